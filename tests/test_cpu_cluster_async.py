"""OpenRLHF 0.11.2's asynchronous trainer on the real path in CPU cluster mode (``--train.async_enable``):
``PPOTrainerAsync`` with our generator and training actors (openrlhf_search/rl/async_trainer.py), DeepSpeed CPU actors,
the real vLLM-CPU engine running ``SearchAgentExecutor`` against a real BM25 ``retriever.server``, weights synced over
gloo, observed through the recording probe (cpu_demo/probe.py).

Fast (``make test``): async GRPO, 2 steps: finite losses, the engine's weights equal to the trainer's after every
sync, the staleness the queue of 1 implies (the batch of step 0 on the initial weights, the batch of step 1 generated
while step 0 trained), the time split logged and printed. Slow (``make test-slow``): async PPO with a critic (masked
GAE), checkpoint and resume, a killed retriever (failed samples out; the run stops past
``--search.max_failed_fraction``), the reward-stage switch, partial rollouts. Measured on 2 shared cores
(2026-12-02, all passed): the fast test 252 s, partial rollouts 159 s, PPO with a critic 149 s, checkpoint / resume
225 s, the stage switch 118 s (load average 2-17), the killed retriever 667 s (two runs, load average 13-22)."""

import math
import os
import shutil

import pytest

from tests.cpu_cluster_support import Background, assets, flat_samples, retriever, run

pytestmark = pytest.mark.timeout(3000)
# one rank per model and one engine (the cluster default), whatever the launchers' defaults
ONE_RANK = ["--actor.num_gpus_per_node", "1", "--ref.num_gpus_per_node", "1", "--critic.num_gpus_per_node", "1",
            "--reward.num_gpus_per_node", "1", "--vllm.num_engines", "1"]
ASYNC = ["--train.async_enable", "--train.async_queue_size", "1"] + ONE_RANK
KL_LOSS = ["--algo.kl.init_coef", "0.001", "--algo.kl.use_loss", "--algo.kl.estimator", "k3"]
FAST_FAILURE = ["--search.retrieval_max_retries", "1", "--search.retrieval_backoff_s", "0.2",
                "--search.retrieval_timeout_s", "5"]
TIMING_KEYS = ("timing/generation", "timing/make_experience", "timing/ppo_train", "timing/broadcast",
               "step_time/search_in_flight_s", "retrieval/searches", "retrieval/latency_p50_ms",
               "retrieval/latency_p99_ms", "retrieval/qps", "retrieval/retries", "retrieval/failovers",
               "async/trainer_wait_s", "async/engine_wait_s", "async/staleness_mean")


@pytest.fixture(scope="module")
def sr1():
    return assets("searchr1")


def check_async_run(result, n_steps: int, n_samples: int, partial: bool = False):
    """What every async run must show; returns the statuses."""
    assert result.rc == 0, result.describe()
    steps = result.steps()
    assert [s["global_step"] for s in steps] == list(range(1, n_steps + 1)), result.describe()
    for s in steps:
        st = s["status"]
        assert math.isfinite(st["policy_loss"]) and st["rollout/num_samples"] == n_samples
        assert "search/valid_searches_mean" in st and st["search/stale_stage_samples_dropped"] == 0.0
        assert set(TIMING_KEYS) <= set(st), sorted(set(TIMING_KEYS) - set(st))
        assert 0 <= st["async/staleness_max"] <= 1  # the queue of 1 is the staleness bound
        # per-token policy versions reach the trainer from the real vLLM stream (policy_versions)
        assert st["async/token_versions_max"] >= 1 and st["async/samples_spanning_sync"] <= n_samples
        assert 0 <= st["async/token_staleness_max"] <= 1 + partial  # a partial rollout may span one more sync
        assert st["step_time/search_in_flight_s"] <= st["timing/generation"] + 1e-6
    syncs = result.syncs()
    assert len(syncs) == n_steps
    for sync in syncs:
        engine = sync["engines"][0]
        assert engine["max_abs_diff"] == 0.0 and engine["n_compared"] > 0 and not engine["missing_in_engine"]
    assert syncs[0]["policy_digest"] != syncs[-1]["policy_digest"], "the policy's weights never changed"
    # the per-step time split is printed
    assert sum(1 for line in result.log.splitlines() if "time split: generation" in line) >= n_steps
    return [s["status"] for s in steps]


