#!/usr/bin/env bash
# Search-R1 GRPO, Qwen2.5-7b base. Setting: released (SETTING=paper is identical; see searchr1.sh and
# docs/parity.md). DRY_RUN=1 or --dry_run validates only.
exec bash "$(dirname "$0")/searchr1.sh" grpo qwen2.5-7b base "$@"
