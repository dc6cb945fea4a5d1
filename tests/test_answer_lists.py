"""Answers that list the gold among other candidates (a policy can learn to list: Cover-EM, and R1-Searcher's released
stage-1 reward built on it, score "Lyon, Nice, Paris, ..." like "Paris"). The released scheme stays as released; the
share of listing answers is logged (``rollout/answer_list_rate``) and the paper schemes' answer-length rule
(``answer_max_words``) applies to the Cover-EM they score with."""

import pytest
import torch

from openrlhf_search.env.rewards import answer_candidates, compute_reward
from tests.test_released_rewards import _traj

TEN_CITIES = "Lyon, Nice, Marseille, Toulouse, Lille, Nantes, Rennes, Le Havre, Saint-Etienne, Paris"


@pytest.mark.parametrize("answer,n", [
    ("Paris", 1), ("the city of Paris", 1), ("Simon and Garfunkel", 1), ("1,000", 1), ("", 0),
    ("Paris, Lyon or Nice", 3), ("Paris; Lyon", 2), ("Paris / Lyon", 2), (TEN_CITIES, 10),
])
def test_answer_candidates(answer, n):
    assert answer_candidates(answer) == n


def test_released_stage1_unchanged_and_list_flagged():
    bare = compute_reward("r1searcher_released_stage1", _traj("Paris"), ["Paris"], "r1searcher")
    listed = compute_reward("r1searcher_released_stage1", _traj(TEN_CITIES), ["Paris"], "r1searcher")
    assert bare.reward == listed.reward == pytest.approx(2.0)  # as released: the list is paid in full
    assert bare.components["answer_list"] == 0.0 and listed.components["answer_list"] == 1.0
    assert listed.components["cover_em"] == 1.0  # plain Cover-EM (evaluation) is unchanged too


def test_paper_stage1_scores_cover_em_under_answer_max_words():
    """11 words > 10: the paper scheme's format rule fails, and its Cover-EM score is 0 (was 1.0)."""
    listed = compute_reward("r1searcher_stage1", _traj(TEN_CITIES), ["Paris"], "r1searcher")
    assert len(TEN_CITIES.split()) == 11
    assert listed.components["format_ok"] == 0.0
    assert listed.components["cover_em"] == 1.0 and listed.components["cover_em_capped"] == 0.0
    assert listed.score == 0.0
    bare = compute_reward("r1searcher_stage1", _traj("the city of Paris"), ["Paris"], "r1searcher")
    assert bare.score == 1.0  # within the cap: covered
    wider = compute_reward("r1searcher_stage1", _traj(TEN_CITIES), ["Paris"], "r1searcher", answer_max_words=20)
    assert wider.score == 1.0


def test_rollout_answer_list_rate_over_trained_samples():
    from types import SimpleNamespace

    from openrlhf_search.rl.trainer import answer_list_stats

    e1 = SimpleNamespace(info={"answer_list": torch.tensor([1.0, 0.0, 1.0]),
                               "retrieval_failed": torch.tensor([0.0, 0.0, 1.0])},
                         action_mask=None, sequences=torch.zeros(3, 4), prompts=[""] * 3)
    e2 = SimpleNamespace(info={"answer_list": torch.tensor([0.0])}, action_mask=None, sequences=torch.zeros(1, 4),
                         prompts=[""])
    # the failed sample (third of e1) is not trained on: 1 listing answer of 3
    assert answer_list_stats([e1, e2]) == {"rollout/answer_list_rate": pytest.approx(1 / 3)}
    assert answer_list_stats([SimpleNamespace(info={}, action_mask=None, sequences=None, prompts=[""])]) == {}
