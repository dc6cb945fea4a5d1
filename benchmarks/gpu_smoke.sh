#!/usr/bin/env bash
# GPU smoke check: the first 10 minutes on a GPU machine, one GPU, one command. Every phase runs under its own cap
# (seconds, CAP_<PHASE> to change); the default caps add up to 600 s and none exceeds 150 s, so a hang fails its
# phase in under 5 minutes and the whole proof ends within 10.
#
# Assumes this project installed with its GPU stack in the Python that runs it (README: GPU install).
#
# Phases (a failed phase is reported and the next ones still run, except that nothing runs without CUDA):
#   env       20 s  the GPU, torch / CUDA, vLLM, OpenRLHF and DeepSpeed versions; stops here (exit 2) without CUDA
#   imports   60 s  python -m openrlhf_search.cli.doctor when the package has it, else an import of every GPU kernel
#                   the path uses (flash-attn varlen and Triton cross-entropy, DeepSpeed FusedAdam, vLLM, faiss)
#   assets    60 s  the tiny policy, prompts and corpus, built offline (python -m cpu_demo.tiny_assets)
#   numerics 120 s  benchmarks/gpu_numerics.py on the tiny policy: packed vs padded log-probs (OpenRLHF's Actor,
#                   flash-attn varlen), the vLLM vs trainer log-prob gap (printed), a weight sync over CUDA IPC
#                   (OpenRLHF's update_weight_cuda_ipc) with sampled engine tensors equal to the trainer's
#   launcher 150 s  one training step of examples/scripts/searchr1.sh (GRPO) at GPUS_PER_NODE=1 (colocated, sleep
#                   mode): Ray, DeepSpeed ZeRO-3, the vLLM engine, the weight sync, the search agent against a BM25
#                   retriever on a free port; a checkpoint at step 1
#   resume    90 s  the same launcher relaunched with --train.max_steps 2: must resume from step 1 and train step 2
#   lora     100 s  one step with LoRA (--ds.lora.rank 8): the merged-weight sync of a colocated layout
#   eval     120 s  (not in the default PHASES) cli.eval (vLLM): LIMIT questions of the embedded held-out set
#
# Usage:   bash benchmarks/gpu_smoke.sh [--dry-run]
# Settings (environment): PYTHON (default python3), PHASES="imports numerics launcher resume lora" (any subset of
#   these and eval; env and assets always run), LIMIT=16 questions of the eval phase, OUT_DIR=runs/gpu_smoke (emptied
#   first), CAP_ENV, CAP_IMPORTS, CAP_ASSETS, CAP_NUMERICS, CAP_LAUNCHER, CAP_RESUME, CAP_LORA, CAP_EVAL (seconds).
# Outputs in OUT_DIR: phases.tsv (phase, seconds, outcome), one log per phase; the work folders under OUT_DIR/work.
# --dry-run (CPU): checks the caps, cli.eval's and the launcher's flags, imports what the numerics call, prints the
#   commands; writes nothing.
# Exit code: 0 when every phase passed, 1 when one failed, 2 on a usage or environment error.
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
PHASES="${PHASES:-imports numerics launcher resume lora}"
LIMIT="${LIMIT:-16}"
OUT_DIR="${OUT_DIR:-$ROOT/runs/gpu_smoke}"
WORK="$OUT_DIR/work"
CAP_ENV="${CAP_ENV:-20}" CAP_IMPORTS="${CAP_IMPORTS:-60}" CAP_ASSETS="${CAP_ASSETS:-60}"
CAP_NUMERICS="${CAP_NUMERICS:-120}" CAP_LAUNCHER="${CAP_LAUNCHER:-150}" CAP_RESUME="${CAP_RESUME:-90}"
CAP_LORA="${CAP_LORA:-100}" CAP_EVAL="${CAP_EVAL:-120}"

die() { echo "gpu_smoke.sh: $*" >&2; exit 2; }
[[ "$LIMIT" =~ ^[1-9][0-9]*$ ]] || die "LIMIT must be a positive integer, got '$LIMIT'"
for v in CAP_ENV CAP_IMPORTS CAP_ASSETS CAP_NUMERICS CAP_LAUNCHER CAP_RESUME CAP_LORA CAP_EVAL; do
  [[ "${!v}" =~ ^[1-9][0-9]*$ ]] || die "$v must be a positive number of seconds, got '${!v}'"
