"""Helpers of the real-path tests (tests/test_cpu_cluster_smoke.py, tests/test_cpu_cluster_e2e.py): the tiny assets,
a BM25 retriever.server over their corpus, one ``cli.train --cpu_cluster`` run in its own session with the recording
probe (cpu_demo/probe.py), and readers of what the probe wrote."""

import contextlib
import os
import threading
from dataclasses import dataclass, field
from typing import Dict, List, Optional, Tuple

import torch

from cpu_demo.probe import read_executor_records, read_jsonl
from cpu_demo.tiny_assets import build_assets, cluster_argv, run_train

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
# Reused between sessions on a developer machine; CI's fresh clone builds it (about a minute on 2 cores).
ASSET_CACHE = os.environ.get("CPU_CLUSTER_CACHE") or os.path.join(REPO, ".cache", "cpu_cluster")


def assets(protocol: str = "searchr1", chat: Optional[bool] = None) -> Dict[str, str]:
    return build_assets(ASSET_CACHE, protocol, chat)


@contextlib.contextmanager
def retriever(corpus: str, workdir: str):
    """A real ``retriever.server`` (BM25) over ``corpus``; yields (url, index_dir, process)."""
    from retriever.launch import ensure_index, start_server_process, stop_server_process

    index_dir = ensure_index(corpus, workdir, encoder="bm25")
    proc, url = start_server_process(index_dir, timeout_s=300)
    try:
        yield url, index_dir, proc
    finally:
        stop_server_process(proc)


@dataclass
class Run:
    """One finished CPU-cluster run and what its probe recorded."""

    rc: int
    log_path: str
    probe: str
    out_dir: str
    wall_s: float
    argv: List[str] = field(default_factory=list)
    shm_before: Dict[str, float] = field(default_factory=dict)

    @property
    def log(self) -> str:
        with open(self.log_path, encoding="utf-8", errors="replace") as f:
            return f.read()

    def steps(self) -> List[dict]:
        return read_jsonl(os.path.join(self.probe, "steps.jsonl"))

    def syncs(self) -> List[dict]:
        return read_jsonl(os.path.join(self.probe, "sync.jsonl"))

    def actor_status(self) -> List[dict]:
        return read_jsonl(os.path.join(self.probe, "actor_status.jsonl"))

    def executor(self) -> List[dict]:
        return read_executor_records(self.probe)

    def experiences(self, n: int) -> dict:
        return torch.load(os.path.join(self.probe, f"experience_{n}.pt"), weights_only=False)

    def policy_batches(self, n: int) -> List[dict]:
        return torch.load(os.path.join(self.probe, f"policy_{n}.pt"), weights_only=False)

    def n_experience(self) -> int:
        return len([f for f in os.listdir(self.probe) if f.startswith("experience_")])

    def left_behind(self) -> List[str]:
        """What the run left on the machine: its private Ray folder if it still exists, and ``/dev/shm/psm_*``
        segments created during the run that no live process maps (vLLM's ring buffers of dead engines)."""
        import re

        from openrlhf_search.cpu.cluster_mode.private_ray import SHM_DIR, new_unmapped_segments

        out = []
        m = re.search(r"\[cpu_cluster\] private Ray folder (\S+)", self.log)
        if m is None:
            out.append("(no private Ray folder named in the log)")
        elif os.path.exists(m.group(1)):
            out.append(m.group(1))
        out += [os.path.join(SHM_DIR, n) for n in new_unmapped_segments(self.shm_before)]
        return out

    def describe(self) -> str:
        return f"rc={self.rc} after {self.wall_s:.0f} s; log {self.log_path}:\n{self.log[-4000:]}"


def run(tmp_dir: str, paths: Dict[str, str], url: str, timeout_s: float = 1500, **kwargs) -> Run:
    """``cli.train --cpu_cluster`` with :func:`cluster_argv` flags (``kwargs`` go to it) and the probe on."""
    import time

    os.makedirs(tmp_dir, exist_ok=True)
    out_dir, probe = os.path.join(tmp_dir, "run"), os.path.join(tmp_dir, "probe")
    from openrlhf_search.cpu.cluster_mode.private_ray import _shm_segments

    argv = cluster_argv(paths, url, out_dir, **kwargs)
    shm_before = _shm_segments()
    start = time.time()
    rc = run_train(argv, os.path.join(tmp_dir, "log.txt"), timeout_s, probe_dir=probe)
    return Run(rc, os.path.join(tmp_dir, "log.txt"), probe, out_dir, time.time() - start, argv, shm_before)


