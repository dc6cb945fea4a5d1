#!/usr/bin/env bash
# R1-Searcher stage 1, Qwen-2.5-7B-Base (the paper's two-stage recipe). Setting: paper (the released code has no Qwen stage 1: r1searcher_qwen7b_base_single.sh) (see r1searcher.sh and docs/parity.md). DRY_RUN=1 or --dry_run validates only.
exec bash "$(dirname "$0")/r1searcher.sh" qwen7b-base 1 "$@"
