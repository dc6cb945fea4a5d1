"""RetrievalClient against the REAL retriever service (BM25 over HotpotQA dev paragraphs): coalescing, load
spreading over two servers, retry then success, RetrievalError, timeouts, query hygiene."""

import asyncio
import socket

import httpx
import pytest

from openrlhf_search.config import SearchConfig
from openrlhf_search.retrieval_client import RetrievalClient, RetrievalError, passage_from_document
from retriever.launch import start_server_process, stop_server_process

QUERIES = ["Scott Derrickson nationality", "Ed Wood director", "film producer Jerry Bruckheimer",
           "American action heist film", "screenwriter and director", "Nicolas Cage", "Kiss and Tell 1945 film",
           "Shirley Temple ambassador"]


@pytest.fixture(scope="module")
def index_dir(hotpotqa_bm25_index):
    return hotpotqa_bm25_index


@pytest.fixture(scope="module")
def servers(index_dir):
    """Two real retriever processes over the same index."""
    procs = [start_server_process(index_dir) for _ in range(2)]
    yield [url for _, url in procs]
    for proc, _ in procs:
        stop_server_process(proc)


def server_requests(url):
    return httpx.get(url + "/health").json()["stats"]["requests"]


def direct(url, queries, topk=3):
    body = httpx.post(url + "/retrieve", json={"queries": queries, "topk": topk, "return_scores": True}).json()
    return [[passage_from_document(h["document"], h["score"]) for h in hits] for hits in body["result"]]


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_64_concurrent_searches_go_out_as_one_request_with_the_same_results(servers):
    url = servers[0]
    queries = [f"{QUERIES[i % len(QUERIES)]} {i}" for i in range(64)]
    before = server_requests(url)
    client = RetrievalClient([url], topk=3, coalesce_window_ms=20)

    async def run():
        return await asyncio.gather(*(client.search(q) for q in queries))

    results = asyncio.run(run())
    assert server_requests(url) - before == 1
    assert client.stats["requests"] == 1 and client.stats["queries"] == 64 and client.stats["queries_sent"] == 64
    assert results == direct(url, queries)
    assert all(1 <= len(r) <= 3 and r[0].title and r[0].text and r[0].score is not None for r in results)


def test_batches_split_at_max_batch_queries_and_duplicates_sent_once(servers):
    url = servers[0]
    client = RetrievalClient([url], coalesce_window_ms=20, max_batch_queries=16)

    async def run(qs):
        return await asyncio.gather(*(client.search(q) for q in qs))

    asyncio.run(run([f"Ed Wood {i}" for i in range(64)]))
    assert client.stats["requests"] == 4
    before = dict(client.stats)
    same = asyncio.run(run(["Nicolas Cage"] * 10))
    assert client.stats["requests"] - before["requests"] == 1
    assert client.stats["queries_sent"] - before["queries_sent"] == 1
    assert all(r == same[0] for r in same) and same[0]


def test_no_coalescing_window_still_answers_each_call(servers):
    client = RetrievalClient([servers[0]], coalesce_window_ms=0)

    async def run():
        out = []
        for q in QUERIES[:3]:  # sequential awaits: nothing to coalesce
            out.append(await client.search(q))
        return out

    assert asyncio.run(run()) == direct(servers[0], QUERIES[:3])
    assert client.stats["requests"] == 3


def test_load_is_spread_round_robin_over_two_servers(servers):
    before = [server_requests(u) for u in servers]
    client = RetrievalClient(servers, coalesce_window_ms=0)

    async def run():
        for q in QUERIES:
            await client.search(q)

    asyncio.run(run())
    delta = [server_requests(u) - b for u, b in zip(servers, before)]
    assert delta == [4, 4]


def test_dead_endpoint_is_retried_elsewhere_then_skipped(servers):
    dead = f"http://127.0.0.1:{free_port()}"
    client = RetrievalClient([dead, servers[1]], backoff_s=0.01, coalesce_window_ms=0,
                             failed_endpoint_cooldown_s=60)

    async def run():
        return [await client.search(q) for q in QUERIES[:4]]

    results = asyncio.run(run())
    assert results == direct(servers[1], QUERIES[:4])
    # the first request hit the dead server and failed over at once (no backoff retry) to the live one; its
    # breaker opened, so later requests skip the dead server
    assert client.stats["failures"] == 1 and client.stats["failovers"] == 1 and client.stats["retries"] == 0
    assert client.stats["requests"] == 5 and client.stats["breaker_opens"] == 1
    assert client.endpoint_stats()[dead]["open"] and client.endpoint_stats()[dead]["requests"] == 1


