"""Training only the top K layers (``--actor.trainable_layers`` / ``--model.trainable_layers``): what trains, what the
weight sync sends, and the frozen-trunk cache that lets the update skip the lower layers."""

import os
import sys

import pytest
import torch

import openrlhf_search._cpu_compat  # noqa: F401  (before any openrlhf import)
from openrlhf_search.rl.freeze import FreezeError, TrunkCache, decoder_of, freeze_before_prepare, freeze_lower_layers

sys.modules.setdefault("flash_attn.ops.triton.cross_entropy", None)  # OpenRLHF's log-probs on the torch path


def _actor(layers=6, seed=0):
    from openrlhf.models import Actor
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    cfg = LlamaConfig(vocab_size=300, hidden_size=32, intermediate_size=64, num_hidden_layers=layers,
                      num_attention_heads=4, num_key_value_heads=2)
    actor = Actor(LlamaForCausalLM(cfg))
    actor.packing_samples, actor.temperature = False, 1.0  # what Actor(path, ...) sets; Actor(model) does not
    return actor


def _batch(pad_left=(5, 2, 0), length=20, seed=1):
    g = torch.Generator().manual_seed(seed)
    seq = torch.randint(1, 300, (len(pad_left), length), generator=g)
    mask = torch.ones_like(seq)
    for i, p in enumerate(pad_left):
        mask[i, :p] = 0
        seq[i, :p] = 0
    return seq, mask


def test_freeze_keeps_the_top_layers_and_final_norm_trainable():
    """Catches the boundary off by one, the final norm or the embeddings left out / put in, and K out of range."""
    actor = _actor()
    info = freeze_lower_layers(actor.model, 2)
    trainable = [n for n, p in actor.model.named_parameters() if p.requires_grad]
    assert info["boundary"] == 4
    assert all(n.startswith(("model.layers.4.", "model.layers.5.", "model.norm.")) for n in trainable)
    assert any(n.startswith("model.layers.4.") for n in trainable) and "model.norm.weight" in trainable
    assert info["trainable_params"] == sum(p.numel() for p in actor.model.parameters() if p.requires_grad)
    for bad in (0, 7, -1):
        with pytest.raises(FreezeError, match=r"\[1, 6\]"):
            freeze_lower_layers(_actor().model, bad)
    with pytest.raises(FreezeError, match="no decoder"):
        decoder_of(torch.nn.Linear(2, 2))


def test_trunk_cache_replays_the_frozen_states_under_any_padding_and_trains_the_top_only():
    """The update's forward from cached trunk states equals the full forward (other padding, other row order), the
    gradient reaches the top layers only, and a batch with an unseen sequence runs the trunk. Catches states stored
    per padded position (wrong rows after re-padding), a hit for a new sequence, or a cache that kept gradients."""
    actor = _actor()
    info = freeze_lower_layers(actor.model, 2)
    seq, mask = _batch()
    actions = torch.ones(3, 8)
    reference = actor(seq, actions, mask)  # no cache installed yet: the plain model
    cache = TrunkCache.install(actor.model, info["boundary"])
    first = actor(seq, actions, mask)
    assert (cache.hits, cache.misses, len(cache.entries)) == (0, 1, 3)
    torch.testing.assert_close(first, reference)
    pad = torch.zeros(3, 3, dtype=torch.long)
    order = [2, 0, 1]
    seq2, mask2 = torch.cat([pad, seq], 1)[order], torch.cat([pad, mask], 1)[order]
    replay = actor(seq2, actions[order], mask2)
    assert cache.hits == 1
    torch.testing.assert_close(replay, reference[order], atol=1e-5, rtol=1e-4)
    replay.sum().backward()
    with_grad = {n for n, p in actor.model.named_parameters() if p.grad is not None}
    assert with_grad and all(n.startswith(("model.layers.4.", "model.layers.5.", "model.norm.")) for n in with_grad)
    new_seq, new_mask = _batch(pad_left=(0,), seed=7)
    actor(new_seq, torch.ones(1, 8), new_mask)
    assert cache.misses == 2 and len(cache.entries) == 4
    cache.clear()
    assert not cache.entries


def test_freeze_before_prepare_freezes_the_trained_model_only():
    """DeepSpeed's optimiser is built in ``strategy.prepare`` from the ``requires_grad`` tensors: the (model,
    optimiser config) pair must be frozen before the real ``prepare`` sees it, an eval-only model (reference) never."""
    seen = {}

    class Strategy:
        def prepare(self, *models, **kwargs):
            seen["trainable"] = [sum(p.requires_grad for p in m[0].model.parameters()) if isinstance(m, tuple)
                                 else sum(p.requires_grad for p in m.model.parameters()) for m in models]
            return models

    strategy = Strategy()
    figures = freeze_before_prepare(strategy, 1, trunk_cache=True)
    policy, reference = _actor(), _actor()
    total = sum(1 for _ in reference.model.parameters())
    strategy.prepare((policy, {}), reference)
    assert seen["trainable"] == [10, total]  # one layer (9 tensors) + the final norm; the reference untouched
    assert figures["boundary"] == 5 and isinstance(figures["trunk_cache"], TrunkCache)


def test_weight_sync_filter_line_is_openrlhfs_own():
    """SearchActorPPOTrainer.broadcast_to_vllm sends only trained tensors by raising ``is_vlm`` for the sync, which
    relies on this exact filter in the installed OpenRLHF (an upgrade that changes it fails here)."""
    import openrlhf.trainer.ray.ppo_actor as ppo_actor

    from openrlhf_search.rl.trainer import SYNC_FILTER_LINE

    with open(ppo_actor.__file__, encoding="utf-8") as f:
        source = f.read()
    assert SYNC_FILTER_LINE in source
    broadcast = source[source.index("def broadcast_to_vllm"):source.index("class PolicyModelActor")]
    assert broadcast.count("is_vlm") == 1  # read nowhere else during a sync
    assert os.path.basename(ppo_actor.__file__) == "ppo_actor.py"
