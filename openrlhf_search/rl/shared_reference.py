"""The reference model's log-probs computed inside the policy actor when only the top layers train.

With ``--actor.trainable_layers K`` the policy and the reference differ only in the top ``K`` layers and the final
norm, yet OpenRLHF 0.11.2 starts a second DeepSpeed model for the reference (``train_ppo_ray.py:94``) and runs all its
layers on every experience batch. Here, as TRL gets its LoRA reference by disabling the adapter, the policy actor keeps
the top layers' *initial* tensors (:class:`ReferenceTop`) and computes the reference log-probs with its own forward
through ``torch.func.functional_call``; the frozen trunk's output comes from the policy's
:class:`openrlhf_search.rl.freeze.TrunkCache`, stored by the experience forward just before (Ray runs one actor's
calls in submission order). :func:`install` makes OpenRLHF's ``train()`` build :class:`ReferenceInPolicyGroup` where
it would start the reference group; OpenRLHF's experience maker uses it as one (``experience_maker.py:175-181``).
"""

from __future__ import annotations  # torch is imported where it runs: the launch checks read this module too

from typing import TYPE_CHECKING, Dict, Optional

if TYPE_CHECKING:
    import torch


class ReferenceTop:
    """The initial values of a model's trained tensors (the top ``K`` layers and the final norm).

    :meth:`capture` clones every ``requires_grad`` parameter; call it after ``freeze_lower_layers`` and before the
    model is trained or a checkpoint is loaded. :meth:`by_name` maps them to the parameter names of the module the
    forward will be called on (DeepSpeed wraps the model after the capture: the Parameter objects stay, their
    names gain prefixes)."""

    def __init__(self, tensors: Dict[int, torch.Tensor]):
        self.tensors = tensors  # id(Parameter) -> initial value

    @classmethod
    def capture(cls, model: torch.nn.Module) -> "ReferenceTop":
        return cls({id(p): p.detach().clone() for p in model.parameters() if p.requires_grad})

    def by_name(self, module: torch.nn.Module) -> Dict[str, torch.Tensor]:
        """``{name: initial value}`` for ``module``'s parameters that were captured, in each one's current dtype
        and device. Raises ValueError when one is missing (the model was rebuilt after the capture)."""
        out, found = {}, set()
        for name, p in module.named_parameters(remove_duplicate=False):
            ref = self.tensors.get(id(p))
            if ref is not None:
                out[name] = ref.to(dtype=p.dtype, device=p.device)
                found.add(id(p))
        if found != set(self.tensors):
            raise ValueError(f"reference top: {len(self.tensors)} tensors captured, {len(found)} found in "
                             f"{type(module).__name__}; the model was replaced after the capture")
        return out

    @property
    def numel(self) -> int:
        return sum(t.numel() for t in self.tensors.values())


def reference_log_probs(actor: torch.nn.Module, top: ReferenceTop, *args, **kwargs) -> torch.Tensor:
    """``actor(*args, **kwargs)`` with the trained tensors replaced by their initial values (no grad): OpenRLHF's
    ``Actor.forward`` returns the action log-probs, [B, A] for [B, T] sequences, as the reference actor's would."""
    import torch

    with torch.no_grad():
        return torch.func.functional_call(actor, top.by_name(actor), args, kwargs, strict=False)


def enabled(args) -> Optional[str]:
    """Why the reference cannot live in the policy actor under ``args`` (OpenRLHF's grouped namespace), or None when
    it can: a KL term to a reference, top-layer training (``--actor.trainable_layers``), ZeRO 0-2 (ZeRO-3 shards the
    tensors the swap replaces), no LoRA, and the reference laid out as the policy (same nodes and GPUs per node, no
    reference offload)."""
    if args.algo.kl.init_coef <= 0:
        return "no KL term (no reference model)"
    if not getattr(args.actor, "trainable_layers", 0):
        return "every layer trains (--actor.trainable_layers 0)"
    if args.ds.zero_stage >= 3:
        return "ZeRO-3 shards the parameters"
    if getattr(args.ds, "lora", None) is not None and getattr(args.ds.lora, "rank", 0):
        return "LoRA"
    if (args.ref.num_nodes, args.ref.num_gpus_per_node) != (args.actor.num_nodes, args.actor.num_gpus_per_node):
        return "the reference has its own layout (--ref.num_nodes / --ref.num_gpus_per_node)"
    if getattr(args.ref, "offload", False):
        return "--ref.offload"
    return None


def starts_reference_model(args) -> bool:
    """Whether OpenRLHF's ``train()`` starts a reference model group under ``args`` (its GPUs, memory and process):
    a KL term (``--algo.kl.init_coef`` > 0) whose reference cannot live in the policy actors (:func:`enabled`)."""
    return (args.algo.kl.init_coef or 0) > 0 and enabled(args) is not None


class ReferenceInPolicyGroup:
    """What OpenRLHF's trainer and experience maker use as the reference ``RayActorGroup``, served by the policy
    actors: ``forward`` runs their ``reference_forward``; the model is built by the policy actors' own init."""

    def __init__(self, policy_group):
        self.policy_group = policy_group

    def async_init_model_from_pretrained(self, *args, **kwargs):
        return []

    def async_run_method_batch(self, method_name, **kwargs):
        name = "reference_forward" if method_name == "forward" else method_name
        return self.policy_group.async_run_method_batch(method_name=name, **kwargs)

    def async_run_method(self, method_name, *args, **kwargs):
        return self.policy_group.async_run_method(method_name, *args, **kwargs)


def install(module, policy_actor_class, reference_actor_class) -> None:
    """Make ``module.RayActorGroup`` (OpenRLHF's ``train_ppo_ray``) return a :class:`ReferenceInPolicyGroup` over
    the group last built of ``policy_actor_class`` when asked for a group of ``reference_actor_class``."""
    real = module.RayActorGroup
    built = {}

    def make_group(num_nodes, num_gpus_per_node, ray_actor_type, *args, **kwargs):
        if ray_actor_type is reference_actor_class and "policy" in built:
            return ReferenceInPolicyGroup(built["policy"])
        group = real(num_nodes, num_gpus_per_node, ray_actor_type, *args, **kwargs)
        if ray_actor_type is policy_actor_class:
            built["policy"] = group
        return group

    module.RayActorGroup = make_group
