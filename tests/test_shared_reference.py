"""The reference log-probs computed in the policy actor over its frozen trunk (``openrlhf_search.rl.shared_reference``):
equal to a separately loaded reference model's after the policy has trained, read through the trunk cache, and
served to OpenRLHF's experience maker where it expects the reference group."""

import sys
from types import SimpleNamespace

import pytest
import torch

import openrlhf_search._cpu_compat  # noqa: F401  (before any openrlhf import)
from openrlhf_search.rl import shared_reference
from openrlhf_search.rl.freeze import TrunkCache, freeze_before_prepare, freeze_lower_layers
from openrlhf_search.rl.shared_reference import ReferenceTop, reference_log_probs

from tests.test_freeze import _actor as freeze_test_actor
from tests.test_freeze import _batch as freeze_test_batch

sys.modules.setdefault("flash_attn.ops.triton.cross_entropy", None)  # OpenRLHF's log-probs on the torch path


def _actor(layers=6, seed=0):
    actor = freeze_test_actor(layers, seed)
    actor.temperature = 0.7  # the rollout temperature, as Actor(path, ...) sets it: the log-probs are scaled by it
    return actor


def _batch():
    seq, mask = freeze_test_batch()
    return seq, mask, torch.ones(len(seq), 7)


def _train_top(actor, scale=0.05, seed=5):
    """Stands in for optimiser steps: every trained tensor moves, the frozen ones stay."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in actor.model.parameters():
            if p.requires_grad:
                p.add_(torch.randn(p.shape, generator=g) * scale)


def test_reference_from_the_policy_equals_a_separate_reference_model_after_training():
    """After the top layers trained, the policy's reference pass gives the log-probs of the untouched model loaded
    on its own (what OpenRLHF's ReferenceModelActor computes), and the policy's own pass does not. Catches the
    initial tensors captured after training (or not swapped in), and a swap that leaks into the policy."""
    policy, separate = _actor(), _actor()
    freeze_lower_layers(policy.model, 2)
    top = ReferenceTop.capture(policy.model)
    assert top.numel == sum(p.numel() for p in policy.model.parameters() if p.requires_grad)
    seq, mask, actions = _batch()
    with torch.no_grad():
        expected = separate(seq, actions, mask)
    _train_top(policy)
    with torch.no_grad():
        trained = policy(seq, actions, mask)
    ref = reference_log_probs(policy, top, seq, actions, mask)
    torch.testing.assert_close(ref, expected)
    assert (trained - expected).abs().max() > 1e-3  # the policy moved: the test is not vacuous
    with torch.no_grad():
        torch.testing.assert_close(policy(seq, actions, mask), trained)  # the swap is undone


def test_the_reference_pass_reads_the_trunk_the_experience_forward_stored():
    """The trunk runs once for both passes: the experience forward stores it, the reference pass hits the cache (and
    still equals the separate reference). Catches a reference pass that recomputes the trunk or reads another row."""
    policy, separate = _actor(), _actor()
    info = freeze_lower_layers(policy.model, 2)
    top = ReferenceTop.capture(policy.model)
    _train_top(policy)
    cache = TrunkCache.install(policy.model, info["boundary"])
    seq, mask, actions = _batch()
    with torch.no_grad():
        policy(seq, actions, mask)
        expected = separate(seq, actions, mask)
    assert (cache.hits, cache.misses) == (0, 1)
    order = [1, 2, 0]
    ref = reference_log_probs(policy, top, seq[order], actions[order], mask[order])
    assert (cache.hits, cache.misses) == (1, 1)
    torch.testing.assert_close(ref, expected[order], atol=1e-5, rtol=1e-4)


def test_capture_before_prepare_and_a_replaced_model_is_refused():
    """``freeze_before_prepare(keep_reference=True)`` captures the trained tensors as loaded (before DeepSpeed's
    prepare and any checkpoint load), the eval-only model is left alone, and a model rebuilt after the capture is a
    clear error instead of a silent reference of other tensors."""

    class Strategy:
        def prepare(self, *models, **kwargs):
            return models

    strategy = Strategy()
    figures = freeze_before_prepare(strategy, 1, keep_reference=True)
    policy, other = _actor(), _actor(seed=1)
    strategy.prepare((policy, {}), other)
    top = figures["reference_top"]
    assert len(top.tensors) == 10  # one layer (9 tensors) and the final norm
    names = sorted(top.by_name(policy))
    assert names[0].startswith("model.model.layers.5.") and names[-1] == "model.model.norm.weight"
    with pytest.raises(ValueError, match="replaced after the capture"):
        top.by_name(other)


def _args(**over):
    a = SimpleNamespace(
        algo=SimpleNamespace(kl=SimpleNamespace(init_coef=0.001)),
        actor=SimpleNamespace(trainable_layers=4, num_nodes=1, num_gpus_per_node=1),
        ref=SimpleNamespace(num_nodes=1, num_gpus_per_node=1, offload=False),
        ds=SimpleNamespace(zero_stage=2, lora=SimpleNamespace(rank=0)))
    for path, value in over.items():
        group, name = path.split("__")
        setattr(getattr(a, group), name, value)
    return a


@pytest.mark.parametrize("over, why", [
    ({}, None),
    ({"ds__zero_stage": 3}, "ZeRO-3"),
    ({"actor__trainable_layers": 0}, "every layer trains"),
    ({"ref__num_gpus_per_node": 2}, "layout"),
    ({"ref__offload": True}, "offload"),
    ({"ds__lora": SimpleNamespace(rank=8)}, "LoRA"),
])
def test_when_the_reference_can_live_in_the_policy(over, why):
    found = shared_reference.enabled(_args(**{k: v for k, v in over.items()}))
    assert found is None if why is None else why in found


def test_train_builds_a_view_of_the_policy_actors_for_the_reference():
    """Where OpenRLHF's ``train()`` builds the reference group, it gets the policy group's view: no actor is
    started, init is a no-op, and the experience maker's ``forward`` reaches the policy's ``reference_forward``."""
    built, calls = [], []

    class Group:
        def __init__(self, nodes, gpus, actor_type, *args, **kwargs):
            built.append(actor_type)

        def async_run_method_batch(self, method_name, **kwargs):
            calls.append(method_name)
            return ["ref"]

        def async_run_method(self, method_name, *args, **kwargs):
            calls.append(method_name)
            return []

    Policy, Reference = type("Policy", (), {}), type("Reference", (), {})
    module = SimpleNamespace(RayActorGroup=Group)
    shared_reference.install(module, Policy, Reference)
    policy = module.RayActorGroup(1, 1, Policy, pg=None)
    ref = module.RayActorGroup(1, 1, Reference, pg=None)
    assert built == [Policy] and ref.policy_group is policy
    assert ref.async_init_model_from_pretrained("strategy", "path") == []
    assert ref.async_run_method_batch(method_name="forward", sequences=[1]) == ["ref"]
    ref.async_run_method(method_name="empty_cache")
    assert calls == ["reference_forward", "empty_cache"]
