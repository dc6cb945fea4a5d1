"""A proxy in the environment (HTTP_PROXY / ALL_PROXY without NO_PROXY, common on cluster nodes) must not take the
local retriever down: every client of the retriever connects to it directly."""

import asyncio
import json
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest


class _Retriever(BaseHTTPRequestHandler):
    def _send(self, status, body):
        data = json.dumps(body).encode()
        self.send_response(status)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def do_GET(self):
        self._send(200, {"fingerprint": "abc", "index": {"encoder": "bm25"}})

    def do_POST(self):
        queries = json.loads(self.rfile.read(int(self.headers["Content-Length"])))["queries"]
        self._send(200, {"result": [[{"document": {"id": "1", "contents": f'"T"\n{q}'}, "score": 1.0}]
                                    for q in queries]})

    def log_message(self, *a):
        pass


class _Proxy(_Retriever):
    hits = 0

    def do_GET(self):
        type(self).hits += 1
        self._send(502, {"detail": "bad gateway"})

    do_POST = do_GET


def _serve(handler):
    server = ThreadingHTTPServer(("127.0.0.1", 0), handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    return server, f"http://127.0.0.1:{server.server_address[1]}"


@pytest.fixture
def proxied(monkeypatch):
    retriever, url = _serve(_Retriever)
    proxy, proxy_url = _serve(_Proxy)
    _Proxy.hits = 0
    for name in ("NO_PROXY", "no_proxy"):
        monkeypatch.delenv(name, raising=False)
    for name in ("HTTP_PROXY", "http_proxy", "HTTPS_PROXY", "https_proxy", "ALL_PROXY", "all_proxy"):
        monkeypatch.setenv(name, proxy_url)
    yield url
    retriever.shutdown()
    proxy.shutdown()


def test_search_reaches_the_local_retriever_with_a_proxy_set(proxied):
    import httpx

    from openrlhf_search.env.retrieval_client import RetrievalClient

    assert httpx.get(proxied + "/health").status_code == 502  # what a default client meets: the proxy
    _Proxy.hits = 0
    client = RetrievalClient([proxied], topk=1, max_retries=0)
    passages = asyncio.run(client.search("who wrote hamlet"))
    assert [p.text for p in passages] == ["who wrote hamlet"]
    assert _Proxy.hits == 0


def test_health_checks_bypass_the_proxy(proxied):
    from openrlhf_search.launch.retriever_check import fetch_health
    from retriever.launch import health

    assert fetch_health(proxied)["fingerprint"] == "abc"
    assert health(proxied)["fingerprint"] == "abc"
    assert _Proxy.hits == 0


def test_launchers_health_probe_bypasses_the_proxy(proxied):
    import os
    import subprocess
    import sys

    from tests.conftest import REPO_ROOT

    script = ('source examples/scripts/common.sh >/dev/null 2>&1 || true; PYTHON="$1"; '
              'retriever_health_fp "$2"')
    out = subprocess.run(["bash", "-c", script, "bash", sys.executable, proxied], cwd=REPO_ROOT, env=os.environ,
                         capture_output=True, text=True, timeout=60)
    assert out.stdout.strip() == "abc", out.stderr
    assert _Proxy.hits == 0
