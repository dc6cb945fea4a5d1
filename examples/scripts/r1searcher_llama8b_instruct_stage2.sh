#!/usr/bin/env bash
# R1-Searcher stage 2, Llama-3.1-8B-Instruct, from STAGE1_CKPT. Setting: released by default, SETTING=paper for the paper's (see r1searcher.sh and docs/parity.md). DRY_RUN=1 or --dry_run validates only.
exec bash "$(dirname "$0")/r1searcher.sh" llama8b-instruct 2 "$@"
