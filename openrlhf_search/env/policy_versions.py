"""Which policy version produced each action token (asynchronous training with partial rollouts).

With ``--train.partial_rollout_enable`` OpenRLHF 0.11.2 syncs weights into engines that keep their in-flight
requests (``TrainingActor.broadcast_to_vllm``: ``pause_generation`` -> weights -> ``resume_generation``;
``vllm_engine.py``: ``llm.pause_generation(mode="keep")``), so one trajectory, even one turn, can hold tokens of two or
more policy versions. A version is the trainer step whose weights the engine holds (0 = the initial weights;
:func:`openrlhf_search.rl.step_timing.set_policy_version`, called by the trainer while the engines are paused).

The bookkeeping, from the engine to the trainer's experience: the engine tags every token it streams with its
version at that moment (:func:`wrap_llm_generate`; the version changes only while the engine is paused, and vLLM
hands out the last step's outputs before ``pause_generation`` returns, so old-weight tokens keep the old version);
the executor shifts each turn's segments to trajectory positions (:func:`shift_segments`) into ``action_versions``;
the generator turns them into an int tensor aligned with the sample's ``action_mask`` (:func:`versions_tensor`,
attribute :data:`TENSOR_ATTR` of the ``Experience``, which has no such field); the trainer attaches the
micro-batches' tensors (:func:`attach_to_experiences`) and logs ``async/samples_spanning_sync`` and the token
staleness (:func:`batch_stats`).
"""

from typing import Callable, List, Optional, Sequence, Tuple

import torch

Segments = List[Tuple[int, int]]  # [(first_token_index, version)], first indices strictly increasing

SEGMENTS_ATTR = "_search_token_versions"  # on a vLLM RequestOutput: segments over its output tokens
TENSOR_ATTR = "action_policy_versions"  # on an Experience: int64 (A,) per sample, (B, A) per micro-batch
NO_VERSION = -1  # positions that are not action tokens (prompt, retrieved documents, padding)


def extend_segments(segments: Segments, n_before: int, n_now: int, version: int) -> int:
    """Record that tokens ``n_before .. n_now - 1`` of an output were produced under ``version``.

    Appends ``(n_before, version)`` when the version differs from the last segment's (in place). Returns the new
    token count (``max(n_before, n_now)``)."""
    if n_now <= n_before:
        return n_before
    if not segments or segments[-1][1] != int(version):
        segments.append((int(n_before), int(version)))
    return n_now


def wrap_llm_generate(llm, get_version: Callable[[], int]) -> None:
    """Replace ``llm.generate`` (vLLM ``AsyncLLM``, an async generator of cumulative ``RequestOutput``) by one that
    tags every streamed token with ``get_version()`` and sets :data:`SEGMENTS_ATTR` on each output it yields (a copy
    of the segments so far over ``outputs[0].token_ids``). Idempotent."""
    if getattr(llm, "_search_versions_wrapped", False):
        return
    generate = llm.generate

    async def versioned_generate(*args, **kwargs):
        segments: Segments = []
        n_seen = 0
        async for out in generate(*args, **kwargs):
            outputs = getattr(out, "outputs", None) or []
            n_now = len(outputs[0].token_ids) if outputs else 0
            n_seen = extend_segments(segments, n_seen, n_now, get_version())
            setattr(out, SEGMENTS_ATTR, list(segments))
            yield out

    llm.generate = versioned_generate
    llm._search_versions_wrapped = True


def shift_segments(turn_segments: Optional[Segments], start: int, n_kept: int) -> Segments:
    """A turn's output segments as positions in the trajectory: ``start`` added, tokens past ``n_kept`` (the turn's
    tokens that were kept) dropped. Empty when the engine recorded nothing."""
    out: Segments = []
    for first, version in turn_segments or []:
        if first < n_kept:
            out.append((start + int(first), int(version)))
    return out


def merge_segments(segments: Sequence[Tuple[int, int]]) -> Segments:
    """Consecutive segments with one version fused (the turns of a trajectory, in order)."""
    out: Segments = []
    for first, version in segments:
        if not out or out[-1][1] != version:
            out.append((int(first), int(version)))
    return out


