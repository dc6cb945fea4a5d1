#!/usr/bin/env bash
# Search-R1 (arXiv 2503.09516) PPO or GRPO training on OpenRLHF + our search agent.
#
#   bash examples/scripts/searchr1.sh {ppo|grpo} {qwen2.5-3b|qwen2.5-7b} {base|instruct} [extra trainer flags]
#
# Setting: SETTING=released (default) reproduces the paper's run as released, scripts/nq_hotpotqa/v0.2/
# train_{ppo,grpo}.sh of PeterGriffinJin/Search-R1 (its docs/experiment_log.md names v0.2 as the paper's) with the
# defaults of verl/trainer/config/ppo_trainer.yaml. SETTING=paper is accepted and identical: every value the paper
# states agrees with those scripts. docs/parity.md lists each value, its source file:line and ours.
#   actor lr 1e-6, constant after a linear warm-up over 28.5% of the steps (critic 1e-5, 1.5%); 1,004 steps
#   (--train.max_steps, openrlhf_search/rl/schedules.py: verl's total_training_steps=1005 with global_steps starting at
#   1 and the loop returning when it reaches 1005, ray_trainer.py:673,843-845); 512 prompts per step; updates of 256 samples
#   (PPO 2 per step, GRPO 512 x 5 / 256 = 10); AdamW betas (0.9, 0.999), weight decay 0.01; entropy bonus 0.001;
#   PPO: GAE gamma = lambda = 1, KL 0.001 as a k1 penalty in the reward; GRPO: group 5, KL 0.001 as a k3 loss,
#   top_p 0.95 (yaml default; PPO sets 1.0); clip 0.2; 4096 tokens of context, 500 per turn, 500 per retrieved
#   block (cut as one string, closing tag included, as generation.py:80-89), top-3, 4 searches + the answering turn;
#   EM reward; eval before training and every 100 steps, checkpoint every 100 steps.
# Data: prompts rendered with the policy's own chat template, base models included (Search-R1's rl_dataset.py), so
# base and instruct files differ; build them with prepare_data and the policy's tokenizer from the NQ + HotpotQA
# train merge of the released run (~170k rows, scripts/nq_hotpotqa/data_process.sh; from the hub), e.g.
#   python -m openrlhf_search.cli.prepare_data --input nq_hotpotqa_train --protocol searchr1 \
#       --tokenizer Qwen/Qwen2.5-7B --out data/searchr1_train_qwen2.5_base.jsonl
# (defaults: TRAIN_DATA=$DATA_DIR/searchr1_train_qwen2.5_<variant>.jsonl, EVAL_DATA=..._eval_...). A TRAIN_DATA that
# gives fewer steps than the LR warm-up (episodes x ceil(rows / 512) < ceil(0.285 x 1004)) is refused with one line
# saying so; ALLOW_SHORT=1 starts anyway (a smoke run on the 512-row sample). Retriever:
# e5-base-v2 Flat over wiki-18: RETRIEVER_CORPUS=wiki-18.jsonl (required; no default) or RETRIEVER_URLS.

USAGE="usage: searchr1.sh ppo|grpo qwen2.5-3b|qwen2.5-7b base|instruct [flags]"
source "$(dirname "${BASH_SOURCE[0]}")/env_help.sh"
help_init "$@"
# --help alone: the defaults of one configuration (the arguments change MODEL, TRAIN_DATA, EVAL_DATA, batch sizes)
[[ "$LAUNCHER_HELP" == 1 && "${1:-}" == -* ]] && set -- ppo qwen2.5-7b base --help
ALGO="${1:?$USAGE}"
SIZE="${2:?$USAGE}"
VARIANT="${3:?$USAGE}"
shift 3
source "$(dirname "${BASH_SOURCE[0]}")/common.sh"

SETTING="${SETTING:-released}"
case "$SETTING" in
    released|paper) ;;  # identical for Search-R1 (docs/parity.md)
    *) die "SETTING must be released or paper, got $SETTING" ;;
esac
case "$SIZE" in
    qwen2.5-3b) HF=Qwen/Qwen2.5-3B ;;
    qwen2.5-7b) HF=Qwen/Qwen2.5-7B ;;
    *) log "unknown model size $SIZE"; exit 2 ;;
esac
case "$VARIANT" in
    base) MODEL="${MODEL:-$HF}" ;;
    instruct) MODEL="${MODEL:-$HF-Instruct}" ;;
    *) log "variant must be base or instruct"; exit 2 ;;
esac
case "$ALGO" in
    ppo) ALGO_ARGS=(--algo.advantage.estimator gae --algo.advantage.gamma 1.0 --algo.advantage.lambd 1.0
                    --rollout.n_samples_per_prompt 1 --rollout.top_p 1.0
                    --algo.kl.init_coef 0.001 --algo.kl.estimator k1
                    --critic.adam.lr 1e-5 --critic.lr_scheduler constant_with_warmup --critic.lr_warmup_ratio 0.015
                    --critic.adam.betas 0.9 0.999 --critic.adam.weight_decay 0.01 --critic.value_clip 0.5) ;;
    grpo) ALGO_ARGS=(--algo.advantage.estimator group_norm --rollout.n_samples_per_prompt 5 --rollout.top_p 0.95
                     --algo.kl.init_coef 0.001 --algo.kl.use_loss --algo.kl.estimator k3) ;;
    *) log "algorithm must be ppo or grpo"; exit 2 ;;
