"""A run's tokens, rewards and weights do not depend on retrieval timing, thread count or a resume.

Every sampled generation call of a rollout carries its own seed from (run seed, step, prompt index, sample index,
turn) (``openrlhf_search/cpu/main_job/seeding.py``) and the engine samples each seeded request from its own generator
with
vLLM's exponential race. Here a wrapper client sleeps a random 0-300 ms before every search (two latency seeds), so
the rollouts reach the engine's continuous batch in different orders; two RL steps of the tiny preset must still give
identical trajectories, rewards and checkpoint weights. Mutations caught: every row drawing from the engine's shared
generator in batch order (the code before the fix: 4 of 4 trajectories of the fast test's first step differed; in a
trial with a searching tiny policy 16 of 16), and seeds or state that a resume does not restore (a seed taken from a
per-process request counter, the data position or optimiser moments not carried over: the resumed run's step 2 then
differs from the uninterrupted run's). Why the engine samples by vLLM's exponential race rather than an inverse-CDF
draw was measured in a trial, not asserted here: with per-sample seeds but the inverse CDF, 1 of 16 trajectories
differed under this jitter and 2 of 16 between 1 and 2 threads (float rounding moving the cumulative sum), with the
race 0 of 16.

Fast tests: the smallest tiny policy (random, it rarely searches), so the jitter is also put before every turn's
generation call (what a retrieval wait looks like to the engine); two latency seeds and a resume. Slow tests: the
tiny preset itself, its policy warm-started once for the module (scripted SFT, so that it searches; minutes on 2
cores, the 151k-token vocabulary's logits dominate) with its lengths cut (per turn, documents, context), jitter on
retrieval only, two latency seeds, a resume, and 1 vs 2 threads.
"""

import asyncio
import json
import os
import random

import pytest
import torch

from openrlhf_search.cpu.data.qa import load_qa_jsonl
from openrlhf_search.cpu.main_job.args import parse_args

SHORT = ["--search.max_new_tokens_per_turn", "32", "--search.max_obs_tokens", "80", "--data.max_len", "420",
         "--eval.disable", "--ckpt.save_steps", "1", "--ckpt.max_num", "3"]
SMALLEST = ["--actor.model_name_or_path", "tiny", "--search.protocol", "searchr1", "--actor.tiny.hidden_size", "32",
            "--actor.tiny.num_layers", "1", "--actor.tiny.num_heads", "2", "--search.max_new_tokens_per_turn", "12",
            "--search.max_turns", "2", "--search.max_obs_tokens", "60", "--data.max_len", "300",
            "--rollout.batch_size", "1",
            "--rollout.n_samples_per_prompt", "4", "--rollout.temperature", "1.0", "--warmstart.sft_steps", "0",
            "--eval.disable", "--ckpt.save_steps", "1", "--ckpt.max_num", "3"]


class JitteredClient:
    """A retrieval client that waits a random 0..max_s seconds (its own seeded generator) before each search."""

    def __init__(self, client, seed: int, max_s: float = 0.3):
        self._client, self._rng, self.max_s = client, random.Random(seed), max_s

    async def search(self, query, topk=None):
        await asyncio.sleep(self._rng.uniform(0, self.max_s))
        return await self._client.search(query, topk)

    async def search_batch(self, queries, topk=None):
        await asyncio.sleep(self._rng.uniform(0, self.max_s))
        return await self._client.search_batch(queries, topk)

    def __getattr__(self, name):
        return getattr(self._client, name)


class JitteredEngine:
    """Waits a random 0..max_s seconds before each generation call (a turn that starts late, as after a search)."""

    def __init__(self, engine, seed: int, max_s: float = 0.05):
        self._engine, self._rng, self.max_s = engine, random.Random(seed), max_s

    async def generate(self, prompt_token_ids, sampling_params, multi_modal_data=None):
        await asyncio.sleep(self._rng.uniform(0, self.max_s))
        return await self._engine.generate(prompt_token_ids, sampling_params, multi_modal_data=multi_modal_data)

    def __getattr__(self, name):
        return getattr(self._engine, name)


class _Arrivals:
    """Records the order in which generation requests reach the engine (what latency reorders)."""

    def __init__(self, engine, log):
        self._engine, self._log = engine, log

    async def generate(self, prompt_token_ids, sampling_params, multi_modal_data=None):
        self._log.append((hash(tuple(prompt_token_ids)), sampling_params.seed))
        return await self._engine.generate(prompt_token_ids, sampling_params, multi_modal_data=multi_modal_data)

    def __getattr__(self, name):
        return getattr(self._engine, name)


