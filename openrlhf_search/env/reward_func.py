"""OpenRLHF's reward-function file: ``--reward.remote_url openrlhf_search/env/reward_func.py``.

OpenRLHF 0.11.2's ``SingleTurnAgentExecutor`` loads this file by path and calls
``reward_func(queries, prompts, labels)`` with ``queries[i]`` = the decoded prompt + response (special tokens
kept) and ``prompts[i]`` = the prompt string; it reads ``rewards``, ``scores`` and ``extra_logs`` from the returned
dict. This file scores trajectories produced outside our search executor (single-turn baselines, rescoring) with the
same reward schemes; the scheme and protocol come from ``SearchConfig.from_env()`` (``OPENRLHF_SEARCH_CONFIG``).
"""

from __future__ import annotations

import logging
import os
import sys
from typing import Dict, List, Sequence

import torch

# The file is loaded by path (importlib), so make the package importable from the repository root.
_ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # the repository root
if _ROOT not in sys.path:
    sys.path.insert(0, _ROOT)

from openrlhf_search.env.config import SearchConfig  # noqa: E402
from openrlhf_search.env.protocol import get_protocol  # noqa: E402
from openrlhf_search.env.rewards import compute_reward  # noqa: E402

logger = logging.getLogger(__name__)

__all__ = ["reward_func", "response_from_query"]


def response_from_query(query: str, prompt: str) -> str:
    """The response part of ``query`` (= prompt + response, decoded).

    ``query[len(prompt):]`` when the decode reproduced the prompt exactly; otherwise the text after the last
    occurrence of the prompt's final 200 characters (decode may differ in leading special tokens or spaces).

    Raises:
        ValueError: the prompt cannot be found in the query (the sample would be scored on the wrong text).
    """
    if query.startswith(prompt):
        return query[len(prompt):]
    tail = prompt[-200:]
    pos = query.rfind(tail) if tail else -1
    if pos < 0:
        raise ValueError("reward_func: the prompt is not a prefix of the query; cannot locate the response")
    return query[pos + len(tail):]


def reward_func(queries: Sequence[str], prompts: Sequence[str], labels: Sequence, **kwargs) -> Dict:
    """Score a batch of trajectories (OpenRLHF's reward-function file contract).

    Args:
        queries: B decoded prompt+response strings.
        prompts: B prompt strings.
        labels: B gold-answer labels (string, JSON list string, list, or ``{"target": [...]}``).

    Returns:
        dict with ``rewards`` (float tensor [B], the training reward of the configured scheme), ``scores``
        (float tensor [B], answer correctness in [0, 1] for dynamic filtering) and ``extra_logs`` (dict of float
        tensors [B]: em, f1, cover_em, format_ok, answer_present, valid_searches, ...).

    Raises:
        ValueError: the three lists differ in length, or a sample's prompt is not in its query, or a label is
            unreadable (the message names the sample index).
    """
    if not (len(queries) == len(prompts) == len(labels)):
        raise ValueError(f"reward_func: {len(queries)} queries, {len(prompts)} prompts, {len(labels)} labels")
    cfg = SearchConfig.from_env()
    protocol = get_protocol(cfg.protocol)
    rewards: List[float] = []
    scores: List[float] = []
    logs: Dict[str, List[float]] = {}
    for i, (query, prompt, label) in enumerate(zip(queries, prompts, labels)):
        try:
            response = response_from_query(query, prompt)
            result = compute_reward(cfg.reward_scheme, response, label, protocol,
                                    answer_max_words=cfg.answer_max_words)
        except ValueError as e:
            raise ValueError(f"reward_func: sample {i}: {e}") from e
        rewards.append(float(result.reward))
        scores.append(result.score)
        for key, value in result.components.items():
            logs.setdefault(key, []).append(float(value))
    n = len(rewards)
    extra_logs = {k: torch.tensor(v, dtype=torch.float32) for k, v in logs.items() if len(v) == n}
    return {
        "rewards": torch.tensor(rewards, dtype=torch.float32),
        "scores": torch.tensor(scores, dtype=torch.float32),
        "extra_logs": extra_logs,
    }
