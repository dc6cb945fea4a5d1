"""Async, batched HTTP client of the retriever service (``POST /retrieve``, Search-R1's schema, DESIGN.md sec. 6).

Rollouts run one asyncio task per sample; each asks for passages one query at a time. Sending every query as its
own HTTP request would put hundreds of small requests on the retriever per step (R1-Searcher and Search-R1 both
batch per turn instead, which makes every sample wait for the slowest of its batch). ``RetrievalClient`` gives
each sample its own ``await search(query)`` and still sends few requests: calls that arrive within
``coalesce_window_ms`` of each other are coalesced into one ``POST /retrieve`` (split at ``max_batch_queries``,
identical queries sent once).

Several endpoints (``--search.retriever_urls``) are used as one service that survives losing some of them:

- routing: each request goes to the healthy endpoint with the fewest requests in flight (ties round-robin), so a
  slow endpoint, whose requests pile up, gets less of the load;
- circuit breaker per endpoint: ``breaker_failures`` consecutive failed requests (connection refused or reset,
  timeout, 5xx, malformed answer) open it: no request goes there for ``failed_endpoint_cooldown_s`` (doubled on
  each failed re-admission, at most ``max_cooldown_s``);
- health checks: when that time is up, one ``GET /health`` probe decides: 200 closes the breaker (traffic comes
  back), anything else opens it again. Real requests never serve as probes while another endpoint is healthy;
- failover: a failed request is sent again at once to a healthy endpoint it has not tried yet (this does not use
  the retry budget); only when none is left does it wait (exponential backoff) and retry, at most ``max_retries``
  times. Then every waiting ``search`` raises ``RetrievalError`` (the executor marks those samples failed).

Failovers, breaker openings and health checks are counted in ``stats`` and logged (a warning when an endpoint is
routed around, info when it is back); :func:`start_retrieval_trace` gives a rollout per-sample counts (the executor
writes them to ``extra_logs``, so OpenRLHF logs them next to the ``search/*`` statistics).
"""

import asyncio
import contextvars
import logging
import time
import weakref
from dataclasses import dataclass, field
from typing import Dict, List, Optional, Set

import httpx

from openrlhf_search.types import Passage

logger = logging.getLogger(__name__)


class RetrievalError(RuntimeError):
    """The retriever could not answer within the retry budget (all endpoints down, timeouts, bad responses)."""


class _BadRequest(Exception):
    """The server rejected the payload (HTTP 4xx other than 408/429): retrying cannot help."""


def passage_from_document(doc: dict, score=None) -> Passage:
    """Turn one ``document`` of the ``/retrieve`` response into a ``Passage``.

    Accepts ``{"id", "title", "text"}`` or the wiki-18 / FlashRAG form ``{"id", "contents": "\\"Title\\"\\ntext"}``.
    Raises ValueError when the document has neither ``text`` nor ``contents``.
    """
    if not isinstance(doc, dict):
        raise ValueError(f"document must be an object, got {type(doc).__name__}")
    pid = str(doc.get("id", ""))
    if "text" in doc and doc.get("text") is not None:
        title = str(doc.get("title") or "")
        text = str(doc["text"])
    elif "contents" in doc:
        contents = str(doc["contents"])
        head, sep, rest = contents.partition("\n")
        if sep:
            title, text = head.strip().strip('"'), rest
        else:
            title, text = str(doc.get("title") or ""), contents
    else:
        raise ValueError(f"document without text or contents: keys {sorted(doc)}")
    return Passage(id=pid, title=title, text=text, score=None if score is None else float(score))


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


@dataclass
class _LoopState:
    """Per-event-loop state: the HTTP client and the coalescing queue belong to one loop."""

    client: httpx.AsyncClient
    pending: List[_Pending] = field(default_factory=list)
    probes: set = field(default_factory=set)
    flush_handle: Optional[asyncio.TimerHandle] = None
    tasks: set = field(default_factory=set)


