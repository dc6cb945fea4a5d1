"""The searchers behind the retrieval service's endpoints (:mod:`retriever.server`): each takes the queries of one
request and answers per query its passages, without blocking the event loop (one worker thread runs the index).

- ``MicroBatcher``: requests that queue while the previous batch is being searched are encoded and searched as one
  batch; a request that finds the server idle goes at once;
- ``PerRequestSearcher``: each request searched on its own (``--no_batching``, the benchmark's baseline);
- ``ConcurrentSearcher``: a web backend, whose queries are searched one by one, concurrently.
"""

import asyncio
import logging
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field

from .errors import BackendError

logger = logging.getLogger("retriever.server")  # the service's log, whichever module writes it


@dataclass
class _Pending:
    queries: list[str]
    topk: int
    future: asyncio.Future


@dataclass
class BatcherStats:
    requests: int = 0
    queries: int = 0
    batches: int = 0
    errors: int = 0
    max_batch_queries_seen: int = 0
    waits: int = 0  # batches that waited for more requests before going out
    busy_seconds: float = 0.0
    started_at: float = field(default_factory=time.time)


class MicroBatcher:
    """Coalesces concurrent ``search`` calls into one ``index.search`` per (batch, topk).

    A batch takes every request queued when the worker is free (those that arrived while the previous batch
    was searched), up to ``max_batch_queries`` queries. The number of clients in a loop is estimated as the
    previous batch's queries plus those that queued while it ran (clients wait for their answer before sending
    again). When the batch already holds that many, it goes out at once: a lone client (estimate 1) never
    waits, so at 1 client the server is as fast as with micro-batching off. When fewer have arrived, the missing
    clients are likely about to send their next request, so the batch waits for them up to ``max(window_ms,
    min(max_wait_ms, half the previous batch's compute time))``, and once it is complete still takes what
    arrives within ``window_ms`` of its start: with many clients in a loop this keeps batches full instead of
    alternating full and tiny ones. Searches run on one worker thread: encoders and faiss are multi-threaded
    already, and one thread keeps the encoder free of concurrent use.

    Args:
        index: anything with ``search(queries, topk) -> list (per query) of passage dicts``.
        window_ms: shortest wait for company when a batch holds fewer queries than the estimate.
        max_batch_queries: most queries per ``index.search`` call.
        max_wait_ms: longest wait for company.
    """

    def __init__(self, index, window_ms: float = 2.0, max_batch_queries: int = 512, max_wait_ms: float = 50.0):
        self.index = index
        self.window_s = window_ms / 1000.0
        self.max_wait_s = max_wait_ms / 1000.0
        self._last_busy_s = 0.0
        self.max_batch_queries = max_batch_queries
        self.stats = BatcherStats()
        self._queue: asyncio.Queue | None = None
        self._queued_queries = 0  # queries waiting in the queue
        self._task: asyncio.Task | None = None
        self._executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="retriever-search")

    async def start(self) -> None:
        self._queue = asyncio.Queue()
        self._task = asyncio.create_task(self._run(), name="retriever-batcher")

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            try:
                await self._task
            except asyncio.CancelledError:
                pass
        self._executor.shutdown(wait=True, cancel_futures=True)

    async def search(self, queries: list[str], topk: int) -> list[list[dict]]:
        """Top-``topk`` passages per query (list per query of passage dicts with ``score``)."""
        fut = asyncio.get_running_loop().create_future()
        self.stats.requests += 1
        self.stats.queries += len(queries)
        self._queued_queries += len(queries)
        await self._queue.put(_Pending(queries, topk, fut))
        return await fut

    async def _run(self) -> None:
        loop = asyncio.get_running_loop()
        # queries the previous batch held plus those that queued while it ran (clients wait for their answer
        # before sending again, so these came from other clients): about how many clients are in the loop
        expected = 1
        while True:
            first = await self._queue.get()
            self._queued_queries -= len(first.queries)
            batch, n = [first], len(first.queries)
            # Everything already queued joins. As many as last time and nobody seen on the way (a lone
            # client: 1): go now, waiting would only add latency. Fewer than last time: the previous batch's
            # clients are likely about to send their next request, so wait up to half a batch's compute time
            # (capped by max_wait) for them rather than run a small batch and make them queue behind it; once
            # requests are streaming in, stragglers within the window still join.
            now = loop.time()
            deadline = now + self.window_s
            stretched = now + max(self.window_s, min(self.max_wait_s, 0.5 * self._last_busy_s))
            waited = False
            while n < self.max_batch_queries:
                try:
                    item = self._queue.get_nowait()
                except asyncio.QueueEmpty:
                    if n >= expected and not waited:
                        break
                    timeout = (stretched if n < expected else deadline) - loop.time()
                    if timeout <= 0:
                        break
                    waited = True
                    try:
                        item = await asyncio.wait_for(self._queue.get(), timeout)
                    except asyncio.TimeoutError:
                        break
                self._queued_queries -= len(item.queries)
                batch.append(item)
                n += len(item.queries)
            self.stats.waits += waited
            t0 = loop.time()
            await self._execute(batch)
            self._last_busy_s = loop.time() - t0
            # everything queued now came from clients not in this batch (with several topk groups in one batch,
            # clients of the first group may already be back: an overestimate costs at most one stretched wait)
            expected = min(self.max_batch_queries, n + self._queued_queries)

    async def _execute(self, batch: list[_Pending]) -> None:
        loop = asyncio.get_running_loop()
        by_topk: dict[int, list[_Pending]] = {}
        for p in batch:
            if not p.future.cancelled():  # client went away while queued
                by_topk.setdefault(p.topk, []).append(p)
        for topk, group in by_topk.items():
            queries = [q for p in group for q in p.queries]
            t0 = time.perf_counter()
            try:
                results = await loop.run_in_executor(self._executor, self.index.search, queries, topk)
            except Exception as e:  # one bad batch must not kill the batcher
                _log_search_failure(e, "batch", len(queries))
                self.stats.errors += 1
                for p in group:
                    if not p.future.done():
                        p.future.set_exception(e)
                continue
            finally:
                self.stats.busy_seconds += time.perf_counter() - t0
            self.stats.batches += 1
            self.stats.max_batch_queries_seen = max(self.stats.max_batch_queries_seen, len(queries))
            i = 0
            for p in group:
                part = results[i:i + len(p.queries)]
                i += len(p.queries)
                if not p.future.done():
                    p.future.set_result(part)


