"""A fresh run in a reused output folder must keep its own checkpoints: OpenRLHF's rotation (max_num) counts every
checkpoint folder in --ckpt.path, whichever run wrote it. FRESH=1 moves the earlier run aside first, so the new
run's global_step5 survives and ``latest`` names it, with the earlier global_step10/15 still on disk."""

import os
import time

import deepspeed
import pytest

import openrlhf.utils.deepspeed.deepspeed as ods
from tests.test_launchers import _common


class _Engine(deepspeed.DeepSpeedEngine):
    """Stands in for a DeepSpeed engine: writes a checkpoint folder and ``latest`` as DeepSpeed does."""

    def __init__(self):  # no engine state needed
        pass

    def save_checkpoint(self, save_dir, tag=None, client_state=None, save_latest=True):
        os.makedirs(os.path.join(save_dir, tag), exist_ok=True)
        with open(os.path.join(save_dir, tag, "mp_rank_00_model_states.pt"), "w") as f:
            f.write("x")
        if save_latest:
            with open(os.path.join(save_dir, "latest"), "w") as f:
                f.write(tag)


class _Strategy(ods.DeepspeedStrategy):
    """OpenRLHF's strategy, its real save_ckpt (rotation included), on one rank without a process group."""

    def __init__(self):
        pass

    def is_rank_0(self):
        return True

    def print(self, *args, **kwargs):
        pass


def _save(actor_dir, step, max_num):
    ods.DeepspeedStrategy.save_ckpt(_Strategy(), _Engine(), str(actor_dir), tag=f"global_step{step}", max_num=max_num)


@pytest.fixture
def no_barrier(monkeypatch):
    monkeypatch.setattr(ods, "torch_dist_barrier_and_cuda_sync", lambda: None)


def test_fresh_run_in_a_used_folder_keeps_its_own_checkpoint(tmp_path, no_barrier):
    run = tmp_path / "run"
    actor = run / "ckpt" / "_actor"
    for step in (10, 15):  # an earlier run's checkpoints, written before this run starts
        _save(actor, step, max_num=2)
        time.sleep(0.02)
    assert (actor / "latest").read_text() == "global_step15"
    snippet = f'resume_args --ckpt.output_dir "{run}" --ckpt.path "{run}/ckpt"; echo "ARGS=${{RESUME_ARGS[*]:-}}"'
    res = _common(snippet, timeout=60, FRESH="1")
    assert res.returncode == 0 and "ARGS=\n" in res.stdout + "\n", res.stderr
    _save(actor, 5, max_num=1)  # the new run's first checkpoint, OpenRLHF's rotation at --ckpt.max_num 1
    assert sorted(os.listdir(actor)) == ["global_step5", "latest"]
    assert (actor / "latest").read_text() == "global_step5" and (actor / "global_step5").is_dir()
    aside = list(tmp_path.glob("run.old-*"))
    assert len(aside) == 1 and sorted(os.listdir(aside[0] / "ckpt" / "_actor")) == ["global_step10",
                                                                                    "global_step15", "latest"]


def test_a_used_folder_without_fresh_is_resumed_not_rotated(tmp_path, no_barrier):
    run = tmp_path / "run"
    _save(run / "ckpt" / "_actor", 10, max_num=2)
    snippet = f'resume_args --ckpt.output_dir "{run}" --ckpt.path "{run}/ckpt"; echo "ARGS=${{RESUME_ARGS[*]:-}}"'
    res = _common(snippet, timeout=60)
    assert res.returncode == 0 and "ARGS=--ckpt.load_enable" in res.stdout  # continues at step 10, not a new run
