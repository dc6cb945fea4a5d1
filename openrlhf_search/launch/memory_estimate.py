"""Per-GPU memory of a cluster run, phase by phase, as OpenRLHF 0.11.2 places and offloads its states; pinned host
memory per node; the checkpoint volume on disk. Printed by every dry run and checked before a real launch
(``cli.train``): a run whose estimate exceeds the GPU is refused in one line naming the settings that fit.

GiB = 2**30 bytes. ``P`` is a model's parameter count, ``W`` the actor's ZeRO world (``actor.num_nodes x
actor.num_gpus_per_node``; ring attention and DeepSpeed TP ranks are ranks of that world), ``T`` the tokens of one
micro-batch on one GPU (micro-batch size x ``--data.max_len``, packed or padded: the worst case, over the ring size).

States of a trained model (actor; critic for PPO; same bytes, ``ppo_actor.py`` / ``ppo_critic.py``): bf16 weights
(2P, over W under ZeRO-3), bf16 gradients (2P/W), fp32 master weights and two Adam moments (12P/W). What stays on the
GPU between trainings depends on the flags, read from ``openrlhf/utils/deepspeed/deepspeed_utils.py``
``offload_deepspeed_states``: ``--ds.enable_sleep`` offloads the optimizer states, the fp32 master weights and the bf16
gradients to pinned host memory, but never the bf16 weights (``lp_params`` is commented out there), so the weight
shards of every colocated model stay on the GPU while vLLM generates; with ``--ds.adam_offload`` the fp32 states
live on the host throughout (DeepSpeed's CPU Adam) and only the bf16 weights and gradients are on the GPU. The
reference holds bf16 weights (2P over W under ZeRO-3, whole below it; 0 with ``--ref.offload``); it exists only with
``--algo.kl.init_coef`` > 0 (``train_ppo_ray.py``) and not when the policy actor computes it over its frozen trunk
(``--actor.trainable_layers``, :mod:`openrlhf_search.rl.shared_reference`).

The three phases of a step on a training GPU (``ppo_trainer.py``, ``experience_maker.py``, ``samples_generator.py``):

* **generation**: vLLM awake (``--vllm.gpu_memory_utilization x GPU`` when it shares the GPU: the engine claims that
  share of the whole GPU at wake-up) plus whatever DeepSpeed keeps there (bf16 weight shards under ``ds.enable_sleep``,
  every state without it);
* **experience**: vLLM asleep (a CUDA context and its graph pool remain); the colocated actor, reference and critic
  forwards run one after another (``_dispatch_forward``), each holding the logits of a rollout micro-batch
  (:data:`FORWARD_LOGITS_BYTES` x ``T x vocabulary``) or one layer's tensors, whichever is larger;
* **training**: with ``ds.enable_sleep`` the critic trains, is offloaded, then the actor (``ppo_train``'s
  ``_run_sleep``): one model's full states + the other's bf16 weights; without it both full states and both
  activations at once. The actor's activations: the layer inputs gradient checkpointing keeps (``T x hidden x layers
  x 2`` bytes) plus the larger of the loss's logits (:data:`TRAIN_LOGITS_BYTES`, :data:`ENTROPY_EXTRA_BYTES`) and the
  recomputed layer (:data:`LAYER_WORKING_ELEMENTS`); the critic has no vocabulary logits. Measured on one H200 (a
  Qwen2.5-7B-shaped model): the forward keeps 534 KB per token (the layer inputs, 200,704 B, + the bf16 logits +
  ~30 KB); the forward + backward peak at 16,384 tokens is 27.0 GiB above the weights against 26.3 here.

Every process on a GPU holds a CUDA context (:data:`CUDA_CONTEXT_GB`); the retriever's faiss-gpu index costs its fp16
shard + faiss temporary memory + a context on each GPU it is placed on (:func:`retriever_gpu_cost`).
vLLM GPUs of split layouts (async, or a synchronous split) hold the engine's share and the retriever when placed
there. The estimate is a model of the code, not a measurement; allocator fragmentation comes on top, so a warning
starts at :data:`WARN_FRACTION` of the GPU and a refusal above it.
"""

import copy
import json
import os
import shutil
import subprocess
from dataclasses import dataclass
from typing import Any, Dict, List, Optional, Tuple

from openrlhf_search.rl.shared_reference import starts_reference_model


