"""The overlong penalty of a multi-turn trajectory is measured against the trajectory's budget, max_turns x the
per-turn budget (openrlhf_search/env/length_penalty.py)."""

import pytest

from openrlhf_search.env.config import ConfigError
from openrlhf_search.rl.experience_maker import SearchExperienceMaker
from openrlhf_search.env.length_penalty import args_with_overlong_budget, check_overlong_args, overlong_budget
from tests.test_cluster_wiring import _maker, _parse
from tests.test_rl_core import _generator, _response

# searchr1.sh's budgets: --rollout.max_new_tokens 500 is the per-turn budget, 5 turns of at most 500 tokens
FLAGS = ["--reward.overlong_buffer_len", "100", "--rollout.max_new_tokens", "500",
         "--search.max_turns", "5", "--search.max_new_tokens_per_turn", "500"]
CLUSTER = FLAGS + ["--algo.advantage.estimator", "reinforce", "--rollout.n_samples_per_prompt", "1",
                   "--algo.kl.init_coef", "0"]
# (turn lengths, reward after the penalty): L_max = 5 x 500 = 2500, the penalty starts above 2500 - 100 = 2400
CASES = [((200, 200, 200), 1.0),          # 600 sampled tokens: 0.0 if measured against the 500 per-turn budget
         ((490,) * 5, 0.5),               # 2450: -(2450 - 2400) / 100
         ((500,) * 5, 0.0),               # 2500: the whole buffer, -1
         ((480,) * 5, 1.0)]               # 2400: exactly at the start of the buffer, no penalty


def _cluster_reward(turns, reward=1.0):
    args, _ = _parse(*CLUSTER)
    exp = _generator(args)._process_response_into_experience(
        _response(turns=turns, doc_len=300, reward=reward), max_len=16384)
    exp.index = [0]
    out = _maker(args, SearchExperienceMaker).compute_advantages_and_returns([exp])[0]
    assert out.response_length.tolist() == [sum(turns)]  # documents blocks never count
    return out.info["reward"].item()


@pytest.mark.parametrize("turns,expected", CASES)
def test_cluster_path_measures_the_trajectory_budget(turns, expected):
    """Mutations caught: the per-turn budget (1.0 -> 0.0 at three turns of 200), no penalty at all (the
    490 x 5 case stays 1.0 instead of 0.5), a budget off by one turn (2000 or 3000)."""
    assert _cluster_reward(turns) == pytest.approx(expected, abs=1e-6)


def test_budget_and_bad_buffers():
    assert overlong_budget(5, 500) == 2500
    args, _ = _parse(*CLUSTER)
    view = args_with_overlong_budget(args)
    assert view.rollout.max_new_tokens == 2500 and args.rollout.max_new_tokens == 500  # args itself untouched
    default_turns, _ = _parse("--reward.overlong_buffer_len", "100")  # SearchConfig defaults: 8 x 500
    assert args_with_overlong_budget(default_turns).rollout.max_new_tokens == 4000
    with pytest.raises(ConfigError, match="overlong_buffer_len 3000"):  # the cluster CLI refuses it up front
        _parse(*CLUSTER[:1], "3000", *CLUSTER[2:])
    args.reward.overlong_buffer_len = 0
    with pytest.raises(ValueError, match=r"must be in \(0, 2500\]"):
        check_overlong_args(args)
