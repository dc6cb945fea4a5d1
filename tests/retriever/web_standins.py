"""Local stand-ins of the web search providers, for tests without the internet.

Each speaks its provider's documented request and answer (the pages named in ``retriever/web/serper.py`` and
``retriever/web/serpapi.py``):

- Serper (https://serper.dev, the API playground): ``POST /search`` with header ``X-API-KEY`` and JSON body
  ``{"q", "num"}``; answer ``{"searchParameters", "organic": [{"title", "link", "snippet", "position"}], "credits"}``;
  a wrong key gets 403 ``{"message": "Unauthorized.", "statusCode": 403}``.
- SerpApi (https://serpapi.com/search-api, https://serpapi.com/search-errors,
  https://serpapi.com/api-status-and-error-codes): ``GET /search?engine=google&q=...&api_key=...``; answer
  ``{"search_metadata": {"status": "Success"}, "organic_results": [{"position", "title", "link", "snippet"}],
  "answer_box"?, "related_questions"?}``; no results = 200 with ``"error": "Google hasn't returned any results for
  this query."``; a wrong key gets 401 ``{"error": "Invalid API key. ..."}``; an empty account 429 ``{"error": "Your
  account has run out of searches."}``.

- SearxNG (https://docs.searxng.org/dev/search_api.html): ``GET /search?q=...&format=json``; answer ``{"query",
  "number_of_results", "results": [{"url", "title", "content", "engine"}], "answers", "suggestions",
  "unresponsive_engines"}``; without ``format=json`` (the JSON format not enabled) 403.

A stand-in also serves a reader (``GET /read/<page url>``, Jina Reader's convention) returning a page as HTML.
Behaviour is set per test through attributes (``mode``, ``retry_after``, ``fail_first``, ``delay_s``, ...); every
request received is recorded in ``requests``.
"""

import json
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from urllib.parse import parse_qs, unquote, urlparse

import httpx
import pytest

KEY = "sk-test-5b1f0c9e7d2a4e33"  # the key the stand-ins accept; must never show up in a log or message
LOOPBACK = ("127.0.0.1", "localhost")


@pytest.fixture(autouse=True)
def no_real_provider(monkeypatch):
    """Import it into a test module: any httpx request to a host other than the loopback (a provider's default
    endpoint left in place) fails the test, in this process and its threads."""
    real = httpx.HTTPTransport.handle_request
    real_async = httpx.AsyncHTTPTransport.handle_async_request

    def guarded(self, request):
        assert request.url.host in LOOPBACK, f"a test tried to reach {request.url.host}"
        return real(self, request)

    async def guarded_async(self, request):
        assert request.url.host in LOOPBACK, f"a test tried to reach {request.url.host}"
        return await real_async(self, request)

    monkeypatch.setattr(httpx.HTTPTransport, "handle_request", guarded)
    monkeypatch.setattr(httpx.AsyncHTTPTransport, "handle_async_request", guarded_async)


def page_html(url: str) -> str:
    """The page the reader serves for ``url``: markup, a script, navigation, then the paragraph holding the
    snippet text."""
    return (f"<html><head><title>t</title><style>p {{color: red}}</style></head><body>"
            f"<nav><a href='/'>Home</a> | <a href='/x'>Menu</a></nav><script>var secret = 1;</script>"
            f"<h1>Page of {url}</h1><p>Unrelated opening words that come first on the page.</p>"
            f"<p>The <b>answer</b> paragraph says that the result snippet text for this page is here, "
            f"and more words follow after it: " + " ".join(f"w{i}" for i in range(400)) + "</p></body></html>")