GIB = float(1 << 30)
DEFAULT_GPU_MEM_GB = 80.0  # when GPU_MEM_GB is unset and no GPU answers nvidia-smi (an 80 GB A100 / H100)
WARN_FRACTION = 0.9
# Bytes per token x vocabulary of OpenRLHF's log-prob path, measured on one H200 (torch 2.11.0+cu130, flash-attn
# 2.8.3's Triton cross-entropy, V 151,936, 4,096 and 8,192 tokens, torch.cuda.max_memory_allocated above the inputs):
FORWARD_LOGITS_BYTES = 6.0  # no gradient (experience forwards): the bf16 logits + their float32 copy (actor.py)
# forward + backward of a training micro-batch: float32 logits kept by the Triton cross-entropy, their float32
# gradient, the bf16 gradient of the cast
TRAIN_LOGITS_BYTES = 10.0
ENTROPY_EXTRA_BYTES = 2.0  # with --actor.entropy_coef: OpenRLHF's torch.compile'd compute_entropy (12.0 in all)
# The torch path (no flash-attn: the CPU mode), measured on CPU with OpenRLHF's own functions
# (tests/test_dry_run_checks.py::test_training_logits_bytes_match_a_measured_peak): 16, and 2 more with entropy.
TORCH_PATH_TRAIN_LOGITS_BYTES = 16.0
TORCH_PATH_ENTROPY_EXTRA_BYTES = 2.0
CKPT_ACT_BYTES = 2.0  # per token x hidden x layer: the bf16 layer input gradient checkpointing keeps
# Per token, bf16 tensors of one decoder layer alive while it is recomputed in the backward (or run in a forward
# without checkpointing): 6 hidden-sized (norms, q/o projections, attention output, residual) + 4
# intermediate-sized (gate, up, activation, product) x 2 bytes.
LAYER_WORKING_ELEMENTS = (6, 4)
CUDA_CONTEXT_GB = 0.6  # per process on a GPU: the CUDA context, cuBLAS / NCCL workspaces
VLLM_ASLEEP_GB = 1.5  # a sleeping vLLM worker: its context and CUDA-graph pool (sleep level 1 frees weights + KV)
FAISS_TEMP_GB = 1.5  # faiss-gpu StandardGpuResources' default temporary memory on a large GPU (its cap)
# A ZeRO checkpoint per trained parameter (mixed-precision Adam): float32 master 4 + two moments 8, plus the bf16
# weights 2 below ZeRO-3 (ZeRO-3 rebuilds them from the master copy). Measured on the tiny model of the CPU mode at
# ZeRO-3, bf16, 2 ranks: 10,298,780 bytes for 853,376 parameters = 12.07 per parameter (actor; critic alike).
DS_CKPT_BYTES_PER_PARAM = 14.0
DS_CKPT_BYTES_PER_PARAM_ZERO3 = 12.0
HF_BYTES_PER_PARAM = 2.0  # a --ckpt.save_hf copy / the final model, bf16 safetensors

# config.json fields of the launchers' hub models (used when the model is not a local folder).
KNOWN_CONFIGS: Dict[str, Dict[str, Any]] = {
    "qwen2.5-3b": dict(model_type="qwen2", hidden_size=2048, num_hidden_layers=36, intermediate_size=11008,
                       num_attention_heads=16, num_key_value_heads=2, vocab_size=151936, tie_word_embeddings=True),
    "qwen2.5-7b": dict(model_type="qwen2", hidden_size=3584, num_hidden_layers=28, intermediate_size=18944,
                       num_attention_heads=28, num_key_value_heads=4, vocab_size=152064, tie_word_embeddings=False),
    "llama-3.1-8b": dict(model_type="llama", hidden_size=4096, num_hidden_layers=32, intermediate_size=14336,
                         num_attention_heads=32, num_key_value_heads=8, vocab_size=128256, tie_word_embeddings=False),
    "qwen3-4b": dict(model_type="qwen3", hidden_size=2560, num_hidden_layers=36, intermediate_size=9728,
                     num_attention_heads=32, num_key_value_heads=8, head_dim=128, vocab_size=151936,
                     tie_word_embeddings=True, attention_bias=False),
    "qwen3-8b": dict(model_type="qwen3", hidden_size=4096, num_hidden_layers=36, intermediate_size=12288,
                     num_attention_heads=32, num_key_value_heads=8, head_dim=128, vocab_size=151936,
                     tie_word_embeddings=False, attention_bias=False),
}


