"""SearchAgentExecutor end to end: the REAL retriever service over HotpotQA dev paragraphs (BM25), both protocols,
budgets, bad model output, a retriever that dies and comes back, OpenRLHF's own loader.

A random tiny model rarely writes tags, so the tests drive the executor with ``tests/scripted_engine.ScriptedEngine``:
vLLM's ``generate`` contract replaying a scripted text for each turn and then EOS, scripted PAST the stop strings
(fake documents, text after the answer), with vLLM's own stop-string check, so what reaches the trajectory is exactly
what vLLM would have returned. Token-exact rollouts of a real model through vLLM are checked by the CPU cluster mode's
tests (tests/test_cpu_cluster_e2e.py).
"""

import asyncio
import logging
import os

import httpx
import pytest
from vllm import SamplingParams

import openrlhf_search._cpu_compat  # noqa: F401
from openrlhf.utils.agent import AgentExecutorBase, MultiTurnAgentExecutor  # noqa: F401
from openrlhf_search.env.agent import ROLLOUT_LOG_KEYS, AgentExecutor, SearchAgentExecutor
from openrlhf_search.env.config import ENV_VAR, SearchConfig
from openrlhf_search.env.protocol import get_protocol
from openrlhf_search.env.retrieval_schema import passage_from_document
from openrlhf_search.env.rewards import compute_reward
from retriever.launch import start_server_process, stop_server_process
from tests.conftest import REPO_ROOT
from tests.scripted_engine import ScriptedEngine

OPENRLHF_KEYS = {"prompt", "label", "images", "mm_train_inputs", "reward", "scores", "observation_tokens",
                 "action_ranges", "rollout_log_probs", "truncated", "extra_logs"}
QUESTION = "Who directed the 2000 film Gone in 60 Seconds?"
GOLD = '["Dominic Sena"]'


# --------------------------------------------------------------------------------------------- scripted model
class Recorder:
    """Wraps an engine and keeps every (prompt_token_ids, sampling_params, output) it served."""

    def __init__(self, engine):
        self.engine, self.calls = engine, []

    async def generate(self, prompt_token_ids, sampling_params, multi_modal_data=None):
        out = await self.engine.generate(prompt_token_ids, sampling_params, multi_modal_data)
        self.calls.append((list(prompt_token_ids), sampling_params, out.outputs[0]))
        return out


def check_trajectory(res, calls, proto, cfg, max_length, tok, prompt):
    """Invariants of every trajectory: action ranges are exactly the sampled tokens, nothing else is."""
    assert OPENRLHF_KEYS <= set(res) and "response_text" in res
    tokens, ranges = res["observation_tokens"], res["action_ranges"]
    prompt_ids = tok(prompt, add_special_tokens=False).input_ids
    assert tokens[: len(prompt_ids)] == prompt_ids
    assert len(tokens) <= max_length
    assert len(ranges) == len(calls)
    for (start, end), (ctx, params, out) in zip(ranges, calls):
        assert ctx == tokens[:start]  # the engine saw exactly the trajectory so far
        assert tokens[start:end] == list(out.token_ids)  # appended as sampled, never re-tokenised
        assert list(params.stop) == list(proto.stop_strings) and params.include_stop_str_in_output
        assert params.max_tokens == min(cfg.max_new_tokens_per_turn, max_length - start)
    covered = sum(e - s for s, e in ranges)
    assert res["extra_logs"]["response_tokens"] == covered
    # observation tokens = everything after the prompt that is not an action
    assert res["extra_logs"]["obs_tokens"] == len(tokens) - len(prompt_ids) - covered
    if res["rollout_log_probs"] is not None:
        lps = res["rollout_log_probs"]
        assert len(lps) == len(tokens)
        mask = [False] * len(tokens)
        for s, e in ranges:
            mask[s:e] = [True] * (e - s)
        assert all(lp == 0.0 for lp, m in zip(lps, mask) if not m)
        flat = [lp for _, _, out in calls for entry, t in zip(out.logprobs, out.token_ids) for lp in [entry[t].logprob]]
        assert [lp for lp, m in zip(lps, mask) if m] == flat
    assert all(isinstance(v, float) for v in res["extra_logs"].values())
    assert set(ROLLOUT_LOG_KEYS) <= set(res["extra_logs"])
    assert isinstance(res["reward"], float) and isinstance(res["scores"], float)
    assert res["response_text"] == tok.decode(
        tokens[len(prompt_ids):-1] if tokens[-1] == tok.eos_token_id else tokens[len(prompt_ids):],
        skip_special_tokens=False)


