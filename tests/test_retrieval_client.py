"""RetrievalClient against the REAL retriever service (BM25 over HotpotQA dev paragraphs): coalescing, load
spreading over two servers, retry then success, RetrievalError, timeouts, query hygiene, and a rejected query
failing alone."""

import asyncio
import json
import socket

import httpx
import pytest

from openrlhf_search.env.config import SearchConfig
from openrlhf_search.env.retrieval_client import QueryRejected, RetrievalClient, RetrievalError
from openrlhf_search.env.retrieval_schema import passage_from_document
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


# ------------------------------------------------------------------ a rejected query fails alone
LONG = "Ed Wood " + "x" * 492  # 500 characters, over the server's 200


@pytest.fixture(scope="module")
def limited_server(index_dir):
    """A real retriever that accepts at most 200 characters per query and 4 queries per request."""
    proc, url = start_server_process(index_dir, extra_args=["--max_query_chars", "200", "--max_queries", "4"])
    yield url
    stop_server_process(proc)


def _search_all(client, queries, **kw):
    async def run():
        return await asyncio.gather(*(client.search(q, **kw) for q in queries), return_exceptions=True)
    return asyncio.run(run())


def test_one_overlong_query_does_not_fail_the_seven_coalesced_with_it(limited_server):
    """Server --max_query_chars 200, client default 1,000, 7 ordinary questions and one of 500
    characters searched together. Before the fix all 8 raised RetrievalError from one 413; now the client reads the
    server's limits from /health, cuts the long query to 200 characters and splits at its 4 queries per request.
    Mutations caught: ignoring the advertised limits (413/422 for the whole batch), failing every waiter of a batch."""
    client = RetrievalClient([limited_server], coalesce_window_ms=20)
    assert client.max_query_chars == 1000
    queries = QUERIES[:7] + [LONG]
    results = _search_all(client, queries)
    assert not [r for r in results if isinstance(r, BaseException)], results
    assert results[:7] == [direct(limited_server, [q])[0] for q in QUERIES[:7]]
    assert results[7] == direct(limited_server, [LONG[:200]])[0] and results[7]
    assert client.stats["server_cut_queries"] == 1 and client.stats["requests"] == 2  # 8 queries at 4 per request
    assert client.stats["rejected_requests"] == 0 and client.stats["errors"] == 0


def test_a_query_the_server_refuses_fails_alone_with_per_query_errors(limited_server):
    """With the client's cut switched off the real server still sees the 500-character query: in its per-query
    mode it refuses that query only (an error of its own in the 200 answer); the others get their passages and
    nothing counts against the endpoint. Mutation caught: treating a per-query error as the request's."""
    client = RetrievalClient([limited_server], coalesce_window_ms=20)
    client._fit = lambda endpoint, queries: queries  # send the query whole
    results = _search_all(client, QUERIES[:3] + [LONG])
    assert results[:3] == [direct(limited_server, [q])[0] for q in QUERIES[:3]]
    assert isinstance(results[3], QueryRejected) and "500 characters > 200" in str(results[3])
    assert client.stats["rejected_queries"] == 1 and client.stats["failures"] == 0
    assert client.stats["breaker_opens"] == 0 and client.stats["failovers"] == 0


def test_server_per_query_mode_and_whole_request_faults(limited_server):
    body = {"queries": ["Ed Wood", "x" * 201, "  ", "Nicolas Cage"], "topk": 2, "return_scores": True,
            "per_query_errors": True}
    r = httpx.post(limited_server + "/retrieve", json=body)
    assert r.status_code == 200
    out = r.json()
    assert out["errors"][0] is None and out["errors"][3] is None
    assert "201 characters > 200" in out["errors"][1] and "empty" in out["errors"][2]
    assert out["result"][1] == [] and out["result"][2] == [] and len(out["result"][0]) == 2
    # without the flag the server answers as before (Search-R1's schema: one bad query rejects the request)
    assert httpx.post(limited_server + "/retrieve", json={"queries": ["ok", "x" * 201]}).status_code == 413
    # request-level faults still reject the whole request in per-query mode
    assert httpx.post(limited_server + "/retrieve", json={**body, "queries": ["q"] * 5}).status_code == 422
    assert httpx.post(limited_server + "/retrieve", json={**body, "topk": 0}).status_code == 422
    health = httpx.get(limited_server + "/health").json()
    assert health["per_query_errors"] is True and health["limits"]["max_query_chars"] == 200


