"""The web backend behind the real retriever service and the trainer's client: ``python -m retriever.server --web``
against local provider stand-ins (``tests/retriever/web_standins.py``, shapes from the providers' public docs: the
Serper API playground at https://serper.dev; https://serpapi.com/search-api and /api-status-and-error-codes).

Covered: the CLI serves ``/retrieve`` (Search-R1's schema), ``/queries`` (R1-Searcher's) and ``/health`` with passages
in the usual schema and never logs the key; a missing key is one line; the client counts web calls and cache hits
(and the step-time accounting reports them); a refused key stops the run in one line (client, executor, the
trainer's last line); a 5xx fails over to another web retriever; a provider slower than the client's deadline ends
in RetrievalError and its late answer is a cache hit for the retry; a 429 is waited out by the server; the budget's
continue mode. Nothing reaches a real provider: every server is given a loopback ``--web_endpoint``."""

import asyncio
import json
import os
import subprocess
import sys
import threading
import time
from types import SimpleNamespace

import httpx
import pytest

from openrlhf_search.rl import step_timing
from openrlhf_search.env.retrieval_client import RetrievalClient, RetrievalError, RetrievalStopped
from retriever.server import bind_socket, create_app
from retriever.web import get_provider
from retriever.web.backend import WebIndex
from retriever.web.cache import QueryCache, RunBudget
from tests.conftest import REPO_ROOT
from tests.retriever.web_standins import KEY, ProviderStandIn, no_real_provider  # noqa: F401 (autouse fixture)


class AppServer:
    """``retriever.server.create_app(index)`` under uvicorn in a thread, on a free loopback port."""

    def __init__(self, index):
        import uvicorn

        sock = bind_socket("127.0.0.1", 0)
        self.url = f"http://127.0.0.1:{sock.getsockname()[1]}"
        self.index = index
        self.server = uvicorn.Server(uvicorn.Config(create_app(index), log_level="warning", access_log=False))
        self.thread = threading.Thread(target=self.server.run, kwargs={"sockets": [sock]}, daemon=True)
        self.thread.start()
        deadline = time.time() + 20
        while not self.server.started and time.time() < deadline:
            time.sleep(0.02)
        assert self.server.started

    def close(self):
        self.server.should_exit = True
        self.thread.join(10)
        self.index.close()


def web_index(standin, tmp_path=None, key=KEY, **kw):
    cache = QueryCache(str(tmp_path / f"cache_{standin.provider}.sqlite")) if tmp_path is not None else None
    return WebIndex(get_provider(standin.provider), key, endpoint=standin.search_url, cache=cache, **kw)


@pytest.fixture
def serper():
    s = ProviderStandIn("serper")
    yield s
    s.close()


def search_all(client, queries):
    async def run():
        try:
            return await asyncio.gather(*(client.search(q) for q in queries), return_exceptions=True)
        finally:
            await client.aclose()

    return asyncio.run(run())


# ------------------------------------------------------------------ the CLI
def _start_cli(provider, endpoint, tmp_path, env_key=KEY, extra=()):
    port_file = tmp_path / "port"
    env = {**os.environ, "PYTHONPATH": REPO_ROOT}
    env.pop("SERPER_API_KEY", None)
    env.pop("SERPAPI_API_KEY", None)
    if env_key is not None:
        env[get_provider(provider).key_env] = env_key
    cmd = [sys.executable, "-m", "retriever.server", "--web", provider, "--web_endpoint", endpoint, "--port", "0",
           "--port_file", str(port_file), "--web_cache", str(tmp_path / "cache.sqlite"), "--log_level", "debug",
           *extra]
    return subprocess.Popen(cmd, env=env, cwd=str(tmp_path), stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            text=True), port_file


