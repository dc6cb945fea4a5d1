#!/usr/bin/env bash
# Prepare one node of a multi-node cluster: start this node's retriever, then start (head) or join Ray.
#
#   head:    HEAD=1 bash examples/scripts/cluster_node_setup.sh [start_retriever.sh flags]
#   workers: HEAD_ADDRESS=HEAD_IP:6379 bash examples/scripts/cluster_node_setup.sh [start_retriever.sh flags]
#
# The retriever is configured like start_retriever.sh (RETRIEVER_CORPUS, RETRIEVER_ENCODER, RETRIEVER_INDEX_DIR,
# ... or its flags; the corpus and the encoder are required), e.g. RETRIEVER_ENCODER=e5-base-v2 RETRIEVER_CORPUS=/shared/wiki-18.jsonl
# RETRIEVER_INDEX_DIR=/shared/wiki18_e5_flat; a prebuilt index on shared storage is reused, not rebuilt.
#
# One retriever per node: rollout actors reach it at
# http://127.0.0.1:$RETRIEVER_PORT, so retrieval traffic never crosses nodes and a slow node does not slow others.
# Before training, the job's driver checks on every GPU node that its retriever answers and that all nodes serve
# the same index (openrlhf_search.launch.retriever_check, --search.check_retrievers).
# The retriever wait (RETRIEVER_WAIT_S, default 3600 s for index building) ends at once if the retriever process
# dies. Ray is the project's own: "$PYTHON -m ray.scripts.scripts" (PYTHON: the checkout's .venv if present).
# DRY_RUN=1 prints the commands instead of running them.
set -euo pipefail
source "$(dirname "${BASH_SOURCE[0]}")/env_help.sh"
help_init "$@"
HERE="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
if [[ -z "${PYTHON:-}" ]]; then  # the checkout's .venv (make setup) when present, else the active python3
    if [[ -x "$HERE/../../.venv/bin/python" ]]; then PYTHON="$HERE/../../.venv/bin/python"; else PYTHON=python3; fi
fi
RETRIEVER_PORT="${RETRIEVER_PORT:-8000}"
DRY_RUN="${DRY_RUN:-0}"
if [[ "$LAUNCHER_HELP" == 1 ]]; then
    launcher_help cluster_node_setup.sh "examples/scripts/start_retriever.sh" "as its flags"
    exit 0
fi
# Ray's workers on this node run $PYTHON: one whose torch has no CUDA (the CPU stack of `make setup` in .venv) would
# train on CPU, so it is refused in one line (CPU_CLUSTER=1 starts anyway).
if [[ "$DRY_RUN" == "0" && "${CPU_CLUSTER:-0}" != "1" ]]; then
    cuda="$("$PYTHON" -c 'import torch; print(torch.version.cuda or "")' 2>/dev/null || true)"
    if [[ -z "$cuda" ]]; then
        echo "cluster_node_setup.sh: $PYTHON has no torch with CUDA (the CPU stack of make setup?): Ray's workers on this node would train on CPU; set PYTHON=/path/to/the/GPU/environment/bin/python (CPU_CLUSTER=1 starts anyway)" >&2
        exit 2
    fi
fi
# The encoder is named, never defaulted: start_retriever.sh alone serves BM25, which no training launcher uses (they
# expect e5-base-v2 or bge-large-en-v1.5), and a node serving the wrong index trains without an error.
encoder_flag=0
for _a in "$@"; do [[ "$_a" == "--" ]] && break; [[ "$_a" == --encoder || "$_a" == --encoder=* ]] && encoder_flag=1; done
if [[ -z "${RETRIEVER_ENCODER:-}" && "$encoder_flag" == 0 ]]; then
    echo "cluster_node_setup.sh: name the retriever's encoder: RETRIEVER_ENCODER=e5-base-v2 (Search-R1's launchers), bge-large-en-v1.5 (R1-Searcher's) or bm25 (or --encoder); start_retriever.sh alone would serve bm25" >&2
    exit 2
fi
export PYTHONPATH="$(cd "$HERE/../.." && pwd)${PYTHONPATH:+:$PYTHONPATH}"
run() {
    if [[ "$DRY_RUN" != "0" ]]; then echo "+ $*"; else "$@"; fi
}

RAY=("$PYTHON" -m ray.scripts.scripts)
if [[ "${HEAD:-0}" == "1" ]]; then
    RAY_CMD=("${RAY[@]}" start --head --port 6379 --dashboard-host 0.0.0.0)
else
    RAY_CMD=("${RAY[@]}" start --address "${HEAD_ADDRESS:?set HEAD=1 on the head node or HEAD_ADDRESS=ip:6379 on workers}")
fi

RETRIEVER_CMD=(bash "$HERE/start_retriever.sh" --port "$RETRIEVER_PORT" "$@")
URL="http://127.0.0.1:${RETRIEVER_PORT}"
if [[ "$DRY_RUN" != "0" ]]; then
    echo "+ nohup ${RETRIEVER_CMD[*]} &"
else
    config="$("${RETRIEVER_CMD[@]}" --print_config)" || exit 2
    index_dir="$(sed -n 's/^index_dir=//p' <<< "$config")"
    echo "[cluster_node_setup] $(tr '\n' ' ' <<< "$config")" >&2
    if "$PYTHON" -m openrlhf_search.launch.retriever_check --urls "$URL" >/dev/null 2>&1; then
        # something already serves the port: keep it only if it serves this node's index
        if [[ -f "$index_dir/manifest.json" ]] \
            && "$PYTHON" -m openrlhf_search.launch.retriever_check --urls "$URL" --index_dir "$index_dir" >/dev/null; then
            echo "[cluster_node_setup] $URL already serves $index_dir; not starting another" >&2
            run "${RAY_CMD[@]}"
            exit 0
        fi
        echo "cluster_node_setup.sh: port $RETRIEVER_PORT already serves another index (or $index_dir is not built): stop it or set RETRIEVER_PORT" >&2
        exit 2
    fi
    nohup "${RETRIEVER_CMD[@]}" > "retriever_${RETRIEVER_PORT}.log" 2>&1 &
    pid=$!
    healthy=0
    for _ in $(seq "${RETRIEVER_WAIT_S:-3600}"); do
        if ! kill -0 "$pid" 2>/dev/null; then
            echo "retriever process $pid exited before answering; see retriever_${RETRIEVER_PORT}.log:" >&2
            tail -n 20 "retriever_${RETRIEVER_PORT}.log" >&2 || true
            exit 1
        fi
        if "$PYTHON" -m openrlhf_search.launch.retriever_check --urls "$URL" --index_dir "$index_dir" >/dev/null 2>&1; then
            healthy=1
            break
        fi
        sleep 1
    done
    if [[ "$healthy" != "1" ]]; then
        echo "retriever not healthy; see retriever_${RETRIEVER_PORT}.log" >&2
        exit 1
    fi
fi
run "${RAY_CMD[@]}"
