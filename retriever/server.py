"""Retrieval service: FastAPI + uvicorn over one index directory.

    python -m retriever.server --index_dir D [--host 127.0.0.1] [--port 8000]
    python -m retriever.server --web serper|serpapi|searxng [--web_endpoint URL] [cost controls, see --help]

Endpoints:
- ``POST /retrieve`` (Search-R1's schema) ``{"queries": [...], "topk": 3, "return_scores": true}`` ->
  ``{"result": [[{"document": {"id","contents","title","text"}, "score": s}, ...], ...]}``; without
  ``return_scores`` each query gets a plain list of documents, as Search-R1's server returns. With
  ``"per_query_errors": true`` a bad query no longer rejects the request: it gets ``[]`` and its message in
  ``"errors"`` (one entry per query, null when served); ``/health`` advertises the mode and the limits.
- ``POST /queries`` (R1-Searcher's schema) ``{"queries": [...], "k": 3}`` ->
  ``{"queries": [...], "answers": [[contents, ...], ...]}``.
- ``GET /health`` -> index info and counters.

``--web PROVIDER`` serves a web search provider instead of an index (``retriever/web``): the same endpoints and
schemas, passages built from the provider's results, a query cache, a run budget and a rate limit; the API key comes
from the provider's environment variable (``SERPER_API_KEY``, ``SERPAPI_API_KEY``) and is never logged. A backend
failure is a :class:`BackendError` answer: 503 (the client retries / fails over) or, with ``"stop_run": true``, a 4xx
after which the run must stop (refused key, empty account, budget spent). The web backend searches every query on
its own (``ConcurrentSearcher``, no batches): with ``per_query_errors`` a query the provider could not serve now gets
``[]``, its message in ``errors`` and its index in ``"unavailable"`` (with ``"retry_after"``), so the client retries
it alone. Each ``/retrieve`` answer from the web backend carries ``"web": {"calls", "cache_hits", "skipped",
"credits", "usd"?}`` for its queries.

Dynamic micro-batching: requests that queue while the previous batch is being searched are encoded and
searched as one batch by a single worker thread, so the event loop never blocks; a request that finds the server
idle goes at once (``MicroBatcher``, ``retriever/searchers.py``). ``--no_batching`` searches each request on its
own (same worker thread), the baseline that ``benchmarks/bench_retriever.py`` measures micro-batching against.
Bad input gets a 4xx with a message and the server keeps serving. SIGTERM/SIGINT shut down cleanly (uvicorn's
handlers; in-flight requests finish).
"""


import argparse
import asyncio
import json
import logging
import math
import os
import signal
import socket
import sys
import time
from dataclasses import dataclass

from .errors import BackendError  # one class whether this module runs as __main__ or is imported
from .searchers import ConcurrentSearcher, MicroBatcher, PerRequestSearcher

logger = logging.getLogger("retriever.server")


@dataclass
class Limits:
    """Input limits; beyond them a request gets 413/422 instead of a slow or failing search."""

    max_query_chars: int = 4096
    max_queries: int = 1024
    max_topk: int = 100
    default_topk: int = 3
    max_body_bytes: int = 8 * 1024 * 1024


class BadRequest(ValueError):
    """Client error: ``status`` is the HTTP code (413 or 422)."""

    def __init__(self, message: str, status: int = 422):
        super().__init__(message)
        self.status = status


def validate_query(i: int, q, limits: Limits) -> str:
    """Check one query; returns it unchanged.

    Raises:
        BadRequest(422): not a string, blank, or not encodable as UTF-8 (a lone surrogate such as "\\ud800").
        BadRequest(413): longer than ``max_query_chars`` characters.
    """
    if not isinstance(q, str):
        raise BadRequest(f"queries[{i}] is a {type(q).__name__}, expected a string")
    if not q.strip():
        raise BadRequest(f"queries[{i}] is empty")
    try:
        q.encode("utf-8")
    except UnicodeEncodeError as e:  # a lone surrogate ("\ud800" in the JSON): cannot be echoed back
        raise BadRequest(f"queries[{i}] is not valid Unicode: {e.reason} at position {e.start}") from e
    if len(q) > limits.max_query_chars:
        raise BadRequest(f"queries[{i}] has {len(q)} characters > {limits.max_query_chars}", status=413)
    return q