# --------------------------------------------------------------------------------------------- fixtures
@pytest.fixture(scope="module")
def index_dir(hotpotqa_bm25_index):
    return hotpotqa_bm25_index


@pytest.fixture(scope="module")
def server(index_dir):
    proc, url = start_server_process(index_dir)
    yield url
    stop_server_process(proc)


def direct(url, query, topk=3):
    body = httpx.post(url + "/retrieve", json={"queries": [query], "topk": topk, "return_scores": True}).json()
    return [passage_from_document(h["document"], h["score"]) for h in body["result"][0]]


def make_prompt(proto, tok, question=QUESTION):
    return proto.build_prompt(question, tok, chat=proto.name == "searchr1")


def run_scripted(tok, url, protocol, turns, max_length=4096, label=GOLD, logprobs=1, prompt=None, **cfg_kw):
    proto = get_protocol(protocol)
    cfg_kw.setdefault("reward_scheme", "r1searcher_stage2" if protocol == "r1searcher" else "searchr1_em")
    cfg = SearchConfig(protocol=protocol, retriever_urls=[url], retrieval_backoff_s=0.01, **cfg_kw)
    prompt = prompt or make_prompt(proto, tok)
    engine = Recorder(ScriptedEngine(tok, proto, {prompt: turns}))
    executor = SearchAgentExecutor(cfg)
    params = SamplingParams(temperature=0.0, logprobs=logprobs, skip_special_tokens=False)
    res = asyncio.run(executor.execute(prompt, label, params, max_length, tok, engine))
    check_trajectory(res, engine.calls, proto, cfg, max_length, tok, prompt)
    return res, engine.calls, executor, prompt


# --------------------------------------------------------------------------------------------- protocols
def test_r1searcher_query_then_answer_with_real_passages(qwen_tokenizer, server):
    tok = qwen_tokenizer
    proto = get_protocol("r1searcher")
    turns = [" I need the director. <|begin_of_query|> Gone in 60 Seconds 2000 film director <|end_of_query|>"
             "\n\n<|begin_of_documents|>\n(1)FAKE PASSAGE the model made up\n<|end_of_documents|>",
             "The film was directed by Dominic Sena. </think>\n\n<answer> Dominic Sena </answer> TRAILING TEXT "
             "<|begin_of_query|> more"]
    res, calls, _, prompt = run_scripted(tok, server, "r1searcher", turns)
    assert len(calls) == 2 and [c[2].finish_reason for c in calls] == ["stop", "stop"]
    assert [c[2].stop_reason for c in calls] == ["<|end_of_query|>", "</answer>"]
    text = res["response_text"]
    assert "FAKE PASSAGE" not in text and "TRAILING" not in text
    (s1, e1), (s2, e2) = res["action_ranges"]
    # the documents block between the two actions is the real retriever's top-3, rendered by the protocol
    passages = direct(server, "Gone in 60 Seconds 2000 film director")
    assert any("Dominic Sena" in p.text for p in passages)
    obs = res["observation_tokens"][e1:s2]
    assert obs == SearchAgentExecutor(SearchConfig(retriever_urls=[server])).observation_tokens(passages, tok)
    assert tok.decode(obs) == proto.render_documents(passages)
    assert e2 == len(res["observation_tokens"])  # nothing after the answer
    logs = res["extra_logs"]
    assert (logs["turns"], logs["queries"], logs["valid_searches"], logs["answer_present"]) == (2, 1, 1, 1)
    assert logs["retrieval_failed"] == 0 and not res["truncated"]
    expected = compute_reward("r1searcher_stage2", text, ["Dominic Sena"], proto)
    assert res["reward"] == expected.reward and logs["f1"] == 1.0
    assert all(lp < 0 for s, e in res["action_ranges"] for lp in res["rollout_log_probs"][s:e])


