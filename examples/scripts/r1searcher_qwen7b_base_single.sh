#!/usr/bin/env bash
# R1-Searcher Qwen-2.5-7B-Base, the released single run on the stage-2 reward. Setting: released (the only one) (see r1searcher.sh and docs/parity.md). DRY_RUN=1 or --dry_run validates only.
exec bash "$(dirname "$0")/r1searcher.sh" qwen7b-base single "$@"
