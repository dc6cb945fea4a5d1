"""Pacing of provider calls: at most ``rate`` calls per second, and none while a provider's Retry-After runs."""

from __future__ import annotations

import threading
import time
from typing import Callable, Optional


class RateLimiter:
    """Thread-safe pacing: calls are spaced ``1 / rate`` seconds apart (no bursts), and :meth:`pause` holds every
    caller until a 429's Retry-After has passed.

    Args:
        rate: calls per second; None or 0 = no pacing (pauses still apply).
        clock, sleep: injectable for tests (``time.monotonic`` / ``time.sleep``).
    """

    def __init__(self, rate: Optional[float], clock: Callable[[], float] = time.monotonic,
                 sleep: Callable[[float], None] = time.sleep):
        if rate is not None and rate < 0:
            raise ValueError(f"rate must be >= 0 calls per second, got {rate}")
        self.interval = 1.0 / rate if rate else 0.0
        self._clock, self._sleep = clock, sleep
        self._lock = threading.Lock()
        self._next = 0.0          # earliest start of the next call
        self._paused_until = 0.0  # Retry-After
        self.waited_s = 0.0       # total time callers were held, seconds
        self.waits = 0            # calls that were held

    def acquire(self) -> float:
        """Block until this call may go; returns the seconds waited."""
        with self._lock:
            now = self._clock()
            start = max(now, self._next, self._paused_until)
            self._next = start + self.interval
            wait = start - now
            if wait > 0:
                self.waited_s += wait
                self.waits += 1
        if wait > 0:
            self._sleep(wait)
        return wait

    def pause(self, seconds: float) -> None:
        """No call starts in the next ``seconds`` (a provider's Retry-After)."""
        with self._lock:
            self._paused_until = max(self._paused_until, self._clock() + max(0.0, seconds))