def test_searchr1_invalid_action_gets_the_message_then_search_and_answer(qwen_tokenizer, server):
    tok = qwen_tokenizer
    proto = get_protocol("searchr1")
    turns = ["<think> I am not sure. </think> I think it is someone.",
             "<think> search it </think> <search> Gone in 60 Seconds director </search><information>FAKE",
             "<think> found </think> <answer> Dominic Sena </answer><|im_end|>"]
    res, calls, _, _ = run_scripted(tok, server, "searchr1", turns)
    assert len(calls) == 3
    assert calls[0][2].finish_reason == "stop" and calls[0][2].stop_reason is None  # EOS
    (s1, e1), (s2, e2), (s3, e3) = res["action_ranges"]
    msg_ids = tok(proto.invalid_action_message(), add_special_tokens=False).input_ids
    assert res["observation_tokens"][e1:s2] == msg_ids
    assert tok.decode(res["observation_tokens"][e2:s3]).startswith(proto.doc_open)
    assert tok.decode(res["observation_tokens"][e2:s3]).endswith(proto.doc_close)
    assert "FAKE" not in res["response_text"]
    logs = res["extra_logs"]
    assert (logs["turns"], logs["invalid_actions"], logs["valid_searches"]) == (3, 1, 1)
    assert res["reward"] == 1.0 and logs["em"] == 1.0


def test_r1searcher_invalid_action_ends_the_trajectory(qwen_tokenizer, server):
    res, calls, _, _ = run_scripted(qwen_tokenizer, server, "r1searcher",
                                    ["I will just guess without tags.", "<answer> never reached </answer>"])
    assert len(calls) == 1 and res["extra_logs"]["invalid_actions"] == 1
    assert res["action_ranges"][-1][1] == len(res["observation_tokens"])
    assert res["extra_logs"]["answer_present"] == 0



def test_searchr1_invalid_action_on_the_last_turn_appends_no_message(qwen_tokenizer, server):
    """No generation call is left to read the message: the trajectory ends on the model's own tokens."""
    res, calls, _, _ = run_scripted(qwen_tokenizer, server, "searchr1",
                                    ["<think> hmm </think> no tags here.", "<think> still </think> no tags."],
                                    max_turns=2)
    assert len(calls) == 2 and res["extra_logs"]["invalid_actions"] == 2
    assert res["action_ranges"][-1][1] == len(res["observation_tokens"])
    assert res["response_text"].count("My previous action is invalid") == 1

# --------------------------------------------------------------------------------------------- budgets
@pytest.mark.parametrize("protocol", ["r1searcher", "searchr1"])
def test_max_turns_is_respected(qwen_tokenizer, server, protocol):
    proto = get_protocol(protocol)
    q = f"{proto.query_open} Ed Wood film {proto.query_close}"
    res, calls, _, _ = run_scripted(qwen_tokenizer, server, protocol, [q] * 6, max_turns=3)
    assert len(calls) == 3
    logs = res["extra_logs"]
    assert (logs["turns"], logs["queries"], logs["valid_searches"]) == (3, 3, 2)  # last query: no turn left to read


@pytest.mark.parametrize("protocol", ["r1searcher", "searchr1"])
def test_max_obs_tokens_cuts_the_passages_and_keeps_the_closing_tag(qwen_tokenizer, server, protocol):
    tok = qwen_tokenizer
    proto = get_protocol(protocol)
    turns = [f"{proto.query_open} Gone in 60 Seconds film {proto.query_close}",
             f"{proto.answer_open} Dominic Sena {proto.answer_close}"]
    res, _, _, _ = run_scripted(tok, server, protocol, turns, max_obs_tokens=40)
    (s1, e1), (s2, e2) = res["action_ranges"]
    obs = res["observation_tokens"][e1:s2]
    assert len(obs) == 40
    close_ids = tok(proto.doc_close, add_special_tokens=False).input_ids
    open_ids = tok(proto.doc_open, add_special_tokens=False).input_ids
    assert obs[-len(close_ids):] == close_ids and obs[: len(open_ids)] == open_ids
    full_body = proto.format_passages(direct(server, "Gone in 60 Seconds film"))
    body = tok.decode(obs[len(open_ids):-len(close_ids)])
    assert body and full_body.startswith(body) and len(body) < len(full_body)


