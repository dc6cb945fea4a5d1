"""Async, batched HTTP client of the retriever service (``POST /retrieve``, Search-R1's schema).

Request and response schemas: ``docs/design.md``, "Retriever schemas".

Rollouts run one asyncio task per sample, each asking for passages one query at a time. ``RetrievalClient`` gives
each sample its own ``await search(query)`` and still sends few requests: calls that arrive within
``coalesce_window_ms`` of each other go out as one ``POST /retrieve`` (split at ``max_batch_queries``, identical
queries sent once), where R1-Searcher and Search-R1 batch per turn and make every sample wait for the slowest.

Several endpoints (``--search.retriever_urls``) serve as one: least-in-flight routing (ties round-robin); a circuit
breaker per endpoint, opened by ``breaker_failures`` consecutive failed requests (refused or reset connection,
timeout, 5xx, malformed answer) for a cooldown doubled on each failed re-admission, closed again by one
``GET /health`` probe; immediate failover to an untried healthy endpoint (outside the retry budget), then
``max_retries`` backoff retries, after which every waiting ``search`` raises ``RetrievalError``. ``timeout_s`` and
``health_timeout_s`` are wall-clock deadlines (httpx's own timeouts only bound the silence between two reads), so one
``search`` ends within about ``(len(urls) + max_retries) * timeout_s`` plus the backoffs.

A query the server rejects fails alone: the limits an endpoint advertises on ``GET /health`` are applied before
sending; requests ask for per-query errors (only that query's ``search`` raises :class:`QueryRejected`); a server
without them that answers a 4xx (or any 413) gets the batch again in halves until the rejected query is alone. A 4xx
never opens a breaker, fails over or retries; one about the request itself (a topk above the server's maximum) fails
every query of it with ``RetrievalError``. A 503 / 429 with ``Retry-After`` waits at least that long (at most
``max_retry_after_s``); a query a web retriever lists as ``"unavailable"`` is sent again alone after the backoff.
An answer with ``"stop_run": true`` (a web retriever whose key or budget is spent) raises :class:`RetrievalStopped`
for every query of its request, which the executor does not absorb: the run stops with that line.

``stats`` counts all of this (with a web retriever's calls, cache hits and skips); :func:`start_retrieval_trace`
gives a rollout per-sample counts (the executor writes them to ``extra_logs``).
"""

import asyncio
import contextvars
import logging
import time
import weakref
from dataclasses import dataclass, field
from typing import Dict, List, Optional, Set

import httpx

from openrlhf_search.env.retrieval_schema import (QueryRejected, QueryUnavailable, RetrievalError, RetrievalStopped,
                                                  parse_retrieve_answer, retry_after_seconds, stop_message)
from openrlhf_search.env.types import Passage

logger = logging.getLogger(__name__)


class _BadRequest(Exception):
    """The server rejected the payload (HTTP 4xx other than 408/429): retrying cannot help."""

    def __init__(self, message: str, status: int):
        super().__init__(message)
        self.status = status


class _Split(Exception):
    """Internal: send this batch as parts of at most ``size`` queries (an endpoint's limit, or halving a batch
    that a server without per-query errors rejected)."""

    def __init__(self, size: int):
        super().__init__(size)
        self.size = max(1, size)


@dataclass
class RetrievalTrace:
    """Per-sample retrieval counters (see :func:`start_retrieval_trace`).

    Attributes:
        searches: ``search`` calls answered for this sample.
        failovers: of the requests that carried this sample's queries, how many times one was sent again to
            another endpoint after a failure (0 when every request succeeded at once).
    """

    searches: int = 0
    failovers: int = 0


_TRACE: contextvars.ContextVar = contextvars.ContextVar("openrlhf_search_retrieval_trace", default=None)


def start_retrieval_trace() -> RetrievalTrace:
    """Start counting this asyncio task's retrievals (one rollout runs as one task); returns the counters, which
    every later ``RetrievalClient.search`` awaited in this task (and tasks it starts) updates. A new call replaces
    the previous trace of the task."""
    trace = RetrievalTrace()
    _TRACE.set(trace)
    return trace


