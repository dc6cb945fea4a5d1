"""The real retrieval server (subprocess on a free 127.0.0.1 port): both schemas under concurrent clients,
results identical to in-process search, every bad input -> 4xx while serving on, clean shutdown and restart."""

import asyncio
import json
import signal

import httpx
import pytest

from retriever.index import load_index
from retriever.launch import (RetrieverStartError, health, running_retriever, start_server_process,
                               stop_server_process)
from tests.conftest import shared_path


@pytest.fixture(scope="module")
def corpus():
    return shared_path("wiki", "hotpotqa_dev500_paragraphs.jsonl")


@pytest.fixture(scope="module")
def questions():
    with open(shared_path("qa", "with_paragraphs", "hotpotqa_dev500_ircot.jsonl")) as f:
        return [json.loads(line)["question_text"] for _, line in zip(range(48), f)]


@pytest.fixture(scope="module")
def bm25_dir(hotpotqa_bm25_index):
    return hotpotqa_bm25_index


@pytest.fixture(scope="module")
def server(bm25_dir):
    # a wide batching window so that concurrent requests visibly share batches
    proc, url = start_server_process(bm25_dir, extra_args=["--batch_window_ms", "30"])
    yield proc, url
    stop_server_process(proc)


def _expected(index, queries, topk):
    return index.search(queries, topk)


async def _client(url, questions, i, topk):
    """One client: three requests in the three response forms."""
    qs = [questions[i % len(questions)], questions[(i + 7) % len(questions)]]
    async with httpx.AsyncClient(base_url=url, timeout=30) as c:
        scored = await c.post("/retrieve", json={"queries": qs, "topk": topk, "return_scores": True})
        plain = await c.post("/retrieve", json={"queries": qs, "topk": topk})
        r1 = await c.post("/queries", json={"queries": qs, "k": topk})
    return qs, scored, plain, r1


def test_concurrent_clients_both_schemas_match_in_process(server, bm25_dir, questions):
    _, url = server
    before = health(url)["stats"]

    async def run():
        return await asyncio.gather(*[_client(url, questions, i, topk=3 if i % 2 else 5) for i in range(32)])

    outs = asyncio.run(run())
    index = load_index(bm25_dir)
    for i, (qs, scored, plain, r1) in enumerate(outs):
        topk = 3 if i % 2 else 5
        assert scored.status_code == plain.status_code == r1.status_code == 200
        exp = _expected(index, qs, topk)
        got = scored.json()["result"]
        assert [[d["document"]["id"] for d in hits] for hits in got] == [[p["id"] for p in h] for h in exp]
        assert [d["score"] for hits in got for d in hits] == pytest.approx([p["score"] for h in exp for p in h])
        assert set(got[0][0]["document"]) == {"id", "contents", "title", "text"}
        # Search-R1 without scores: a plain list of documents per query
        assert plain.json()["result"] == [[{k: p[k] for k in ("id", "contents", "title", "text")} for p in h]
                                         for h in exp]
        # R1-Searcher schema
        assert r1.json() == {"queries": qs, "answers": [[p["contents"] for p in h] for h in exp]}
    after = health(url)["stats"]
    served = after["requests"] - before["requests"]
    assert served == 96 and after["queries"] - before["queries"] == 192
    assert after["batches"] - before["batches"] < served  # concurrent requests were coalesced
    assert after["max_batch_queries_seen"] > 2


def test_micro_batching_off_flag_serves_the_same_results_one_search_per_request(bm25_dir, questions):
    proc, url = start_server_process(bm25_dir, extra_args=["--no_batching"])
    try:
        async def run():
            return await asyncio.gather(*[_client(url, questions, i, topk=3) for i in range(8)])

        outs = asyncio.run(run())
        stats = health(url)["stats"]
    finally:
        stop_server_process(proc)
    index = load_index(bm25_dir)
    for qs, scored, _, r1 in outs:
        exp = _expected(index, qs, 3)
        assert [[d["document"]["id"] for d in hits] for hits in scored.json()["result"]] == \
            [[p["id"] for p in h] for h in exp]
        assert r1.json()["answers"] == [[p["contents"] for p in h] for h in exp]
    assert stats["batching"] is False
    assert stats["requests"] == stats["batches"] == 24 and stats["max_batch_queries_seen"] == 2