@pytest.mark.parametrize("provider", ["serper", "serpapi"])
def test_cli_serves_both_schemas_from_a_standin_and_never_logs_the_key(provider, tmp_path):
    standin = ProviderStandIn(provider)
    proc, port_file = _start_cli(provider, standin.search_url, tmp_path, extra=["--web_site", "en.wikipedia.org"])
    try:
        deadline = time.time() + 60
        while not port_file.exists() and proc.poll() is None and time.time() < deadline:
            time.sleep(0.05)
        assert port_file.exists(), proc.communicate(timeout=10)[0][-3000:]
        url = f"http://127.0.0.1:{port_file.read_text()}"
        for _ in range(200):
            try:
                health = httpx.get(url + "/health", timeout=2).json()
                break
            except httpx.HTTPError:
                time.sleep(0.05)
        body = httpx.post(url + "/retrieve", json={"queries": ["Ed Wood", "Nicolas Cage"], "topk": 3,
                                                    "return_scores": True}, timeout=30).json()
        plain = httpx.post(url + "/retrieve", json={"queries": ["Ed Wood"], "topk": 3}, timeout=30).json()
        r1 = httpx.post(url + "/queries", json={"queries": ["Ed Wood"], "k": 3}, timeout=30).json()
        after = httpx.get(url + "/health", timeout=5).json()
    finally:
        proc.terminate()
        log = proc.communicate(timeout=30)[0]
        standin.close()
    assert proc.returncode == 0, log[-3000:]
    assert health["backend"] == "web" and health["provider"] == provider and health["fingerprint"]
    assert health["per_query_errors"] is True and health["site"] == "en.wikipedia.org"
    result = body["result"]
    assert [len(h) for h in result] == [3, 3] and body["web"] == {"calls": 2, "cache_hits": 0, "skipped": 0,
                                                                      "credits": 2.0}
    doc = result[0][0]["document"]
    assert set(doc) == {"id", "title", "text", "contents"} and result[0][0]["score"] == 1.0
    assert doc["contents"] == f'"{doc["title"]}"\n{doc["text"]}'
    assert plain["result"] == [[h["document"] for h in result[0]]] and plain["web"]["cache_hits"] == 1
    assert r1 == {"queries": ["Ed Wood"], "answers": [[h["document"]["contents"] for h in result[0]]],
                  "web": {"calls": 0, "cache_hits": 1, "skipped": 0, "credits": 0.0}}
    assert len(standin.searches) == 2
    web = after["web"]
    assert web["calls"] == 2 and web["cache_hits"] == 2 and web["budget"]["calls"] == 2
    assert web["budget"]["max_queries"] == 10000 and web["cache"]["hits"] == 2
    assert "web search: %s at %s" % (provider, standin.search_url) in log and "web cache (final)" in log
    assert "HTTP Request" not in log  # httpx's request lines (SerpApi's URL holds the key) are held back
    assert KEY not in log and KEY not in json.dumps(after)


def test_cli_without_the_key_is_one_line_naming_the_variable(tmp_path):
    proc, _ = _start_cli("serpapi", "http://127.0.0.1:9/search", tmp_path, env_key=None)
    out = proc.communicate(timeout=60)[0]
    assert proc.returncode == 2
    assert out.strip().splitlines()[-1] == ("retriever.server: error: no API key for --web serpapi: set the "
                                            "environment variable SERPAPI_API_KEY")


# ------------------------------------------------------------------ the client
def test_client_counts_web_calls_and_cache_hits_for_the_step_timing(serper, tmp_path):
    server = AppServer(web_index(serper, tmp_path))
    try:
        client = RetrievalClient([server.url], topk=3, coalesce_window_ms=20)
        before = dict(client.stats)
        first = search_all(client, ["a", "b", "c"])
        second = search_all(client, ["a", "b", "c", "d"])
    finally:
        server.close()
    assert [len(p) for p in first + second] == [3] * 7 and first == second[:3]
    assert first[0][0].id.startswith("https://example.org/") and first[0][0].score == 1.0
    assert (client.stats["web_calls"], client.stats["web_cache_hits"], client.stats["web_skipped"]) == (4, 3, 0)
    stats = step_timing.retrieval_stats([(0.0, 0.1, True)], (0.0, 1.0), [before], [dict(client.stats)])
    assert (stats["retrieval/web_calls"], stats["retrieval/web_cache_hits"], stats["retrieval/web_skipped"]) == \
        (4.0, 3.0, 0.0)
    local = step_timing.retrieval_stats([], (0.0, 1.0), [{"requests": 1}], [{"requests": 2}])
    assert not any(k.startswith("retrieval/web_") for k in local)  # a local index: no web keys
    line = step_timing.split_line(3, {"timing/generation": 5.0, **stats, "retrieval/web_skipped": 2.0})
    assert "4 web calls, 3 cache hits, 2 skipped by the web budget" in line


def test_refused_key_stops_the_client_the_executor_and_the_run_in_one_line(serper, qwen_tokenizer):
    wrong = "sk-wrong-key-that-must-not-leak"
    server = AppServer(web_index(serper, key=wrong))
    try:
        client = RetrievalClient([server.url], coalesce_window_ms=5, max_retries=2, backoff_s=0.01)
        results = search_all(client, ["a", "b"])
        executor_error = _executor_error(server.url, qwen_tokenizer)
    finally:
        server.close()
    assert all(isinstance(r, RetrievalStopped) for r in results)
    msg = str(results[0])
    assert "\n" not in msg and "serper refused the API key (HTTP 403: Unauthorized.)" in msg
    assert "SERPER_API_KEY" in msg and wrong not in msg
    assert client.stats["requests"] == 1 and client.stats["retries"] == 0 and client.stats["stopped"] == 1
    assert isinstance(executor_error, RetrievalStopped)  # not absorbed as a failed sample
    # the trainer's last line: RetrievalStopped re-raised through two Ray actor hops (rollout actor, trainer actor)
    from openrlhf_search.cli.train import stop_reason

    inner = SimpleNamespace(cause=results[0], __cause__=None)
    outer = RuntimeError("RayTaskError(...)")
    outer.cause = inner
    assert stop_reason(outer) == msg


