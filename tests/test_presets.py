"""The named flag sets of ``main_job.train --preset``: what the main job runs is what docs/cpu_job.md and
docs/trials_em.md say.

The default was chosen on the validation split (docs/trials_em.md, trial T2c) and its held-out figures (README,
docs/cpu_job.md) are runs of the former default plus seven flags; ``f1_sentences`` is the former default, with which
one of docs/cpu_job.md's ablation tables and its "The earlier default" table were measured. These tests catch a preset
that loses one of those flags (the figures would then belong to another job), or an ``f1_sentences`` that drifts
from ``default`` in more than the seven settings.
"""

from openrlhf_search.cpu.main_job.args import PRESETS, parse_args

# trial T2c's flags (docs/trials_em.md) and the former default's values of the same settings
T2C = {"search.protocol": "searchr1_bare", "search.reward_scheme": "searchr1_em",
       "search.max_new_tokens_per_turn": 48, "warmstart.self_prompt": "bare", "warmstart.self_form": "think_span",
       "actor.adam.lr": 1e-4, "train.max_steps": 30}  # lr: trial T5's rule, steps: trial T7's (docs/trials_em.md)
FORMER = {"search.protocol": "searchr1_short", "search.reward_scheme": "r1searcher_stage2",
          "search.max_new_tokens_per_turn": 32, "warmstart.self_prompt": "few_words", "warmstart.self_form": "sentence",
          "actor.adam.lr": 2e-4, "train.max_steps": 20}


def _flat(obj, prefix="") -> dict:
    """Parsed main_job.train args -> {"group.sub.field": value}: namespaces and dataclasses (SearchConfig,
    RewardSchedule) flattened recursively; every other value a leaf."""
    fields = vars(obj) if hasattr(obj, "__dict__") and not isinstance(obj, (str, int, float, list, tuple)) else None
    if fields is None:
        return {prefix[:-1]: obj}
    out = {}
    for k, v in fields.items():
        out.update(_flat(v, f"{prefix}{k}."))
    return out


def _get(flat: dict, key: str):
    assert key in flat, f"{key} not in the parsed args"
    return flat[key]


def test_default_preset_is_the_exact_answer_setting_chosen_on_validation():
    flat = _flat(parse_args(["--preset", "default"]))
    for key, want in T2C.items():
        assert _get(flat, key) == want, key
    assert _get(flat, "warmstart.answers") == "self"  # no gold answer in the warm start


def test_f1_sentences_is_the_former_default_and_differs_in_those_settings_only():
    new, old = _flat(parse_args(["--preset", "default"])), _flat(parse_args(["--preset", "f1_sentences"]))
    for key, want in FORMER.items():
        assert _get(old, key) == want, key
    # every parsed value that differs is one of the seven settings (also where SearchConfig / RewardSchedule copy it)
    differ = {k for k in new if k != "preset" and new[k] != old.get(k)}
    settings = {k.split(".")[-1] for k in T2C} | {"stage1_scheme"}  # RewardSchedule's name for the reward scheme
    assert differ and all(k.split(".")[-1] in settings for k in differ), sorted(differ)
    assert all(key in differ for key in T2C), sorted(differ)


def test_user_flags_win_over_a_preset():
    args = _flat(parse_args(["--preset", "default", "--search.reward_scheme", "r1searcher_stage2"]))
    assert _get(args, "search.reward_scheme") == "r1searcher_stage2"
    assert set(PRESETS) == {"default", "f1_sentences", "tiny"}


def test_the_last_preset_wins_in_either_spelling():
    """run_default.sh passes ``--preset default`` and its header offers ``--preset tiny`` as an extra flag: the second
    must take effect (it was ignored: args.preset said tiny while the flags were the default's), as must
    ``--preset=NAME``, which argparse accepts."""
    import pytest

    for argv in (["--preset", "default", "--preset", "tiny"], ["--preset=tiny"],
                 ["--preset", "default", "--preset=tiny"]):
        args = parse_args(argv)
        assert args.preset == "tiny" and args.actor.model_name_or_path == "tiny", argv
    assert parse_args(["--preset=tiny", "--preset", "default"]).actor.model_name_or_path == "smollm2"
    for bad in (["--preset", "default", "--preset", "nope"], ["--preset=nope"], ["--preset"]):
        with pytest.raises(SystemExit):
            parse_args(bad)


def test_benchmarks_offer_every_preset_and_nothing_else():
    """bench_train_local / bench_ablation / bench_multihop refuse an unknown --preset at once (it used to fail in
    the child job, after the data, index and retriever were set up): their choices must follow PRESETS."""
    import os
    import re

    from tests.conftest import REPO_ROOT

    for name in ("bench_train_local.py", "bench_ablation.py", "bench_multihop.py"):
        src = open(os.path.join(REPO_ROOT, "benchmarks", name)).read()
        m = re.search(r'add_argument\("--preset", default="default", choices=(\[[^\]]*\])', src)
        assert m, name
        assert sorted(eval(m.group(1))) == sorted(PRESETS), name  # a literal list of our own source