BAD_BODIES = [
    ({}, 422), ({"queries": []}, 422), ({"queries": "one string"}, 422), ({"queries": [""]}, 422),
    ({"queries": ["   "]}, 422), ({"queries": [3]}, 422), ({"queries": [None]}, 422), ({"queries": [["nested"]]}, 422),
    ({"queries": ["q" * 100_000]}, 413), ({"queries": ["ok", "x" * 4097]}, 413),
    ({"queries": ["x"], "topk": 0}, 422), ({"queries": ["x"], "topk": -3}, 422), ({"queries": ["x"], "topk": 101}, 422),
    ({"queries": ["x"], "topk": 10**12}, 422), ({"queries": ["x"], "topk": "3"}, 422),
    ({"queries": ["x"], "topk": 2.5}, 422),
    ({"queries": ["x"], "topk": True}, 422), ({"queries": ["x"], "return_scores": "yes"}, 422),
    ({"queries": ["x"] * 1025}, 422),
]


def test_bad_inputs_get_4xx_and_server_keeps_serving(server, questions):
    proc, url = server
    with httpx.Client(base_url=url, timeout=30) as c:
        for body, status in BAD_BODIES:
            r = c.post("/retrieve", json=body)
            assert r.status_code == status, (body if len(json.dumps(body)) < 200 else "long", r.text[:200])
            assert r.json()["detail"]  # says what is wrong
        for body in ({"queries": ["x"], "k": 0}, {"queries": []}, {"k": 3}):
            assert c.post("/queries", json=body).status_code == 422
        json_type = {"content-type": "application/json"}
        assert c.post("/retrieve", content=b'{"queries": ["x"', headers=json_type).status_code == 422
        assert c.post("/retrieve", content=b"\xff\xfe", headers=json_type).status_code == 422
        assert c.post("/retrieve", json=["not", "an", "object"]).status_code == 422
        deep = b'{"queries": ' + b"[" * 5000 + b"]" * 5000 + b"}"  # RecursionError in json.loads
        for path in ("/retrieve", "/queries"):
            r = c.post(path, content=deep, headers={"content-type": "application/json"})
            assert r.status_code == 422 and "nested" in r.json()["detail"]
            # a lone surrogate decodes to a str that cannot be encoded back (the /queries echo was a 500)
            r = c.post(path, content=b'{"queries": ["abc \\ud800 def"]}', headers={"content-type": "application/json"})
            assert r.status_code == 422 and "queries[0]" in r.json()["detail"], r.text[:200]
        assert c.post("/retrieve", content=b"x" * (9 * 1024 * 1024)).status_code == 413
        assert c.get("/retrieve").status_code == 405
        # still serving, correctly
        r = c.post("/retrieve", json={"queries": questions[:2], "topk": 2, "return_scores": True})
        assert r.status_code == 200 and [len(h) for h in r.json()["result"]] == [2, 2]
        assert c.post("/retrieve", json={"queries": ["x"], "topk": 100}).status_code == 200
        assert c.post("/retrieve", json={"queries": ["x" * 4096]}).status_code == 200  # at the limit: fine
    assert proc.poll() is None
    assert health(url)["stats"]["errors"] == 0


def test_shutdown_and_restart_on_same_port_with_existing_index(bm25_dir, questions):
    proc, url = start_server_process(bm25_dir)
    body = {"queries": questions[:4], "topk": 3, "return_scores": True}
    first = httpx.post(url + "/retrieve", json=body).json()
    assert stop_server_process(proc, sig=signal.SIGTERM) == 0  # clean shutdown
    with pytest.raises(httpx.ConnectError):
        httpx.post(url + "/retrieve", json=body)
    port = int(url.rsplit(":", 1)[1])
    proc2, url2 = start_server_process(bm25_dir, port=port)  # comes back at the same URL, index reused
    try:
        assert url2 == url
        assert httpx.post(url + "/retrieve", json=body).json() == first
        stop_server_process(proc2, sig=signal.SIGKILL)  # a crash ...
        proc2, url2 = start_server_process(bm25_dir, port=port)  # ... and a restart
        assert httpx.post(url + "/retrieve", json=body).json() == first
        assert stop_server_process(proc2, sig=signal.SIGINT) == 0  # Ctrl-C is clean too
    finally:
        stop_server_process(proc2)


