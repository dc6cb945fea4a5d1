"""Warm start before RL: OpenRLHF's ``train_sft`` on search trajectories, the documents blocks out of the loss.

    python -m openrlhf_search.cli.sft --data.dataset trajectories.jsonl --model.model_name_or_path MODEL \\
        --ckpt.output_dir OUT [every OpenRLHF train_sft flag] [--model.trainable_layers K] [--cpu]

Each row of ``--data.dataset`` is a tokenised trajectory ``{"input_ids": [...], "action_ranges": [[s, e], ...]}``
(:mod:`openrlhf_search.rl.sft`). OpenRLHF's parser, validation, trainer, loss, optimiser, LR schedule and checkpoints
run unchanged (its ``__main__`` block is reused, as ``cli.train`` reuses ``train_ppo_ray``'s); injected where its
``train()`` looks them up: the dataset class (:class:`~openrlhf_search.rl.sft.TrajectorySFTDataset`) and, with
``--model.trainable_layers K``, a strategy that freezes all but the top ``K`` decoder layers
(:mod:`openrlhf_search.rl.freeze`). The HF model is written to ``--ckpt.output_dir``.

``--cpu``: run on this machine's CPU in this process (one data-parallel rank over gloo, the CPU cluster mode's
patches and settings: :mod:`openrlhf_search.cpu.cluster_mode.runtime`); ``--ds.param_dtype fp32`` is accepted
there. On GPUs launch it like OpenRLHF's ``train_sft`` (``deepspeed --module openrlhf_search.cli.sft ...``).
"""

import os
import socket
import sys
from typing import List, Optional

import openrlhf_search._cpu_compat  # noqa: F401  (before any openrlhf import)
from openrlhf_search.cli.train_args import FP32, OpenRLHFMain, allow_cpu_fp32, one_line_error

OPENRLHF_SFT_MODULE = "openrlhf.cli.train_sft"


def build_parser():
    """OpenRLHF's ``train_sft`` parser (built by its own code) with ``--model.trainable_layers`` and ``--cpu``."""
    import types

    parser = OpenRLHFMain(OPENRLHF_SFT_MODULE).build_parser()
    parser.prog = "python -m openrlhf_search.cli.sft"
    parser.add_argument("--model.trainable_layers", type=int, default=0,
                        help="train only the top K decoder layers and the final norm (0: every parameter)")
    parser.add_argument("--cpu", action="store_true", default=False,
                        help="run on this machine's CPU in this process (gloo, the CPU cluster mode's patches; "
                             "--ds.param_dtype fp32 allowed)")
    allow_cpu_fp32(parser)
    parser.error = types.MethodType(one_line_error, parser)
    return parser


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _single_rank_env() -> None:
    """The environment ``deepspeed.init_distributed`` reads, for one rank on this machine (unless a launcher set
    it)."""
    for key, value in (("RANK", "0"), ("LOCAL_RANK", "0"), ("WORLD_SIZE", "1"), ("LOCAL_WORLD_SIZE", "1"),
                       ("MASTER_ADDR", "127.0.0.1")):
        os.environ.setdefault(key, value)
    os.environ.setdefault("MASTER_PORT", str(_free_port()))


def check_data(path: Optional[str]) -> Optional[str]:
    """One line naming what is wrong with ``--data.dataset`` (a local trajectories jsonl: token ids belong to one
    tokenizer), None when its first row is a trajectory."""
    import json

    from openrlhf_search.rl.sft import TrajectoryFormatError, check_trajectory

    if not path:
        return "--data.dataset is required (a jsonl of {\"input_ids\": [...], \"action_ranges\": [[s, e], ...]})"
    if not os.path.exists(path):
        return f"--data.dataset {path}: no such file"
    try:
        with open(path, encoding="utf-8") as f:
            first = next((line for line in f if line.strip()), None)
        if first is None:
            return f"--data.dataset {path}: empty"
        row = json.loads(first)
        check_trajectory(row.get("input_ids") or [], row.get("action_ranges") or [], where=f"{path} row 0")
    except (OSError, json.JSONDecodeError, TrajectoryFormatError, AttributeError) as e:
        return f"--data.dataset {path}: {e}"
    return None


def main(argv: Optional[List[str]] = None) -> int:
    parser = build_parser()
    flat = parser.parse_args(argv)
    main_block = OpenRLHFMain(OPENRLHF_SFT_MODULE)
    if flat.cpu:
        from openrlhf_search.cpu.cluster_mode import runtime
        from openrlhf_search.cpu.cluster_mode.settings import apply_cpu_settings

        for line in apply_cpu_settings(flat):
            print(f"[cpu] {line}", file=sys.stderr)
        runtime.install()
        _single_rank_env()
    elif getattr(flat, "ds.param_dtype") == FP32:
        print("error: --ds.param_dtype fp32 needs --cpu (GPU runs train in bf16 or fp16)", file=sys.stderr)
        return 2
    if getattr(flat, "model.trainable_layers") < 0:
        print("error: --model.trainable_layers must be >= 0", file=sys.stderr)
        return 2
    problem = check_data(getattr(flat, "data.dataset"))
    if problem:
        print(f"error: {problem}", file=sys.stderr)
        return 2
    args = main_block.validate(flat)
    module = main_block.module
    from openrlhf_search.rl.sft import TrajectorySFTDataset

    module.SFTDataset = TrajectorySFTDataset
    k = args.model.trainable_layers
    if k:
        from openrlhf_search.rl.freeze import freeze_before_prepare

        real_get_strategy = module.get_strategy

        def get_strategy(a):
            strategy = real_get_strategy(a)
            freeze_before_prepare(strategy, k, trunk_cache=a.ds.zero_stage < 3)
            return strategy

        module.get_strategy = get_strategy
    module.train(args)
    return 0


if __name__ == "__main__":
    sys.exit(main())