done
for p in $PHASES; do
  case "$p" in imports|numerics|launcher|resume|lora|eval) ;;
    *) die "PHASES: unknown phase '$p' (imports, numerics, launcher, resume, lora, eval)" ;; esac
done
has() { [[ " $PHASES " == *" $1 "* ]]; }
cap() { local v="CAP_${1^^}"; echo "${!v}"; }
TOTAL_CAP=$(( CAP_ENV + CAP_ASSETS ))
for p in $PHASES; do TOTAL_CAP=$(( TOTAL_CAP + $(cap "$p") )); done
case "$OUT_DIR" in /|"$ROOT"|"$HOME"|"") die "OUT_DIR '$OUT_DIR' would be emptied: choose a folder of its own" ;; esac
command -v "$PYTHON" >/dev/null 2>&1 || die "no Python '$PYTHON': set PYTHON to the interpreter with the GPU extras"

export TOKENIZERS_PARALLELISM=false PYTHONUNBUFFERED=1 TQDM_MININTERVAL=10
export PYTHONPATH="$ROOT${PYTHONPATH:+:$PYTHONPATH}"

# the launcher's extra flags: one step, small batches on one GPU, a checkpoint every step (later flags win)
LAUNCHER_ARGS=(--train.max_steps 1 --rollout.batch_size 4 --rollout.n_samples_per_prompt 4 --train.batch_size 16
               --rollout.micro_batch_size 2 --train.micro_batch_size 2 --data.max_len 1024
               --rollout.max_new_tokens 48 --search.max_new_tokens_per_turn 48 --search.max_turns 3
               --search.topk 1 --search.max_obs_tokens 120 --eval.n_samples_per_prompt 1 --ckpt.save_steps 1
               --vllm.gpu_memory_utilization 0.3)
RESUME_ARGS=(--train.max_steps 2)
LORA_ARGS=(--ds.lora.rank 8 --ds.lora.alpha 16)
LAUNCHER=(bash examples/scripts/searchr1.sh grpo qwen2.5-3b base)
# cli.eval's flags after --model and --retriever_url: the tiny policy's budgets (the launcher's above)
EVAL_ARGS=(--datasets "$WORK/data/eval.jsonl" --limit "$LIMIT" --protocol searchr1 --chat_template
           --topk 1 --max_turns 3 --max_new_tokens 48 --max_obs_tokens 120 --max_length 1024
           --out_dir "$OUT_DIR/eval")
HAS_DOCTOR="$("$PYTHON" -c 'import importlib.util as u; print(int(u.find_spec("openrlhf_search.cli.doctor") is not None))' \
  2>/dev/null || echo 0)"

if [ "$DRY_RUN" = 1 ]; then
  echo "== DRY RUN: nothing is installed, built or trained"
  echo "python: $PYTHON; phases: env assets $PHASES; eval questions: $LIMIT; out: $OUT_DIR"
  for p in env assets $PHASES; do
    c="$(cap "$p")"
    echo "   cap $p: ${c}s"
    [ "$c" -lt 300 ] || die "CAP_${p^^} ${c}s: a hang must fail its phase in under 5 minutes (< 300)"
  done
  echo "   caps add up to ${TOTAL_CAP}s"
  [ "$TOTAL_CAP" -le 600 ] || echo "   note: over the 10-minute proof (600 s)"
  "$PYTHON" - "${EVAL_ARGS[@]}" <<'PY'
