"""RL-core faults of issue 10 (items 2-5, 7): trajectory length, empty action masks, failed samples in group
statistics and dynamic filtering, the reward-stage switch, and mutation-catching tests for the KL penalty,
reward-to-go with gamma < 1 and the pairing of shaped rewards with trajectories in the CPU trainer."""

from types import SimpleNamespace

import pytest
import torch

import openrlhf_search._cpu_compat  # noqa: F401
from openrlhf.trainer.ppo_utils.experience import Experience
from openrlhf.trainer.ppo_utils.experience_maker import RemoteExperienceMaker
from openrlhf.trainer.ppo_utils.samples_generator import SamplesGenerator

from openrlhf_search.experience_maker import (
    SearchExperienceMaker,
    SearchSamplesGenerator,
    group_has_signal,
    valid_rollout_stats,
)
from openrlhf_search.reward_schedule import RewardSchedule
from tests.test_cluster_wiring import _maker, _parse


def _generator(args):
    return SearchSamplesGenerator(strategy=SimpleNamespace(args=args), prompts_dataloader=None,
                                  eval_dataloader=None, tokenizer=None, vllm_engines=[])


def _response(prompt_len=10, turns=(35, 35), doc_len=500, reward=1.0, score=1.0, truncated=False, logs=None):
    """An executor dict: prompt, then model turns separated by documents blocks of ``doc_len`` tokens."""
    tokens, ranges = list(range(1, prompt_len + 1)), []
    for i, n in enumerate(turns):
        if i:
            tokens += [7] * doc_len
        ranges.append((len(tokens), len(tokens) + n))
        tokens += [5] * n
    return {"prompt": "p", "label": "a", "observation_tokens": tokens, "action_ranges": ranges,
            "rollout_log_probs": None, "reward": reward, "scores": score, "truncated": truncated,
            "extra_logs": dict(logs or {})}


# ------------------------------------------------------------------------------ item 2: trajectory length
def test_length_is_the_sampled_tokens_and_the_overlong_penalty_spares_documents():
    args, _ = _parse("--algo.advantage.estimator", "reinforce", "--rollout.n_samples_per_prompt", "1",
                     "--reward.overlong_buffer_len", "100", "--rollout.max_new_tokens", "170",
                     "--algo.kl.init_coef", "0")
    resp = _response()  # 70 sampled tokens around one 500-token documents block
    ours = _generator(args)._process_response_into_experience(resp, max_len=4096)
    theirs = SamplesGenerator._process_response_into_experience(_generator(args), resp, max_len=4096)
    assert ours.response_length.tolist() == [70]
    assert theirs.response_length.tolist() == [570]  # OpenRLHF 0.11.2: first to last action token
    maker = _maker(args, SearchExperienceMaker)
    for exp in (ours, theirs):
        exp.index = [0]
    # budget 170 - buffer 100 = 70: the 70 sampled tokens are not over it; 570 would take the whole 1.0 away
    out = maker.compute_advantages_and_returns([ours])[0]
    assert out.info["reward"].tolist() == [1.0] and out.rewards.tolist() == [1.0]
    assert maker.compute_advantages_and_returns([theirs])[0].info["reward"].tolist() == [0.0]


def test_make_experience_batch_measures_length_on_the_action_mask(monkeypatch):
    """Samples from OpenRLHF's own generator (span length) are re-measured before anything reads the length."""
    args, _ = _parse("--algo.advantage.estimator", "reinforce", "--rollout.n_samples_per_prompt", "1")
    sample = SamplesGenerator._process_response_into_experience(_generator(args), _response(), max_len=4096)
    assert sample.response_length.tolist() == [570]
    monkeypatch.setattr(RemoteExperienceMaker, "make_experience_batch", lambda self, samples: samples)
    out = _maker(args, SearchExperienceMaker).make_experience_batch([sample])
    assert out[0].response_length.tolist() == [70]


def test_stop_properly_penalty_only_sees_length_cuts():
    args, _ = _parse("--algo.advantage.estimator", "reinforce", "--rollout.n_samples_per_prompt", "1",
                     "--reward.stop_properly_penalty_coef", "0", "--algo.kl.init_coef", "0")
    gen = _generator(args)
    full = gen._process_response_into_experience(_response(logs={"context_full": 1.0}), max_len=4096)
    cut = gen._process_response_into_experience(_response(truncated=True), max_len=4096)
    full.index, cut.index = [0], [0]
    maker = _maker(args, SearchExperienceMaker)
    assert maker.compute_advantages_and_returns([full])[0].info["reward"].tolist() == [1.0]
    assert maker.compute_advantages_and_returns([cut])[0].info["reward"].tolist() == [0.0]


