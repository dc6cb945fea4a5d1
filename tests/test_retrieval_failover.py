"""Retriever failover: several endpoints are one service. A dead or unhealthy endpoint is routed
around (circuit breaker), re-admitted after a passing ``GET /health`` probe, and a request that fails on one endpoint
is re-sent at once to another, so a rollout loses no sample when one of four real retrievers is killed mid-rollout.
An endpoint that dribbles its answer is cut off by the request's deadline and failed over like a dead one; a query
the retriever refuses costs the sample nothing but an empty documents block."""

import asyncio
import logging
import signal
import time
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest
from vllm import SamplingParams

from openrlhf_search.env.agent import SearchAgentExecutor
from openrlhf_search.env.config import SearchConfig
from openrlhf_search.env.protocol import get_protocol
from openrlhf_search.env.retrieval_client import RetrievalClient, RetrievalError, start_retrieval_trace
from tests.test_retrieval_client import _WholeRequestServer
from retriever.launch import start_server_process, stop_server_process
from tests.scripted_engine import ScriptedEngine
from tests.test_agent import make_prompt

QUESTIONS = [f"Question {i}: who directed Ed Wood?" for i in range(16)]
SEARCHES = ["Ed Wood director", "Scott Derrickson nationality", "Tim Burton films"]


@pytest.fixture(scope="module")
def four_servers(hotpotqa_bm25_index):
    """Four real ``python -m retriever.server`` processes over one BM25 index (started in parallel)."""
    with ThreadPoolExecutor(4) as pool:
        procs = list(pool.map(lambda _: start_server_process(hotpotqa_bm25_index), range(4)))
    yield procs
    for proc, _ in procs:
        if proc.poll() is None:
            stop_server_process(proc)


def server_requests(url):
    return httpx.get(url + "/health").json()["stats"]["requests"]


class KillWhen:
    """An engine wrapper that SIGKILLs a retriever process at the first generate call where ``ready()`` holds."""

    def __init__(self, engine, proc, ready):
        self.engine, self.proc, self.ready, self.calls, self.killed_at = engine, proc, ready, 0, None

    async def generate(self, prompt_token_ids, sampling_params, multi_modal_data=None):
        self.calls += 1
        if self.killed_at is None and self.ready():
            stop_server_process(self.proc, sig=signal.SIGKILL)
            self.killed_at = self.calls
        return await self.engine.generate(prompt_token_ids, sampling_params, multi_modal_data)


