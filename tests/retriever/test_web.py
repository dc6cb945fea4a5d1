"""The web search backend in process (``retriever.web``), against local stand-ins of Serper and SerpApi
(``tests/retriever/web_standins.py``, which speak the request and answer shapes of the providers' public docs:
https://serper.dev API playground; https://serpapi.com/search-api, /search-errors, /api-status-and-error-codes).

Covered: each provider's request and the passages it gives (schema, top-k, site filter), empty results, 429 with
Retry-After (waited, then answered; past the cap -> 503), 401 / 403 (the run stops, one line, no key), an empty
account, 5xx, the cache across a restart (hit rate logged), the budget (stop / continue, money from reported
credits, spend kept under a run name), the rate limit, the page reader. Nothing reaches a real provider: the
autouse guard fails any request to a host other than 127.0.0.1."""

import asyncio
import logging
import time

import pytest

from retriever.errors import BackendError
from retriever.web import get_provider
from retriever.web.backend import WebIndex
from retriever.web.cache import QueryCache, RunBudget
from retriever.web.provider import parse_retry_after
from retriever.web.ratelimit import Paused, RateLimiter
from retriever.web.reader import PageReader, clean_page_text, window
from tests.retriever.web_standins import KEY, ProviderStandIn, no_real_provider  # noqa: F401 (autouse fixture)


@pytest.fixture(params=["serper", "serpapi"])
def standin(request):
    s = ProviderStandIn(request.param)
    yield s
    s.close()


def make(standin, tmp_path=None, key=KEY, **kw):
    cache = kw.pop("cache", None)
    if cache is None and tmp_path is not None:
        cache = QueryCache(str(tmp_path / "web_cache.sqlite"))
    kw.setdefault("default_retry_s", 0.05)
    return WebIndex(get_provider(standin.provider), key, endpoint=standin.search_url, cache=cache, **kw)


def test_each_provider_gets_its_documented_request_and_gives_passages(standin):
    index = make(standin, site="en.wikipedia.org")
    try:
        hits = index.search(["Ed Wood director", "Nicolas Cage"], 3)
    finally:
        index.close()
    assert len(hits) == 2 and all(len(h) == 3 for h in hits)
    for h in hits:
        assert all(set(p) == {"id", "title", "text", "contents", "score"} for p in h)
        assert all(p["contents"] == f'"{p["title"]}"\n{p["text"]}' for p in h)
        assert [p["score"] for p in h] == [1.0, 0.5, pytest.approx(1 / 3)]
        assert all(p["id"].startswith("https://example.org/") for p in h)
        assert h.source == "web"
    sent = standin.searches
    assert len(sent) == 2
    if standin.provider == "serper":
        assert all(r["method"] == "POST" and r["headers"]["x-api-key"] == KEY for r in sent)
        assert sorted(r["json"]["q"] for r in sent) == ["Ed Wood director site:en.wikipedia.org",
                                                         "Nicolas Cage site:en.wikipedia.org"]
        assert hits[0][0]["title"] == "Ed Wood director site:en.wikipedia.org result 1"
    else:
        assert all(r["method"] == "GET" and r["params"]["api_key"] == KEY and r["params"]["engine"] == "google"
                   for r in sent)
        # Search-R1's order: the answer box, then the organic results (serp_search_server.py:60-74), cut to top-k
        assert [p["title"] for p in hits[1]] == ["Nicolas Cage site:en.wikipedia.org answer box",
                                                  "Nicolas Cage site:en.wikipedia.org result 1",
                                                  "Nicolas Cage site:en.wikipedia.org result 2"]


def test_empty_results_are_no_passages_and_are_cached(standin, tmp_path):
    standin.mode = "empty"
    index = make(standin, tmp_path)
    try:
        assert index.search(["zzqx nothing"], 5) == [[]]
        assert index.search(["zzqx nothing"], 5) == [[]]
    finally:
        index.close()
    assert len(standin.searches) == 1 and index.counts["empty"] == 1 and index.counts["cache_hits"] == 1


def test_429_waits_retry_after_then_answers(standin):
    standin.mode, standin.retry_after, standin.fail_first = "429", 1, 1
    index = make(standin, limiter=RateLimiter(0))
    t0 = time.monotonic()
    try:
        hits = index.search(["q"], 2)
    finally:
        index.close()
    assert len(hits[0]) == 2 and len(standin.searches) == 2
    assert time.monotonic() - t0 >= 1.0  # the second call went after the provider's Retry-After
    assert index.counts["rate_limited"] == 1 and index.counts["retry_after_wait_s"] == 1.0


