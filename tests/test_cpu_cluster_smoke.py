"""The real cluster path, once per landing (fast suite): ``python -m openrlhf_search.cli.train --cpu_cluster`` runs
OpenRLHF 0.11.2's own ``train_ppo_ray.train()`` on a private local Ray: our trainer, experience maker and masked
losses in DeepSpeed CPU actors (the policy, which also computes the reference's log-probs, and the critic), our
``SearchAgentExecutor`` inside OpenRLHF's vLLM actor class running the real vLLM-CPU engine against a real BM25
``retriever.server``, weights synced over gloo. One Search-R1 PPO step (GAE with a critic, KL in the reward) with a
tiny warm-started policy (cpu_demo/tiny_assets.py).
PPO rather than GRPO here: the critic's values make every advantage non-zero, so the zero-gradient check on
retrieved tokens is never vacuous. Only the policy's top layer trains (``--actor.trainable_layers 1``): the sync then
sends the trained tensors only, and the engine must still equal the trainer everywhere. Slower checks of the same
path: tests/test_cpu_cluster_e2e.py (``make test-slow``)."""

import math

import pytest
import torch

from tests.cpu_cluster_support import assets, environment_spans, retriever, run

# Measured: 3 to 5 minutes with Ray and vLLM start-up on 2 loaded cores; the limit leaves room for a busier box.
pytestmark = pytest.mark.timeout(1500)


def test_one_ppo_step_runs_on_the_real_path(tmp_path):
    """Catches: a crash anywhere on the real path (patches, class injection, executor in the vLLM actor, weight
    sync), a weight sync that leaves the engine on other weights than the trainer's, documents blocks that get a
    policy gradient (a dropped mask between engine and trainer), a DeepSpeed JIT build, missing search / rollout
    logs."""
    from transformers import AutoTokenizer

    from openrlhf_search.env.protocol import get_protocol

    paths = assets("searchr1")
    with retriever(paths["corpus"], str(tmp_path / "index")) as (url, _, _):
        result = run(str(tmp_path), paths, url, steps=1, estimator="gae", n_samples=1, rollout_batch=4,
                     extra=["--critic.model_name_or_path", paths["model"], "--algo.kl.init_coef", "0.001",
                            "--algo.kl.estimator", "k1", "--actor.trainable_layers", "1"])
    assert result.rc == 0, result.describe()
    assert result.left_behind() == []  # the private Ray folder and vLLM's shared-memory segments are removed
    # progress is one line per step; OpenRLHF's per-episode prompt bar and the workers' library warnings are gone
    assert "step 1 of 1" in result.log and "Episode [" not in result.log
    assert result.log.count("The pynvml package is deprecated") <= 1  # the driver's own import, before the filter
    assert "Loading extension module" not in result.log and "Building extension module" not in result.log

    steps = result.steps()
    assert [s["global_step"] for s in steps] == [1]
    status = steps[0]["status"]
    assert math.isfinite(status["policy_loss"]) and math.isfinite(status["critic_loss"])
    for key in ("rollout/reward_mean", "rollout/num_samples", "search/valid_searches_mean",
                "search/retrieval_failed_rate", "timing/generation", "timing/broadcast"):
        assert key in status, sorted(status)
    assert status["rollout/num_samples"] == 4.0

    # the executor ran inside the vLLM actor (another process) and really searched
    records = result.executor()
    assert len(records) == 4 and {r["pid"] for r in records} != {steps[0]["pid"]}
    assert sum(r["extra_logs"]["valid_searches"] for r in records) > 0

    # after the sync every vLLM parameter equals the trainer's, bit for bit
    syncs = result.syncs()
    assert len(syncs) == 1 and syncs[0]["engines"][0]["n_compared"] > 0
    assert syncs[0]["engines"][0]["max_abs_diff"] == 0.0 and not syncs[0]["engines"][0]["missing_in_engine"]
    assert syncs[0]["engines"][0]["packed_layers"] == []  # every layer computes from the synced weights

    # top layer trained, everything below it frozen (the sync sent only the top: the equality above covers the rest);
    # the update replayed the experience forward's frozen-trunk states
    from safetensors.torch import load_file

    before, after = load_file(f"{paths['model']}/model.safetensors"), load_file(f"{result.out_dir}/model.safetensors")
    changed = {n for n in before if not torch.equal(before[n].to(after[n].dtype), after[n])}  # in the run's dtype
    assert changed and all(n.startswith(("model.layers.1.", "model.norm.")) for n in changed), sorted(changed)
    assert status["trunk_cache_hits"] > 0 and "[freeze] top 1 layers" in result.log
    # the reference log-probs came from the policy actor (its initial top layer over the shared trunk): before the
    # first update the policy is the reference, so the KL of the first experience is 0 up to float order
    assert "[reference] computed in the policy actors" in result.log
    assert abs(status["kl"]) < 1e-5, status["kl"]

    # retrieved tokens: exactly zero gradient of the loss with respect to their log-probs; action tokens: some
    tok = AutoTokenizer.from_pretrained(paths["model"])
    proto = get_protocol("searchr1")
    n_env = 0
    action_grad = 0.0
    for batch in result.policy_batches(1):
        for r in range(len(batch["sequences"])):
            ids = batch["sequences"][r][batch["attention_mask"][r].bool()].tolist()
            env = [t - 1 for s, e in environment_spans(ids, tok, proto) for t in range(s, e)]
            n_env += len(env)
            grad = batch["logp_grad"][r]
            assert torch.all(grad[env] == 0) and torch.all(batch["action_mask"][r][env] == 0)
            action_grad += float(grad[batch["action_mask"][r].bool()].abs().sum())
    assert n_env > 0 and action_grad > 0