@dataclass
class _Pending:
    query: str
    topk: int
    future: asyncio.Future
    failovers: int = 0


@dataclass
class _Endpoint:
    """Circuit-breaker state of one retriever URL (shared by every event loop using the client)."""

    url: str
    consecutive_failures: int = 0
    open: bool = False
    open_until: float = 0.0        # time.monotonic() when the next health probe may run
    cooldown_s: float = 0.0        # current open period; doubles on each failed re-admission
    probe: Optional[asyncio.Task] = None   # the GET /health probe in flight, if any

    @property
    def probing(self) -> bool:
        return self.probe is not None and not self.probe.done() and not self.probe.get_loop().is_closed()
    in_flight: int = 0
    requests: int = 0
    failures: int = 0
    limits: Optional[dict] = None  # what GET /health advertised ({} when nothing); None until read
    per_query_errors: bool = False  # the server answers a bad query with its own error (our server's mode)


@dataclass
class _LoopState:
    """Per-event-loop state: the HTTP client and the coalescing queue belong to one loop."""

    client: httpx.AsyncClient
    pending: List[_Pending] = field(default_factory=list)
    probes: set = field(default_factory=set)
    flush_handle: Optional[asyncio.TimerHandle] = None
    tasks: set = field(default_factory=set)
    limit_reads: Dict[str, asyncio.Task] = field(default_factory=dict)  # url -> GET /health in flight


