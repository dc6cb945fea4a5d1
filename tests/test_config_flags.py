"""One declaration per search knob: ``SearchConfig``'s field (default + help) is the only one.

Every command that takes search settings (``cli.train``'s ``--search.*``, ``cli.eval``'s and ``cli.prepare_data``'s
``--max_turns`` style) gets its flags from ``env.config.add_search_config_arguments``; the papers' eval settings are
overrides of SearchConfig (``PaperEvalSetting.search``), and ``EvalSettings`` holds a SearchConfig.

Mutations caught: a hand-written ``add_argument("--max_turns", default=4)`` (or ``--search.topk``,
``--max_new_tokens``, ``--no_chat_template``) anywhere in the package (the AST scan); a generated flag whose default
is not None or the field's own (the parse of each command with no flags); a search field copied into
``EvalSettings`` or ``PaperEvalSetting`` under its name or an alias; an eval flag that no longer overrides the paper
value, or an unset one that no longer falls back to it.
"""

import argparse
import ast
import dataclasses
import os

import pytest

from openrlhf_search.env.config import (FLAT_FLAG_NAMES, ConfigError, SearchConfig, add_search_config_arguments,
                                        field_default, search_config_from_args)

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
FIELDS = [f.name for f in dataclasses.fields(SearchConfig)]
#: the other names a search setting goes by on a command line or in an old settings object
ALIASES = {**{flat: name for name, flat in FLAT_FLAG_NAMES.items()}, "chat": "chat_template",
           "max_new_tokens": "max_new_tokens_per_turn", "retriever_url": "retriever_urls"}

#: add_argument calls of a search field's name that declare something else, path relative to openrlhf_search/ (the
#: scan covers the library; the CPU demo, cpu_demo/, passes its own small settings explicitly)
ALLOWED = {
    # the protocol whose chat template is checked (chat_tools protocols only), not a search run's protocol
    ("cli/check_template.py", "--protocol"),
}


def search_field_of_flag(flag: str):
    """The SearchConfig field a flag spells (``--search.topk``, ``--max_new_tokens``, ``--no_chat_template``), or
    None."""
    name = flag.lstrip("-")
    name = name[len("search."):] if name.startswith("search.") else name
    for candidate in (name, name[3:] if name.startswith("no_") else None):
        if candidate in FIELDS:
            return candidate
        if candidate in ALIASES:
            return ALIASES[candidate]
    return None


def hand_declared_search_flags(source: str):
    """``(line, flag)`` of every ``add_argument`` call in ``source`` whose literal flag names a search setting."""
    found = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Call) and getattr(node.func, "attr", None) == "add_argument":
            for arg in node.args:
                if isinstance(arg, ast.Constant) and isinstance(arg.value, str) and search_field_of_flag(arg.value):
                    found.append((node.lineno, arg.value))
    return found


def test_no_command_declares_a_search_setting_by_hand():
    package = os.path.join(REPO, "openrlhf_search")
    bad = []
    for root, _, files in os.walk(package):
        for name in files:
            if name.endswith(".py"):
                path = os.path.join(root, name)
                rel = os.path.relpath(path, package).replace(os.sep, "/")
                with open(path, encoding="utf-8") as f:
                    bad += [f"{rel}:{line} {flag}" for line, flag in hand_declared_search_flags(f.read())
                            if (rel, flag) not in ALLOWED]
    assert not bad, "declare search flags with env.config.add_search_config_arguments: " + ", ".join(bad)


def test_the_scan_finds_a_planted_second_declaration():
    planted = ('p.add_argument("--max_turns", type=int, default=4)\n'
               'g.add_argument("--search.topk", type=int, default=5)\n'
               'g.add_argument("--max_new_tokens", type=int, default=256)\n'
               'c.add_argument("--no_chat_template", dest="chat", action="store_false")\n'
               'p.add_argument("--temperature", type=float, default=1.0)\n')
    assert [flag for _, flag in hand_declared_search_flags(planted)] == [
        "--max_turns", "--search.topk", "--max_new_tokens", "--no_chat_template"]


# ------------------------------------------------------------------------ every command parsed with no search flag
def second_defaults(parser: argparse.ArgumentParser):
    """``{flag: default}`` of the parser's search flags whose default is neither None (unset) nor the field's."""
    out = {}
    for action in parser._actions:
        for flag in action.option_strings:
            name = search_field_of_flag(flag)
            if name and action.default is not None and flag.lstrip("-").split(".")[-1][:3] != "no_" \
                    and action.default != field_default(name):
                out[flag] = action.default
    return out


def _commands():
    from openrlhf_search.cli import eval as eval_cli
    from openrlhf_search.cli import prepare_data

    return {"cli.eval": (eval_cli.build_parser(), ["--model", "tiny"], "--", FLAT_FLAG_NAMES),
            "cli.prepare_data": (prepare_data.build_parser(), ["--input", "x", "--out", "y"], "--", FLAT_FLAG_NAMES)}


@pytest.mark.parametrize("command", ["cli.eval", "cli.prepare_data"])
def test_each_command_parsed_with_no_flag_gives_searchconfigs_defaults(command):
    parser, argv, prefix, names = _commands()[command]
    assert second_defaults(parser) == {}
    args = parser.parse_args(argv)
    assert search_config_from_args(args, prefix=prefix, names=names) == SearchConfig()
    # and each flag given reaches its field
    args = parser.parse_args(argv + ["--max_turns", "3", "--max_new_tokens", "77"])
    cfg = search_config_from_args(args, prefix=prefix, names=names)
    assert (cfg.max_turns, cfg.max_new_tokens_per_turn) == (3, 77)


