"""``--help`` explains every ``--search.*`` and ``--reward.*`` flag of ``cli.train`` in one line: what it sets, its
unit, the papers' value (or that it is not a paper setting) and a default that parses back to the default.

Mutations caught: a field left with the old "SearchConfig.<name> (default ...)" placeholder or no help, a help that
names no paper, a numeric field whose help names no unit, a shown default that is not the field's (the round trip
through the CLI's own parser), an OpenRLHF ``--reward.*`` flag whose help was not replaced, a multi-line help.
"""

import argparse
import dataclasses
import re

import pytest

from openrlhf_search.cli import train as cluster_cli
from openrlhf_search.env.config import REWARD_FLAG_HELP, SearchConfig, flag_help

PAPER = re.compile(r"paper|Search-R1|R1-Searcher")
UNITS = re.compile(r"\b(tokens?|passages?|seconds|milliseconds|characters|words|calls|retries|queries|step count|"
                   r"fraction|reward units)\b")
FIELDS = {f.name: f for f in dataclasses.fields(SearchConfig)}


@pytest.fixture(scope="module")
def parsers():
    return {"cluster": cluster_cli.build_parser()}


def _flags(parser: argparse.ArgumentParser, prefixes=("--search.", "--reward.")):
    return {o: a for a in parser._actions for o in a.option_strings if o.startswith(prefixes)}


@pytest.mark.parametrize("cli", ["cluster"])
def test_every_search_and_reward_flag_has_one_line_with_the_papers_value(parsers, cli):
    flags = _flags(parsers[cli])
    assert len([f for f in flags if f.startswith("--search.")]) >= len(FIELDS)
    assert any(f.startswith("--reward.") for f in flags)
    bad = {f: a.help for f, a in flags.items()
           if not a.help or "\n" in a.help or a.help.startswith("SearchConfig.") or not PAPER.search(a.help)}
    assert not bad, bad


@pytest.mark.parametrize("cli", ["cluster"])
def test_search_field_flags_show_the_field_help_with_a_unit_for_numbers(parsers, cli):
    flags = _flags(parsers[cli], ("--search.",))
    for name, f in FIELDS.items():
        assert flags[f"--search.{name}"].help == flag_help(name)
        if f.type in (int, float, "int", "float") or name in ("max_obs_tokens",):
            assert UNITS.search(f.metadata["help"]), name


@pytest.mark.parametrize("cli", ["cluster"])
def test_the_default_shown_parses_back_to_the_fields_default(parsers, cli):
    def parse(flag, value):
        return cluster_cli.parse_args(["--actor.model_name_or_path", "Qwen/Qwen2.5-7B",
                                       "--data.prompt_dataset", "train.jsonl", flag, value])[1]
    for name, f in FIELDS.items():
        shown = re.search(r"\(default (.*)\)$", flag_help(name)).group(1)
        if shown in ("''", "auto"):  # "no value": the flag is not given
            continue
        default = f.default if f.default is not dataclasses.MISSING else f.default_factory()
        assert getattr(parse(f"--search.{name}", shown), name) == default, (name, shown)


def test_openrlhf_reward_flags_get_the_search_paths_help(parsers):
    flags = _flags(parsers["cluster"], ("--reward.",))
    assert set(REWARD_FLAG_HELP) <= set(flags), set(REWARD_FLAG_HELP) - set(flags)
    for flag, text in REWARD_FLAG_HELP.items():
        assert flags[flag].help == text
    # the overlong pair keeps its own text (openrlhf_search.env.length_penalty), in trajectory tokens
    assert "--search.max_turns" in flags["--reward.overlong_buffer_len"].help


def test_flag_help_names_an_unknown_field():
    with pytest.raises(KeyError, match="no field 'nope'"):
        flag_help("nope")
    assert flag_help("stop_at_answer").endswith("(default true)")
    assert flag_help("retriever_urls").endswith("(default http://127.0.0.1:8000)")
