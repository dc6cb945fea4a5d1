"""Learning signal of the CPU update (RLUpdater) on a toy search-shaped task, and what breaks it.

Toy environment (in-process, scripted): after the prompt the policy samples one token (its "query"), the environment
inserts a fixed block of tokens (its "documents"), then the policy samples one more token (its "answer"). Reward 1
when the answer token is the target token, else 0. The policy is a tiny Qwen2 with a 16-token vocabulary so that the
target is found by sampling (chance 1/16 at the start).

The reward must rise within a bounded number of CPU steps with the real advantage estimators, the real masked loss
and the real collate / action-mask code; it must NOT rise when the advantage sign is flipped or when the action mask
covers the inserted block instead of the actions. And the loss gives exactly zero gradient to environment tokens.
"""

import pytest
import torch
from transformers import Qwen2Config, Qwen2ForCausalLM

from openrlhf_search.cpu.main_job.experience import Trajectory, action_log_probs, collate
from openrlhf_search.cpu.main_job.rl_step import RLSettings, RLUpdater

VOCAB = 16
PAD = 0
PROMPT = [1, 2, 3]
ENV_BLOCK = [4, 5, 6, 7, 8, 9]  # inserted by the environment between the two actions
TARGET = 13


def tiny_model(seed=0):
    torch.manual_seed(seed)
    cfg = Qwen2Config(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                      num_attention_heads=2, num_key_value_heads=2, max_position_embeddings=64,
                      tie_word_embeddings=False, pad_token_id=PAD)
    return Qwen2ForCausalLM(cfg).eval()


@torch.no_grad()
def sample_next(model, tokens, gen):
    logits = model(input_ids=torch.tensor([tokens])).logits[0, -1]
    return int(torch.multinomial(torch.softmax(logits, -1), 1, generator=gen))


def rollout(model, n_prompts, n_samples, gen, mask_env_instead=False):
    """Trajectories of the toy environment; ``mask_env_instead`` marks the inserted block as the action (a bug)."""
    trajs, rewards = [], []
    for g in range(n_prompts):
        for _ in range(n_samples):
            tokens = list(PROMPT)
            a1 = sample_next(model, tokens, gen)
            tokens.append(a1)
            env_start = len(tokens)
            tokens += ENV_BLOCK
            a2 = sample_next(model, tokens, gen)
            tokens.append(a2)
            p = len(PROMPT)
            ranges = [(p, p + 1), (env_start + len(ENV_BLOCK), env_start + len(ENV_BLOCK) + 1)]
            if mask_env_instead:
                ranges = [(env_start, env_start + len(ENV_BLOCK))]
            r = float(a2 == TARGET)
            trajs.append(Trajectory(tokens=tokens, action_ranges=ranges, reward=r, group=g))
            rewards.append(r)
    return trajs, torch.tensor(rewards)


@torch.no_grad()
def target_prob(model):
    logits = model(input_ids=torch.tensor([PROMPT + [10] + ENV_BLOCK])).logits[0, -1]
    return float(torch.softmax(logits, -1)[TARGET])


def train(estimator, steps, flip_sign=False, mask_env_instead=False, seed=0):
    model = tiny_model(seed)
    s = RLSettings(estimator=estimator, n_samples_per_prompt=8, actor_lr=3e-2, critic_lr=3e-2, kl_coef=0.0,
                   micro_batch_size=32, eps_clip=0.2)
    upd = RLUpdater(model, s, PAD)
    gen = torch.Generator().manual_seed(seed)
    p0 = target_prob(model)
    for _ in range(steps):
        trajs, r = rollout(model, 4, 8, gen, mask_env_instead)
        shaped = upd.shape_rewards(r, torch.ones_like(r, dtype=torch.bool))
        exp = upd.make_experience(trajs, shaped)
        if flip_sign:
            exp["advantages"] = -exp["advantages"]
        stats = upd.update(exp)
        assert stats["nan_skipped"] == 0
    return p0, target_prob(model)


@pytest.mark.parametrize("estimator", ["reinforce_baseline", "group_norm", "gae"])
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
    upd = RLUpdater(model, RLSettings(estimator="reinforce_baseline", n_samples_per_prompt=4, kl_coef=0.0), PAD)
    gen = torch.Generator().manual_seed(1)
    trajs, r = rollout(model, 1, 4, gen)
    r[0] = 1.0  # make sure the group has a non-zero advantage
    exp = upd.make_experience(trajs, upd.shape_rewards(r, torch.ones(4, dtype=torch.bool)))
    batch = exp["batch"]
    logp, _ = action_log_probs(model, batch)
    logp.retain_grad()
    loss, *_ = upd.policy_loss(logp, exp["old_logp"], exp["advantages"], action_mask=batch.action_mask)
    loss.backward()
    env_positions = ~batch.action_mask
    assert logp.grad[batch.action_mask].abs().sum() > 0
    assert torch.count_nonzero(logp.grad[env_positions]) == 0
    # the action mask marks exactly the two sampled tokens, never the inserted block
    assert batch.action_mask.sum(-1).tolist() == [2, 2, 2, 2]
    first = collate(trajs[:1], PAD).action_mask[0]
    predicted = torch.tensor(trajs[0].tokens[1:])[first].tolist()
    assert predicted == [trajs[0].tokens[len(PROMPT)], trajs[0].tokens[-1]]


def test_nan_guard_skips_the_step_and_keeps_weights():
    model = tiny_model(2)
    upd = RLUpdater(model, RLSettings(estimator="reinforce_baseline", n_samples_per_prompt=4, kl_coef=0.0), PAD)
    trajs, r = rollout(model, 1, 4, torch.Generator().manual_seed(2))
    r[0] = 1.0
    exp = upd.make_experience(trajs, upd.shape_rewards(r, torch.ones(4, dtype=torch.bool)))
    exp["advantages"] = torch.where(exp["batch"].action_mask, torch.tensor(float("nan")), exp["advantages"])
    before = [p.detach().clone() for p in model.parameters()]
    stats = upd.update(exp)
    assert stats["nan_skipped"] == 1
    assert all(torch.equal(a, b) for a, b in zip(before, model.parameters()))
    assert not upd.actor_opt.state  # no AdamW moment was written
