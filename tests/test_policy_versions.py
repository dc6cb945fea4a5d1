"""Per-token policy versions (asynchronous training with partial rollouts; ``openrlhf_search/env/policy_versions.py``),
without Ray: the real ``SearchAgentExecutor`` over an engine stand-in built like OpenRLHF's ``RolloutRayActor``
(``generate`` reads vLLM's stream of cumulative outputs) whose streamed generation is paused for a weight sync
mid-turn, and again while a search is in flight; the instruments are installed by the real
``step_timing.install_in_rollout_actor``. The expected version of each token is what the engine held when it
produced that token, recorded by the stand-in itself.
"""

import asyncio
from types import SimpleNamespace

import pytest
import torch

import openrlhf_search._cpu_compat  # noqa: F401
from openrlhf.trainer.ppo_utils.experience import Experience
from openrlhf_search.env import policy_versions as pv
from openrlhf_search.rl import step_timing
from openrlhf_search.env.agent import SearchAgentExecutor
from openrlhf_search.env.config import SearchConfig
from openrlhf_search.rl.experience_maker import SearchSamplesGenerator
from openrlhf_search.env.protocol import get_protocol
from openrlhf_search.env.types import Passage


class StreamingLLM:
    """vLLM ``AsyncLLM.generate`` stand-in: replays one scripted turn per call, streaming cumulative outputs
    ``chunk`` tokens at a time. ``sync_before`` = {(call, token index)}: the engine's weights are replaced (version
    + 1) before that token is produced, as a partial-rollout weight sync does between two engine steps."""

    def __init__(self, actor, turns, sync_before=(), chunk=1):
        self.actor, self.turns, self.sync_before, self.chunk = actor, turns, set(sync_before), chunk
        self.calls = 0
        self.truth = []  # per call: the version that produced each token

    async def generate(self, prompt, params, request_id=None):
        ids, call = self.turns[self.calls], self.calls
        self.calls += 1
        made = []
        self.truth.append(made)
        for i in range(0, len(ids), self.chunk):
            for k in range(i, min(i + self.chunk, len(ids))):
                if (call, k) in self.sync_before:
                    step_timing.set_policy_version(self.actor, getattr(self.actor, step_timing.VERSION_ATTR, 0) + 1)
                made.append(getattr(self.actor, step_timing.VERSION_ATTR, 0))
            await asyncio.sleep(0)
            n = len(made)
            done = n == len(ids)
            yield SimpleNamespace(outputs=[SimpleNamespace(token_ids=list(ids[:n]), logprobs=None,
                                                           finish_reason="stop" if done else None)])


class Actor:
    """``RolloutRayActor``'s ``generate``: iterate ``self.llm.generate`` and return the last output."""

    def __init__(self):
        self.llm = None

    async def generate(self, prompt_token_ids, sampling_params, multi_modal_data=None):
        final = None
        async for out in self.llm.generate({"prompt_token_ids": prompt_token_ids}, sampling_params, request_id="r"):
            final = out
        return final


class SyncingClient:
    """Retrieval client whose search is in flight while the trainer syncs (``bump`` versions)."""

    def __init__(self, actor, bump=0):
        self.actor, self.bump = actor, bump

    async def search(self, query):
        for _ in range(self.bump):
            step_timing.set_policy_version(self.actor, getattr(self.actor, step_timing.VERSION_ATTR) + 1)
        return [Passage(id="1", title="France", text="Paris is the capital of France.")]


def rollout(tok, sync_before, search_syncs=0, chunk=1, install=True):
    proto = get_protocol("searchr1")
    turns = [tok("<search> capital of France </search>", add_special_tokens=False).input_ids,
             tok("<answer> Paris </answer>", add_special_tokens=False).input_ids + [tok.eos_token_id]]
    actor = Actor()
    step_timing.set_policy_version(actor, 3)
    actor.llm = StreamingLLM(actor, turns, sync_before, chunk)
    if install:
        step_timing.install_in_rollout_actor(actor, record_versions=True)
    cfg = SearchConfig(protocol="searchr1", retriever_urls=["http://127.0.0.1:9"], reward_scheme="searchr1_em")
    executor = SearchAgentExecutor(cfg, retrieval_client=SyncingClient(actor, search_syncs), protocol=proto)
    prompt = proto.build_prompt("What is the capital of France?", tok, chat=True)
    params = SimpleNamespace(logprobs=None, stop=None)
    res = asyncio.run(executor.execute(prompt, '["Paris"]', params, 4096, tok, actor))
    return res, actor.llm.truth


def expected_tensor(res, truth):
    per_token = [pv.NO_VERSION] * len(res["observation_tokens"])
    for (start, end), made in zip(res["action_ranges"], truth):
        assert end - start == len(made)
        per_token[start:end] = made
    return torch.tensor(per_token[1:])