def test_train_parser_gives_searchconfigs_defaults():
    from openrlhf_search.cli import train

    parser = train.build_parser()
    assert second_defaults(parser) == {}
    flags = {o for a in parser._actions for o in a.option_strings}
    assert {f"--search.{name}" for name in FIELDS} <= flags
    args = parser.parse_args([])
    assert search_config_from_args(args) == SearchConfig()
    args = parser.parse_args(["--search.max_turns", "3", "--search.retriever_urls", "http://a:1, http://b:2",
                              "--search.chat_template", "false"])
    cfg = search_config_from_args(args)
    assert (cfg.max_turns, cfg.retriever_urls, cfg.chat_template) == (3, ["http://a:1", "http://b:2"], False)


def test_a_planted_second_default_is_found():
    p = argparse.ArgumentParser()
    add_search_config_arguments(p, prefix="--", only=["topk"], field_defaults=True)
    p.add_argument("--max_turns", type=int, default=4)
    assert second_defaults(p) == {"--max_turns": 4}
    p = argparse.ArgumentParser()
    add_search_config_arguments(p, prefix="--", only=["max_turns", "chat_template"], switches=True,
                                field_defaults=True)
    assert second_defaults(p) == {}


def test_generated_flags_follow_the_field():
    p = argparse.ArgumentParser()
    dests = add_search_config_arguments(p, prefix="--", only=["max_new_tokens_per_turn", "chat_template"],
                                        names=FLAT_FLAG_NAMES, switches=True)
    assert dests == {"max_new_tokens_per_turn": "max_new_tokens", "chat_template": "chat_template"}
    assert p.parse_args([]).max_new_tokens is None  # unset: the base's value
    assert p.parse_args(["--no_chat_template"]).chat_template is False
    base = SearchConfig(max_new_tokens_per_turn=512, topk=5)
    cfg = search_config_from_args(p.parse_args(["--chat_template"]), prefix="--", names=FLAT_FLAG_NAMES, base=base)
    assert (cfg.max_new_tokens_per_turn, cfg.topk, cfg.chat_template) == (512, 5, True)
    with pytest.raises(ConfigError, match="max_new_tokens_per_turn"):
        search_config_from_args(p.parse_args(["--max_new_tokens", "0"]), prefix="--", names=FLAT_FLAG_NAMES)
    with pytest.raises(KeyError, match="max_tokens"):
        add_search_config_arguments(argparse.ArgumentParser(), only=["max_tokens"])
    with pytest.raises(SystemExit):
        p.parse_args(["--chat_template", "--no_chat_template"])


# ------------------------------------------------------------------------ eval settings hold a SearchConfig
def copied_search_fields(cls):
    """The dataclass fields of ``cls`` that copy a search setting (by its name or an alias)."""
    return sorted(f.name for f in dataclasses.fields(cls) if f.name in FIELDS or f.name in ALIASES)


def test_eval_settings_hold_a_searchconfig_and_copy_none_of_its_fields():
    from openrlhf_search.evaluation.runner import EvalSettings
    from openrlhf_search.evaluation.settings import SETTINGS, PaperEvalSetting

    assert copied_search_fields(EvalSettings) == [] and copied_search_fields(PaperEvalSetting) == []
    assert EvalSettings().search == SearchConfig()

    @dataclasses.dataclass
    class Planted:
        search: SearchConfig
        max_turns: int = 4
        retriever_url: str = ""

    assert copied_search_fields(Planted) == ["max_turns", "retriever_url"]
    for key, setting in SETTINGS.items():  # the papers' values are overrides of SearchConfig's fields
        assert set(setting.search) <= set(FIELDS), key
        assert setting.search_config().protocol == key[0]


def test_eval_flags_override_the_paper_setting_and_unset_ones_keep_it():
    from openrlhf_search.cli import eval as eval_cli
    from openrlhf_search.evaluation.settings import eval_setting

    def resolved(protocol, *flags, paper=True):
        args = eval_cli.build_parser().parse_args(["--model", "tiny", "--protocol", protocol, *flags])
        setting = eval_setting(protocol, "released") if paper else None
        return eval_cli.run_settings(args, ["bamboogle"], setting)["bamboogle"].search

    cfg = resolved("r1searcher")
    assert (cfg.max_turns, cfg.topk, cfg.max_new_tokens_per_turn, cfg.chat_template) == (9, 5, 512, False)
    assert cfg.reward_scheme == "r1searcher_stage2"
    cfg = resolved("r1searcher", "--max_turns", "3", "--topk", "2", "--chat_template", "--template", "train")
    assert (cfg.max_turns, cfg.topk, cfg.chat_template) == (3, 2, True)
    cfg = resolved("searchr1")
    assert (cfg.max_turns, cfg.obs_cut, cfg.reward_scheme) == (5, "block", "searchr1_em")
    cfg = resolved("chat_tools", paper=False)  # no paper setting: SearchConfig's own defaults
    assert cfg == SearchConfig(protocol="chat_tools", reward_scheme="searchr1_em")
