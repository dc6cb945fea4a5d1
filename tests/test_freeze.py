"""Partial fine-tuning (--actor.trainable_layers) and the frozen-trunk cache: the split forward must equal the full
forward, frozen parameters must get no gradient and no optimiser state, and an RL update through the cache must equal
the same update without it."""

import copy

import pytest
import torch

from openrlhf_search.cpu.main_job.experience import Trajectory, action_log_probs, batched_trunk, collate
from openrlhf_search.cpu.main_job.freeze import (FreezeError, freeze_lower_layers, top_hidden, trunk_boundary,
                                          trunk_hidden)
from openrlhf_search.cpu.main_job.offline_assets import build_tiny_qwen2
from openrlhf_search.cpu.main_job.rl_step import RLSettings, RLUpdater


def _model(tok, layers=3):
    return build_tiny_qwen2(tok, hidden_size=32, num_layers=layers, num_heads=2, seed=1)


def _trajs():
    # right-padded batch of different lengths; action ranges after a 5-token prompt, one environment block between
    return [Trajectory(tokens=list(range(100, 100 + n)), action_ranges=[(5, 9), (12, n)], reward=r, group=0)
            for n, r in ((20, 1.0), (16, 0.0), (18, 0.5), (14, 0.0))]


def test_split_forward_equals_full_forward(qwen_tokenizer):
    model = _model(qwen_tokenizer)
    full = copy.deepcopy(model)
    info = freeze_lower_layers(model, 1)
    assert info["boundary"] == 2 and trunk_boundary(model) == 2
    batch = collate(_trajs(), pad_id=0)
    with torch.no_grad():
        ref = full.get_decoder()(input_ids=batch.input_ids, attention_mask=batch.attention_mask).last_hidden_state
        split = top_hidden(model, trunk_hidden(model, batch.input_ids, batch.attention_mask), batch.attention_mask)
    real = batch.attention_mask.bool()
    assert torch.allclose(split[real], ref[real], atol=1e-5)
    # the model's layer list is restored after the split calls
    assert len(model.get_decoder().layers) == 3
    lp_full, _ = action_log_probs(full, batch)
    lp_cached, _ = action_log_probs(model, batch, trunk=batched_trunk(model, batch, micro_batch_size=3))
    assert torch.allclose(lp_full, lp_cached, atol=1e-5)


def test_frozen_parameters_get_no_gradient(qwen_tokenizer):
    model = _model(qwen_tokenizer)
    info = freeze_lower_layers(model, 1)
    assert 0 < info["trainable_params"] < info["total_params"]
    batch = collate(_trajs(), pad_id=0)
    lp, _ = action_log_probs(model, batch, trunk=batched_trunk(model, batch, 4))
    (-(lp * batch.action_mask).sum()).backward()
    dec = model.get_decoder()
    assert all(p.grad is None for p in dec.layers[0].parameters())
    assert model.get_input_embeddings().weight.grad is None
    assert all(p.grad is not None and p.grad.abs().sum() > 0 for p in dec.layers[2].parameters())


def test_trainable_layers_out_of_range_is_an_error(qwen_tokenizer):
    with pytest.raises(FreezeError):
        freeze_lower_layers(_model(qwen_tokenizer), 4)
    with pytest.raises(FreezeError):
        trunk_hidden(_model(qwen_tokenizer), torch.ones(1, 3, dtype=torch.long), torch.ones(1, 3, dtype=torch.long))


def test_update_through_the_trunk_cache_equals_the_plain_update(qwen_tokenizer):
    """Same experience and same AdamW step whether the frozen trunk is cached or recomputed by full forwards."""
    settings = RLSettings(estimator="reinforce_baseline", n_samples_per_prompt=4, kl_coef=0.01, actor_lr=1e-2,
                          micro_batch_size=2)
    results = []
    for cached in (True, False):
        model = _model(qwen_tokenizer)
        freeze_lower_layers(model, 1)
        if not cached:
            model._trunk_boundary = 0  # same frozen parameters, but every forward runs the whole model
        upd = RLUpdater(model, settings, pad_id=0)
        # only the top layer and the final norm are in the optimiser
        n_opt = sum(p.numel() for g in upd.actor_opt.param_groups for p in g["params"])
        assert n_opt == sum(p.numel() for p in model.parameters() if p.requires_grad)
        trajs = _trajs()
        rewards = torch.tensor([t.reward for t in trajs])
        exp = upd.make_experience(trajs, upd.shape_rewards(rewards, torch.ones(4, dtype=torch.bool)))
        assert (exp["trunk"] is not None) == cached
        upd.update(exp)
        results.append((exp["old_logp"], model.get_decoder().layers[2].mlp.up_proj.weight.detach().clone()))
    assert torch.allclose(results[0][0], results[1][0], atol=1e-5)
    assert torch.allclose(results[0][1], results[1][1], atol=1e-5)


def test_experience_from_the_rollouts_trunk_states_equals_a_fresh_trunk_pass(qwen_tokenizer):
    """make_experience(trunk_states=...) (the engine's captured states, last row zero as the engine hands them out)
    gives the log-probs, KL and advantages of a fresh trunk pass; one missing trajectory makes it run the trunk."""
    settings = RLSettings(estimator="group_norm", n_samples_per_prompt=4, kl_coef=0.01, micro_batch_size=2)
    model = _model(qwen_tokenizer)
    freeze_lower_layers(model, 1)
    upd = RLUpdater(model, settings, pad_id=0)
    trajs = _trajs()
    shaped = upd.shape_rewards(torch.tensor([t.reward for t in trajs]), torch.ones(4, dtype=torch.bool))
    states = []
    for t in trajs:
        h = trunk_hidden(model, torch.tensor([t.tokens]), torch.ones(1, len(t.tokens), dtype=torch.long))[0]
        states.append(torch.cat([h[:-1], torch.zeros_like(h[-1:])]))
    fresh = upd.make_experience(trajs, shaped)
    reused = upd.make_experience(trajs, shaped, trunk_states=states)
    for k in ("old_logp", "ref_logp", "kl", "advantages"):
        assert torch.allclose(fresh[k], reused[k], atol=1e-5), k
    assert not torch.equal(reused["trunk"], fresh["trunk"])  # it really used the handed-in states (zero last rows)
    partial = upd.make_experience(trajs, shaped, trunk_states=states[:3] + [None])
    assert torch.equal(partial["trunk"], fresh["trunk"])
