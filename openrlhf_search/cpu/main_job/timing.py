"""Phase timers for the rollout: how long the engine and the retriever were busy (union of in-flight calls).

Rollouts of a batch run concurrently (one asyncio task per sample), so generation of one sample overlaps the
retrieval of another. A :class:`BusyTimer` counts the wall time during which at least one call of its phase was in
flight; the generation and retrieval figures may therefore add up to more than the rollout's wall time.
"""

import time
from typing import Optional


class BusyTimer:
    """Wall seconds with at least one active call (re-entrant across concurrent tasks)."""

    def __init__(self):
        self.active = 0
        self.busy_s = 0.0
        self.calls = 0
        self._since: Optional[float] = None

    def __enter__(self):
        if self.active == 0:
            self._since = time.perf_counter()
        self.active += 1
        self.calls += 1
        return self

    def __exit__(self, *exc):
        self.active -= 1
        if self.active == 0 and self._since is not None:
            self.busy_s += time.perf_counter() - self._since
            self._since = None
        return False

    def reset(self) -> float:
        """Return the busy seconds so far and start again from 0."""
        busy, self.busy_s, self.calls = self.busy_s, 0.0, 0
        return busy


class TimedEngine:
    """Wraps an engine with vLLM's ``generate`` contract; times it and forwards everything else."""

    def __init__(self, engine, timer: BusyTimer):
        self._engine = engine
        self.timer = timer

    async def generate(self, prompt_token_ids, sampling_params, multi_modal_data=None):
        with self.timer:
            return await self._engine.generate(prompt_token_ids, sampling_params, multi_modal_data=multi_modal_data)

    def __getattr__(self, name):
        return getattr(self._engine, name)


class TimedRetrievalClient:
    """Wraps a ``RetrievalClient``; times ``search`` / ``search_batch`` and forwards everything else."""

    def __init__(self, client, timer: BusyTimer):
        self._client = client
        self.timer = timer

    async def search(self, *args, **kwargs):
        with self.timer:
            return await self._client.search(*args, **kwargs)

    async def search_batch(self, *args, **kwargs):
        with self.timer:
            return await self._client.search_batch(*args, **kwargs)

    def __getattr__(self, name):
        return getattr(self._client, name)
