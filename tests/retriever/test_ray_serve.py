"""The retriever as a Ray Serve application (``retriever.serve``) on a real local Ray (2 CPUs, no dashboard):
the CLI's start / stop, the same answers and errors as the plain server through one URL, both replicas used, and a
replica SIGKILLed in the middle of a load run with nothing lost beyond the client's retries (counted).

Slow (all but the first test): a local Ray and two replicas take ~30 s to come up on this 2-core machine."""

import asyncio
import json
import os
import signal
import subprocess
import sys
import time

import httpx
import pytest

from retriever.index import load_index
from tests.conftest import REPO_ROOT, shared_path
from tests.retriever.ray_cleanup import descendants

APP = "retriever_test"


@pytest.fixture(scope="module")
def questions():
    with open(shared_path("qa", "with_paragraphs", "hotpotqa_dev500_ircot.jsonl")) as f:
        return [json.loads(line)["question_text"] for _, line in zip(range(64), f)]


def _env():
    env = dict(os.environ)
    env["PYTHONPATH"] = REPO_ROOT + (os.pathsep + env["PYTHONPATH"] if env.get("PYTHONPATH") else "")
    return env


def test_cli_rejects_bad_input_before_starting_ray(tmp_path):
    """A wrong --index_dir or --replicas 0 is one line on stderr and status 2, within seconds (no Ray started)."""
    for args, needle in ((["--index_dir", str(tmp_path)], "manifest.json"),
                         (["--index_dir", str(tmp_path), "--replicas", "0"], "--replicas")):
        proc = subprocess.run([sys.executable, "-m", "retriever.serve", "--ray", *args], cwd=REPO_ROOT, env=_env(),
                              capture_output=True, text=True, timeout=120)
        assert proc.returncode == 2, proc.stderr
        assert needle in proc.stderr
        assert "Started a local Ray" not in proc.stderr


def test_cli_flags(monkeypatch, capsys):
    """Serve flags are parsed here, every other flag by retriever.server's parser; the dashboard address that
    the launchers export (RAY_ADDRESS=http://...) becomes ``auto``; contradictory flags exit 2 with a message."""
    from retriever.serve import parse_args

    monkeypatch.delenv("RAY_ADDRESS", raising=False)
    a, s = parse_args(["--ray", "--replicas", "3", "--index_dir", "D", "--port", "0", "--max_topk", "7", "--topk", "2"])
    assert (a.replicas, a.address, s.index_dir, s.port, s.max_topk, s.topk) == (3, None, "D", 0, 7, 2)
    monkeypatch.setenv("RAY_ADDRESS", "http://head:8265")
    assert parse_args(["--ray", "--index_dir", "D"])[0].address == "auto"
    assert parse_args(["--ray", "--index_dir", "D", "--address", "10.0.0.1:6379"])[0].address == "10.0.0.1:6379"
    a, _ = parse_args(["--ray", "--index_dir", "D", "--replica_resources", '{"retriever": 1}'])
    assert a.replica_resources == {"retriever": 1}
    monkeypatch.delenv("RAY_ADDRESS")
    for argv, msg in ((["--replicas", "2", "--index_dir", "D"], "--replicas needs --ray"),
                      (["--ray", "--detach", "--index_dir", "D"], "--detach needs --address"),
                      (["--ray", "--replica_resources", "[1]", "--index_dir", "D"], "JSON object"),
                      (["--ray", "--index_dir", "D", "--topk", "0"], "--topk must be in"),
                      (["--ray", "--replicas", "2"], "--index_dir")):
        with pytest.raises(SystemExit) as e:
            parse_args(argv)
        assert e.value.code == 2
        assert msg in capsys.readouterr().err


