#!/usr/bin/env bash
# R1-Searcher (arXiv 2503.05592) RL on OpenRLHF + our search agent.
#
#   bash examples/scripts/r1searcher.sh {qwen7b-base|llama8b-instruct} {1|2|single} [extra trainer flags]
#
# Settings (SETTING=released|paper; docs/parity.md lists every value with its source file:line):
#   released  the released scripts of RUCAIBox/R1-Searcher with the values their rollout loop hard-codes:
#             qwen7b-base single  = scripts/qwen_reinforce_plus_train.sh: ONE run from the base model on the
#                                   stage-2 reward (train/reward_server_qwen_zero.py), reinforce_baseline,
#                                   64 prompts x 16 samples per step, updates of 256, KL 0;
#             llama8b-instruct 1  = scripts/llama_reinforce_plus_train_stage1.sh: group_norm, 15 prompts x 16,
#                                   updates of 60, KL 1e-4 (k1 in the reward), released stage-1 reward
#                                   (r1searcher_released_llama_stage1: +-1 Cover-EM, +0.5 retrieval, +0.5 format)
#                                   normalised as released: its server returns [score, 0] per sample, so each
#                                   group_norm row is 8 samples of a prompt and 8 zeros (--search.group_norm_zero_pad);
#             llama8b-instruct 2  = scripts/llama_reinforce_plus_train_stage2.sh: reinforce_baseline, 65 x 16,
#                                   updates of 260, from the stage-1 checkpoint (STAGE1_CKPT), released stage-2 reward
#                                   (r1searcher_released_llama_stage2: F1, -1 format).
#             All: lr 2e-6 constant (cosine to 10% over 10,000 episodes, no warm-up: flat for any real run; they
#             stop by hand, so no step cap unless you pass --train.max_steps), AdamW betas (0.9, 0.95), no weight
#             decay, clip 0.2, loss averaged per sequence then over sequences, temperature 1 and top_p 0.95,
#             512 tokens per generation call, no stop at </answer> (only at <|end_of_query|>), top-3, at most
#             8 retrievals (9 calls), context 1,024 + 29,000; documents appended whole (no cap) and written as the
#             HotpotQA abstracts TSV line "(1)Title: T Text:  abstract" (prepare that corpus with
#             python -m retriever.prepare_corpus --format hotpotqa_abstracts); queries cleaned as released (quotes
#             removed, whitespace collapsed).
#   paper     the paper's recipe where it differs: two stages for both models (stage 1 reward = 0.5 retrieval +
#             0.5 format, stage 2 = answer F1 with a -2 format penalty), REINFORCE++ (reinforce_baseline) in both
#             stages; every other value as released. qwen7b-base stages 1 and 2 exist only in this setting (the
#             released Qwen recipe is the single run).
# Data (prompt/label jsonl from python -m openrlhf_search.cli.prepare_data with the policy's tokenizer, e.g.
#   python -m openrlhf_search.cli.prepare_data --input "$DATA_DIR"/qa/r1searcher/stage_1.jsonl \
#       --protocol r1searcher --tokenizer meta-llama/Llama-3.1-8B-Instruct --chat_template --bucket --mix 0:2:1.5 \
#       --out data/r1searcher_stage1_llama8b-instruct.jsonl
# ; with --tokenizer the special tokens vLLM added to the released run's text prompts are written in front, so the
# Llama prompts start with two <|begin_of_text|> as released): TRAIN_DATA default
# $DATA_DIR/r1searcher_<stage>_<model>.jsonl (base and chat renderings differ), EVAL_DATA
# default $DATA_DIR/r1searcher_eval_<model>.jsonl. Retriever: bge-large-en-v1.5 Flat; training corpus = the
# HotpotQA 2017 abstracts (train/wiki_corpus_load.py); RETRIEVER_CORPUS is required (no default) or RETRIEVER_URLS.
# Not from the released scripts (ours): eval every 20 steps on EVAL_DATA, layout (common.sh).
# Layout: the released runs train on 5 actor GPUs (actor and reference colocated) with one vLLM engine of tensor
# parallel 2 on 2 more GPUs, ZeRO-2 (scripts/llama_reinforce_plus_train_stage1.sh:45-51,68 and
# llama_reinforce_plus_train_stage2.sh:46-52,69; the Qwen run 4 + 2: qwen_reinforce_plus_train.sh:45-51,68), micro
# batches of 1 for training and rollout (lines 56-59 / 57-60 / 56-59). Our default uses every GPU of the node
# (common.sh layout_args): the released Llama batches (60 and 260 samples per update) do not divide over 8 DeepSpeed
# ranks, so on 1 x 8 GPUs the Llama stage 1 trains on 6 GPUs with 2 vLLM engines on the other 2, stage 2 on 5 with
# 3 engines (2 x 8: 6 + 2 and 5 + 3 per node; 1 x 4: all colocated). The released layout itself:
#   GPUS_PER_NODE=7 ACTOR_GPUS_PER_NODE=5 VLLM_TP=2 bash examples/scripts/r1searcher_llama8b_instruct_stage1.sh

