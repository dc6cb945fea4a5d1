"""The server's micro-batcher in isolation: results routed back to the right request, grouping by topk,
a failing batch fails only its own requests, and concurrent callers share batches."""

import asyncio
import threading
import time

import pytest

from retriever.searchers import MicroBatcher, PerRequestSearcher


class RecordingIndex:
    """Echo index: passage ids encode (query, rank); records batches and the thread they ran on."""

    def __init__(self, cost_s=0.01, fail_on=None):
        self.calls = []
        self.cost_s = cost_s
        self.fail_on = fail_on

    def search(self, queries, topk):
        self.calls.append((list(queries), topk, threading.current_thread().name))
        if self.fail_on is not None and self.fail_on in queries:
            raise RuntimeError("encoder blew up")
        time.sleep(self.cost_s)
        return [[{"id": f"{q}#{r}", "score": float(-r)} for r in range(topk)] for q in queries]


def test_results_routed_per_request_and_grouped_by_topk():
    index = RecordingIndex()

    async def run():
        b = MicroBatcher(index, window_ms=20)
        await b.start()
        try:
            reqs = [([f"q{i}a", f"q{i}b"] if i % 3 == 0 else [f"q{i}"], 1 + i % 2) for i in range(24)]
            outs = await asyncio.gather(*[b.search(q, k) for q, k in reqs])
            return b, reqs, outs
        finally:
            await b.stop()

    b, reqs, outs = asyncio.run(run())
    for (queries, k), out in zip(reqs, outs):
        assert [[h["id"] for h in hits] for hits in out] == [[f"{q}#{r}" for r in range(k)] for q in queries]
    for queries, topk, thread in index.calls:
        assert thread.startswith("retriever-search")  # never on the event loop's thread
    assert {topk for _, topk, _ in index.calls} == {1, 2}
    assert len(index.calls) < 24  # 24 concurrent requests shared batches
    assert b.stats.requests == 24 and b.stats.queries == sum(len(q) for q, _ in reqs)


def test_failing_batch_fails_only_its_requests_and_batcher_survives():
    index = RecordingIndex(fail_on="boom")

    async def run():
        b = MicroBatcher(index, window_ms=1)
        await b.start()
        try:
            with pytest.raises(RuntimeError, match="blew up"):
                await b.search(["boom"], 3)
            ok = await b.search(["fine"], 2)  # the next request is served
            return b, ok
        finally:
            await b.stop()

    b, ok = asyncio.run(run())
    assert [h["id"] for h in ok[0]] == ["fine#0", "fine#1"]
    assert b.stats.errors == 1


def test_clients_in_a_loop_get_full_batches():
    """16 clients each sending the next query a few ms after the previous answer arrives: the window
    stretches while the batch refills, so batches hold all 16 clients. With a fixed 2 ms window the same
    run alternates 4- and 16-query batches ([4, 16, 4, 16, 4, 16, 3, 9, 3, 9, 3, 9]: 12 batches)."""
    index = RecordingIndex(cost_s=0.1)

    async def run():
        b = MicroBatcher(index, window_ms=2, max_wait_ms=50)
        await b.start()

        async def client(i):
            for r in range(6):
                await asyncio.sleep(0.004 * (i % 5))  # clients come back 0-16 ms apart
                out = await b.search([f"c{i}r{r}"], 1)
                assert out[0][0]["id"] == f"c{i}r{r}#0"

        try:
            await asyncio.gather(*[client(i) for i in range(16)])
        finally:
            await b.stop()

    asyncio.run(run())
    sizes = [len(q) for q, _, _ in index.calls]
    assert sum(sizes) == 96
    assert len(sizes) <= 9, sizes  # 6 rounds of 16: about one batch per round


def test_a_lone_client_never_waits_for_company():
    """At 1 client the batcher must add no wait (the old code waited the whole window before every
    request, so 1-client latency was worse than with micro-batching off). ``stats.waits`` counts batches that
    waited for more requests; a burst afterwards still waits to fill its batches."""
    index = RecordingIndex(cost_s=0.01)

    async def run():
        b = MicroBatcher(index, window_ms=50, max_wait_ms=50)
        await b.start()
        try:
            for r in range(12):  # one client, one request after another
                out = await b.search([f"solo{r}"], 1)
                assert out[0][0]["id"] == f"solo{r}#0"
            solo_waits = b.stats.waits

            async def client(i):
                for r in range(3):
                    await asyncio.sleep(0.002 * (i % 3))
                    await b.search([f"c{i}r{r}"], 1)

            await asyncio.gather(*[client(i) for i in range(8)])
            return b, solo_waits
        finally:
            await b.stop()

    b, solo_waits = asyncio.run(run())
    assert solo_waits == 0
    assert [len(q) for q, _, _ in index.calls[:12]] == [1] * 12
    assert b.stats.waits >= 1  # clients in a loop: later batches wait for the ones still to come back
    assert len(index.calls) - 12 < 24  # and the 24 burst requests shared batches


def test_batching_off_searches_each_request_on_its_own():
    index = RecordingIndex(fail_on="boom")

    async def run():
        s = PerRequestSearcher(index)
        await s.start()
        try:
            reqs = [([f"q{i}a", f"q{i}b"] if i % 3 == 0 else [f"q{i}"], 1 + i % 2) for i in range(12)]
            outs = await asyncio.gather(*[s.search(q, k) for q, k in reqs])
            with pytest.raises(RuntimeError, match="blew up"):
                await s.search(["boom"], 1)
            return s, reqs, outs
        finally:
            await s.stop()

    s, reqs, outs = asyncio.run(run())
    for (queries, k), out in zip(reqs, outs):
        assert [[h["id"] for h in hits] for hits in out] == [[f"{q}#{r}" for r in range(k)] for q in queries]
    assert sorted((tuple(q), k) for q, k, _ in index.calls[:12]) == sorted((tuple(q), k) for q, k in reqs)
    assert all(thread.startswith("retriever-search") for _, _, thread in index.calls)
    assert s.stats.requests == 13 and s.stats.batches == 12 and s.stats.errors == 1
    assert s.stats.max_batch_queries_seen == 2
