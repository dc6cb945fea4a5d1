"""Which policy parameters train, and the frozen-trunk cache that makes partial fine-tuning cheap on a CPU.

``--actor.trainable_layers K`` trains only the top ``K`` decoder layers and the final norm of a decoder-only HF
model (Llama / Qwen2 / Mistral layout: ``model.get_decoder().layers`` and ``.norm``); the embeddings, the (tied) LM
head and the lower layers stay frozen. Then:

- autograd stops at the first trainable layer, so a backward pass covers ``K`` layers, not all of them;
- the frozen *trunk* (embeddings + the lower ``L - K`` layers) computes the same hidden states for the policy
  before the update, for the frozen reference (a copy of the policy made after the warm start, so its trunk is the
  same) and for every micro-batch of the update. :func:`trunk_hidden` computes them once per rollout batch and
  :func:`top_hidden` runs only the top layers on them: one RL step then costs about one trunk forward instead of
  three full forwards and a full backward (measured on SmolLM2-135M, 30 layers, K = 4: see
  ``benchmarks/bench_learning.py``).

The split runs the model's own ``forward`` with a shortened ``layers`` list (and the final norm switched off for the
trunk), so masks and rotary positions are built exactly as in a full forward; ``tests/test_freeze.py`` checks that
trunk + top equals the full forward.
"""

import contextlib
from typing import Optional

import torch


class FreezeError(ValueError):
    """The model has no decoder-layer list to split, or K is out of range."""


def _decoder(model):
    dec = model.get_decoder() if hasattr(model, "get_decoder") else getattr(model, "model", None)
    if dec is None or not isinstance(getattr(dec, "layers", None), torch.nn.ModuleList) or not hasattr(dec, "norm"):
        raise FreezeError(f"{type(model).__name__}: no decoder with .layers (ModuleList) and .norm to split")
    return dec


def freeze_lower_layers(model, trainable_layers: int) -> dict:
    """Freeze all but the top ``trainable_layers`` decoder layers (and the final norm) of ``model``, in place.

    Args:
        model: an HF decoder-only causal LM.
        trainable_layers: K; 0 means train everything (nothing is frozen, no trunk cache).
    Returns:
        {"trainable_params", "total_params", "boundary"}: ``boundary`` = index of the first trainable layer
        (0 when nothing is frozen); it is also stored on the model as ``model._trunk_boundary``.
    Raises:
        FreezeError: K < 0 or K > number of layers, or a model without a splittable decoder.
    """
    if trainable_layers == 0:
        for p in model.parameters():
            p.requires_grad_(True)
        model._trunk_boundary = 0
        n = sum(p.numel() for p in model.parameters())
        return {"trainable_params": n, "total_params": n, "boundary": 0}
    dec = _decoder(model)
    n_layers = len(dec.layers)
    if not 0 < trainable_layers <= n_layers:
        raise FreezeError(f"--actor.trainable_layers must be in [0, {n_layers}], got {trainable_layers}")
    boundary = n_layers - trainable_layers
    for p in model.parameters():
        p.requires_grad_(False)
    for layer in dec.layers[boundary:]:
        for p in layer.parameters():
            p.requires_grad_(True)
    for p in dec.norm.parameters():
        p.requires_grad_(True)
    model._trunk_boundary = boundary
    return {"trainable_params": sum(p.numel() for p in model.parameters() if p.requires_grad),
            "total_params": sum(p.numel() for p in model.parameters()), "boundary": boundary}


def trunk_boundary(model) -> int:
    """Index of the first trainable decoder layer (0: no frozen trunk)."""
    return int(getattr(model, "_trunk_boundary", 0) or 0)


@contextlib.contextmanager
def _layers(dec, layers, norm):
    saved_layers, saved_norm = dec.layers, dec.norm
    dec.layers, dec.norm = torch.nn.ModuleList(layers), norm
    try:
        yield
    finally:
        dec.layers, dec.norm = saved_layers, saved_norm


@torch.no_grad()
def trunk_hidden(model, input_ids: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
    """Hidden states after the frozen lower layers (no final norm).

    Args:
        model: a model prepared by :func:`freeze_lower_layers` with K > 0.
        input_ids, attention_mask: [B, T] (right padding).
    Returns:
        [B, T, H] float tensor, no gradient.
    Raises:
        FreezeError: the model has no frozen trunk.
    """
    b = trunk_boundary(model)
    if b == 0:
        raise FreezeError("trunk_hidden: the model has no frozen trunk (trainable_layers = 0)")
    dec = _decoder(model)
    with _layers(dec, list(dec.layers)[:b], torch.nn.Identity()):
        return dec(input_ids=input_ids, attention_mask=attention_mask, use_cache=False).last_hidden_state


def top_hidden(model, trunk: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
    """The decoder's last hidden state (final norm applied) computed from cached trunk states.

    Args:
        model: the policy or its reference (same boundary, same frozen trunk weights).
        trunk: [B, T, H] from :func:`trunk_hidden` on the same batch.
        attention_mask: [B, T].
    Returns:
        [B, T, H]; differentiable with respect to the top layers when grad is enabled.
    """
    b = trunk_boundary(model)
    dec = _decoder(model)
    with _layers(dec, list(dec.layers)[b:], dec.norm):
        return dec(inputs_embeds=trunk, attention_mask=attention_mask, use_cache=False).last_hidden_state


def decoder_hidden(model, input_ids: torch.Tensor, attention_mask: torch.Tensor,
                   trunk: Optional[torch.Tensor] = None) -> torch.Tensor:
    """Last hidden state [B, T, H] of the decoder: from ``trunk`` when given (and the model is split), else a full
    forward without a KV cache."""
    if trunk is not None and trunk_boundary(model) > 0:
        return top_hidden(model, trunk, attention_mask)
    dec = model.get_decoder() if hasattr(model, "get_decoder") else model.base_model
    return dec(input_ids=input_ids, attention_mask=attention_mask, use_cache=False).last_hidden_state
