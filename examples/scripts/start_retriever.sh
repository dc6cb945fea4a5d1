#!/usr/bin/env bash
# Start the retrieval service in one command: prepare the corpus (optional), build the index if missing, serve.
#
# Usage:
#   examples/scripts/start_retriever.sh [--source DUMP.jsonl] [--corpus CORPUS.jsonl] [--index_dir DIR]
#       [--encoder bm25|e5-base-v2|bge-large-en-v1.5|minilm|PATH] [--index_type bm25|flat|hnsw|ivfpq]
#       [--host 127.0.0.1] [--port 8000] [--limit N] [--print_config] [-- extra server flags]
#
# --print_config prints what would be served (corpus=, index_dir=, index_state=built|to_build, encoder=,
# index_type=, url=, one per line) after checking that the corpus (or its source) exists, and exits.
#
# Every flag has an environment variable (flags win): RETRIEVER_SOURCE, RETRIEVER_CORPUS, RETRIEVER_ENCODER,
# RETRIEVER_INDEX_TYPE, RETRIEVER_INDEX_DIR, RETRIEVER_HOST, RETRIEVER_PORT, RETRIEVER_LIMIT; --help lists them with
# their defaults and meanings (the table in env_help.sh). There is no default corpus: one taken from eval data would
# leak the answers.
#
# Examples:
#   examples/scripts/start_retriever.sh --encoder minilm --index_type hnsw --port 8001
#   RETRIEVER_SOURCE=kilt_knowledgesource.json RETRIEVER_CORPUS=data/kilt_100w.jsonl \
#     RETRIEVER_ENCODER=e5-base-v2 examples/scripts/start_retriever.sh
#   curl -s localhost:8000/retrieve -d '{"queries":["who wrote hamlet"],"topk":3,"return_scores":true}'
set -euo pipefail
source "$(dirname "${BASH_SOURCE[0]}")/env_help.sh"
help_init "$@"

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)"
CALLER_PWD="$PWD"  # relative paths given are the caller's (resolved below), not the repo root's
cd "$ROOT"

SOURCE="${RETRIEVER_SOURCE:-}"
CORPUS="${RETRIEVER_CORPUS:-}"
ENCODER="${RETRIEVER_ENCODER:-bm25}"
INDEX_TYPE="${RETRIEVER_INDEX_TYPE:-}"
INDEX_DIR="${RETRIEVER_INDEX_DIR:-}"
HOST="${RETRIEVER_HOST:-127.0.0.1}"
PORT="${RETRIEVER_PORT:-8000}"
LIMIT="${RETRIEVER_LIMIT:-}"
PRINT_CONFIG=0
EXTRA=()

while [[ $# -gt 0 ]]; do
  case "$1" in
    --source) SOURCE="$2"; shift 2 ;;
    --corpus) CORPUS="$2"; shift 2 ;;
    --encoder) ENCODER="$2"; shift 2 ;;
    --index_type) INDEX_TYPE="$2"; shift 2 ;;
    --index_dir) INDEX_DIR="$2"; shift 2 ;;
    --host) HOST="$2"; shift 2 ;;
    --port) PORT="$2"; shift 2 ;;
    --limit) LIMIT="$2"; shift 2 ;;
    --print_config) PRINT_CONFIG=1; shift ;;
    -h|--help) launcher_help start_retriever.sh "python -m retriever.server" "after --"; exit 0 ;;
    --) shift; EXTRA=("$@"); break ;;
    *) echo "start_retriever.sh: unknown flag $1 (see --help)" >&2; exit 2 ;;
  esac
done

for _var in SOURCE CORPUS INDEX_DIR ENCODER; do  # ENCODER only when it names a folder there (else a preset / hub id)
  _val="${!_var}"
  [[ -z "$_val" || "$_val" == /* ]] && continue
  [[ "$_var" == ENCODER && ! -e "$CALLER_PWD/$_val" ]] && continue
  printf -v "$_var" '%s' "$CALLER_PWD/${_val#./}"
done

if [[ -z "${PYTHON:-}" ]]; then
  if [[ -x "$ROOT/.venv/bin/python" ]]; then PYTHON="$ROOT/.venv/bin/python"; else PYTHON=python; fi
fi
export PYTHONPATH="$ROOT${PYTHONPATH:+:$PYTHONPATH}"
[[ -z "$INDEX_TYPE" ]] && { [[ "$ENCODER" == "bm25" ]] && INDEX_TYPE=bm25 || INDEX_TYPE=flat; }

if [[ -z "$CORPUS" ]]; then
  if [[ -n "$INDEX_DIR" && -f "$INDEX_DIR/manifest.json" ]]; then  # a built index: its manifest names the corpus
    CORPUS="$("$PYTHON" -c 'import json, sys; print(json.load(open(sys.argv[1])).get("corpus_path", ""))' \
      "$INDEX_DIR/manifest.json")"
  else
    echo "start_retriever.sh: no corpus: give --corpus (RETRIEVER_CORPUS) or --index_dir of a built index" >&2
    exit 2
  fi
elif [[ ! -f "$CORPUS" && "$PRINT_CONFIG" == "1" && ! ( -n "$INDEX_DIR" && -f "$INDEX_DIR/manifest.json" ) ]]; then
  if [[ -z "$SOURCE" ]]; then
    echo "start_retriever.sh: corpus $CORPUS not found (give --corpus, or --source to prepare it)" >&2
    exit 2
  elif [[ ! -f "$SOURCE" ]]; then
    echo "start_retriever.sh: corpus $CORPUS not found and its source $SOURCE not found either" >&2
    exit 2
  fi
elif [[ ! -f "$CORPUS" && ! ( -n "$INDEX_DIR" && -f "$INDEX_DIR/manifest.json" ) ]]; then
  if [[ -n "$SOURCE" ]]; then
    echo "[start_retriever] preparing $CORPUS from $SOURCE"
    "$PYTHON" -m retriever.prepare_corpus --input "$SOURCE" --output "$CORPUS"
  else
    echo "start_retriever.sh: corpus $CORPUS not found (give --corpus, or --source to prepare it)" >&2
    exit 2
  fi
fi

if [[ -z "$INDEX_DIR" ]]; then
  name="$(basename "$CORPUS" .jsonl)_$(basename "$ENCODER")_${INDEX_TYPE}${LIMIT:+_$LIMIT}"
  INDEX_DIR="$ROOT/runs/retriever/$name"
fi

if [[ "$PRINT_CONFIG" == "1" ]]; then
  state=to_build
  [[ -f "$INDEX_DIR/manifest.json" ]] && state=built
  printf 'corpus=%s\nindex_dir=%s\nindex_state=%s\nencoder=%s\nindex_type=%s\nurl=http://%s:%s\n' \
    "$CORPUS" "$INDEX_DIR" "$state" "$ENCODER" "$INDEX_TYPE" "$HOST" "$PORT"
  exit 0
fi

if [[ ! -f "$INDEX_DIR/manifest.json" ]]; then
  echo "[start_retriever] building $INDEX_TYPE index ($ENCODER) in $INDEX_DIR (resumable: rerun after an interruption)"
  "$PYTHON" -m retriever.build_index --corpus "$CORPUS" --index_dir "$INDEX_DIR" --encoder "$ENCODER" \
    --index_type "$INDEX_TYPE" ${LIMIT:+--limit "$LIMIT"}
fi

echo "[start_retriever] serving $INDEX_DIR on http://$HOST:$PORT"
exec "$PYTHON" -m retriever.server --index_dir "$INDEX_DIR" --host "$HOST" --port "$PORT" "${EXTRA[@]}"