def _validate_shape(queries, topk, limits: Limits) -> int:
    """The request-level checks (the list itself and topk); returns topk."""
    if not isinstance(queries, list) or not queries:
        raise BadRequest("'queries' must be a non-empty list of strings")
    if len(queries) > limits.max_queries:
        raise BadRequest(f"too many queries: {len(queries)} > {limits.max_queries} per request")
    if topk is None:
        topk = limits.default_topk
    if isinstance(topk, bool) or not isinstance(topk, int):
        raise BadRequest(f"topk must be an integer, got {topk!r}")
    if not 1 <= topk <= limits.max_topk:
        raise BadRequest(f"topk must be in [1, {limits.max_topk}], got {topk}")
    return topk


def validate_request(queries, topk, limits: Limits) -> tuple[list[str], int]:
    """Check queries/topk against ``limits``; returns (queries, topk). One bad query rejects the request
    (Search-R1's schema has no per-query error; see :func:`validate_request_per_query` for the mode that has).

    Raises:
        BadRequest(422): queries not a non-empty list of non-blank strings, too many queries, topk not an
            integer in [1, max_topk]. BadRequest(413): a query longer than ``max_query_chars`` characters.
    """
    topk = _validate_shape(queries, topk, limits)
    for i, q in enumerate(queries):
        validate_query(i, q, limits)
    return queries, topk


def validate_request_per_query(queries, topk, limits: Limits) -> tuple[list, int, list]:
    """``"per_query_errors": true`` requests: only request-level faults (not a list, empty list, more than
    ``max_queries``, bad topk) reject the request; a bad query gets its own error and the others are served
    (so one query the server refuses does not fail every search coalesced with it).

    Returns:
        (queries, topk, errors): ``errors[i]`` is None for a query that will be searched, else the message
        :func:`validate_query` gave (the same text a whole-request rejection would carry).
    Raises:
        BadRequest(422): a request-level fault.
    """
    topk = _validate_shape(queries, topk, limits)
    errors = []
    for i, q in enumerate(queries):
        try:
            validate_query(i, q, limits)
            errors.append(None)
        except BadRequest as e:
            errors.append(str(e))
    return queries, topk, errors


def backend_failures(results: list) -> list:
    """Indices of the queries whose result is a :class:`BackendError` (the backend's per-query failures).

    Raises:
        BackendError: the first that says the run must stop (the whole request gets it), or the first 503 (with
            the longest Retry-After among them) when every query failed."""
    failed = [i for i, r in enumerate(results) if isinstance(r, BackendError)]
    if not failed:
        return failed
    stop = next((results[i] for i in failed if results[i].stop_run), None)
    if stop is not None:
        raise stop
    if len(failed) == len(results):
        waits = [results[i].retry_after for i in failed if results[i].retry_after]
        first = results[failed[0]]
        raise BackendError(str(first), status=first.status, retry_after=max(waits) if waits else None)
    return failed


def _raise_first_failure(results: list) -> None:
    """A request without per-query errors fails whole: a stop first, else the 503 with the longest Retry-After."""
    failed = backend_failures(results)
    if failed:
        waits = [results[i].retry_after for i in failed if results[i].retry_after]
        first = results[failed[0]]
        raise BackendError(str(first), status=first.status, retry_after=max(waits) if waits else None)


def web_counts(results: list) -> dict | None:
    """Per request, where its queries' passages came from (``WebHits.source`` of the web backend) and what they
    cost: ``{"calls", "cache_hits", "skipped", "credits", "usd"?}`` (``usd`` when the price is known: set with
    ``--web_usd_per_1k``, or 0 for a free engine); None for an index (its lists carry no source)."""
    sources = [getattr(hits, "source", None) for hits in results]
    if not any(sources):
        return None
    counts = {"calls": sources.count("web"), "cache_hits": sources.count("cache"), "skipped": sources.count("skipped"),
              "credits": sum(getattr(h, "credits", 0.0) for h in results)}
    usd = [getattr(h, "usd", None) for h in results if getattr(h, "source", None) == "web"]
    if usd and all(u is not None for u in usd):
        counts["usd"] = sum(usd)
    return counts


def _document(p: dict) -> dict:
    return {"id": p["id"], "contents": p["contents"], "title": p["title"], "text": p["text"]}


