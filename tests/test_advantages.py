"""Masked GAE, group baselines and whitening against hand-computed numbers and OpenRLHF 0.11.2's own code."""

from types import SimpleNamespace

import pytest
import torch

import openrlhf_search._cpu_compat  # noqa: F401
from openrlhf.models.utils import compute_reward
from openrlhf.trainer.ppo_utils.experience import Experience
from openrlhf.trainer.ppo_utils.experience_maker import RemoteExperienceMaker
from openrlhf.trainer.ppo_utils.kl_controller import FixedKLController

from openrlhf_search.rl.advantages import group_baseline_rewards, masked_gae, masked_whiten

# One trajectory of 7 response tokens: 2 sampled tokens ("<search> q"), a 3-token document block written by the
# environment, then 2 sampled tokens ("<answer> x"). Values and rewards on the document block are garbage on purpose
# (a critic does output something there, and a per-token KL penalty is nonzero there): masked GAE must ignore them.
MASK = torch.tensor([[1, 1, 0, 0, 0, 1, 1]], dtype=torch.bool)
VALUES = torch.tensor([[0.5, 0.4, 9.0, 9.0, 9.0, 0.3, 0.2]])
REWARDS = torch.tensor([[0.0, 0.0, 5.0, 5.0, 5.0, 0.0, 1.0]])
GAMMA, LAMBD = 0.9, 0.8  # gamma * lambd = 0.72

# Derivation by hand over the action tokens only (a0..a3 = positions 0, 1, 5, 6; V = .5 .4 .3 .2; r = 0 0 0 1):
#   a3: delta = 1 + 0.9*0      - 0.2 = 0.8     A = 0.8
#   a2: delta = 0 + 0.9*0.2    - 0.3 = -0.12   A = -0.12 + 0.72*0.8     = 0.456
#   a1: delta = 0 + 0.9*0.3    - 0.4 = -0.13   A = -0.13 + 0.72*0.456   = 0.19832
#   a0: delta = 0 + 0.9*0.4    - 0.5 = -0.14   A = -0.14 + 0.72*0.19832 = 0.0027904
# returns = A + V on action tokens: 0.5027904, 0.59832, 0.756, 1.0; both are 0 on the document block.
EXPECTED_ADV = [0.0027904, 0.19832, 0.0, 0.0, 0.0, 0.456, 0.8]
EXPECTED_RET = [0.5027904, 0.59832, 0.0, 0.0, 0.0, 0.756, 1.0]
# OpenRLHF 0.11.2 recurses over every position with V and r multiplied by the mask. Then at a1 (position 1) the
# next value is V[2] * 0 = 0 and the credit from a2 arrives decayed by 0.72 per document token:
#   pos 4: delta = 0 + 0.9*0.3 - 0 = 0.27   A = 0.27 + 0.72*0.456 = 0.59832
#   pos 3: A = 0.72*0.59832 = 0.4307904;  pos 2: A = 0.72*0.4307904 = 0.310169088
#   pos 1: delta = 0 + 0.9*0 - 0.4 = -0.4  A = -0.4 + 0.72*0.310169088 = -0.17667825664
OPENRLHF_ADV_AT_A1 = -0.17667825664


def test_masked_gae_hand_computed_with_document_block():
    adv, ret = masked_gae(REWARDS, VALUES, MASK, GAMMA, LAMBD)
    torch.testing.assert_close(adv, torch.tensor([EXPECTED_ADV]), atol=1e-6, rtol=0)
    torch.testing.assert_close(ret, torch.tensor([EXPECTED_RET]), atol=1e-6, rtol=0)


def test_openrlhf_gae_bootstraps_zero_before_document_block():
    """The difference ``docs/design.md``, "Masking rule" describes, shown on OpenRLHF's real method."""
    adv_orl, _ = RemoteExperienceMaker.get_advantages_and_returns(None, VALUES, REWARDS, MASK.float(), GAMMA, LAMBD)
    assert adv_orl[0, 1].item() == pytest.approx(OPENRLHF_ADV_AT_A1, abs=1e-6)
    adv, _ = masked_gae(REWARDS, VALUES, MASK, GAMMA, LAMBD)
    assert adv[0, 1].item() == pytest.approx(EXPECTED_ADV[1], abs=1e-6)
    assert abs(adv[0, 1].item() - adv_orl[0, 1].item()) > 0.3
    # after the last document block both agree (no environment token in between)
    torch.testing.assert_close(adv[0, 5:], adv_orl[0, 5:], atol=1e-6, rtol=0)


