#!/usr/bin/env bash
# Start the retrieval service as a Ray Serve application on the running Ray cluster: N replicas, one URL for every
# rollout worker, a dead replica replaced by Serve (python -m retriever.serve --ray). Builds the index when missing
# (with --ray_build: encoded by Ray Data over the cluster's GPUs, python -m retriever.build_index --ray).
# Run it on a node of the cluster (the head, usually); it stays in the foreground and removes the application on
# SIGTERM/SIGINT. For one retriever per node without Serve, use start_retriever.sh / cluster_node_setup.sh.
#
# Usage:
#   examples/scripts/start_retriever_serve.sh [--corpus CORPUS.jsonl] [--index_dir DIR] [--encoder E]
#       [--index_type T] [--replicas N] [--replica_gpus G] [--replica_cpus C] [--address auto] [--host 0.0.0.0]
#       [--port 8000] [--limit N] [--ray_build] [-- extra retriever.serve / server flags]
#
# Every flag has an environment variable (flags win); the corpus / index ones are start_retriever.sh's, so both
# scripts find the same index: RETRIEVER_CORPUS, RETRIEVER_ENCODER, RETRIEVER_INDEX_TYPE, RETRIEVER_INDEX_DIR,
# RETRIEVER_LIMIT, RETRIEVER_HOST, RETRIEVER_PORT, RETRIEVER_REPLICAS, RETRIEVER_REPLICA_GPUS, RETRIEVER_REPLICA_CPUS,
# RETRIEVER_RAY_BUILD, RAY_CLUSTER; --help lists them with their defaults and meanings (the table in env_help.sh).
#
# Example (head node of a running cluster, e5 Flat on 4 GPU replicas):
#   RETRIEVER_CORPUS=data/kilt_100w.jsonl RETRIEVER_ENCODER=e5-base-v2 \
#     examples/scripts/start_retriever_serve.sh --replicas 4 --replica_gpus 1 --ray_build
#   curl -s http://HEAD_IP:8000/retrieve -d '{"queries":["who wrote hamlet"],"topk":3}'
set -euo pipefail
source "$(dirname "${BASH_SOURCE[0]}")/env_help.sh"
help_init "$@"

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)"
cd "$ROOT"

CORPUS="${RETRIEVER_CORPUS:-}"  # no default: a corpus taken from eval data would hold the eval questions' gold passages
ENCODER="${RETRIEVER_ENCODER:-bm25}"
INDEX_TYPE="${RETRIEVER_INDEX_TYPE:-}"
INDEX_DIR="${RETRIEVER_INDEX_DIR:-}"
LIMIT="${RETRIEVER_LIMIT:-}"
HOST="${RETRIEVER_HOST:-0.0.0.0}"
PORT="${RETRIEVER_PORT:-8000}"
REPLICAS="${RETRIEVER_REPLICAS:-2}"
REPLICA_GPUS="${RETRIEVER_REPLICA_GPUS:-0}"
REPLICA_CPUS="${RETRIEVER_REPLICA_CPUS:-1}"
RAY_BUILD="${RETRIEVER_RAY_BUILD:-0}"
CLUSTER="${RAY_CLUSTER:-auto}"
EXTRA=()

while [[ $# -gt 0 ]]; do
  case "$1" in
    --corpus) CORPUS="$2"; shift 2 ;;
    --encoder) ENCODER="$2"; shift 2 ;;
    --index_type) INDEX_TYPE="$2"; shift 2 ;;
    --index_dir) INDEX_DIR="$2"; shift 2 ;;
    --limit) LIMIT="$2"; shift 2 ;;
    --host) HOST="$2"; shift 2 ;;
    --port) PORT="$2"; shift 2 ;;
    --replicas) REPLICAS="$2"; shift 2 ;;
    --replica_gpus) REPLICA_GPUS="$2"; shift 2 ;;
    --replica_cpus) REPLICA_CPUS="$2"; shift 2 ;;
    --address) CLUSTER="$2"; shift 2 ;;
    --ray_build) RAY_BUILD=1; shift ;;
    -h|--help) launcher_help start_retriever_serve.sh "python -m retriever.serve" "after --"; exit 0 ;;
    --) shift; EXTRA=("$@"); break ;;
    *) echo "start_retriever_serve.sh: unknown flag $1 (see --help)" >&2; exit 2 ;;
  esac
done

if [[ -z "${PYTHON:-}" ]]; then
  if [[ -x "$ROOT/.venv/bin/python" ]]; then PYTHON="$ROOT/.venv/bin/python"; else PYTHON=python; fi
fi
export PYTHONPATH="$ROOT${PYTHONPATH:+:$PYTHONPATH}"
[[ -z "$INDEX_TYPE" ]] && { [[ "$ENCODER" == "bm25" ]] && INDEX_TYPE=bm25 || INDEX_TYPE=flat; }
if [[ -z "$CORPUS" ]]; then
  echo "start_retriever_serve.sh: no corpus: give --corpus (RETRIEVER_CORPUS)" >&2
  exit 2
fi
if [[ ! -f "$CORPUS" ]]; then
  echo "start_retriever_serve.sh: corpus $CORPUS not found (give --corpus; start_retriever.sh --source prepares one)" >&2
  exit 2
fi
if [[ -z "$INDEX_DIR" ]]; then  # the same default as start_retriever.sh
  name="$(basename "$CORPUS" .jsonl)_$(basename "$ENCODER")_${INDEX_TYPE}${LIMIT:+_$LIMIT}"
  INDEX_DIR="$ROOT/runs/retriever/$name"
fi
ADDRESS_ARGS=()
[[ "$CLUSTER" != "local" ]] && ADDRESS_ARGS=(--address "$CLUSTER")

if [[ ! -f "$INDEX_DIR/manifest.json" ]]; then
  BUILD_RAY=()
  [[ "$RAY_BUILD" == "1" ]] && BUILD_RAY=(--ray ${ADDRESS_ARGS[@]:+--ray_address "$CLUSTER"})
  echo "[start_retriever_serve] building $INDEX_TYPE index ($ENCODER) in $INDEX_DIR ${BUILD_RAY[*]:-}"
  "$PYTHON" -m retriever.build_index --corpus "$CORPUS" --index_dir "$INDEX_DIR" --encoder "$ENCODER" \
    --index_type "$INDEX_TYPE" ${LIMIT:+--limit "$LIMIT"} ${BUILD_RAY[@]:+"${BUILD_RAY[@]}"}
fi

echo "[start_retriever_serve] serving $INDEX_DIR with $REPLICAS Serve replica(s) on $HOST:$PORT (Ray: $CLUSTER)"
exec "$PYTHON" -m retriever.serve --ray ${ADDRESS_ARGS[@]:+"${ADDRESS_ARGS[@]}"} --replicas "$REPLICAS" \
  --replica_gpus "$REPLICA_GPUS" --replica_cpus "$REPLICA_CPUS" --index_dir "$INDEX_DIR" --host "$HOST" \
  --port "$PORT" ${EXTRA[@]:+"${EXTRA[@]}"}
