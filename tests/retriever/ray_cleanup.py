"""Shut a test's local Ray down and wait until every process it started is gone (Ray's workers outlive
``ray.shutdown()`` by up to a minute while they notice their raylet died; a test must leave nothing behind)."""

import os
import time


def descendants(pid: int) -> list[int]:
    """Every live descendant of ``pid`` (from /proc)."""
    children: dict[int, list[int]] = {}
    for d in os.listdir("/proc"):
        if d.isdigit():
            try:
                with open(f"/proc/{d}/stat") as f:
                    ppid = int(f.read().rsplit(")", 1)[1].split()[1])
            except (OSError, ValueError, IndexError):
                continue
            children.setdefault(ppid, []).append(int(d))
    out, todo = [], [pid]
    while todo:
        for c in children.get(todo.pop(), []):
            out.append(c)
            todo.append(c)
    return out


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


def shutdown_ray_and_wait(timeout_s: float = 90.0) -> list[int]:
    """``serve.shutdown()`` (if Serve runs), ``ray.shutdown()``, then wait for the processes this test process
    started (raylet, gcs, workers) to exit; SIGKILL the ones still there after ``timeout_s``. Returns those killed."""
    import ray

    started = descendants(os.getpid())
    try:
        from ray import serve

        if ray.is_initialized():
            serve.shutdown()
    except Exception:  # Serve never started: nothing to stop
        pass
    ray.shutdown()
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline and any(_alive(p) for p in started):
        time.sleep(0.5)
    killed = [p for p in started if _alive(p)]
    for p in killed:
        try:
            os.kill(p, 9)
        except OSError:
            pass
    return killed
