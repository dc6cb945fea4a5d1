"""Rollout batches that divide evenly over the data-parallel ranks.

OpenRLHF 0.11.2 trains the partial last prompt batch of every pass over the data, and a dynamic-filtering step can
end short. Its rollout micro-batches are dealt to the ranks in chunks of ``ceil(micro-batches / ranks)``
(``openrlhf/trainer/ray/launcher.py:346-356``: 18 over 8 ranks give 3,3,3,3,3,3,0,0; fewer than ranks raise), and
under ZeRO-3 every forward and micro-step is collective, so ranks with less data wait until the NCCL timeout. One
level up, DeepSpeed steps the optimiser only at a gradient-accumulation boundary, so a batch smaller than
``--train.batch_size`` leaks its gradients into the next step.

Policy (verl's ``drop_last`` for the tail, applied to any short batch): keep the largest multiple of
``lcm(--rollout.micro_batch_size x lcm(ranks), --train.batch_size, n_samples_per_prompt)`` samples (whole prompt
groups) and drop the rest (those prompts come back in the next pass). A launcher's full batch is never cut (the
launchers' layout check).
"""

import math
from typing import List, Sequence, Tuple


def data_parallel_ranks(args) -> List[int]:
    """Data-parallel ranks of each trained / forwarded model group: actor, reference, critic (nodes x GPUs per node
    / ring-attention size / DeepSpeed tensor parallel size; models that are not configured are left out)."""
    ring = int(getattr(args.ds, "ring_attn_size", 1) or 1)
    tp = int(getattr(args.ds, "tensor_parallel_size", 1) or 1)
    out = []
    for who in ("actor", "ref", "critic"):
        group = getattr(args, who, None)
        if group is None or not getattr(group, "num_gpus_per_node", None):
            continue
        if who == "critic" and not getattr(group, "model_name_or_path", None):
            continue
        out.append(max(1, int(group.num_nodes) * int(group.num_gpus_per_node) // ring // tp))
    return out or [1]


def even_unit(micro_batch_size: int, ranks: Sequence[int], n_samples_per_prompt: int,
              train_batch_size: int = 1) -> int:
    """Samples per even unit: a multiple of ``micro_batch_size x lcm(ranks)`` (rollout micro-batches on every rank)
    and of ``train_batch_size`` (whole optimiser steps), made of whole prompt groups."""
    per_round = int(micro_batch_size) * math.lcm(*[int(r) for r in ranks])
    return math.lcm(per_round, int(train_batch_size), int(n_samples_per_prompt))


def unit_of(args, n_samples_per_prompt: int) -> int:
    """:func:`even_unit` for OpenRLHF's parsed ``args``."""
    return even_unit(args.rollout.micro_batch_size, data_parallel_ranks(args), n_samples_per_prompt,
                     args.train.batch_size)


def even_share(samples: Sequence, unit: int) -> Tuple[list, int]:
    """(the first ``floor(len / unit) x unit`` samples, how many were dropped). Samples are in prompt-group order,
    as OpenRLHF's generator returns them, so only whole trailing groups are dropped."""
    keep = len(samples) // unit * unit
    return list(samples[:keep]), len(samples) - keep


def tail_prompts_dropped(rows: int, rollout_batch_size: int, n_samples_per_prompt: int, unit: int) -> int:
    """Prompts of a pass over ``rows`` prompts that are never trained on (its partial last batch cut to a unit)."""
    tail = rows % rollout_batch_size
    kept_samples = tail * n_samples_per_prompt // unit * unit
    return tail - kept_samples // n_samples_per_prompt