class ProviderStandIn:
    """One provider's local server on 127.0.0.1 (a free port), started on construction.

    Attributes:
        provider: "serper" or "serpapi".
        mode: "ok", "empty", "429", "500", "timeout_like" (answers after ``delay_s``), "quota", "badquery",
            "429quota" (a transient 429 whose text mentions quota and credits, with ``retry_after``), "nonjson" (a
            200 that is an HTML page), "trickle" (a 200 whose body comes one byte every ``trickle_s``).
        fail_if: a query for which this returns True always gets the provider's 5xx (the others are served).
        hold: a query for which this returns True waits until ``release`` is set before it is answered.
        retry_after: the Retry-After header value of a 429 (None: no header).
        fail_first: with mode "429" / "500": fail only this many calls, then answer normally (None: always).
        delay_s: seconds every search answer waits.
        credits: Serper's ``credits`` field.
        requests: what was received, one dict per request.
    """

    def __init__(self, provider: str):
        self.provider = provider
        self.mode = "ok"
        self.retry_after = None
        self.fail_first = None
        self.delay_s = 0.0
        self.credits = 1
        self.trickle_s = 0.2
        self.trickling = False  # a trickled body is being sent right now
        self.fail_if = None
        self.hold = None
        self.release = threading.Event()
        self.requests = []
        self._failed = 0
        self._lock = threading.Lock()
        standin = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *args):  # quiet
                pass

            def do_GET(self):
                standin._handle(self, "GET", None)

            def do_POST(self):
                length = int(self.headers.get("content-length") or 0)
                standin._handle(self, "POST", self.rfile.read(length))

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.server.daemon_threads = True
        self.thread = threading.Thread(target=self.server.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True)
        self.thread.start()

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.server.server_address[1]}"

    @property
    def search_url(self) -> str:
        return self.url + "/search"

    @property
    def searches(self) -> list:
        return [r for r in self.requests if r["path"] == "/search"]

    def close(self) -> None:
        self.release.set()
        self.server.shutdown()
        self.server.server_close()

    # ------------------------------------------------------------------ answers
    def _send(self, h, status, body, headers=None):
        data = body.encode() if isinstance(body, str) else json.dumps(body).encode()
        h.send_response(status)
        h.send_header("Content-Type", "text/html" if isinstance(body, str) else "application/json")
        h.send_header("Content-Length", str(len(data)))
        for k, v in (headers or {}).items():
            h.send_header(k, v)
        h.end_headers()
        h.wfile.write(data)

    def _handle(self, h, method, raw):
        parsed = urlparse(h.path)
        if parsed.path.startswith("/read/"):
            url = unquote(h.path[len("/read/"):])
            self.requests.append({"method": method, "path": "/read", "url": url,
                                  "authorization": h.headers.get("Authorization")})
            return self._send(h, 200, page_html(url))
        params = {k: v[0] for k, v in parse_qs(parsed.query).items()}
        body = json.loads(raw) if raw else None
        self.requests.append({"method": method, "path": parsed.path, "params": params, "json": body,
                              "headers": {k.lower(): v for k, v in h.headers.items()}, "t": time.monotonic()})
        if parsed.path != "/search":
            return self._send(h, 404, {"error": "not found"})
        if self.delay_s:
            time.sleep(self.delay_s)
        q = (body or {}).get("q") if self.provider == "serper" else params.get("q")
        if self.hold is not None and q and self.hold(q):
            self.release.wait(60)
        if self.mode == "nonjson":
            return self._send(h, 200, "<html><body>Service temporarily moved</body></html>")
        if self.mode == "trickle":
            return self._trickle(h)
        if self.fail_if is not None and q and self.fail_if(q):
            return self._send(h, 500, {"message": "Internal server error", "statusCode": 500})
        if self.mode == "429quota" and self._should_fail():
            return self._send(h, 429, {"message": "Rate limit exceeded: per-second quota, credits are not charged "
                                                  "for this request", "statusCode": 429},
                              {"Retry-After": str(self.retry_after)} if self.retry_after is not None else None)
        if self.provider == "serper":
            return self._serper(h, method, body or {})
        if self.provider == "searxng":
            return self._searxng(h, method, params)
        return self._serpapi(h, method, params)

    def _trickle(self, h):
        data = json.dumps({"organic": [], "credits": 1}).encode()
        h.send_response(200)
        h.send_header("Content-Type", "application/json")
        h.send_header("Content-Length", str(len(data)))
        h.end_headers()
        self.trickling = True
        try:
            for i in range(len(data)):
                h.wfile.write(data[i:i + 1])
                h.wfile.flush()
                time.sleep(self.trickle_s)
        except OSError:  # the caller gave up (its deadline): what a trickling provider sees
            pass
        finally:
            self.trickling = False

    def _searxng(self, h, method, params):
        if params.get("format") != "json":
            return self._send(h, 403, "<html><body>403 Forbidden</body></html>")
        q = params.get("q", "")
        results = [] if self.mode == "empty" else [
            {"url": f"https://example.org/{i}", "title": f"{q} result {i}", "engine": "duckduckgo",
             "content": f"the result snippet text for this page is here ({q}, {i})", "score": 1.0 / i}
            for i in range(1, 11)]
        return self._send(h, 200, {"query": q, "number_of_results": len(results), "results": results,
                                   "answers": [], "corrections": [], "infoboxes": [], "suggestions": [],
                                   "unresponsive_engines": []})

    @property
    def provider_calls(self) -> list:
        """The queries of the search requests received, in order."""
        return [(r["json"] or {}).get("q") if self.provider == "serper" else r["params"].get("q")
                for r in self.searches]

    def _should_fail(self) -> bool:
        with self._lock:
            if self.fail_first is not None and self._failed >= self.fail_first:
                return False
            self._failed += 1
            return True

    def _serper(self, h, method, body):
        if method != "POST":
            return self._send(h, 405, {"message": "Method Not Allowed", "statusCode": 405})
        if h.headers.get("X-API-KEY") != KEY:
            return self._send(h, 403, {"message": "Unauthorized.", "statusCode": 403})
        q, num = body.get("q"), body.get("num", 10)
        if self.mode == "quota":
            return self._send(h, 400, {"message": "Not enough credits", "statusCode": 400})
        if self.mode == "badquery":
            return self._send(h, 400, {"message": "Query too long.", "statusCode": 400})
        if self.mode in ("429", "500") and self._should_fail():
            if self.mode == "429":
                return self._send(h, 429, {"message": "Too many requests", "statusCode": 429},
                                  {"Retry-After": str(self.retry_after)} if self.retry_after is not None else None)
            return self._send(h, 500, {"message": "Internal server error", "statusCode": 500})
        organic = [] if self.mode == "empty" else [
            {"title": f"{q} result {i}", "link": f"https://example.org/{i}?q={q.replace(' ', '+')}",
             "snippet": f"the result snippet text for this page is here ({q}, {i})", "position": i}
            for i in range(1, min(int(num), 10) + 1)]
        return self._send(h, 200, {"searchParameters": {"q": q, "type": "search", "engine": "google", "num": num},
                                   "organic": organic, "relatedSearches": [], "credits": self.credits})

    def _serpapi(self, h, method, params):
        if method != "GET":
            return self._send(h, 405, {"error": "Method not allowed."})
        if params.get("api_key") != KEY:
            return self._send(h, 401, {"error": "Invalid API key. Your API key should be here: "
                                                "https://serpapi.com/manage-api-key"})
        if params.get("engine") != "google" or not params.get("q"):
            return self._send(h, 400, {"error": "Missing query `q` parameter."})
        q = params["q"]
        if self.mode == "quota":
            return self._send(h, 429, {"error": "Your account has run out of searches."})
        if self.mode in ("429", "500") and self._should_fail():
            if self.mode == "429":
                return self._send(h, 429, {"error": "The number of requests sent using this API key exceeds the "
                                                    "hourly throughput limit."},
                                  {"Retry-After": str(self.retry_after)} if self.retry_after is not None else None)
            return self._send(h, 503, {"search_metadata": {"id": "x", "status": "Error"},
                                       "error": "We couldn't get valid results for this search. Please try again "
                                                "later."})
        meta = {"id": "6540ac26b68f8b2910019dd5", "status": "Success", "json_endpoint": "https://serpapi.com/x.json"}
        if self.mode == "empty":
            return self._send(h, 200, {"search_metadata": meta, "search_parameters": {"engine": "google", "q": q},
                                       "search_information": {"organic_results_state": "Fully empty"},
                                       "error": "Google hasn't returned any results for this query."})
        return self._send(h, 200, {
            "search_metadata": meta, "search_parameters": {"engine": "google", "q": q},
            "answer_box": {"type": "organic_result", "title": f"{q} answer box", "snippet": "the boxed answer",
                           "link": "https://example.org/box"},
            "organic_results": [{"position": i, "title": f"{q} result {i}", "link": f"https://example.org/{i}",
                                 "snippet": f"the result snippet text for this page is here ({q}, {i})"}
                                for i in range(1, 11)],
            "related_questions": [{"question": f"related {i}?", "snippet": f"related answer {i}"} for i in (1, 2)]})
