"""Web search as a user runs it: ``python -m retriever.server --web ...`` started as a process (its documented
command) against a local provider stand-in on 127.0.0.1 (``tests/retriever/web_standins.py``), searched through the
trainer's ``RetrievalClient``.

Covered: every provider error gets its documented answer (a refused key, an empty account, the run's budget -> 402 /
403 with ``stop_run`` and the client stops in one line; a 429, a provider 5xx, a trickled answer past the deadline, a
non-JSON answer -> 503 and the client retries), one log line each and no traceback; a transient 429 whose text
mentions quota and credits is waited out, not a stop; a Retry-After pauses the server's provider calls and the
client waits at least as long; one query held by the provider or failing never holds or fails another; only
answered calls are paid for (attempts counted apart); a money cap holds under concurrent calls; the cache key is
normalised and a smaller top-k is served from a larger answer; SearxNG needs no key and costs nothing."""

import asyncio
import os
import subprocess
import sys
import threading
import time

import httpx
import pytest

from openrlhf_search.env.retrieval_client import RetrievalClient, RetrievalError, RetrievalStopped
from retriever.web import get_provider
from tests.conftest import REPO_ROOT
from tests.retriever.web_standins import KEY, ProviderStandIn, no_real_provider  # noqa: F401 (autouse fixture)


class Cli:
    """``python -m retriever.server --web PROVIDER --web_endpoint <stand-in>`` in a subprocess."""

    def __init__(self, standin, tmp_path, *extra, key=KEY):
        port_file = tmp_path / "port"
        env = {**os.environ, "PYTHONPATH": REPO_ROOT}
        for name in ("SERPER_API_KEY", "SERPAPI_API_KEY", "SEARXNG_API_KEY"):
            env.pop(name, None)
        if key is not None:
            env[get_provider(standin.provider).key_env] = key
        cmd = [sys.executable, "-m", "retriever.server", "--web", standin.provider, "--web_endpoint",
               standin.search_url, "--port", "0", "--port_file", str(port_file), "--web_cache",
               str(tmp_path / "cache.sqlite"), *extra]
        self.proc = subprocess.Popen(cmd, env=env, cwd=str(tmp_path), stdout=subprocess.PIPE,
                                     stderr=subprocess.STDOUT, text=True)
        deadline = time.time() + 90
        while not port_file.exists() and self.proc.poll() is None and time.time() < deadline:
            time.sleep(0.05)
        assert port_file.exists(), self.stop()[-3000:]
        self.url = f"http://127.0.0.1:{port_file.read_text()}"
        for _ in range(400):
            try:
                httpx.get(self.url + "/health", timeout=2)
                break
            except httpx.HTTPError:
                time.sleep(0.05)
        self.log = None

    def health(self) -> dict:
        return httpx.get(self.url + "/health", timeout=10).json()

    def post(self, queries, topk=3, **kw):
        return httpx.post(self.url + "/retrieve", json={"queries": queries, "topk": topk, **kw}, timeout=60)

    def stop(self) -> str:
        if self.log is None:
            self.proc.terminate()
            self.log = self.proc.communicate(timeout=60)[0]
        return self.log


@pytest.fixture
def cli(tmp_path):
    started = []

    def start(standin, *extra, key=KEY):
        c = Cli(standin, tmp_path, *extra, key=key)
        started.append((c, standin))
        return c

    yield start
    for c, standin in started:
        c.stop()
        standin.close()


def client(url, **kw):
    kw.setdefault("coalesce_window_ms", 0)
    kw.setdefault("backoff_s", 0.05)
    return RetrievalClient([url], **kw)


def search_all(c, queries, topk=None):
    async def run():
        try:
            return await asyncio.gather(*(c.search(q, topk) for q in queries), return_exceptions=True)
        finally:
            await c.aclose()

    return asyncio.run(run())


def error_lines(log: str) -> list:
    return [line for line in log.splitlines() if " WARNING " in line or " ERROR " in line]