USAGE="usage: r1searcher.sh qwen7b-base|llama8b-instruct 1|2|single [flags]"
source "$(dirname "${BASH_SOURCE[0]}")/env_help.sh"
help_init "$@"
# --help alone: the defaults of one configuration (the arguments change MODEL, SETTING, data, batch sizes)
[[ "$LAUNCHER_HELP" == 1 && "${1:-}" == -* ]] && set -- qwen7b-base single --help
MODEL_KEY="${1:?$USAGE}"
STAGE="${2:?$USAGE}"
shift 2
ESTIMATOR_ENV="${ESTIMATOR:-}"  # ESTIMATOR=... overrides the setting's estimator
source "$(dirname "${BASH_SOURCE[0]}")/common.sh"

case "$MODEL_KEY/$STAGE" in
    qwen7b-base/single) DEFAULT_SETTING=released ;;
    qwen7b-base/1|qwen7b-base/2) DEFAULT_SETTING=paper ;;
    llama8b-instruct/1|llama8b-instruct/2) DEFAULT_SETTING=released ;;
    */1|*/2|*/single) log "unknown model $MODEL_KEY"; exit 2 ;;
    *) log "stage must be 1, 2 or single (qwen7b-base)"; exit 2 ;;
esac
SETTING="${SETTING:-$DEFAULT_SETTING}"
case "$MODEL_KEY/$STAGE/$SETTING" in
    qwen7b-base/single/released|qwen7b-base/[12]/paper|llama8b-instruct/[12]/released|llama8b-instruct/[12]/paper) ;;
    qwen7b-base/single/paper) die "the paper's Qwen recipe has two stages: use r1searcher_qwen7b_base_stage{1,2}.sh" ;;
    qwen7b-base/[12]/released) die "the released Qwen recipe is one run: use r1searcher_qwen7b_base_single.sh" ;;
    *) die "SETTING must be released or paper, got $SETTING" ;;
esac

case "$MODEL_KEY" in
    qwen7b-base)  # scripts/qwen_reinforce_plus_train.sh
        BASE_MODEL="${BASE_MODEL:-Qwen/Qwen2.5-7B}"; CHAT=false; KL=0.0
        ROLLOUT_BS=64; TRAIN_BS=256; ESTIMATOR=reinforce_baseline; SAVE_STEPS=20; MAX_CKPT=3 ;;
    llama8b-instruct)
        BASE_MODEL="${BASE_MODEL:-meta-llama/Llama-3.1-8B-Instruct}"; CHAT=true; KL=1e-4
        if [[ "$STAGE" == "1" ]]; then  # scripts/llama_reinforce_plus_train_stage1.sh
            ROLLOUT_BS=15; TRAIN_BS=60; ESTIMATOR=group_norm; SAVE_STEPS=10; MAX_CKPT=2
        else                             # scripts/llama_reinforce_plus_train_stage2.sh
            ROLLOUT_BS=65; TRAIN_BS=260; ESTIMATOR=reinforce_baseline; SAVE_STEPS=20; MAX_CKPT=4
        fi ;;
esac
STAGE1_FROM=""
case "$STAGE" in
    single) MODEL="${MODEL:-$BASE_MODEL}"; SCHEME=r1searcher_released_stage2 ;;
    1) MODEL="${MODEL:-$BASE_MODEL}"; SCHEME=r1searcher_released_llama_stage1 ;;
    2) STAGE1_FROM="${STAGE1_CKPT:-$OUTPUT_ROOT/r1searcher_${MODEL_KEY}_stage1}"; MODEL="$STAGE1_FROM"
       SCHEME=r1searcher_released_llama_stage2
       export MEMORY_MODEL="${MEMORY_MODEL:-$BASE_MODEL}" ;;  # the memory estimate's shape until stage 1 exists
esac
if [[ "$SETTING" == "paper" ]]; then
    ESTIMATOR=reinforce_baseline
    [[ "$STAGE" == "1" ]] && SCHEME=r1searcher_stage1 || SCHEME=r1searcher_stage2
fi
ESTIMATOR="${ESTIMATOR_ENV:-$ESTIMATOR}"
# the released Llama stage 1's [score, 0] rewards in group_norm rows of 16 (train/reward_server_llama_stage1.py:226)
ZERO_PAD=false
[[ "$MODEL_KEY/$STAGE/$SETTING/$ESTIMATOR" == "llama8b-instruct/1/released/group_norm" ]] && ZERO_PAD=true
RUN="r1searcher_${MODEL_KEY}_stage${STAGE}"
[[ "$STAGE" == "single" ]] && RUN="r1searcher_${MODEL_KEY}_single"
TRAIN_DATA_FILE="${TRAIN_DATA:-$DATA_DIR/r1searcher_$([[ "$STAGE" == "single" ]] && echo stage2 || echo "stage$STAGE")_${MODEL_KEY}.jsonl}"
EVAL_DATA_FILE="${EVAL_DATA:-$DATA_DIR/r1searcher_eval_${MODEL_KEY}.jsonl}"
# the inputs: R1-Searcher's files (git clone --depth 1 https://github.com/RUCAIBox/R1-Searcher); the tokenizer: the
# policy's, for stage 2 the base model's (its start, stage 1's checkpoint, has the same one and may not exist yet)
DATA_TOKENIZER="$MODEL"; [[ "$STAGE" == 2 ]] && DATA_TOKENIZER="$BASE_MODEL"
TRAIN_DATA_MAKE="$(prepare_hint "$TRAIN_DATA_FILE" r1searcher "$DATA_TOKENIZER" "$CHAT" \
    "R1-Searcher/data/training_set/stage_$([[ "$STAGE" == 1 ]] && echo 1 || echo 2).jsonl")"