def _make_searcher(index, batching: bool, window_ms: float, max_batch_queries: int, max_wait_ms: float):
    """The searcher that serves ``index``: one search per query for a web backend, else micro-batches or, with
    ``batching=False``, one search per request."""
    if getattr(index, "independent_queries", False):
        return ConcurrentSearcher(index)
    if batching:
        return MicroBatcher(index, window_ms=window_ms, max_batch_queries=max_batch_queries, max_wait_ms=max_wait_ms)
    return PerRequestSearcher(index)


async def _json_body(request, limits: Limits) -> dict:
    """The request's JSON object; ``BadRequest`` (413) past ``limits.max_body_bytes``, (400) when malformed."""
    # counted while reading: a chunked body (no Content-Length) is cut off at the limit instead of being
    # read whole first (Starlette's request.body() buffers everything; a 256 MiB body grew the server by 384 MiB)
    parts, size = [], 0
    async for chunk in request.stream():
        size += len(chunk)
        if size > limits.max_body_bytes:
            raise BadRequest(f"request body over {limits.max_body_bytes} bytes (read {size} so far)", status=413)
        parts.append(chunk)
    raw = b"".join(parts)
    try:
        body = json.loads(raw)
    except (ValueError, UnicodeDecodeError) as e:
        raise BadRequest(f"malformed JSON body: {e}") from e
    except RecursionError as e:  # e.g. [[[[...]]]] thousands deep
        raise BadRequest("malformed JSON body: nested too deeply") from e
    if not isinstance(body, dict):
        raise BadRequest("request body must be a JSON object")
    return body


def _health(index, batcher, limits: Limits, batching: bool) -> dict:
    """``GET /health``: the index's info, the searcher's counters and the input limits."""
    s = batcher.stats
    return {"status": "ok", **index.info(),
            "stats": {"requests": s.requests, "queries": s.queries, "batches": s.batches, "errors": s.errors,
                      "batching": batching, "waits": s.waits,
                      "max_batch_queries_seen": s.max_batch_queries_seen,
                      "busy_seconds": round(s.busy_seconds, 3),
                      "uptime_seconds": round(time.time() - s.started_at, 1)},
            "limits": limits.__dict__, "per_query_errors": True}


async def _search_per_query(body: dict, batcher, limits: Limits) -> tuple[list, list, list]:
    """A ``per_query_errors`` request searched: ``(results, errors, unavailable)``; a bad query gets ``[]`` and its
    message in ``errors``, a query the backend could not serve now also its ``(index, retry_after)`` in
    ``unavailable``."""
    queries, topk, errors = validate_request_per_query(body.get("queries"), body.get("topk"), limits)
    good = [i for i, err in enumerate(errors) if err is None]
    found = await batcher.search([queries[i] for i in good], topk) if good else []
    results = [[] for _ in queries]
    unavailable = []
    failed = set(backend_failures(found))
    for j, (i, hits) in enumerate(zip(good, found)):
        if j in failed:  # this query alone could not be served now: the client retries it
            errors[i] = str(hits)
            unavailable.append((i, hits.retry_after))
        else:
            results[i] = hits
    return results, errors, unavailable


async def _retrieve(body: dict, batcher, limits: Limits) -> dict:
    """``POST /retrieve`` (Search-R1's schema) for a parsed body."""
    return_scores = body.get("return_scores", False)
    per_query = body.get("per_query_errors", False)
    for name, value in (("return_scores", return_scores), ("per_query_errors", per_query)):
        if not isinstance(value, bool):
            raise BadRequest(f"{name} must be true or false")
    errors, unavailable = None, []
    if per_query:
        results, errors, unavailable = await _search_per_query(body, batcher, limits)
    else:
        queries, topk = validate_request(body.get("queries"), body.get("topk"), limits)
        results = await batcher.search(queries, topk)
        _raise_first_failure(results)
    if return_scores:
        out = {"result": [[{"document": _document(p), "score": p["score"]} for p in hits] for hits in results]}
    else:
        out = {"result": [[_document(p) for p in hits] for hits in results]}
    if errors is not None:
        out["errors"] = errors
    if unavailable:  # per-query errors worth retrying (a provider outage for these queries), not rejections
        out["unavailable"] = [i for i, _ in unavailable]
        waits = [w for _, w in unavailable if w]
        out["retry_after"] = max(waits) if waits else None
    counts = web_counts(results)
    if counts is not None:
        out["web"] = counts
    return out