def _trainer_class():
    from openrlhf_search.cpu.main_job.trainer import LocalSearchTrainer

    class Recording(LocalSearchTrainer):
        """Injects the jittered client and records every training rollout (tokens, reward) and request order."""

        latency_seed = 0
        turn_jitter = False

        def _build_engine(self):
            if not isinstance(self.client, JitteredClient):
                self.client = JitteredClient(self.client, self.latency_seed)
            super()._build_engine()
            self.arrivals = getattr(self, "arrivals", [])
            engine = _Arrivals(self.timed_engine, self.arrivals)
            self.timed_engine = JitteredEngine(engine, self.latency_seed) if self.turn_jitter else engine

        def rollout(self, rows, n, greedy=False, desc=None, step=None, **kw):
            outs = super().rollout(rows, n, greedy=greedy, desc=None, step=step, **kw)
            if not greedy:
                self.recorded = getattr(self, "recorded", [])
                self.recorded.append([(tuple(o["observation_tokens"]), float(o["reward"]),
                                       float(o["extra_logs"]["valid_searches"])) for o in outs])
            return outs

    return Recording


@pytest.fixture(scope="module")
def searching_policy(tmp_path_factory, default_bm25_url, default_data):
    """The tiny preset's policy after a short scripted warm start (it then searches), saved as an HF folder."""
    from openrlhf_search.cpu.main_job.train import make_warmstart
    from openrlhf_search.cpu.main_job.trainer import LocalSearchTrainer

    out = tmp_path_factory.mktemp("searching_tiny")
    args = parse_args(["--preset", "tiny"] + SHORT + [
        "--search.retriever_urls", default_bm25_url, "--ckpt.output_dir", str(out / "ws"), "--ckpt.no_load",
        "--warmstart.sft_steps", "60"])
    t = LocalSearchTrainer(args, load_qa_jsonl(default_data.train_path), [], warmstart_fn=make_warmstart(args))
    try:
        t.warmstart_fn(t)
        t.actor.save_pretrained(str(out / "policy"))
        t.tokenizer.save_pretrained(str(out / "policy"))
    finally:
        t.close()
    return str(out / "policy")


def _run(flags, url, data, out, latency_seed, steps=2, threads=None, turn_jitter=False):
    cls = _trainer_class()
    cls.latency_seed, cls.turn_jitter = latency_seed, turn_jitter
    flags = list(flags) + ["--search.retriever_urls", url, "--ckpt.output_dir", str(out),
                           "--train.max_steps", str(steps)]
    if threads:
        flags += ["--train.threads", str(threads)]
    t = cls(parse_args(flags), load_qa_jsonl(data.train_path), [])
    try:
        t.fit()
    finally:
        t.close()
    return {"recorded": getattr(t, "recorded", []), "arrivals": t.arrivals,
            "weights": _weights(out / "checkpoints" / f"global_step{steps}"),
            "metrics": [json.loads(x) for x in open(out / "metrics.jsonl")]}


def _weights(ckpt_dir):
    from safetensors.torch import load_file

    return load_file(os.path.join(ckpt_dir, "actor", "model.safetensors"))


def test_rollout_seeds_differ_per_step_prompt_sample_and_turn_and_not_per_process():
    """Mutations caught: a part of the key left out (two calls would replay the same noise), Python's salted
    ``hash`` (a resumed process would draw other seeds)."""
    import subprocess
    import sys

    from openrlhf_search.cpu.main_job.seeding import rollout_seed

    keys = [(42, s, p, j, t) for s in (1, 2) for p in (0, 1) for j in (0, 1) for t in (0, 1)]
    seeds = [rollout_seed(*k[:4], turn=k[4]) for k in keys]
    assert len(set(seeds)) == len(keys) and all(0 <= x < 2 ** 63 for x in seeds)
    assert rollout_seed(7, 1, 0, 0) != rollout_seed(42, 1, 0, 0)
    other = subprocess.run([sys.executable, "-c", "from openrlhf_search.cpu.main_job.seeding import rollout_seed; "
                            "print(rollout_seed(42, 3, 1, 2, turn=1))"], capture_output=True, text=True, check=True,
                           env=dict(os.environ, PYTHONHASHSEED="123"))
    assert int(other.stdout) == rollout_seed(42, 3, 1, 2, turn=1)


def _check_same(a, b, weights_exact=True):
    assert len(a["recorded"]) == len(b["recorded"]) >= 1
    for step, (sa, sb) in enumerate(zip(a["recorded"], b["recorded"]), start=1):
        differ = sum(x[0] != y[0] for x, y in zip(sa, sb))
        assert differ == 0, f"step {step}: {differ} of {len(sa)} trajectories differ"
        assert [x[1] for x in sa] == [y[1] for y in sb], f"step {step}: rewards differ"
    assert a["weights"].keys() == b["weights"].keys()
    for k in a["weights"]:
        if weights_exact:
            assert torch.equal(a["weights"][k], b["weights"][k]), k
        else:
            assert torch.allclose(a["weights"][k], b["weights"][k], atol=1e-5), k


@pytest.fixture(scope="module")
def fast_runs(default_bm25_url, default_data, tmp_path_factory):
    """Runs of the smallest tiny policy by name, each computed once for the module."""
    cache, base = {}, tmp_path_factory.mktemp("determinism_fast")

    def get(name, **kw):
        if name not in cache:
            cache[name] = _run(SMALLEST, default_bm25_url, default_data, base / name, turn_jitter=True, **kw)
        return cache[name]

    return get


