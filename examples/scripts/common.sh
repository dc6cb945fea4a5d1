#!/usr/bin/env bash
# Shared launcher logic, sourced by the training scripts of this folder (never run directly).
#
# Environment (all optional):
#   DRY_RUN=1         parse and validate every flag with OpenRLHF's real parser (python -m openrlhf_search.cli.train
#                     --dry_run), print the resolved config as JSON, start nothing. A `--dry_run` argument does
#                     the same. DRY_RUN=argv prints the train arguments NUL-separated and exits (used by tests).
#   SUBMIT=1          submit to a running Ray cluster with `ray job submit` (RAY_ADDRESS, default
#                     http://127.0.0.1:8265) instead of running the driver here. Retrievers are then expected on
#                     every node (examples/scripts/cluster_node_setup.sh), reached at http://127.0.0.1:$RETRIEVER_PORT
#                     from each node's own rollout actors: one retriever per node, no cross-node retrieval traffic.
#   RETRIEVER_URLS    comma-separated retriever URLs; when set no retriever is started.
#   RETRIEVER_MODE    node (default): start_retriever.sh, one retriever per node; serve: start_retriever_serve.sh, one
#                     Ray Serve application (RETRIEVER_REPLICAS replicas) on this node's Ray cluster, started here
#                     also with SUBMIT=1 and reached by every node at http://$RETRIEVER_SERVE_IP:$RETRIEVER_PORT
#                     (default: this node's first IP).
#   RETRIEVER_PORT    port of the retriever started here (default 8000). The retriever itself is configured by
#                     start_retriever.sh's variables (RETRIEVER_CORPUS, RETRIEVER_SOURCE, RETRIEVER_ENCODER,
#                     RETRIEVER_INDEX_TYPE, RETRIEVER_INDEX_DIR); each training script sets its paper's encoder
#                     as the default.
#   NNODES, GPUS_PER_NODE, VLLM_TP   cluster layout (default 1 node, 8 GPUs, tensor parallel 1).
#   PYTHON            interpreter (default: the checkout's .venv/bin/python if present, else python3).
#   OUTPUT_ROOT       checkpoints and logs (default ./checkpoints).
# Any extra script arguments are passed to the trainer after the script's own flags (the last value wins).

set -euo pipefail

SCRIPT_DIR="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
REPO_ROOT="$(cd "$SCRIPT_DIR/../.." && pwd)"
if [[ -z "${PYTHON:-}" ]]; then  # the checkout's .venv (make setup) when present, else the active python3
    if [[ -x "$REPO_ROOT/.venv/bin/python" ]]; then PYTHON="$REPO_ROOT/.venv/bin/python"; else PYTHON=python3; fi
fi
DRY_RUN="${DRY_RUN:-0}"
SUBMIT="${SUBMIT:-0}"
RAY_ADDRESS="${RAY_ADDRESS:-http://127.0.0.1:8265}"
RETRIEVER_PORT="${RETRIEVER_PORT:-8000}"
NNODES="${NNODES:-1}"
GPUS_PER_NODE="${GPUS_PER_NODE:-8}"
VLLM_TP="${VLLM_TP:-1}"
OUTPUT_ROOT="${OUTPUT_ROOT:-$REPO_ROOT/checkpoints}"
DATA_DIR="${DATA_DIR:-$REPO_ROOT/data}"

EXTRA_ARGS=()
for _arg in "$@"; do
    if [[ "$_arg" == "--dry_run" ]]; then
        [[ "$DRY_RUN" == "0" ]] && DRY_RUN=1
    else
        EXTRA_ARGS+=("$_arg")
    fi
done

export PYTHONPATH="$REPO_ROOT${PYTHONPATH:+:$PYTHONPATH}"
cd "$REPO_ROOT"

log() { echo "[$(basename "$0")] $*" >&2; }

# GPU layout: actor, reference (and critic) share every GPU of the job with the vLLM engines (colocate_all,
# sleep mode), as both papers' single-node setups do.
layout_args() {
    local engines=$(( NNODES * GPUS_PER_NODE / VLLM_TP ))
    LAYOUT_ARGS=(
        --actor.num_nodes "$NNODES" --actor.num_gpus_per_node "$GPUS_PER_NODE"
        --ref.num_nodes "$NNODES" --ref.num_gpus_per_node "$GPUS_PER_NODE"
        --critic.num_nodes "$NNODES" --critic.num_gpus_per_node "$GPUS_PER_NODE"
        --vllm.num_engines "$engines" --vllm.tensor_parallel_size "$VLLM_TP"
        --train.colocate_all --vllm.enable_sleep --ds.enable_sleep --vllm.gpu_memory_utilization 0.6
        --ds.zero_stage 3 --actor.gradient_checkpointing_enable --ds.packing_samples
    )
}