@pytest.mark.parametrize("gamma,lambd", [(1.0, 1.0), (0.99, 0.95), (0.9, 0.0)])
def test_masked_gae_equals_openrlhf_on_contiguous_action_span(gamma, lambd):
    """One action span followed by right padding (no environment tokens): both implementations must agree."""
    gen = torch.Generator().manual_seed(0)
    lengths = [7, 3, 10, 1]
    mask = torch.zeros(4, 10, dtype=torch.bool)
    for i, n in enumerate(lengths):
        mask[i, :n] = True
    values = torch.randn(4, 10, generator=gen)
    rewards = torch.randn(4, 10, generator=gen) * 0.1
    adv, ret = masked_gae(rewards, values, mask, gamma, lambd)
    adv_orl, ret_orl = RemoteExperienceMaker.get_advantages_and_returns(
        None, values, rewards, mask.float(), gamma, lambd
    )
    torch.testing.assert_close(adv[mask], adv_orl[mask], atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(ret[mask], ret_orl[mask], atol=1e-5, rtol=1e-5)
    assert (adv[~mask] == 0).all() and (ret[~mask] == 0).all()


def test_masked_gae_equals_gae_on_compacted_sequence():
    """Random holes: result equals plain GAE run on the action tokens pulled out of each row."""
    gen = torch.Generator().manual_seed(1)
    mask = torch.rand(5, 30, generator=gen) > 0.4
    mask[3] = False  # a row with no action token (a sample left out of training)
    values = torch.randn(5, 30, generator=gen)
    rewards = torch.randn(5, 30, generator=gen)
    adv, ret = masked_gae(rewards, values, mask, 0.97, 0.9)
    for b in range(5):
        idx = mask[b].nonzero().flatten()
        if len(idx) == 0:
            assert (adv[b] == 0).all() and (ret[b] == 0).all()
            continue
        a_ref, r_ref = RemoteExperienceMaker.get_advantages_and_returns(
            None, values[b, idx][None], rewards[b, idx][None], None, 0.97, 0.9
        )
        torch.testing.assert_close(adv[b, idx], a_ref[0], atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(ret[b, idx], r_ref[0], atol=1e-5, rtol=1e-5)
        assert (adv[b, ~mask[b]] == 0).all()


def test_masked_gae_rejects_bad_input():
    with pytest.raises(ValueError, match="shape"):
        masked_gae(REWARDS, VALUES[:, :5], MASK, 1.0, 1.0)
    with pytest.raises(ValueError, match="gamma"):
        masked_gae(REWARDS, VALUES, MASK, 1.5, 1.0)


def _openrlhf_shaped_rewards(rewards: torch.Tensor, group_size: int, estimator: str) -> torch.Tensor:
    """Run OpenRLHF's real compute_advantages_and_returns on one-token experiences; return its shaped rewards."""
    args = SimpleNamespace(
        algo=SimpleNamespace(advantage=SimpleNamespace(estimator=estimator, gamma=1.0, lambd=1.0, no_std_norm=False)),
        rollout=SimpleNamespace(n_samples_per_prompt=group_size, max_new_tokens=16),
        reward=SimpleNamespace(clip_range=None, overlong_buffer_len=None, stop_properly_penalty_coef=None),
        data=SimpleNamespace(max_len=32),
    )
    maker = RemoteExperienceMaker.__new__(RemoteExperienceMaker)
    maker.strategy, maker.args, maker.advantage_estimator = SimpleNamespace(args=args), args, estimator
    maker.kl_ctl = FixedKLController(0.0)
    experiences = []
    for start in range(0, len(rewards), 3):  # micro-batches of 3 that cut across groups, as in real runs
        chunk = rewards[start : start + 3]
        experiences.append(
            Experience(
                action_mask=torch.ones(len(chunk), 1, dtype=torch.bool),
                rewards=chunk.clone(),
                kl=torch.zeros(len(chunk), 1),
                response_length=torch.ones(len(chunk)),
                index=list(range(start, start + len(chunk))),
                info={},
            )
        )
    maker.compute_advantages_and_returns(experiences)
    return torch.cat([e.returns[:, 0] for e in experiences])


@pytest.mark.parametrize("estimator", ["group_norm", "reinforce_baseline", "rloo", "reinforce", "dr_grpo"])
def test_group_baselines_match_openrlhf(estimator):
    gen = torch.Generator().manual_seed(2)
    rewards = torch.randint(0, 3, (16,), generator=gen).float() / 2  # ties and an all-equal group are likely
    rewards[:4] = 0.5  # one group with zero std
    ours = group_baseline_rewards(rewards, 4, estimator)
    theirs = _openrlhf_shaped_rewards(rewards, 4, estimator)
    torch.testing.assert_close(ours, theirs, atol=1e-6, rtol=1e-6)
    if estimator != "reinforce":
        assert (ours[:4] == 0).all()


def test_group_baselines_hand_computed():
    r = torch.tensor([1.0, 0.0, 0.0, 1.0, 2.0, 2.0])
    # group 1: mean 1/3 -> r - mean
    torch.testing.assert_close(
        group_baseline_rewards(r, 3, "reinforce_baseline")[:3], torch.tensor([2 / 3, -1 / 3, -1 / 3])
    )
    # rloo group 1: baselines (0+0)/2, (1+0)/2, (1+0)/2
    torch.testing.assert_close(group_baseline_rewards(r, 3, "rloo")[:3], torch.tensor([1.0, -0.5, -0.5]))
    # group_norm group 2: mean 5/3, unbiased std sqrt(1/3)
    expect = (torch.tensor([1.0, 2.0, 2.0]) - 5 / 3) / (1 / 3) ** 0.5
    torch.testing.assert_close(group_baseline_rewards(r, 3, "group_norm")[3:], expect, atol=1e-6, rtol=1e-6)


def test_group_baselines_ignore_invalid_samples():
    r = torch.tensor([1.0, 0.0, 123.0, 0.0])
    valid = torch.tensor([True, True, False, True])
    out = group_baseline_rewards(r, 4, "reinforce_baseline", valid=valid)
    torch.testing.assert_close(out, torch.tensor([2 / 3, -1 / 3, 0.0, -1 / 3]))
    same = group_baseline_rewards(torch.tensor([1.0, 0.0, 0.0]), 3, "group_norm")
    out = group_baseline_rewards(r, 4, "group_norm", valid=valid)
    torch.testing.assert_close(out[valid], same)
    assert out[2] == 0
    # a NaN reward on a failed sample is fine, on a valid one it is an error
    r[2] = float("nan")
    assert torch.isfinite(group_baseline_rewards(r, 4, "rloo", valid=valid)).all()
    with pytest.raises(ValueError, match="non-finite"):
        group_baseline_rewards(r, 4, "rloo")


def test_group_baselines_reject_bad_input():
    with pytest.raises(ValueError, match="estimator"):
        group_baseline_rewards(torch.zeros(4), 2, "gae")
    with pytest.raises(ValueError, match="groups"):
        group_baseline_rewards(torch.zeros(5), 2, "rloo")


def test_masked_whiten_uses_action_tokens_only():
    x = torch.tensor([[1.0, 3.0, 100.0], [5.0, -50.0, 7.0]])
    mask = torch.tensor([[1, 1, 0], [1, 0, 1]])
    out = masked_whiten(x, mask)
    vals = torch.tensor([1.0, 3.0, 5.0, 7.0])  # mean 4, population var 5
    torch.testing.assert_close(out[mask.bool()], (vals - 4) / 5**0.5)
    assert out[0, 2] == 0 and out[1, 1] == 0
    centred = masked_whiten(x, mask, scale=False)
    torch.testing.assert_close(centred[mask.bool()], vals - 4)
    assert (masked_whiten(x, torch.zeros_like(mask)) == 0).all()


def test_compute_reward_places_outcome_on_last_action_token():
    """The reward layout masked_gae relies on: OpenRLHF puts r at the last action token, after a document block."""
    kl = torch.zeros(1, 7)
    reward = compute_reward(torch.tensor([1.0]), 0.0, kl, action_mask=MASK)
    adv, _ = masked_gae(reward, torch.zeros(1, 7), MASK, 1.0, 1.0)
    # gamma = lambda = 1 and V = 0: every action token gets the full outcome, the document block nothing
    torch.testing.assert_close(adv, torch.tensor([[1.0, 1.0, 0, 0, 0, 1.0, 1.0]]))


# ------------------------------------------------------------------ equal rewards, float residue
# OpenRLHF 0.11.2's formula (and ours before the fix) gave every sample of
# an all-equal group the same large advantage, e.g. 8 x 0.8 -> -0.921 each under group_norm (the float32 mean of
# eight 0.8s is 0.8 - 6e-8, the std 1e-8 passes the 1e-9 guard). Mutation caught: dropping the equality guard (the
# group_norm cases then give ~-0.92, the others ~-6e-8 instead of exactly 0).
EQUAL_GROUPS = [(0.8, 8), (-1.2, 8), (0.2, 16), (0.8, 5), (0.3, 5), (0.8, 12), (0.7, 12), (-2.0, 4),
                (0.1, 16), (1 / 3, 8), (0.9, 16)]
BASELINED = ("group_norm", "reinforce_baseline", "dr_grpo", "rloo")


@pytest.mark.parametrize("value,size", EQUAL_GROUPS)
@pytest.mark.parametrize("estimator", BASELINED)
def test_equal_rewards_give_exactly_zero(value, size, estimator):
    rewards = torch.cat([torch.full((size,), value), torch.tensor([1.0, 0.0] * (size // 2) + [0.5] * (size % 2))])
    out = group_baseline_rewards(rewards, size, estimator)
    assert (out[:size] == 0).all(), out[:size].tolist()
    assert (out[size:] != 0).any()  # the second, mixed group still gets a signal


def test_the_unguarded_values_are_the_openrlhf_formula():
    """The wrong numbers (-0.921 for eight 0.8s) come from OpenRLHF's own formula: the test above would fail without
    our guard."""
    for value, size, wrong in [(0.8, 8, -0.921), (-1.2, 8, -0.928), (0.2, 16, -0.909)]:
        theirs = _openrlhf_shaped_rewards(torch.full((size,), value), size, "group_norm")
        assert theirs[0].item() == pytest.approx(wrong, abs=1e-3)
        assert (group_baseline_rewards(torch.full((size,), value), size, "group_norm") == 0).all()


@pytest.mark.parametrize("estimator", BASELINED)
def test_equal_within_tolerance_and_with_failed_samples(estimator):
    # the same value reached by two float paths (1 ulp apart) is equal; a failed sample's different reward does
    # not make the group informative
    a = torch.tensor(0.8)
    b = torch.nextafter(a, torch.tensor(1.0))
    rewards = torch.stack([a, b, a, a, b, a, a, a])
    assert (group_baseline_rewards(rewards, 8, estimator) == 0).all()
    rewards = torch.tensor([0.8] * 7 + [0.0])
    valid = torch.tensor([True] * 7 + [False])
    assert (group_baseline_rewards(rewards, 8, estimator, valid=valid) == 0).all()


def test_group_norm_std_floor_keeps_tiny_spreads_unnormalised():
    """A genuine spread below NeMo-RL's 1e-3 std floor (PR #4161) is not blown up to O(1) by the division: one
    sample 1e-4 above seven others keeps r - mean (OpenRLHF would give it +2.47). Above the floor the group is
    normalised exactly as OpenRLHF does. Mutation caught: removing the floor (the first assert sees 2.47)."""
    rewards = torch.tensor([0.5] * 7 + [0.5001])
    out = group_baseline_rewards(rewards, 8, "group_norm")
    torch.testing.assert_close(out, rewards - rewards.mean(), atol=1e-7, rtol=0)
    assert _openrlhf_shaped_rewards(rewards, 8, "group_norm")[-1].item() == pytest.approx(2.47, abs=0.01)
    wide = torch.tensor([0.5] * 7 + [0.51])  # std 3.5e-3 >= floor
    torch.testing.assert_close(group_baseline_rewards(wide, 8, "group_norm"),
                               _openrlhf_shaped_rewards(wide, 8, "group_norm"), atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("scale", [True, False])
def test_masked_whiten_constant_batch_is_exactly_zero(scale):
    """A constant batch (every advantage 0.8, e.g. reinforce with equal rewards) whitened to -6e-4 per token before
    the fix (residue / sqrt(1e-8)). Mutation caught: dropping the equality guard in masked_whiten."""
    x = torch.full((3, 7), 0.8)
    mask = torch.ones(3, 7)
    mask[1, 4:] = 0
    x[1, 4:] = 5.0  # outside the mask: ignored
    assert (masked_whiten(x, mask, scale=scale) == 0).all()
    x = torch.full((4, 5), -1.2)
    assert (masked_whiten(x, torch.ones(4, 5), scale=scale) == 0).all()


def test_the_experience_maker_gives_zero_advantage_to_equal_groups():
    """The cluster experience maker goes through group_baseline_rewards: a group of equal rewards gets advantage 0,
    a group with spread does not."""
    from openrlhf_search.rl.experience_maker import SearchExperienceMaker
    from tests.test_cluster_wiring import _contiguous_masks, _experiences, _maker, _parse

    rewards = [0.8] * 8 + [1.0, 0.0] * 4
    for estimator in ("group_norm", "reinforce_baseline", "rloo", "dr_grpo"):
        args, _ = _parse("--algo.advantage.estimator", estimator, "--rollout.n_samples_per_prompt", "8",
                         "--algo.kl.init_coef", "0")
        exps = _maker(args, SearchExperienceMaker).compute_advantages_and_returns(
            _experiences(_contiguous_masks([3] * 16), rewards, micro=3))
        adv = torch.cat([e.advantages for e in exps])
        assert (adv[:8] == 0).all(), (estimator, adv[:8, 0].tolist())
        assert (adv[8:].abs().sum(-1) > 0).all()
