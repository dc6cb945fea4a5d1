#!/usr/bin/env bash
# GPU smoke check for your own GPU machine: the product's training and evaluation path on one GPU, in minutes.
#
# Assumes this project installed with its GPU extras in the Python that runs it (torch built with CUDA first):
#   pip install -e .[gpu]                                 # vLLM 0.29.0, OpenRLHF 0.11.2, DeepSpeed, flash-attn, ...
#
# Phases (each under `timeout`; a failed phase is reported and the next ones still run):
#   env          the GPU, torch / CUDA, vLLM, OpenRLHF and DeepSpeed versions; stops here (exit 2) without CUDA
#   assets       the tiny policy, prompts and corpus, built offline (python -m openrlhf_search.cpu.cluster_mode.assets)
#   launcher     one training step of examples/scripts/searchr1.sh (GRPO) at GPUS_PER_NODE=1 with those assets:
#                OpenRLHF's Ray loop, DeepSpeed, the vLLM engine, the weight sync and the search agent against a BM25
#                retriever on a free port, small batches
#   eval         cli.eval --backend vllm (vLLM's AsyncLLMEngine on the GPU) with the tiny policy: LIMIT questions of
#                the embedded default's held-out set (python -m openrlhf_search.cpu.data.default_dataset) against a
#                BM25 retriever over its corpus, greedy, Search-R1's tags
#
# Usage:   bash benchmarks/gpu_smoke.sh [--dry-run]
# Settings (environment): PYTHON (default python3: the interpreter with the GPU extras), PHASES="launcher eval" (any
#   subset), LIMIT=64 questions of the eval phase, OUT_DIR=runs/gpu_smoke (emptied first), TIMEOUT_S=1800 per phase.
# Outputs in OUT_DIR: phases.tsv, assets.log, launcher.log, eval.log, eval/ (cli.eval's predictions and summary);
#   the work folders under OUT_DIR/work.
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
PHASES="${PHASES:-launcher eval}"
LIMIT="${LIMIT:-64}"
OUT_DIR="${OUT_DIR:-$ROOT/runs/gpu_smoke}"
TIMEOUT_S="${TIMEOUT_S:-1800}"
WORK="$OUT_DIR/work"

die() { echo "gpu_smoke.sh: $*" >&2; exit 2; }
[[ "$LIMIT" =~ ^[1-9][0-9]*$ ]] || die "LIMIT must be a positive integer, got '$LIMIT'"
[[ "$TIMEOUT_S" =~ ^[1-9][0-9]*$ ]] || die "TIMEOUT_S must be a positive integer, got '$TIMEOUT_S'"
for p in $PHASES; do
  case "$p" in launcher|eval) ;; *) die "PHASES: unknown phase '$p' (launcher, eval)" ;; esac
done
case "$OUT_DIR" in /|"$ROOT"|"$HOME"|"") die "OUT_DIR '$OUT_DIR' would be emptied: choose a folder of its own" ;; esac
command -v "$PYTHON" >/dev/null 2>&1 || die "no Python '$PYTHON': set PYTHON to the interpreter with the GPU extras"

export TOKENIZERS_PARALLELISM=false PYTHONUNBUFFERED=1 TQDM_MININTERVAL=10
export PYTHONPATH="$ROOT${PYTHONPATH:+:$PYTHONPATH}"

# the launcher's extra flags: one step, small batches on one GPU (later flags win over the launcher's own)
LAUNCHER_ARGS=(--train.max_steps 1 --rollout.batch_size 4 --rollout.n_samples_per_prompt 4 --train.batch_size 16
               --rollout.micro_batch_size 2 --train.micro_batch_size 2 --data.max_len 1024
               --rollout.max_new_tokens 48 --search.max_new_tokens_per_turn 48 --search.max_turns 3
               --search.topk 1 --search.max_obs_tokens 120 --eval.n_samples_per_prompt 1 --ckpt.save_steps 1)