esac
RUN="searchr1_${ALGO}_${SIZE}_${VARIANT}"
TRAIN_DATA_FILE="${TRAIN_DATA:-$DATA_DIR/searchr1_train_qwen2.5_${VARIANT}.jsonl}"
EVAL_DATA_FILE="${EVAL_DATA:-$DATA_DIR/searchr1_eval_qwen2.5_${VARIANT}.jsonl}"
TRAIN_DATA_MAKE="$(prepare_hint "$TRAIN_DATA_FILE" searchr1 "$MODEL" true nq_hotpotqa_train)"
EVAL_DATA_MAKE="$(prepare_hint "$EVAL_DATA_FILE" searchr1 "$MODEL" true flashrag:nq)"
# (STEPS, not MAX_STEPS: common.sh reads MAX_STEPS from the environment for CPU_CLUSTER=1)
ROLLOUT_BS=512 EPISODES=15 STEPS=1004 WARMUP_RATIO=0.285
TRAIN_BS=256 TRAIN_MICRO=2 ROLLOUT_MICRO=8
N_SAMPLES=1 CRITIC=true
[[ "$ALGO" == grpo ]] && { N_SAMPLES=5; CRITIC=false; }
# Search-R1's retriever: e5-base-v2, flat inner-product index over wiki-18 (retrieval_launch.sh).
PAPER_RETRIEVER_ENCODER=e5-base-v2 PAPER_RETRIEVER_INDEX_TYPE=flat  # what a running retriever is compared with
export RETRIEVER_ENCODER="${RETRIEVER_ENCODER:-e5-base-v2}" RETRIEVER_INDEX_TYPE="${RETRIEVER_INDEX_TYPE:-flat}"

RUN_DESC="searchr1.sh $ALGO $SIZE $VARIANT"
cpu_cluster_setup searchr1 true "$([[ "$ALGO" == ppo ]] && echo 1 || echo 4)"
check_inputs
check_data_steps "$TRAIN_DATA_FILE" "$ROLLOUT_BS" "$EPISODES" "$STEPS" "$WARMUP_RATIO"
check_data_batch "$TRAIN_DATA_FILE" "$ROLLOUT_BS" "$N_SAMPLES" "$TRAIN_BS"
layout_args "$TRAIN_BS" "$TRAIN_MICRO" "$(( ROLLOUT_BS * N_SAMPLES ))" "$ROLLOUT_MICRO" "$CRITIC"
start_retrievers
log "setting: $SETTING | model: $MODEL${MODEL_WHERE:+ ($MODEL_WHERE)} | data: $TRAIN_DATA_FILE (expected: rendered with $MODEL's chat template, checked by cli.train) | eval: $EVAL_DATA_FILE"
launch \
    "${LAYOUT_ARGS[@]}" \
    "${ALGO_ARGS[@]}" \
    --actor.model_name_or_path "$MODEL" \
    --data.prompt_dataset "$TRAIN_DATA_FILE" \
    --data.input_key prompt --data.label_key label \
    --eval.dataset "$EVAL_DATA_FILE" --eval.steps 100 --eval.before_training \
    --eval.n_samples_per_prompt 1 --eval.temperature 0.0 \
    --rollout.batch_size "$ROLLOUT_BS" --train.batch_size "$TRAIN_BS" \
    --rollout.micro_batch_size "$ROLLOUT_MICRO" --train.micro_batch_size "$TRAIN_MICRO" \
    --rollout.temperature 1.0 \
    --actor.adam.lr 1e-6 --actor.lr_scheduler constant_with_warmup --actor.lr_warmup_ratio "$WARMUP_RATIO" \
    --actor.adam.betas 0.9 0.999 --actor.adam.weight_decay 0.01 \
    --actor.eps_clip 0.2 --actor.entropy_coef 0.001 --actor.loss_agg_mode token-mean \
    --data.max_len 4096 --rollout.max_new_tokens 500 \
    --train.max_steps "$STEPS" --train.num_episodes "$EPISODES" --train.max_epochs 1 \
    --search.protocol searchr1 --search.chat_template true \
    --search.reward_scheme searchr1_em \
    --search.topk 3 --search.max_turns 5 \
    --search.max_new_tokens_per_turn 500 --search.max_obs_tokens 500 --search.obs_cut block \
    --ckpt.output_dir "$OUTPUT_ROOT/$RUN" --ckpt.path "$OUTPUT_ROOT/$RUN/ckpt" --ckpt.save_steps 100 \
    --ckpt.save_hf \
    --logger.tensorboard_dir "$OUTPUT_ROOT/$RUN/tensorboard"
