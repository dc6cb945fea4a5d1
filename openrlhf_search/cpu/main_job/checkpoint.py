"""Checkpoints of the CPU main job: HF-format model + tokenizer, critic, optimiser, data position and RNG.

Layout under the checkpoint folder::

    global_step{N}/actor/            save_pretrained of the policy and its tokenizer (loadable by vLLM / HF)
    global_step{N}/critic.pt         value critic state (PPO only)
    global_step{N}/optimizer.pt      AdamW states {"actor": ..., "critic": ...}
    global_step{N}/rng.pt            python, numpy, torch and rollout-engine generator states
    global_step{N}/trainer_state.json  step, data epoch and position, metrics rows written
    ref/                             the reference policy (the model RL started from), written once
    latest                           name of the newest complete checkpoint (written last, atomically)

A checkpoint is written into ``global_step{N}.tmp`` and renamed when complete, and ``latest`` is replaced only
afterwards, so a job killed while saving resumes from the previous checkpoint. Before writing, the free disk space is
compared with the size of the newest complete checkpoint (a SmolLM2 checkpoint is ~0.6 GB): too little stops the run
with a :class:`CheckpointError` that says so, and a write that fails anyway (``No space left on device``) removes its
partial folder, so the disk is not left full and the previous checkpoint stays the one to resume from.
"""

import json
import os
import random
import shutil
from typing import Optional

import numpy as np
import torch

LATEST = "latest"


class CheckpointError(RuntimeError):
    """A checkpoint folder is incomplete or unreadable; the message names the file."""


def _atomic_write_text(path: str, text: str) -> None:
    tmp = path + ".tmp"
    with open(tmp, "w") as fh:
        fh.write(text)
        fh.flush()
        os.fsync(fh.fileno())
    os.replace(tmp, path)


def rng_state(engine_generator: Optional[torch.Generator] = None) -> dict:
    """All random states that shape a rollout (python, numpy, torch CPU, the engine's sampling generator)."""
    state = {"python": random.getstate(), "numpy": np.random.get_state(), "torch": torch.get_rng_state()}
    if engine_generator is not None:
        state["engine"] = engine_generator.get_state()
    return state


def set_rng_state(state: dict, engine_generator: Optional[torch.Generator] = None) -> None:
    """Restore what :func:`rng_state` captured."""
    random.setstate(state["python"])
    np.random.set_state(state["numpy"])
    torch.set_rng_state(state["torch"])
    if engine_generator is not None and "engine" in state:
        engine_generator.set_state(state["engine"])


def folder_bytes(path: str) -> int:
    """Bytes of the regular files under ``path`` (0 when it does not exist)."""
    return sum(os.path.getsize(os.path.join(d, f)) for d, _, files in os.walk(path) for f in files
               if os.path.isfile(os.path.join(d, f)))


def _gib(n: float) -> str:
    return f"{n / 2 ** 30:.2f} GiB"


def check_disk_space(ckpt_dir: str, margin: float = 1.1) -> None:
    """Refuse a checkpoint that would not fit: the newest complete one's size (times ``margin``) must be free.

    Raises:
        CheckpointError: less free space under ``ckpt_dir`` than the previous checkpoint took; the message gives both
            figures and the checkpoint that stays the one to resume from.
    """
    prev = latest_checkpoint(ckpt_dir)
    if prev is None:
        return  # the first checkpoint: its size is not known yet (a write that fails is caught below)
    need, free = folder_bytes(prev) * margin, shutil.disk_usage(ckpt_dir).free
    if free < need:
        raise CheckpointError(f"not enough disk space for the next checkpoint in {ckpt_dir}: {_gib(free)} free, "
                              f"~{_gib(need)} needed (the size of {os.path.basename(prev)}); the run stops here and "
                              f"resumes from {os.path.basename(prev)} once space is freed (or with a lower "
                              f"--ckpt.max_num)")


