"""Pacing of provider calls: at most ``rate`` calls per second, and none while a provider's Retry-After runs."""

from __future__ import annotations

import asyncio
import time
from typing import Awaitable, Callable, Optional


class Paused(Exception):
    """The provider asked for a pause longer than the caller may wait; ``retry_after``: seconds still to go."""

    def __init__(self, retry_after: float):
        super().__init__(f"provider paused for another {retry_after:.1f}s (its Retry-After)")
        self.retry_after = retry_after


class RateLimiter:
    """Pacing for the calls of one event loop: calls are spaced ``1 / rate`` seconds apart (no bursts), and
    :meth:`pause` holds every caller until a 429's Retry-After has passed, callers already sleeping towards their
    slot included (each checks the pause again when it wakes).

    Args:
        rate: calls per second; None or 0 = no pacing (pauses still apply).
        clock, sleep: injectable for tests (``time.monotonic`` / ``asyncio.sleep``).
    """

    def __init__(self, rate: Optional[float], clock: Callable[[], float] = time.monotonic,
                 sleep: Callable[[float], Awaitable[None]] = asyncio.sleep):
        if rate is not None and rate < 0:
            raise ValueError(f"rate must be >= 0 calls per second, got {rate}")
        self.interval = 1.0 / rate if rate else 0.0
        self._clock, self._sleep = clock, sleep
        self._next = 0.0          # earliest start of the next call
        self._paused_until = 0.0  # Retry-After
        self.waited_s = 0.0       # total time callers were held, seconds
        self.waits = 0            # calls that were held

    def paused_for(self) -> float:
        """Seconds of the current pause still to run (0 when none)."""
        return max(0.0, self._paused_until - self._clock())

    async def acquire(self, max_wait: Optional[float] = None) -> float:
        """Wait until this call may go; returns the seconds waited.

        Raises:
            Paused: a pause has more than ``max_wait`` seconds left (the caller answers "retry later" at once
                instead of holding its request).
        """
        waited, held = 0.0, False
        while True:
            now = self._clock()
            left = self._paused_until - now
            if max_wait is not None and left > max_wait:
                raise Paused(left)
            start = max(now, self._next, self._paused_until)
            self._next = start + self.interval
            wait = start - now
            if wait <= 0:
                return waited
            if not held:
                held = True
                self.waits += 1
            await self._sleep(wait)
            waited += wait
            self.waited_s += wait
            if self._clock() >= self._paused_until:  # no pause began while this call slept
                return waited

    def pause(self, seconds: float) -> None:
        """No call starts in the next ``seconds`` (a provider's Retry-After)."""
        self._paused_until = max(self._paused_until, self._clock() + max(0.0, seconds))
