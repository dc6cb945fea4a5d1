"""Launchers and the Ray Serve retriever: ``RETRIEVER_MODE=serve`` makes common.sh start
``start_retriever_serve.sh`` (one Serve application for the cluster) and hand its URL to the trainer; the
default per-node path is unchanged. The real start (local Ray, BM25) is slow."""

import json
import os
import subprocess
import sys
import time

import pytest

from tests.conftest import REPO_ROOT, shared_path

SCRIPTS = os.path.join(REPO_ROOT, "examples", "scripts")


def _env(**extra):
    env = dict(os.environ, PYTHON=sys.executable, OMP_NUM_THREADS="1", TOKENIZERS_PARALLELISM="false")
    for k in ("RETRIEVER_URLS", "RETRIEVER_MODE", "RAY_ADDRESS"):
        env.pop(k, None)
    env.update(extra)
    return env


def _urls(**env):
    out = subprocess.run(["bash", os.path.join(SCRIPTS, "searchr1_grpo_qwen2.5-3b_base.sh")],
                         env=_env(DRY_RUN="argv", **env), capture_output=True, check=True, timeout=120)
    argv = [a.decode() for a in out.stdout.split(b"\0") if a]
    return argv[argv.index("--search.retriever_urls") + 1]


def test_serve_mode_hands_the_serve_url_to_the_trainer(tmp_path):
    from tests.test_launchers import HAVE_SHARED, _inputs

    if not HAVE_SHARED:
        pytest.skip("../shared/data not found")
    assert _urls(RETRIEVER_MODE="serve", RETRIEVER_SERVE_IP="10.1.2.3", RETRIEVER_PORT="8123") == "http://10.1.2.3:8123"
    assert _urls(RETRIEVER_PORT="8123") == "http://127.0.0.1:8123"  # the per-node default is untouched
    inputs = _inputs(tmp_path, "searchr1_grpo_qwen2.5-3b_base.sh")
    res = subprocess.run(["bash", os.path.join(SCRIPTS, "searchr1_grpo_qwen2.5-3b_base.sh")], capture_output=True,
                         text=True, timeout=300,
                         env=_env(DRY_RUN="1", RETRIEVER_MODE="serve", RETRIEVER_SERVE_IP="10.1.2.3", **inputs))
    assert res.returncode == 0, res.stderr[-2000:]
    assert "start_retriever_serve.sh" in res.stdout + res.stderr


def test_serve_script_rejects_bad_flags():
    res = subprocess.run(["bash", os.path.join(SCRIPTS, "start_retriever_serve.sh"), "--nope"], capture_output=True,
                         text=True, timeout=30, env=_env())
    assert res.returncode == 2 and "unknown flag --nope" in res.stderr
    res = subprocess.run(["bash", os.path.join(SCRIPTS, "start_retriever_serve.sh"), "--corpus", "/no/such.jsonl"],
                         capture_output=True, text=True, timeout=30, env=_env())
    assert res.returncode == 2 and "not found" in res.stderr


@pytest.mark.slow
def test_launcher_starts_the_serve_application_and_stops_it(tmp_path):
    """common.sh with RETRIEVER_MODE=serve and a private Ray (RAY_CLUSTER=local): the index is built, the Serve
    application answers at the URL given to the trainer, and the launcher's exit stops it and its Ray."""
    import socket

    corpus = shared_path("wiki", "hotpotqa_dev500_paragraphs.jsonl")
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    probe = ("import json, sys, urllib.request; req = urllib.request.Request(sys.argv[1] + '/retrieve', "
             "data=json.dumps({'queries': ['Scott Derrickson nationality'], 'topk': 3}).encode(), "
             "headers={'Content-Type': 'application/json'}); "
             "print(len(json.load(urllib.request.urlopen(req, timeout=60))['result'][0]))")
    script = (f'source "{SCRIPTS}/common.sh"; start_retrievers; echo "PID=$RETRIEVER_PID URLS=$RETRIEVER_URLS"; '
              f'"$PYTHON" -c "{probe}" "$RETRIEVER_URLS"')
    res = subprocess.run(["bash", "-c", script], capture_output=True, text=True, timeout=600,
                         env=_env(DRY_RUN="0", RETRIEVER_MODE="serve", RAY_CLUSTER="local",
                                  RETRIEVER_SERVE_IP="127.0.0.1", RETRIEVER_HOST="127.0.0.1", RETRIEVER_PORT=str(port),
                                  RETRIEVER_CORPUS=corpus,
                                  RETRIEVER_ENCODER="bm25", RETRIEVER_LIMIT="300", RETRIEVER_REPLICAS="1",
                                  RETRIEVER_REPLICA_CPUS="0.5", RETRIEVER_INDEX_DIR=str(tmp_path / "index"),
                                  OUTPUT_ROOT=str(tmp_path)))
    log = open(tmp_path / f"retriever_{port}.log").read()
    assert res.returncode == 0, res.stderr[-3000:] + log[-3000:]
    assert 1 <= int(res.stdout.split()[-1]) <= 3
    assert f"URLS=http://127.0.0.1:{port}" in res.stdout
    assert "Serve replica(s)" in log and json.load(open(tmp_path / "index" / "manifest.json"))["count"] == 300
    pid = int(res.stdout.split("PID=")[1].split()[0])
    for _ in range(240):  # SIGTERM from the launcher's EXIT trap: the app is deleted and the local Ray shut down
        if not os.path.exists(f"/proc/{pid}") or open(f"/proc/{pid}/stat").read().split()[2] == "Z":
            break
        time.sleep(0.5)
    else:
        os.kill(pid, 9)
        pytest.fail("retriever.serve still running after the launcher exited")