class RetrievalClient:
    """Coalescing, load-spreading, failing-over client of one or more retriever services.

    Args:
        urls: base URLs (``http://host:port``); ``/retrieve`` is appended.
        topk: default passages per query.
        timeout_s: deadline of one request attempt, seconds of wall time from sending to the parsed answer (and
            httpx's inactivity timeout inside it).
        max_retries: retries after a backoff, once a failed request has no healthy endpoint left that it has not
            tried. Failing over to an untried healthy endpoint is immediate and does not count: with four endpoints
            and ``max_retries=0`` a request survives three of them failing.
        backoff_s: delay before a retry that finds no untried healthy endpoint, seconds; doubled on each such retry.
        coalesce_window_ms: how long the first pending query waits for others before the request goes out, ms.
            0 still coalesces the calls made in the same event-loop iteration.
        max_batch_queries: most queries in one request; a larger batch is split.
        max_query_chars: queries are cut to this many characters (a runaway query must not reach the server whole);
            an endpoint that advertises a smaller ``limits.max_query_chars`` on ``/health`` gets them cut to that.
        failed_endpoint_cooldown_s: how long an endpoint whose breaker opened gets no request before its health is
            checked, seconds (default ``max(1, 4 * backoff_s)``); doubled after each failed check.
        breaker_failures: consecutive failed requests that open an endpoint's breaker (default 1: a refused
            connection or a timeout is rarely a one-off).
        max_cooldown_s: cap on the doubled cooldown, seconds.
        health_timeout_s: deadline of one ``GET /health`` (probe or limits look-up), seconds of wall time (default
            ``min(timeout_s, 5)``).
        max_retry_after_s: longest Retry-After (of a 503 / 429 answer, or of a query the server marks unavailable)
            waited before a retry, seconds; a server asking for longer fails those queries at once.

    Attributes:
        stats: counters ``requests`` (HTTP attempts), ``queries`` (search calls), ``queries_sent`` (queries in
            request bodies after de-duplication), ``failures`` (failed attempts), ``failovers`` (attempts sent at
            once to another endpoint after a failure), ``retries`` (attempts after a backoff), ``errors`` (batches
            given up), ``breaker_opens``,
            ``breaker_closes``, ``health_checks``, ``health_check_failures``, ``truncated_queries``,
            ``empty_queries``, ``sanitized_queries`` (characters UTF-8 cannot carry replaced), ``limit_reads``
            (``GET /health`` for an endpoint's limits), ``server_cut_queries`` (queries cut to an endpoint's
            advertised length, per attempt), ``rejected_requests`` (4xx answers), ``rejected_queries`` (searches
            that raised :class:`QueryRejected`), ``splits`` (batches re-sent in parts), ``timeouts`` (attempts
            or probes ended by their deadline), ``stopped`` (requests answered with ``stop_run``), and from a web
            retriever ``web_calls`` (queries answered by a provider call), ``web_cache_hits``, ``web_skipped``
            (queries the spent budget left without passages), ``web_credits`` and ``web_usd`` (what those calls
            cost; ``web_usd`` only counts answers that carry a price), ``query_retries`` (queries the server marked
            unavailable, sent again alone), ``retry_after_waits`` (retries that waited a server's Retry-After).
    Raises:
        ValueError: no URL, or a count / duration out of range.
    """

    def __init__(self, urls: List[str], topk: int = 3, timeout_s: float = 30, max_retries: int = 4,
                 backoff_s: float = 0.5, coalesce_window_ms: float = 5, max_batch_queries: int = 256,
                 max_query_chars: int = 1000, failed_endpoint_cooldown_s: Optional[float] = None,
                 breaker_failures: int = 1, max_cooldown_s: float = 60.0, health_timeout_s: Optional[float] = None,
                 max_retry_after_s: float = 300.0):
        if isinstance(urls, str):
            urls = [u for u in urls.split(",") if u]
        if not urls:
            raise ValueError("RetrievalClient needs at least one retriever URL")
        if topk < 1 or max_batch_queries < 1 or max_query_chars < 1 or max_retries < 0 or breaker_failures < 1:
            raise ValueError("topk, max_batch_queries, max_query_chars, breaker_failures must be >= 1 and "
                             "max_retries >= 0")
        self.urls = [u.rstrip("/") for u in urls]
        if len(set(self.urls)) != len(self.urls):
            raise ValueError(f"retriever URLs given twice: {self.urls}")
        self.topk = topk
        self.timeout_s = timeout_s
        self.max_retries = max_retries
        self.backoff_s = backoff_s
        self.coalesce_window_s = coalesce_window_ms / 1000.0
        self.max_batch_queries = max_batch_queries
        self.max_query_chars = max_query_chars
        self.failed_endpoint_cooldown_s = (failed_endpoint_cooldown_s if failed_endpoint_cooldown_s is not None
                                           else max(1.0, backoff_s * 4))
        self.breaker_failures = breaker_failures
        self.max_cooldown_s = max(max_cooldown_s, self.failed_endpoint_cooldown_s)
        self.health_timeout_s = health_timeout_s if health_timeout_s is not None else min(timeout_s, 5.0)
        self.max_retry_after_s = max_retry_after_s
        self._endpoints: Dict[str, _Endpoint] = {u: _Endpoint(u) for u in self.urls}
        self._next_endpoint = 0
        self._states: "weakref.WeakKeyDictionary[asyncio.AbstractEventLoop, _LoopState]" = weakref.WeakKeyDictionary()
        self.stats = {"requests": 0, "queries": 0, "queries_sent": 0, "failures": 0, "retries": 0, "failovers": 0,
                      "errors": 0, "breaker_opens": 0, "breaker_closes": 0, "health_checks": 0,
                      "health_check_failures": 0, "truncated_queries": 0, "empty_queries": 0,
                      "sanitized_queries": 0, "limit_reads": 0, "server_cut_queries": 0, "rejected_requests": 0,
                      "rejected_queries": 0, "splits": 0, "timeouts": 0, "stopped": 0, "web_calls": 0,
                      "web_cache_hits": 0, "web_skipped": 0, "web_credits": 0.0, "web_usd": 0.0,
                      "query_retries": 0, "retry_after_waits": 0}

    @classmethod
    def from_config(cls, cfg) -> "RetrievalClient":
        """Build from a ``SearchConfig`` (retriever_urls, topk, retrieval_*, coalesce_window_ms, max_*)."""
        return cls(urls=list(cfg.retriever_urls), topk=cfg.topk, timeout_s=cfg.retrieval_timeout_s,
                   max_retries=cfg.retrieval_max_retries, backoff_s=cfg.retrieval_backoff_s,
                   coalesce_window_ms=cfg.coalesce_window_ms, max_batch_queries=cfg.max_batch_queries,
                   max_query_chars=cfg.max_query_chars)

    # ------------------------------------------------------------------ public API
    async def search(self, query: str, topk: Optional[int] = None) -> List[Passage]:
        """Top-k passages for one query, sent together with concurrent calls (coalesced).

        Args:
            query: the search query; cut to ``max_query_chars``; an empty / blank query returns [] without a request.
            topk: passages wanted (default ``self.topk``).
        Returns:
            list of at most ``topk`` ``Passage`` objects, best first.
        Raises:
            QueryRejected: the server refused this query (the others sent with it are not affected).
            RetrievalStopped: the retriever says the run must stop (web provider key refused, budget spent).
            RetrievalError: the request failed on every attempt (or the server refused the request as a whole).
        """
        self.stats["queries"] += 1
        query = self._clean(query)
        if not query:
            return []
        topk = int(topk or self.topk)
        loop = asyncio.get_running_loop()
        state = self._state(loop)
        item = _Pending(query, topk, loop.create_future())
        state.pending.append(item)
        if len(state.pending) >= self.max_batch_queries:
            self._flush(state)
        elif state.flush_handle is None:
            state.flush_handle = loop.call_later(self.coalesce_window_s, self._flush, state)
        try:
            result = await item.future
        finally:
            trace = _TRACE.get()
            if trace is not None:
                trace.failovers += item.failovers
        if trace is not None:
            trace.searches += 1
        return result

    async def search_batch(self, queries: List[str], topk: Optional[int] = None) -> List[List[Passage]]:
        """Passages for several queries at once (one request per ``max_batch_queries``); same errors as ``search``."""
        return list(await asyncio.gather(*(self.search(q, topk) for q in queries)))

    async def health(self) -> Dict[str, bool]:
        """``GET /health`` of every endpoint: {url: reachable and answered 200}. Does not touch the breakers."""
        state = self._state(asyncio.get_running_loop())
        result = {}
        for url in self.urls:
            try:
                response = await asyncio.wait_for(state.client.get(url + "/health", timeout=self.health_timeout_s),
                                                  self.health_timeout_s)
                result[url] = response.status_code == 200
            except (httpx.HTTPError, TimeoutError):
                result[url] = False
        return result

    def endpoint_stats(self) -> Dict[str, dict]:
        """Per endpoint: ``open`` (breaker open: no traffic), ``consecutive_failures``, ``requests``, ``failures``,
        ``in_flight``."""
        return {u: {"open": e.open, "consecutive_failures": e.consecutive_failures, "requests": e.requests,
                    "failures": e.failures, "in_flight": e.in_flight} for u, e in self._endpoints.items()}

    async def aclose(self):
        """Close the HTTP client of the running loop (pending searches fail with RetrievalError)."""
        loop = asyncio.get_running_loop()
        state = self._states.pop(loop, None)
        if state is not None:
            for item in state.pending:
                if not item.future.done():
                    item.future.set_exception(RetrievalError("retrieval client closed"))
            for task in list(state.probes):
                task.cancel()
            await state.client.aclose()

    # ------------------------------------------------------------------ internals
    def _clean(self, query) -> str:
        query = "" if query is None else str(query)
        query = " ".join(query.split())  # newlines / runs of spaces would only change BM25 tokenisation noise
        if not query:
            self.stats["empty_queries"] += 1
            return ""
        if len(query) > self.max_query_chars:
            self.stats["truncated_queries"] += 1
            query = query[: self.max_query_chars]
        try:
            query.encode("utf-8")
        except UnicodeEncodeError:  # a lone surrogate: no server can read it back, replace it rather than fail
            self.stats["sanitized_queries"] += 1
            query = query.encode("utf-8", "replace").decode("utf-8")
        return query

    def _state(self, loop) -> _LoopState:
        state = self._states.get(loop)
        if state is None:
            # An explicit transport: httpx then ignores HTTP_PROXY / HTTPS_PROXY / ALL_PROXY (the retriever is a
            # service of the cluster, and a node's internet proxy answers 502 for http://127.0.0.1:8000); the
            # transport still reads SSL_CERT_FILE for an https retriever.
            transport = httpx.AsyncHTTPTransport(limits=httpx.Limits(max_connections=64))
            state = _LoopState(client=httpx.AsyncClient(timeout=self.timeout_s, transport=transport))
            self._states[loop] = state
        return state

    def _flush(self, state: _LoopState):
        if state.flush_handle is not None:
            state.flush_handle.cancel()
            state.flush_handle = None
        pending, state.pending = state.pending, []
        by_topk: Dict[int, List[_Pending]] = {}
        for item in pending:
            by_topk.setdefault(item.topk, []).append(item)
        for topk, items in by_topk.items():
            unique = list(dict.fromkeys(item.query for item in items))
            for start in range(0, len(unique), self.max_batch_queries):
                chunk = unique[start: start + self.max_batch_queries]
                chunk_set = set(chunk)
                waiters = [item for item in items if item.query in chunk_set]
                task = asyncio.ensure_future(self._run_batch(state, chunk, topk, waiters))
                state.tasks.add(task)  # keep a reference so the task is not garbage-collected mid-flight
                task.add_done_callback(state.tasks.discard)

    # --- circuit breaker and health checks
    def _available(self, state: _LoopState) -> List[_Endpoint]:
        """Endpoints whose breaker is closed; starts a health probe for every open one whose cooldown is over."""
        now = time.monotonic()
        ok = []
        for e in self._endpoints.values():
            if not e.open:
                ok.append(e)
            elif not e.probing and now >= e.open_until:
                self._start_probe(state, e)
        return ok

    def _start_probe(self, state: _LoopState, e: _Endpoint) -> None:
        e.probe = asyncio.ensure_future(self._probe(state, e))
        state.probes.add(e.probe)
        e.probe.add_done_callback(state.probes.discard)

    async def _get_health(self, state: _LoopState, e: _Endpoint) -> httpx.Response:
        """``GET /health`` within ``health_timeout_s`` of wall time; learns the endpoint's limits from a 200.
        Raises httpx.HTTPError or TimeoutError."""
        try:
            response = await asyncio.wait_for(state.client.get(e.url + "/health", timeout=self.health_timeout_s),
                                              self.health_timeout_s)
        except TimeoutError:
            self.stats["timeouts"] += 1
            raise TimeoutError(f"GET {e.url}/health took more than {self.health_timeout_s}s") from None
        if response.status_code == 200 or e.limits is None:
            self._learn_limits(e, response)
        return response

    @staticmethod
    def _learn_limits(e: _Endpoint, response: httpx.Response) -> None:
        body = None
        if response.status_code == 200:
            try:
                body = response.json()
            except ValueError:
                body = None
        limits = body.get("limits") if isinstance(body, dict) else None
        e.limits = {k: v for k, v in limits.items() if isinstance(v, int) and not isinstance(v, bool) and v > 0} \
            if isinstance(limits, dict) else {}
        e.per_query_errors = bool(isinstance(body, dict) and body.get("per_query_errors") is True)

    async def _ensure_limits(self, state: _LoopState, e: _Endpoint) -> None:
        """Read the endpoint's advertised limits once (concurrent requests share one look-up). A look-up that
        cannot reach the endpoint raises, and so counts as the attempt's failure."""
        if e.limits is not None:
            return
        task = state.limit_reads.get(e.url)
        if task is None:
            self.stats["limit_reads"] += 1
            task = state.limit_reads[e.url] = asyncio.ensure_future(self._get_health(state, e))

            def done(t, url=e.url):
                if state.limit_reads.get(url) is t:
                    del state.limit_reads[url]
                if not t.cancelled():
                    t.exception()  # retrieved: the attempts awaiting it may have met their own deadline first

            task.add_done_callback(done)
        await asyncio.shield(task)

    def _fit(self, e: _Endpoint, queries: List[str]) -> List[str]:
        """The queries cut to the endpoint's advertised ``max_query_chars``."""
        limit = (e.limits or {}).get("max_query_chars")
        if not limit:
            return queries
        cut = [q[:limit] for q in queries]
        self.stats["server_cut_queries"] += sum(len(q) > limit for q in queries)
        return cut

    async def _probe(self, state: _LoopState, e: _Endpoint) -> None:
        self.stats["health_checks"] += 1
        try:
            response = await self._get_health(state, e)
            healthy, why = response.status_code == 200, f"HTTP {response.status_code}"
        except (httpx.HTTPError, TimeoutError) as err:
            healthy, why = False, repr(err)
        if healthy:
            self._close_breaker(e, "health check passed")
        elif e.open:
            self.stats["health_check_failures"] += 1
            e.cooldown_s = min(self.max_cooldown_s, 2 * e.cooldown_s)
            e.open_until = time.monotonic() + e.cooldown_s
            logger.info("retriever %s still unhealthy (%s); next health check in %.1fs", e.url, why, e.cooldown_s)

    def _record_success(self, e: _Endpoint) -> None:
        e.consecutive_failures = 0
        if e.open:  # a forced attempt (every endpoint was open) got through
            self._close_breaker(e, "request succeeded")

    def _close_breaker(self, e: _Endpoint, why: str) -> None:
        if e.open:
            e.open = False
            e.consecutive_failures = 0
            self.stats["breaker_closes"] += 1
            logger.info("retriever %s back in rotation (%s)", e.url, why)

    def _record_failure(self, e: _Endpoint, error, forced: bool) -> None:
        e.failures += 1
        e.consecutive_failures += 1
        now = time.monotonic()
        if e.open:
            if forced:  # sent while open (every endpoint was out) and failed: wait longer before the next check
                e.cooldown_s = min(self.max_cooldown_s, 2 * e.cooldown_s)
                e.open_until = now + e.cooldown_s
            # else: a request sent before the breaker opened, failing late: already counted
        elif e.consecutive_failures >= self.breaker_failures:
            e.open = True
            e.cooldown_s = self.failed_endpoint_cooldown_s
            e.open_until = now + e.cooldown_s
            self.stats["breaker_opens"] += 1
            healthy = sum(not x.open for x in self._endpoints.values())
            logger.warning("retriever %s taken out of rotation after %d consecutive failures (last: %r); %d of %d "
                           "endpoints left, health check in %.1fs", e.url, e.consecutive_failures, error, healthy,
                           len(self._endpoints), e.cooldown_s)

    def _pick_endpoint(self, state: _LoopState, tried: Set[str]) -> Optional[_Endpoint]:
        """A closed-breaker endpoint not in ``tried`` with the fewest requests in flight (ties round-robin);
        None when there is none."""
        candidates = [e for e in self._available(state) if e.url not in tried]
        if not candidates:
            return None
        n = len(self.urls)
        order = {u: (i - self._next_endpoint) % n for i, u in enumerate(self.urls)}
        best = min(candidates, key=lambda e: (e.in_flight, order[e.url]))
        self._next_endpoint = (self.urls.index(best.url) + 1) % n
        return best

    def _fallback_endpoint(self, state: _LoopState) -> _Endpoint:
        """Every endpoint is open or was tried: a closed one if any (fewest in flight), else the open one whose
        health check is due first (the request itself then tests it)."""
        closed = self._available(state)
        if closed:
            return min(closed, key=lambda e: e.in_flight)
        return min(self._endpoints.values(), key=lambda e: e.open_until)

    async def _run_batch(self, state: _LoopState, queries: List[str], topk: int, waiters: List[_Pending]):
        try:
            results = await self._resolve(state, queries, topk, waiters)
        except Exception as e:  # every waiter learns the failure; nothing hangs
            self.stats["errors"] += 1
            err = e if isinstance(e, RetrievalError) else RetrievalError(f"retrieval failed: {e!r}")
            results = [err] * len(queries)
        by_query = dict(zip(queries, results))
        for item in waiters:
            if item.future.done():
                continue
            result = by_query[item.query]
            if isinstance(result, BaseException):
                if isinstance(result, QueryRejected):
                    self.stats["rejected_queries"] += 1
                item.future.set_exception(result)
            else:
                item.future.set_result(list(result))

    async def _resolve(self, state: _LoopState, queries: List[str], topk: int, waiters: List[_Pending],
                       round_: int = 0) -> list:
        """Per query, its passages or the exception its ``search`` raises. A batch an endpoint cannot take whole
        (over its advertised ``max_queries``, or rejected with a 4xx by a server without per-query errors) is
        re-sent in parts, concurrently; a part that fails gives its own queries the error, not the others. Queries
        the server marks unavailable (a web provider failing for them alone) are sent again on their own after
        the backoff or the server's Retry-After, whichever is longer, at most ``max_retries`` times."""
        try:
            results = await self._post_with_retries(state, queries, topk, waiters)
        except _Split as split:
            size = split.size
        else:
            return await self._retry_unavailable(state, queries, topk, waiters, results, round_)
        self.stats["splits"] += 1
        parts = [queries[i: i + size] for i in range(0, len(queries), size)]
        outcomes = await asyncio.gather(
            *(self._resolve(state, part, topk, [w for w in waiters if w.query in set(part)]) for part in parts),
            return_exceptions=True)
        results = []
        for part, outcome in zip(parts, outcomes):
            if isinstance(outcome, BaseException):
                if not isinstance(outcome, Exception):  # cancellation and the like: not ours to swallow
                    raise outcome
                self.stats["errors"] += 1
                err = outcome if isinstance(outcome, RetrievalError) else RetrievalError(
                    f"retrieval failed: {outcome!r}")
                results.extend([err] * len(part))
            else:
                results.extend(outcome)
        return results

    async def _retry_unavailable(self, state: _LoopState, queries: List[str], topk: int, waiters: List[_Pending],
                                 results: list, round_: int) -> list:
        """``results`` with every :class:`QueryUnavailable` query searched again (alone) or turned into its error."""
        again = [i for i, r in enumerate(results) if isinstance(r, QueryUnavailable)]
        if not again:
            return results
        wait = max([self.backoff_s * 2 ** round_] + [results[i].retry_after or 0.0 for i in again])
        if round_ >= self.max_retries or wait > self.max_retry_after_s:
            why = (f"after {round_} retries" if round_ >= self.max_retries else
                   f"the server asks to wait {wait:g}s > max_retry_after_s {self.max_retry_after_s:g}")
            for i in again:
                results[i] = RetrievalError(f"retriever could not serve the query ({why}): {results[i]}")
            return results
        self.stats["query_retries"] += len(again)
        self.stats["retry_after_waits"] += wait > self.backoff_s * 2 ** round_
        await asyncio.sleep(wait)
        subset = [queries[i] for i in again]
        try:
            found = await self._resolve(state, subset, topk, [w for w in waiters if w.query in set(subset)],
                                        round_ + 1)
        except Exception as e:  # only these queries fail; the others' answers stand
            found = [e if isinstance(e, RetrievalError) else RetrievalError(f"retrieval failed: {e!r}")] * len(subset)
        for i, r in zip(again, found):
            results[i] = r
        return results

    async def _post_with_retries(self, state: _LoopState, queries: List[str], topk: int,
                                 waiters: List[_Pending]) -> list:
        """POST one batch; fail over to each untried healthy endpoint at once, then up to ``max_retries`` retries
        after a backoff. Returns per query its passages or a :class:`QueryRejected`. Raises RetrievalError when the
        retries are spent or the server refused the request as a whole, ``_Split`` when the batch must go in
        parts."""
        last_error = None
        retry_after = 0.0  # the longest Retry-After a failed attempt's answer asked for, seconds
        tried: Set[str] = set()
        attempts = retries = 0
        while True:
            endpoint = self._pick_endpoint(state, tried)
            forced = False
            if attempts and endpoint is not None:  # failover: another healthy endpoint, at once, budget untouched
                self.stats["failovers"] += 1
                for item in waiters:
                    item.failovers += 1
                logger.warning("retriever request of %d queries failed over to %s after: %r", len(queries),
                               endpoint.url, last_error)
            elif attempts:  # no untried healthy endpoint: wait, then take the best there is
                if retries >= self.max_retries:
                    break
                backoff = self.backoff_s * (2 ** retries)
                if retry_after > self.max_retry_after_s:
                    break
                retries += 1
                self.stats["retries"] += 1
                self.stats["retry_after_waits"] += retry_after > backoff
                await asyncio.sleep(max(backoff, retry_after))  # never before the server said it can serve
                retry_after = 0.0
                endpoint = self._pick_endpoint(state, tried)
            if endpoint is None:
                endpoint = self._fallback_endpoint(state)
                forced = endpoint.open
            attempts += 1
            url = endpoint.url
            tried.add(url)
            self.stats["requests"] += 1
            endpoint.requests += 1
            endpoint.in_flight += 1
            try:
                # one deadline for the whole attempt: httpx's timeout only bounds the silence between two reads
                async with asyncio.timeout(self.timeout_s):
                    await self._ensure_limits(state, endpoint)
                    max_queries = (endpoint.limits or {}).get("max_queries")
                    if max_queries and len(queries) > max_queries:
                        raise _Split(max_queries)
                    payload = {"queries": self._fit(endpoint, queries), "topk": topk, "return_scores": True,
                               "per_query_errors": True}
                    response = await state.client.post(url + "/retrieve", json=payload, timeout=self.timeout_s)
                if 400 <= response.status_code < 500 and response.status_code not in (408, 429):
                    stop = stop_message(response, url)
                    if stop is not None:
                        self.stats["stopped"] += 1
                        raise RetrievalStopped(stop)
                    raise _BadRequest(f"{url} answered {response.status_code}: {response.text[:300]}",
                                      response.status_code)
                response.raise_for_status()
                body = response.json()
                results = parse_retrieve_answer(body, len(queries), url)
                self._count_web(body)
                self.stats["queries_sent"] += len(queries)
                self._record_success(endpoint)
                return results
            except _Split:
                self.stats["requests"] -= 1  # nothing was sent
                endpoint.requests -= 1
                raise
            except _BadRequest as e:  # the endpoint is alive and answered: not a reason to route around it
                self.stats["rejected_requests"] += 1
                self._record_success(endpoint)
                if len(queries) > 1 and (e.status == 413 or not endpoint.per_query_errors):
                    logger.info("retriever %s rejected a request of %d queries (%s); re-sending it in halves so "
                                "that only the rejected query fails", url, len(queries), e)
                    raise _Split((len(queries) + 1) // 2) from e
                if endpoint.per_query_errors:  # per-query faults come back per query: this one is the request's
                    raise RetrievalError(f"retriever refused the request (not a query): {e}") from e
                return [QueryRejected(f"retriever refused the query: {e}")]
            except (httpx.HTTPError, ValueError, KeyError, TypeError, TimeoutError) as e:
                if isinstance(e, httpx.HTTPStatusError):
                    retry_after = max(retry_after, retry_after_seconds(e.response) or 0.0)
                if isinstance(e, TimeoutError):
                    self.stats["timeouts"] += 1
                    e = TimeoutError(f"no complete answer from {url} within the {self.timeout_s}s deadline")
                self.stats["failures"] += 1
                self._record_failure(endpoint, e, forced)
                last_error = e
                logger.warning("retriever request to %s failed (attempt %d, retry %d/%d): %r", url, attempts,
                               retries, self.max_retries, e)
            finally:
                endpoint.in_flight -= 1
        asked = (f"; the server asks to wait {retry_after:g}s > max_retry_after_s {self.max_retry_after_s:g}"
                 if retry_after > self.max_retry_after_s else "")
        raise RetrievalError(f"retriever unavailable after {attempts} attempts ({retries} retries) over "
                             f"{self.urls}: {last_error!r}{asked}")

    def _count_web(self, body) -> None:
        """Add a web retriever's per-answer counts (``"web": {"calls", "cache_hits", "skipped", "credits",
        "usd"}``) to ``stats``."""
        web = body.get("web") if isinstance(body, dict) else None
        if isinstance(web, dict):
            for key in ("calls", "cache_hits", "skipped", "credits", "usd"):
                value = web.get(key)
                if isinstance(value, (int, float)) and not isinstance(value, bool) and value > 0:
                    self.stats[f"web_{key}"] += value
