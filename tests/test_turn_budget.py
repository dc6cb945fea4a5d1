"""The per-turn token budget of a thinking policy: the dry run names it, and a step whose turns mostly end on it
logs a warning (``search/turn_cut_rate`` from the executor's per-turn ``turns_cut`` count)."""

import torch
from openrlhf.trainer.ppo_utils.experience_maker import Experience

from openrlhf_search.cli import train as cli
from openrlhf_search.rl.experience_maker import search_rollout_stats, turn_cut_warning
from tests.test_launchers import _argv


def _experience(turns, cut):
    n = len(turns)
    exp = Experience(sequences=torch.zeros(n, 4, dtype=torch.long))
    exp.info = {"turns": torch.tensor(turns, dtype=torch.float), "turns_cut": torch.tensor(cut, dtype=torch.float),
                "retrieval_failed": torch.zeros(n)}
    return exp


def test_turn_cut_rate_is_over_turns_and_warns_above_half():
    stats = search_rollout_stats([_experience([4, 2], [3, 0]), _experience([2], [1])])
    assert stats["search/turn_cut_rate"] == 4 / 8
    assert turn_cut_warning(stats, 1024) is None  # half: no warning
    stats = search_rollout_stats([_experience([4, 2], [4, 1])])
    warn = turn_cut_warning(stats, 1024)
    assert stats["search/turn_cut_rate"] == 5 / 6 and warn.startswith("83% of this step's turns")
    assert "--search.max_new_tokens_per_turn 1024" in warn and "THINKING=0" in warn


def test_the_dry_run_names_the_turn_budget_and_whether_the_policy_thinks_in_it():
    _, think = cli.parse_args(_argv("chat_tools_grpo_qwen3-8b.sh"))
    line = cli.turn_budget_line(think)
    assert line.startswith(f"turn budget: {think.max_new_tokens_per_turn} new tokens per turn")
    assert "thinking on" in line
    _, nothink = cli.parse_args(_argv("chat_tools_grpo_qwen3-8b.sh", THINKING="0"))
    assert "thinking" not in cli.turn_budget_line(nothink)
    _, searchr1 = cli.parse_args(_argv("searchr1_grpo_qwen2.5-3b_base.sh"))
    assert "thinking" not in cli.turn_budget_line(searchr1)
