"""``WebIndex``: a web search provider behind the retriever's index interface (``search(queries, topk)``,
``info()``, ``close()``), so ``retriever.server`` serves it on ``/retrieve``, ``/queries`` and ``/health`` unchanged.

Every query is its own task on the index's event loop (one thread of its own, with one ``httpx.AsyncClient``):
one query's back-off, slow answer or failure never holds or fails another's, and the server, which hands each
request's queries over with :meth:`WebIndex.submit`, gets per query its passages or its own
:class:`~retriever.errors.BackendError`. Identical queries in flight share one provider call.

Per query: the :class:`~retriever.web.cache.QueryCache`; on a miss the :class:`~retriever.web.cache.RunBudget`
(credits held while the call runs, so concurrent calls cannot pass a cap), the
:class:`~retriever.web.ratelimit.RateLimiter`, one provider call under a total deadline (a 429 pauses the limiter
for its Retry-After, for every call, those already scheduled included; the call then tries again, at most
``retries_429`` times), the optional :class:`~retriever.web.reader.PageReader` (its reads paced by their own
limiter and capped by the budget), and the answer is cached.

A result becomes a passage ``{"id": url, "title", "text": snippet (or page text), "contents": "\\"title\\"\\ntext",
"score": 1 / rank}`` (web providers give no score; rank 1 scores 1.0); a missing title / snippet reads "No title." /
"No snippet available." as in Search-R1's ``serp_search_server.py:70-71``.

Failures become :class:`~retriever.errors.BackendError` answers (``provider`` module table): a refused key, an empty
account or (``on_budget="stop"``) the budget -> a 4xx with ``stop_run`` after which every request gets the same
answer; 5xx / timeouts / a 429 that outlasts the waits -> 503 (with Retry-After when known), which the client
retries for that query alone; another 4xx for one query -> no passages for it. With ``on_budget="continue"`` a query
the budget no longer covers gets no passages (cached queries are still served) and is counted as ``skipped``. Each
error is one log line.

Each query's list of passages is a :class:`WebHits` whose ``source`` says where it came from ("cache", "web",
"skipped") and ``credits`` / ``usd`` what it cost; the server sums them per request (``"web"`` in the ``/retrieve``
answer) for the client's counters.
"""

from __future__ import annotations

import asyncio
import hashlib
import logging
import threading
from concurrent.futures import Future
from typing import Optional

import httpx

from ..errors import BackendError
from .cache import BudgetExhausted, QueryCache, RunBudget, cache_key
from .provider import (AuthError, BadQuery, Provider, ProviderAnswer, ProviderError, QuotaError, RateLimited,
                       SecretFilter, Unavailable, call, redact)
from .ratelimit import Paused, RateLimiter
from .reader import PageReader

logger = logging.getLogger("retriever.web")


class WebHits(list):
    """One query's passages; ``source`` is "cache", "web" or "skipped" (the budget is spent, ``continue`` mode);
    ``credits`` / ``usd``: what its provider call cost (0 for a cache hit; ``usd`` None without a price)."""

    def __init__(self, passages=(), source: str = "web", credits: float = 0.0, usd: Optional[float] = None):
        super().__init__(passages)
        self.source, self.credits, self.usd = source, credits, usd


def passages_from_results(results, provider: str) -> list:
    """Provider results (best first) -> passage dicts with a reciprocal-rank ``score``."""
    out = []
    for rank, r in enumerate(results, 1):
        title = " ".join(r.title.split()) or "No title."
        text = " ".join(r.snippet.split()) or "No snippet available."
        out.append({"id": r.url or f"{provider}:{rank}", "title": title, "text": text,
                    "contents": f'"{title}"\n{text}', "score": 1.0 / rank})
    return out


