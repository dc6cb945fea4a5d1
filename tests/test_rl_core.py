"""RL-core behaviour: trajectory length, empty action masks, failed samples in group
statistics and dynamic filtering, the reward-stage switch, and mutation-catching tests for the KL penalty,
reward-to-go with gamma < 1 on the cluster path's experience maker and losses."""

from types import SimpleNamespace

import pytest
import torch

import openrlhf_search._cpu_compat  # noqa: F401
from openrlhf.models.loss import PolicyLoss, aggregate_loss
from openrlhf.trainer.ppo_utils.experience import Experience
from openrlhf.trainer.ppo_utils.experience_maker import RemoteExperienceMaker
from openrlhf.trainer.ppo_utils.samples_generator import SamplesGenerator

from openrlhf_search.rl.experience_maker import (
    SearchExperienceMaker,
    SearchSamplesGenerator,
    group_has_signal,
    valid_rollout_stats,
)
from openrlhf_search.rl.loss import MaskedPolicyLoss, MaskedValueLoss, safe_aggregate_loss, safe_masked_mean
from openrlhf_search.env.reward_schedule import RewardSchedule
from tests.test_cluster_wiring import _maker, _parse
from tests.test_loss import CONFIGS


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


# ------------------------------------------------------------------------------ trajectory length
def test_length_is_the_sampled_tokens_and_the_overlong_penalty_spares_documents():
    args, _ = _parse("--algo.advantage.estimator", "reinforce", "--rollout.n_samples_per_prompt", "1",
                     "--reward.overlong_buffer_len", "100", "--search.max_turns", "2",
                     "--search.max_new_tokens_per_turn", "85",  # trajectory budget 2 x 85 = 170
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


# ------------------------------------------------------------------------------ failed samples
def _sample(reward, failed=False, score=0.0, length=10):
    return Experience(action_mask=torch.ones(1, length, dtype=torch.bool), rewards=torch.tensor([reward]),
                      scores=torch.tensor([score]), response_length=torch.tensor([length]),
                      truncated=torch.tensor([False]), prompts=["p"],
                      info={"reward": torch.tensor([reward]), "retrieval_failed": torch.tensor([float(failed)])})


def test_rollout_stats_leave_failed_samples_out():
    from openrlhf_search.rl.trainer import _SearchPPOTrainer

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


# ------------------------------------------------------------------------------ stage switch
def test_samples_buffered_under_stage_1_are_dropped_when_stage_2_starts():
    from openrlhf_search.rl.trainer import _SearchPPOTrainer

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


# ------------------------------------------------------------------------------ empty action masks

@pytest.mark.parametrize("cfg", CONFIGS, ids=lambda c: ",".join(f"{k}={v}" for k, v in c.items()) or "ppo")
@pytest.mark.parametrize("window_tokens", [None, 0.0])
def test_empty_mask_gives_zero_loss_and_finite_metrics(cfg, window_tokens):
    """micro_batch_size 1: one failed sample is a whole micro-batch (and, window_tokens 0, a whole window)."""
    log_probs = (-torch.rand(1, 6) * 3).requires_grad_(True)
    old = log_probs.detach() + 0.3
    mask = torch.zeros(1, 6, dtype=torch.bool)
    kw = {} if window_tokens is None else {"batch_num_tokens": torch.tensor(window_tokens),
                                           "global_batch_size": torch.tensor(window_tokens)}
    loss, clip_ratio, ppo_kl, vllm_kl, is_filter = MaskedPolicyLoss(**cfg)(
        log_probs, old, torch.ones(1, 6), action_mask=mask, rollout_log_probs=old + 0.1, **kw)
    assert loss.item() == 0.0
    loss.backward()  # a normal backward (DeepSpeed needs a graph), zero gradient
    assert torch.equal(log_probs.grad, torch.zeros_like(log_probs))
    for metric in (clip_ratio, ppo_kl, vllm_kl, is_filter):
        assert metric is None or (torch.isfinite(metric).all() and metric.item() == 0.0)
    # OpenRLHF's own loss gives NaN here: the defect these guards are for
    raw = PolicyLoss(**cfg)(log_probs.detach(), old, torch.ones(1, 6), action_mask=mask,
                            rollout_log_probs=old + 0.1, **kw)
    assert not all(torch.isfinite(t).all() for t in raw if t is not None)
    values = torch.randn(1, 6, requires_grad=True)
    vloss = MaskedValueLoss(clip_eps=0.2)(values, values.detach(), torch.zeros(1, 6), action_mask=mask, **kw)
    vloss.backward()
    assert vloss.item() == 0.0 and torch.equal(values.grad, torch.zeros_like(values))


def test_safe_aggregate_and_mean_equal_openrlhf_on_non_empty_masks():
    gen = torch.Generator().manual_seed(1)
    x = torch.randn(3, 5, generator=gen)
    mask = torch.tensor([[1, 1, 0, 0, 0], [0, 0, 0, 0, 0], [1, 0, 1, 1, 0]], dtype=torch.bool)
    for token_level in (True, False):
        for kw in ({}, {"batch_num_tokens": torch.tensor(6.0), "global_batch_size": torch.tensor(2.0)}):
            assert torch.equal(safe_aggregate_loss(x, mask, token_level_loss=token_level, **kw),
                               aggregate_loss(x, mask, token_level_loss=token_level, **kw))
    torch.testing.assert_close(safe_masked_mean(x, mask), (x * mask).sum() / mask.sum())
    per_row = safe_masked_mean(x, mask, dim=-1)
    assert per_row[1] == 0.0 and per_row[0] == pytest.approx(float(x[0, :2].mean()))
    # KL / entropy terms of a micro-batch without action tokens: 0 with a graph, not NaN
    kl = torch.randn(1, 5, requires_grad=True)
    empty = torch.zeros(1, 5, dtype=torch.bool)
    out = safe_aggregate_loss(kl, empty, batch_num_tokens=torch.tensor(0.0))
    out.backward()
    assert out.item() == 0.0 and torch.equal(kl.grad, torch.zeros_like(kl))
    assert torch.isnan(aggregate_loss(kl.detach(), empty, batch_num_tokens=torch.tensor(0.0)))


class _Strategy:
    """What ActorPPOTrainer.ppo_train / training_step use of DeepSpeedStrategy, on one CPU process."""

    def __init__(self, args, accumulated_gradient):
        self.args, self.accumulated_gradient, self.ring_attn_group = args, accumulated_gradient, None
        self.losses = []

    def is_rank_0(self):
        return True

    def backward(self, loss, model, optim):
        self.losses.append(float(loss))  # a NaN loss would be skipped by DeepSpeed as an overflow
        loss.backward()

    def optimizer_step(self, *a, **k):
        pass

    def get_grad_norm(self, model):
        return 0.0

    def all_reduce(self, data, op="mean"):
        return dict(data)


def _actor_ppo_train(monkeypatch, empties, safe):
    """OpenRLHF's real ActorPPOTrainer.ppo_train (micro_batch_size 1, 2 micro-batches per optimizer step, KL loss
    and entropy on) over samples whose action mask is empty where ``empties`` says so."""
    import sys

    import openrlhf.models.actor as actor_module
    import openrlhf.trainer.ray.ppo_actor as ppo_actor
    from openrlhf.models import Actor
    from openrlhf.trainer.ppo_utils import NaiveReplayBuffer

    from cpu_demo.offline_assets import build_tiny_qwen2, load_qwen_tokenizer
    from openrlhf_search.rl.loss import install_into_openrlhf

    for name in ("PolicyLoss", "aggregate_loss", "masked_mean", "ActorPPOTrainer"):
        monkeypatch.setattr(ppo_actor, name, getattr(ppo_actor, name))  # restored after the test
    if safe:
        install_into_openrlhf()
    monkeypatch.setitem(sys.modules, "flash_attn.ops.triton.cross_entropy", None)  # CPU: torch log-softmax path
    monkeypatch.setattr(actor_module, "compute_entropy", getattr(actor_module.compute_entropy, "__wrapped__",
                                                                    actor_module.compute_entropy))  # no compile
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    args, _ = _parse("--algo.advantage.estimator", "reinforce_baseline", "--rollout.n_samples_per_prompt", "2",
                     "--algo.kl.use_loss", "--algo.kl.init_coef", "0.01", "--algo.kl.estimator", "k3",
                     "--actor.entropy_coef", "0.01", "--train.micro_batch_size", "1")
    args.ds.tensor_parallel_size = 2  # only turns the replay-buffer shuffle off: fixed accumulation windows
    torch.manual_seed(0)
    actor = Actor(build_tiny_qwen2(load_qwen_tokenizer(), hidden_size=32, num_layers=1, num_heads=2))
    actor.packing_samples, actor.is_vlm = False, False
    trainer = object.__new__(ppo_actor.ActorPPOTrainer)
    trainer.strategy, trainer.args, trainer.actor, trainer.ema_model = _Strategy(args, 2), args, actor, None
    trainer.actor_optim, trainer.max_epochs, trainer.dataloader_pin_memory, trainer.aux_loss = None, 1, False, False
    trainer.actor_scheduler = SimpleNamespace(get_last_lr=lambda: [1e-6])
    trainer.actor_loss_fn = ppo_actor.PolicyLoss()
    trainer.replay_buffer = NaiveReplayBuffer(1, 0, False, False, False)
    trainer.replay_buffer.target_device = torch.device("cpu")
    n_valid = 0
    for i, empty in enumerate(empties):
        gen = torch.Generator().manual_seed(0 if empty else 1000 + n_valid)  # valid samples alike in every run
        n_valid += not empty
        seq = torch.randint(0, 1000, (1, 12), generator=gen)
        mask = torch.zeros(1, 11, dtype=torch.bool)
        if not empty:
            mask[0, 5:9] = True
        att = torch.ones(1, 12, dtype=torch.long)
        with torch.no_grad():
            lp = actor(seq, mask, attention_mask=att)
        trainer.replay_buffer.append(Experience(
            sequences=seq, attention_mask=att, action_mask=mask, action_log_probs=lp + 0.05,
            base_action_log_probs=lp - 0.1, advantages=torch.randn(1, 11, generator=gen) * mask,
            returns=torch.zeros(1, 11), rewards=torch.tensor([1.0]), response_length=mask.sum(-1),
            total_length=torch.tensor([12]), info={"reward": torch.tensor([1.0])}, index=[i]))
    monkeypatch.setattr(torch.cuda, "current_device", lambda: "cpu")
    try:
        return trainer.ppo_train(0.01), trainer.strategy.losses
    except ZeroDivisionError as e:
        return e, trainer.strategy.losses


def test_accumulation_window_of_failed_samples_trains_on_nothing_and_logs_no_nan(monkeypatch):
    import math

    # OpenRLHF 0.11.2 as shipped: NaN losses, then a ZeroDivisionError in the token-weighted metric average
    raw, raw_losses = _actor_ppo_train(monkeypatch, [True, True, False, False], safe=False)
    assert isinstance(raw, ZeroDivisionError) and math.isnan(raw_losses[0])
    status, losses = _actor_ppo_train(monkeypatch, [True, True, False, False], safe=True)
    reference, _ = _actor_ppo_train(monkeypatch, [False, False], safe=True)  # the valid window alone
    assert losses[:2] == [0.0, 0.0] and all(math.isfinite(v) for v in losses)
    assert all(math.isfinite(v) for v in status.values())
    for key in ("policy_loss", "ppo_kl", "ppo_clip_ratio", "kl", "logprobs_diff", "entropy_loss"):
        assert status[key] == pytest.approx(reference[key], rel=1e-4, abs=1e-6), key
    assert reference["kl"] > 1e-3 and reference["entropy_loss"] > 1.0  # the compared terms are not trivially 0


# ------------------------------------------------------------------------------ tests that catch mutations
# One trajectory: 2 sampled tokens, a 3-token documents block, 2 sampled tokens; outcome reward 1 on the last one.
DOC_MASK = torch.tensor([[1, 1, 0, 0, 0, 1, 1]], dtype=torch.bool)
KL = torch.tensor([[0.1, 0.2, 7.0, 7.0, 7.0, 0.3, 0.4]])  # garbage on the documents block on purpose


def _one_experience(kl=KL, reward=1.0):
    return Experience(action_mask=DOC_MASK.clone(), rewards=torch.tensor([reward]), kl=kl.clone(),
                      response_length=DOC_MASK.sum(-1), index=[0], info={})


def test_cluster_kl_penalty_enters_the_returns_on_action_tokens_only():
    # reinforce, gamma 1, KL coefficient 0.5 as a reward penalty: return(t) = 1 - 0.5 * sum of KL at action
    # tokens from t on (compute_reward, OpenRLHF models/utils.py; masked: the block's 7.0 never enters)
    args, _ = _parse("--algo.advantage.estimator", "reinforce", "--rollout.n_samples_per_prompt", "1",
                     "--algo.kl.init_coef", "0.5", "--algo.advantage.no_std_norm")
    out = _maker(args, SearchExperienceMaker).compute_advantages_and_returns([_one_experience()])[0]
    expected = torch.tensor([[1 - 0.5 * 1.0, 1 - 0.5 * 0.9, 0, 0, 0, 1 - 0.5 * 0.7, 1 - 0.5 * 0.4]])
    torch.testing.assert_close(out.returns, expected)
    assert out.info["return"].item() == pytest.approx(1 - 0.5 * 1.0)


def test_cluster_reward_to_go_with_gamma_below_one_discounts_per_action_token():
    # gamma 0.9, no KL: the discount applies per sampled token, never per retrieved token
    args, _ = _parse("--algo.advantage.estimator", "reinforce", "--rollout.n_samples_per_prompt", "1",
                     "--algo.kl.init_coef", "0", "--algo.advantage.gamma", "0.9", "--algo.advantage.no_std_norm")
    out = _maker(args, SearchExperienceMaker).compute_advantages_and_returns(
        [_one_experience(kl=torch.zeros(1, 7))])[0]
    torch.testing.assert_close(out.returns, torch.tensor([[0.9 ** 3, 0.9 ** 2, 0, 0, 0, 0.9, 1.0]]))
    # with KL as well: r_t = -0.5 kl_t on action tokens, + 1 at the end; G_t = r_t + 0.9 G_next(action)
    args.algo.kl.init_coef = 0.5
    maker = _maker(args, SearchExperienceMaker)
    maker.kl_ctl.value = 0.5
    out = maker.compute_advantages_and_returns([_one_experience()])[0]
    g3 = 1 - 0.2
    g2 = -0.15 + 0.9 * g3
    g1 = -0.1 + 0.9 * g2
    g0 = -0.05 + 0.9 * g1
    torch.testing.assert_close(out.returns, torch.tensor([[g0, g1, 0, 0, 0, g2, g3]]))
