"""What web search costs, kept down: a persistent query cache and a per-run budget.

:class:`QueryCache` (SQLite) stores the passages of every answered query under (provider, query as sent, top-k,
variant): the same query to the same provider with the same top-k is never sent twice, across restarts and across
servers that share the file (WAL mode). Empty answers are stored too (they were paid for).

:class:`RunBudget` caps one run's provider calls (``max_queries``) and money (``max_usd``, from the credits the provider
reports times ``usd_per_1k`` per 1,000 credits). Every query sent to the provider counts once, answered or not
(a 429 retry of it does not count again); cache hits are free. With a run name the spend is kept in the cache file,
so a restarted server goes on counting the same run.
"""

from __future__ import annotations

import json
import os
import sqlite3
import threading
import time
from typing import Optional

_SCHEMA = """
CREATE TABLE IF NOT EXISTS results (
    provider TEXT NOT NULL, query TEXT NOT NULL, topk INTEGER NOT NULL, variant TEXT NOT NULL,
    created REAL NOT NULL, passages TEXT NOT NULL,
    PRIMARY KEY (provider, query, topk, variant));
CREATE TABLE IF NOT EXISTS spend (
    run TEXT PRIMARY KEY, calls INTEGER NOT NULL, credits REAL NOT NULL, updated REAL NOT NULL);
"""


class QueryCache:
    """Passages per (provider, query, topk, variant) in one SQLite file; thread-safe.

    Args:
        path: the SQLite file (created with its folder); ``":memory:"`` for a cache that dies with the process.
        max_age_s: entries older than this many seconds are misses (None: kept forever; time-sensitive questions
            may want fresh results).

    Attributes:
        lookups, hits: counters since this object was made (``hit_rate`` = hits / lookups).
    """

    def __init__(self, path: str, max_age_s: Optional[float] = None):
        self.path = path
        if path != ":memory:":
            os.makedirs(os.path.dirname(os.path.abspath(path)) or ".", exist_ok=True)
        self.max_age_s = max_age_s
        self._lock = threading.Lock()
        self._db = sqlite3.connect(path, check_same_thread=False, timeout=30)
        if path != ":memory:":
            self._db.execute("PRAGMA journal_mode=WAL")
        self._db.executescript(_SCHEMA)
        self._db.commit()
        self.lookups = 0
        self.hits = 0

    @property
    def hit_rate(self) -> float:
        return self.hits / self.lookups if self.lookups else 0.0

    def __len__(self) -> int:
        with self._lock:
            return self._db.execute("SELECT COUNT(*) FROM results").fetchone()[0]

    def get(self, provider: str, query: str, topk: int, variant: str) -> Optional[list]:
        """The stored passages (list of dicts), or None on a miss."""
        with self._lock:
            self.lookups += 1
            row = self._db.execute("SELECT passages, created FROM results WHERE provider=? AND query=? AND topk=? "
                                   "AND variant=?", (provider, query, int(topk), variant)).fetchone()
            if row is None or (self.max_age_s is not None and time.time() - row[1] > self.max_age_s):
                return None
            self.hits += 1
        return json.loads(row[0])

    def put(self, provider: str, query: str, topk: int, variant: str, passages: list) -> None:
        with self._lock:
            self._db.execute("INSERT OR REPLACE INTO results VALUES (?, ?, ?, ?, ?, ?)",
                             (provider, query, int(topk), variant, time.time(), json.dumps(passages)))
            self._db.commit()

    def load_spend(self, run: str) -> tuple:
        """(calls, credits) recorded for ``run``; (0, 0.0) for a new run."""
        with self._lock:
            row = self._db.execute("SELECT calls, credits FROM spend WHERE run=?", (run,)).fetchone()
        return (int(row[0]), float(row[1])) if row else (0, 0.0)

    def save_spend(self, run: str, calls: int, credits: float) -> None:
        with self._lock:
            self._db.execute("INSERT OR REPLACE INTO spend VALUES (?, ?, ?, ?)", (run, calls, credits, time.time()))
            self._db.commit()

    def close(self) -> None:
        with self._lock:
            self._db.close()


class BudgetExhausted(RuntimeError):
    """The run's web budget is spent; the message is one line naming the cap and the flags."""


class RunBudget:
    """Per-run caps on provider calls and money; thread-safe.

    Args:
        max_queries: most queries sent to the provider in the run (None: no cap).
        max_usd: most money, US dollars (None: no cap); needs ``usd_per_1k``.
        usd_per_1k: price of 1,000 provider credits (one search is one credit unless the provider reports more:
            Serper's ``credits`` field).
        store, run: keep the spend under ``run`` in this :class:`QueryCache` file (a restart resumes it).
    Raises:
        ValueError: ``max_usd`` without a price, or a negative cap.
    """

    def __init__(self, max_queries: Optional[int] = None, max_usd: Optional[float] = None,
                 usd_per_1k: Optional[float] = None, store: Optional[QueryCache] = None, run: Optional[str] = None):
        if max_usd is not None and not usd_per_1k:
            raise ValueError("a money cap needs the price: give --web_usd_per_1k (your plan's US$ per 1,000 searches)")
        for name, v in (("max_queries", max_queries), ("max_usd", max_usd), ("usd_per_1k", usd_per_1k)):
            if v is not None and v < 0:
                raise ValueError(f"{name} must be >= 0, got {v}")
        self.max_queries, self.max_usd, self.usd_per_1k = max_queries, max_usd, usd_per_1k
        self.store, self.run = (store, run) if store is not None and run else (None, None)
        self.calls, self.credits = self.store.load_spend(self.run) if self.store is not None else (0, 0.0)
        self._in_flight = 0
        self._lock = threading.Lock()

    @property
    def usd(self) -> Optional[float]:
        """Money spent so far, US dollars (None without a price)."""
        return None if not self.usd_per_1k else self.credits * self.usd_per_1k / 1000.0

    def _over(self) -> Optional[str]:
        if self.max_queries is not None and self.calls >= self.max_queries:
            return f"{self.calls} provider calls of --web_max_queries {self.max_queries}"
        if self.max_usd is not None:
            # a call in flight may still cost its credit: count one per call not yet answered
            projected = (self.credits + self._in_flight + 1) * self.usd_per_1k / 1000.0
            if projected > self.max_usd + 1e-12:
                return f"US${self.usd:.4f} spent of --web_max_usd {self.max_usd:g} (the next call would pass it)"
        return None

    def reserve(self) -> None:
        """Count one call about to be sent. Raises BudgetExhausted when a cap is reached (nothing counted)."""
        with self._lock:
            over = self._over()
            if over:
                raise BudgetExhausted(f"web search budget reached: {over}")
            self.calls += 1
            self._in_flight += 1

    def settle(self, credits: float) -> None:
        """The reserved call is over; it cost ``credits`` (0 when the provider charged nothing: an error)."""
        with self._lock:
            self._in_flight = max(0, self._in_flight - 1)
            self.credits += max(0.0, float(credits))
            calls, spent = self.calls, self.credits
        if self.store is not None:
            self.store.save_spend(self.run, calls, spent)

    @property
    def exhausted(self) -> bool:
        with self._lock:
            return self._over() is not None

    def info(self) -> dict:
        """Spend and caps for ``GET /health``."""
        return {"calls": self.calls, "credits": self.credits, "usd": self.usd, "max_queries": self.max_queries,
                "max_usd": self.max_usd, "usd_per_1k": self.usd_per_1k, "run": self.run, "exhausted": self.exhausted}