@pytest.mark.slow
def test_cli_serves_and_stops_cleanly(hotpotqa_bm25_index, tmp_path, questions):
    """``python -m retriever.serve --ray`` with a local Ray: answers like the in-process index, SIGTERM -> status 0,
    and its Ray (raylet, gcs) is gone afterwards."""
    port_file = tmp_path / "port"
    log = open(tmp_path / "serve.log", "w")
    proc = subprocess.Popen([sys.executable, "-m", "retriever.serve", "--ray", "--replicas", "1", "--num_cpus", "1",
                             "--replica_cpus", "0.5", "--index_dir", hotpotqa_bm25_index, "--port", "0",
                             "--port_file", str(port_file)], cwd=REPO_ROOT, env=_env(), stdout=log,
                            stderr=subprocess.STDOUT)
    try:
        for _ in range(600):  # up to 5 minutes on a loaded machine; the port file appears once Serve is ready
            if port_file.exists() or proc.poll() is not None:
                break
            time.sleep(0.5)
        assert port_file.exists(), open(tmp_path / "serve.log").read()[-3000:]
        url = f"http://127.0.0.1:{port_file.read_text()}"
        r = httpx.post(url + "/queries", json={"queries": questions[:3], "k": 2}, timeout=60)
        assert r.status_code == 200
        index = load_index(hotpotqa_bm25_index)
        assert r.json()["answers"] == [[p["contents"] for p in hits] for hits in index.search(questions[:3], 2)]
        index.close()
        raylet_pids = descendants(proc.pid)
        assert raylet_pids, "no Ray processes under the CLI"
    finally:
        proc.send_signal(signal.SIGTERM)
        rc = proc.wait(timeout=120)
        log.close()
    assert rc == 0, open(tmp_path / "serve.log").read()[-3000:]
    for _ in range(60):
        alive = [p for p in raylet_pids if os.path.exists(f"/proc/{p}")]
        if not alive:
            break
        time.sleep(0.5)
    assert not alive, f"Ray processes left behind: {alive}"


@pytest.fixture(scope="module")
def serve_app(hotpotqa_bm25_index):
    """A local Ray (2 CPUs) running the retriever with 2 replicas; torn down (Serve, then Ray) after the module."""
    import ray

    from retriever.serve import _free_port, build_application, deploy

    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False)
    try:
        app = build_application(hotpotqa_bm25_index, replicas=2, replica_cpus=0.5, window_ms=5)
        url = deploy(app, port=_free_port("127.0.0.1"), app_name=APP)
        yield url
    finally:
        from tests.retriever.ray_cleanup import shutdown_ray_and_wait

        shutdown_ray_and_wait()


@pytest.mark.slow
def test_same_answers_and_errors_as_the_plain_server(serve_app, hotpotqa_bm25_index, questions):
    index = load_index(hotpotqa_bm25_index)
    expected = index.search(questions[:4], 3)

    async def run():
        async with httpx.AsyncClient(base_url=serve_app, timeout=60) as c:
            scored = await c.post("/retrieve", json={"queries": questions[:4], "topk": 3, "return_scores": True})
            plain = await c.post("/retrieve", json={"queries": questions[:4], "topk": 3})
            r1s = await c.post("/queries", json={"queries": questions[:4], "k": 3})
            bad = [await c.post("/retrieve", json=body) for body in
                   ({"queries": []}, {"queries": ["x"], "topk": 0}, {"queries": [3]}, {"queries": ["x" * 5000]})]
            health = await c.get("/health")
            # 32 concurrent requests: Serve spreads them over both replicas
            many = await asyncio.gather(*(c.post("/retrieve", json={"queries": [q], "topk": 1})
                                          for q in questions[:32]))
            return scored, plain, r1s, bad, health, many

    scored, plain, r1s, bad, health, many = asyncio.run(run())
    assert scored.status_code == plain.status_code == r1s.status_code == 200
    got = scored.json()["result"]
    assert [[h["document"]["id"] for h in hits] for hits in got] == [[p["id"] for p in hits] for hits in expected]
    assert [h["score"] for hits in got for h in hits] == pytest.approx([p["score"] for hits in expected for p in hits])
    assert plain.json()["result"] == [[h["document"] for h in hits] for hits in got]
    assert r1s.json()["answers"] == [[p["contents"] for p in hits] for hits in expected]
    assert [r.status_code for r in bad] == [422, 422, 422, 413]
    assert "non-empty list" in bad[0].json()["detail"]
    assert health.status_code == 200 and health.json()["count"] == len(index) and health.json()["index_type"] == "bm25"
    assert all(r.status_code == 200 for r in many)
    assert len({r.headers["x-retriever-replica"] for r in many}) == 2
    assert [r.json()["result"][0][0]["id"] for r in many] == [hits[0]["id"] for hits in index.search(questions[:32], 1)]
    index.close()