@dataclass(frozen=True)
class ModelShape:
    """What the estimate needs of a decoder-only model: parameters, vocabulary, hidden size, layers, MLP width."""

    params: float
    vocab: int
    hidden: int
    layers: int
    intermediate: int


def params_from_config(cfg: Dict[str, Any]) -> Tuple[float, int]:
    """(parameters, vocabulary) of a decoder-only transformer from its HF ``config.json`` fields."""
    h, n, inter, vocab = cfg["hidden_size"], cfg["num_hidden_layers"], cfg["intermediate_size"], cfg["vocab_size"]
    heads = cfg["num_attention_heads"]
    kv = cfg.get("num_key_value_heads", heads)
    head_dim = cfg.get("head_dim") or h // heads
    attn = h * heads * head_dim * 2 + h * kv * head_dim * 2
    if cfg.get("attention_bias", cfg.get("model_type") == "qwen2"):  # Qwen2: q, k, v projections carry biases
        attn += heads * head_dim + 2 * kv * head_dim
    if cfg.get("model_type") == "qwen3":  # Qwen3: RMSNorm of q and k per head
        attn += 2 * head_dim
    per_layer = attn + 3 * h * inter + 2 * h
    emb = vocab * h * (1 if cfg.get("tie_word_embeddings") else 2)
    return float(n * per_layer + emb + h), int(vocab)


def shape_from_config(cfg: Dict[str, Any]) -> ModelShape:
    """:class:`ModelShape` of an HF ``config.json`` dict (a multimodal config's ``text_config`` is used)."""
    cfg = cfg.get("text_config") or cfg
    params, vocab = params_from_config(cfg)
    return ModelShape(params, vocab, int(cfg["hidden_size"]), int(cfg["num_hidden_layers"]),
                      int(cfg["intermediate_size"]))


def model_shape(name_or_path: Optional[str]) -> Optional[ModelShape]:
    """:class:`ModelShape` of a local HF folder (its ``config.json``) or a known hub name
    (:data:`KNOWN_CONFIGS`, matched case-insensitively inside the name); None when unknown."""
    if not name_or_path:
        return None
    path = os.path.join(name_or_path, "config.json")
    if os.path.isfile(path):
        try:
            with open(path) as f:
                return shape_from_config(json.load(f))
        except (KeyError, TypeError, ValueError, OSError):
            return None
    key = name_or_path.lower()
    for name in sorted(KNOWN_CONFIGS, key=len, reverse=True):
        if name in key:
            return shape_from_config(KNOWN_CONFIGS[name])
    return None


def policy_shape(args) -> Optional[ModelShape]:
    """The policy's shape; for a stage-2 launcher whose stage-1 folder does not exist yet, the model named by
    ``MEMORY_MODEL`` (exported by the launchers: the stage-1 checkpoint's base model)."""
    return model_shape(args.actor.model_name_or_path) or model_shape(os.environ.get("MEMORY_MODEL"))


def gpu_memory_gb() -> Tuple[float, str]:
    """(GiB of one GPU, where it came from): ``GPU_MEM_GB`` when set, else the smallest ``memory.total`` that
    ``nvidia-smi`` reports on this host (no CUDA context is opened in the driver), else :data:`DEFAULT_GPU_MEM_GB`.
    Raises ValueError for a ``GPU_MEM_GB`` that is not a positive number."""
    raw = os.environ.get("GPU_MEM_GB")
    if raw:
        try:
            value = float(raw)
        except ValueError:
            value = -1.0
        if value <= 0:
            raise ValueError(f"GPU_MEM_GB must be a positive number of GiB, got {raw!r}")
        return value, "GPU_MEM_GB"
    smi = shutil.which("nvidia-smi")
    if smi:
        try:
            out = subprocess.run([smi, "--query-gpu=memory.total", "--format=csv,noheader,nounits"],
                                 capture_output=True, text=True, timeout=20).stdout
            mib = [float(x) for x in out.split() if x.strip()]
            if mib:
                return round(min(mib) / 1024, 1), "nvidia-smi"
        except (OSError, ValueError, subprocess.SubprocessError):
            pass
    return DEFAULT_GPU_MEM_GB, "the default: GPU_MEM_GB unset, no nvidia-smi"


