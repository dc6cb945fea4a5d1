# shellcheck shell=bash
# The environment of every launcher in this folder, in one table, and the --help printer that reads it. Sourced
# first by each launcher (never run directly):
#
#   source "$(dirname "${BASH_SOURCE[0]}")/env_help.sh"; help_init "$@"
#   ... the launcher resolves its defaults ...
#   [[ "$LAUNCHER_HELP" == 1 ]] && { launcher_help TITLE COMMAND [WHERE] [SUMMARY]; exit 0; }
#
# `bash examples/scripts/<launcher>.sh --help` (or -h) prints the launcher's header (description and usage), then
# every variable it reads (its own file, the files it sources and the scripts of this folder it runs), grouped, each
# with the value that launcher resolves for it (its model, data files, encoder, ...) or the caller's value, marked
# "(set)", and one line naming the command the extra arguments go to. It starts and builds nothing.
#
# Table rows: group|variable|default|meaning|read by. The default is a bash word evaluated in the launcher after it
# resolved its settings (so "${MODEL-}" is that launcher's model); it must be `set -u` safe and hold no quote (an
# apostrophe inside ${VAR:-...} opens a quoted string in bash). "read by": the files of this folder that read the
# variable (common.sh passes GPU_MEM_GB, MEMORY_CHECK, DISK_CHECK and PLACEMENT_WAIT_S on to cli.train, eval.sh passes OPENAI_API_KEY on to
# cli.eval); a launcher prints the rows read by one of its files. tests/test_launcher_help.py checks that every
# variable a launcher's files read with ${VAR:-...}, ${VAR-...}, ${VAR:+...} or ${VAR:?...} is printed by its
# --help, except these internal ones (set by the scripts themselves, never by the caller):
LAUNCHER_INTERNAL_VARS="RETRIEVER_ON_VLLM_GPUS LAUNCHER_HELP EVAL_DATA_FILE LAYOUT_DESC RETRIEVER_PORT_SET STAGE1_FROM ESTIMATOR_ENV LIMIT MODEL_WHERE PAPER_RETRIEVER_ENCODER PAPER_RETRIEVER_INDEX_TYPE TRAIN_DATA_MAKE EVAL_DATA_MAKE"

HELP_DIR="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"