async def _queries(body: dict, batcher, limits: Limits) -> dict:
    """``POST /queries`` (R1-Searcher's schema) for a parsed body."""
    queries, topk = validate_request(body.get("queries"), body.get("k", body.get("topk")), limits)
    results = await batcher.search(queries, topk)
    _raise_first_failure(results)
    out = {"queries": queries, "answers": [[p["contents"] for p in hits] for hits in results]}
    counts = web_counts(results)
    if counts is not None:
        out["web"] = counts
    return out


def _add_error_handlers(app, limits: Limits) -> None:
    """Bad input and backend failures as JSON answers: 413 for a declared body past the limit, ``BadRequest``'s
    status, ``BackendError``'s status with ``stop_run`` and Retry-After, 422 for a schema error."""
    from fastapi import Request
    from fastapi.exceptions import RequestValidationError
    from fastapi.responses import JSONResponse

    @app.middleware("http")
    async def limit_body(request: Request, call_next):
        length = request.headers.get("content-length")
        if length is not None and length.isdigit() and int(length) > limits.max_body_bytes:
            return JSONResponse({"detail": f"request body {length} bytes > {limits.max_body_bytes}"}, 413)
        return await call_next(request)

    @app.exception_handler(BadRequest)
    async def bad_request(_request, exc: BadRequest):
        return JSONResponse({"detail": str(exc)}, status_code=exc.status)

    @app.exception_handler(BackendError)
    async def backend_error(_request, exc: BackendError):
        # rounded up: a client that waits what the header says never comes back before the provider's pause ends
        headers = {"Retry-After": str(max(1, math.ceil(exc.retry_after)))} if exc.retry_after else None
        return JSONResponse({"detail": str(exc), "stop_run": exc.stop_run}, status_code=exc.status, headers=headers)

    @app.exception_handler(RequestValidationError)
    async def invalid(_request, exc: RequestValidationError):
        return JSONResponse({"detail": jsonable_errors(exc)}, status_code=422)


def create_app(index, limits: Limits | None = None, window_ms: float = 2.0, max_batch_queries: int = 512,
               max_wait_ms: float = 50.0, batching: bool = True, added_latency_ms: float = 0.0):
    """The FastAPI application serving ``index`` (anything with ``search(queries, topk)`` and ``info()``).

    ``batching=False`` serves each request with its own search (``PerRequestSearcher``) instead of the
    ``MicroBatcher``; ``window_ms``, ``max_batch_queries`` and ``max_wait_ms`` then have no effect.
    ``added_latency_ms``: every ``/retrieve`` answer waits this long first (a benchmark's stand-in for a remote or
    loaded retriever, so that asynchronous training has retrieval time to hide); 0 in production."""
    from contextlib import asynccontextmanager

    from fastapi import FastAPI, Request

    limits = limits or Limits()
    batcher = _make_searcher(index, batching, window_ms, max_batch_queries, max_wait_ms)

    @asynccontextmanager
    async def lifespan(app):
        await batcher.start()
        logger.info("retriever ready: %s", json.dumps(index.info()))
        yield
        await batcher.stop()
        logger.info("retriever stopped after %d requests", batcher.stats.requests)

    app = FastAPI(title="openrlhf-search retriever", lifespan=lifespan)
    app.state.batcher = batcher
    app.state.limits = limits
    _add_error_handlers(app, limits)

    @app.get("/health")
    async def health():
        return _health(index, batcher, limits, batching)

    @app.post("/retrieve")
    async def retrieve(request: Request):
        out = await _retrieve(await _json_body(request, limits), batcher, limits)
        if added_latency_ms > 0:
            await asyncio.sleep(added_latency_ms / 1000.0)
        return out

    @app.post("/queries")
    async def queries_endpoint(request: Request):
        return await _queries(await _json_body(request, limits), batcher, limits)

    return app


def jsonable_errors(exc) -> list:
    return [{"loc": list(e.get("loc", ())), "msg": e.get("msg", "")} for e in exc.errors()]