def test_async_grpo_runs_on_the_real_path(sr1, tmp_path):
    """Catches: async refused or crashing (class injection into PPOTrainerAsync's actors), OpenRLHF's experience
    maker in place of ours (no search/* stats), engine weights out of sync, a queue that does not bound the
    staleness, the time split not logged."""
    with retriever(sr1["corpus"], str(tmp_path / "index")) as (url, _, _):
        result = run(str(tmp_path), sr1, url, steps=2, estimator="group_norm", extra=KL_LOSS + ASYNC)
    statuses = check_async_run(result, 2, 8)
    # step 0's batch was generated on the initial weights; step 1's while step 0 trained (on the same weights)
    assert [s["async/staleness_mean"] for s in statuses] == [0.0, 1.0]
    assert all(s["async/samples_spanning_sync"] == 0.0 for s in statuses)  # no partial rollouts: the lock
    assert all(s["async/token_versions_max"] == 1.0 for s in statuses)  # one version per trajectory, every token
    assert [s["async/token_staleness_mean"] for s in statuses] == [0.0, 1.0]
    assert statuses[0]["retrieval/searches"] > 0 and statuses[0]["retrieval/latency_p50_ms"] > 0


@pytest.mark.slow
def test_async_ppo_with_critic(sr1, tmp_path):
    with retriever(sr1["corpus"], str(tmp_path / "index")) as (url, _, _):
        result = run(str(tmp_path), sr1, url, steps=3, estimator="gae", n_samples=1, rollout_batch=4,
                     extra=["--critic.model_name_or_path", sr1["model"], "--algo.kl.init_coef", "0.01",
                            "--algo.kl.estimator", "k1"] + ASYNC)
    statuses = check_async_run(result, 3, 4)
    assert all(math.isfinite(s["critic_loss"]) for s in statuses)
    for k in (1, 2, 3):  # masked GAE: no advantage outside the action mask
        for s in flat_samples(result.experiences(k)):
            assert float(s["advantages"][~s["action_mask"].bool()].abs().sum()) == 0.0


@pytest.mark.slow
def test_async_partial_rollouts(sr1, tmp_path):
    """``--train.partial_rollout_enable``: vLLM-CPU's pause / resume around the weight sync (OpenRLHF's
    ``TrainingActor.broadcast_to_vllm``); trajectories that ran across a sync keep exact tokens and masks (the
    executor's action ranges are what the trainer masks)."""
    with retriever(sr1["corpus"], str(tmp_path / "index")) as (url, _, _):
        result = run(str(tmp_path), sr1, url, steps=3, estimator="group_norm",
                     extra=KL_LOSS + ASYNC + ["--train.partial_rollout_enable"])
    statuses = check_async_run(result, 3, 8, partial=True)
    records = result.executor()
    for k in (1, 2, 3):
        for s in flat_samples(result.experiences(k)):
            # the trained action mask is exactly one trajectory's action ranges as the executor returned them
            # (position t of the mask is token t + 1), with as many tokens: nothing lost, duplicated or re-tokenised
            mask = s["action_mask"].bool().tolist()
            n = len(s["tokens"])
            exact = []
            for rec in records:
                if rec["n_tokens"] != n:
                    continue
                ranges = [False] * (n - 1)
                for b, e in rec["action_ranges"]:
                    for t in range(b, e):
                        ranges[t - 1] = True
                exact.append(ranges == mask)
            assert any(exact), f"step {k}: no executor trajectory with this sample's length and action ranges"
    print("samples spanning a sync per step:", [st["async/samples_spanning_sync"] for st in statuses],
          "most versions in one sample:", [st["async/token_versions_max"] for st in statuses])


@pytest.mark.slow
def test_async_checkpoint_and_resume(sr1, tmp_path):
    """Stopped after step 1 (its checkpoint the latest) and resumed in async mode: the resumed run trains step 2
    only, on the prompts the uninterrupted run trained on at step 2, and the engine gets the checkpoint's weights."""
    with retriever(sr1["corpus"], str(tmp_path / "index")) as (url, _, _):
        full = run(str(tmp_path / "full"), sr1, url, steps=2, estimator="group_norm",
                   extra=KL_LOSS + ASYNC + ["--ckpt.save_steps", "1", "--ckpt.max_num", "3"])
        check_async_run(full, 2, 8)
        ckpt = os.path.join(full.out_dir, "ckpt")
        resumed_ckpt = str(tmp_path / "ckpt")
        shutil.copytree(ckpt, resumed_ckpt)
        for name in os.listdir(os.path.join(resumed_ckpt, "_actor")):
            if name.startswith("global_step") and name != "global_step1":
                shutil.rmtree(os.path.join(resumed_ckpt, "_actor", name))
        with open(os.path.join(resumed_ckpt, "_actor", "latest"), "w") as f:
            f.write("global_step1")
        resumed = run(str(tmp_path / "resumed"), sr1, url, steps=2, estimator="group_norm",
                      extra=KL_LOSS + ASYNC + ["--ckpt.path", resumed_ckpt, "--ckpt.load_enable",
                                               "--ckpt.save_steps", "-1"])
    assert resumed.rc == 0, resumed.describe()
    before, after = full.steps(), resumed.steps()
    assert [s["global_step"] for s in after] == [2]
    assert sorted(after[0]["prompts"]) == sorted(before[1]["prompts"])
    assert resumed.syncs()[0]["policy_digest"] == full.syncs()[0]["policy_digest"]
    assert resumed.syncs()[0]["engines"][0]["max_abs_diff"] == 0.0
    assert after[0]["status"]["async/staleness_mean"] == 0.0  # generated on the checkpoint's weights