def test_retry_with_backoff_until_a_restarted_server_answers(index_dir):
    proc, url = start_server_process(index_dir)
    port = int(url.rsplit(":", 1)[1])
    stop_server_process(proc)
    client = RetrievalClient([url], backoff_s=0.4, max_retries=8, coalesce_window_ms=0)

    async def run():
        task = asyncio.create_task(client.search("Ed Wood director"))
        await asyncio.sleep(0.2)  # the first attempts fail while the server is down
        new_proc, _ = await asyncio.to_thread(start_server_process, index_dir, port)
        try:
            return await task, new_proc
        except BaseException:
            stop_server_process(new_proc)
            raise

    passages, new_proc = asyncio.run(run())
    try:
        assert passages == direct(url, ["Ed Wood director"])[0]
        assert client.stats["failures"] >= 1 and client.stats["retries"] >= 1 and client.stats["errors"] == 0
    finally:
        stop_server_process(new_proc)


def test_retrieval_error_after_the_retry_budget_for_every_waiter():
    dead = f"http://127.0.0.1:{free_port()}"
    client = RetrievalClient([dead], max_retries=2, backoff_s=0.01, coalesce_window_ms=5)

    async def run():
        return await asyncio.gather(*(client.search(f"q{i}") for i in range(5)), return_exceptions=True)

    results = asyncio.run(run())
    assert all(isinstance(r, RetrievalError) for r in results)
    assert client.stats["requests"] == 3 and client.stats["errors"] == 1


def test_timeout_of_a_server_that_never_answers():
    async def run():
        async def hang(reader, writer):
            await asyncio.sleep(30)

        server = await asyncio.start_server(hang, "127.0.0.1", 0)
        port = server.sockets[0].getsockname()[1]
        client = RetrievalClient([f"http://127.0.0.1:{port}"], timeout_s=0.2, max_retries=1, backoff_s=0.01)
        try:
            with pytest.raises(RetrievalError, match="unavailable"):
                await client.search("anything")
        finally:
            server.close()
        return client

    client = asyncio.run(run())
    assert client.stats["requests"] == 2 and client.stats["failures"] == 2


def test_client_errors_are_not_retried(servers):
    client = RetrievalClient([servers[0]], max_retries=4, backoff_s=0.01)
    with pytest.raises(RetrievalError, match="422"):
        asyncio.run(client.search("Ed Wood", topk=10_000))  # beyond the server's max_topk
    assert client.stats["requests"] == 1 and client.stats["retries"] == 0


def test_empty_queries_never_sent_and_long_queries_cut(servers):
    client = RetrievalClient([servers[0]], max_query_chars=200)

    async def run():
        return await client.search("   \n "), await client.search(""), await client.search("Ed Wood " * 2000)

    empty1, empty2, long = asyncio.run(run())
    assert empty1 == [] and empty2 == [] and long
    assert long == direct(servers[0], [" ".join(("Ed Wood " * 2000).split())[:200]])[0]
    assert client.stats["requests"] == 1 and client.stats["empty_queries"] == 2
    assert client.stats["truncated_queries"] == 1


def test_from_config_and_use_across_event_loops(servers):
    cfg = SearchConfig(retriever_urls=list(servers), topk=2, retrieval_max_retries=1, coalesce_window_ms=1)
    client = RetrievalClient.from_config(cfg)
    assert client.urls == servers and client.topk == 2 and client.max_retries == 1
    for _ in range(2):  # a fresh loop per call (asyncio.run) must work, as in the local trainer
        assert len(asyncio.run(client.search("Nicolas Cage"))) == 2


def test_passage_parsing_of_both_document_forms():
    p = passage_from_document({"id": 7, "contents": '"Ed Wood"\nEdward Davis Wood Jr. was a filmmaker.'}, 1.5)
    assert (p.id, p.title, p.text, p.score) == ("7", "Ed Wood", "Edward Davis Wood Jr. was a filmmaker.", 1.5)
    p = passage_from_document({"id": "x", "title": "T", "text": "body", "contents": "ignored"})
    assert (p.title, p.text, p.score) == ("T", "body", None)
    with pytest.raises(ValueError):
        passage_from_document({"id": "x"})