def test_429_past_the_wait_cap_is_a_503_for_the_client(standin):
    standin.mode, standin.retry_after = "429", 120
    index = make(standin, max_retry_wait_s=5)
    try:
        with pytest.raises(BackendError) as e:
            index.search(["q"], 2)
    finally:
        index.close()
    assert e.value.status == 503 and not e.value.stop_run and e.value.retry_after == 120
    assert len(standin.searches) == 1  # nothing waited here: the client's retry rules take over


def test_refused_key_stops_in_one_line_without_the_key(standin, caplog):
    wrong = "sk-wrong-0123456789abcdef"
    index = make(standin, key=wrong)
    caplog.set_level(logging.DEBUG)
    try:
        with pytest.raises(BackendError) as e:
            index.search(["a", "b"], 3)
        with pytest.raises(BackendError) as again:  # every later request: the same answer, no provider call
            index.search(["c"], 3)
    finally:
        index.close()
    msg = str(e.value)
    assert e.value.stop_run and e.value.status == 403 and again.value is e.value
    assert "\n" not in msg and f"{standin.provider} refused the API key" in msg
    assert {"serper": "SERPER_API_KEY", "serpapi": "SERPAPI_API_KEY"}[standin.provider] in msg
    assert {"serper": "HTTP 403", "serpapi": "HTTP 401"}[standin.provider] in msg
    assert len(standin.searches) == 2
    assert wrong not in msg and wrong not in caplog.text and wrong not in str(index.info())


def test_empty_account_stops_the_run(standin):
    standin.mode = "quota"
    index = make(standin)
    try:
        with pytest.raises(BackendError) as e:
            index.search(["q"], 3)
    finally:
        index.close()
    assert e.value.stop_run and e.value.status == 402 and "out of searches" in str(e.value)


def test_5xx_is_a_503_and_the_retry_succeeds_without_calling_twice_for_answered_queries(standin, tmp_path):
    index = make(standin, tmp_path)
    try:
        index.search(["answered"], 3)
        standin.mode, standin.fail_first = "500", 1
        with pytest.raises(BackendError) as e:
            index.search(["answered", "failing"], 3)
        assert e.value.status == 503 and not e.value.stop_run
        hits = index.search(["answered", "failing"], 3)  # the client's retry
    finally:
        index.close()
    assert [len(h) for h in hits] == [3, 3] and [h.source for h in hits] == ["cache", "web"]
    assert [r["json"]["q"] if r["json"] else r["params"]["q"] for r in standin.searches] == [
        "answered", "failing", "failing"]


def test_a_provider_slower_than_the_call_timeout_is_a_503():
    s = ProviderStandIn("serpapi")
    s.delay_s = 1.0
    index = make(s, timeout_s=0.3)
    try:
        with pytest.raises(BackendError, match="serpapi: no complete answer within 0.3s") as e:
            index.search(["q"], 3)
    finally:
        index.close()
        s.close()
    assert e.value.status == 503 and not e.value.stop_run and index.counts["unavailable"] == 1


def test_provider_400_for_one_query_gives_it_no_passages():
    s = ProviderStandIn("serper")
    s.mode = "badquery"
    index = make(s)
    try:
        assert index.search(["x" * 50], 3) == [[]]
    finally:
        index.close()
        s.close()
    assert index.counts["bad_queries"] == 1


def test_cache_survives_a_restart_and_logs_its_hit_rate(standin, tmp_path, caplog):
    caplog.set_level(logging.INFO, logger="retriever.web")
    first = make(standin, tmp_path)
    try:
        a = first.search(["Ed Wood", "Nicolas Cage"], 3)
    finally:
        first.close()
    second = make(standin, tmp_path)  # a new process would open the same file
    try:
        b = second.search(["Ed Wood", "Nicolas Cage"], 3)
        c = second.search(["Ed Wood"], 5)  # another top-k: another entry
    finally:
        second.close()
    assert b == a and [h.source for h in b] == ["cache", "cache"] and c[0].source == "web"
    assert len(standin.searches) == 3
    assert second.info()["web"]["cache"]["hit_rate"] == pytest.approx(2 / 3, abs=1e-4)
    assert "web cache (final): 2 of 3 lookups hit (66.7%)" in caplog.text