def _executor_error(url, tok):
    """The exception a real SearchAgentExecutor raises when its first search is refused with stop_run."""
    from openrlhf_search.env.agent import SearchAgentExecutor
    from openrlhf_search.env.config import SearchConfig

    ids = tok("<|begin_of_query|> Ed Wood director <|end_of_query|>", add_special_tokens=False).input_ids

    class OneTurn:
        async def generate(self, tokens, params, multi_modal_data=None):
            return SimpleNamespace(outputs=[SimpleNamespace(token_ids=ids, finish_reason="stop", logprobs=None)])

    cfg = SearchConfig(protocol="r1searcher", retriever_urls=[url], max_turns=3)
    executor = SearchAgentExecutor(cfg)
    params = SimpleNamespace(logprobs=None, stop=None, include_stop_str_in_output=False,
                             output_text_buffer_length=0, max_tokens=64)

    async def run():
        try:
            await executor.execute("Who directed Ed Wood?", '["Tim Burton"]', params, 512, tok, OneTurn())
        except Exception as e:
            return e
        finally:
            await executor.client.aclose()

    return asyncio.run(run())


def test_a_5xx_fails_over_to_another_web_retriever(tmp_path):
    broken, healthy = ProviderStandIn("serpapi"), ProviderStandIn("serpapi")
    broken.mode = "500"
    servers = [AppServer(web_index(broken)), AppServer(web_index(healthy))]
    try:
        client = RetrievalClient([s.url for s in servers], coalesce_window_ms=5, backoff_s=0.01)
        results = search_all(client, ["Ed Wood"])
    finally:
        for s in servers:
            s.close()
        broken.close()
        healthy.close()
    assert len(results[0]) == 3 and client.stats["failovers"] == 1 and client.stats["errors"] == 0
    assert len(broken.searches) == 1 and len(healthy.searches) == 1


def test_a_provider_slower_than_the_client_deadline(serper, tmp_path):
    serper.delay_s = 4.0  # far past the client's 0.5 s deadline, so a loaded machine cannot blur the two
    server = AppServer(web_index(serper, tmp_path, timeout_s=10))
    try:
        client = RetrievalClient([server.url], timeout_s=0.5, max_retries=0, coalesce_window_ms=0)
        t0 = time.monotonic()
        late = search_all(client, ["slow query"])
        waited = time.monotonic() - t0
        time.sleep(max(0.0, 4.5 - waited))  # the provider's answer lands in the cache meanwhile
        serper.delay_s = 0.0
        retry = search_all(RetrievalClient([server.url], timeout_s=5, coalesce_window_ms=0), ["slow query"])
    finally:
        server.close()
    assert isinstance(late[0], RetrievalError) and "deadline" in str(late[0])
    assert client.stats["timeouts"] == 1 and waited < 3.5  # the client did not wait for the provider
    assert len(retry[0]) == 3 and len(serper.searches) == 1  # the retry was a cache hit


def test_a_429_is_waited_out_by_the_server(serper):
    serper.mode, serper.retry_after, serper.fail_first = "429", 1, 1
    server = AppServer(web_index(serper))
    try:
        results = search_all(RetrievalClient([server.url], timeout_s=10, coalesce_window_ms=0), ["q"])
    finally:
        server.close()
    assert len(results[0]) == 3 and len(serper.searches) == 2 and server.index.counts["rate_limited"] == 1


def test_budget_continue_mode_leaves_queries_without_passages_and_counts_them(serper, tmp_path):
    server = AppServer(web_index(serper, tmp_path, budget=RunBudget(max_queries=1), on_budget="continue"))
    try:
        client = RetrievalClient([server.url], coalesce_window_ms=20)
        first = search_all(client, ["a"])
        later = search_all(client, ["b", "c"])
    finally:
        server.close()
    assert len(first[0]) == 3 and later == [[], []]
    assert (client.stats["web_calls"], client.stats["web_skipped"]) == (1, 2) and len(serper.searches) == 1


def test_ray_serve_refuses_a_web_backend(capsys):
    from retriever.serve import parse_args

    with pytest.raises(SystemExit) as e:
        parse_args(["--ray", "--web", "serper"])
    assert e.value.code == 2 and "drop --ray" in capsys.readouterr().err