wait_for_retriever() {
    local url="$1" tries="${2:-600}"
    for _ in $(seq "$tries"); do
        if "$PYTHON" -c "import sys, urllib.request; urllib.request.urlopen(sys.argv[1] + '/health', timeout=2)" \
            "$url" 2>/dev/null; then
            return 0
        fi
        sleep 1
    done
    log "retriever at $url not healthy after ${tries}s"
    return 1
}

# Start the retriever of this node (start_retriever.sh belongs to the retriever service; it builds the index when
# missing) unless URLs are given, the job is submitted to a cluster (one retriever per node, started by
# cluster_node_setup.sh), or in a dry run.
start_retrievers() {
    if [[ -n "${RETRIEVER_URLS:-}" ]]; then
        log "using retrievers at $RETRIEVER_URLS"
        return 0
    fi
    RETRIEVER_URLS="http://127.0.0.1:${RETRIEVER_PORT}"
    local cmd=(bash "$SCRIPT_DIR/start_retriever.sh" --port "$RETRIEVER_PORT")
    if [[ "${RETRIEVER_MODE:-node}" == "serve" ]]; then  # one Serve application for the whole cluster
        RETRIEVER_URLS="http://${RETRIEVER_SERVE_IP:-$(hostname -I 2>/dev/null | awk '{print $1}')}:${RETRIEVER_PORT}"
        cmd=(bash "$SCRIPT_DIR/start_retriever_serve.sh" --port "$RETRIEVER_PORT")
    fi
    if [[ "$DRY_RUN" != "0" ]]; then
        log "dry run: would start RETRIEVER_ENCODER=${RETRIEVER_ENCODER:-default} ${cmd[*]}"
        return 0
    fi
    if [[ "$SUBMIT" == "1" && "${RETRIEVER_MODE:-node}" != "serve" ]]; then
        log "cluster job: each node serves its own retriever at $RETRIEVER_URLS (cluster_node_setup.sh)"
        return 0
    fi
    mkdir -p "$OUTPUT_ROOT"
    "${cmd[@]}" > "$OUTPUT_ROOT/retriever_${RETRIEVER_PORT}.log" 2>&1 &
    RETRIEVER_PID=$!
    trap 'kill "$RETRIEVER_PID" 2>/dev/null || true' EXIT
    log "retriever starting (pid $RETRIEVER_PID, log $OUTPUT_ROOT/retriever_${RETRIEVER_PORT}.log)"
    wait_for_retriever "$RETRIEVER_URLS" "${RETRIEVER_WAIT_S:-3600}"
}

# Run (or submit, or dry-run) python -m openrlhf_search.cli.train with the given flags + the script's extra args.
launch() {
    local full=("$@" --search.retriever_urls "$RETRIEVER_URLS" "${EXTRA_ARGS[@]}")
    if [[ "$DRY_RUN" == "argv" ]]; then
        printf '%s\0' "${full[@]}"
        return 0
    fi
    local submit=(ray job submit --address "$RAY_ADDRESS" --working-dir "$REPO_ROOT"
                  --runtime-env-json '{"excludes": [".git", ".venv", "checkpoints", "data", "*.pt", "*.safetensors"]}'
                  -- python3 -m openrlhf_search.cli.train)
    if [[ "$DRY_RUN" != "0" ]]; then
        if [[ "$SUBMIT" == "1" ]]; then
            log "dry run: would submit: ${submit[*]} ${full[*]}"
        fi
        "$PYTHON" -m openrlhf_search.cli.train "${full[@]}" --dry_run
        return $?
    fi
    mkdir -p "$OUTPUT_ROOT"
    if [[ "$SUBMIT" == "1" ]]; then
        "${submit[@]}" "${full[@]}"
    else
        "$PYTHON" -m openrlhf_search.cli.train "${full[@]}"
    fi
}
