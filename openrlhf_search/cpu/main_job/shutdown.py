"""Clean exit of the CPU job on a scheduler's SIGTERM: exit code 143, threads joined, no half-written checkpoint.

:func:`install` makes the first SIGTERM raise ``SystemExit(143)`` in the main thread, so the job unwinds through its
``finally`` blocks (the trainer joins the engine thread and closes the retrieval client, the CLI stops the retriever
child it started). Inside a :func:`critical` block (writing a checkpoint) the exit waits until the block ends. Later
signals are ignored: a second SIGTERM must not interrupt the cleanup the first one started (an interrupted join
leaves the engine thread inside a forward pass when the interpreter exits, and the C++ runtime then aborts with
"terminate called without an active exception", exit -6).
"""

import contextlib
import signal
import threading

_state = {"installed": False, "exiting": False, "pending": None, "depth": 0}


def _exit_code(signum: int) -> int:
    return 128 + int(signum)


def _handler(signum, frame):
    if _state["exiting"]:
        return  # the cleanup of the first signal is running: let it finish
    if _state["depth"] > 0:
        _state["pending"] = signum  # raised when the critical block ends
        return
    _state["exiting"] = True
    raise SystemExit(_exit_code(signum))


def install(signals=(signal.SIGTERM,)) -> None:
    """Install the handler for ``signals`` (main thread only; elsewhere a no-op, as Python allows handlers only
    there)."""
    if threading.current_thread() is not threading.main_thread():
        return
    for s in signals:
        signal.signal(s, _handler)
    _state.update(installed=True, exiting=False, pending=None, depth=0)


def terminated() -> bool:
    """True once a signal started the exit (the CLI then skips its normal end)."""
    return bool(_state["exiting"])


@contextlib.contextmanager
def critical():
    """Defer a signal's exit to the end of the block (nested blocks: the outermost end). A no-op without
    :func:`install`."""
    _state["depth"] += 1
    try:
        yield
    finally:
        _state["depth"] -= 1
        if _state["depth"] == 0 and _state["pending"] is not None and not _state["exiting"]:
            signum, _state["pending"] = _state["pending"], None
            _state["exiting"] = True
            raise SystemExit(_exit_code(signum))
