#!/usr/bin/env bash
# Submit one of the training scripts of this folder to a running multi-node Ray cluster.
#
#   RAY_ADDRESS=http://HEAD_IP:8265 bash examples/scripts/ray_job_submit.sh r1searcher_qwen7b_base_stage1.sh \
#       [extra trainer flags]
#   DRY_RUN=1 bash examples/scripts/ray_job_submit.sh searchr1_ppo_qwen2.5-7b_base.sh   # print + validate only
#
# Prepare every node first with cluster_node_setup.sh (it starts that node's retriever, then joins Ray). The job
# uploads this checkout as its working dir; the driver (python -m openrlhf_search.cli.train) adds the search config
# to the job's runtime env, so every rollout actor on every node gets it and queries the retriever of its own node
# at http://127.0.0.1:$RETRIEVER_PORT. Set the layout of the cluster with NNODES and GPUS_PER_NODE.
# Ray's CLI is run as "$PYTHON -m ray.scripts.scripts" (the project's Ray, not whatever `ray` is on PATH); the job's
# driver runs "$JOB_PYTHON -m openrlhf_search.cli.train" (default: the same interpreter path, i.e. the checkout's
# .venv at the same path on the head node). Before train() the driver checks, on every GPU node, that the node's
# retriever answers and that all serve one index; otherwise the job exits 1 without training.
set -euo pipefail
source "$(dirname "${BASH_SOURCE[0]}")/env_help.sh"
help_init "$@"
if [[ "$LAUNCHER_HELP" == 1 && ( $# -lt 2 || "${1:-}" == -* ) ]]; then  # with a script, its own --help (SUBMIT=1)
    launcher_help ray_job_submit.sh SCRIPT "after its own flags" \
        "Every variable is the training script's: bash examples/scripts/ray_job_submit.sh SCRIPT --help lists them."
    exit 0
fi
SCRIPT="${1:?usage: ray_job_submit.sh TRAINING_SCRIPT [trainer flags]}"
shift
HERE="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
[[ -f "$SCRIPT" ]] || SCRIPT="$HERE/$SCRIPT"
SUBMIT=1 exec bash "$SCRIPT" "$@"