class RetrievalClient:
    """Coalescing, load-spreading, failing-over client of one or more retriever services.

    Args:
        urls: base URLs (``http://host:port``); ``/retrieve`` is appended.
        topk: default passages per query.
        timeout_s: timeout of one HTTP request, seconds.
        max_retries: retries after a backoff, once a failed request has no healthy endpoint left that it has not
            tried. Failing over to an untried healthy endpoint is immediate and does not count: with four endpoints
            and ``max_retries=0`` a request survives three of them failing.
        backoff_s: delay before a retry that finds no untried healthy endpoint, seconds; doubled on each such retry.
        coalesce_window_ms: how long the first pending query waits for others before the request goes out, ms.
            0 still coalesces the calls made in the same event-loop iteration.
        max_batch_queries: most queries in one request; a larger batch is split.
        max_query_chars: queries are cut to this many characters (a runaway query must not reach the server whole).
        failed_endpoint_cooldown_s: how long an endpoint whose breaker opened gets no request before its health is
            checked, seconds (default ``max(1, 4 * backoff_s)``); doubled after each failed check.
        breaker_failures: consecutive failed requests that open an endpoint's breaker (default 1: a refused
            connection or a timeout is rarely a one-off).
        max_cooldown_s: cap on the doubled cooldown, seconds.
        health_timeout_s: timeout of one ``GET /health`` probe (default ``min(timeout_s, 5)``).

    Attributes:
        stats: counters ``requests`` (HTTP attempts), ``queries`` (search calls), ``queries_sent`` (queries in
            request bodies after de-duplication), ``failures`` (failed attempts), ``failovers`` (attempts sent at
            once to another endpoint after a failure), ``retries`` (attempts after a backoff), ``errors`` (batches
            given up), ``breaker_opens``,
            ``breaker_closes``, ``health_checks``, ``health_check_failures``, ``truncated_queries``,
            ``empty_queries``.
    Raises:
        ValueError: no URL, or a count / duration out of range.
    """

    def __init__(self, urls: List[str], topk: int = 3, timeout_s: float = 30, max_retries: int = 4,
                 backoff_s: float = 0.5, coalesce_window_ms: float = 5, max_batch_queries: int = 256,
                 max_query_chars: int = 1000, failed_endpoint_cooldown_s: Optional[float] = None,
                 breaker_failures: int = 1, max_cooldown_s: float = 60.0, health_timeout_s: Optional[float] = None):
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
        self._endpoints: Dict[str, _Endpoint] = {u: _Endpoint(u) for u in self.urls}
        self._next_endpoint = 0
        self._states: "weakref.WeakKeyDictionary[asyncio.AbstractEventLoop, _LoopState]" = weakref.WeakKeyDictionary()
        self.stats = {"requests": 0, "queries": 0, "queries_sent": 0, "failures": 0, "retries": 0, "failovers": 0,
                      "errors": 0, "breaker_opens": 0, "breaker_closes": 0, "health_checks": 0,
                      "health_check_failures": 0, "truncated_queries": 0, "empty_queries": 0}

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
            RetrievalError: the request failed on every attempt.
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
                response = await state.client.get(url + "/health", timeout=self.health_timeout_s)
                result[url] = response.status_code == 200
            except httpx.HTTPError:
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
        return query

    def _state(self, loop) -> _LoopState:
        state = self._states.get(loop)
        if state is None:
            state = _LoopState(client=httpx.AsyncClient(timeout=self.timeout_s,
                                                        limits=httpx.Limits(max_connections=64)))
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

    async def _probe(self, state: _LoopState, e: _Endpoint) -> None:
        self.stats["health_checks"] += 1
        try:
            response = await state.client.get(e.url + "/health", timeout=self.health_timeout_s)
            healthy, why = response.status_code == 200, f"HTTP {response.status_code}"
        except httpx.HTTPError as err:
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
            results = await self._post_with_retries(state, queries, topk, waiters)
        except Exception as e:  # every waiter learns the failure; nothing hangs
            self.stats["errors"] += 1
            err = e if isinstance(e, RetrievalError) else RetrievalError(f"retrieval failed: {e!r}")
            for item in waiters:
                if not item.future.done():
                    item.future.set_exception(err)
            return
        by_query = dict(zip(queries, results))
        for item in waiters:
            if not item.future.done():
                item.future.set_result(list(by_query[item.query]))

    async def _post_with_retries(self, state: _LoopState, queries: List[str], topk: int,
                                 waiters: List[_Pending]) -> List[List[Passage]]:
        """POST one batch; fail over to each untried healthy endpoint at once, then up to ``max_retries`` retries
        after a backoff. Raises RetrievalError (4xx at once, else when the retries are spent)."""
        payload = {"queries": queries, "topk": topk, "return_scores": True}
        last_error = None
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
                retries += 1
                self.stats["retries"] += 1
                await asyncio.sleep(self.backoff_s * (2 ** (retries - 1)))
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
                response = await state.client.post(url + "/retrieve", json=payload, timeout=self.timeout_s)
                if 400 <= response.status_code < 500 and response.status_code not in (408, 429):
                    raise _BadRequest(f"{url} answered {response.status_code}: {response.text[:300]}")
                response.raise_for_status()
                results = self._parse(response.json(), len(queries))
                self.stats["queries_sent"] += len(queries)
                self._record_success(endpoint)
                return results
            except _BadRequest as e:  # the endpoint is alive and answered: not a reason to route around it
                self.stats["failures"] += 1
                self._record_success(endpoint)
                raise RetrievalError(str(e)) from e
            except (httpx.HTTPError, ValueError, KeyError, TypeError) as e:
                self.stats["failures"] += 1
                self._record_failure(endpoint, e, forced)
                last_error = e
                logger.warning("retriever request to %s failed (attempt %d, retry %d/%d): %r", url, attempts,
                               retries, self.max_retries, e)
            finally:
                endpoint.in_flight -= 1
        raise RetrievalError(f"retriever unavailable after {attempts} attempts ({retries} retries) over "
                             f"{self.urls}: {last_error!r}")

    @staticmethod
    def _parse(body, n_queries: int) -> List[List[Passage]]:
        """Parse ``{"result": [[{"document": {...}, "score": s}, ...], ...]}``; ValueError when malformed."""
        if not isinstance(body, dict) or "result" not in body:
            raise ValueError("retriever response has no 'result'")
        result = body["result"]
        if not isinstance(result, list) or len(result) != n_queries:
            raise ValueError(f"retriever returned {len(result) if isinstance(result, list) else '?'} result lists "
                             f"for {n_queries} queries")
        parsed = []
        for hits in result:
            passages = []
            for hit in hits:
                if isinstance(hit, dict) and "document" in hit:
                    passages.append(passage_from_document(hit["document"], hit.get("score")))
                else:  # return_scores=False form: the document itself
                    passages.append(passage_from_document(hit))
            parsed.append(passages)
        return parsed