def test_start_errors_are_clear(tmp_path, bm25_dir):
    with pytest.raises(RetrieverStartError, match="no manifest.json"):
        start_server_process(str(tmp_path), timeout_s=60)
    proc, url = start_server_process(bm25_dir)
    try:  # the port is taken: the second server fails fast with a message instead of hanging
        with pytest.raises(RetrieverStartError, match="cannot bind"):
            start_server_process(bm25_dir, port=int(url.rsplit(":", 1)[1]), timeout_s=60)
    finally:
        stop_server_process(proc)
    # limits under which every request would get a 4xx (or wait forever) are refused at start, not served
    with pytest.raises(RetrieverStartError, match="--topk must be in"):
        proc, _ = start_server_process(bm25_dir, extra_args=["--topk", "500"], timeout_s=60)
        stop_server_process(proc)  # reached only if the flag was wrongly accepted: leave no server behind


@pytest.mark.parametrize("flags, says", [
    (["--topk", "500"], "--topk"), (["--max_topk", "0"], "--max_topk"), (["--max_queries", "0"], "--max_queries"),
    (["--max_query_chars", "0"], "--max_query_chars"), (["--max_batch_queries", "0"], "--max_batch_queries"),
    (["--batch_window_ms", "inf"], "--batch_window_ms"), (["--batch_max_wait_ms", "nan"], "--batch_max_wait_ms"),
    (["--batch_window_ms", "-5"], "--batch_window_ms"),
])
def test_server_flags_that_would_refuse_or_hold_every_request(flags, says, capsys):
    from retriever.server import parse_args

    with pytest.raises(SystemExit) as e:
        parse_args(["--index_dir", "x"] + flags)
    assert e.value.code == 2 and says in capsys.readouterr().err


def test_running_retriever_minilm_matches_in_process(corpus, tmp_path, questions):
    """Dense service end to end (MiniLM Flat over 48 passages): same passages and scores as in-process."""
    with running_retriever(corpus, str(tmp_path), encoder="minilm", limit=48, topk_max=10) as url:
        r = httpx.post(url + "/retrieve", json={"queries": questions[:6], "topk": 4, "return_scores": True},
                       timeout=60)
        assert r.status_code == 200
        assert httpx.post(url + "/retrieve", json={"queries": ["x"], "topk": 11}).status_code == 422  # topk_max
        info = health(url)
        assert info["index_type"] == "flat" and info["encoder"] == "minilm" and info["count"] == 48
    with pytest.raises(httpx.ConnectError):  # stopped on exit
        httpx.get(url + "/health")
    index = load_index(info["index_dir"])
    exp = index.search(questions[:6], 4)
    got = r.json()["result"]
    assert [[d["document"]["id"] for d in h] for h in got] == [[p["id"] for p in h] for h in exp]
    assert [d["score"] for h in got for d in h] == pytest.approx([p["score"] for h in exp for p in h], abs=1e-5)