def test_a_request_level_4xx_is_not_a_dead_endpoint(limited_server, servers):
    """topk above the server's maximum is the request's fault (a configuration error): every query of it raises
    RetrievalError, but the endpoint stays in rotation and nothing fails over to the other one."""
    client = RetrievalClient([limited_server, servers[0]], coalesce_window_ms=20, max_retries=3, backoff_s=0.01)
    client._next_endpoint = 0
    results = _search_all(client, QUERIES[:2], topk=10_000)
    assert all(isinstance(r, RetrievalError) and not isinstance(r, QueryRejected) for r in results)
    assert "refused the request" in str(results[0]) and "topk" in str(results[0])
    assert client.stats["failovers"] == 0 and client.stats["retries"] == 0 and client.stats["breaker_opens"] == 0
    assert not any(e["open"] for e in client.endpoint_stats().values())
    again = _search_all(client, QUERIES[:4])  # and both keep serving
    assert all(isinstance(r, list) and r for r in again), again


def test_lone_surrogate_is_replaced_not_sent(servers):
    """A query with a lone surrogate got a 422 for its whole request; it is now sent with the character replaced."""
    client = RetrievalClient([servers[0]])
    [result] = _search_all(client, ["Ed Wood \ud800 director"])
    assert result == direct(servers[0], ["Ed Wood ? director"])[0]
    assert client.stats["sanitized_queries"] == 1


class _WholeRequestServer:
    """A retriever without per-query errors and without /health (as Search-R1's retrieval_server.py): a request
    holding a query of more than 200 characters gets a 413, one holding "BAD" a 422, for the whole request."""

    def __init__(self):
        self.posts = []

    async def handle(self, reader, writer):
        try:
            head = await reader.readuntil(b"\r\n\r\n")
            if head.startswith(b"GET"):
                status, body = 404, {"detail": "Not Found"}
            else:
                length = int(next(line.split(b":")[1] for line in head.split(b"\r\n")
                                  if line.lower().startswith(b"content-length")))
                queries = json.loads(await reader.readexactly(length))["queries"]
                self.posts.append(queries)
                if any(len(q) > 200 for q in queries):
                    status, body = 413, {"detail": "query too long"}
                elif any("BAD" in q for q in queries):
                    status, body = 422, {"detail": "bad query"}
                else:
                    status, body = 200, {"result": [[{"id": q, "title": "T", "text": q}] for q in queries]}
            data = json.dumps(body).encode()
            writer.write(b"HTTP/1.1 %d X\r\nContent-Type: application/json\r\nContent-Length: %d\r\n"
                         b"Connection: close\r\n\r\n" % (status, len(data)) + data)
            await writer.drain()
        finally:
            writer.close()


def test_server_without_per_query_errors_halves_until_the_bad_query_is_alone():
    """A 4xx for a whole coalesced request from a server that cannot say which query was bad: the batch is
    re-sent in halves until the rejected queries are alone. 8 queries, 2 bad: 6 answered, 2 QueryRejected, the
    endpoint never opened. Mutation caught: failing the whole batch on a 4xx (old behaviour)."""
    fake = _WholeRequestServer()

    async def run():
        server = await asyncio.start_server(fake.handle, "127.0.0.1", 0)
        url = f"http://127.0.0.1:{server.sockets[0].getsockname()[1]}"
        client = RetrievalClient([url], coalesce_window_ms=20, max_query_chars=1000)
        try:
            queries = [f"good {i}" for i in range(6)] + ["BAD query", "y" * 300]
            return client, queries, await asyncio.gather(*(client.search(q) for q in queries),
                                                         return_exceptions=True)
        finally:
            server.close()

    client, queries, results = asyncio.run(run())
    assert [r[0].text for r in results[:6]] == queries[:6]
    assert all(isinstance(r, QueryRejected) for r in results[6:])
    assert "422" in str(results[6]) and "413" in str(results[7])
    assert [len(p) for p in fake.posts][:1] == [8] and [q for p in fake.posts if len(p) == 1 for q in p] == \
        ["BAD query", "y" * 300]
    assert client.stats["rejected_queries"] == 2 and client.stats["failures"] == 0
    assert not client.endpoint_stats()[client.urls[0]]["open"]
