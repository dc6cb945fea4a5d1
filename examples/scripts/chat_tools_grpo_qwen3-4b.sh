#!/usr/bin/env bash
# GRPO, Qwen3-4B with thinking, search as a native tool call (protocol chat_tools), EM reward. Settings are ours
# (see chat_tools.sh and docs/parity.md, "Native tool calling"). DRY_RUN=1 or --dry_run validates only.
ALGO=grpo exec bash "$(dirname "$0")/chat_tools.sh" qwen3-4b "$@"