def test_start_retriever_script_builds_then_serves(corpus, tmp_path):
    """examples/scripts/start_retriever.sh: builds the missing index, serves it, stops cleanly on SIGTERM."""
    import os
    import subprocess
    import time

    from retriever.launch import REPO_ROOT

    port_file = tmp_path / "port"
    index_dir = tmp_path / "idx"
    cmd = ["bash", os.path.join(REPO_ROOT, "examples", "scripts", "start_retriever.sh"), "--corpus", corpus,
           "--index_dir", str(index_dir), "--limit", "50", "--port", "0", "--", "--port_file", str(port_file)]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
    try:
        deadline = time.time() + 120
        while not port_file.exists() and time.time() < deadline and proc.poll() is None:
            time.sleep(0.1)
        assert port_file.exists(), proc.stdout.read().decode()[-2000:] if proc.poll() is not None else "timeout"
        url = f"http://127.0.0.1:{port_file.read_text().strip()}"
        for _ in range(100):
            try:
                info = health(url)
                break
            except OSError:
                time.sleep(0.1)
        assert info["count"] == 50 and info["index_type"] == "bm25"
        assert (index_dir / "manifest.json").exists()
        r = httpx.post(url + "/queries", json={"queries": ["Shirley Temple"], "k": 1})
        assert r.status_code == 200 and "Shirley Temple" in r.json()["answers"][0][0]
    finally:
        rc = stop_server_process(proc)
    assert rc == 0
    bad = subprocess.run(["bash", os.path.join(REPO_ROOT, "examples", "scripts", "start_retriever.sh"),
                          "--corpus", str(tmp_path / "missing.jsonl")], capture_output=True, text=True)
    assert bad.returncode == 2 and "not found" in bad.stderr


def test_server_stops_when_its_parent_is_killed(bm25_dir, tmp_path):
    """A trainer killed with SIGKILL runs no ``finally``: the retriever it started must not outlive it."""
    import os
    import subprocess
    import sys
    import time

    from retriever.launch import REPO_ROOT

    pid_file = tmp_path / "server.pid"
    parent = subprocess.Popen([sys.executable, "-c", (
        "import sys, time\n"
        "from retriever.launch import start_server_process\n"
        f"proc, url = start_server_process({bm25_dir!r})\n"
        f"open({str(pid_file)!r}, 'w').write(str(proc.pid))\n"
        "time.sleep(600)\n")], cwd=REPO_ROOT)
    try:
        deadline = time.time() + 120
        while not (pid_file.exists() and pid_file.read_text()) and time.time() < deadline:
            assert parent.poll() is None, "the parent failed to start the server"
            time.sleep(0.2)
        server_pid = int(pid_file.read_text())
        os.kill(server_pid, 0)  # alive while its parent lives
        parent.kill()
        parent.wait()
        deadline = time.time() + 30
        while time.time() < deadline:
            try:
                os.kill(server_pid, 0)
            except ProcessLookupError:
                return
            # reap it if it is our zombie grandchild's orphan (reparented to init, which reaps it)
            time.sleep(0.2)
        raise AssertionError(f"retriever pid {server_pid} still running 30 s after its parent was killed")
    finally:
        if parent.poll() is None:
            parent.kill()


def test_server_started_from_a_worker_thread_outlives_that_thread(bm25_dir):
    """Linux's parent-death signal follows the forking *thread*: a server started through ``asyncio.to_thread`` must
    not die when the worker thread is retired (it did, once, mid-test)."""
    import threading
    import time

    started = {}
    t = threading.Thread(target=lambda: started.update(zip(("proc", "url"), start_server_process(bm25_dir))))
    t.start()
    t.join()
    try:
        time.sleep(1.0)
        assert started["proc"].poll() is None, "the server died with the thread that started it"
        assert health(started["url"])["status"] == "ok"
    finally:
        stop_server_process(started["proc"])


def test_added_latency_delays_every_answer(bm25_dir, questions):
    """``--added_latency_ms`` (the asynchronous-training benchmark's slow retriever) holds each /retrieve answer at
    least that long and changes nothing else. Mutation caught: the flag parsed but not applied."""
    import time

    proc, url = start_server_process(bm25_dir, extra_args=["--added_latency_ms", "300"])
    try:
        body = {"queries": questions[:2], "topk": 3}
        start = time.monotonic()
        slow = httpx.post(url + "/retrieve", json=body, timeout=30).json()
        assert time.monotonic() - start >= 0.3
    finally:
        stop_server_process(proc)
    proc, url = start_server_process(bm25_dir)
    try:
        assert httpx.post(url + "/retrieve", json=body, timeout=30).json() == slow
    finally:
        stop_server_process(proc)
