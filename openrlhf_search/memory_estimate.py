"""Per-GPU memory estimate of a cluster run, printed by every dry run (``cli.train --dry_run``).

What it adds up on one actor GPU (GiB = 2**30 bytes), for the training phase and the generation phase of a step:

* **logits**: the larger of the experience forward (no gradient: ``--rollout.micro_batch_size x data.max_len``
  tokens, packed or padded, the worst case, x vocabulary x 6 bytes: the model's bf16 logits plus the float32 copy
  OpenRLHF makes before the log-softmax, ``openrlhf/models/actor.py:267``) and the training step
  (``--train.micro_batch_size x data.max_len`` tokens x vocabulary x :data:`TRAIN_LOGITS_BYTES`: the float32 logits
  kept for the backward, their gradient and the slices autograd builds from the chunked log-softmax, measured at 16
  bytes on CPU, plus :data:`ENTROPY_EXTRA_BYTES` with ``--actor.entropy_coef``, whose softmax is kept too);
* **ZeRO shards** (mixed-precision Adam: bf16 weights and gradients, fp32 master weights and two moments = 16 bytes
  per parameter): ZeRO-3 divides all of it over the actor ranks, ZeRO-2 keeps the bf16 weights whole and divides the
  rest; the reference holds bf16 weights (2 bytes, divided under ZeRO-3); a PPO critic as the actor;
* **the vLLM share**: ``--vllm.gpu_memory_utilization x GPU memory`` on GPUs that vLLM shares with training
  (colocated); with ``--vllm.enable_sleep`` it is released while training and counted in the generation phase only;
  with ``--ds.enable_sleep`` the DeepSpeed states are offloaded during generation;
* **the retriever index** when it sits on the training GPUs (``RETRIEVER_GPU_GB``, set by the launchers for a
  dense faiss index on the node's GPUs: faiss-gpu shards a Flat index in fp16 over every GPU, outside Ray's
  accounting).

Activations are not counted (gradient checkpointing keeps them small next to the logits at long contexts); the
estimate is a floor, so a warning above 90% of ``GPU_MEM_GB`` (default 80) is a real risk.
"""

import json
import os
from typing import Any, Dict, Optional, Tuple

GIB = float(1 << 30)
FORWARD_LOGITS_BYTES = 6.0  # per token x vocabulary, no gradient: bf16 logits + their float32 copy
# Per token x vocabulary, peak of forward + backward of OpenRLHF's log-probs (torch path of
# openrlhf/models/utils.py log_probs_from_logits, float32) measured on CPU with the real functions
# (tests/test_dry_run_checks.py::test_training_logits_bytes_match_a_measured_peak, resident memory polled during the
# step): 16.0 at 2048 x 32768, 18.0 with compute_entropy.
TRAIN_LOGITS_BYTES = 16.0
ENTROPY_EXTRA_BYTES = 2.0
# A ZeRO checkpoint per trained parameter (mixed-precision Adam): float32 master 4 + two moments 8, plus the bf16
# weights 2 below ZeRO-3 (ZeRO-3 rebuilds them from the master copy). Measured on the tiny model of the CPU mode at
# ZeRO-3, bf16, 2 ranks: 10,298,780 bytes for 853,376 parameters = 12.07 per parameter (actor; critic alike).
DS_CKPT_BYTES_PER_PARAM = 14.0
DS_CKPT_BYTES_PER_PARAM_ZERO3 = 12.0
HF_BYTES_PER_PARAM = 2.0  # a --ckpt.save_hf copy / the final model, bf16 safetensors
# (parameters, vocabulary) of the launchers' hub models, from their config.json (hidden, layers, intermediate,
# heads, vocab, tied embeddings) when the model is not a local folder.
KNOWN_MODELS = {
    "qwen2.5-3b": (3.09e9, 151936),
    "qwen2.5-7b": (7.62e9, 152064),
    "llama-3.1-8b": (8.03e9, 128256),
}


