"""``WebIndex``: a web search provider behind the retriever's index interface (``search(queries, topk)``,
``info()``, ``close()``), so ``retriever.server`` serves it on ``/retrieve``, ``/queries`` and ``/health`` unchanged.

Per query: the :class:`~retriever.web.cache.QueryCache`; on a miss the :class:`~retriever.web.cache.RunBudget`, the
:class:`~retriever.web.ratelimit.RateLimiter`, one provider call (a 429 waits its Retry-After, up to
``max_retry_wait_s``, then tries again, at most ``retries_429`` times), the optional
:class:`~retriever.web.reader.PageReader`, and the answer is cached. The uncached queries of one batch go to the
provider concurrently (``concurrency`` threads, still paced by the rate limit).

A result becomes a passage ``{"id": url, "title", "text": snippet (or page text), "contents": "\\"title\\"\\ntext",
"score": 1 / rank}`` (web providers give no score; rank 1 scores 1.0); a missing title / snippet reads "No title." /
"No snippet available." as in Search-R1's ``serp_search_server.py:70-71``.

Failures become :class:`retriever.server.BackendError` answers (``provider`` module table): a refused key, an empty
account or (``on_budget="stop"``) the budget -> a 4xx with ``stop_run`` after which every request gets the same
answer; 5xx / timeouts / a 429 that outlasts the waits -> 503, which the client retries or fails over (queries of
the batch that were answered are cached, so the retry costs only the failed ones); another 4xx for one query -> no
passages for it. With ``on_budget="continue"`` a query the budget no longer covers gets no passages (cached queries
are still served) and is counted as ``skipped``.

Each query's list of passages is a :class:`WebHits` whose ``source`` says where it came from ("cache", "web",
"skipped"); the server sums them per request (``"web"`` in the ``/retrieve`` answer) for the client's counters.
"""

from __future__ import annotations

import hashlib
import logging
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from typing import Optional

import httpx

from ..server import BackendError
from .cache import BudgetExhausted, QueryCache, RunBudget
from .provider import (AuthError, BadQuery, Provider, ProviderAnswer, ProviderError, QuotaError, RateLimited,
                       SecretFilter, Unavailable, call, redact)
from .ratelimit import RateLimiter
from .reader import PageReader

logger = logging.getLogger("retriever.web")