# ------------------------------------------------------------------ errors that stop the run
@pytest.mark.parametrize("case", ["refused_key", "empty_account_serpapi", "empty_account_serper", "budget"])
def test_errors_that_stop_the_run_are_402_403_with_stop_run_and_stop_the_client_in_one_line(cli, case):
    provider = {"empty_account_serpapi": "serpapi"}.get(case, "serper")
    standin = ProviderStandIn(provider)
    extra, key = [], KEY
    if case == "refused_key":
        key = "sk-wrong-0000"
    elif case.startswith("empty_account"):
        standin.mode = "quota"
    else:
        extra = ["--web_max_queries", "1"]
    server = cli(standin, *extra, key=key)
    if case == "budget":
        assert server.post(["first"]).status_code == 200
    raw = server.post(["q"])
    c = client(server.url, max_retries=3)
    results = search_all(c, ["a", "b"])
    log = server.stop()
    status = {"refused_key": 403, "budget": 402}.get(case, 402)
    assert raw.status_code == status and raw.json()["stop_run"] is True, raw.text
    assert all(isinstance(r, RetrievalStopped) for r in results), results
    msg = str(results[0])
    assert "\n" not in msg and {"refused_key": "refused the API key", "budget": "budget reached"}.get(
        case, "out of searches") in msg
    assert c.stats["stopped"] == 1 and c.stats["retries"] == 0 and c.stats["requests"] == 1
    assert "Traceback" not in log and "sk-wrong-0000" not in log and KEY not in log
    assert len(error_lines(log)) == 1, log  # the stop, logged once; later requests get it silently
    assert len(standin.searches) == 1  # nothing sent to the provider after the stop


# ------------------------------------------------------------------ errors worth a retry
@pytest.mark.parametrize("case", ["429", "500", "timeout", "nonjson"])
def test_temporary_errors_are_503_and_the_client_retries(cli, case):
    standin = ProviderStandIn("serpapi" if case == "500" else "serper")
    extra = ["--web_max_retry_wait_s", "0"]
    if case == "429":
        standin.mode, standin.retry_after = "429", 1
    elif case == "500":
        standin.mode = "500"
    elif case == "timeout":
        standin.mode, standin.trickle_s = "trickle", 0.3
        extra += ["--web_timeout_s", "1"]
    else:
        standin.mode = "nonjson"
    server = cli(standin, *extra)
    raw = server.post(["q"])
    during_trickle = standin.trickling
    c = client(server.url, max_retries=1, timeout_s=30)
    results = search_all(c, ["a"])
    log = server.stop()
    assert raw.status_code == 503 and raw.json()["stop_run"] is False, raw.text
    assert isinstance(results[0], RetrievalError) and not isinstance(results[0], RetrievalStopped)
    assert c.stats["retries"] == 1 and c.stats["stopped"] == 0
    assert "Traceback" not in log
    assert len(error_lines(log)) == len(standin.searches), log  # one line per failed provider call
    if case == "429":
        assert raw.headers["retry-after"] == "1"
    if case == "timeout":  # answered while the provider was still sending: a total deadline, not a per-read one
        assert during_trickle and "no complete answer within 1s" in raw.json()["detail"]


def test_a_transient_429_that_mentions_quota_and_credits_is_waited_out_not_a_stop(cli):
    standin = ProviderStandIn("serpapi")
    standin.mode, standin.retry_after, standin.fail_first = "429quota", 1, 1
    server = cli(standin)
    results = search_all(client(server.url), ["Ed Wood"])
    health = server.health()
    server.stop()
    assert len(results[0]) == 3 and len(standin.searches) == 2
    web = health["web"]
    assert (web["calls"], web["attempts"], web["retries"], web["rate_limited"]) == (1, 2, 1, 1)
    assert web["stopped"] is None and web["budget"]["calls"] == 1


