"""MaskedPolicyLoss / MaskedValueLoss: exactly zero gradient on retrieved tokens, same loss as OpenRLHF on actions."""

import pytest
import torch

import openrlhf_search._cpu_compat  # noqa: F401
from openrlhf.models.loss import PolicyLoss, ValueLoss

from openrlhf_search.rl.advantages import masked_gae
from openrlhf_search.rl.loss import (
    MaskedPolicyLoss,
    MaskedValueLoss,
    install_into_openrlhf,
    safe_aggregate_loss,
    safe_masked_mean,
)

# response tokens: 3 sampled, 4 retrieved (document block), 2 sampled, 1 right padding
MASK = torch.tensor([[1, 1, 1, 0, 0, 0, 0, 1, 1, 0], [1, 1, 0, 0, 1, 1, 1, 1, 0, 0]], dtype=torch.bool)

CONFIGS = [
    dict(),
    dict(token_level_loss=False),
    dict(dual_clip=3.0),
    dict(policy_loss_type="gspo"),
    dict(is_correction_level="token", is_correction_mode="mask"),
    dict(is_correction_level="seq", is_correction_mode="mask"),
    dict(is_correction_level="token", is_correction_mode="clip"),
]


def _inputs(seed=0):
    gen = torch.Generator().manual_seed(seed)
    log_probs = (-torch.rand(2, 10, generator=gen) * 3).requires_grad_(True)
    old = log_probs.detach() + 0.3 * torch.randn(2, 10, generator=gen)
    rollout = old + 0.05 * torch.randn(2, 10, generator=gen)
    # advantages nonzero everywhere, as OpenRLHF's whitening leaves them outside the mask
    adv = torch.randn(2, 10, generator=gen)
    return log_probs, old, adv, rollout


@pytest.mark.parametrize("cfg", CONFIGS, ids=lambda c: ",".join(f"{k}={v}" for k, v in c.items()) or "ppo")
def test_zero_gradient_outside_mask_and_same_loss(cfg):
    log_probs, old, adv, rollout = _inputs()
    loss, *_ = MaskedPolicyLoss(**cfg)(log_probs, old, adv, action_mask=MASK, rollout_log_probs=rollout)
    loss.backward()
    grad = log_probs.grad
    assert (grad[~MASK] == 0).all(), grad[~MASK]
    assert (grad[MASK] != 0).any()
    # on action tokens the loss equals OpenRLHF's own PolicyLoss with the same inputs
    ref, *_ = PolicyLoss(**cfg)(log_probs.detach(), old, adv, action_mask=MASK, rollout_log_probs=rollout)
    torch.testing.assert_close(loss.detach(), ref, atol=1e-6, rtol=1e-6)


def test_non_finite_values_outside_mask_stay_out_of_the_gradient():
    """OpenRLHF's loss multiplies by the mask, and 0 * inf = nan; ours never builds the inf."""
    log_probs, old, adv, rollout = _inputs(1)
    old = old.clone()
    old[~MASK] = float("-inf")  # e.g. a log-prob that was never computed for a document token
    adv = adv.clone()
    adv[~MASK] = float("nan")
    cfg = dict(is_correction_level="token")
    loss, *_ = MaskedPolicyLoss(**cfg)(log_probs, old, adv, action_mask=MASK, rollout_log_probs=rollout)
    loss.backward()
    assert torch.isfinite(loss) and torch.isfinite(log_probs.grad).all()
    assert (log_probs.grad[~MASK] == 0).all()
    lp2 = log_probs.detach().clone().requires_grad_(True)
    ref, *_ = PolicyLoss(**cfg)(lp2, old, adv, action_mask=MASK, rollout_log_probs=rollout)
    assert not torch.isfinite(ref)  # the failure mode the subclass exists for


