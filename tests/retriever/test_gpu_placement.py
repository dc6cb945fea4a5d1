"""Where a dense index goes on a GPU node, checked on CPU (faiss-gpu absent): the devices chosen from
``RETRIEVER_GPUS`` / ``--gpus``, the explicit faiss temporary memory, the query encoder on the first chosen GPU, and
the arguments handed to faiss (a stand-in module records them); the launchers put it on the vLLM GPUs of a split
layout and the memory estimate counts it there."""

import sys
import types

import pytest

from retriever.index import DEFAULT_FAISS_TEMP_GB, _to_gpus, gpu_plan


def test_the_plan_names_devices_temp_memory_and_the_encoder(monkeypatch):
    monkeypatch.delenv("RETRIEVER_GPUS", raising=False)
    monkeypatch.delenv("RETRIEVER_FAISS_TEMP_GB", raising=False)
    everything = gpu_plan(8)
    assert everything["devices"] == list(range(8)) and everything["encoder_device"] == "cuda:0"
    assert everything["temp_memory_bytes"] == int(DEFAULT_FAISS_TEMP_GB * 2**30)
    split = gpu_plan(8, "7,6", 0.5)
    assert split == {"devices": [6, 7], "temp_memory_bytes": 2**29, "encoder_device": "cuda:6"}
    monkeypatch.setenv("RETRIEVER_GPUS", "5")
    monkeypatch.setenv("RETRIEVER_FAISS_TEMP_GB", "1")
    assert gpu_plan(8) == {"devices": [5], "temp_memory_bytes": 2**30, "encoder_device": "cuda:5"}
    assert gpu_plan(8, "none")["devices"] == [] and gpu_plan(0, "all")["encoder_device"] is None
    with pytest.raises(ValueError, match=r"names GPU\(s\) \[8\], this host has 8"):
        gpu_plan(8, "6,8")
    with pytest.raises(ValueError, match="comma-separated GPU ids"):
        gpu_plan(8, "last")


def test_the_index_is_sharded_over_the_chosen_gpus_with_explicit_temp_memory(monkeypatch):
    calls = {}

    class Resources:
        def setTempMemory(self, n):  # faiss' name
            calls.setdefault("temp", []).append(n)

    class Options:
        useFloat16 = False
        shard = False

    def to_gpus(resources, index, co=None, gpus=None):
        calls.update(resources=len(resources), index=index, fp16=co.useFloat16, shard=co.shard, gpus=gpus)
        return types.SimpleNamespace(ntotal=3)

    fake = types.SimpleNamespace(StandardGpuResources=Resources, GpuMultipleClonerOptions=Options,
                                 index_cpu_to_gpu_multiple_py=to_gpus)
    monkeypatch.setitem(sys.modules, "faiss", fake)
    out, on_gpu = _to_gpus("cpu-index", gpu_plan(8, "6,7", 0.25))
    assert on_gpu and out.ntotal == 3 and len(out.referenced_objects) == 2
    assert calls == {"temp": [2**28, 2**28], "resources": 2, "index": "cpu-index", "fp16": True, "shard": True,
                     "gpus": [6, 7]}
    del fake.GpuMultipleClonerOptions  # faiss-cpu: the index stays where it is
    assert _to_gpus("cpu-index", gpu_plan(8, "6")) == ("cpu-index", False)


def test_a_split_layout_puts_the_retriever_on_the_vllm_gpus():
    from tests.test_launchers import _common

    show = 'echo "GPUS=$RETRIEVER_GPUS ON=$RETRIEVER_ON_VLLM_GPUS"'
    res = _common(f"DRY_RUN=1 ASYNC=1; layout_args 256 4 512 8 true; {show}", timeout=120)
    assert res.returncode == 0, res.stderr[-2000:]
    assert "GPUS=4,5,6,7 ON=1" in res.stdout  # 4 training GPUs, the engines on the last 4
    colocated = _common('DRY_RUN=1; layout_args 256 4 512 8 true; echo "GPUS=${RETRIEVER_GPUS:-all}"', timeout=120)
    assert "GPUS=all" in colocated.stdout
