"""Learning signal of the RL core (group baselines of ``advantages.py``, ``loss.MaskedPolicyLoss``) on a toy
search-shaped task, and what breaks it.

Toy environment (in-process, scripted): after the prompt the policy samples one token (its "query"), the environment
inserts a fixed block of tokens (its "documents"), then the policy samples one more token (its "answer"). Reward 1
when the answer token is the target token, else 0. The policy is a tiny Qwen2 with a 16-token vocabulary so that the
target is found by sampling (chance 1/16 at the start). One update per step: outcome rewards shaped by
``group_baseline_rewards`` on every action token, the masked PPO loss (on-policy, ratio 1), torch AdamW, as OpenRLHF's
actor does with these pieces.

The reward must rise within a bounded number of CPU steps with the real estimators and the real masked loss; it must
NOT rise when the advantage sign is flipped or when the action mask covers the inserted block instead of the
actions. And the loss gives exactly zero gradient to environment tokens.
"""

import pytest
import torch
from transformers import Qwen2Config, Qwen2ForCausalLM

from openrlhf_search.rl.advantages import group_baseline_rewards
from openrlhf_search.rl.loss import MaskedPolicyLoss

VOCAB = 16
PROMPT = [1, 2, 3]
ENV_BLOCK = [4, 5, 6, 7, 8, 9]  # inserted by the environment between the two actions
TARGET = 13
N_SAMPLES = 8


def tiny_model(seed=0):
    torch.manual_seed(seed)
    cfg = Qwen2Config(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                      num_attention_heads=2, num_key_value_heads=2, max_position_embeddings=64,
                      tie_word_embeddings=False, pad_token_id=0)
    return Qwen2ForCausalLM(cfg).eval()


@torch.no_grad()
def sample_next(model, tokens, gen):
    """One token per row of ``tokens`` [B, T] (equal lengths, no padding), sampled from the last position: [B]."""
    logits = model(input_ids=tokens).logits[:, -1].float()
    return torch.multinomial(torch.softmax(logits, -1), 1, generator=gen)[:, 0]


def rollout(model, n_prompts, gen, mask_env_instead=False):
    """(tokens [B, T], action mask [B, T - 1] over predicted tokens, rewards [B]); ``mask_env_instead`` marks the
    inserted block as the action (a bug). Every trajectory has the same length, so each turn of all B samples is one
    batched forward."""
    b = n_prompts * N_SAMPLES
    tokens = torch.tensor([PROMPT] * b)
    tokens = torch.cat([tokens, sample_next(model, tokens, gen)[:, None]], 1)  # the query token
    tokens = torch.cat([tokens, torch.tensor([ENV_BLOCK] * b)], 1)
    tokens = torch.cat([tokens, sample_next(model, tokens, gen)[:, None]], 1)  # the answer token
    mask = torch.zeros(b, tokens.shape[1] - 1, dtype=torch.bool)  # position t predicts token t + 1
    if mask_env_instead:
        mask[:, len(PROMPT): len(PROMPT) + len(ENV_BLOCK)] = True
    else:
        mask[:, len(PROMPT) - 1] = True  # the query token
        mask[:, -1] = True  # the answer token
    return tokens, mask, (tokens[:, -1] == TARGET).float()


def log_probs(model, tokens):
    logits = model(input_ids=tokens).logits[:, :-1].float()
    return torch.log_softmax(logits, -1).gather(-1, tokens[:, 1:, None])[..., 0]


@torch.no_grad()
def target_prob(model):
    logits = model(input_ids=torch.tensor([PROMPT + [10] + ENV_BLOCK])).logits[0, -1]
    return float(torch.softmax(logits, -1)[TARGET])


def train(estimator, steps, flip_sign=False, mask_env_instead=False, seed=0):
    model = tiny_model(seed)
    opt = torch.optim.AdamW(model.parameters(), lr=3e-2, weight_decay=0.0)
    loss_fn = MaskedPolicyLoss(clip_eps_low=0.2, clip_eps_high=0.2)
    gen = torch.Generator().manual_seed(seed)
    p0 = target_prob(model)
    for _ in range(steps):
        tokens, mask, rewards = rollout(model, 4, gen, mask_env_instead)
        shaped = group_baseline_rewards(rewards, N_SAMPLES, estimator)
        advantages = shaped[:, None].expand_as(mask) * mask
        if flip_sign:
            advantages = -advantages
        model.train()
        logp = log_probs(model, tokens)
        loss, *_ = loss_fn(logp, logp.detach(), advantages, action_mask=mask)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        model.eval()
    return p0, target_prob(model)


@pytest.mark.parametrize("estimator", ["reinforce_baseline", "group_norm", "rloo"])
def test_reward_rises_with_env_tokens_inserted(estimator):
    p0, p1 = train(estimator, steps=25)
    assert p0 < 0.15
    assert p1 > 0.5, f"{estimator}: P(target) {p0:.3f} -> {p1:.3f} in 25 steps"


def test_flipped_advantage_sign_does_not_learn():
    p0, p1 = train("reinforce_baseline", steps=25, flip_sign=True)
    assert p1 < p0 + 0.02, f"flipped sign still learned: {p0:.3f} -> {p1:.3f}"


def test_mask_on_environment_tokens_does_not_learn():
    p0, p1 = train("reinforce_baseline", steps=25, mask_env_instead=True)
    assert p1 < 0.2, f"a mask over the inserted block still learned the answer: {p0:.3f} -> {p1:.3f}"


def test_no_gradient_reaches_environment_token_log_probs():
    model = tiny_model(1)
    tokens, mask, rewards = rollout(model, 1, torch.Generator().manual_seed(1))
    rewards[0] = 1.0 - rewards[0]  # a group with reward spread: non-zero advantages
    shaped = group_baseline_rewards(rewards, N_SAMPLES, "reinforce_baseline")
    logp = log_probs(model, tokens)
    logp.retain_grad()
    old = logp.detach() + 0.3  # off-policy on purpose: ratios != 1 everywhere, also on the documents block
    loss, *_ = MaskedPolicyLoss()(logp, old, shaped[:, None].expand_as(mask).clone(), action_mask=mask)
    loss.backward()
    assert logp.grad[mask].abs().sum() > 0
    assert torch.count_nonzero(logp.grad[~mask]) == 0
    # the mask marks exactly the two sampled tokens, never the inserted block
    assert mask.sum(-1).tolist() == [2] * N_SAMPLES
    assert tokens[0, 1:][mask[0]].tolist() == [tokens[0, len(PROMPT)].item(), tokens[0, -1].item()]