class PerRequestSearcher:
    """Micro-batching off (``--no_batching``): every request is its own ``index.search`` call, in arrival order,
    on one worker thread, as a per-request retrieval server (Search-R1's ``retrieval_server.py`` searches each
    request's queries in its handler). Same interface and stats as ``MicroBatcher`` (a batch = a request), so the
    two modes of one server can be measured against each other.
    """

    def __init__(self, index):
        self.index = index
        self.stats = BatcherStats()
        self._executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="retriever-search")

    async def start(self) -> None:
        pass

    async def stop(self) -> None:
        self._executor.shutdown(wait=True, cancel_futures=True)

    def _timed_search(self, queries: list[str], topk: int) -> list[list[dict]]:
        t0 = time.perf_counter()
        try:
            return self.index.search(queries, topk)
        finally:
            self.stats.busy_seconds += time.perf_counter() - t0

    async def search(self, queries: list[str], topk: int) -> list[list[dict]]:
        """Top-``topk`` passages per query (list per query of passage dicts with ``score``); the index's
        exception when its search fails."""
        self.stats.requests += 1
        self.stats.queries += len(queries)
        try:
            results = await asyncio.get_running_loop().run_in_executor(self._executor, self._timed_search,
                                                                       queries, topk)
        except Exception as e:
            _log_search_failure(e, "request", len(queries))
            self.stats.errors += 1
            raise
        self.stats.batches += 1
        self.stats.max_batch_queries_seen = max(self.stats.max_batch_queries_seen, len(queries))
        return results


class ConcurrentSearcher:
    """For an index whose queries are independent and I/O-bound (the web backend, ``independent_queries``): every
    request goes to ``index.submit`` at once, and each of its queries is searched on its own, so one query in
    back-off or failing never holds or fails another request's (nor another query of its own request: the result
    is, per query, its passages or its :class:`BackendError`). Same interface and stats as ``MicroBatcher``."""

    def __init__(self, index):
        self.index = index
        self.stats = BatcherStats()

    async def start(self) -> None:
        pass

    async def stop(self) -> None:
        pass

    async def search(self, queries: list[str], topk: int) -> list:
        self.stats.requests += 1
        self.stats.queries += len(queries)
        t0 = time.perf_counter()
        try:
            results = await asyncio.wrap_future(self.index.submit(queries, topk))
        finally:
            self.stats.busy_seconds += time.perf_counter() - t0
        self.stats.batches += 1
        self.stats.errors += sum(isinstance(r, BackendError) for r in results)
        self.stats.max_batch_queries_seen = max(self.stats.max_batch_queries_seen, len(queries))
        return results


def _log_search_failure(e: Exception, what: str, n: int) -> None:
    if isinstance(e, BackendError):  # already explained in one line (a provider outage, a refused key)
        logger.warning("search failed for a %s of %d queries: %s", what, n, e)
    else:
        logger.exception("search failed for a %s of %d queries", what, n)