def test_one_of_four_retrievers_killed_mid_rollout_loses_no_sample(qwen_tokenizer, four_servers, caplog):
    tok = qwen_tokenizer
    proto = get_protocol("searchr1")
    urls = [url for _, url in four_servers]
    victim_proc, victim = four_servers[2]
    prompts = [make_prompt(proto, tok, q) for q in QUESTIONS]
    turns = [f"<search> {q} </search>" for q in SEARCHES] + ["<answer> Ed Wood </answer>"]
    engine = ScriptedEngine(tok, proto, {p: turns for p in prompts})
    # 16 samples x 3 searches; 2 queries per request so every turn spreads over all four endpoints; no backoff
    # retry at all: only failover can save the requests sent to the dead endpoint
    cfg = SearchConfig(protocol="searchr1", retriever_urls=urls, retrieval_max_retries=0, coalesce_window_ms=20,
                       max_batch_queries=2, reward_scheme="searchr1_em")
    client = RetrievalClient.from_config(cfg)
    client.failed_endpoint_cooldown_s = 120  # no health probe re-admits the dead endpoint during the test
    executor = SearchAgentExecutor(cfg, retrieval_client=client)
    params = SamplingParams(temperature=0.0, logprobs=1, skip_special_tokens=False)
    before = {u: server_requests(u) for u in urls}
    # the kill lands once the victim has answered a request (so it was in use), with most searches still to come
    # (round-robin reaches it by the 3rd request of 24 or more)
    killer = KillWhen(engine, victim_proc,
                      ready=lambda: client.endpoint_stats()[victim]["requests"] > client.endpoint_stats()[victim]
                      ["failures"] + client.endpoint_stats()[victim]["in_flight"])

    async def rollout():
        return await asyncio.gather(*(executor.execute(p, '["Ed Wood"]', params, 4096, tok, killer) for p in prompts))

    with caplog.at_level(logging.INFO, logger="openrlhf_search.env.retrieval_client"):
        results = asyncio.run(rollout())

    assert victim_proc.poll() is not None and killer.killed_at < killer.calls  # really killed, mid-rollout
    # no sample lost: every sample made its three searches and got the answer's reward
    for r in results:
        logs = r["extra_logs"]
        assert logs["retrieval_failed"] == 0.0 and logs["retrieval_failures"] == 0.0
        assert logs["valid_searches"] == 3.0 and r["reward"] == 1.0
    # the dead endpoint had served requests before the kill, then was routed around
    live = [u for u in urls if u != victim]
    served_by_live = sum(server_requests(u) - before[u] for u in live)
    ep = client.endpoint_stats()
    assert ep[victim]["requests"] - ep[victim]["failures"] >= 1  # answered before the kill
    assert ep[victim]["open"] and all(not ep[u]["open"] for u in live)
    assert client.stats["breaker_opens"] == 1 and client.stats["errors"] == 0
    assert client.stats["failovers"] == ep[victim]["failures"] >= 1
    assert served_by_live + ep[victim]["requests"] - ep[victim]["failures"] == \
        client.stats["requests"] - client.stats["failures"]
    # ... counted per sample (extra_logs, logged by OpenRLHF) and in the logs
    assert sum(r["extra_logs"]["retrieval_failovers"] for r in results) >= client.stats["failovers"]
    assert any("failed over" in m for m in caplog.messages)
    assert any(victim in m and "taken out of rotation" in m for m in caplog.messages)


def test_breaker_opens_then_a_health_check_brings_the_endpoint_back(hotpotqa_bm25_index):
    proc, url = start_server_process(hotpotqa_bm25_index)
    port = int(url.rsplit(":", 1)[1])
    stop_server_process(proc)  # down from the start
    other, other_url = start_server_process(hotpotqa_bm25_index)
    client = RetrievalClient([url, other_url], coalesce_window_ms=0, failed_endpoint_cooldown_s=0.3,
                             max_retries=0)
    restarted = None
    try:
        async def phase(n):
            return [await client.search(f"Ed Wood {i}") for i in range(n)]

        asyncio.run(phase(4))
        assert client.endpoint_stats()[url]["open"] and client.stats["failovers"] == 1
        assert client.endpoint_stats()[url]["requests"] == 1  # open breaker: no more real requests sent there

        async def wait_for_probe(expect_open):
            for _ in range(100):
                await client.search("Nicolas Cage")  # traffic triggers the due probes
                await asyncio.sleep(0.05)
                if client.endpoint_stats()[url]["open"] == expect_open and client.stats["health_checks"]:
                    return

        asyncio.run(wait_for_probe(expect_open=True))
        assert client.stats["health_check_failures"] >= 1  # still down: stays out, next check later
        assert client.endpoint_stats()[url]["requests"] == 1
        restarted, _ = start_server_process(hotpotqa_bm25_index, port=port)
        checks = client.stats["health_checks"]
        asyncio.run(wait_for_probe(expect_open=False))
        assert not client.endpoint_stats()[url]["open"] and client.stats["breaker_closes"] == 1
        assert client.stats["health_checks"] > checks
        before = server_requests(url)
        asyncio.run(phase(4))
        assert server_requests(url) - before == 2  # back in rotation: half the sequential requests
    finally:
        stop_server_process(other)
        if restarted is not None:
            stop_server_process(restarted)