def test_budget_stop_mode_stops_new_calls_with_a_clear_message(standin, tmp_path):
    index = make(standin, tmp_path, budget=RunBudget(max_queries=2))
    try:
        index.search(["q1", "q2"], 3)
        assert index.search(["q1"], 3)[0].source == "cache"  # a cache hit is free
        with pytest.raises(BackendError) as e:
            index.search(["q3"], 3)
        with pytest.raises(BackendError) as again:  # once stopped, every request gets the stop
            index.search(["q1"], 3)
    finally:
        index.close()
    assert again.value is e.value
    assert e.value.stop_run and e.value.status == 402
    assert "budget reached: 2 provider calls of --web_max_queries 2" in str(e.value)
    assert "--web_on_budget continue" in str(e.value)
    assert len(standin.searches) == 2


def test_budget_continue_mode_goes_on_without_web_results(standin, tmp_path, caplog):
    caplog.set_level(logging.WARNING, logger="retriever.web")
    index = make(standin, tmp_path, budget=RunBudget(max_queries=1), on_budget="continue")
    try:
        first = index.search(["q1"], 3)
        later = index.search(["q2", "q1", "q3"], 3)
    finally:
        index.close()
    assert len(first[0]) == 3
    assert [h.source for h in later] == ["skipped", "cache", "skipped"] and later[0] == [] and len(later[1]) == 3
    assert len(standin.searches) == 1 and index.counts["skipped"] == 2
    assert caplog.text.count("uncached queries get no passages from now on") == 1


def test_money_cap_counts_the_credits_the_provider_reports(tmp_path):
    s = ProviderStandIn("serper")
    s.credits = 2  # e.g. num > 10 on Serper
    budget = RunBudget(max_usd=0.0045, usd_per_1k=1.0)  # US$ 0.001 per credit: two calls of 2 credits = 0.004
    index = make(s, tmp_path, budget=budget)
    try:
        index.search(["a"], 3)
        index.search(["b"], 3)
        with pytest.raises(BackendError, match="US\\$0.0040 spent of --web_max_usd 0.0045"):
            index.search(["c"], 3)
    finally:
        index.close()
        s.close()
    assert budget.credits == 4 and budget.usd == pytest.approx(0.004) and len(s.searches) == 2
    with pytest.raises(ValueError, match="--web_usd_per_1k"):
        RunBudget(max_usd=1.0)


def test_budget_spend_is_kept_under_a_run_name(tmp_path):
    path = str(tmp_path / "c.sqlite")
    b = RunBudget(max_queries=3, store=QueryCache(path), run="exp1")
    for _ in range(2):
        b.settle(b.reserve(), charged=1)
    again = RunBudget(max_queries=3, store=QueryCache(path), run="exp1")
    other = RunBudget(max_queries=3, store=QueryCache(path), run="exp2")
    assert (again.calls, again.credits) == (2, 2.0) and (other.calls, other.credits) == (0, 0.0)
    again.reserve()
    with pytest.raises(Exception, match="2 provider calls \\(1 in flight\\) of --web_max_queries 3"):
        again.reserve()


def test_rate_limiter_spaces_calls_and_honours_a_pause():
    now = [100.0]
    slept = []

    async def sleep(s):
        slept.append(s)
        now[0] += s

    limiter = RateLimiter(4.0, clock=lambda: now[0], sleep=sleep)

    async def run():
        for _ in range(3):
            await limiter.acquire()
        assert slept == [pytest.approx(0.25), pytest.approx(0.25)]
        limiter.pause(2.0)
        await limiter.acquire()
        assert slept[-1] == pytest.approx(2.0) and limiter.waits == 3
        limiter.pause(10.0)
        with pytest.raises(Paused) as e:  # a pause longer than the caller may wait: told at once, no sleep
            await limiter.acquire(max_wait=5.0)
        assert e.value.retry_after == pytest.approx(10.0) and len(slept) == 3

    asyncio.run(run())


def test_a_pause_that_begins_while_a_call_waits_for_its_slot_holds_that_call_too():
    now = [0.0]
    slept = []
    limiter = RateLimiter(1.0, clock=lambda: now[0])

    async def sleep(s):
        slept.append(s)
        if len(slept) == 1:  # while the second call sleeps towards its slot, a 429 pauses the provider
            limiter.pause(5.0)
        now[0] += s

    limiter._sleep = sleep

    async def run():
        await limiter.acquire()
        await limiter.acquire()

    asyncio.run(run())
    assert slept == [pytest.approx(1.0), pytest.approx(4.0)]  # woke at 1 s, saw the pause, waited to 5 s


def test_calls_are_paced_by_the_rate_limit():
    s = ProviderStandIn("serper")
    index = make(s, limiter=RateLimiter(20.0), concurrency=8)
    try:
        index.search([f"q{i}" for i in range(6)], 2)
    finally:
        index.close()
        s.close()
    times = sorted(r["t"] for r in s.searches)
    assert len(times) == 6 and times[-1] - times[0] >= 0.2  # 6 calls at 20/s: starts 50 ms apart, 250 ms in all


