#!/usr/bin/env bash
# R1-Searcher stage 2, Qwen-2.5-7B-Base, from STAGE1_CKPT (the paper's two-stage recipe). Setting: paper (the released code has no Qwen stage 2: r1searcher_qwen7b_base_single.sh) (see r1searcher.sh and docs/parity.md). DRY_RUN=1 or --dry_run validates only.
exec bash "$(dirname "$0")/r1searcher.sh" qwen7b-base 2 "$@"