def test_max_length_observation_that_does_not_fit_is_not_appended(qwen_tokenizer, server):
    tok = qwen_tokenizer
    proto = get_protocol("r1searcher")
    prompt = make_prompt(proto, tok)
    turn = "<|begin_of_query|> Gone in 60 Seconds film <|end_of_query|>"
    n_prompt = len(tok(prompt, add_special_tokens=False).input_ids)
    n_turn = len(tok(turn, add_special_tokens=False).input_ids)
    max_length = n_prompt + n_turn + 30  # room for the action, not for three passages
    res, calls, _, _ = run_scripted(tok, server, "r1searcher", [turn, "<answer> x </answer>"], max_length=max_length)
    # the policy stopped properly (end-of-query tag): not a length cut, so no stop-properly penalty applies
    assert len(calls) == 1 and not res["truncated"] and res["extra_logs"]["truncated"] == 0.0
    assert res["extra_logs"]["context_full"] == 1.0
    assert res["action_ranges"][-1][1] == len(res["observation_tokens"]) == n_prompt + n_turn
    assert res["extra_logs"]["queries"] == 1 and res["extra_logs"]["valid_searches"] == 0


def test_max_length_cuts_generation_mid_turn(qwen_tokenizer, server):
    tok = qwen_tokenizer
    proto = get_protocol("searchr1")
    n_prompt = len(tok(make_prompt(proto, tok), add_special_tokens=False).input_ids)
    long_turn = "<think> " + "thinking more and more " * 40 + "</think> <answer> x </answer>"
    res, calls, _, _ = run_scripted(tok, server, "searchr1", [long_turn], max_length=n_prompt + 25)
    assert len(calls) == 1 and calls[0][2].finish_reason == "length"
    assert len(res["observation_tokens"]) == n_prompt + 25 and res["truncated"]


def test_max_new_tokens_per_turn(qwen_tokenizer, server):
    long_turn = "<think> " + "more thoughts " * 60 + "</think>"
    res, calls, _, _ = run_scripted(qwen_tokenizer, server, "searchr1", [long_turn, long_turn, long_turn],
                                    max_new_tokens_per_turn=16, max_turns=3)
    assert [len(c[2].token_ids) for c in calls] == [16, 16, 16]
    assert all(c[2].finish_reason == "length" for c in calls)
    assert res["extra_logs"]["turns_cut"] == res["extra_logs"]["turns"] == 3  # every turn cut, not only the last


# --------------------------------------------------------------------------------------------- bad model output
BAD_CASES = {
    "unclosed_query": (["{qo} Ed Wood director and then nothing"], "invalid"),
    "nested_query": (["{qo} first {qo} Ed Wood director {qc}", "{ao} Ed Wood {ac}"], "query"),
    "empty_query": (["{qo}    {qc}", "{ao} x {ac}"], "invalid"),
    "huge_query": (["{qo} " + "Ed Wood director " * 600 + "{qc}", "{ao} x {ac}"], "query"),
    "tags_inside_answer": (["{ao} Paris {qc} {ac}", "{ao} Paris {ac}"], "invalid"),
    "text_after_answer": (["{ao} Dominic Sena {ac} and more text {qo} q {qc}"], "answer"),
    "non_ascii": (["{qo} Zürich 東京 café — ünïcödé {qc}", "{ao} 東京 {ac}"], "query"),
}


@pytest.mark.parametrize("protocol", ["r1searcher", "searchr1"])
@pytest.mark.parametrize("case", sorted(BAD_CASES))
def test_bad_model_output(qwen_tokenizer, server, protocol, case):
    proto = get_protocol(protocol)
    raw, first_kind = BAD_CASES[case]
    turns = [t.format(qo=proto.query_open, qc=proto.query_close, ao=proto.answer_open, ac=proto.answer_close)
             for t in raw]
    extra = {"max_new_tokens_per_turn": 4000} if case == "huge_query" else {}  # ~1,800 tokens in one turn
    res, calls, executor, _ = run_scripted(qwen_tokenizer, server, protocol, turns, max_turns=3,
                                           max_length=8192, **extra)
    first_text = qwen_tokenizer.decode(calls[0][2].token_ids)
    assert proto.parse_action(first_text).kind == first_kind
    logs = res["extra_logs"]
    stats = executor.client.stats
    if case == "empty_query":
        assert stats["requests"] == 0 and logs["valid_searches"] == 0
    if case == "huge_query":
        assert stats["truncated_queries"] == 1 and logs["valid_searches"] == 1
        assert len(first_text) > 10_000
    if case in ("nested_query", "non_ascii"):
        assert logs["valid_searches"] == 1 and stats["requests"] == 1
    if case == "text_after_answer":
        assert "more text" not in res["response_text"] and len(calls) == 1
    if case == "unclosed_query":
        assert logs["valid_searches"] == 0
    if first_kind == "invalid" and protocol == "r1searcher":
        assert len(calls) == 1  # no environment message in R1-Searcher: the trajectory ends
    assert logs["retrieval_failed"] == 0