def test_endpoint_that_never_answers_times_out_and_fails_over(hotpotqa_bm25_index):
    """An endpoint that accepts connections but never answers: the first request times out and fails over; the
    breaker then keeps it out."""
    proc, url = start_server_process(hotpotqa_bm25_index)

    async def run():
        async def hang(reader, writer):
            await asyncio.sleep(30)

        server = await asyncio.start_server(hang, "127.0.0.1", 0)
        slow = f"http://127.0.0.1:{server.sockets[0].getsockname()[1]}"
        client = RetrievalClient([slow, url], timeout_s=0.5, max_retries=0, coalesce_window_ms=0,
                                 failed_endpoint_cooldown_s=60)
        try:
            results = await asyncio.gather(*(client.search(f"Ed Wood {i}") for i in range(6)))
        finally:
            server.close()
        return client, slow, results

    try:
        client, slow, results = asyncio.run(run())
    finally:
        stop_server_process(proc)
    assert all(results)
    ep = client.endpoint_stats()
    assert ep[slow]["requests"] == 1 and ep[slow]["failures"] == 1 and ep[slow]["open"]
    assert client.stats["failovers"] == 1 and client.stats["errors"] == 0


def test_slow_endpoint_gets_no_new_request_while_another_is_free(hotpotqa_bm25_index):
    """Least-in-flight routing: an endpoint still busy with a request gets no other while a free one exists (plain
    round-robin would send it every second request, each waiting behind the slow one)."""
    proc, url = start_server_process(hotpotqa_bm25_index)
    body = b'{"result": [[{"document": {"id": "slow", "title": "Slow", "text": "late"}, "score": 1.0}]]}'

    async def run():
        release = asyncio.Event()
        seen = []

        async def slow_handler(reader, writer):
            head = await reader.readuntil(b"\r\n\r\n")
            if head.startswith(b"GET"):  # the client's limits look-up: a server without /health (as Search-R1's)
                writer.write(b"HTTP/1.1 404 Not Found\r\nContent-Length: 0\r\nConnection: close\r\n\r\n")
                await writer.drain()
                writer.close()
                return
            length = int(next(h.split(b":")[1] for h in head.split(b"\r\n") if h.lower().startswith(b"content-length")))
            seen.append(await reader.readexactly(length))
            await release.wait()  # answers only when the test says so
            writer.write(b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\nContent-Length: "
                         + str(len(body)).encode() + b"\r\nConnection: close\r\n\r\n" + body)
            await writer.drain()
            writer.close()

        server = await asyncio.start_server(slow_handler, "127.0.0.1", 0)
        slow = f"http://127.0.0.1:{server.sockets[0].getsockname()[1]}"
        client = RetrievalClient([slow, url], coalesce_window_ms=0, max_retries=0)
        try:
            first = asyncio.create_task(client.search("Ed Wood"))  # round-robin starts at the slow endpoint
            while not seen:
                await asyncio.sleep(0.01)
            rest = [await client.search(q) for q in ["Nicolas Cage", "Scott Derrickson", "Tim Burton", "Ed Wood 2"]]
            in_flight = client.endpoint_stats()[slow]["in_flight"]
            release.set()
            return client, slow, await first, rest, in_flight, len(seen)
        finally:
            server.close()

    try:
        client, slow, first, rest, in_flight, slow_requests = asyncio.run(run())
    finally:
        stop_server_process(proc)
    assert [p.id for p in first] == ["slow"] and in_flight == 1 and slow_requests == 1
    assert all(r and r[0].id != "slow" for r in rest)
    ep = client.endpoint_stats()
    assert ep[slow]["requests"] == 1 and ep[url]["requests"] == 4 and client.stats["failures"] == 0


def test_trace_counts_only_its_own_task():
    """``start_retrieval_trace`` is per asyncio task: two concurrent samples do not see each other's counts."""
    client = RetrievalClient(["http://127.0.0.1:9"], max_retries=0, coalesce_window_ms=0)

    async def sample():
        trace = start_retrieval_trace()
        with pytest.raises(RetrievalError):
            await client.search("x")
        return trace

    async def run():
        return await asyncio.gather(sample(), sample())

    a, b = asyncio.run(run())
    assert a is not b and a.searches == 0 and b.searches == 0 and a.failovers == 0


