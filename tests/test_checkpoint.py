"""Checkpoints under a full disk: the save is refused (or its partial folder removed) with a clear error, and the
previous checkpoint stays the one ``latest`` names, so the run resumes from it (a full disk killed three runs in
2026-12 at a checkpoint save with a bare ``No space left on device``)."""

import collections
import os

import pytest
import torch

from openrlhf_search.cpu.main_job import checkpoint as ckpt


@pytest.fixture()
def saved(tmp_path, qwen_tokenizer):
    from openrlhf_search.cpu.main_job.offline_assets import build_tiny_qwen2
    from openrlhf_search.cpu.main_job.optim import make_adamw

    model = build_tiny_qwen2(qwen_tokenizer, hidden_size=16, num_layers=1, num_heads=2)
    opt = make_adamw(list(model.parameters()), lr=1e-3)
    d = str(tmp_path / "ck")

    def save(step):
        return ckpt.save_checkpoint(d, step, model, qwen_tokenizer, {"actor": opt}, {"x": step},
                                    ckpt.rng_state(torch.Generator()))

    save(1)
    return d, save


def _listing(d):
    return sorted(os.listdir(d))


def test_too_little_free_space_refuses_the_save_and_keeps_the_last_checkpoint(saved, monkeypatch):
    d, save = saved
    size = ckpt.folder_bytes(os.path.join(d, "global_step1"))
    assert size > 0
    usage = collections.namedtuple("usage", "total used free")
    monkeypatch.setattr(ckpt.shutil, "disk_usage", lambda p: usage(10 * size, 9 * size, size // 2))
    with pytest.raises(ckpt.CheckpointError, match="not enough disk space.*global_step1"):
        save(2)
    assert _listing(d) == ["global_step1", "latest"]
    assert ckpt.latest_checkpoint(d).endswith("global_step1")
    monkeypatch.setattr(ckpt.shutil, "disk_usage", lambda p: usage(10 * size, 0, 2 * size))
    assert save(2).endswith("global_step2")  # enough space again: the save goes through


def test_a_write_that_fails_removes_its_partial_folder(saved, monkeypatch):
    d, save = saved

    def full_disk(*a, **k):
        raise RuntimeError("[enforce fail at inline_container.cc] PytorchStreamWriter failed writing file: "
                           "file write failed")

    monkeypatch.setattr(ckpt.torch, "save", full_disk)
    with pytest.raises(ckpt.CheckpointError, match="global_step2.*file write failed.*resumes from global_step1"):
        save(2)
    assert _listing(d) == ["global_step1", "latest"]  # no global_step2.tmp left filling the disk
    assert ckpt.load_trainer_files(ckpt.latest_checkpoint(d))["state"]["step"] == 1
