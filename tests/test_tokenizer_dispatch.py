"""The policy's tokenizer crosses Ray once per rollout process, not once per prompt.

A real local Ray, the real Qwen2.5 tokenizer, :class:`SearchSamplesGenerator`'s dispatch (OpenRLHF's own
``_dispatch_prompts_to_vllm`` underneath) and rollout actors whose ``generate_responses`` is OpenRLHF's own
(``RolloutRayActor`` with its vLLM start-up left out) calling our executor's token cache."""

import os
import pickle
from types import SimpleNamespace

import pytest
import ray
import ray.cloudpickle

from openrlhf_search.rl.experience_maker import SearchSamplesGenerator

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
MB = 1 << 20


def _engine_class():
    from openrlhf.trainer.ray.vllm_engine import RolloutRayActor

    from openrlhf_search.env.agent import SearchAgentExecutor
    from openrlhf_search.env.config import SearchConfig

    class RecordingExecutor(SearchAgentExecutor):
        """Our executor's token cache, fed the prompt and the documents' opening tag of every trajectory."""

        async def execute(self, prompt, label, sampling_params, max_length, hf_tokenizer, llm_engine, images=None):
            from openrlhf_search.env.tokenizer_handle import tokenizer_loads

            ids = self._encode_cached(hf_tokenizer, prompt)
            self._encode_cached(hf_tokenizer, self.protocol.doc_open)
            return {"pid": os.getpid(), "tok_id": id(hf_tokenizer), "loads": tokenizer_loads(), "ids": ids,
                    "cache": len(self._token_cache), "type": type(hf_tokenizer).__name__}

    class Engine(RolloutRayActor.__ray_actor_class__):
        async def __init__(self):  # the real actor's generate_responses, without starting vLLM
            self.executor = RecordingExecutor(SearchConfig(), retrieval_client=object())

        def get_num_unfinished_requests(self) -> int:
            return 0

    return ray.remote(num_cpus=0)(Engine)


class _Recorder:
    """An engine handle whose ``generate_responses.remote`` records what each call carries (Ray's pickler)."""

    def __init__(self, engine, sizes):
        self._engine, self._sizes = engine, sizes
        self.get_num_unfinished_requests = engine.get_num_unfinished_requests
        self.generate_responses = self

    def remote(self, **kwargs):
        self._sizes.append(len(ray.cloudpickle.dumps(kwargs)))
        return self._engine.generate_responses.remote(**kwargs)


@pytest.fixture(scope="module")
def local_ray():
    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False,
             runtime_env={"env_vars": {"PYTHONPATH": REPO, "TOKENIZERS_PARALLELISM": "false"}})
    try:
        yield
    finally:
        ray.shutdown()


def test_search_samples_generator_sends_the_tokenizer_once_per_process(qwen_tokenizer, local_ray):
    full = len(pickle.dumps(qwen_tokenizer))
    assert full > 5 * MB  # the control: the real tokenizer sent with every prompt would break the 1 MB bound
    engines = [_engine_class().remote() for _ in range(2)]
    sizes = []
    args = SimpleNamespace(rollout=SimpleNamespace(n_samples_per_prompt=2),
                           algo=SimpleNamespace(advantage=SimpleNamespace(is_correction_level="off")))
    gen = SearchSamplesGenerator(strategy=SimpleNamespace(args=args), prompts_dataloader=None, eval_dataloader=None,
                                 tokenizer=qwen_tokenizer, vllm_engines=[_Recorder(e, sizes) for e in engines])
    prompts = [f"Question {i}: who wrote Hamlet?" for i in range(6)]
    results = []
    for _ in range(2):  # two rollout batches: the second reuses the first's handle and the actors' copies
        refs = gen._dispatch_prompts_to_vllm(prompts, ["a"] * len(prompts), max_new_tokens=8, max_len=64)
        assert gen.tokenizer is qwen_tokenizer  # restored after the dispatch
        results += [r for group in ray.get(refs) for r in group]

    assert len(sizes) == 12 and max(sizes) < MB, sizes
    assert len(results) == 24
    assert {r["type"] for r in results} == {type(qwen_tokenizer).__name__}
    expected = {p: qwen_tokenizer(p, add_special_tokens=False)["input_ids"] for p in prompts}
    assert all(r["ids"] == expected[p] for r, p in zip(results, [p for p in prompts for _ in range(2)] * 2))
    by_pid = {}
    for r in results:
        by_pid.setdefault(r["pid"], []).append(r)
    assert len(by_pid) == 2  # both actors got work
    for rows in by_pid.values():
        assert {r["tok_id"] for r in rows} == {rows[0]["tok_id"]}  # one tokenizer object per process
        assert {r["loads"] for r in rows} == {1}  # fetched and unpickled once
        # the executor's cache keyed by id(tokenizer): the tag is one entry, each distinct prompt one entry
        n_prompts = len({tuple(r["ids"]) for r in rows})
        assert max(r["cache"] for r in rows) == n_prompts + 1