# ------------------------------------------------------------------ a deadline, not an idle limit
class _Dribbler:
    """An HTTP server that answers POSTs (and GET /health too with ``dribble_get``, else a quick 404) with a valid
    200 JSON body, one byte every ``interval`` seconds: never silent for longer than ``interval``, so httpx's
    inactivity timeouts never fire."""

    BODY = b'{"result": [[]], "status": "ok", "padding": "................................"}'

    def __init__(self, interval: float, dribble_get: bool = True):
        self.interval, self.dribble_get, self.posts = interval, dribble_get, 0

    async def handle(self, reader, writer):
        try:
            head = await reader.readuntil(b"\r\n\r\n")
            if head.startswith(b"GET") and not self.dribble_get:
                writer.write(b"HTTP/1.1 404 Not Found\r\nContent-Length: 0\r\nConnection: close\r\n\r\n")
                await writer.drain()
                return
            self.posts += head.startswith(b"POST")
            writer.write(b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\nContent-Length: %d\r\n\r\n"
                         % len(self.BODY))
            await writer.drain()
            for i in range(len(self.BODY)):
                await asyncio.sleep(self.interval)
                writer.write(self.BODY[i:i + 1])
                await writer.drain()
        except (ConnectionError, asyncio.CancelledError, asyncio.IncompleteReadError):
            pass
        finally:
            writer.close()


def test_a_dribbling_endpoint_is_cut_off_by_the_deadline():
    """A slow server, shortened: timeout_s=1, max_retries=1 against a server sending a byte every 0.3 s. Before
    the fix one search took len(BODY) x 0.3 s = 25 s per attempt (40.6 s measured, then []). Now each
    attempt ends at its 1 s deadline: the search raises RetrievalError within 2 attempts + 0.5 s backoff; the bound
    asserted (6 s) is a generous correctness margin on a loaded machine, not a speed figure. The health check is
    bounded the same way (a dribbled /health, both for the limits look-up and for ``health()``). Mutation caught:
    dropping the wall-clock deadline (the search then outlasts 6 s)."""
    posts, gets = _Dribbler(0.3, dribble_get=False), _Dribbler(0.3, dribble_get=True)

    async def run():
        servers = [await asyncio.start_server(d.handle, "127.0.0.1", 0) for d in (posts, gets)]
        url, health_url = [f"http://127.0.0.1:{s.sockets[0].getsockname()[1]}" for s in servers]
        client = RetrievalClient([url], timeout_s=1.0, max_retries=1, backoff_s=0.5, coalesce_window_ms=0)
        other = RetrievalClient([health_url], timeout_s=1.0, max_retries=0, coalesce_window_ms=0)
        try:
            t0 = time.monotonic()
            with pytest.raises(RetrievalError, match="deadline"):
                await asyncio.wait_for(client.search("Ed Wood"), 60)
            search_s = time.monotonic() - t0
            t0 = time.monotonic()
            healthy = await asyncio.wait_for(other.health(), 60)
            with pytest.raises(RetrievalError, match="deadline"):  # the limits look-up is cut off as well
                await asyncio.wait_for(other.search("Ed Wood"), 60)
            health_s = time.monotonic() - t0
        finally:
            for s in servers:
                s.close()
        return client, url, search_s, healthy, health_url, health_s

    client, url, search_s, healthy, health_url, health_s = asyncio.run(run())
    assert search_s < 6.0, search_s
    assert healthy == {health_url: False} and health_s < 6.0, health_s
    assert posts.posts == 2  # both attempts were POSTs that the dribbler answered too slowly
    assert client.stats["requests"] == 2 and client.stats["failures"] == 2 and client.stats["timeouts"] == 2
    assert client.endpoint_stats()[url]["open"] and client.stats["breaker_opens"] == 1


