"""Training only the top K decoder layers (``--actor.trainable_layers K``) and the frozen-trunk cache.

``freeze_lower_layers`` leaves ``requires_grad`` on the top ``K`` decoder layers and the final norm of a decoder-only
HF model (Llama / Qwen2 / Mistral layout: ``model.get_decoder().layers`` and ``.norm``); the embeddings, the (tied)
LM head and the lower layers are frozen. Called before ``DeepspeedStrategy.prepare``, it shrinks the optimiser to the
trainable tensors: OpenRLHF's ``get_optimizer_grouped_parameters`` keeps only ``requires_grad`` parameters
(``openrlhf/utils/deepspeed/deepspeed_utils.py``), and autograd stops at the first trainable layer.

:class:`TrunkCache` saves the second forward of the frozen *trunk* (embeddings + the lower ``L - K`` layers): the
policy's experience forward (old log-probs) stores the trunk's output per sequence, and the update's forward on the
same sequences, in whatever micro-batches and padding, skips the frozen layers and starts from the stored states.
The trunk's weights never change, so the states are the ones the update would compute (up to float summation order
across batch shapes). Module names and the model's own ``forward`` are untouched: each frozen layer's ``forward``
becomes the identity (the last one returns the stored states) only while a batch whose every sequence is stored runs.
"""

import functools
import sys
from typing import Dict, List, Optional, Tuple

import torch


class FreezeError(ValueError):
    """The model has no decoder-layer list to split, or K is out of range."""


def decoder_of(model):
    """The decoder (``.layers`` ModuleList and ``.norm``) of an HF causal LM, seen through OpenRLHF's ``Actor``,
    PEFT's wrappers and DeepSpeed's engine.

    Raises:
        FreezeError: no such decoder.
    """
    node = model
    for _ in range(6):
        if node is None:
            break
        if isinstance(getattr(node, "layers", None), torch.nn.ModuleList) and hasattr(node, "norm"):
            return node
        inner = getattr(node, "module", None) or getattr(node, "model", None) or getattr(node, "base_model", None)
        node = inner if inner is not node else None
    raise FreezeError(f"{type(model).__name__}: no decoder with .layers (ModuleList) and .norm to split; "
                      "--actor.trainable_layers needs a decoder-only HF model (Llama, Qwen2, Mistral layout)")


def freeze_lower_layers(model, trainable_layers: int) -> Dict[str, int]:
    """Freeze all but the top ``trainable_layers`` decoder layers and the final norm of ``model``, in place.

    Args:
        model: an HF decoder-only causal LM (or a wrapper :func:`decoder_of` sees through).
        trainable_layers: K >= 1.
    Returns:
        {"trainable_params", "total_params", "boundary"}: ``boundary`` = index of the first trainable layer.
    Raises:
        FreezeError: K < 1 or K > number of layers, or no splittable decoder.
    """
    dec = decoder_of(model)
    n_layers = len(dec.layers)
    if not 0 < trainable_layers <= n_layers:
        raise FreezeError(f"--actor.trainable_layers must be in [1, {n_layers}] for this model, got "
                          f"{trainable_layers}")
    boundary = n_layers - trainable_layers
    for p in model.parameters():
        p.requires_grad_(False)
    for layer in dec.layers[boundary:]:
        for p in layer.parameters():
            p.requires_grad_(True)
    for p in dec.norm.parameters():
        p.requires_grad_(True)
    return {"trainable_params": sum(p.numel() for p in model.parameters() if p.requires_grad),
            "total_params": sum(p.numel() for p in model.parameters()), "boundary": boundary}