@pytest.mark.parametrize("chunk", [1, 3])
def test_a_sample_resumed_after_syncs_gets_each_tokens_version(qwen_tokenizer, chunk):
    """Synced before token 4 of turn 1 (mid-turn, engine paused with the request kept) and while the search was in
    flight: turn 1 = tokens 0-3 of version 3 then 4, turn 2 all of version 5. Catches: the resumed tokens tagged
    with the old version (a per-trajectory or per-turn tag, the version read when the request started), an
    off-by-one at the boundary (token 4 tagged 3, or token 3 tagged 4), the turn-local index not shifted to the
    trajectory's, and documents or prompt tokens given a version. ``chunk`` 3: vLLM hands several steps' tokens
    out at once (its output collector merges them), the sync falling inside no chunk."""
    res, truth = rollout(qwen_tokenizer, sync_before={(0, 3 if chunk == 3 else 4)}, search_syncs=1, chunk=chunk)
    boundary = 3 if chunk == 3 else 4
    assert truth[0] == [3] * boundary + [4] * (len(truth[0]) - boundary) and set(truth[1]) == {5}
    (s1, _), (s2, _) = res["action_ranges"]
    assert res["action_versions"] == [(s1, 3), (s1 + boundary, 4), (s2, 5)]
    got = pv.versions_tensor(res["action_versions"], res["action_ranges"], len(res["observation_tokens"]), 4096)
    assert torch.equal(got, expected_tensor(res, truth))
    assert got[s1 + boundary - 2] == 3 and got[s1 + boundary - 1] == 4  # mask position i = token i + 1
    assert bool(pv.spans_sync(got))


def test_the_generator_puts_the_tensor_on_the_sample_and_the_trainer_on_its_micro_batch(qwen_tokenizer):
    """Executor result -> ``SearchSamplesGenerator._process_response_into_experience`` (OpenRLHF's own conversion
    underneath) -> OpenRLHF's micro-batch concat in ``split_rollout_samples``' order -> ``attach_to_experiences``
    and the step's figures. Catches: the tensor not aligned with the sample's ``action_mask`` (shifted by the
    mask's one-token offset or cut to another length), rows of a micro-batch attached in the wrong order (its
    ``index``), padding read as version 0, and a sample whose tokens are all of one version counted as spanning."""
    spanning, _ = rollout(qwen_tokenizer, sync_before={(0, 2)})
    plain, _ = rollout(qwen_tokenizer, sync_before=())
    gen = object.__new__(SearchSamplesGenerator)
    samples = [gen._process_response_into_experience(r, max_len=4096) for r in (plain, spanning)]
    for s, r in zip(samples, (plain, spanning)):
        t = getattr(s, pv.TENSOR_ATTR)
        assert t.shape == s.action_mask[0].shape
        assert torch.equal(t != pv.NO_VERSION, s.action_mask[0].bool())
    for i, s in enumerate(samples):  # what OpenRLHF's split_rollout_samples does before concatenating
        s.index = [i]
    batch = Experience.concat_experiences([samples[1], samples[0]], qwen_tokenizer.pad_token_id)
    pv.attach_to_experiences([batch], samples)
    got = getattr(batch, pv.TENSOR_ATTR)
    assert got.shape == batch.action_mask.shape
    assert torch.equal(got != pv.NO_VERSION, batch.action_mask.bool())
    assert pv.spans_sync(got).tolist() == [True, False]
    stats = pv.batch_stats([getattr(s, pv.TENSOR_ATTR) for s in samples], global_step=5)
    assert stats["async/samples_spanning_sync"] == 1.0 and stats["async/token_versions_max"] == 2.0
    assert stats["async/token_staleness_max"] == 2.0  # step 5 trained on tokens of version 3


def test_no_instruments_no_versions(qwen_tokenizer):
    """Without the async trainer's instruments (sync training, the CPU main job) the executor returns no
    ``action_versions`` and the generator attaches nothing. Catches: a version invented for untagged tokens."""
    res, _ = rollout(qwen_tokenizer, sync_before={(0, 2)}, install=False)
    assert res["action_versions"] is None
    sample = object.__new__(SearchSamplesGenerator)._process_response_into_experience(res, max_len=4096)
    assert getattr(sample, pv.TENSOR_ATTR, None) is None
    assert pv.batch_stats([None], 1) == {}


def test_versions_tensor_refuses_untagged_action_tokens_and_follows_truncation():
    """An action token before the first recorded segment is refused (it would otherwise get a made-up version);
    ``--data.max_len`` cuts the tensor as OpenRLHF cuts the mask. Catches: silently tagging untagged tokens, a
    tensor longer than the truncated mask."""
    with pytest.raises(ValueError, match="no recorded policy version"):
        pv.versions_tensor([(6, 1)], [(4, 8)], 8, 100)
    t = pv.versions_tensor([(4, 1), (6, 2)], [(4, 8), (10, 12)], 12, 9)
    assert t.tolist() == [-1, -1, -1, 1, 1, 2, 2, -1]