class Background:
    """:func:`run` in a thread, so that a test can act on the retriever while the run goes on."""

    def __init__(self, *args, **kwargs):
        self.result: Optional[Run] = None
        self.error: Optional[BaseException] = None
        self.thread = threading.Thread(target=self._go, args=args, kwargs=kwargs, daemon=True)
        self.thread.start()

    def _go(self, *args, **kwargs):
        try:
            self.result = run(*args, **kwargs)
        except BaseException as e:  # re-raised by join()
            self.error = e

    def join(self, timeout: float) -> Run:
        self.thread.join(timeout)
        if self.error is not None:
            raise self.error
        assert self.result is not None, "the run did not end"
        return self.result


# ------------------------------------------------------------------ acting at a step boundary
def hold_after_step(probe_dir: str, step: int) -> None:
    """Ask the run recording into ``probe_dir`` to wait at the end of ``step`` (probe.hold_at_step_end); call before
    the run starts."""
    from cpu_demo.probe import HOLD_FILE

    os.makedirs(probe_dir, exist_ok=True)
    with open(os.path.join(probe_dir, HOLD_FILE), "w", encoding="utf-8") as f:
        f.write(str(step))


def wait_until_held(probe_dir: str, step: int, running) -> bool:
    """Poll until the trainer waits at the end of ``step`` (True), or ``running()`` turns false first (False)."""
    import time

    held = os.path.join(probe_dir, f"held_{step}")
    while running():
        if os.path.exists(held):
            return True
        time.sleep(0.2)
    return os.path.exists(held)


def release_step(probe_dir: str, step: int) -> None:
    """Let the trainer held at the end of ``step`` go on."""
    open(os.path.join(probe_dir, f"release_{step}"), "w").close()


# ------------------------------------------------------------------ reading trajectories
def real_positions(attention_mask: torch.Tensor) -> torch.Tensor:
    """Indices t (into [T-1] per-token arrays) of the predictions of real tokens 1..L-1 (any padding side)."""
    idx = attention_mask.bool().nonzero().flatten()
    return idx[1:] - 1


def tokens_of(sequence: torch.Tensor, attention_mask: torch.Tensor) -> Tuple[int, ...]:
    return tuple(sequence[attention_mask.bool()].tolist())


def environment_spans(ids: List[int], tokenizer, protocol) -> List[Tuple[int, int]]:
    """[start, end) token spans of every documents block in ``ids``: the executor tokenises ``doc_open``, the
    passages and ``doc_close`` on their own, so each block starts and ends with those exact id sequences."""
    open_ids = tokenizer(protocol.doc_open, add_special_tokens=False)["input_ids"]
    close_ids = tokenizer(protocol.doc_close, add_special_tokens=False)["input_ids"]
    spans, i = [], 0
    while i <= len(ids) - len(open_ids):
        if ids[i:i + len(open_ids)] == open_ids:
            j = i + len(open_ids)
            while j <= len(ids) - len(close_ids) and ids[j:j + len(close_ids)] != close_ids:
                j += 1
            spans.append((i, min(j + len(close_ids), len(ids))))
            i = j + len(close_ids)
        else:
            i += 1
    return spans


def flat_samples(record: dict) -> List[dict]:
    """Per-sample dicts (real positions only) of one experience dump, in the batch's prompt order (``index``)."""
    out = []
    for exp in record["experiences"]:
        for r in range(len(exp["sequences"])):
            pos = real_positions(exp["attention_mask"][r])
            s = {"tokens": tokens_of(exp["sequences"][r], exp["attention_mask"][r]),
                 "index": exp["index"][r], "reward": float(exp["rewards"][r]),
                 "failed": float(exp["info"].get("retrieval_failed", torch.zeros(len(exp["sequences"])))[r]) > 0.5}
            for key in ("action_mask", "action_log_probs", "base_action_log_probs", "values", "returns",
                        "advantages", "kl"):
                v = exp.get(key)
                s[key] = None if v is None else v[r][pos]
            s["info"] = {k: float(v.reshape(-1)[r]) for k, v in exp["info"].items()
                         if torch.is_tensor(v) and v.numel() == len(exp["sequences"])}
            out.append(s)
    return sorted(out, key=lambda s: s["index"])