def bind_socket(host: str, port: int) -> socket.socket:
    """A listening TCP socket (port 0 = any free port); SO_REUSEADDR so a restart can take the same port."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind((host, port))
    sock.listen(2048)
    sock.set_inheritable(True)
    return sock


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m retriever.server", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    source = p.add_mutually_exclusive_group(required=True)
    source.add_argument("--index_dir", help="folder made by python -m retriever.build_index")
    source.add_argument("--web", metavar="PROVIDER", choices=WEB_PROVIDERS,
                        help="serve a web search provider instead of an index: serper (API key in $SERPER_API_KEY), "
                             "serpapi (API key in $SERPAPI_API_KEY) or searxng (a self-hosted SearxNG instance, no "
                             "key, no charge: give its URL with --web_endpoint); the key is never logged")
    p.add_argument("--host", default="127.0.0.1", help="bind address (default loopback only)")
    p.add_argument("--port", type=int, default=8000, help="TCP port; 0 picks a free one (see --port_file)")
    p.add_argument("--port_file", default=None, help="write the bound port here once listening")
    p.add_argument("--topk", type=int, default=3, help="top-k when a request gives none")
    p.add_argument("--max_topk", type=int, default=100)
    p.add_argument("--max_queries", type=int, default=1024, help="queries per request")
    p.add_argument("--max_query_chars", type=int, default=4096)
    p.add_argument("--batch_window_ms", type=float, default=2.0,
                   help="shortest wait for more requests when a batch is smaller than the previous one")
    p.add_argument("--no_batching", action="store_true",
                   help="micro-batching off: search each request on its own (the benchmark's baseline mode)")
    p.add_argument("--batch_max_wait_ms", type=float, default=50.0,
                   help="longest stretch of the window while a batch refills (see MicroBatcher)")
    p.add_argument("--max_batch_queries", type=int, default=512, help="queries per encoder/search batch")
    p.add_argument("--device", default=None, help="query encoder device (dense indexes)")
    p.add_argument("--no_faiss_gpu", action="store_true", help="keep the faiss index on CPU even with GPUs")
    p.add_argument("--gpus", default=None,
                   help="GPUs of the dense index and its query encoder: all, none or ids (6,7); default "
                        "RETRIEVER_GPUS, else all")
    p.add_argument("--faiss_temp_gb", type=float, default=None,
                   help="faiss temporary memory per GPU, GiB (default RETRIEVER_FAISS_TEMP_GB, else 1.5)")
    p.add_argument("--nprobe", type=int, default=None, help="IVF-PQ cells per query (overrides the manifest)")
    p.add_argument("--ef_search", type=int, default=None, help="HNSW efSearch (overrides the manifest)")
    p.add_argument("--dedup", action="store_true",
                   help="no two passages with the same text (lower-cased, whitespace collapsed) in one result list")
    p.add_argument("--added_latency_ms", type=float, default=0.0,
                   help="wait this long before every /retrieve answer, ms (benchmarks: a slow retriever; default 0)")
    p.add_argument("--log_level", default="info")
    w = p.add_argument_group("web search (--web)", "cost and safety controls; docs/retriever.md, 'Web search'")
    w.add_argument("--web_endpoint", default=None,
                   help="the provider's search URL (default its public one: https://google.serper.dev/search, "
                        "https://serpapi.com/search); a local stand-in for tests")
    w.add_argument("--web_key_env", default=None,
                   help="environment variable holding the API key (default SERPER_API_KEY / SERPAPI_API_KEY)")
    w.add_argument("--web_cache", default="web_cache.sqlite",
                   help="SQLite query cache, kept across restarts and shared by servers (default ./web_cache.sqlite; "
                        "'none': no cache)")
    w.add_argument("--web_cache_max_age_days", type=float, default=None,
                   help="cached answers older than this are fetched again (default: kept forever)")
    w.add_argument("--web_cache_max_entries", type=int, default=None,
                   help="most answers kept in the cache; past it the oldest are dropped (default: no cap)")
    w.add_argument("--web_max_queries", type=int, default=10000,
                   help="most paid provider calls (answered queries) in this run; cache hits and failed attempts are "
                        "free; default 10000")
    w.add_argument("--web_max_usd", type=float, default=None,
                   help="most money for this run, US$ (needs --web_usd_per_1k)")
    w.add_argument("--web_usd_per_1k", type=float, default=None,
                   help="your plan's price of 1,000 searches (provider credits), US$")
    w.add_argument("--web_run", default=None,
                   help="run name: the budget's spend is kept in the cache file under it, so a restarted server "
                        "goes on counting the same run (default: counted from zero at each start)")
    w.add_argument("--web_on_budget", choices=("stop", "continue"), default="stop",
                   help="budget reached: stop (the run stops with the message) or continue (uncached queries get no "
                        "passages; cached ones are still served)")
    w.add_argument("--web_qps", type=float, default=5.0, help="most provider calls per second (0: no pacing)")
    w.add_argument("--web_concurrency", type=int, default=8, help="provider calls in flight at once")
    w.add_argument("--web_timeout_s", type=float, default=10.0,
                   help="total deadline of one provider call or page read, from connecting to the last byte, seconds")
    w.add_argument("--web_max_retry_wait_s", type=float, default=30.0,
                   help="longest Retry-After of a 429 waited here; a longer one answers 503 (the client retries)")
    w.add_argument("--web_retries_429", type=int, default=3, help="provider calls per query after a 429")
    w.add_argument("--web_site", default="",
                   help="restrict queries to a site (appends ' site:SITE'; R1-Searcher's online eval: "
                        "en.wikipedia.org)")
    w.add_argument("--web_reader_endpoint", default=None,
                   help="reader service for page text (GET ENDPOINT/<page url>, Jina Reader's convention, e.g. "
                        "https://r.jina.ai; key in $WEB_READER_API_KEY); default: title + snippet only")
    w.add_argument("--web_page_words", type=int, default=200, help="words of page text per passage (with a reader)")
    w.add_argument("--web_reader_qps", type=float, default=5.0, help="most page reads per second (0: no pacing)")
    w.add_argument("--web_max_page_reads", type=int, default=None,
                   help="most pages read in this run; past it passages keep their snippet (default: no cap)")
    a = p.parse_args(argv)
    # limits that would make the server refuse every request (or hold it forever) are refused at start
    for name in ("max_topk", "max_queries", "max_query_chars", "max_batch_queries"):
        if getattr(a, name) < 1:
            p.error(f"--{name} must be >= 1, got {getattr(a, name)}")
    if not 1 <= a.topk <= a.max_topk:
        p.error(f"--topk must be in [1, --max_topk {a.max_topk}], got {a.topk}")
    for name in ("batch_window_ms", "batch_max_wait_ms", "added_latency_ms", "web_qps", "web_max_retry_wait_s",
                 "web_reader_qps"):
        if not 0 <= getattr(a, name) < float("inf"):  # NaN fails too
            p.error(f"--{name} must be a finite number >= 0, got {getattr(a, name)}")
    for name in ("web_max_queries", "web_max_usd", "web_usd_per_1k", "web_retries_429", "web_cache_max_age_days",
                 "web_max_page_reads"):
        if getattr(a, name) is not None and not 0 <= getattr(a, name) < float("inf"):
            p.error(f"--{name} must be a finite number >= 0, got {getattr(a, name)}")
    for name in ("web_concurrency", "web_page_words"):
        if getattr(a, name) < 1:
            p.error(f"--{name} must be >= 1, got {getattr(a, name)}")
    if not 0 < a.web_timeout_s < float("inf"):
        p.error(f"--web_timeout_s must be a finite number > 0, got {a.web_timeout_s}")
    if a.web_cache_max_entries is not None and a.web_cache_max_entries < 1:
        p.error(f"--web_cache_max_entries must be >= 1, got {a.web_cache_max_entries}")
    if a.web_max_usd is not None and not a.web_usd_per_1k:
        p.error("--web_max_usd needs --web_usd_per_1k (your plan's US$ per 1,000 searches)")
    return a


WEB_PROVIDERS = ("serper", "serpapi", "searxng")
READER_KEY_ENV = "WEB_READER_API_KEY"


def load_web_index(a: argparse.Namespace):
    """The ``WebIndex`` the ``--web*`` flags describe. Raises ValueError (one line) on a missing key or bad value."""
    from .web import get_provider
    from .web.backend import WebIndex
    from .web.cache import QueryCache, RunBudget
    from .web.ratelimit import RateLimiter
    from .web.reader import PageReader

    provider = get_provider(a.web)
    key_env = a.web_key_env or provider.key_env
    key = os.environ.get(key_env, "").strip()
    if not key and provider.needs_key:
        raise ValueError(f"no API key for --web {a.web}: set the environment variable {key_env}")
    if a.web == "searxng" and not a.web_endpoint:
        raise ValueError("--web searxng needs --web_endpoint: your instance's search URL, e.g. "
                         "http://127.0.0.1:8888/search")
    cache = None
    if a.web_cache and a.web_cache.lower() != "none":
        max_age = None if a.web_cache_max_age_days is None else a.web_cache_max_age_days * 86400.0
        cache = QueryCache(a.web_cache, max_age_s=max_age, max_entries=a.web_cache_max_entries)
    budget = RunBudget(a.web_max_queries, a.web_max_usd, a.web_usd_per_1k, store=cache, run=a.web_run)
    reader = None
    if a.web_reader_endpoint:
        reader = PageReader(a.web_reader_endpoint, os.environ.get(READER_KEY_ENV) or None, a.web_page_words,
                            a.web_timeout_s)
    return WebIndex(provider, key, endpoint=a.web_endpoint, cache=cache, budget=budget,
                    limiter=RateLimiter(a.web_qps), reader=reader, reader_limiter=RateLimiter(a.web_reader_qps),
                    max_page_reads=a.web_max_page_reads, site=a.web_site, on_budget=a.web_on_budget,
                    timeout_s=a.web_timeout_s, concurrency=a.web_concurrency, max_retry_wait_s=a.web_max_retry_wait_s,
                    retries_429=a.web_retries_429)


def main(argv=None) -> int:
    a = parse_args(argv)
    logging.basicConfig(level=a.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    if a.web:  # no log line may carry a key (httpx logs SerpApi's request URL, which holds it, at INFO)
        from .web import get_provider
        from .web.provider import SecretFilter

        key_env = a.web_key_env or get_provider(a.web).key_env
        secrets = SecretFilter([os.environ.get(key_env, "").strip(), os.environ.get(READER_KEY_ENV, "").strip()])
        for handler in logging.getLogger().handlers:
            handler.addFilter(secrets)
        logging.getLogger("httpx").setLevel(max(logging.WARNING, logging.getLogger().level))
    import uvicorn

    from .index import RetrieverIndexError, load_index

    try:
        if a.web:
            index = load_web_index(a)
        else:
            index = load_index(a.index_dir, device=a.device, faiss_gpu=not a.no_faiss_gpu, nprobe=a.nprobe,
                               ef_search=a.ef_search, dedup=a.dedup, gpus=a.gpus, faiss_temp_gb=a.faiss_temp_gb)
    except (RetrieverIndexError, FileNotFoundError, ValueError) as e:  # ValueError: the encoder cannot load
        print(f"retriever.server: error: {e}", file=sys.stderr)
        return 2
    limits = Limits(max_query_chars=a.max_query_chars, max_queries=a.max_queries, max_topk=a.max_topk,
                    default_topk=a.topk)
    app = create_app(index, limits, window_ms=a.batch_window_ms, max_batch_queries=a.max_batch_queries,
                     max_wait_ms=a.batch_max_wait_ms, batching=not a.no_batching,
                     added_latency_ms=a.added_latency_ms)
    try:
        sock = bind_socket(a.host, a.port)
    except OSError as e:
        print(f"retriever.server: cannot bind {a.host}:{a.port}: {e}", file=sys.stderr)
        return 2
    port = sock.getsockname()[1]
    if a.port_file:
        tmp = a.port_file + ".tmp"
        with open(tmp, "w") as f:
            f.write(str(port))
        os.replace(tmp, a.port_file)
    if a.web:
        b = index.budget
        logger.info("web search: %s at %s%s; cache %s; at most %s paid provider calls%s this run (%s when reached); "
                    "%s calls/s", a.web, index.endpoint, f", site:{a.web_site}" if a.web_site else "",
                    a.web_cache if index.cache else "off", b.max_queries if b.max_queries is not None else "unlimited",
                    f" and US${b.max_usd:g}" if b.max_usd is not None else "", a.web_on_budget,
                    a.web_qps or "unlimited")
    logger.info("serving %s on http://%s:%d (micro-batching %s)", a.index_dir or f"web search ({a.web})", a.host,
                port, "off" if a.no_batching else "on")
    config = uvicorn.Config(app, log_level=a.log_level, access_log=False, timeout_graceful_shutdown=10)
    server = uvicorn.Server(config)
    # uvicorn handles SIGTERM/SIGINT (graceful shutdown), then re-raises the signal against the handlers
    # that were in place before it ran; these record it, so a requested stop exits with status 0.
    received: list[int] = []
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda s, _frame: received.append(s))
    server.run(sockets=[sock])
    index.close()
    if received:
        logger.info("stopped cleanly on %s", signal.Signals(received[0]).name)
    return 0


if __name__ == "__main__":
    sys.exit(main())