@pytest.mark.slow
def test_replica_killed_during_load_loses_no_request(serve_app, hotpotqa_bm25_index, questions):
    """64 rollout-like workers send 768 searches through ``RetrievalClient``, one query per HTTP request (so about
    64 requests are in flight at any time); after 160 answers one replica is SIGKILLed. Every search must come back
    with the in-process index's answer; the requests the dead replica held fail and are retried (counted in the
    client's stats); Serve brings the deployment back to 2 replicas."""
    from ray import serve

    from openrlhf_search.env.retrieval_client import RetrievalClient

    index = load_index(hotpotqa_bm25_index)
    want = {q: [p["id"] for p in hits] for q, hits in zip(questions, index.search(questions, 3))}
    index.close()
    client = RetrievalClient([serve_app], topk=3, timeout_s=60, max_retries=8, backoff_s=0.25,
                             coalesce_window_ms=0, max_batch_queries=1)
    total, n_workers = 768, 64
    done, wrong, killed = [], [], {}

    async def worker(w):
        for i in range(w, total, n_workers):
            q = questions[i % len(questions)]
            hits = await client.search(q)
            if [p.id for p in hits] != want[q]:
                wrong.append(q)
            done.append(i)

    async def killer():
        async with httpx.AsyncClient(base_url=serve_app, timeout=60) as c:
            while len(done) < 160:
                await asyncio.sleep(0.05)
            r = await c.get("/health")
            killed["replica"], killed["pid"] = r.headers["x-retriever-replica"], int(r.headers["x-retriever-pid"])
            killed["at"] = len(done)
            os.kill(killed["pid"], signal.SIGKILL)  # a crash: no graceful shutdown, in-flight requests cut

    async def run():
        try:
            await asyncio.gather(killer(), *(worker(w) for w in range(n_workers)))
        finally:
            await client.aclose()

    asyncio.run(run())
    print(f"\nreplica {killed['replica']} (pid {killed['pid']}) killed after {killed['at']} answers; client stats "
          f"{client.stats}")
    assert killed["at"] < total
    assert len(done) == total and not wrong
    assert client.stats["errors"] == 0  # nothing lost beyond the retries
    assert client.stats["failures"] >= 1  # the kill did cut requests in flight (else this test proves nothing)
    assert client.stats["retries"] == client.stats["failures"]  # every failed attempt was sent again, and answered
    with pytest.raises(ProcessLookupError):
        os.kill(killed["pid"], 0)
    # Serve replaces the dead replica: two RUNNING replicas again, the killed one not among them
    status = None
    for _ in range(240):
        status = serve.status().applications[APP].deployments["Retriever"]
        if status.replica_states.get("RUNNING", 0) == 2 and status.status == "HEALTHY":
            break
        time.sleep(0.5)
    assert status.replica_states.get("RUNNING", 0) == 2, status

    async def replicas_now():
        async with httpx.AsyncClient(base_url=serve_app, timeout=60) as c:
            rs = await asyncio.gather(*(c.get("/health") for _ in range(32)))
        return {r.headers["x-retriever-replica"] for r in rs}

    seen: set = set()
    for _ in range(60):  # the proxies learn of the new replica shortly after it is RUNNING
        seen |= asyncio.run(replicas_now())
        if len(seen) == 2:
            break
        time.sleep(0.5)
    assert killed["replica"] not in seen and len(seen) == 2