# --------------------------------------------------------------------------------------------- real tiny model
# --------------------------------------------------------------------------------------------- outage
def test_retriever_dies_mid_rollout_and_comes_back(qwen_tokenizer, index_dir, caplog):
    tok = qwen_tokenizer
    proto = get_protocol("searchr1")
    proc, url = start_server_process(index_dir)
    port = int(url.rsplit(":", 1)[1])
    questions = [f"Question number {i} about Ed Wood?" for i in range(4)]
    prompts = [make_prompt(proto, tok, q) for q in questions]
    turns = ["<search> Ed Wood director </search>", "<answer> Ed Wood </answer>"]
    engine = ScriptedEngine(tok, proto, {p: turns for p in prompts})
    cfg = SearchConfig(protocol="searchr1", retriever_urls=[url], retrieval_max_retries=2, retrieval_backoff_s=0.05,
                       reward_scheme="searchr1_em")
    executor = SearchAgentExecutor(cfg)
    params = SamplingParams(temperature=0.0, logprobs=1, skip_special_tokens=False)

    def batch():
        async def run():
            return await asyncio.gather(*(executor.execute(p, '["Ed Wood"]', params, 4096, tok, engine)
                                          for p in prompts))
        return asyncio.run(run())

    try:
        ok = batch()
        assert all(r["extra_logs"]["retrieval_failed"] == 0 and r["reward"] == 1.0 for r in ok)
        stop_server_process(proc)
        failed_before = SearchAgentExecutor.retrieval_failed_samples
        with caplog.at_level(logging.WARNING, logger="openrlhf_search.env.agent"):
            down = batch()
        for r in down:
            logs = r["extra_logs"]
            assert logs["retrieval_failed"] == 1.0 and logs["retrieval_failures"] == 1.0
            assert r["reward"] == 0.0 and r["scores"] == 0.0
            assert len(r["action_ranges"]) == 1 and r["action_ranges"][0][1] == len(r["observation_tokens"])
            assert logs["valid_searches"] == 0
        assert SearchAgentExecutor.retrieval_failed_samples - failed_before == 4
        counts = [m for m in caplog.messages if "retrieval failed" in m and "so far" in m]
        assert len(counts) == 4 and f"({failed_before + 4} such samples" in counts[-1]
        proc, _ = start_server_process(index_dir, port=port)
        back = batch()
        assert all(r["extra_logs"]["retrieval_failed"] == 0 and r["reward"] == 1.0 for r in back)
        assert [r["observation_tokens"] for r in back] == [r["observation_tokens"] for r in ok]
    finally:
        stop_server_process(proc)


# --------------------------------------------------------------------------------------------- OpenRLHF loader
def test_openrlhf_loader_builds_our_executor_from_env(monkeypatch):
    from openrlhf.trainer.ray.vllm_engine import _load_agent_executor

    cfg = SearchConfig(protocol="searchr1", retriever_urls=["http://127.0.0.1:8123", "http://127.0.0.1:8124"],
                       topk=5, max_turns=4, reward_scheme="searchr1_em")
    monkeypatch.setenv(ENV_VAR, cfg.to_json())
    executor = _load_agent_executor(os.path.join(REPO_ROOT, "openrlhf_search", "env", "agent.py"))
    assert type(executor).__name__ == "SearchAgentExecutor"
    assert isinstance(executor, AgentExecutorBase)
    assert executor.config == cfg and executor.protocol.name == "searchr1"
    assert executor.client.urls == cfg.retriever_urls and executor.client.topk == 5
    assert AgentExecutor is SearchAgentExecutor