def test_retry_after_parsing():
    assert parse_retry_after("3") == 3.0 and parse_retry_after(None) is None and parse_retry_after("soon") is None
    assert parse_retry_after("Wed, 21 Oct 2015 07:28:00 GMT", now=1445412470.0) == pytest.approx(10.0)


def test_page_text_through_a_reader_is_clean_and_capped(tmp_path):
    s = ProviderStandIn("serper")
    reader = PageReader(s.url + "/read", api_key="reader-key-1234", max_words=20)
    index = make(s, tmp_path, reader=reader)
    try:
        hits = index.search(["Ed Wood"], 2)
    finally:
        index.close()
        s.close()
    reads = [r for r in s.requests if r["path"] == "/read"]
    # one read per hit; the pages are read concurrently, so in any order
    assert sorted(r["url"] for r in reads) == sorted(p["id"] for p in hits[0]) and len(reads) == 2
    assert all(r["authorization"] == "Bearer reader-key-1234" for r in reads)
    for p in hits[0]:
        words = p["text"].split()
        assert len(words) == 20 and words[:4] == ["The", "answer", "paragraph", "says"]  # from the snippet's paragraph
        assert "<" not in p["text"] and "secret" not in p["text"] and "Home" not in p["text"]
        assert p["contents"] == f'"{p["title"]}"\n{p["text"]}'


def test_markup_cleaning():
    md = ("Title: X\nURL Source: https://x.org\nMarkdown Content:\n# Heading\n\nSome **bold** and [a link](https://a.b)"
          " ![img](https://i.png) https://bare.url/x end.\n\n* item one")
    assert clean_page_text(md) == "Heading\n\nSome bold and a link end.\n\nitem one"
    assert window("a b c\n\nthe snippet words are right here now\n\nz", "... snippet words are right here now ...",
                  4) == "the snippet words are"


def test_default_endpoints_are_the_public_ones_and_tests_never_reach_them():
    for name, url in (("serper", "https://google.serper.dev/search"), ("serpapi", "https://serpapi.com/search")):
        index = WebIndex(get_provider(name), KEY)
        assert index.endpoint == url
        try:
            with pytest.raises(BackendError, match="a test tried to reach"):  # the guard's failure, as a 503
                index.search(["q"], 3)
        finally:
            index.close()


def test_the_cache_key_holds_the_endpoint_and_the_cache_keeps_at_most_max_entries(tmp_path):
    cache = QueryCache(str(tmp_path / "c.sqlite"), max_entries=2)
    cache.put("serper", "http://a/search", "Q1", 3, "snippet", [{"id": 1}])
    assert cache.get("serper", "http://b/search", "q1", 3, "snippet") is None  # another endpoint: a miss
    assert cache.get("serper", "http://a/search", " q1 ", 2, "snippet") == [{"id": 1}]
    cache.put("serper", "http://a/search", "q2", 3, "snippet", [])
    cache.put("serper", "http://a/search", "q3", 3, "snippet", [])
    assert len(cache) == 2 and cache.evicted == 1
    assert cache.get("serper", "http://a/search", "q1", 3, "snippet") is None  # the oldest went first
    cache.close()


def test_status_decides_before_text_whether_an_account_is_empty():
    serper, serpapi = get_provider("serper"), get_provider("serpapi")
    assert serper.is_quota(400, "Not enough credits") and serper.is_quota(402, "")
    assert not serper.is_quota(429, "quota exceeded, credits not charged") and not serper.is_quota(503, "quota")
    assert serpapi.is_quota(429, "Your account has run out of searches.")  # SerpApi's documented empty account
    assert not serpapi.is_quota(429, "Your account has run out of searches.", retry_after=30)


def test_page_reads_are_paced_and_capped_by_the_budget(tmp_path):
    s = ProviderStandIn("serper")
    reader = PageReader(s.url + "/read", max_words=20)
    index = make(s, reader=reader, reader_limiter=RateLimiter(20.0), max_page_reads=3)
    try:
        hits = index.search(["Ed Wood"], 5)
    finally:
        index.close()
        s.close()
    reads = [r for r in s.requests if r["path"] == "/read"]
    assert len(reads) == 3 and index.counts["page_reads_over_budget"] == 2
    assert sum(p["text"].startswith("the result snippet text") for p in hits[0]) == 2  # the rest kept snippets
    assert index.reader_limiter.waits == 2  # the 2nd and 3rd read waited for their slot