import sys
from openrlhf_search.cli.eval import build_parser
a = build_parser().parse_args(["--model", "MODEL", "--retriever_url", "http://127.0.0.1:1", *sys.argv[1:]])
print(f"   ok: cli.eval, {a.limit} questions, protocol {a.protocol}, top-{a.topk}")
PY
  plan="$("$PYTHON" benchmarks/gpu_numerics.py --model MODEL --dry_run 2>/dev/null | grep '^plan:')" \
    || die "benchmarks/gpu_numerics.py cannot import what it calls"
  echo "   ok: numerics $plan"
  if [ "$HAS_DOCTOR" = 1 ]; then imports_cmd="$PYTHON -m openrlhf_search.cli.doctor"
  else imports_cmd="$PYTHON -c <import of flash_attn varlen + Triton cross-entropy, FusedAdam, vllm, faiss>"; fi
  echo "== would run (imports): $imports_cmd"
  echo "== would run (numerics): $PYTHON benchmarks/gpu_numerics.py --model MODEL"
  echo "== would run (launcher): GPUS_PER_NODE=1 ${LAUNCHER[*]} ${LAUNCHER_ARGS[*]}"
  echo "== would run (resume): GPUS_PER_NODE=1 ${LAUNCHER[*]} ${LAUNCHER_ARGS[*]} ${RESUME_ARGS[*]}"
  echo "== would run (lora): GPUS_PER_NODE=1 ${LAUNCHER[*]} ${LAUNCHER_ARGS[*]} ${LORA_ARGS[*]}"
  echo "== would run (eval): $PYTHON -m openrlhf_search.cli.eval --model MODEL --retriever_url URL ${EVAL_ARGS[*]}"
  echo "== DRY RUN passed"
  exit 0
fi

echo "== env"
command -v nvidia-smi >/dev/null 2>&1 \
  && timeout 20 nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader || true
timeout "$CAP_ENV" "$PYTHON" - <<'PY' || die "this Python lacks the GPU stack (README: GPU install)"
import importlib.metadata as md
import torch
versions = {d: md.version(d) for d in ("torch", "vllm", "openrlhf", "deepspeed", "transformers")}
print("   " + ", ".join(f"{k} {v}" for k, v in versions.items()) + f", CUDA {torch.version.cuda}")
if not torch.cuda.is_available():
    raise SystemExit("torch sees no CUDA device")
p = torch.cuda.get_device_properties(0)
print(f"   device 0: {p.name}, {p.total_memory / 2**30:.1f} GiB")
PY

rm -rf "$OUT_DIR"
mkdir -p "$WORK"
PHASES_TSV="$OUT_DIR/phases.tsv"
: >"$PHASES_TSV"
FAILED=0

# phase NAME LOG CMD...: CMD under its cap (CAP_<NAME>), its output appended to LOG; the outcome goes to phases.tsv
phase() {
  local name=$1 log=$2 rc t0 limit
  limit="$(cap "$name")"
  shift 2
  echo "== $name (cap ${limit}s, log: $log)"
  t0=$(date +%s)
  set +e
  timeout --kill-after=10 "$limit" "$@" >>"$log" 2>&1
  rc=$?
  set -e
  local status=ok
  [ "$rc" -eq 0 ] || status="rc=$rc"
  [ "$rc" -eq 124 ] && status="timed out after ${limit}s"
  printf '%s\t%s\t%s\n' "$name" "$(( $(date +%s) - t0 ))" "$status" >>"$PHASES_TSV"
  echo "   $name: $status in $(( $(date +%s) - t0 ))s"
  if [ "$rc" -ne 0 ]; then FAILED=1; tail -n 30 "$log"; return 1; fi
}

IMPORTS_PY=$(cat <<'PY'
import importlib
missing = []
for mod, what in (("flash_attn.flash_attn_interface", "flash-attn varlen kernels (packing)"),
                  ("flash_attn.ops.triton.cross_entropy", "flash-attn's Triton cross-entropy (log-probs)"),
                  ("vllm._C", "vLLM's CUDA kernels"), ("faiss", "faiss (dense retriever)")):
    try:
        importlib.import_module(mod)
    except Exception as e:
        missing.append(f"{what}: {type(e).__name__}: {e}")
try:
    from deepspeed.ops.op_builder import FusedAdamBuilder
    FusedAdamBuilder().load()
except Exception as e:
    missing.append(f"DeepSpeed FusedAdam: {type(e).__name__}: {e}")
print("\n".join(missing) or "every GPU kernel imports")
raise SystemExit(1 if missing else 0)
PY
)
if has imports; then
  if [ "$HAS_DOCTOR" = 1 ]; then phase imports "$OUT_DIR/imports.log" "$PYTHON" -m openrlhf_search.cli.doctor || true
  else phase imports "$OUT_DIR/imports.log" "$PYTHON" -c "$IMPORTS_PY" || true; fi
fi