def test_a_dribbling_endpoint_fails_over_like_a_dead_one(hotpotqa_bm25_index):
    """Two endpoints, the first dribbling: the first request is cut off at its deadline, fails over at once to the
    real server, and the dribbler's breaker keeps it out of rotation; every search is answered."""
    proc, url = start_server_process(hotpotqa_bm25_index)
    dribbler = _Dribbler(0.3)

    async def run():
        server = await asyncio.start_server(dribbler.handle, "127.0.0.1", 0)
        slow = f"http://127.0.0.1:{server.sockets[0].getsockname()[1]}"
        # a 3 s deadline: the dribbler needs about 25 s for its answer, and a loaded machine's real server (a
        # process of its own) can take over 1 s for its first search
        client = RetrievalClient([slow, url], timeout_s=3.0, max_retries=0, coalesce_window_ms=0,
                                 failed_endpoint_cooldown_s=60)
        try:
            t0 = time.monotonic()
            results = [await asyncio.wait_for(client.search(f"Ed Wood {i}"), 60) for i in range(4)]
            return client, slow, results, time.monotonic() - t0
        finally:
            server.close()

    try:
        client, slow, results, wall_s = asyncio.run(run())
        expected = [httpx.post(url + "/retrieve", json={"queries": [f"Ed Wood {i}"], "topk": 3}).json()["result"][0]
                    for i in range(4)]
    finally:
        stop_server_process(proc)
    assert [[p.id for p in r] for r in results] == [[d["id"] for d in e] for e in expected]
    ep = client.endpoint_stats()
    assert ep[slow]["open"] and ep[slow]["requests"] == 1 and ep[slow]["failures"] == 1
    assert client.stats["failovers"] == 1 and client.stats["errors"] == 0 and client.stats["timeouts"] >= 1
    assert wall_s < 15.0, wall_s  # one 3 s deadline, then a live server (a dribbled answer would take ~25 s)


# ------------------------------------------------------------------ a rejected query: the executor's side
def test_a_rejected_query_gets_an_empty_documents_block_and_the_sample_is_kept(qwen_tokenizer):
    """The retriever refuses the policy's first query (a server without per-query errors, 422 for it alone): the
    turn gets the empty documents block, the sample is not marked retrieval_failed (it is the policy's doing), the
    rejection is counted, and the trajectory goes on to a normal search and the answer. Mutation caught: treating
    QueryRejected as a retrieval failure (retrieval_failed 1, reward 0, the rollout cut after turn 1)."""
    tok = qwen_tokenizer
    proto = get_protocol("searchr1")
    prompt = make_prompt(proto, tok, "Who directed Ed Wood?")
    turns = ["<search> BAD query </search>", "<search> Ed Wood director </search>", "<answer> Ed Wood </answer>"]
    engine = ScriptedEngine(tok, proto, {prompt: turns})
    fake = _WholeRequestServer()
    params = SamplingParams(temperature=0.0, logprobs=1, skip_special_tokens=False)

    async def run():
        server = await asyncio.start_server(fake.handle, "127.0.0.1", 0)
        url = f"http://127.0.0.1:{server.sockets[0].getsockname()[1]}"
        cfg = SearchConfig(protocol="searchr1", retriever_urls=[url], reward_scheme="searchr1_em", max_turns=4)
        executor = SearchAgentExecutor(cfg)
        try:
            return await executor.execute(prompt, '["Ed Wood"]', params, 4096, tok, engine)
        finally:
            server.close()

    res = asyncio.run(run())
    logs = res["extra_logs"]
    assert logs["rejected_queries"] == 1.0 and logs["retrieval_failed"] == 0.0 and logs["retrieval_failures"] == 0.0
    assert logs["queries"] == 2.0 and logs["valid_searches"] == 1.0 and res["reward"] == 1.0
    assert len(res["action_ranges"]) == 3
    first_block = res["response_text"].split("</search>", 1)[1]
    assert first_block.startswith(proto.render_documents([]))
