#!/usr/bin/env bash
# The validation-split figures of a finished held-out run of bench_train_local.py, without training again.
#
# Training does not depend on the evaluated split (the validation questions are carved by --data.seed and never
# trained on, whatever --eval.split says), so a held-out run's policies are the ones a validation run of the same
# flags and seed would train. This resumes the finished run in OUT (its step-N checkpoint and reference linked, not
# copied) with --eval.split validation, its before-RL validation pass (eval_before_validation.json, written by the
# held-out run for the baselines) as the "before", and evaluates the final policy on the validation questions: the
# before/after table, baselines and decomposition on validation, as `bench_train_local.py --split validation` prints.
#
#   bash benchmarks/validation_of_run.sh RUN SEED OUT [train_local flags of the run, after --preset default]
#   bash benchmarks/validation_of_run.sh runs/em_heldout/seed7 7 runs/em_val/seed7
set -euo pipefail
[ $# -ge 3 ] || { echo "usage: $0 RUN_DIR SEED OUT_DIR [flags]" >&2; exit 2; }
SRC=$1 SEED=$2 OUT=$3; shift 3
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
for f in train/checkpoints/latest train/eval_before_validation.json data/train.jsonl data/eval.jsonl data/corpus.jsonl; do
  [ -e "$SRC/$f" ] || { echo "$SRC/$f missing: not a finished held-out run of bench_train_local.py" >&2; exit 2; }
done
step=$(cat "$SRC/train/checkpoints/latest")
mkdir -p "$OUT/train/checkpoints"
ln -sfn "$(realpath "$SRC/train/checkpoints/$step")" "$OUT/train/checkpoints/$step"
ln -sfn "$(realpath "$SRC/train/checkpoints/ref")" "$OUT/train/checkpoints/ref"
cp "$SRC/train/checkpoints/latest" "$OUT/train/checkpoints/latest"
cp "$SRC/train/eval_before_validation.json" "$OUT/train/eval_before.json"
cp "$SRC/train/metrics.jsonl" "$SRC/train/warmstart.jsonl" "$OUT/train/"
export PYTHONPATH="$ROOT" OMP_NUM_THREADS="${OMP_NUM_THREADS:-1}" TOKENIZERS_PARALLELISM=false HF_HUB_OFFLINE=1
"${PYTHON:-$ROOT/.venv/bin/python}" -m openrlhf_search.cli.train_local --preset default \
  --train_data "$SRC/data/train.jsonl" --eval_data "$SRC/data/eval.jsonl" --corpus "$SRC/data/corpus.jsonl" \
  --retriever.encoder bm25 --train.seed "$SEED" --eval.split validation --ckpt.output_dir "$OUT/train" "$@"