EVAL_DATA_MAKE="$(prepare_hint "$EVAL_DATA_FILE" r1searcher "$DATA_TOKENIZER" "$CHAT" \
    R1-Searcher/data/eval_set/hotpotqa_500.jsonl)"
# R1-Searcher's retriever: BGE-large-en-v1.5, Flat inner product (train/wiki_corpus_load.py,
# wiki_corpus_index_bulid/build_corpus_index.py).
PAPER_RETRIEVER_ENCODER=bge-large-en-v1.5 PAPER_RETRIEVER_INDEX_TYPE=flat  # what a running retriever is compared with
export RETRIEVER_ENCODER="${RETRIEVER_ENCODER:-bge-large-en-v1.5}" RETRIEVER_INDEX_TYPE="${RETRIEVER_INDEX_TYPE:-flat}"

RUN_DESC="r1searcher.sh $MODEL_KEY $STAGE (setting $SETTING)"
cpu_cluster_setup r1searcher "$CHAT" 4
check_inputs
TRAIN_MICRO=1 ROLLOUT_MICRO=1 N_SAMPLES=16  # released: scripts/*_train*.sh:21,56-59 (micro-batches of 1)
check_data_batch "$TRAIN_DATA_FILE" "$ROLLOUT_BS" "$N_SAMPLES" "$TRAIN_BS"
layout_args "$TRAIN_BS" "$TRAIN_MICRO" "$(( ROLLOUT_BS * N_SAMPLES ))" "$ROLLOUT_MICRO" "$([[ "$ESTIMATOR" == gae ]] && echo true || echo false)"
start_retrievers
log "setting: $SETTING | model: $MODEL${MODEL_WHERE:+ ($MODEL_WHERE)} | data: $TRAIN_DATA_FILE (expected: $([[ $CHAT == true ]] && echo "chat-rendered with the policy's template" || echo "base prompt"), checked by cli.train) | eval: $EVAL_DATA_FILE"
launch \
    "${LAYOUT_ARGS[@]}" \
    --actor.model_name_or_path "$MODEL" \
    --data.prompt_dataset "$TRAIN_DATA_FILE" \
    --data.input_key prompt --data.label_key label --data.max_samples 100000 \
    --eval.dataset "$EVAL_DATA_FILE" --eval.steps 20 \
    --eval.n_samples_per_prompt 1 --eval.temperature 0.0 --search.eval_reward_scheme r1searcher_stage2 \
    --algo.advantage.estimator "$ESTIMATOR" \
    --rollout.n_samples_per_prompt "$N_SAMPLES" \
    --rollout.batch_size "$ROLLOUT_BS" --train.batch_size "$TRAIN_BS" \
    --rollout.micro_batch_size "$ROLLOUT_MICRO" --train.micro_batch_size "$TRAIN_MICRO" \
    --rollout.temperature 1.0 --rollout.top_p 0.95 \
    --actor.adam.lr 2e-6 --actor.lr_scheduler cosine_with_min_lr --actor.lr_warmup_ratio 0.0 --actor.min_lr_ratio 0.1 \
    --actor.adam.betas 0.9 0.95 --actor.adam.weight_decay 0.0 --actor.eps_clip 0.2 \
    --actor.loss_agg_mode seq-mean-token-mean \
    --algo.kl.init_coef "$KL" --algo.kl.estimator k1 \
    --data.max_len 30024 \
    --train.num_episodes 10000 --train.max_epochs 1 \
    --search.protocol r1searcher --search.chat_template "$CHAT" \
    --search.reward_scheme "$SCHEME" \
    --search.topk 3 --search.max_turns 9 --search.stop_at_answer false \
    --search.max_new_tokens_per_turn 512 --search.max_obs_tokens 0 \
    --search.passage_format hotpotqa_abstracts --search.query_cleaning r1searcher_train \
    --search.group_norm_zero_pad "$ZERO_PAD" \
    --ckpt.output_dir "$OUTPUT_ROOT/$RUN" --ckpt.path "$OUTPUT_ROOT/$RUN/ckpt" --ckpt.save_steps "$SAVE_STEPS" \
    --ckpt.max_num "$MAX_CKPT" --ckpt.save_hf \
    --logger.tensorboard_dir "$OUTPUT_ROOT/$RUN/tensorboard"
