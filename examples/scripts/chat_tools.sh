#!/usr/bin/env bash
# Search as a native tool call of the policy's chat template (protocol chat_tools): GRPO with the EM reward for a
# chat model whose template declares tools (Qwen3 with thinking on by default).
#
#   [ALGO=grpo|ppo] bash examples/scripts/chat_tools.sh {qwen3-4b|qwen3-8b} [extra trainer flags]
#
# Settings: ours, no paper trains this protocol. They are Search-R1's released GRPO values (searchr1.sh grpo: lr 1e-6
# with a linear warm-up over 28.5% of 1,004 steps, 512 prompts per step, group of 5, updates of 256 samples, KL 0.001
# as a k3 loss, top_p 0.95, entropy bonus 0.001, e5-base-v2 Flat over wiki-18, top-3, EM reward) with the budgets a
# thinking model needs: 8,192 tokens of context, 1,024 per turn (reasoning included), 500 per tool response, 5 turns
# (4 searches + the answer). What differs from the papers' protocols: docs/parity.md, "Native tool calling".
# ALGO=ppo trains with Search-R1's released PPO values instead (GAE gamma = lambda = 1, KL 0.001 as a k1 penalty in
# the reward, critic lr 1e-5, one sample per prompt, top_p 1.0).
# THINKING=0 trains with Qwen3's enable_thinking=False (protocol chat_tools_nothink); prompts must be rendered for the
# same protocol:
#   python -m openrlhf_search.cli.prepare_data --input nq_hotpotqa_train --protocol chat_tools \
#       --tokenizer Qwen/Qwen3-8B --out data/chat_tools_train_qwen3.jsonl
# (defaults: TRAIN_DATA=$DATA_DIR/chat_tools_train_qwen3.jsonl, EVAL_DATA=$DATA_DIR/chat_tools_eval_qwen3.jsonl;
# with THINKING=0 chat_tools_nothink_*). Retriever: RETRIEVER_CORPUS=wiki-18.jsonl or RETRIEVER_URLS.

USAGE="usage: chat_tools.sh qwen3-4b|qwen3-8b [flags]"
source "$(dirname "${BASH_SOURCE[0]}")/env_help.sh"
help_init "$@"
[[ "$LAUNCHER_HELP" == 1 && "${1:-}" == -* ]] && set -- qwen3-8b --help
SIZE="${1:?$USAGE}"
shift 1
source "$(dirname "${BASH_SOURCE[0]}")/common.sh"

case "$SIZE" in
    qwen3-4b) HF=Qwen/Qwen3-4B ;;
    qwen3-8b) HF=Qwen/Qwen3-8B ;;
    *) log "unknown model size $SIZE"; exit 2 ;;
esac
MODEL="${MODEL:-$HF}"
case "${THINKING:-1}" in
    1) PROTOCOL=chat_tools ;;
    0) PROTOCOL=chat_tools_nothink ;;
    *) die "THINKING must be 1 or 0, got ${THINKING}" ;;
esac
ALGO="${ALGO:-grpo}"
case "$ALGO" in
    grpo) ALGO_ARGS=(--algo.advantage.estimator group_norm --rollout.n_samples_per_prompt 5 --rollout.top_p 0.95
                     --algo.kl.init_coef 0.001 --algo.kl.use_loss --algo.kl.estimator k3)
          N_SAMPLES=5 CRITIC=false ;;
    ppo) ALGO_ARGS=(--algo.advantage.estimator gae --algo.advantage.gamma 1.0 --algo.advantage.lambd 1.0
                    --rollout.n_samples_per_prompt 1 --rollout.top_p 1.0
                    --algo.kl.init_coef 0.001 --algo.kl.estimator k1
                    --critic.adam.lr 1e-5 --critic.lr_scheduler constant_with_warmup --critic.lr_warmup_ratio 0.015
                    --critic.adam.betas 0.9 0.999 --critic.adam.weight_decay 0.01 --critic.value_clip 0.5)
         N_SAMPLES=1 CRITIC=true ;;
    *) die "ALGO must be grpo or ppo, got $ALGO" ;;
esac
RUN="${PROTOCOL}_${ALGO}_${SIZE}"
TRAIN_DATA_FILE="${TRAIN_DATA:-$DATA_DIR/${PROTOCOL}_train_qwen3.jsonl}"
EVAL_DATA_FILE="${EVAL_DATA:-$DATA_DIR/${PROTOCOL}_eval_qwen3.jsonl}"
TRAIN_DATA_MAKE="$(prepare_hint "$TRAIN_DATA_FILE" "$PROTOCOL" "$MODEL" true nq_hotpotqa_train)"
EVAL_DATA_MAKE="$(prepare_hint "$EVAL_DATA_FILE" "$PROTOCOL" "$MODEL" true flashrag:nq)"
ROLLOUT_BS=512 EPISODES=15 STEPS=1004 WARMUP_RATIO=0.285
TRAIN_BS=256 TRAIN_MICRO=1 ROLLOUT_MICRO=4
export RETRIEVER_ENCODER="${RETRIEVER_ENCODER:-e5-base-v2}" RETRIEVER_INDEX_TYPE="${RETRIEVER_INDEX_TYPE:-flat}"

RUN_DESC="chat_tools.sh $SIZE (protocol $PROTOCOL, $ALGO)"
cpu_cluster_setup "$PROTOCOL" true "$([[ "$ALGO" == ppo ]] && echo 1 || echo 4)"
check_inputs
check_data_steps "$TRAIN_DATA_FILE" "$ROLLOUT_BS" "$EPISODES" "$STEPS" "$WARMUP_RATIO"
check_data_batch "$TRAIN_DATA_FILE" "$ROLLOUT_BS" "$N_SAMPLES" "$TRAIN_BS"
layout_args "$TRAIN_BS" "$TRAIN_MICRO" "$(( ROLLOUT_BS * N_SAMPLES ))" "$ROLLOUT_MICRO" "$CRITIC"
start_retrievers
log "protocol: $PROTOCOL | model: $MODEL | data: $TRAIN_DATA_FILE (expected: rendered with $MODEL's chat template and tools, checked by cli.train) | eval: $EVAL_DATA_FILE"
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
    --data.max_len 8192 --rollout.max_new_tokens 1024 \
    --train.max_steps "$STEPS" --train.num_episodes "$EPISODES" --train.max_epochs 1 \
    --search.protocol "$PROTOCOL" --search.chat_template true \
    --search.reward_scheme searchr1_em \
    --search.topk 3 --search.max_turns 5 \
    --search.max_new_tokens_per_turn 1024 --search.max_obs_tokens 500 \
    --ckpt.output_dir "$OUTPUT_ROOT/$RUN" --ckpt.path "$OUTPUT_ROOT/$RUN/ckpt" --ckpt.save_steps 100 \
    --ckpt.save_hf \
    --logger.tensorboard_dir "$OUTPUT_ROOT/$RUN/tensorboard"
