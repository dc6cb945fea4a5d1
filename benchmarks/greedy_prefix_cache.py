"""Greedy search trajectories of one in-process vLLM-CPU engine, with or without vLLM's prefix caching.

Rolls the first ``--n_prompts`` prompts of the CPU cluster mode's tiny assets (cpu_demo/tiny_assets.py),
each ``--repeats`` times, through our ``SearchAgentExecutor`` at temperature 0 with the cluster mode's search settings
(3 turns of at most 48 tokens, top-1 BM25 passage cut to 120 tokens; the BM25 index is searched in this process). One
request at a time, so that every turn after the first re-sends a context whose prefix the previous request computed:
with caching on, vLLM serves that prefix from its cache. Writes ``--out`` JSON: ``{"caching", "block_size",
"trajectories": [token ids per trajectory], "prefill": cluster_probe.prefill_summary(...), "load_s", "rollout_s"}``.

Run once with ``--caching on`` and once with ``--caching off`` (each in its own process: vLLM picks its CPU platform
once per process); the trajectories must be identical (``tests/test_prefix_caching.py``,
``benchmarks/bench_prefix_caching_cpu.py``).

    PYTHONPATH=. .venv/bin/python benchmarks/greedy_prefix_cache.py --caching on --out /tmp/on.json
"""

import argparse
import asyncio
import json
import os
import sys
import time

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if REPO not in sys.path:
    sys.path.insert(0, REPO)


class IndexClient:
    """``async search(query) -> list[Passage]`` over a built index, in this process (no HTTP)."""

    def __init__(self, index_dir: str, topk: int):
        from retriever.index import load_index

        self.index, self.topk = load_index(index_dir), topk

    async def search(self, query: str):
        from openrlhf_search.env.retrieval_schema import passage_from_document

        return [passage_from_document(d) for d in self.index.search([query], self.topk)[0]]


class SyncEngine:
    """The executor's engine contract (``async generate(prompt_token_ids, sampling_params, multi_modal_data)`` ->
    ``RequestOutput``) on vLLM's offline ``LLM``, one request per call; records each request's prompt and cached
    tokens as the cluster probe does (``prefill_<pid>.jsonl`` rows)."""

    def __init__(self, llm):
        self.llm, self.records = llm, []

    async def generate(self, prompt_token_ids, sampling_params, multi_modal_data=None):
        t0 = time.time()
        out = self.llm.generate([{"prompt_token_ids": list(prompt_token_ids)}], sampling_params, use_tqdm=False)[0]
        self.records.append({"prompt_tokens": len(prompt_token_ids), "cached_tokens": int(out.num_cached_tokens or 0),
                             "output_tokens": len(out.outputs[0].token_ids), "start": t0, "end": time.time()})
        return out


def rollouts(model: str, train_data: str, index_dir: str, caching: bool, n_prompts: int, repeats: int) -> dict:
    """Greedy trajectories (token ids) of the first ``n_prompts`` rows of ``train_data``, each ``repeats`` times,
    and the engine's prefill counts; see the module docstring."""
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"  # engine core in this process
    import openrlhf_search._cpu_compat  # noqa: F401
    from openrlhf_search.cpu.cluster_mode.runtime import install_vllm_gemm_patch

    install_vllm_gemm_patch()  # the layers as the CPU cluster mode's engines hold them
    from transformers import AutoTokenizer
    from vllm import LLM, SamplingParams

    from openrlhf_search.env.agent import SearchAgentExecutor
    from cpu_demo.probe import prefill_summary
    from openrlhf_search.env.config import SearchConfig
    from cpu_demo.tiny_assets import WARMSTART

    with open(train_data, encoding="utf-8") as f:
        rows = [json.loads(line) for line in f if line.strip()][:n_prompts]
    t0 = time.time()
    llm = LLM(model=model, enforce_eager=True, max_model_len=1024, seed=0, enable_prefix_caching=caching)
    load_s = time.time() - t0
    tok = AutoTokenizer.from_pretrained(model)
    cfg = SearchConfig(protocol="searchr1", reward_scheme="searchr1_format", topk=1, max_turns=3,
                       max_new_tokens_per_turn=48, max_obs_tokens=WARMSTART["obs_tokens"])
    executor = SearchAgentExecutor(cfg, retrieval_client=IndexClient(index_dir, cfg.topk))
    engine = SyncEngine(llm)
    params = SamplingParams(temperature=0.0, max_tokens=48, logprobs=0)

    async def run_all():
        out = []
        for row in rows:
            for _ in range(repeats):
                res = await executor.execute(row["prompt"], row["label"], params, 1024, tok, engine)
                out.append([int(t) for t in res["observation_tokens"]])
        return out

    t0 = time.time()
    trajectories = asyncio.run(run_all())
    return {"caching": caching, "block_size": llm.llm_engine.vllm_config.cache_config.block_size,
            "trajectories": trajectories, "prefill": prefill_summary(engine.records), "load_s": load_s,
            "rollout_s": time.time() - t0}