def test_missing_mask_is_an_error():
    log_probs, old, adv, _ = _inputs()
    with pytest.raises(ValueError, match="action_mask"):
        MaskedPolicyLoss()(log_probs, old, adv)
    with pytest.raises(ValueError, match="shape"):
        MaskedPolicyLoss()(log_probs, old, adv, action_mask=MASK[:, :5])


def test_tiny_model_logits_of_retrieved_tokens_get_no_gradient(tiny_policy):
    """Autograd through a real (tiny) Qwen2: the logits that score document tokens receive exactly zero gradient."""
    torch.manual_seed(0)
    model = tiny_policy
    vocab = model.config.vocab_size
    prompt_len, resp_len = 4, MASK.shape[1]
    seqs = torch.randint(0, min(vocab, 5000), (2, prompt_len + resp_len))
    logits = model(input_ids=seqs).logits.float()
    logits.retain_grad()
    # log p(token t+1 | <= t) for the response tokens, as OpenRLHF's Actor computes them (its
    # log_probs_from_logits takes flash-attn's Triton kernel for float32, which needs CUDA)
    lp = torch.log_softmax(logits[:, :-1], -1).gather(-1, seqs[:, 1:, None])[..., 0][:, -resp_len:]
    old = lp.detach() - 0.1
    values = torch.randn(2, resp_len)
    rewards = torch.zeros(2, resp_len)
    rewards[0, 8], rewards[1, 7] = 1.0, -1.0  # outcome on the last action token
    adv, _ = masked_gae(rewards, values, MASK, 1.0, 1.0)
    loss, *_ = MaskedPolicyLoss()(lp, old, adv, action_mask=MASK)
    loss.backward()
    # logits at position p score token p+1; response token j sits at prompt_len + j
    g = logits.grad[:, prompt_len - 1 : prompt_len - 1 + resp_len]
    per_token = g.abs().sum(-1)
    assert (per_token[~MASK] == 0).all()
    assert (per_token[MASK] > 0).all()
    assert any(p.grad is not None and p.grad.abs().sum() > 0 for p in model.parameters())
    model.zero_grad(set_to_none=True)


def test_masked_value_loss():
    gen = torch.Generator().manual_seed(3)
    values = torch.randn(2, 10, generator=gen).requires_grad_(True)
    old = values.detach() + 0.1
    returns = torch.randn(2, 10, generator=gen)
    returns[~MASK] = float("nan")  # masked_gae leaves 0 there, but nothing may depend on it
    loss = MaskedValueLoss(clip_eps=0.2)(values, old, returns, action_mask=MASK)
    loss.backward()
    assert torch.isfinite(loss)
    assert (values.grad[~MASK] == 0).all() and (values.grad[MASK] != 0).any()
    clean = returns.clone()
    clean[~MASK] = 0
    ref = ValueLoss(clip_eps=0.2)(values.detach(), old, clean, action_mask=MASK)
    torch.testing.assert_close(loss.detach(), ref)


def test_install_into_openrlhf_rebinds_actor_losses():
    import openrlhf.trainer.ray.ppo_actor as ppo_actor
    import openrlhf.trainer.ray.ppo_critic as ppo_critic

    names = [(ppo_actor, n) for n in ("PolicyLoss", "aggregate_loss", "masked_mean", "ActorPPOTrainer")]
    names += [(ppo_critic, n) for n in ("ValueLoss", "masked_mean")]
    saved = [getattr(m, n) for m, n in names]
    try:
        install_into_openrlhf()
        assert ppo_actor.PolicyLoss is MaskedPolicyLoss and ppo_critic.ValueLoss is MaskedValueLoss
        assert ppo_actor.aggregate_loss is safe_aggregate_loss and ppo_actor.masked_mean is safe_masked_mean
        assert ppo_critic.masked_mean is safe_masked_mean
        assert issubclass(ppo_actor.ActorPPOTrainer, saved[3]) and ppo_actor.ActorPPOTrainer is not saved[3]
    finally:
        for (m, n), v in zip(names, saved):
            setattr(m, n, v)