def retriever_gpu_cost(rows: float, dim: int, index_gpus: int, temp_gb: float = FAISS_TEMP_GB,
                       encoder_params: float = 0.0) -> float:
    """GiB per GPU of a dense Flat index that faiss-gpu shards in fp16 over ``index_gpus`` GPUs: the shard
    (``rows x dim x 2 / index_gpus``), faiss' temporary memory and the retriever process' CUDA context; the query
    encoder (``encoder_params`` x 2 bytes, fp16) is counted on each, as it sits on the first of them."""
    if rows <= 0 or dim <= 0 or index_gpus <= 0:
        return 0.0
    return rows * dim * 2 / index_gpus / GIB + temp_gb + CUDA_CONTEXT_GB + encoder_params * 2 / GIB


def _ds_states(p: float, world: int, zero3: bool, adam_offload: bool) -> Dict[str, float]:
    """GiB per GPU of one trained model's DeepSpeed states, split into what stays and what ``ds.enable_sleep``
    offloads."""
    weights = 2 * p / (world if zero3 else 1)
    grads = 2 * p / world
    fp32 = 0.0 if adam_offload else 12 * p / world
    return {"weights": weights / GIB, "offloadable": (grads + fp32) / GIB}


def _layer_working(shape: ModelShape, tokens: float) -> float:
    h, i = LAYER_WORKING_ELEMENTS
    return tokens * (h * shape.hidden + i * shape.intermediate) * 2 / GIB


def _flag(args, section: str, name: str, default=None):
    return getattr(getattr(args, section, None), name, default)


def phase_model(args, gpu_mem_gb: float, retriever_gb: float = 0.0, retriever_on_training: bool = True,
                shape: Optional[ModelShape] = None, critic_shape: Optional[ModelShape] = None) -> Dict[str, Any]:
    """GiB per GPU of each phase on a training GPU and, in split layouts, on a vLLM GPU (see the module doc).

    Args:
        retriever_gb: the retriever's cost per GPU it sits on (:func:`retriever_gpu_cost`).
        retriever_on_training: the retriever sits on the training GPUs (else on the vLLM GPUs of a split layout).

    Returns ``{"phases": {phase: {part: GiB}}, "vllm_gpu": {part: GiB} or None, "colocated": bool}``."""
    shape = shape or policy_shape(args)
    critic_shape = critic_shape or model_shape(_flag(args, "critic", "model_name_or_path")) or shape
    world = max(1, args.actor.num_nodes * args.actor.num_gpus_per_node)
    zero3 = args.ds.zero_stage == 3
    adam_offload = bool(_flag(args, "ds", "adam_offload", False))
    ds_sleep = bool(_flag(args, "ds", "enable_sleep", False))
    asynchronous = bool(_flag(args, "train", "async_enable", False))
    colocated = bool(args.train.colocate_all) and not asynchronous  # vLLM on the training GPUs
    vllm_sleep = bool(args.vllm.enable_sleep) and colocated
    has_critic = bool(_flag(args, "critic", "model_name_or_path"))
    has_ref = starts_reference_model(args)  # with top-layer training the policy actor computes it (no weights here)
    ring = max(1, args.ds.ring_attn_size or 1)
    train_tokens = args.train.micro_batch_size * args.data.max_len / ring
    rollout_tokens = args.rollout.micro_batch_size * args.data.max_len / ring
    util = args.vllm.gpu_memory_utilization or 0.9

    actor = _ds_states(shape.params, world, zero3, adam_offload)
    critic = _ds_states(critic_shape.params, world, zero3, adam_offload) if has_critic else None
    ref = 0.0 if (not has_ref or _flag(args, "ref", "offload", False)) else 2 * shape.params / (
        world if zero3 else 1) / GIB
    processes = 1 + has_ref + has_critic + (1 if colocated and args.vllm.num_engines else 0)
    contexts = processes * CUDA_CONTEXT_GB
    retr = retriever_gb if retriever_on_training else 0.0

    # The trained models' activations during fit.
    logits_bytes = TRAIN_LOGITS_BYTES + (ENTROPY_EXTRA_BYTES if _flag(args, "actor", "entropy_coef") else 0.0)
    gc = bool(_flag(args, "actor", "gradient_checkpointing_enable", False))

    def activations(s: ModelShape, with_logits: bool) -> float:
        kept = train_tokens * s.hidden * s.layers * CKPT_ACT_BYTES / GIB if gc else \
            s.layers * _layer_working(s, train_tokens)
        transient = _layer_working(s, train_tokens)
        if with_logits:
            transient = max(transient, train_tokens * s.vocab * logits_bytes / GIB)
        return kept + transient

    actor_act = activations(shape, True)
    critic_act = activations(critic_shape, False) if has_critic else 0.0
    forward = max(rollout_tokens * shape.vocab * FORWARD_LOGITS_BYTES / GIB, _layer_working(shape, rollout_tokens))
    if has_critic:
        forward = max(forward, _layer_working(critic_shape, rollout_tokens))

    resident = actor["weights"] + (critic["weights"] if critic else 0.0) + ref
    offloadable = actor["offloadable"] + (critic["offloadable"] if critic else 0.0)
    idle_states = resident + (0.0 if ds_sleep else offloadable)  # what DeepSpeed keeps outside its fit
    vllm_awake = util * gpu_mem_gb if colocated else 0.0
    vllm_idle = (VLLM_ASLEEP_GB if vllm_sleep else vllm_awake) if colocated else 0.0
    common = {"cuda_contexts": contexts, "retriever": retr}

    if ds_sleep:  # reload, fit, offload: the critic, then the actor; the larger of the two is the peak
        runs = [(actor["offloadable"], actor_act)] + ([(critic["offloadable"], critic_act)] if critic else [])
        states, act = max(runs, key=sum)
        fit = {"trained_model_states": states, "activations": act}
    else:  # every state stays loaded; actor and critic fit at once
        fit = {"trained_model_states": 0.0, "activations": actor_act + critic_act}
    phases = {
        "generation": dict(common, vllm=vllm_awake, deepspeed_states=idle_states),
        "experience": dict(common, vllm=vllm_idle, deepspeed_states=idle_states, forward=forward),
        "training": dict(common, vllm=vllm_idle, deepspeed_states=idle_states, **fit),
    }
    if not colocated:  # vLLM on GPUs of its own: the training GPUs never hold it
        del phases["generation"]
    vllm_gpu = None
    if not colocated and args.vllm.num_engines:
        vllm_gpu = {"vllm": util * gpu_mem_gb, "retriever": 0.0 if retriever_on_training else retriever_gb}
    return {"phases": phases, "vllm_gpu": vllm_gpu, "colocated": colocated}