def asset_paths():
    """The CPU cluster mode's tiny Search-R1 assets (built or reused in ``.cache/cpu_cluster``) and a BM25 index
    over their corpus (built there once, as the launchers' ``CPU_CLUSTER=1`` does)."""
    from cpu_demo.tiny_assets import build_assets
    from retriever.launch import ensure_index

    cache = os.environ.get("CPU_CLUSTER_CACHE") or os.path.join(REPO, ".cache", "cpu_cluster")
    paths = build_assets(cache, "searchr1")
    return paths, ensure_index(paths["corpus"], os.path.join(cache, "index_bm25"), encoder="bm25")


def run_in_subprocess(caching: bool, out: str, n_prompts: int = 4, repeats: int = 2, timeout_s: int = 900) -> dict:
    """:func:`rollouts` in a fresh process with the CPU cluster mode's thread and KV-cache settings; returns its JSON.
    Raises RuntimeError with the output's tail when the process fails."""
    import subprocess

    paths, index_dir = asset_paths()
    env = dict(os.environ, OMP_NUM_THREADS="1", VLLM_CPU_KVCACHE_SPACE="1", VLLM_CPU_OMP_THREADS_BIND="nobind",
               HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1",
               PYTHONPATH=REPO + (os.pathsep + os.environ["PYTHONPATH"] if os.environ.get("PYTHONPATH") else ""))
    cmd = [sys.executable, os.path.abspath(__file__), "--caching", "on" if caching else "off", "--out", out,
           "--model", paths["model"], "--train_data", paths["train_data"], "--index_dir", index_dir,
           "--n_prompts", str(n_prompts), "--repeats", str(repeats)]
    proc = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=timeout_s)
    if proc.returncode != 0 or not os.path.isfile(out):
        raise RuntimeError(f"greedy_prefix_cache.py --caching {caching} exited {proc.returncode}:\n"
                           f"{proc.stderr[-3000:]}")
    with open(out) as f:
        return json.load(f)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--caching", choices=["on", "off"], required=True)
    p.add_argument("--out", required=True)
    p.add_argument("--model")
    p.add_argument("--train_data")
    p.add_argument("--index_dir")
    p.add_argument("--n_prompts", type=int, default=4)
    p.add_argument("--repeats", type=int, default=2)
    a = p.parse_args(argv)
    if not (a.model and a.train_data and a.index_dir):
        paths, index_dir = asset_paths()
        a.model, a.train_data = a.model or paths["model"], a.train_data or paths["train_data"]
        a.index_dir = a.index_dir or index_dir
    res = rollouts(a.model, a.train_data, a.index_dir, a.caching == "on", a.n_prompts, a.repeats)
    with open(a.out, "w") as f:
        json.dump(res, f)
    print(json.dumps({k: v for k, v in res.items() if k != "trajectories"}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
