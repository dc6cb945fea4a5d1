"""The CPU cluster mode's private local Ray: its own temp folder, and at the end every process it started and every
shared-memory segment its vLLM engines left behind removed (``psutil`` walks the process tree and the memory maps);
the last worker traceback of a failed run read back from Ray's logs."""

import os
import re
import sys
import tempfile
from typing import Dict, List, Optional, Tuple

import psutil

SHM_DIR = "/dev/shm"
SHM_PREFIX = "psm_"  # multiprocessing.shared_memory segments: vLLM's MessageQueue ring buffers (~160 MiB each)
_TRACEBACK = "Traceback (most recent call last):"
_FRAME = re.compile(r'^\s*File "([^"]+)", line (\d+), in (\S+)')
_EXC_LINE = re.compile(r"^[A-Za-z_][\w.]*(Error|Exception|Exit|Interrupt|Refused|Limit|Failure)\b.*")


def _mapped_shm_segments(exclude: Tuple[int, ...] = ()) -> set:
    """Names of /dev/shm segments some live process maps (``psutil``'s memory maps), ``exclude``d pids aside."""
    out = set()
    for proc in psutil.process_iter():
        if proc.pid in exclude:
            continue
        try:
            maps = proc.memory_maps(grouped=False)
        except (psutil.Error, OSError):  # gone, another user's, or a zombie
            continue
        out.update(os.path.basename(m.path) for m in maps if m.path.startswith(SHM_DIR + "/"))
    return out


def _shm_segments() -> Dict[str, float]:
    try:
        names = [n for n in os.listdir(SHM_DIR) if n.startswith(SHM_PREFIX)]
    except OSError:
        return {}
    out = {}
    for n in names:
        try:
            out[n] = os.stat(os.path.join(SHM_DIR, n)).st_mtime
        except OSError:
            continue
    return out


def _descendants(root: int) -> List[int]:
    """Every live descendant process of ``root`` (``psutil``, recursively), [] when ``root`` is gone."""
    try:
        return [p.pid for p in psutil.Process(root).children(recursive=True)]
    except psutil.NoSuchProcess:
        return []


def _alive(pid: int) -> bool:
    try:
        return psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False


def new_unmapped_segments(before, exclude: Tuple[int, ...] = ()) -> List[str]:
    """``psm_*`` segments not in ``before`` (a :func:`_shm_segments` snapshot) that no live process, ``exclude``
    aside, maps: what a run that started after the snapshot left behind."""
    mapped = _mapped_shm_segments(exclude)
    return sorted(n for n in _shm_segments() if n not in before and n not in mapped)


def last_worker_traceback(log_dir: str) -> Optional[Dict[str, str]]:
    """The newest Python traceback in the Ray worker logs under ``log_dir`` (``session_*/logs/worker-*.err|out``).

    Returns {"exception": last line of the traceback, "where": "file:line in func" of its innermost frame, "log":
    the file}, or None when no worker log holds a traceback."""
    import glob

    files = glob.glob(os.path.join(log_dir, "session_*", "logs", "worker-*.err"))
    files += glob.glob(os.path.join(log_dir, "session_*", "logs", "worker-*.out"))
    best = None
    for path in files:
        try:
            with open(path, encoding="utf-8", errors="replace") as f:
                lines = f.read().splitlines()
        except OSError:
            continue
        starts = [i for i, ln in enumerate(lines) if _TRACEBACK in ln]
        if not starts:
            continue
        block = lines[starts[-1] + 1:]
        where, exc = "", ""
        for ln in block:
            m = _FRAME.match(ln)
            if m:
                where = f"{m.group(1)}:{m.group(2)} in {m.group(3)}"
                continue
            text = ln.strip()
            if where and _EXC_LINE.match(text):
                exc = text
                break
        if not exc:
            continue
        mtime = os.path.getmtime(path)
        if best is None or mtime > best[0]:
            best = (mtime, {"exception": exc[:500], "where": where, "log": path})
    return best[1] if best else None


