"""A mistyped or pre-0.10 OpenRLHF flag is answered with the flag that replaced it."""

import pytest

from openrlhf_search.cli import train as cli
from openrlhf_search.cli import train_args
from openrlhf_search.cli.train_args import RENAMED_FLAGS, nearest_flags


@pytest.fixture(scope="module")
def parser():
    return cli.build_parser()


@pytest.mark.parametrize("typed, first", [
    ("--actor.learning_rat", "--actor.adam.lr"),  # once: --actor.min_lr_ratio
    ("--learning_rate", "--actor.adam.lr"),
    ("--actor_learning_rate", "--actor.adam.lr"),
    ("--pretrain", "--actor.model_name_or_path"),
    ("--micro_train_batch_size", "--train.micro_batch_size"),
    ("--critic_learning_rate", "--critic.adam.lr"),
    ("--bf16", "--ds.param_dtype"),
    ("--train.batchsize", "--train.batch_size"),
    ("--search.top_k", "--search.topk"),
])
def test_nearest_flag_first(parser, typed, first):
    assert nearest_flags(parser, typed)[0] == first


def test_every_renamed_flag_exists(parser):
    flags = {o for a in parser._actions for o in a.option_strings}
    missing = sorted(v for v in RENAMED_FLAGS.values() if v not in flags)
    assert not missing  # a table entry OpenRLHF dropped would silently never be suggested


@pytest.mark.parametrize("old", sorted(RENAMED_FLAGS))
def test_every_old_flag_is_answered_with_its_new_name_first(parser, old):
    assert nearest_flags(parser, "--" + old)[0] == RENAMED_FLAGS[old]


def test_the_table_holds_only_old_names_the_matcher_cannot_find_alone(parser, monkeypatch):
    """Each entry is needed: without the table the old name is not answered with its new flag first."""
    table = dict(RENAMED_FLAGS)
    monkeypatch.setattr(train_args, "RENAMED_FLAGS", {})
    found_alone = [old for old, new in table.items() if (nearest_flags(parser, "--" + old) or [None])[0] == new]
    assert not found_alone