def save_checkpoint(ckpt_dir: str, step: int, actor, tokenizer, optimizers: dict, trainer_state: dict,
                    rng: dict, critic=None, max_num: int = 2) -> str:
    """Write checkpoint ``global_step{step}`` and point ``latest`` at it; keep the newest ``max_num``.

    Returns:
        the checkpoint folder.
    Raises:
        CheckpointError: not enough free disk space (:func:`check_disk_space`), or writing failed (a full disk,
            ``No space left on device``): the partial folder is removed; ``latest`` still names the previous one.
    """
    os.makedirs(ckpt_dir, exist_ok=True)
    check_disk_space(ckpt_dir)
    name = f"global_step{step}"
    final = os.path.join(ckpt_dir, name)
    tmp = final + ".tmp"
    shutil.rmtree(tmp, ignore_errors=True)
    try:
        _write_checkpoint_files(tmp, step, actor, tokenizer, optimizers, trainer_state, rng, critic)
    except (OSError, RuntimeError) as e:  # torch.save reports a full disk as RuntimeError ("file write failed")
        shutil.rmtree(tmp, ignore_errors=True)
        prev = latest_checkpoint(ckpt_dir)
        raise CheckpointError(f"writing {name} in {ckpt_dir} failed ({e}; {_gib(shutil.disk_usage(ckpt_dir).free)} "
                              f"free now); the partial folder was removed and the run resumes from "
                              f"{os.path.basename(prev) if prev else 'scratch'} once the cause is fixed") from e
    shutil.rmtree(final, ignore_errors=True)
    os.replace(tmp, final)
    _atomic_write_text(os.path.join(ckpt_dir, LATEST), name)
    kept = sorted((d for d in os.listdir(ckpt_dir) if d.startswith("global_step") and not d.endswith(".tmp")),
                  key=lambda d: int(d[len("global_step"):]))
    for old in kept[:-max_num] if max_num > 0 else []:
        shutil.rmtree(os.path.join(ckpt_dir, old), ignore_errors=True)
    return final


def _write_checkpoint_files(tmp: str, step: int, actor, tokenizer, optimizers: dict, trainer_state: dict, rng: dict,
                            critic) -> None:
    os.makedirs(tmp)
    actor.save_pretrained(os.path.join(tmp, "actor"), safe_serialization=True)
    tokenizer.save_pretrained(os.path.join(tmp, "actor"))
    if critic is not None:
        torch.save(critic.state_dict(), os.path.join(tmp, "critic.pt"))
    torch.save({k: o.state_dict() for k, o in optimizers.items()}, os.path.join(tmp, "optimizer.pt"))
    torch.save(rng, os.path.join(tmp, "rng.pt"))
    with open(os.path.join(tmp, "trainer_state.json"), "w") as fh:
        json.dump(dict(trainer_state, step=step), fh, indent=1, sort_keys=True)


def latest_checkpoint(ckpt_dir: str) -> Optional[str]:
    """Folder of the newest complete checkpoint, or None when there is none.

    Raises:
        CheckpointError: ``latest`` names a folder that does not exist.
    """
    marker = os.path.join(ckpt_dir, LATEST)
    if not os.path.isfile(marker):
        return None
    name = open(marker).read().strip()
    path = os.path.join(ckpt_dir, name)
    if not os.path.isfile(os.path.join(path, "trainer_state.json")):
        raise CheckpointError(f"{marker} points at {path}, which is not a complete checkpoint")
    return path


def load_trainer_files(path: str) -> dict:
    """Read ``trainer_state.json``, ``optimizer.pt``, ``rng.pt`` and (if present) ``critic.pt`` of a checkpoint.

    Returns:
        {"state": dict, "optimizers": dict, "rng": dict, "critic": state_dict | None}
    Raises:
        CheckpointError: a required file is missing.
    """
    out = {}
    for key, fname in (("optimizers", "optimizer.pt"), ("rng", "rng.pt")):
        f = os.path.join(path, fname)
        if not os.path.isfile(f):
            raise CheckpointError(f"checkpoint file missing: {f}")
        out[key] = torch.load(f, map_location="cpu", weights_only=False)  # our own files (numpy RNG state)
    with open(os.path.join(path, "trainer_state.json")) as fh:
        out["state"] = json.load(fh)
    critic = os.path.join(path, "critic.pt")
    out["critic"] = torch.load(critic, map_location="cpu") if os.path.isfile(critic) else None
    return out
