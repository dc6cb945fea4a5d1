"""Retriever failover (issue 10 item 8): several endpoints are one service. A dead or unhealthy endpoint is routed
around (circuit breaker), re-admitted after a passing ``GET /health`` probe, and a request that fails on one endpoint
is re-sent at once to another, so a rollout loses no sample when one of four real retrievers is killed mid-rollout."""

import asyncio
import logging
import signal
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest
from vllm import SamplingParams

from openrlhf_search.agent import SearchAgentExecutor
from openrlhf_search.config import SearchConfig
from openrlhf_search.local.engine import HFEngine
from openrlhf_search.protocol import get_protocol
from openrlhf_search.retrieval_client import RetrievalClient, RetrievalError, start_retrieval_trace
from retriever.launch import start_server_process, stop_server_process
from tests.test_agent import ScriptedLM, make_prompt

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
    engine = HFEngine(ScriptedLM(tok, proto, {p: turns for p in prompts}), tok, max_batch_size=1)
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

    with caplog.at_level(logging.INFO, logger="openrlhf_search.retrieval_client"):
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
            length = int(next(l.split(b":")[1] for l in head.split(b"\r\n") if l.lower().startswith(b"content-length")))
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
