"""Supervised fine-tuning on search trajectories with the documents blocks masked, through OpenRLHF's SFT trainer.

A warm start before RL (``python -m openrlhf_search.cli.sft``) must train the policy's own tokens only, as the RL
loss does (Search-R1's retrieved-token masking, arXiv 2503.09516 sec. 3.1), on exactly the tokens a rollout holds, so
each trajectory is stored tokenised as the executor builds rollouts, with the spans the policy wrote:

    {"input_ids": [int, ...], "action_ranges": [[start, end], ...], ...any other field}

(half-open token spans of model turns). OpenRLHF's ``SFTDataset`` masks the prompt only, or inserts chat markers
with ``--data.multiturn``; :class:`TrajectorySFTDataset` replaces it inside OpenRLHF's own ``train_sft.train``.
Its loss mask follows ``SFTDataset``'s convention: position ``t`` is trained when token ``t + 1`` is a policy token.
"""

import json
import logging
from typing import Iterable, List, Sequence, Tuple

import torch
from torch.utils.data import Dataset

import openrlhf_search._cpu_compat  # noqa: F401  (before any openrlhf import)
from openrlhf.datasets import SFTDataset

logger = logging.getLogger(__name__)


class TrajectoryFormatError(ValueError):
    """A trajectory row is not ``{"input_ids": [...], "action_ranges": [[s, e], ...]}`` with spans inside it."""


def check_trajectory(input_ids: Sequence[int], action_ranges: Iterable[Sequence[int]],
                     where: str = "trajectory") -> List[Tuple[int, int]]:
    """The spans as sorted ``(start, end)`` pairs, after checking them against ``input_ids``.

    Raises:
        TrajectoryFormatError: no token, no span, a span that is empty, overlaps another or leaves the sequence, or a
            span starting at 0 (a first token has no position predicting it).
    """
    n = len(input_ids)
    if n == 0:
        raise TrajectoryFormatError(f"{where}: no input_ids")
    if not all(isinstance(t, int) for t in input_ids):
        raise TrajectoryFormatError(f"{where}: input_ids must be integers")
    try:
        spans = sorted((int(s), int(e)) for s, e in action_ranges)
    except (TypeError, ValueError):
        raise TrajectoryFormatError(f"{where}: action_ranges must be [[start, end], ...]") from None
    if not spans:
        raise TrajectoryFormatError(f"{where}: no action_ranges (nothing to train on)")
    last = 0
    for s, e in spans:
        if not (1 <= s < e <= n) or s < last:
            raise TrajectoryFormatError(f"{where}: span [{s}, {e}) is empty, overlaps another or leaves the "
                                        f"{n} tokens (spans start at >= 1)")
        last = e
    return spans


def loss_mask(n_tokens: int, action_ranges: Sequence[Tuple[int, int]]) -> torch.Tensor:
    """[1, n_tokens] float mask: 1 at position ``t`` when token ``t + 1`` lies in an action span (``SFTDataset``'s
    shifted convention: ``SFTTrainer`` reads ``loss_mask[:, :-1]`` against the log-probs of the next tokens)."""
    mask = torch.zeros(1, n_tokens, dtype=torch.float32)
    for s, e in action_ranges:
        mask[0, s - 1: e - 1] = 1
    return mask


class TrajectorySFTDataset(SFTDataset):
    """``SFTDataset``'s interface (constructor arguments, ``__getitem__`` -> ``(input_ids, attention_mask,
    loss_mask)`` each ``[1, T]``, ``collate_fn``) over pre-tokenised trajectories; only action tokens are trained.

    A trajectory longer than ``max_length`` is cut to it (its spans clipped; a row left without an action token is
    dropped), and both counts are logged.

    Raises:
        TrajectoryFormatError: a row without ``input_ids`` / ``action_ranges`` or with invalid spans (the row is
            named), or no usable row.
    """

    def __init__(self, dataset, tokenizer, max_length: int, strategy, input_template=None, pretrain_mode=False,
                 num_processors=8, multiturn=False):
        Dataset.__init__(self)
        self.tokenizer, self.strategy, self.max_length = tokenizer, strategy, max_length
        self.pretrain_mode, self.multiturn = False, False
        self.rows: List[Tuple[List[int], List[Tuple[int, int]]]] = []
        cut = dropped = 0
        for i, row in enumerate(dataset):
            if "input_ids" not in row or "action_ranges" not in row:
                raise TrajectoryFormatError(f"trajectory row {i}: needs 'input_ids' and 'action_ranges' (fields: "
                                            f"{sorted(row)})")
            ids = list(row["input_ids"])
            spans = check_trajectory(ids, row["action_ranges"], where=f"trajectory row {i}")
            if len(ids) > max_length:
                cut += 1
                ids = ids[:max_length]
                spans = [(s, min(e, max_length)) for s, e in spans if s < max_length]
                if not spans:
                    dropped += 1
                    continue
            self.rows.append((ids, spans))
        if cut:
            logger.warning(f"{cut} trajectories longer than --data.max_len {max_length} were cut ({dropped} left "
                           "without a policy token and dropped)")
        if not self.rows:
            raise TrajectoryFormatError("no trajectory with a policy token to train on")

    def __len__(self):
        return len(self.rows)

    def __getitem__(self, idx):
        ids, spans = self.rows[idx]
        input_ids = torch.tensor([ids], dtype=torch.long)
        return input_ids, torch.ones_like(input_ids), loss_mask(len(ids), spans)


def write_trajectories(path: str, rows: Iterable[dict]) -> int:
    """Write trajectory rows (each checked with :func:`check_trajectory`) as jsonl; returns the count.

    Raises:
        TrajectoryFormatError: a row is invalid (nothing is written past it).
    """
    n = 0
    with open(path, "w", encoding="utf-8") as f:
        for i, row in enumerate(rows):
            check_trajectory(row["input_ids"], row["action_ranges"], where=f"trajectory row {i}")
            f.write(json.dumps(row, ensure_ascii=False) + "\n")
            n += 1
    return n