assets="$OUT_DIR/assets.txt"
get() { sed -n "s/^$1=//p" "$assets"; }
phase assets "$OUT_DIR/assets.log" bash -c '"$0" -m cpu_demo.tiny_assets --out "$1" \
    --protocol searchr1 --chat true >"$2"' "$PYTHON" "$WORK/assets" "$assets" || true

if has numerics && [ -s "$assets" ]; then
  phase numerics "$OUT_DIR/numerics.log" "$PYTHON" benchmarks/gpu_numerics.py --model "$(get MODEL)" || true
  grep -E '^(packed_vs_padded|vllm_vs_trainer|weight_sync|FAILED)' "$OUT_DIR/numerics.log" | sed 's/^/   /' || true
fi

# launch NAME OUTPUT_ROOT EXTRA...: the launcher with the tiny assets at GPUS_PER_NODE=1, under phase NAME
launch() {
  local name=$1 root=$2 port
  shift 2
  port="$("$PYTHON" -c 'import socket; s = socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])')"
  phase "$name" "$OUT_DIR/$name.log" env GPUS_PER_NODE=1 NNODES=1 PYTHON="$PYTHON" MODEL="$(get MODEL)" \
    RETRIEVER_PORT="$port" GPU_MEM_GB="${GPU_MEM_GB:-}" \
    TRAIN_DATA="$(get TRAIN_DATA)" EVAL_DATA="$(get EVAL_DATA)" RETRIEVER_CORPUS="$(get CORPUS)" \
    RETRIEVER_ENCODER=bm25 RETRIEVER_INDEX_TYPE=bm25 RETRIEVER_INDEX_DIR="$WORK/index_bm25" ALLOW_SHORT=1 \
    OUTPUT_ROOT="$root" "${LAUNCHER[@]}" "${LAUNCHER_ARGS[@]}" "$@"
}

if has launcher && [ -s "$assets" ]; then
  launch launcher "$WORK/launcher" || true
fi
if has resume && [ -s "$assets" ]; then
  # step 1's checkpoint must be resumed: the relaunch names it and trains step 2, never step 1 again
  if launch resume "$WORK/launcher" "${RESUME_ARGS[@]}"; then
    if ! grep -q "resuming from" "$OUT_DIR/resume.log" || ! grep -q "step 2 time split" "$OUT_DIR/resume.log" \
        || grep -q "step 1 time split" "$OUT_DIR/resume.log"; then
      echo "   resume: the relaunch did not resume from step 1 (see $OUT_DIR/resume.log)"
      printf 'resume_check\t0\tnot resumed from step 1\n' >>"$PHASES_TSV"
      FAILED=1
    fi
  fi
fi
if has lora && [ -s "$assets" ]; then
  launch lora "$WORK/lora" "${LORA_ARGS[@]}" || true
fi

# cli.eval against a BM25 retriever over the embedded corpus, started and stopped here (MODEL CORPUS INDEX FLAGS...)
EVAL_PY=$(cat <<'PY'
import subprocess
import sys

from retriever.launch import ensure_index, start_server_process, stop_server_process

model, corpus, index_dir, flags = sys.argv[1], sys.argv[2], sys.argv[3], sys.argv[4:]
proc, url = start_server_process(ensure_index(corpus, index_dir))
try:
    rc = subprocess.call([sys.executable, "-m", "openrlhf_search.cli.eval", "--model", model, "--retriever_url", url,
                          *flags])
finally:
    stop_server_process(proc)
sys.exit(rc)
PY
)

if has eval && [ -s "$assets" ]; then
  "$PYTHON" -m cpu_demo.data.default_dataset --out "$WORK/data" --seed 0 >>"$OUT_DIR/eval.log" 2>&1 \
    && { phase eval "$OUT_DIR/eval.log" "$PYTHON" -c "$EVAL_PY" "$(get MODEL)" "$WORK/data/corpus.jsonl" \
           "$WORK/eval_index" "${EVAL_ARGS[@]}" || true; } || true
fi

echo
echo "== summary (caps add up to ${TOTAL_CAP}s)"
cat "$PHASES_TSV"
for f in "$OUT_DIR"/eval/*.summary.json; do
  [ -f "$f" ] && { echo "$f"; cat "$f"; echo; }
done
echo "== done; figures and logs in $OUT_DIR$([ "$FAILED" = 0 ] || echo '; a phase FAILED (see above)')"
exit "$FAILED"