def freeze_before_prepare(strategy, trainable_layers: int, trunk_cache: bool = False,
                          keep_reference: bool = False) -> dict:
    """Make ``strategy.prepare`` (OpenRLHF's ``DeepspeedStrategy``) freeze the lower layers of the model it is handed
    with an optimiser config (the trained model), so DeepSpeed's optimiser holds only the trained tensors.

    Returns a dict that, once ``prepare`` has run, holds :func:`freeze_lower_layers`' figures (``boundary``,
    ``trainable_params``, ``total_params``), with ``trunk_cache`` the model's :class:`TrunkCache`
    (``"trunk_cache"``) and with ``keep_reference`` the trained tensors' initial values
    (``"reference_top"``, :class:`openrlhf_search.rl.shared_reference.ReferenceTop`)."""
    real_prepare = strategy.prepare
    figures: dict = {}

    def prepare(*models, **kwargs):
        trained = [item[0] for item in models if isinstance(item, tuple)]  # (model, optimiser config)
        for model in trained:
            figures.update(freeze_lower_layers(model.model, trainable_layers))
            print(f"[freeze] top {trainable_layers} layers: {figures['trainable_params']:,} of "
                  f"{figures['total_params']:,} parameters train (layers from {figures['boundary']} up and the final "
                  "norm)", file=sys.stderr, flush=True)
            if keep_reference:  # before DeepSpeed and any checkpoint: the reference is the model as loaded
                from openrlhf_search.rl.shared_reference import ReferenceTop

                figures["reference_top"] = ReferenceTop.capture(model.model)
        out = real_prepare(*models, **kwargs)
        if trunk_cache and trained and figures["boundary"] > 0:
            figures["trunk_cache"] = TrunkCache.install(trained[0].model, figures["boundary"])
        return out

    strategy.prepare = prepare
    return figures


class TrunkCache:
    """Stores the frozen trunk's output per sequence and replays it for later forwards of the same sequences.

    Installed on the model by :meth:`install` (after :func:`freeze_lower_layers`). A forward whose every row's
    attended tokens are stored skips the frozen layers (``hits`` counts such forwards); any other forward runs them
    and stores each row's states (``misses``). :meth:`clear` drops every entry (the policy actor clears it after each
    training step, so it holds one rollout batch: [tokens, hidden] floats per sequence).
    """

    def __init__(self, boundary: int):
        self.boundary = boundary
        self.entries: Dict[Tuple[int, ...], torch.Tensor] = {}
        self.hits = self.misses = 0
        self._plan: Optional[dict] = None

    @classmethod
    def install(cls, model, boundary: int) -> "TrunkCache":
        """Wrap the decoder of ``model`` (hooks on the decoder, ``forward`` of layers ``< boundary``); returns the
        cache. Raises FreezeError (no decoder) or ValueError (boundary out of range)."""
        dec = decoder_of(model)
        if not 0 < boundary < len(dec.layers):
            raise ValueError(f"trunk boundary {boundary} outside (0, {len(dec.layers)})")
        cache = cls(boundary)
        dec.register_forward_pre_hook(cache._before_decoder, with_kwargs=True)
        dec.register_forward_hook(cache._after_decoder)
        for i in range(boundary):
            layer = dec.layers[i]
            layer.forward = functools.partial(cache._frozen_layer, i, layer.forward)
        return cache

    def clear(self) -> None:
        self.entries.clear()

    @staticmethod
    def _keys(input_ids: torch.Tensor, attention_mask: torch.Tensor) -> List[Tuple[int, ...]]:
        ids, mask = input_ids.detach().cpu(), attention_mask.detach().cpu().bool()
        return [tuple(row[m].tolist()) for row, m in zip(ids, mask)]

    def _before_decoder(self, module, args, kwargs):
        input_ids = kwargs.get("input_ids", args[0] if args else None)
        mask = kwargs.get("attention_mask")
        self._plan = None
        if input_ids is None or mask is None or mask.dim() != 2 or kwargs.get("past_key_values") is not None:
            return None  # generation with a KV cache, or inputs_embeds: the trunk runs as usual, nothing stored
        keys = self._keys(input_ids, mask)
        hit = all(k in self.entries for k in keys)
        self._plan = {"keys": keys, "mask": mask.bool(), "hit": hit}
        if hit:
            self.hits += 1
        else:
            self.misses += 1
        return None

    def _after_decoder(self, module, args, output):
        self._plan = None
        return None

    def _frozen_layer(self, index: int, real_forward, hidden_states, *args, **kwargs):
        plan = self._plan
        if plan is None:
            return real_forward(hidden_states, *args, **kwargs)
        last = index == self.boundary - 1
        if not plan["hit"]:
            out = real_forward(hidden_states, *args, **kwargs)
            if last:
                states = out.detach()
                for key, row, m in zip(plan["keys"], states, plan["mask"]):
                    self.entries[key] = row[m.to(row.device)].clone()
            return out
        if not last:
            return hidden_states  # skipped: the last frozen layer returns the stored states
        out = hidden_states.new_zeros(hidden_states.shape)
        for i, (key, m) in enumerate(zip(plan["keys"], plan["mask"])):
            out[i, m.to(out.device)] = self.entries[key].to(out.dtype)
        return out