def _kill_when_step_logged(background, proc, probe_dir, timeout_s=2400):
    import signal
    import time

    steps = os.path.join(probe_dir, "steps.jsonl")
    deadline = time.time() + timeout_s
    while time.time() < deadline and background.thread.is_alive():
        if os.path.exists(steps) and os.path.getsize(steps) > 0:
            proc.send_signal(signal.SIGKILL)
            proc.wait()
            return True
        time.sleep(0.5)
    return False


@pytest.mark.slow
def test_async_killed_retriever(sr1, tmp_path):
    """The retriever is killed once step 1 is logged: with ``--search.max_failed_fraction 1`` the run completes and
    the later steps' failed samples carry no action token and are left out of the step's search statistics; with
    0.5 it stops with one ``error:`` line naming the flag. Either way the run leaves neither its Ray folder nor
    vLLM's shared memory behind. Catches: failed samples trained on or counted, a failure limit that the async
    trainer's actors swallow (the run hangs on the generator or ends 0), a nested Ray error printed as a
    traceback instead of the line, a run that stops without cleaning up."""
    with retriever(sr1["corpus"], str(tmp_path / "index_a")) as (url, _, proc):
        bg = Background(str(tmp_path / "a"), sr1, url, steps=4, estimator="group_norm",
                        extra=KL_LOSS + ASYNC + FAST_FAILURE + ["--search.max_failed_fraction", "1.0"])
        assert _kill_when_step_logged(bg, proc, str(tmp_path / "a" / "probe"))
        done = bg.join(3000)
    assert done.rc == 0, done.describe()
    statuses = [s["status"] for s in done.steps()]
    assert len(statuses) == 4 and statuses[-1]["search/retrieval_failed_rate"] > 0.0
    n_failed = 0
    for k in range(1, 5):
        samples = flat_samples(done.experiences(k))
        for s in samples:
            if s["failed"]:
                n_failed += 1
                assert not s["action_mask"].any()
        trained = statuses[k - 1]["search/num_trained_samples"]
        assert trained == sum(1 for s in samples if not s["failed"])
    assert n_failed > 0
    assert done.left_behind() == []

    with retriever(sr1["corpus"], str(tmp_path / "index_b")) as (url, _, proc):
        bg = Background(str(tmp_path / "b"), sr1, url, steps=4, estimator="group_norm",
                        extra=KL_LOSS + ASYNC + FAST_FAILURE + ["--search.max_failed_fraction", "0.5"])
        assert _kill_when_step_logged(bg, proc, str(tmp_path / "b" / "probe"))
        stopped = bg.join(3000)
    assert stopped.rc == 1, stopped.describe()
    errors = [line for line in stopped.log.splitlines() if line.startswith("error: ")]
    assert len(errors) == 1 and "--search.max_failed_fraction 0.5" in errors[0], errors
    assert stopped.left_behind() == []


@pytest.mark.slow
def test_async_reward_stage_switch(tmp_path):
    """R1-Searcher's two stages with ``--search.stage2_start_step 1`` in async mode: the generator switches every
    engine before producing step 1's batch, so every trajectory trained at step 0 was scored by stage 1 and every
    one trained at step 1 or later by stage 2 (the executor in the vLLM actor records its scheme), and no sample was
    dropped for another stage."""
    r1 = assets("r1searcher")
    with retriever(r1["corpus"], str(tmp_path / "index")) as (url, _, _):
        result = run(str(tmp_path), r1, url, steps=3, estimator="reinforce_baseline", protocol="r1searcher",
                     reward_scheme="r1searcher_stage1",
                     extra=["--search.stage2_reward_scheme", "r1searcher_stage2", "--search.stage2_start_step", "1",
                            "--search.chat_template", "false", "--algo.kl.init_coef", "0.001",
                            "--algo.kl.estimator", "k1"] + ASYNC)
    statuses = check_async_run(result, 3, 8)
    assert [s["search/reward_stage"] for s in statuses] == [1.0, 2.0, 2.0]
    steps = result.steps()
    step_of = {p: i for i, s in enumerate(steps) for p in s["prompts"]}
    trained = [r for r in result.executor() if r["prompt"] in step_of]
    assert trained
    for rec in trained:
        assert rec["scheme"] == ("r1searcher_stage1" if step_of[rec["prompt"]] == 0 else "r1searcher_stage2")