def params_from_config(cfg: Dict[str, Any]) -> Tuple[float, int]:
    """(parameters, vocabulary) of a decoder-only transformer from its HF ``config.json`` fields."""
    h, n, inter, vocab = cfg["hidden_size"], cfg["num_hidden_layers"], cfg["intermediate_size"], cfg["vocab_size"]
    heads = cfg["num_attention_heads"]
    kv = cfg.get("num_key_value_heads", heads)
    head_dim = cfg.get("head_dim") or h // heads
    attn = h * heads * head_dim * 2 + h * kv * head_dim * 2
    if cfg.get("attention_bias", cfg.get("model_type") == "qwen2"):  # Qwen2: q, k, v projections carry biases
        attn += heads * head_dim + 2 * kv * head_dim
    per_layer = attn + 3 * h * inter + 2 * h
    emb = vocab * h * (1 if cfg.get("tie_word_embeddings") else 2)
    return float(n * per_layer + emb + h), int(vocab)


def model_size(name_or_path: str) -> Optional[Tuple[float, int]]:
    """(parameters, vocabulary) of a local HF folder or a known hub name, None when unknown."""
    path = os.path.join(name_or_path, "config.json")
    if os.path.isfile(path):
        try:
            with open(path) as f:
                return params_from_config(json.load(f))
        except (KeyError, TypeError, ValueError, OSError):
            return None
    key = name_or_path.lower()
    for name, size in KNOWN_MODELS.items():
        if name in key:
            return size
    return None