@pytest.mark.parametrize("text, field", [
    ('{"retrieval_backoff_s": Infinity}', "retrieval_backoff_s"),  # first retry would sleep forever
    ('{"coalesce_window_ms": 1e400}', "coalesce_window_ms"),       # the first query would never be sent
    ('{"retrieval_timeout_s": NaN}', "retrieval_timeout_s"), ('{"retrieval_timeout_s": 0}', "retrieval_timeout_s"),
    ('{"retrieval_max_retries": true}', "retrieval_max_retries"),
    ('{"chat_template": "false"}', "chat_template"),                # a non-empty string is truthy
    ('{"retriever_urls": ["http://"]}', "retriever_urls"), ('{"retriever_urls": ["http://h:port"]}', "retriever_urls"),
    ('{"retriever_urls": 5}', "retriever_urls"),
    ('{"reward_scheme": "searchr1_emm"}', "reward_scheme"),          # a typo must fail at start, not at 1st reward
])
def test_bad_env_config_is_refused_when_the_executor_is_built(monkeypatch, text, field):
    from openrlhf_search.env.config import ConfigError

    monkeypatch.setenv(ENV_VAR, text)
    with pytest.raises(ConfigError, match=field):
        AgentExecutor()


def test_images_and_unreadable_labels_are_refused(qwen_tokenizer, server):
    executor = SearchAgentExecutor(SearchConfig(retriever_urls=[server]))
    params = SamplingParams(temperature=0.0)
    with pytest.raises(ValueError, match="images"):
        asyncio.run(executor.execute("p", "a", params, 100, qwen_tokenizer, None, images=["x"]))
    with pytest.raises(ValueError):
        asyncio.run(executor.execute("p", None, params, 100, qwen_tokenizer, None))


def test_rollout_log_probs_none_without_logprobs(qwen_tokenizer, server):
    res, _, _, _ = run_scripted(qwen_tokenizer, server, "r1searcher", ["<answer> x </answer>"], logprobs=None)
    assert res["rollout_log_probs"] is None


def test_observation_tokens_ignore_padding_state_left_in_a_shared_tokenizer(qwen_tokenizer):
    """A trainer's padded batch call leaves padding/truncation enabled in the Rust backend; it must not leak in."""
    from openrlhf_search.env.types import Passage

    executor = SearchAgentExecutor(SearchConfig(protocol="searchr1"))
    passages = [Passage("1", "Ed Wood", "Edward Davis Wood Jr. was an American filmmaker. " * 5)]
    clean = executor.observation_tokens(passages, qwen_tokenizer)
    qwen_tokenizer(["a", "a much longer text here"], padding="max_length", truncation=True, max_length=8)
    try:
        assert executor.observation_tokens(passages, qwen_tokenizer) == clean
    finally:
        qwen_tokenizer(["reset"])  # leave the session tokenizer as other tests expect it
    assert qwen_tokenizer.decode(clean) == get_protocol("searchr1").render_documents(passages)


def test_unmasked_arm_trains_on_the_documents_block_and_nothing_else_changes(qwen_tokenizer, server):
    """``mask_retrieved`` false (the masking ablation): the same trajectory, one action span from the end of the prompt
    to the end, so the documents block is trained on; true (default): the block lies between the two sampled spans.
    Catches the flag ignored, a span that starts inside the prompt, or a trajectory that changes with the flag."""
    tok = qwen_tokenizer
    proto = get_protocol("searchr1")
    turns = ["<search> Gone in 60 Seconds 2000 film director </search>", "<answer> Dominic Sena </answer>"]
    prompt = make_prompt(proto, tok)
    results = {}
    for mask in (True, False):
        cfg = SearchConfig(protocol="searchr1", retriever_urls=[server], reward_scheme="searchr1_em",
                           mask_retrieved=mask)
        engine = ScriptedEngine(tok, proto, {prompt: turns})
        params = SamplingParams(temperature=0.0, logprobs=1, skip_special_tokens=False)
        results[mask] = asyncio.run(SearchAgentExecutor(cfg).execute(prompt, GOLD, params, 4096, tok, engine))
    masked, unmasked = results[True], results[False]
    assert masked["observation_tokens"] == unmasked["observation_tokens"] and masked["reward"] == unmasked["reward"]
    (s1, e1), (s2, e2) = masked["action_ranges"]
    assert s2 > e1 and "<information>" in tok.decode(masked["observation_tokens"][e1:s2])
    assert unmasked["action_ranges"] == [(s1, e2)] and s1 == len(tok(prompt, add_special_tokens=False).input_ids)