# ------------------------------------------------------------------ Retry-After
def test_retry_after_pauses_the_server_and_the_client_waits_at_least_that_long(cli):
    standin = ProviderStandIn("serper")
    standin.mode, standin.retry_after, standin.fail_first = "429", 2, 1
    server = cli(standin, "--web_max_retry_wait_s", "0", "--web_qps", "0")
    first = server.post(["x"])
    during_pause = server.post(["y"])  # another query inside the pause: answered at once, no provider call
    calls_in_pause = len(standin.searches)
    c = client(server.url, max_retries=2, backoff_s=0.01)
    t0 = time.monotonic()
    results = search_all(c, ["z"])
    waited = time.monotonic() - t0
    server.stop()
    assert first.status_code == 503 and first.headers["retry-after"] == "2"
    assert during_pause.status_code == 503 and int(during_pause.headers["retry-after"]) >= 1
    assert calls_in_pause == 1
    assert len(results[0]) == 3 and c.stats["retry_after_waits"] >= 1
    assert waited >= 1.0  # the client slept the server's Retry-After, not its own 10 ms backoff
    times = [r["t"] for r in standin.searches]
    assert len(times) == 2 and times[1] - times[0] >= 2.0  # no provider call inside the provider's pause


# ------------------------------------------------------------------ independence
def test_a_query_held_by_the_provider_does_not_hold_another_request(cli):
    standin = ProviderStandIn("serper")
    standin.hold = lambda q: q.startswith("slow")
    server = cli(standin)
    slow = {}

    def search_slow():
        slow["r"] = server.post(["slow one"])

    t = threading.Thread(target=search_slow, daemon=True)
    t.start()
    while not standin.searches:
        time.sleep(0.02)
    fast = server.post(["fast one"])  # with one search thread this would wait for the held query
    fast_before_slow = "r" not in slow
    standin.release.set()
    t.join(30)
    server.stop()
    assert fast.status_code == 200 and len(fast.json()["result"][0]) == 3
    assert fast_before_slow and slow["r"].status_code == 200


def test_a_failing_query_fails_only_itself_and_is_retried_alone(cli):
    standin = ProviderStandIn("serper")
    standin.fail_if = lambda q: q.startswith("bad")
    server = cli(standin)
    raw = server.post(["good", "bad"], per_query_errors=True, return_scores=True)
    c = client(server.url, max_retries=2, coalesce_window_ms=50)
    results = search_all(c, ["good two", "bad two"])
    server.stop()
    body = raw.json()
    assert raw.status_code == 200 and len(body["result"][0]) == 3 and body["result"][1] == []
    assert body["errors"][0] is None and "HTTP 500" in body["errors"][1] and body["unavailable"] == [1]
    assert len(results[0]) == 3 and isinstance(results[1], RetrievalError)
    # the bad query alone was sent again (a request of only failing queries is a 503, retried as any other: 1 + 2)
    assert c.stats["query_retries"] == 1
    assert standin.provider_calls.count("good two") == 1 and standin.provider_calls.count("bad two") == 1 + 1 + 2


# ------------------------------------------------------------------ budget in paid credits
def test_only_answered_calls_are_paid_for_and_attempts_are_counted_apart(cli):
    standin = ProviderStandIn("serper")
    standin.mode, standin.fail_first = "500", 3
    server = cli(standin, "--web_max_queries", "1")
    codes = [server.post(["q"]).status_code for _ in range(4)]
    health = server.health()
    server.stop()
    assert codes == [503, 503, 503, 200]
    web = health["web"]
    assert web["budget"]["calls"] == 1 and web["calls"] == 1 and web["attempts"] == 4 and web["unavailable"] == 3


def test_a_money_cap_holds_under_concurrent_calls(cli):
    standin = ProviderStandIn("serper")
    standin.credits = 2  # each call costs 2 credits = US$0.002 at US$1 per 1,000 credits
    server = cli(standin, "--web_max_usd", "0.005", "--web_usd_per_1k", "1", "--web_on_budget", "continue",
                 "--web_qps", "0", "--web_concurrency", "8")
    c = client(server.url, coalesce_window_ms=20)
    results = search_all(c, [f"q{i}" for i in range(10)])
    health = server.health()
    server.stop()
    budget = health["web"]["budget"]
    assert budget["usd"] <= 0.005 and budget["calls"] == 2 and len(standin.searches) == 2
    assert sum(len(r) == 3 for r in results) == 2 and c.stats["web_skipped"] == 8
    assert c.stats["web_usd"] == pytest.approx(0.004) and c.stats["web_credits"] == 4


