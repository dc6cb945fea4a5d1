"""Run the retriever service as a child process: build (once) an index, start ``python -m retriever.server``, wait for
``GET /health``, stop it. Used by the CPU main job (``python -m cpu_demo.run``), the benchmarks,
and the tests of other modules:

    from retriever.launch import running_retriever
    with running_retriever(shared_path("wiki", "hotpotqa_dev500_paragraphs.jsonl"), str(tmp_path), limit=200) as url:
        httpx.post(url + "/retrieve", json={"queries": ["..."], "topk": 3})

``start_server_process`` / ``stop_server_process`` let a test kill a server and bring it back on the same
port (a retriever that dies mid-rollout and comes back).
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import tempfile
import threading
import time
import urllib.error
import urllib.request

REPO_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


class RetrieverStartError(RuntimeError):
    """The server process exited or did not answer /health in time; the message holds its log tail."""


def ensure_index(corpus_path: str, workdir: str, encoder: str = "bm25", limit: int | None = None,
                 index_type: str | None = None, device: str | None = None) -> str:
    """Build (once) an index of the first ``limit`` passages under ``workdir``; returns the index dir.

    A complete index already there (same corpus, encoder, type, limit) is reused. ``device``: the dense encoder's
    device for the passages (``cpu``, ``cuda``; None: sentence-transformers' choice); BM25 ignores it.
    """
    from .index import MANIFEST, build_index

    index_type = index_type or ("bm25" if encoder == "bm25" else "flat")
    name = f"index_{os.path.basename(encoder.rstrip('/'))}_{index_type}_{limit if limit is not None else 'all'}"
    index_dir = os.path.join(workdir, name)
    manifest = os.path.join(index_dir, MANIFEST)
    if os.path.exists(manifest):
        with open(manifest) as f:
            m = json.load(f)
        if m.get("corpus_path") == os.path.abspath(corpus_path) and m.get("limit") == limit:
            return index_dir
    build_index(corpus_path, index_dir, encoder=encoder, index_type=index_type, limit=limit, overwrite=True,
                chunk_size=256, device=device)
    return index_dir


def health(url: str, timeout: float = 2.0) -> dict:
    """GET ``url/health`` -> its JSON. Raises OSError/urllib errors when the server does not answer."""
    # no proxy: HTTP_PROXY without NO_PROXY would send the local server's URL to a node's internet proxy
    with urllib.request.build_opener(urllib.request.ProxyHandler({})).open(url.rstrip("/") + "/health",
                                                                            timeout=timeout) as r:
        return json.loads(r.read())


def _die_with_parent() -> None:
    """In the child, before exec: ask Linux to SIGTERM it when its parent dies, so a trainer or test killed with
    SIGKILL (no ``finally`` runs) leaves no retriever behind holding memory and a port."""
    import ctypes

    PR_SET_PDEATHSIG = 1
    try:
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(PR_SET_PDEATHSIG, signal.SIGTERM)
    except OSError:
        pass  # no glibc: the child outlives a SIGKILLed parent, as any subprocess would


def _pdeathsig_is_safe() -> bool:
    """Linux sends the parent-death signal when the *thread* that forked the child exits, not the process: a server
    started from a worker thread (``asyncio.to_thread``, a thread pool) would be killed when that thread is retired.
    So it is armed only for servers started from the main thread (the CLIs, the benchmarks, test fixtures)."""
    return sys.platform.startswith("linux") and threading.current_thread() is threading.main_thread()


def start_server_process(index_dir: str, port: int | None = None, host: str = "127.0.0.1",
                         timeout_s: float = 120.0, extra_args: list[str] | None = None,
                         log_path: str | None = None) -> tuple[subprocess.Popen, str]:
    """Start ``python -m retriever.server`` on ``index_dir``; wait until ``GET /health`` answers.

    Args:
        port: a fixed port (e.g. the one a killed server used); None picks a free one (the server binds
            port 0 and reports the port through a file, so there is no race with other processes).
        timeout_s: seconds to wait for /health (loading a MiniLM encoder takes a few seconds here).
        extra_args: more server flags (``["--max_topk", "50"]``).
        log_path: server stdout+stderr file (default: a temp file; its tail is in start errors).
    Returns:
        (process, base URL ``http://127.0.0.1:PORT``).
    Raises:
        RetrieverStartError: the process exits or /health does not answer within ``timeout_s``.
    """
    tmpdir = tempfile.mkdtemp(prefix="retriever_")
    port_file = os.path.join(tmpdir, "port")
    log_path = log_path or os.path.join(tmpdir, "server.log")
    cmd = [sys.executable, "-m", "retriever.server", "--index_dir", index_dir, "--host", host,
           "--port", str(port if port is not None else 0), "--port_file", port_file, "--log_level", "warning"]
    cmd += list(extra_args or [])
    env = dict(os.environ)
    env["PYTHONPATH"] = REPO_ROOT + (os.pathsep + env["PYTHONPATH"] if env.get("PYTHONPATH") else "")
    env.setdefault("OMP_NUM_THREADS", "1")
    env.setdefault("TOKENIZERS_PARALLELISM", "false")
    env.setdefault("HF_HUB_OFFLINE", "1")
    log = open(log_path, "wb")
    proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=env, cwd=REPO_ROOT,
                            preexec_fn=_die_with_parent if _pdeathsig_is_safe() else None)
    log.close()
    proc.log_path = log_path  # type: ignore[attr-defined]
    deadline = time.time() + timeout_s
    url = None
    while time.time() < deadline:
        if proc.poll() is not None:
            raise RetrieverStartError(f"retriever exited with {proc.returncode}: {_tail(log_path)}")
        if url is None and os.path.exists(port_file):
            with open(port_file) as f:
                url = f"http://{host}:{int(f.read().strip())}"
        if url is not None:
            try:
                health(url, timeout=2.0)
                return proc, url
            except (OSError, urllib.error.URLError, ValueError):
                pass
        time.sleep(0.1)
    stop_server_process(proc)
    raise RetrieverStartError(f"retriever did not answer /health within {timeout_s}s: {_tail(log_path)}")


def stop_server_process(proc: subprocess.Popen, timeout_s: float = 15.0, sig: int = signal.SIGTERM) -> int:
    """Stop a server started by ``start_server_process`` (SIGTERM, then SIGKILL after ``timeout_s``).

    Pass ``sig=signal.SIGKILL`` to simulate a crash. Returns the exit code.
    """
    if proc.poll() is None:
        proc.send_signal(sig)
        try:
            proc.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
    return proc.returncode


def _tail(path: str, n: int = 3000) -> str:
    try:
        with open(path, "rb") as f:
            return f.read()[-n:].decode("utf-8", "replace")
    except OSError:
        return "(no log)"


@contextlib.contextmanager
def running_retriever(corpus_path: str, workdir: str, encoder: str = "bm25", limit: int | None = None,
                      topk_max: int = 100, index_type: str | None = None, extra_args: list[str] | None = None):
    """Build an index over the first ``limit`` passages of ``corpus_path`` under ``workdir``, start the real
    server on a free 127.0.0.1 port, yield its base URL, and stop it (SIGTERM) on exit.

    Args:
        encoder: ``bm25`` (instant) or ``minilm`` (offline dense encoder, ~35 passages/s on this CPU: keep
            ``limit`` to a few hundred) or any encoder accepted by ``retriever.build_index``.
        topk_max: the server's ``--max_topk``.
    Raises:
        RetrieverStartError: the server did not come up (message holds its log tail).
    """
    index_dir = ensure_index(corpus_path, workdir, encoder=encoder, limit=limit, index_type=index_type)
    proc, url = start_server_process(index_dir, extra_args=["--max_topk", str(topk_max)] + list(extra_args or []))
    try:
        yield url
    finally:
        stop_server_process(proc)