launcher_env_table() {
    cat <<'EOF'
Run mode|DRY_RUN|0|1 (or --dry_run): validate every flag with OpenRLHF's parser, check the inputs, print the resolved config; start nothing (eval.sh, cluster_node_setup.sh: print the commands)|common.sh eval.sh cluster_node_setup.sh
Layout|NNODES|${NNODES-}|nodes in the job|common.sh
Layout|GPUS_PER_NODE|${GPUS_PER_NODE-}|GPUs per node; with CPU_CLUSTER=1 the DeepSpeed ranks per model and vLLM-CPU engines (default 1 there)|common.sh
Layout|VLLM_TP|${VLLM_TP-}|tensor parallel size of each vLLM engine|common.sh
Layout|ACTOR_GPUS_PER_NODE|auto${LAYOUT_ACTOR_GPUS:+ (here $LAYOUT_ACTOR_GPUS)}|GPUs per node for actor and reference, the rest hold vLLM (auto: all, colocated, when the batch sizes fit; with ASYNC=1 the split closest to half that fits; python -m openrlhf_search.launch.layout)|common.sh
Layout|GPU_MEM_GB|nvidia-smi, else 80|GiB of one GPU for the per-phase memory estimate (dry run and launch): above 90% a warning, above 100% a refusal naming the settings that fit; MEMORY_CHECK=0 launches anyway|common.sh
Layout|RETRIEVER_GPU_GB|estimated|GiB the node's dense retriever index takes on each GPU it sits on: its fp16 faiss shard, faiss temporary memory and a CUDA context (estimated for a Flat index; 0 for BM25, HNSW, Serve)|common.sh
Layout|RETRIEVER_GPUS|${RETRIEVER_GPUS:-all}|GPUs of the node's dense index and its query encoder: all, none or ids (a split layout: the vLLM GPUs)|common.sh
Layout|RETRIEVER_FAISS_TEMP_GB|1.5|faiss temporary memory per GPU of the dense index, GiB|common.sh
Layout|MEMORY_CHECK|1|0: launch even when the memory estimate exceeds the GPU (printed as a warning)|common.sh
Layout|DISK_CHECK|1|0: launch even when the disk of --ckpt.path cannot hold the run's checkpoints (printed as a warning)|common.sh
Layout|MEMORY_MODEL|${MEMORY_MODEL:-the policy}|model whose config the memory estimate reads while MODEL is not a folder yet (stage 2: its base model)|r1searcher.sh
Layout|PLACEMENT_WAIT_S|60|seconds the driver waits for Ray to have the layout's GPUs free before it exits with one line|common.sh
Model and data|SETTING|${SETTING-}|released or paper: which source the hyper-parameters follow (docs/parity.md lists every value and its source line)|searchr1.sh r1searcher.sh common.sh
Model and data|MODEL|${MODEL-}|policy to train: a local folder or a hub name org/name|searchr1.sh r1searcher.sh common.sh
Model and data|MODEL_CHECK|1|0: skip looking a hub-name MODEL up in the local HF cache and on the hub (offline, only the paper models pass unchecked)|common.sh
Model and data|BASE_MODEL|${BASE_MODEL-}|R1-Searcher policy of the model key (Qwen/Qwen2.5-7B or meta-llama/Llama-3.1-8B-Instruct); MODEL overrides it|r1searcher.sh
Model and data|THINKING|1|1: the policy thinks (protocol chat_tools, Qwen3 enable_thinking=True); 0: enable_thinking=False (protocol chat_tools_nothink); prompts must be rendered for the same protocol|chat_tools.sh
Model and data|STAGE1_CKPT|${STAGE1_FROM:-unused (stage-2 launchers only)}|stage 2's start: stage 1's run folder (its newest global_step*_hf copy) or an HF model folder|r1searcher.sh
Model and data|TRAIN_DATA|${TRAIN_DATA_FILE-}|training prompts (jsonl from python -m openrlhf_search.cli.prepare_data with the policy's tokenizer)|searchr1.sh r1searcher.sh common.sh
Model and data|EVAL_DATA|${EVAL_DATA_FILE-}|evaluation prompts, same format|searchr1.sh r1searcher.sh common.sh
Model and data|DATA_DIR|${DATA_DIR:-data (training launchers); none (eval.sh: hub sets only)}|folder of the default prompt files (training launchers) or of dataset names (eval.sh: R1-Searcher's sets under qa/r1searcher/)|common.sh eval.sh
Training / steps|ALGO|${ALGO:-grpo}|chat_tools.sh: grpo (group of 5, KL as a k3 loss) or ppo (GAE with a critic, KL as a k1 reward penalty), both with Search-R1 released values|chat_tools.sh
Training / steps|ESTIMATOR|${ESTIMATOR-}|advantage estimator, overriding the setting's (reinforce_baseline, group_norm, gae, ...)|r1searcher.sh
Training / steps|ALLOW_SHORT|0|1: start even when TRAIN_DATA gives fewer steps than the LR warm-up|common.sh
Checkpoints and resume|OUTPUT_ROOT|${OUTPUT_ROOT-}|checkpoints, HF copies, tensorboard logs and retriever logs, one folder per run under it|common.sh
Checkpoints and resume|FRESH|0|1: start over instead of resuming from the run folder's newest checkpoint (the old folder is moved aside, never deleted)|common.sh
Async|ASYNC|0|1: asynchronous training, vLLM generates the next batch while DeepSpeed trains (vLLM then never shares the trainer's GPUs)|common.sh
Async|ASYNC_QUEUE_SIZE|1|batches vLLM may generate ahead of training (ASYNC=1)|common.sh
Async|PARTIAL_ROLLOUT|0|1: add --train.partial_rollout_enable (ASYNC=1)|common.sh
Retriever|RETRIEVER_URLS|${ROUTES:-unset: a retriever is started on RETRIEVER_PORT}|comma-separated running retrievers (checked: healthy, one index); none is started then|common.sh eval.sh
Retriever|RETRIEVER_MODE|node|node: one start_retriever.sh per node; serve: one Ray Serve application (start_retriever_serve.sh) for the cluster|common.sh
Retriever|RETRIEVER_CORPUS|${RETRIEVER_CORPUS:-none: required unless RETRIEVER_INDEX_DIR is built (launchers: or RETRIEVER_URLS)}|passage jsonl ({id,contents} or {id,title,text}); no default (one taken from eval data would leak the answers)|common.sh start_retriever.sh start_retriever_serve.sh
Retriever|RETRIEVER_SOURCE|none|raw dump (KILT pages, wiki-18, {id,title,text}) that python -m retriever.prepare_corpus cuts into RETRIEVER_CORPUS when that is missing|common.sh start_retriever.sh
Retriever|RETRIEVER_ENCODER|${RETRIEVER_ENCODER:-none: required by cluster_node_setup.sh, bm25 for start_retriever.sh alone, the paper encoder in a launcher}|bm25, e5-base-v2 (Search-R1), bge-large-en-v1.5 (R1-Searcher), minilm or a model folder|common.sh eval.sh start_retriever.sh start_retriever_serve.sh cluster_node_setup.sh
Retriever|RETRIEVER_INDEX_TYPE|${RETRIEVER_INDEX_TYPE:-bm25 for the bm25 encoder, else flat}|bm25, flat, hnsw or ivfpq|common.sh start_retriever.sh start_retriever_serve.sh
Retriever|RETRIEVER_INDEX_DIR|${RETRIEVER_INDEX_DIR:-runs/retriever/<corpus>_<encoder>_<index type>}|index folder: reused when built (its manifest names the corpus), built there otherwise|common.sh start_retriever.sh start_retriever_serve.sh
Retriever|RETRIEVER_LIMIT|none (every passage)|index only the first N passages (quick trials)|start_retriever.sh start_retriever_serve.sh
Retriever|RETRIEVER_HOST|127.0.0.1 (Serve: 0.0.0.0)|address the retriever listens on (0.0.0.0 serves other machines)|start_retriever.sh start_retriever_serve.sh
Retriever|RETRIEVER_PORT|${RETRIEVER_PORT:-8000}|port of the retriever started here (CPU_CLUSTER=1: a free port unless given)|common.sh start_retriever.sh start_retriever_serve.sh cluster_node_setup.sh
Retriever|RETRIEVER_WAIT_S|3600|seconds to wait for a started retriever to answer /health (index building); a retriever that dies ends the wait at once|common.sh eval.sh cluster_node_setup.sh
Retriever: Ray Serve|RETRIEVER_SERVE_IP|this node's first IP (hostname -I)|address every node reaches the Serve retriever at (RETRIEVER_MODE=serve)|common.sh
Retriever: Ray Serve|RETRIEVER_REPLICAS|2|Serve replicas of the retriever|common.sh start_retriever_serve.sh
Retriever: Ray Serve|RETRIEVER_REPLICA_GPUS|0|GPUs per replica (1 for a dense index served from GPU); on one node they come off GPUS_PER_NODE|common.sh start_retriever_serve.sh
Retriever: Ray Serve|RETRIEVER_REPLICA_CPUS|1|CPUs per replica|start_retriever_serve.sh
Retriever: Ray Serve|RETRIEVER_RAY_BUILD|0|1: build a missing dense index with Ray Data over the cluster's GPUs (--ray_build)|start_retriever_serve.sh
Retriever: Ray Serve|RAY_CLUSTER|auto|Ray address of the Serve driver (auto: this node's cluster; local: a private Ray for a one-machine trial)|start_retriever_serve.sh
Evaluation|DATASETS|${DEFAULT_SETS-}|space-separated set names or paths|eval.sh
Evaluation|OUT_DIR|${OUT_DIR-}|predictions, summaries and retriever logs|eval.sh
Evaluation|TOPK|${DEFAULT_TOPK-}|passages per query (R1-Searcher 5, Search-R1 3)|eval.sh
Evaluation|HOTPOTQA_RETRIEVER_URL|none|r1searcher: a running retriever over the HotpotQA 2017 abstracts|eval.sh
Evaluation|HOTPOTQA_CORPUS|none|r1searcher: the abstracts' passage jsonl, to start that retriever on HOTPOTQA_PORT|eval.sh
Evaluation|HOTPOTQA_PORT|8001|port of the HotpotQA retriever started here|eval.sh
Evaluation|KILT_RETRIEVER_URL|none|r1searcher: a running retriever over KILT 100-word passages (2Wiki, MuSiQue, Bamboogle)|eval.sh
Evaluation|KILT_CORPUS|none|r1searcher: the KILT passage jsonl, to start that retriever on KILT_PORT|eval.sh
Evaluation|KILT_PORT|8002|port of the KILT retriever started here|eval.sh
Evaluation|ONLINE|0|1 (r1searcher): also Bamboogle against web search, the row bamboogle@web beside the local one (R1-Searcher online evaluation)|eval.sh
Evaluation|WEB_RETRIEVER_URL|none|ONLINE=1: a running web retriever (python -m retriever.server --web ...); none is started then|eval.sh
Evaluation|WEB_PROVIDER|serper|ONLINE=1: provider of the web retriever started here: serper or serpapi|eval.sh
Evaluation|SERPER_API_KEY|none|API key of --web serper (read by retriever.server, never logged)|eval.sh
Evaluation|SERPAPI_API_KEY|none|API key of --web serpapi (read by retriever.server, never logged)|eval.sh
Evaluation|WEB_SITE|en.wikipedia.org|ONLINE=1: queries restricted to this site, as R1-Searcher online eval (empty: the whole web)|eval.sh
Evaluation|WEB_MAX_QUERIES|2000|ONLINE=1: most provider calls of the web retriever started here (its cache OUT_DIR/web_cache.sqlite makes reruns free)|eval.sh
Evaluation|WEB_PORT|8003|port of the web retriever started here|eval.sh
Evaluation|JUDGE_URL|none (no judge accuracy)|OpenAI-compatible endpoint of the judge (a local vllm serve, say)|eval.sh
Evaluation|JUDGE_MODEL|gpt-4o-mini|judge model name|eval.sh
Evaluation|OPENAI_API_KEY|none|key for a hosted judge endpoint (read by cli.eval)|eval.sh
Submission / Ray|SUBMIT|0|1: ray job submit to a running cluster (ray_job_submit.sh sets it); each node serves its own retriever (cluster_node_setup.sh)|common.sh
Submission / Ray|RAY_ADDRESS|${RAY_ADDRESS-}|Ray dashboard address the job is submitted to|common.sh
Submission / Ray|JOB_PYTHON|${PYTHON-}|interpreter of the submitted job's driver on the head node (default: PYTHON)|common.sh
Submission / Ray|HEAD|0|1: this node starts the Ray head|cluster_node_setup.sh
Submission / Ray|HEAD_ADDRESS|none: required on workers|ip:6379 of the Ray head a worker joins|cluster_node_setup.sh
CPU cluster mode|CPU_CLUSTER|0|1: run the launcher's real path on this machine's CPUs with a tiny policy, prompts and corpus (docs/cluster.md); cluster_node_setup.sh: start even with a CPU-only torch|common.sh cluster_node_setup.sh
CPU cluster mode|CPU_CLUSTER_CACHE|${REPO_ROOT:-.}/.cache/cpu_cluster|where the tiny assets are built once and reused|common.sh
CPU cluster mode|MAX_STEPS|${MAX_STEPS-}|training steps of a CPU_CLUSTER=1 run|common.sh
Local default run|RUN_DIR|${RUN_DIR-}|everything run_default.sh writes (data, index, checkpoints, tables)|run_default.sh
Local default run|ENCODER|${ENCODER-}|retriever of the local run: bm25 or minilm|run_default.sh
Environment|PYTHON|${PYTHON:-${PY:-.venv/bin/python of the checkout if present, else the python on PATH}}|interpreter; Ray's CLI runs as PYTHON -m ray.scripts.scripts; a GPU run refuses a torch without CUDA|common.sh eval.sh start_retriever.sh start_retriever_serve.sh cluster_node_setup.sh run_default.sh
Environment|PYTHONPATH|the checkout, put in front|module search path of every python started|common.sh start_retriever.sh start_retriever_serve.sh cluster_node_setup.sh run_default.sh
Environment|OMP_NUM_THREADS|every core|threads of each process of the job (its phases run one at a time)|run_default.sh
EOF
}

# help_init "$@": LAUNCHER_HELP=1 when an argument before any -- is -h or --help, and the table's variables the
# caller set (HELP_ENV: name -> value as given), read before the launcher changes any of them.
help_init() {
    LAUNCHER_HELP=0
    declare -gA HELP_ENV=()
    local arg var
    for arg in "$@"; do
        [[ "$arg" == -- ]] && break  # what follows goes to another program (start_retriever.sh -- server flags)
        if [[ "$arg" == -h || "$arg" == --help ]]; then LAUNCHER_HELP=1; fi
    done
    [[ "$LAUNCHER_HELP" == 1 ]] || return 0
    while IFS='|' read -r _ var _; do
        if [[ -n "${!var+x}" ]]; then HELP_ENV["$var"]="${!var}"; fi
    done < <(launcher_env_table)
    return 0
}

# launcher_files FILE: FILE and the scripts of this folder it sources or runs (a "/name.sh" in a line that is not a
# comment), transitively, space-separated.
launcher_files() {
    local todo=("$1") seen=" " file ref
    while (( ${#todo[@]} )); do
        file="${todo[0]}"
        todo=("${todo[@]:1}")
        [[ "$seen" == *" $file "* || ! -f "$HELP_DIR/$file" ]] && continue
        seen+="$file "
        for ref in $(grep -v '^[[:space:]]*#' "$HELP_DIR/$file" | grep -oE '/[A-Za-z0-9_.-]+\.sh' | sed 's#^/##'); do
            todo+=("$ref")
        done
    done
    echo "$seen"
}

# launcher_help TITLE COMMAND [WHERE] [SUMMARY]: the --help of the running launcher ($0): its header up to the
# second blank comment line, SUMMARY, the table's rows read by its files, grouped, and the line naming COMMAND, which
# the extra arguments go to (WHERE, default: after the launcher flags). Prints to stdout; starts nothing.
launcher_help() {
    local title="$1" command="$2" where="${3:-after the launcher flags (the last value wins)}" summary="${4:-}"
    local script files group var default meaning readers reader value i
    local groups=() g=() v=() d=() m=() shown=0 seen=""
    script="$(basename "$0")"
    files=" $(launcher_files "$script") "
    awk 'NR == 1 { next } !/^#/ { exit } $0 == "#" { if (++blank == 2) exit } { sub(/^# ?/, ""); print }' \
        "$HELP_DIR/$script"
    echo
    echo "Environment of $title: each variable with this launcher's default, or the value you set, marked (set)."
    [[ -n "$summary" ]] && printf '%s\n' "$summary"
    while IFS='|' read -r group var default meaning readers; do  # the rows read by one of the launcher's files
        for reader in $readers; do
            if [[ "$files" == *" $reader "* ]]; then
                g+=("$group"); v+=("$var"); d+=("$default"); m+=("$meaning")
                [[ "$seen" == *"|$group|"* ]] || { groups+=("$group"); seen+="|$group|"; }  # in the table's order
                break
            fi
        done
    done < <(launcher_env_table)
    for group in "${groups[@]}"; do
        echo
        echo "$group"
        for i in "${!v[@]}"; do
            [[ "${g[$i]}" == "$group" ]] || continue
            var="${v[$i]}"
            if [[ -n "${HELP_ENV[$var]+x}" && "$var" == *_KEY ]]; then
                value="(set, hidden)"  # a secret (API key) is never printed
            elif [[ -n "${HELP_ENV[$var]+x}" ]]; then
                value="${HELP_ENV[$var]} (set)"
            else
                eval "value=\"${d[$i]}\""
            fi
            if (( ${#var} + ${#value} < 36 )); then
                printf '  %-36s %s\n' "$var=$value" "${m[$i]}"
            else  # a long value (a path): the meaning on the next line
                printf '  %s\n  %-36s %s\n' "$var=$value" "" "${m[$i]}"
            fi
            shown=$(( shown + 1 ))
        done
    done
    (( shown )) || echo "  (no variables of its own)"
    echo
    echo "Other arguments are passed to $command $where; $command --help lists them."
    return 0
}