# cli.eval's flags after --model and --retriever_url: the tiny policy's budgets (the launcher's above)
EVAL_ARGS=(--backend vllm --datasets "$WORK/data/eval.jsonl" --limit "$LIMIT" --protocol searchr1 --chat_template
           --topk 1 --max_turns 3 --max_new_tokens 48 --max_obs_tokens 120 --max_length 1024
           --out_dir "$OUT_DIR/eval")

if [ "$DRY_RUN" = 1 ]; then
  echo "== DRY RUN: nothing is installed, built or trained"
  echo "python: $PYTHON; phases: $PHASES; eval questions: $LIMIT; out: $OUT_DIR"
  "$PYTHON" - "${EVAL_ARGS[@]}" <<'PY'
import sys
from openrlhf_search.cli.eval import build_parser
a = build_parser().parse_args(["--model", "MODEL", "--retriever_url", "http://127.0.0.1:1", *sys.argv[1:]])
print(f"   ok: cli.eval --backend {a.backend}, {a.limit} questions, protocol {a.protocol}, top-{a.topk}")
PY
  echo "== would run: GPUS_PER_NODE=1 bash examples/scripts/searchr1.sh grpo qwen2.5-3b base ${LAUNCHER_ARGS[*]}"
  echo "== would run: $PYTHON -m openrlhf_search.cli.eval --model MODEL --retriever_url URL ${EVAL_ARGS[*]}"
  echo "== DRY RUN passed"
  exit 0
fi

echo "== env"
command -v nvidia-smi >/dev/null 2>&1 \
  && timeout 20 nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader || true
"$PYTHON" - <<'PY' || die "this Python lacks the GPU stack (see the header: pip install -e .[gpu])"
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

assets="$OUT_DIR/assets.txt"
get() { sed -n "s/^$1=//p" "$assets"; }
phase assets "$OUT_DIR/assets.log" bash -c '"$0" -m openrlhf_search.cpu.cluster_mode.assets --out "$1" \
    --protocol searchr1 --chat true >"$2"' "$PYTHON" "$WORK/assets" "$assets" || true

if has launcher && [ -s "$assets" ]; then
  port="$("$PYTHON" -c 'import socket; s = socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])')"
  phase launcher "$OUT_DIR/launcher.log" env GPUS_PER_NODE=1 NNODES=1 PYTHON="$PYTHON" MODEL="$(get MODEL)" \
    RETRIEVER_PORT="$port" \
    TRAIN_DATA="$(get TRAIN_DATA)" EVAL_DATA="$(get EVAL_DATA)" RETRIEVER_CORPUS="$(get CORPUS)" \
    RETRIEVER_ENCODER=bm25 RETRIEVER_INDEX_TYPE=bm25 RETRIEVER_INDEX_DIR="$WORK/index_bm25" ALLOW_SHORT=1 \
    OUTPUT_ROOT="$WORK/launcher" bash examples/scripts/searchr1.sh grpo qwen2.5-3b base "${LAUNCHER_ARGS[@]}" \
    || true
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
  phase eval_data "$OUT_DIR/eval.log" "$PYTHON" -m openrlhf_search.cpu.data.default_dataset --out "$WORK/data" \
      --seed 0 \
    && { phase eval "$OUT_DIR/eval.log" "$PYTHON" -c "$EVAL_PY" "$(get MODEL)" "$WORK/data/corpus.jsonl" \
           "$WORK/eval_index" "${EVAL_ARGS[@]}" || true; } || true
fi

echo
echo "== summary"
cat "$PHASES_TSV"
for f in "$OUT_DIR"/eval/*.summary.json; do
  [ -f "$f" ] && { echo "$f"; cat "$f"; echo; }
done
echo "== done; figures and logs in $OUT_DIR$([ "$FAILED" = 0 ] || echo '; a phase FAILED (see above)')"
exit "$FAILED"