def pinned_host_gb(args, shape: ModelShape, critic_shape: Optional[ModelShape] = None) -> float:
    """GB (1e9 bytes) of pinned host memory per node: DeepSpeed states offloaded by ``--ds.enable_sleep`` (14 bytes
    per parameter: fp32 master, moments, bf16 gradients) or held by ``--ds.adam_offload`` (16: fp32 gradients
    instead), per trained model, divided over the nodes; vLLM weights released by sleep mode (2 bytes per parameter
    per engine on the node); a ``--ref.offload`` reference (2 per parameter over the nodes)."""
    nodes = max(1, args.actor.num_nodes)
    critic_p = (critic_shape or shape).params if _flag(args, "critic", "model_name_or_path") else 0.0
    per_param = 16.0 if _flag(args, "ds", "adam_offload", False) else (
        14.0 if _flag(args, "ds", "enable_sleep", False) else 0.0)
    ds = per_param * (shape.params + critic_p) / nodes
    colocated = bool(args.train.colocate_all) and not _flag(args, "train", "async_enable", False)
    engines = (args.vllm.num_engines or 0) / nodes
    vllm = 2 * shape.params * engines if (args.vllm.enable_sleep and colocated) else 0.0
    ref = 2 * shape.params / nodes if (starts_reference_model(args) and _flag(args, "ref", "offload")) else 0.0
    return (ds + vllm + ref) / 1e9


def _totals(model: Dict[str, Any]) -> Dict[str, float]:
    out = {name: sum(parts.values()) for name, parts in model["phases"].items()}
    if model["vllm_gpu"]:
        out["vllm_gpu"] = sum(model["vllm_gpu"].values())
    return out


def _peak(model: Dict[str, Any]) -> Tuple[str, float]:
    totals = _totals(model)
    name = max(totals, key=totals.get)
    return name, totals[name]