def estimate(args, gpu_mem_gb: float = 80.0, retriever_gpu_gb: float = 0.0) -> Dict[str, Any]:
    """Per-GPU memory of the run ``args`` (parsed ``train_ppo_ray`` arguments) in GiB, by component and phase.

    Returns a dict with ``components`` (GiB), ``training_gb``, ``generation_gb``, ``peak_gb``, ``gpu_mem_gb``,
    ``fraction`` and ``warning`` (one line naming the flag to change when the peak exceeds 90%, else None);
    ``{"unknown_model": name}`` when the policy's size cannot be read."""
    size = model_size(args.actor.model_name_or_path)
    if size is None:
        return {"unknown_model": args.actor.model_name_or_path}
    params, vocab = size
    ranks = max(1, args.actor.num_nodes * args.actor.num_gpus_per_node
                // (args.ds.ring_attn_size or 1) // (args.ds.tensor_parallel_size or 1))
    forward = args.rollout.micro_batch_size * args.data.max_len * vocab * FORWARD_LOGITS_BYTES / GIB
    per_token = TRAIN_LOGITS_BYTES + (ENTROPY_EXTRA_BYTES if getattr(args.actor, "entropy_coef", None) is not None
                                      else 0.0)
    backward = args.train.micro_batch_size * args.data.max_len * vocab * per_token / GIB
    logits = max(forward, backward)
    zero3 = args.ds.zero_stage == 3
    actor = (16 * params / ranks if zero3 else 2 * params + 14 * params / ranks) / GIB
    uses_ref = args.algo.kl.init_coef > 0 or args.algo.kl.use_loss
    ref = (2 * params / (ranks if zero3 else 1)) / GIB if uses_ref else 0.0
    critic = actor if getattr(args.critic, "model_name_or_path", None) else 0.0
    # vLLM shares the training GPUs only in the synchronous colocate_all (async colocates the DeepSpeed models only)
    colocated = bool(args.train.colocate_all) and not getattr(args.train, "async_enable", False)
    vllm = (args.vllm.gpu_memory_utilization or 0.9) * gpu_mem_gb if colocated else 0.0
    states = actor + ref + critic
    training = states + logits + (0.0 if args.vllm.enable_sleep else vllm) + retriever_gpu_gb
    generation = (0.0 if args.ds.enable_sleep else states) + vllm + retriever_gpu_gb
    peak = max(training, generation)
    out = {"components": {"logits_largest_forward": round(forward, 1), "logits_training_backward": round(backward, 1),
                          "actor_zero_shard": round(actor, 1),
                          "reference": round(ref, 1), "critic": round(critic, 1), "vllm_share": round(vllm, 1),
                          "retriever_index": round(retriever_gpu_gb, 1)},
           "model_parameters": params, "vocab": vocab, "actor_ranks": ranks,
           "training_gb": round(training, 1), "generation_gb": round(generation, 1), "peak_gb": round(peak, 1),
           "gpu_mem_gb": gpu_mem_gb, "fraction": round(peak / gpu_mem_gb, 3), "warning": None}
    if peak > 0.9 * gpu_mem_gb:
        if training >= generation and logits >= max(actor, vllm if not args.vllm.enable_sleep else 0.0):
            fix = (f"--rollout.micro_batch_size / --train.micro_batch_size (now {args.rollout.micro_batch_size} / "
                   f"{args.train.micro_batch_size}) or --data.max_len {args.data.max_len}")
        elif generation > training:
            fix = f"--vllm.gpu_memory_utilization {args.vllm.gpu_memory_utilization}"
        else:
            fix = "more GPUs (NNODES / GPUS_PER_NODE) or --ds.zero_stage 3"
        out["warning"] = (f"estimated {peak:.0f} GiB per GPU ({'training' if training >= generation else 'generation'}"
                          f": logits {logits:.0f} ({'training backward' if backward >= forward else 'forward'}), "
                          f"ZeRO shards {states:.0f}, vLLM {vllm:.0f}, retriever index "
                          f"{retriever_gpu_gb:.0f}) > 90% of GPU_MEM_GB {gpu_mem_gb:g}: lower {fix}")
    return out


def checkpoint_volume(args) -> Dict[str, Any]:
    """Disk a run writes under ``--ckpt.path`` and ``--ckpt.output_dir`` (GB = 1e9 bytes), from the policy's size.

    Per save: a DeepSpeed state per trained model (actor, and the critic for PPO; ``_actor`` / ``_critic``) of
    :data:`DS_CKPT_BYTES_PER_PARAM_ZERO3` (ZeRO-3) or :data:`DS_CKPT_BYTES_PER_PARAM` per parameter, plus with
    ``--ckpt.save_hf`` an HF copy of the actor (:data:`HF_BYTES_PER_PARAM`). At most: ``--ckpt.max_num`` regular
    saves (OpenRLHF rotates them), one "best" state per model when an evaluation runs (``--eval.dataset`` and
    ``--eval.steps``; OpenRLHF keeps the newest best), ``--ckpt.max_num`` best HF copies
    (``trainer.prune_hf_copies``), and the final HF model (actor; critic with ``--critic.save_value_network``).
    Full fine-tuning is assumed (LoRA or frozen layers write less).

    Returns ``{"per_checkpoint_gb", "at_most_gb", "trained_models", "line"}`` or ``{"unknown_model": name}``.
    """
    size = model_size(args.actor.model_name_or_path)
    if size is None:
        return {"unknown_model": args.actor.model_name_or_path}
    params = size[0]
    critic = bool(getattr(args.critic, "model_name_or_path", None))
    models = 2 if critic else 1
    per_param = DS_CKPT_BYTES_PER_PARAM_ZERO3 if args.ds.zero_stage == 3 else DS_CKPT_BYTES_PER_PARAM
    ds = 0.0 if getattr(args.ckpt, "disable_ds", False) else per_param * params * models / 1e9
    hf = HF_BYTES_PER_PARAM * params / 1e9 if args.ckpt.save_hf else 0.0
    keep = max(1, args.ckpt.max_num)
    evaluates = bool(getattr(args.eval, "dataset", None)) and 0 < (args.eval.steps or -1) < float("inf")
    best = evaluates and getattr(args.ckpt, "best_metric_key", "") != "none"
    final = HF_BYTES_PER_PARAM * params * (2 if critic and getattr(args.critic, "save_value_network", False)
                                           else 1) / 1e9
    max_mem = getattr(args.ckpt, "max_mem", float("inf")) or float("inf")
    ds_kept = min(ds * keep, max_mem * 2**30 / 1e9 * models + ds) if ds else 0.0  # max_mem rotates per model
    at_most = ds_kept + (ds if best else 0.0) + hf * keep * (2 if best else 1) + final
    per = ds + hf
    line = (f"checkpoints: {per:.0f} GB per save ({models} trained model(s) x {per_param:g} B x "
            f"{params / 1e9:.2f}B parameters{f' + HF copy {hf:.0f} GB' if hf else ''}), at most {at_most:.0f} GB "
            f"(--ckpt.max_num {args.ckpt.max_num}{', a best checkpoint' if best else ''}, final model {final:.0f} GB)")
    return {"per_checkpoint_gb": round(per, 1), "at_most_gb": round(at_most, 1), "trained_models": models,
            "line": line}
