#!/usr/bin/env bash
# R1-Searcher stage 1, Llama-3.1-8B-Instruct. Setting: released by default, SETTING=paper for the paper's (see r1searcher.sh and docs/parity.md). DRY_RUN=1 or --dry_run validates only.
exec bash "$(dirname "$0")/r1searcher.sh" llama8b-instruct 1 "$@"
