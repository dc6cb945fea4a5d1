"""The policy's context length against the run's ``--data.max_len``, checked when a run starts.

A trajectory longer than the engine's context fails in the middle of a step (vLLM: ``prompt has 753 tokens,
max_model_len is 700``) or, on the cluster path, when the vLLM engines
start with ``max_model_len = --data.max_len`` above what the model supports. Both are refused here first, in one line.
"""

import json
import os
from typing import Optional


def model_context_length(model_path: Optional[str]) -> Optional[int]:
    """``max_position_embeddings`` of a local model folder's ``config.json`` (tokens); None for a hub name, a
    folder without a config, or a config without the field."""
    if not model_path or not os.path.isdir(model_path):
        return None
    try:
        with open(os.path.join(model_path, "config.json"), encoding="utf-8") as f:
            config = json.load(f)
    except (OSError, ValueError):
        return None
    value = config.get("max_position_embeddings") or (config.get("text_config") or {}).get("max_position_embeddings")
    return int(value) if value else None


def context_error(max_len: int, context: Optional[int], flag: str = "--data.max_len") -> Optional[str]:
    """The one-line refusal when ``max_len`` exceeds ``context`` (None when it fits or the context is unknown)."""
    if context is None or max_len is None or int(max_len) <= int(context):
        return None
    return (f"{flag} {max_len} exceeds the policy's context of {context} tokens (max_position_embeddings): "
            f"trajectories would fail mid-step; lower {flag} to at most {context}")
