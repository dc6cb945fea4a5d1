"""What a CPU-cluster run leaves on the machine and what its console ends with, without starting Ray
(openrlhf_search/cpu/cluster_mode/runtime.py ``PrivateRay``, ``last_worker_traceback``). The end-to-end checks are in
tests/test_cpu_cluster_smoke.py (normal exit) and tests/test_cpu_cluster_e2e.py (SIGTERM)."""

import os
from multiprocessing import shared_memory

from openrlhf_search.cpu.cluster_mode.private_ray import SHM_DIR, PrivateRay, last_worker_traceback

# A vLLM engine failure as Ray writes it to the rollout actor's worker-*.err (shape of a real log; paths shortened)
WORKER_ERR = """\
INFO 12-02 15:55:34 [core.py:93] Initializing a V1 LLM engine (v0.29.0) with config: model='/x/model'
ERROR 12-02 15:57:01 [core.py:712] EngineCore encountered a fatal error.
Traceback (most recent call last):
  File "/venv/site-packages/vllm/v1/engine/core.py", line 703, in run_engine_core
    engine_core.run_busy_loop()
  File "/venv/site-packages/vllm/v1/worker/worker_base.py", line 267, in execute_method
    return func(*args, **kwargs)
  File "/work/main/openrlhf_search/cpu/cluster_mode/runtime.py", line 421, in update_weight
    self.model_runner.model.load_weights(weights=[(name, weight)])
  File "/venv/site-packages/vllm/model_executor/models/qwen2.py", line 398, in load_weights
    weight_loader = param.weight_loader
                    ^^^^^^^^^^^^^^^^^^^
AttributeError: 'Parameter' object has no attribute 'weight_loader'
INFO 12-02 15:57:02 [core.py:720] shutting down
"""


def _session(tmp_path, name, text, mtime=None):
    logs = tmp_path / "session_2026-12-02_15-53-41_1" / "logs"
    logs.mkdir(parents=True, exist_ok=True)
    path = logs / name
    path.write_text(text)
    if mtime is not None:
        os.utime(path, (mtime, mtime))
    return path


def test_last_worker_traceback_names_the_exception_and_its_frame(tmp_path):
    """Mutation caught: the outermost frame reported instead of the innermost, or the last line missed."""
    _session(tmp_path, "worker-aa-01-10.out", "nothing here\n")
    _session(tmp_path, "worker-bb-01-11.err", WORKER_ERR)
    found = last_worker_traceback(str(tmp_path))
    assert found["exception"] == "AttributeError: 'Parameter' object has no attribute 'weight_loader'"
    assert found["where"] == "/venv/site-packages/vllm/model_executor/models/qwen2.py:398 in load_weights"
    assert found["log"].endswith("worker-bb-01-11.err")


def test_the_newest_traceback_wins_and_none_without_one(tmp_path):
    assert last_worker_traceback(str(tmp_path)) is None
    _session(tmp_path, "worker-old-01-1.err", WORKER_ERR, mtime=1_000)
    newer = WORKER_ERR.replace("AttributeError: 'Parameter'", "RuntimeError: boom 'Parameter'")
    _session(tmp_path, "worker-new-01-2.err", newer, mtime=2_000)
    assert last_worker_traceback(str(tmp_path))["exception"].startswith("RuntimeError: boom")


def test_failure_line_keeps_the_log_outside_the_removed_folder(tmp_path):
    private = PrivateRay(temp_root=str(tmp_path))
    _session(tmp_path / os.path.basename(private.temp_dir), "worker-bb-01-11.err", WORKER_ERR)
    line = private.failure(keep_log_in=str(tmp_path / "out"))
    assert line.startswith("a Ray worker failed: AttributeError: 'Parameter' object has no attribute 'weight_loader'")
    assert "qwen2.py:398 in load_weights" in line and str(tmp_path / "out" / "ray_worker_failure.log") in line
    private.cleanup(wait_s=0)
    assert not os.path.exists(private.temp_dir) and (tmp_path / "out" / "ray_worker_failure.log").exists()


def test_cleanup_removes_the_runs_unmapped_segments_only(tmp_path):
    """A segment from before the run, and one a live process still maps, stay; the dead run's segment goes.
    Mutation caught: every psm_* removed (another run's live ring buffer), or none."""
    before = shared_memory.SharedMemory(create=True, size=4096)
    try:
        private = PrivateRay(temp_root=str(tmp_path))
        dead = shared_memory.SharedMemory(create=True, size=4096)
        dead_name = dead.name.lstrip("/")
        dead.close()  # unmapped: what a SIGKILLed engine process leaves
        live = shared_memory.SharedMemory(create=True, size=4096)
        try:
            assert private.leaked_shm_segments() == [dead_name]
            removed = private.cleanup(wait_s=0)
            assert os.path.join(SHM_DIR, dead_name) in removed and not os.path.exists(os.path.join(SHM_DIR, dead_name))
            assert os.path.exists(os.path.join(SHM_DIR, live.name.lstrip("/")))
            assert os.path.exists(os.path.join(SHM_DIR, before.name.lstrip("/")))
            assert not os.path.exists(private.temp_dir)
        finally:
            live.close()
            live.unlink()
    finally:
        before.close()
        before.unlink()


_DRIVER = r'''
import os, signal, subprocess, sys, time
from multiprocessing import shared_memory
from openrlhf_search.cpu.cluster_mode.private_ray import PrivateRay

private = PrivateRay(temp_root=sys.argv[1])
# a process tree like the local Ray's (a child with a grandchild), and a segment an engine process maps
child = subprocess.Popen([sys.executable, "-c", "import subprocess, sys, time; "
                          "subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(600)']); time.sleep(600)"])
seg = shared_memory.SharedMemory(create=True, size=4096)
signal.signal(signal.SIGTERM, lambda signum, frame: private.terminate(128 + signum))
print(private.temp_dir, seg.name.lstrip("/"), child.pid, flush=True)
time.sleep(600)
'''


def test_sigterm_ends_the_process_tree_and_removes_what_it_left(tmp_path):
    """What cli.train's SIGTERM handler does in CPU cluster mode (the slow end-to-end test sends it to a real run).
    Mutation caught: descendants not killed (the grandchild survives), or the folder / segment left."""
    import signal
    import subprocess
    import sys
    import time

    from tests.cpu_cluster_support import REPO

    proc = subprocess.Popen([sys.executable, "-c", _DRIVER, str(tmp_path)], stdout=subprocess.PIPE, text=True,
                            env=dict(os.environ, PYTHONPATH=REPO), cwd=REPO)
    folder, seg, child = proc.stdout.readline().split()
    time.sleep(1.0)  # the grandchild has started
    from openrlhf_search.cpu.cluster_mode.private_ray import _descendants

    tree = _descendants(proc.pid)
    assert len(tree) >= 2
    proc.send_signal(signal.SIGTERM)
    assert proc.wait(timeout=60) == 143
    time.sleep(0.5)
    assert not any(os.path.exists(f"/proc/{p}") and open(f"/proc/{p}/stat").read().split()[2] != "Z" for p in tree)
    assert not os.path.exists(folder) and not os.path.exists(os.path.join(SHM_DIR, seg))