def _variant(args, **flags):
    new = copy.deepcopy(args)
    for dotted, value in flags.items():
        section, name = dotted.split(".")
        setattr(getattr(new, section), name, value)
    return new


def _split_tries(args) -> List[Tuple[str, Dict[str, Any]]]:
    """Other splits of a node between training and vLLM GPUs (layouts that are not colocated), more training GPUs
    first, that the batch sizes and ``--vllm.tensor_parallel_size`` allow (:mod:`openrlhf_search.launch.layout`)."""
    from openrlhf_search.launch.layout import batch_layout_problems

    colocated = bool(args.train.colocate_all) and not _flag(args, "train", "async_enable", False)
    if colocated or not args.vllm.num_engines:
        return []
    nodes, tp = max(1, args.actor.num_nodes), max(1, args.vllm.tensor_parallel_size or 1)
    per_node = args.actor.num_gpus_per_node + args.vllm.num_engines * tp // nodes
    samples = args.rollout.batch_size * args.rollout.n_samples_per_prompt
    out = []
    for a in range(per_node - 1, 0, -1):
        rest = per_node - a
        if a == args.actor.num_gpus_per_node or rest % tp or batch_layout_problems(
                nodes * a, args.train.batch_size, args.train.micro_batch_size, samples, args.rollout.micro_batch_size):
            continue
        out.append((f"ACTOR_GPUS_PER_NODE={a}", {"actor.num_gpus_per_node": a, "ref.num_gpus_per_node": a,
                                                 "critic.num_gpus_per_node": a,
                                                 "vllm.num_engines": nodes * rest // tp}))
    return out


def fixes_that_fit(args, gpu_mem_gb: float, retriever_gb: float, retriever_on_training: bool,
                   shape: ModelShape) -> List[str]:
    """Settings (flag lists) under which the estimate fits :data:`WARN_FRACTION` of the GPU, fewest changes first:
    DeepSpeed sleep, Adam offload, both, a lower vLLM share, another split of a node's GPUs
    (``ACTOR_GPUS_PER_NODE``), and ``--data.max_len`` halved as the last resort; the first three found."""
    limit = WARN_FRACTION * gpu_mem_gb
    tries: List[Tuple[str, Dict[str, Any]]] = []
    if not _flag(args, "ds", "enable_sleep", False):
        tries.append(("--ds.enable_sleep", {"ds.enable_sleep": True}))
    if not _flag(args, "ds", "adam_offload", False):
        tries.append(("--ds.adam_offload", {"ds.adam_offload": True}))
        if not _flag(args, "ds", "enable_sleep", False):
            tries.append(("--ds.enable_sleep --ds.adam_offload", {"ds.enable_sleep": True, "ds.adam_offload": True}))
    util = args.vllm.gpu_memory_utilization or 0.9
    for lower in (0.5, 0.4, 0.3):
        if lower < util:
            tries.append((f"--vllm.gpu_memory_utilization {lower}", {"vllm.gpu_memory_utilization": lower}))
    tries += _split_tries(args)
    tries.append((f"--data.max_len {args.data.max_len // 2}", {"data.max_len": args.data.max_len // 2}))
    out = []
    for text, flags in tries:
        model = phase_model(_variant(args, **flags), gpu_mem_gb, retriever_gb, retriever_on_training, shape)
        if _peak(model)[1] <= limit:
            out.append(text)
            if len(out) == 3:
                break
    return out


def estimate(args, gpu_mem_gb: float = DEFAULT_GPU_MEM_GB, retriever_gb: float = 0.0,
             retriever_on_training: bool = True) -> Dict[str, Any]:
    """Per-GPU memory of the run ``args`` (parsed ``train_ppo_ray`` arguments) in GiB, phase by phase.

    Returns ``{"phases": {phase: {part: GiB}}, "phase_gb": {phase: GiB}, "vllm_gpu", "peak_phase", "peak_gb",
    "gpu_mem_gb", "fraction", "pinned_host_gb_per_node", "fixes", "warning", "error"}``: ``error`` (one line) when
    the peak exceeds the GPU, ``warning`` above :data:`WARN_FRACTION`, each naming the settings that fit (``fixes``);
    ``{"unknown_model": name}`` when the policy's size cannot be read."""
    shape = policy_shape(args)
    if shape is None:
        return {"unknown_model": args.actor.model_name_or_path}
    model = phase_model(args, gpu_mem_gb, retriever_gb, retriever_on_training, shape)
    totals = _totals(model)
    peak_name, peak = _peak(model)
    round_parts = {k: {p: round(v, 1) for p, v in parts.items()} for k, parts in model["phases"].items()}
    out: Dict[str, Any] = {
        "phases": round_parts, "phase_gb": {k: round(v, 1) for k, v in totals.items()},
        "vllm_gpu": {p: round(v, 1) for p, v in model["vllm_gpu"].items()} if model["vllm_gpu"] else None,
        "peak_phase": peak_name, "peak_gb": round(peak, 1), "gpu_mem_gb": gpu_mem_gb,
        "fraction": round(peak / gpu_mem_gb, 3), "model_parameters": shape.params, "vocab": shape.vocab,
        "actor_ranks": args.actor.num_nodes * args.actor.num_gpus_per_node,
        "pinned_host_gb_per_node": round(pinned_host_gb(args, shape), 0),
        "fixes": [], "warning": None, "error": None,
    }
    if peak > WARN_FRACTION * gpu_mem_gb:
        out["fixes"] = fixes_that_fit(args, gpu_mem_gb, retriever_gb, retriever_on_training, shape)
        parts = model["vllm_gpu"] if peak_name == "vllm_gpu" else model["phases"][peak_name]
        biggest = ", ".join(f"{k} {v:.0f}" for k, v in sorted(parts.items(), key=lambda kv: -kv[1]) if v >= 0.5)
        fits = (f"fits with {' or with '.join(out['fixes'])}" if out["fixes"] else
                "no single setting fits: more GPUs (NNODES / GPUS_PER_NODE) or a GPU with more memory")
        where = "a vLLM GPU" if peak_name == "vllm_gpu" else f"the {peak_name} phase"
        line = (f"estimated {peak:.0f} GiB per GPU in {where} ({biggest}) of {gpu_mem_gb:g} GiB: {fits}")
        if peak > gpu_mem_gb:
            out["error"] = line + " (MEMORY_CHECK=0 launches anyway)"
        else:
            out["warning"] = line
    return out


def summary_line(est: Dict[str, Any]) -> str:
    """One line of an :func:`estimate`: GiB per phase, the GPU, pinned host memory per node."""
    phases = ", ".join(f"{k} {v:g}" for k, v in est["phase_gb"].items())
    return (f"memory per GPU (GiB): {phases} of {est['gpu_mem_gb']:g}; pinned host memory "
            f"{est['pinned_host_gb_per_node']:.0f} GB per node")


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
    shape = policy_shape(args)
    if shape is None:
        return {"unknown_model": args.actor.model_name_or_path}
    params = shape.params
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


def _folder_bytes(path: str) -> int:
    total = 0
    for root, _, files in os.walk(path):
        for name in files:
            try:
                total += os.path.getsize(os.path.join(root, name))
            except OSError:
                pass
    return total


def disk_problem(args, volume: Dict[str, Any]) -> Optional[str]:
    """One line when the file system of ``--ckpt.path`` cannot hold what the run will write there and under
    ``--ckpt.output_dir`` (``volume["at_most_gb"]`` of :func:`checkpoint_volume`, less what those folders already
    hold: a resumed run's checkpoints are rotated, not added); None when it can or the volume is unknown."""
    if "at_most_gb" not in volume:
        return None
    folders = [f for f in dict.fromkeys([getattr(args.ckpt, "path", None), getattr(args.ckpt, "output_dir", None)])
               if f]  # --ckpt.path first: its disk is the one asked and named
    if not folders:
        return None
    probe = os.path.abspath(folders[0])
    while not os.path.exists(probe):
        parent = os.path.dirname(probe)
        if parent == probe:
            return None
        probe = parent
    free = shutil.disk_usage(probe).free
    held = sum(_folder_bytes(f) for f in folders if os.path.isdir(f))
    need = volume["at_most_gb"] * 1e9 - held
    if free >= need:
        return None
    return (f"{folders[0]}: its disk ({probe}) has {free / 1e9:.0f} GB free, the run writes up to "
            f"{volume['at_most_gb']:.0f} GB of checkpoints "
            f"there ({held / 1e9:.0f} GB already held): lower --ckpt.max_num ({args.ckpt.max_num}), point "
            "OUTPUT_ROOT at a larger disk, or DISK_CHECK=0 to start anyway")