# ------------------------------------------------------------------------------ item 4: failed samples
def _sample(reward, failed=False, score=0.0, length=10):
    return Experience(action_mask=torch.ones(1, length, dtype=torch.bool), rewards=torch.tensor([reward]),
                      scores=torch.tensor([score]), response_length=torch.tensor([length]),
                      truncated=torch.tensor([False]), prompts=["p"],
                      info={"reward": torch.tensor([reward]), "retrieval_failed": torch.tensor([float(failed)])})


def test_rollout_stats_leave_failed_samples_out():
    from openrlhf_search.trainer import _SearchPPOTrainer

    exps = [_sample(1.0, length=10), _sample(0.0, failed=True, length=900), _sample(0.5, length=20)]
    stats = valid_rollout_stats(exps)
    assert stats["rollout/reward_mean"] == pytest.approx(0.75)
    assert stats["rollout/response_length_mean"] == pytest.approx(15.0)
    assert stats["rollout/num_samples"] == 2.0
    trainer = object.__new__(_SearchPPOTrainer)  # the trainer's hook, on the parent's stats
    logged = trainer._compute_rollout_stats(exps)
    assert logged["rollout/reward_mean"] == pytest.approx(0.75) and logged["search/num_trained_samples"] == 2


def test_group_filter_reads_training_reward_spread_of_valid_samples():
    # stage 1: every answer wrong (score 0) but the retrieval/format reward varies -> the group carries signal
    assert group_has_signal([_sample(r, score=0.0) for r in (0.5, 0.5, 1.0, 1.0)])
    # the valid samples agree; only the failed one differs -> no signal
    assert not group_has_signal([_sample(1.0), _sample(1.0), _sample(1.0), _sample(0.0, failed=True)])
    assert not group_has_signal([_sample(1.0), _sample(0.0, failed=True)])   # one valid sample
    assert not group_has_signal([_sample(0.3)] * 4)


def test_dynamic_filtering_replaces_groups_without_spread(monkeypatch):
    args, _ = _parse("--algo.advantage.estimator", "group_norm", "--rollout.n_samples_per_prompt", "4",
                     "--algo.dynamic_filtering_enable")
    groups = [
        [_sample(r, score=0.0) for r in (0.5, 0.5, 1.0, 1.0)],                              # kept (signal)
        [_sample(1.0, score=1.0)] * 3 + [_sample(0.0, failed=True)],                         # dropped
        [_sample(r, score=r) for r in (0.0, 1.0, 0.0, 0.0)],                                 # kept (replacement)
    ]
    calls = []

    def fake_parent(self, dataloader_iter, num_prompts, dynamic_filtering, **kw):
        assert dynamic_filtering is False  # the parent's own filter (answer score) is never used
        calls.append(num_prompts)
        out = [e for g in groups[:num_prompts] for e in g]
        del groups[:num_prompts]
        return out, num_prompts, not groups

    monkeypatch.setattr(SamplesGenerator, "_generate_vllm", fake_parent)
    accepted, consumed, exhausted = _generator(args)._generate_vllm(iter(()), 2, True, n_samples_per_prompt=4)
    assert calls == [2, 1] and consumed == 3 and exhausted
    assert [float(e.rewards[0]) for e in accepted] == [0.5, 0.5, 1.0, 1.0, 0.0, 1.0, 0.0, 0.0]


# ------------------------------------------------------------------------------ item 5: stage switch
def test_samples_buffered_under_stage_1_are_dropped_when_stage_2_starts():
    from openrlhf_search.trainer import _SearchPPOTrainer

    args, _ = _parse("--algo.advantage.estimator", "reinforce", "--rollout.n_samples_per_prompt", "1")
    gen = _generator(args)
    gen._sample_buffer = [_sample(1.0) for _ in range(3)]
    gen._dataloader_iter = None  # the prompts are all generated; only the buffer is left
    trainer = object.__new__(_SearchPPOTrainer)
    trainer.reward_schedule = RewardSchedule("r1searcher_stage1", "r1searcher_stage2", 2)
    trainer.active_reward_scheme, trainer.vllm_engines, trainer.samples_generator = None, [], gen
    assert trainer.apply_reward_scheme(0) == "r1searcher_stage1" and len(gen._sample_buffer) == 3
    assert trainer.apply_reward_scheme(1) == "r1searcher_stage1" and len(gen._sample_buffer) == 3
    assert trainer.apply_reward_scheme(2) == "r1searcher_stage2" and gen._sample_buffer == []
    # the episode ends instead of training on stage-1 rewards or restarting the data
    assert gen.generate_samples() == ([], None, 0, True)