class WebHits(list):
    """One query's passages; ``source`` is "cache", "web" or "skipped" (the budget is spent, ``continue`` mode)."""

    def __init__(self, passages=(), source: str = "web"):
        super().__init__(passages)
        self.source = source


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
        api_key: the provider's key (never logged; redacted from every message).
        endpoint: the provider's search URL (default its public one; a local stand-in in tests).
        cache: query cache (None: every query goes to the provider).
        budget: run budget (None: no cap).
        limiter: call pacing (None: none).
        reader: page text reader (None: passages are title + snippet).
        site: restrict every query to this site (`` site:<site>`` appended, as R1-Searcher's online eval does with
            en.wikipedia.org).
        on_budget: "stop" (the run stops when the budget is spent) or "continue" (no web passages from then on).
        timeout_s: deadline of one provider call, seconds.
        concurrency: provider calls in flight at once.
        max_retry_wait_s: longest Retry-After waited here, seconds; a longer one, or 429s past ``retries_429``
            calls again, answer 503 (with Retry-After) and the client's retry rules take over.
        retries_429: provider calls per query after a 429.
        default_retry_s: wait after a 429 without Retry-After, seconds, doubled on each further 429.
        log_every: log the cache hit rate every this many lookups.
    """

    def __init__(self, provider: Provider, api_key: str, endpoint: Optional[str] = None,
                 cache: Optional[QueryCache] = None, budget: Optional[RunBudget] = None,
                 limiter: Optional[RateLimiter] = None, reader: Optional[PageReader] = None, site: str = "",
                 on_budget: str = "stop", timeout_s: float = 10.0, concurrency: int = 8,
                 max_retry_wait_s: float = 60.0, retries_429: int = 3, default_retry_s: float = 1.0,
                 log_every: int = 100):
        if on_budget not in ("stop", "continue"):
            raise ValueError(f"on_budget must be stop or continue, got {on_budget!r}")
        if not api_key:
            raise ValueError(f"no API key for {provider.name}: set {provider.key_env}")
        self.provider, self._key = provider, api_key
        self.endpoint = endpoint or provider.default_endpoint
        self.cache, self.budget, self.limiter, self.reader = cache, budget, limiter, reader
        self.site = site.strip()
        self.on_budget = on_budget
        self.timeout_s, self.max_retry_wait_s = timeout_s, max_retry_wait_s
        self.retries_429, self.default_retry_s = retries_429, default_retry_s
        self.log_every = log_every
        # httpx logs every request URL at INFO, and SerpApi's URL carries the key
        self._log_filter = SecretFilter([api_key, getattr(reader, "api_key", None)])
        logging.getLogger("httpx").addFilter(self._log_filter)
        self._pool = ThreadPoolExecutor(max_workers=max(1, concurrency), thread_name_prefix="web-search")
        self._http = httpx.Client(limits=httpx.Limits(max_connections=max(1, concurrency) * 2))
        self._lock = threading.Lock()
        self._stopped: Optional[BackendError] = None
        self._budget_logged = False
        self.counts = {"calls": 0, "cache_hits": 0, "skipped": 0, "empty": 0, "rate_limited": 0,
                       "retry_after_wait_s": 0.0, "unavailable": 0, "bad_queries": 0}

    # ------------------------------------------------------------------ index interface
    def search(self, queries: list, topk: int) -> list:
        """Per query, a :class:`WebHits` of at most ``topk`` passages.

        Raises:
            BackendError: 403 / 402 with ``stop_run`` (refused key, empty account, budget in stop mode), or 503
                (the provider failed for at least one query; the others' answers are cached).
        """
        if self._stopped is not None:
            raise self._stopped
        unique = list(dict.fromkeys(queries))
        futures = {q: self._pool.submit(self._one, q, int(topk)) for q in unique}
        answers, stop, unavailable = {}, None, None
        for q, fut in futures.items():
            try:
                answers[q] = fut.result()
            except BackendError as e:
                if e.stop_run:
                    stop = stop or e
                else:
                    unavailable = unavailable or e
        if stop is not None:
            self._stopped = stop
            logger.error("%s", stop)
            raise stop
        if unavailable is not None:
            raise unavailable
        return [answers[q] for q in queries]

    def info(self) -> dict:
        """What ``GET /health`` reports: provider, endpoint, settings, fingerprint (hash of provider, endpoint,
        site and passage text), and under ``web`` the counters (``calls``: HTTP calls sent to the provider, 429
        retries included), the budget's spend and caps, the cache's hit rate."""
        variant = self._variant()
        ident = {"provider": self.provider.name, "endpoint": self.endpoint, "site": self.site, "variant": variant}
        fingerprint = hashlib.sha256(repr(sorted(ident.items())).encode()).hexdigest()[:16]
        cache = None if self.cache is None else {
            "path": self.cache.path, "lookups": self.cache.lookups, "hits": self.cache.hits,
            "hit_rate": round(self.cache.hit_rate, 4)}
        return {"backend": "web", "index_type": "web", "encoder": f"web:{self.provider.name}",
                "provider": self.provider.name, "endpoint": self.endpoint, "docs": self.provider.docs,
                "site": self.site or None, "passage_text": variant, "count": None, "dim": None, "corpus_path": None,
                "fingerprint": fingerprint,
                "web": {**self.counts, "retry_after_wait_s": round(self.counts["retry_after_wait_s"], 3),
                        "on_budget": self.on_budget, "budget": self.budget.info() if self.budget else None,
                        "cache": cache, "rate_limit_waits": self.limiter.waits if self.limiter else 0,
                        "page_reads": self.reader.reads if self.reader else 0,
                        "stopped": str(self._stopped) if self._stopped else None}}

    def close(self) -> None:
        self._pool.shutdown(wait=True, cancel_futures=True)
        self._http.close()
        logging.getLogger("httpx").removeFilter(self._log_filter)
        self._log_cache(final=True)
        if self.cache is not None:
            self.cache.close()

    # ------------------------------------------------------------------ one query
    def _variant(self) -> str:
        return self.reader.variant if self.reader else "snippet"

    def _one(self, query: str, topk: int) -> WebHits:
        sent = f"{query} site:{self.site}" if self.site else query
        variant = self._variant()
        if self.cache is not None:
            cached = self.cache.get(self.provider.name, sent, topk, variant)
            if self.cache.lookups % self.log_every == 0:
                self._log_cache()
            if cached is not None:
                self._count("cache_hits")
                return WebHits(cached, "cache")
        if self._stopped is not None:
            raise self._stopped
        if self.budget is not None:
            try:
                self.budget.reserve()
            except BudgetExhausted as e:
                return self._over_budget(str(e))
        credits = 0.0
        try:
            answer = self._call(sent, topk)
            credits = answer.credits if answer is not None else 0.0
        finally:
            if self.budget is not None:
                self.budget.settle(credits)
        if answer is None:  # the provider refused this query (a 4xx): no passages, nothing cached
            return WebHits([], "web")
        passages = passages_from_results(answer.results, self.provider.name)
        if self.reader is not None:
            for p, r in zip(passages, answer.results):
                page = self.reader.read(self._http, r.url, r.snippet)
                if page:
                    p["text"], p["contents"] = page, f'"{p["title"]}"\n{page}'
        if not passages:
            self._count("empty")
        if self.cache is not None:
            self.cache.put(self.provider.name, sent, topk, variant, passages)
        return WebHits(passages, "web")

    def _call(self, query: str, topk: int) -> Optional[ProviderAnswer]:
        """One provider answer (None: the provider refused the query), waiting out 429s; maps the provider errors
        to BackendError."""
        for attempt in range(self.retries_429 + 1):
            if self.limiter is not None:
                self.limiter.acquire()
            self._count("calls")
            try:
                return call(self.provider, self._http, self.endpoint, self._key, query, topk, self.timeout_s)
            except RateLimited as e:
                self._count("rate_limited")
                wait = e.retry_after if e.retry_after is not None else self.default_retry_s * 2 ** attempt
                if wait > self.max_retry_wait_s or attempt == self.retries_429:
                    self._count("unavailable")
                    raise BackendError(f"web search unavailable: {e}; Retry-After {wait:g}s "
                                       f"(waits past --web_max_retry_wait_s {self.max_retry_wait_s:g}s or "
                                       f"{self.retries_429} retries are left to the client)", status=503,
                                       retry_after=wait) from None
                logger.warning("%s; waiting %.1fs (Retry-After) before calling again", e, wait)
                self._count("retry_after_wait_s", wait)
                if self.limiter is not None:
                    self.limiter.pause(wait)  # every other call waits too
                else:
                    time.sleep(wait)
            except (AuthError, QuotaError) as e:
                hint = f"; check {self.provider.key_env}" if isinstance(e, AuthError) else ""
                raise BackendError(f"web search stopped: {e}{hint}", status=402 if isinstance(e, QuotaError)
                                   else 403, stop_run=True) from None
            except BadQuery as e:
                self._count("bad_queries")
                logger.warning("%s: the query gets no passages", e)
                return None
            except (Unavailable, ProviderError) as e:
                self._count("unavailable")
                raise BackendError(f"web search unavailable: {e}", status=503) from None
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
        spend = "" if self.budget is None else f", {self.budget.calls} provider calls this run" + (
            f" (US${self.budget.usd:.2f})" if self.budget.usd is not None else "")
        logger.info("web cache%s: %d of %d lookups hit (%.1f%%)%s", " (final)" if final else "", self.cache.hits,
                    self.cache.lookups, 100.0 * self.cache.hit_rate, spend)

    def redact(self, text: str) -> str:
        """``text`` without the API key."""
        return redact(text, self._key)