# ------------------------------------------------------------------ cache
def test_the_cache_key_is_normalised_and_a_smaller_topk_is_served_from_a_larger_answer(cli):
    standin = ProviderStandIn("serper")
    server = cli(standin)
    big = server.post(["Ed Wood director"], topk=5, return_scores=True).json()
    same = server.post(["  ed   WOOD director "], topk=2, return_scores=True).json()
    more = server.post(["ed wood director"], topk=8).json()
    server.stop()
    assert same["web"]["cache_hits"] == 1 and same["result"][0] == big["result"][0][:2]
    assert more["web"]["calls"] == 1 and len(more["result"][0]) == 8  # more than was stored: a new call
    assert len(standin.searches) == 2


# ------------------------------------------------------------------ SearxNG
def test_searxng_needs_no_key_and_costs_nothing(cli):
    standin = ProviderStandIn("searxng")
    server = cli(standin, "--web_max_usd", "0.01", "--web_usd_per_1k", "5", key=None)
    c = client(server.url)
    results = search_all(c, ["Ed Wood", "Nicolas Cage"])
    health = server.health()
    server.stop()
    assert [len(r) for r in results] == [3, 3] and results[0][0].title == "Ed Wood result 1"
    assert results[0][0].text.startswith("the result snippet text")
    assert all(r["params"]["format"] == "json" for r in standin.searches)
    assert health["provider"] == "searxng" and health["web"]["budget"]["usd"] == 0.0
    assert c.stats["web_calls"] == 2 and c.stats["web_usd"] == 0.0


# ------------------------------------------------------------------ cost before the run
def test_preflight_compares_the_runs_searches_with_the_budget_and_refuses_one_it_cannot_carry(cli):
    from types import SimpleNamespace

    from openrlhf_search.cli.train import check_web_budget
    from openrlhf_search.env.config import ConfigError

    standin = ProviderStandIn("serper")
    server = cli(standin, "--web_max_queries", "1000", "--web_usd_per_1k", "1", "--web_qps", "5")
    server.post(["warm"])
    server.post(["warm"])  # the cache's hit rate is now 50 %
    args = SimpleNamespace(rollout=SimpleNamespace(batch_size=8, n_samples_per_prompt=5),
                           train=SimpleNamespace(max_steps=20), search=SimpleNamespace(web_budget_check=True))
    cfg = SimpleNamespace(retriever_urls=[server.url], max_turns=4)
    with pytest.raises(ConfigError) as refused:
        check_web_budget(args, cfg)
    args.search.web_budget_check = False
    told = check_web_budget(args, cfg)
    args.search.web_budget_check, args.train.max_steps = True, 10
    fits = check_web_budget(args, cfg)
    server.stop()
    assert ("up to 160 searches per step (8 prompts x 5 samples x 4 turns), about 80 paid after the cache's 50% "
            "hit rate, about US$0.08 per step; budget: 999 paid calls left, enough for 12.5 of 20 steps; at 5 "
            "calls/s the provider needs about 16 s per step") in str(refused.value)
    assert "--search.web_budget_check false" in str(refused.value) and told in str(refused.value)
    assert "enough for 12.5 of 10 steps" in fits


def test_the_step_line_shows_what_the_steps_searches_cost_and_the_run_so_far(cli):
    from openrlhf_search.rl import step_timing

    standin = ProviderStandIn("serper")
    server = cli(standin, "--web_usd_per_1k", "1")
    c = client(server.url, coalesce_window_ms=20)
    before = dict(c.stats)
    search_all(c, ["a", "b"])
    middle = dict(c.stats)
    search_all(c, ["a", "c", "d", "e"])
    server.stop()
    step1 = step_timing.retrieval_stats([], (0.0, 1.0), [before], [middle])
    step2 = step_timing.retrieval_stats([], (0.0, 1.0), [middle], [dict(c.stats)])
    assert step2["retrieval/web_usd"] == pytest.approx(0.003) and step2["retrieval/web_usd_run"] == pytest.approx(0.005)
    line = step_timing.split_line(2, {"timing/generation": 5.0, "step_time/search_in_flight_s": 1.0, **step2})
    assert "3 web calls, 1 cache hits, US$0.0030 (run US$0.0050)" in line
    assert step1["retrieval/web_credits"] == 2 and step1["retrieval/web_credits_run"] == 2
