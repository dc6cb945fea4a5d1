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
#   bash benchmarks/validation_of_run.sh RUN SEED OUT [more main_job.train flags]
#   bash benchmarks/validation_of_run.sh runs/em_heldout/seed7 7 runs/em_val/seed7
# The run's preset and --job_args are read from RUN/bench_train_local.json (PRESET=NAME overrides the preset: a run
# written before the JSON recorded it, with empty job_args, ran the default of its day), SEED must be the run's.
# OUT must be new (or hold only an earlier evaluation of this script): nothing is written into RUN.
# SPLIT=heldout BEFORE=FILE: the other way round, a validation run's final policy on the held-out questions, FILE the
# held-out before-RL evaluation (eval_before.json) of a run with the same warm start (same seed and warm-start flags;
# the RL flags may differ), e.g. a held-out run of the default for a validation trial of another RL setting.
set -euo pipefail
[ $# -ge 3 ] || { echo "usage: $0 RUN_DIR SEED OUT_DIR [flags]" >&2; exit 2; }
SRC=$1 SEED=$2 OUT=$3; shift 3
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
PY="${PYTHON:-$ROOT/.venv/bin/python}"
[[ "$SEED" =~ ^[0-9]+$ ]] || { echo "SEED must be an integer, got '$SEED'" >&2; exit 2; }
SPLIT="${SPLIT:-validation}"
case "$SPLIT" in
  validation) BEFORE="${BEFORE:-$SRC/train/eval_before_validation.json}" ;;
  heldout) [ -n "${BEFORE:-}" ] || { echo "SPLIT=heldout needs BEFORE=<held-out eval_before.json of the same warm start>" >&2; exit 2; } ;;
  *) echo "SPLIT must be validation or heldout, got '$SPLIT'" >&2; exit 2 ;;
esac
[ -e "$BEFORE" ] || { echo "$BEFORE missing: the before-RL evaluation of the $SPLIT split" >&2; exit 2; }
for f in train/checkpoints/latest train/checkpoints/ref data/train.jsonl \
         data/eval.jsonl data/corpus.jsonl; do
  [ -e "$SRC/$f" ] || { echo "$SRC/$f missing: not a finished held-out run of bench_train_local.py" >&2; exit 2; }
done
step=$(cat "$SRC/train/checkpoints/latest")
# the checkpoint's own step count as --train.max_steps: a run of fewer steps than today's preset (20 before trial T7
# of docs/trials_em.md made the default 30) is evaluated as it is, not trained on to the preset's count
ckpt_steps=${step##*[!0-9]}
[[ "$ckpt_steps" =~ ^[0-9]+$ ]] || { echo "$SRC/train/checkpoints/latest names '$step', not global_stepN" >&2; exit 2; }
[ -d "$SRC/train/checkpoints/$step" ] || { echo "$SRC/train/checkpoints/$step missing (latest names it)" >&2; exit 2; }
for f in "$@"; do
  [ "$f" != "--ckpt.no_load" ] || { echo "--ckpt.no_load would train again through the linked checkpoints" >&2; exit 2; }
done
mkdir -p "$OUT"
if [ "$(realpath "$OUT")" = "$(realpath "$SRC")" ]; then echo "OUT must not be RUN" >&2; exit 2; fi
for d in "$OUT"/train/checkpoints/*/; do  # a real checkpoint folder in OUT would be resumed instead of RUN's
  [ -e "$d" ] || continue
  [ -L "${d%/}" ] || { echo "$OUT already holds a checkpoint ($d): give a new OUT" >&2; exit 2; }
done
# the run's own preset, flags and seed (bench_train_local.json); "" when the file is absent
read -r RUN_PRESET RUN_SEED < <("$PY" - "$SRC/bench_train_local.json" <<'PYEOF'
import json, os, sys
d = json.load(open(sys.argv[1])) if os.path.exists(sys.argv[1]) else {}
print(d.get("preset") or "default", 42 if d.get("seed") is None else d["seed"])
PYEOF
)
RUN_JOB_ARGS=$("$PY" -c 'import json,os,sys; p=sys.argv[1]; print(json.load(open(p)).get("job_args","") if os.path.exists(p) else "")' "$SRC/bench_train_local.json")
if [ -e "$SRC/bench_train_local.json" ] && [ "$RUN_SEED" != "$SEED" ]; then
  echo "SEED $SEED is not the run's (--train.seed $RUN_SEED in $SRC/bench_train_local.json)" >&2; exit 2
fi
before_split=$("$PY" -c 'import json,sys; print(json.load(open(sys.argv[1])).get("split", "heldout"))' "$BEFORE")
[ "$before_split" = "$SPLIT" ] || { echo "$BEFORE holds the $before_split split, not $SPLIT" >&2; exit 2; }
mkdir -p "$OUT/train/checkpoints"
ln -sfn "$(realpath "$SRC/train/checkpoints/$step")" "$OUT/train/checkpoints/$step"
ln -sfn "$(realpath "$SRC/train/checkpoints/ref")" "$OUT/train/checkpoints/ref"
cp "$SRC/train/checkpoints/latest" "$OUT/train/checkpoints/latest"
cp "$BEFORE" "$OUT/train/eval_before.json"
# SPLIT=heldout from a validation run: its own before-RL pass holds the validation records that choose the suffix
# baseline's k (eval_before_validation.json of a held-out run)
if [ "$SPLIT" = heldout ] && [ -e "$SRC/train/eval_before.json" ] && [ "$("$PY" -c 'import json,sys; print(json.load(open(sys.argv[1])).get("split", "heldout"))' "$SRC/train/eval_before.json")" = validation ]; then
  cp "$SRC/train/eval_before.json" "$OUT/train/eval_before_validation.json"
fi
cp "$SRC/train/metrics.jsonl" "$SRC/train/warmstart.jsonl" "$OUT/train/"
export PYTHONPATH="$ROOT" OMP_NUM_THREADS="${OMP_NUM_THREADS:-1}" TOKENIZERS_PARALLELISM=false HF_HUB_OFFLINE=1
# shellcheck disable=SC2086  # the run's job_args, split as bench_train_local split them
eval "set -- $RUN_JOB_ARGS \"\$@\""
# the evaluated policy's figures as a bench_train_local.json, so that seeds_report.py puts them in its table
summary() {
  "$PY" - "$OUT" "$SEED" "$SPLIT" "${PRESET:-$RUN_PRESET}" "$RUN_JOB_ARGS" "$SRC" <<'PYEOF'
import json, os, sys
out, seed, split, preset, job_args, src = sys.argv[1:]
read = lambda name: json.load(open(os.path.join(out, "train", name))) if os.path.exists(os.path.join(out, "train", name)) else None
json.dump({"seed": int(seed), "split": split, "preset": preset, "job_args": job_args, "compare": read("eval_compare.json"),
           "analysis": read("eval_analysis.json"), "source_run": src, "evaluated_by": "benchmarks/validation_of_run.sh",
           "job_wall_s": None, "omp_threads": None}, open(os.path.join(out, "bench_train_local.json"), "w"), indent=1)
PYEOF
}
"$PY" -m openrlhf_search.cpu.main_job.train --preset "${PRESET:-$RUN_PRESET}" \
  --train_data "$SRC/data/train.jsonl" --eval_data "$SRC/data/eval.jsonl" --corpus "$SRC/data/corpus.jsonl" \
  --retriever.encoder bm25 --train.seed "$SEED" --eval.split "$SPLIT" --ckpt.output_dir "$OUT/train" \
  --train.max_steps "$ckpt_steps" "$@"
summary