class PrivateRay:
    """The private local Ray of one CPU-cluster run and what it leaves on the machine.

    Owns a temp folder (``ray_cpu_cluster_*``) and, at :meth:`cleanup`, removes it and the ``/dev/shm/psm_*``
    segments created since the run started that no live process maps any more (vLLM-CPU's shared-memory ring
    buffers of killed engine processes stay otherwise, ~160 MiB of RAM each until reboot). :meth:`failure` reads the
    worker logs first, so a failed run's console ends with the worker's own exception."""

    def __init__(self, temp_root: Optional[str] = None):
        self.temp_dir = tempfile.mkdtemp(prefix="ray_cpu_cluster_", dir=temp_root)
        self._shm_before = _shm_segments()
        self._cleaned = False

    def failure(self, keep_log_in: Optional[str] = None) -> Optional[str]:
        """One line naming the failed worker's exception and where it was raised (None if no worker log holds a
        traceback). ``keep_log_in``: a folder the worker's log is copied to, since the Ray folder is removed."""
        found = last_worker_traceback(self.temp_dir)
        if found is None:
            return None
        log = found["log"]
        if keep_log_in:
            import shutil

            try:
                os.makedirs(keep_log_in, exist_ok=True)
                kept = os.path.join(keep_log_in, "ray_worker_failure.log")
                shutil.copyfile(found["log"], kept)
                log = kept
            except OSError:
                log = found["log"] + " (removed at exit)"
        return f"a Ray worker failed: {found['exception']} (raised at {found['where']}; worker log: {log})"

    def leaked_shm_segments(self, exclude: Tuple[int, ...] = ()) -> List[str]:
        """``psm_*`` segments created during this run that no live process (``exclude`` aside) maps."""
        return new_unmapped_segments(self._shm_before, exclude)

    def terminate(self, exit_code: int = 143) -> None:
        """Stop this run now, from a signal handler: SIGKILL every descendant process of this driver (the local Ray's
        GCS, raylet, workers and their vLLM engine processes), remove what they leave (:meth:`cleanup`), exit.

        Used for SIGTERM because the driver is usually blocked inside ``ray.get``, where an exception raised by a
        Python handler does not reliably unwind to the ``finally`` that would shut Ray down."""
        import signal
        import time

        pids = _descendants(os.getpid())
        for pid in pids:
            try:
                os.kill(pid, signal.SIGKILL)
            except OSError:
                pass
        deadline = time.time() + 10
        while time.time() < deadline and any(_alive(p) for p in pids):
            time.sleep(0.2)
        self.cleanup(wait_s=5, exclude=(os.getpid(),))
        print(f"[cpu_cluster] stopped by signal: {len(pids)} Ray / vLLM processes ended, {self.temp_dir} and this "
              "run's shared memory removed", file=sys.stderr, flush=True)
        os._exit(exit_code)

    def cleanup(self, wait_s: float = 10.0, exclude: Tuple[int, ...] = ()) -> List[str]:
        """Remove the temp folder and this run's unmapped shm segments (idempotent); returns what was removed.

        Waits up to ``wait_s`` for the engine processes Ray is stopping to unmap their segments; ``exclude``: pids
        whose mappings do not count (the exiting driver's own)."""
        import shutil
        import time

        if self._cleaned:
            return []
        deadline = time.time() + wait_s
        while time.time() < deadline:
            new = {n for n in _shm_segments() if n not in self._shm_before}
            if not new & _mapped_shm_segments(exclude):
                break
            time.sleep(0.5)
        removed = []
        for name in self.leaked_shm_segments(exclude):
            try:
                os.unlink(os.path.join(SHM_DIR, name))
                removed.append(os.path.join(SHM_DIR, name))
            except OSError:
                pass
        shutil.rmtree(self.temp_dir, ignore_errors=True)
        removed.append(self.temp_dir)
        self._cleaned = True
        return removed