def test_two_rl_steps_do_not_depend_on_latency(fast_runs):
    a, b = fast_runs("latency_1", latency_seed=1), fast_runs("latency_2", latency_seed=2)
    assert len(a["recorded"]) == 2 and len(a["recorded"][0]) == 4
    assert a["arrivals"] != b["arrivals"], "the latency did not change the order requests reached the engine"
    _check_same(a, b)
    assert [r["reward"] for r in a["metrics"]] == [r["reward"] for r in b["metrics"]]


def test_a_resumed_run_samples_the_next_step_as_the_uninterrupted_one(fast_runs, default_bm25_url, default_data,
                                                                      tmp_path):
    full = fast_runs("latency_1", latency_seed=1)
    out = tmp_path / "resumed"
    first = _run(SMALLEST, default_bm25_url, default_data, out, latency_seed=3, steps=1, turn_jitter=True)
    second = _run(SMALLEST, default_bm25_url, default_data, out, latency_seed=4, steps=2, turn_jitter=True)
    assert first["recorded"][0] == full["recorded"][0]
    assert len(second["recorded"]) == 1, "the second run did not resume at step 1"
    _check_same({**full, "recorded": full["recorded"][1:]}, second)


@pytest.fixture(scope="module")
def preset_runs(searching_policy, default_bm25_url, default_data, tmp_path_factory):
    """Two-step runs of the tiny preset (warm-started policy, retrieval jitter only) by name, computed once."""
    cache, base = {}, tmp_path_factory.mktemp("determinism_preset")
    flags = ["--preset", "tiny"] + SHORT + ["--actor.model_name_or_path", searching_policy, "--warmstart.sft_steps",
                                           "0"]

    def get(name, **kw):
        if name not in cache:
            cache[name] = _run(flags, default_bm25_url, default_data, base / name, **kw)
        return cache[name]

    get.flags = flags
    return get


@pytest.mark.slow
@pytest.mark.timeout(3600)
def test_tiny_preset_under_retrieval_latency_resume_and_thread_count(preset_runs, default_bm25_url, default_data,
                                                                     tmp_path):
    a, b = preset_runs("latency_1", latency_seed=1), preset_runs("latency_2", latency_seed=2)
    assert sum(v for step in a["recorded"] for _, _, v in step) > 0, "nobody searched: no retrieval latency met"
    assert a["arrivals"] != b["arrivals"], "the latency did not change the order requests reached the engine"
    _check_same(a, b)
    out = tmp_path / "resumed"
    _run(preset_runs.flags, default_bm25_url, default_data, out, latency_seed=3, steps=1)
    second = _run(preset_runs.flags, default_bm25_url, default_data, out, latency_seed=4, steps=2)
    _check_same({**a, "recorded": a["recorded"][1:]}, second)
    prev = torch.get_num_threads()
    try:  # 1 vs 2 threads: no sampled token flips; the update's float sums agree to rounding only
        one = preset_runs("threads_1", latency_seed=1, threads=1)
        two = preset_runs("threads_2", latency_seed=1, threads=2)
    finally:
        torch.set_num_threads(prev)
    _check_same(one, two, weights_exact=False)


def test_seeded_sample_gives_each_turn_its_own_seed_and_leaves_the_callers_params_alone():
    """The trajectory's view of the engine: turn t of (run seed, step, prompt, sample) is sent with
    ``seed = rollout_seed(..., turn=t)`` on a copy of the params; greedy params pass through untouched. Mutations
    caught: the turn not advanced (every turn replays the same noise), the seed written into the caller's params (the
    trajectories of a step share one SamplingParams object, so one sample's seed would leak into another's), a seed
    put on greedy params."""
    from vllm import SamplingParams

    from openrlhf_search.cpu.main_job.seeding import SeededSample, rollout_seed

    class Recorder:
        name = "engine"

        def __init__(self):
            self.seen = []

        async def generate(self, prompt_token_ids, sampling_params, multi_modal_data=None):
            self.seen.append(sampling_params)
            return len(self.seen)

    eng = Recorder()
    shared = SamplingParams(temperature=1.0, max_tokens=4)
    a, b = SeededSample(eng, 42, 3, 1, 0), SeededSample(eng, 42, 3, 1, 1)

    async def turns():
        return [await a.generate([1], shared), await b.generate([1], shared), await a.generate([1, 2], shared)]

    assert asyncio.run(turns()) == [1, 2, 3]
    assert [p.seed for p in eng.seen] == [rollout_seed(42, 3, 1, 0, turn=0), rollout_seed(42, 3, 1, 1, turn=0),
                                          rollout_seed(42, 3, 1, 0, turn=1)]
    assert shared.seed is None and all(p is not shared for p in eng.seen)
    assert (a.turn, b.turn) == (2, 1) and a.name == "engine"  # other attributes reach the wrapped engine
    greedy = SamplingParams(temperature=0.0, max_tokens=4)
    asyncio.run(a.generate([1], greedy))
    assert eng.seen[-1] is greedy and greedy.seed is None