class WebIndex:
    """Web search with the retriever index interface.

    Args:
        provider: a :class:`~retriever.web.provider.Provider`.
        api_key: the provider's key (never logged; redacted from every message); may be empty for a provider
            that needs none (SearxNG).
        endpoint: the provider's search URL (default its public one; a local stand-in in tests).
        cache: query cache (None: every query goes to the provider).
        budget: run budget (None: no cap).
        limiter: provider call pacing (None: none).
        reader: page text reader (None: passages are title + snippet).
        reader_limiter: page read pacing (None: none).
        max_page_reads: most pages read in the run (None: no cap); past it passages keep their snippet.
        site: restrict every query to this site (`` site:<site>`` appended, as R1-Searcher's online eval does with
            en.wikipedia.org).
        on_budget: "stop" (the run stops when the budget is spent) or "continue" (no web passages from then on).
        timeout_s: total deadline of one provider call (connect to the last byte), seconds.
        concurrency: provider calls in flight at once.
        max_retry_wait_s: longest Retry-After waited here, seconds; a longer one, or 429s past ``retries_429``
            calls again, answer 503 (with Retry-After) and the client's retry rules take over.
        retries_429: provider calls per query after a 429.
        default_retry_s: wait after a 429 without Retry-After, seconds, doubled on each further 429.
        log_every: log the cache hit rate every this many lookups.
    """

    def __init__(self, provider: Provider, api_key: str, endpoint: Optional[str] = None,
                 cache: Optional[QueryCache] = None, budget: Optional[RunBudget] = None,
                 limiter: Optional[RateLimiter] = None, reader: Optional[PageReader] = None,
                 reader_limiter: Optional[RateLimiter] = None, max_page_reads: Optional[int] = None, site: str = "",
                 on_budget: str = "stop", timeout_s: float = 10.0, concurrency: int = 8,
                 max_retry_wait_s: float = 60.0, retries_429: int = 3, default_retry_s: float = 1.0,
                 log_every: int = 100):
        if on_budget not in ("stop", "continue"):
            raise ValueError(f"on_budget must be stop or continue, got {on_budget!r}")
        if not api_key and provider.needs_key:
            raise ValueError(f"no API key for {provider.name}: set {provider.key_env}")
        self.provider, self._key = provider, api_key or ""
        self.endpoint = endpoint or provider.default_endpoint
        self.cache, self.budget, self.limiter, self.reader = cache, budget, limiter, reader
        self.reader_limiter, self.max_page_reads = reader_limiter, max_page_reads
        self.site = site.strip()
        self.on_budget = on_budget
        self.timeout_s, self.max_retry_wait_s = timeout_s, max_retry_wait_s
        self.retries_429, self.default_retry_s = retries_429, default_retry_s
        self.log_every = log_every
        self._credit_estimate = provider.credits_per_call  # what a call is held at; raised to the dearest seen
        self._cost_seen = False
        self._first_paid = asyncio.Lock()
        # httpx logs every request URL at INFO, and SerpApi's URL carries the key
        self._log_filter = SecretFilter([api_key, getattr(reader, "api_key", None)])
        logging.getLogger("httpx").addFilter(self._log_filter)
        self._lock = threading.Lock()
        self._stopped: Optional[BackendError] = None
        self._budget_logged = self._reads_logged = False
        self._inflight: dict = {}
        self._reads_started = 0
        self.counts = {"calls": 0, "attempts": 0, "retries": 0, "cache_hits": 0, "shared": 0, "skipped": 0,
                       "empty": 0, "rate_limited": 0, "retry_after_wait_s": 0.0, "unavailable": 0,
                       "bad_queries": 0, "credits": 0.0, "page_reads_over_budget": 0}
        # the index's own event loop: every query is a task on it, whatever thread or loop asks
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, name="web-search", daemon=True)
        self._thread.start()
        self._slots = asyncio.Semaphore(max(1, concurrency))
        self._http = self._await(self._client(max(1, concurrency)))

    @staticmethod
    async def _client(concurrency: int) -> httpx.AsyncClient:
        return httpx.AsyncClient(limits=httpx.Limits(max_connections=concurrency * 2))

    def _await(self, coro):
        return asyncio.run_coroutine_threadsafe(coro, self._loop).result()

    # ------------------------------------------------------------------ index interface
    independent_queries = True  # retriever.server: serve each request's queries with submit(), not in batches

    def submit(self, queries: list, topk: int) -> Future:
        """Start searching ``queries``; the future's result is, per query, a :class:`WebHits` or the
        :class:`~retriever.errors.BackendError` of that query alone (any thread may call this)."""
        return asyncio.run_coroutine_threadsafe(self._each(list(queries), int(topk)), self._loop)

    def search_each(self, queries: list, topk: int) -> list:
        """Blocking :meth:`submit`: per query a :class:`WebHits` or a BackendError."""
        return self.submit(queries, topk).result()

    def search(self, queries: list, topk: int) -> list:
        """Per query, a :class:`WebHits` of at most ``topk`` passages.

        Raises:
            BackendError: 403 / 402 with ``stop_run`` (refused key, empty account, budget in stop mode), or 503
                (the provider failed for at least one query; the others' answers are cached).
        """
        results = self.search_each(queries, topk)
        errors = [r for r in results if isinstance(r, BackendError)]
        if errors:
            raise next((e for e in errors if e.stop_run), errors[0])
        return results

    def info(self) -> dict:
        """What ``GET /health`` reports: provider, endpoint, settings, fingerprint (hash of provider, endpoint,
        site and passage text), and under ``web`` the counters (``calls``: answered = paid provider calls,
        ``attempts``: HTTP calls sent, ``retries``: attempts after a 429), the budget's spend and caps, the
        cache's hit rate."""
        variant = self._variant()
        ident = {"provider": self.provider.name, "endpoint": self.endpoint, "site": self.site, "variant": variant}
        fingerprint = hashlib.sha256(repr(sorted(ident.items())).encode()).hexdigest()[:16]
        cache = None if self.cache is None else {
            "path": self.cache.path, "lookups": self.cache.lookups, "hits": self.cache.hits,
            "hit_rate": round(self.cache.hit_rate, 4), "max_entries": self.cache.max_entries,
            "evicted": self.cache.evicted}
        return {"backend": "web", "index_type": "web", "encoder": f"web:{self.provider.name}",
                "provider": self.provider.name, "endpoint": self.endpoint, "docs": self.provider.docs,
                "site": self.site or None, "passage_text": variant, "count": None, "dim": None, "corpus_path": None,
                "fingerprint": fingerprint,
                "web": {**self.counts, "retry_after_wait_s": round(self.counts["retry_after_wait_s"], 3),
                        "on_budget": self.on_budget, "budget": self.budget.info() if self.budget else None,
                        "cache": cache, "rate_limit_waits": self.limiter.waits if self.limiter else 0,
                        "qps": 1.0 / self.limiter.interval if self.limiter and self.limiter.interval else None,
                        "paused_s": round(self.limiter.paused_for(), 3) if self.limiter else 0.0,
                        "page_reads": self.reader.reads if self.reader else 0,
                        "stopped": str(self._stopped) if self._stopped else None}}

    def close(self) -> None:
        if self._loop.is_closed():
            return
        self._await(self._shutdown())
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(30)
        self._loop.close()
        logging.getLogger("httpx").removeFilter(self._log_filter)
        self._log_cache(final=True)
        if self.cache is not None:
            self.cache.close()

    async def _shutdown(self) -> None:
        """Cancel the searches still running (their requests are gone with the server) and close the client."""
        tasks = [t for t in asyncio.all_tasks() if t is not asyncio.current_task()]
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        await self._http.aclose()

    # ------------------------------------------------------------------ one query
    def _variant(self) -> str:
        return self.reader.variant if self.reader else "snippet"

    async def _each(self, queries: list, topk: int) -> list:
        if self._stopped is not None:  # once stopped, every request gets the stop, cache hits included
            return [self._stopped] * len(queries)
        unique = list(dict.fromkeys(queries))
        outcomes = await asyncio.gather(*(self._one(q, topk) for q in unique), return_exceptions=True)
        by_query = {}
        for q, out in zip(unique, outcomes):
            if isinstance(out, BaseException) and not isinstance(out, BackendError):
                if not isinstance(out, Exception):
                    raise out
                logger.error("web search of one query failed unexpectedly: %r", out)
                out = BackendError(f"web search failed: {type(out).__name__}: {out}", status=503)
            by_query[q] = out
        return [by_query[q] for q in queries]

    async def _one(self, query: str, topk: int) -> WebHits:
        sent = f"{query} site:{self.site}" if self.site else query
        variant = self._variant()
        if self.cache is not None:
            cached = self.cache.get(self.provider.name, self.endpoint, sent, topk, variant)
            if self.cache.lookups % self.log_every == 0:
                self._log_cache()
            if cached is not None:
                self._count("cache_hits")
                return WebHits(cached, "cache")
        if self._stopped is not None:
            raise self._stopped
        key = (cache_key(sent), topk)
        task = self._inflight.get(key)
        if task is not None:  # the same query is being fetched for another request: share its answer
            self._count("shared")
            hits = await asyncio.shield(task)
            return WebHits(hits, "cache" if hits.source == "web" else hits.source)
        task = self._inflight[key] = asyncio.ensure_future(self._fetch(sent, topk, variant))
        task.add_done_callback(lambda t: self._inflight.pop(key, None))
        try:
            return await asyncio.shield(task)
        except BackendError as e:
            if not e.stop_run:
                raise
            if self._stopped is None:
                self._stopped = e
                logger.error("%s", e)
            # queries sent together can each be refused: every request gets the first stop, one object
            raise self._stopped from None

    async def _fetch(self, sent: str, topk: int, variant: str) -> WebHits:
        if self.budget is not None and self.budget.max_usd is not None and not self._cost_seen:
            async with self._first_paid:  # under a money cap, the first paid call goes alone: its answer says
                if not self._cost_seen:   # what a call costs, and later calls are held at that price
                    return await self._fetch_paid(sent, topk, variant)
        return await self._fetch_paid(sent, topk, variant)

    async def _fetch_paid(self, sent: str, topk: int, variant: str) -> WebHits:
        held, charged = 0.0, None
        if self.budget is not None:
            try:
                held = self.budget.reserve(self._credit_estimate)
            except BudgetExhausted as e:
                return self._over_budget(str(e))
        try:
            answer = await self._call(sent, topk)
            if answer is not None:
                charged = answer.credits
                self._credit_estimate = max(self._credit_estimate, answer.credits)
                self._cost_seen = True
        finally:
            if self.budget is not None:
                self.budget.settle(held, charged)
        if answer is None:  # the provider refused this query (a 4xx): no passages, nothing cached
            return WebHits([], "web")
        self._count("calls")
        self._count("credits", answer.credits)
        passages = passages_from_results(answer.results, self.provider.name)
        if self.reader is not None:
            await asyncio.gather(*(self._read(p, r) for p, r in zip(passages, answer.results)))
        if not passages:
            self._count("empty")
        if self.cache is not None:
            self.cache.put(self.provider.name, self.endpoint, sent, topk, variant, passages)
        usd = None
        if self.budget is not None and self.budget.usd_per_1k:
            usd = answer.credits * self.budget.usd_per_1k / 1000.0
        elif not answer.credits:
            usd = 0.0
        return WebHits(passages, "web", answer.credits, usd)

    async def _read(self, passage: dict, result) -> None:
        """Replace the passage's snippet by its page text (kept when the read cap is reached or the read fails)."""
        with self._lock:
            if self.max_page_reads is not None and self._reads_started >= self.max_page_reads:
                self.counts["page_reads_over_budget"] += 1
                if not self._reads_logged:
                    self._reads_logged = True
                    logger.warning("page reads reached --web_max_page_reads %d: passages keep their snippet from "
                                   "now on", self.max_page_reads)
                return
            self._reads_started += 1  # counted when it starts: concurrent reads cannot pass the cap
        if self.reader_limiter is not None:
            await self.reader_limiter.acquire()
        page = await self.reader.read(self._http, result.url, result.snippet)
        if page:
            passage["text"], passage["contents"] = page, f'"{passage["title"]}"\n{page}'

    async def _call(self, query: str, topk: int) -> Optional[ProviderAnswer]:
        """One provider answer (None: the provider refused the query), waiting out 429s; maps the provider errors
        to BackendError (each logged in one line)."""
        for attempt in range(self.retries_429 + 1):
            if self.limiter is not None:
                try:
                    await self.limiter.acquire(max_wait=self.max_retry_wait_s)
                except Paused as p:  # a Retry-After longer than this server waits: no call, the client waits
                    self._count("unavailable")
                    raise BackendError(f"web search unavailable: {self.provider.name} asked for a pause "
                                       f"({p.retry_after:.0f}s left)", status=503, retry_after=p.retry_after) from None
            self._count("attempts")
            if attempt:
                self._count("retries")
            try:
                async with self._slots:
                    return await call(self.provider, self._http, self.endpoint, self._key, query, topk,
                                      self.timeout_s)
            except RateLimited as e:
                self._count("rate_limited")
                wait = e.retry_after if e.retry_after is not None else self.default_retry_s * 2 ** attempt
                if self.limiter is not None:
                    self.limiter.pause(wait)  # every other call waits too, those already scheduled included
                if wait > self.max_retry_wait_s or attempt == self.retries_429:
                    self._count("unavailable")
                    err = BackendError(f"web search unavailable: {e}; Retry-After {wait:g}s (waits past "
                                       f"--web_max_retry_wait_s {self.max_retry_wait_s:g}s or {self.retries_429} "
                                       "retries are left to the client)", status=503, retry_after=wait)
                    logger.warning("%s", err)
                    raise err from None
                logger.warning("%s; waiting %.1fs (Retry-After) before calling again", e, wait)
                self._count("retry_after_wait_s", wait)
                if self.limiter is None:
                    await asyncio.sleep(wait)
            except (AuthError, QuotaError) as e:
                hint = f"; check {self.provider.key_env}" if isinstance(e, AuthError) else ""
                if isinstance(e, AuthError) and self.provider.name == "searxng":
                    hint = "; the instance must allow the JSON format (search: formats: [html, json] in settings.yml)"
                raise BackendError(f"web search stopped: {e}{hint}", status=402 if isinstance(e, QuotaError)
                                   else 403, stop_run=True) from None
            except BadQuery as e:
                self._count("bad_queries")
                logger.warning("%s: the query gets no passages", e)
                return None
            except (Unavailable, ProviderError) as e:
                self._count("unavailable")
                logger.warning("web search unavailable for one query: %s", e)
                raise BackendError(f"web search unavailable: {e}", status=503,
                                   retry_after=getattr(e, "retry_after", None)) from None
        raise AssertionError("unreachable")  # pragma: no cover

    def _over_budget(self, message: str) -> WebHits:
        if self.on_budget == "stop":
            raise BackendError(f"{message}; raise the cap, or --web_on_budget continue to go on without web "
                               "results", status=402, stop_run=True)
        self._count("skipped")
        if not self._budget_logged:
            self._budget_logged = True
            logger.warning("%s: uncached queries get no passages from now on (--web_on_budget continue; cached "
                           "queries are still served)", message)
        return WebHits([], "skipped")

    def _count(self, key: str, value: float = 1) -> None:
        with self._lock:
            self.counts[key] += value

    def _log_cache(self, final: bool = False) -> None:
        if self.cache is None or not self.cache.lookups:
            return
        spend = "" if self.budget is None else f", {self.budget.calls} paid provider calls this run" + (
            f" (US${self.budget.usd:.2f})" if self.budget.usd is not None else "")
        logger.info("web cache%s: %d of %d lookups hit (%.1f%%)%s", " (final)" if final else "", self.cache.hits,
                    self.cache.lookups, 100.0 * self.cache.hit_rate, spend)

    def redact(self, text: str) -> str:
        """``text`` without the API key."""
        return redact(text, self._key)