def versions_tensor(segments: Sequence[Tuple[int, int]], action_ranges: Sequence[Tuple[int, int]], n_tokens: int,
                    truncate_length: int) -> torch.Tensor:
    """Per-position versions aligned with OpenRLHF's ``action_mask`` of one sample.

    Args:
        segments: ``[(first_token_index, version)]`` over ``observation_tokens`` (the executor's ``action_versions``);
            a segment runs up to the next one's first index.
        action_ranges: the executor's ``[(start, end)]`` spans of action tokens.
        n_tokens: ``len(observation_tokens)``.
        truncate_length: ``--data.max_len``: OpenRLHF keeps ``observation_tokens[:truncate_length]`` and its action
            mask is ``mask[1:truncate_length]`` (``samples_generator._process_response_into_experience``).
    Returns:
        int64 tensor of length ``min(n_tokens, truncate_length) - 1``, the ``action_mask``'s: at position ``i`` the
        version of token ``i + 1`` when it is an action token, :data:`NO_VERSION` otherwise.
    Raises:
        ValueError: an action token before the first segment (no version recorded for it).
    """
    length = max(min(int(n_tokens), int(truncate_length)), 1)
    bounds = sorted((int(f), int(v)) for f, v in segments)
    for start, end in action_ranges:
        if end > start and (not bounds or start < bounds[0][0]):
            raise ValueError(f"action tokens from {start} have no recorded policy version (segments {bounds})")
    per_token = torch.full((length,), NO_VERSION, dtype=torch.long)
    for i, (first, version) in enumerate(bounds):
        stop = bounds[i + 1][0] if i + 1 < len(bounds) else length
        per_token[first:stop] = version
    action = torch.zeros(length, dtype=torch.bool)
    for start, end in action_ranges:
        action[start:end] = True
    per_token[~action] = NO_VERSION
    return per_token[1:]


def spans_sync(versions: torch.Tensor) -> torch.Tensor:
    """Per sample (rows of a ``(B, A)`` tensor, or one ``(A,)`` sample): whether its action tokens come from more than
    one policy version. Bool ``(B,)`` (or 0-d)."""
    v = versions if versions.dim() > 1 else versions.unsqueeze(0)
    valid = v != NO_VERSION
    big = torch.iinfo(v.dtype).max
    lo = torch.where(valid, v, torch.full_like(v, big)).min(dim=-1).values
    hi = torch.where(valid, v, torch.full_like(v, NO_VERSION)).max(dim=-1).values
    out = valid.any(dim=-1) & (hi > lo)
    return out if versions.dim() > 1 else out[0]


def batch_stats(per_sample: Sequence[torch.Tensor], global_step: int) -> dict:
    """Per-step figures of a rollout batch's per-sample version tensors (samples without one are skipped).

    Returns ``{}`` when none carries one, else ``async/samples_spanning_sync`` (count), ``async/token_staleness_mean``
    / ``_max`` (``global_step`` minus the version, over all action tokens) and ``async/token_versions_max`` (most
    distinct versions in one sample)."""
    tensors = [t for t in per_sample if t is not None]
    if not tensors:
        return {}
    spanning = sum(int(spans_sync(t)) for t in tensors)
    tokens = torch.cat([t[t != NO_VERSION] for t in tensors])
    most = max(int(torch.unique(t[t != NO_VERSION]).numel()) for t in tensors)
    out = {"async/samples_spanning_sync": float(spanning), "async/token_versions_max": float(most)}
    if tokens.numel():
        staleness = (global_step - tokens).float()
        out["async/token_staleness_mean"] = staleness.mean().item()
        out["async/token_staleness_max"] = staleness.max().item()
    return out


def attach_to_experiences(experiences: Sequence, rollout_samples: Sequence) -> None:
    """Give each micro-batch ``Experience`` a ``(B, A)`` :data:`TENSOR_ATTR` built from its samples' tensors, in the
    order of its ``index`` (the positions in ``rollout_samples`` that ``split_rollout_samples`` recorded), right-padded
    with :data:`NO_VERSION` to the micro-batch's ``action_mask`` width. Nothing is attached when a sample of the
    micro-batch has no tensor or the experience has no ``index``."""
    for exp in experiences:
        index = getattr(exp, "index", None)
        if not index:
            continue
        rows = [getattr(rollout_samples[i], TENSOR_ATTR, None) for i in index]
        if any(r is None for r in rows):
            continue
        width = exp.action_mask.shape[-1] if exp.action_mask is not None else max(len(r) for r in rows)
        out = torch.full((len(rows), width), NO_VERSION, dtype=torch.long)
        for j, r in enumerate(rows):
            n = min(len(r), width)
            out[j, :n] = r[:n]
        setattr(exp, TENSOR_ATTR, out)
