"""What web search costs, kept down: a persistent query cache and a per-run budget.

:class:`QueryCache` (SQLite) stores the passages of every answered query under (provider, endpoint, query as sent
lower-cased with its spaces collapsed, variant), with the top-k it was asked for: the same query is never sent twice
to the same provider (a smaller top-k is served from a larger answer), across restarts and across servers that share
the file (WAL mode). Empty answers are stored too (they were paid for). ``max_entries`` caps its size.

:class:`RunBudget` caps one run's paid provider calls (``max_queries``) and money (``max_usd``, from the credits the
provider reports times ``usd_per_1k`` per 1,000 credits). Only a call the provider answered counts (failed attempts
and retries are counted apart by the backend, and cost nothing); cache hits are free. With a run name the spend is
kept in the cache file, so a restarted server goes on counting the same run.
"""

from __future__ import annotations

import json
import os
import sqlite3
import threading
import time
from typing import Optional

_SCHEMA = """
CREATE TABLE IF NOT EXISTS answers (
    provider TEXT NOT NULL, endpoint TEXT NOT NULL, query TEXT NOT NULL, variant TEXT NOT NULL,
    topk INTEGER NOT NULL, created REAL NOT NULL, passages TEXT NOT NULL,
    PRIMARY KEY (provider, endpoint, query, variant));
CREATE INDEX IF NOT EXISTS answers_created ON answers (created);
CREATE TABLE IF NOT EXISTS spend (
    run TEXT PRIMARY KEY, calls INTEGER NOT NULL, credits REAL NOT NULL, updated REAL NOT NULL);
"""


def cache_key(query: str) -> str:
    """The cache's form of a query: lower case, runs of whitespace one space, no leading or trailing space (search
    engines answer these forms alike)."""
    return " ".join(query.lower().split())


class QueryCache:
    """Passages per (provider, endpoint, normalised query, variant) in one SQLite file; thread-safe.

    An entry remembers the top-k it was asked with; a later request for fewer passages is served from it (its
    first k: web results are ranked), a request for more is a miss and its answer replaces the entry.

    Args:
        path: the SQLite file (created with its folder); ``":memory:"`` for a cache that dies with the process.
        max_age_s: entries older than this many seconds are misses (None: kept forever; time-sensitive questions
            may want fresh results).
        max_entries: most entries kept; past it the oldest are dropped (None: no cap).

    Attributes:
        lookups, hits, evicted: counters since this object was made (``hit_rate`` = hits / lookups).
    """

    def __init__(self, path: str, max_age_s: Optional[float] = None, max_entries: Optional[int] = None):
        self.path = path
        if path != ":memory:":
            os.makedirs(os.path.dirname(os.path.abspath(path)) or ".", exist_ok=True)
        if max_entries is not None and max_entries < 1:
            raise ValueError(f"max_entries must be >= 1, got {max_entries}")
        self.max_age_s, self.max_entries = max_age_s, max_entries
        self._lock = threading.Lock()
        self._db = sqlite3.connect(path, check_same_thread=False, timeout=30)
        if path != ":memory:":
            self._db.execute("PRAGMA journal_mode=WAL")
        self._db.executescript(_SCHEMA)
        self._db.commit()
        self.lookups = 0
        self.hits = 0
        self.evicted = 0

    @property
    def hit_rate(self) -> float:
        return self.hits / self.lookups if self.lookups else 0.0

    def __len__(self) -> int:
        with self._lock:
            return self._db.execute("SELECT COUNT(*) FROM answers").fetchone()[0]

    def get(self, provider: str, endpoint: str, query: str, topk: int, variant: str) -> Optional[list]:
        """The first ``topk`` stored passages (list of dicts), or None on a miss (none stored, too old, or stored
        for a smaller top-k that came back full)."""
        with self._lock:
            self.lookups += 1
            row = self._db.execute("SELECT passages, created, topk FROM answers WHERE provider=? AND endpoint=? AND "
                                   "query=? AND variant=?", (provider, endpoint, cache_key(query), variant)).fetchone()
            if row is None or (self.max_age_s is not None and time.time() - row[1] > self.max_age_s):
                return None
            passages = json.loads(row[0])
            if row[2] < topk and len(passages) >= row[2]:  # asked for fewer and got them all: more may exist
                return None
            self.hits += 1
        return passages[:topk]

    def put(self, provider: str, endpoint: str, query: str, topk: int, variant: str, passages: list) -> None:
        """Store an answer (a smaller top-k never replaces a larger one); drops the oldest entries past
        ``max_entries``."""
        with self._lock:
            self._db.execute(
                "INSERT INTO answers VALUES (?, ?, ?, ?, ?, ?, ?) ON CONFLICT (provider, endpoint, query, variant) "
                "DO UPDATE SET topk=excluded.topk, created=excluded.created, passages=excluded.passages "
                "WHERE excluded.topk >= answers.topk",
                (provider, endpoint, cache_key(query), variant, int(topk), time.time(), json.dumps(passages)))
            if self.max_entries is not None:
                over = self._db.execute("SELECT COUNT(*) FROM answers").fetchone()[0] - self.max_entries
                if over > 0:
                    self._db.execute("DELETE FROM answers WHERE rowid IN (SELECT rowid FROM answers ORDER BY created "
                                     "LIMIT ?)", (over,))
                    self.evicted += over
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
    """Per-run caps on paid provider calls and money, for callers on one event loop or several threads.

    Only an answered call is paid for and counted (``calls``, ``credits``); a 429, a 5xx or a timeout costs nothing
    here. Concurrent calls cannot overshoot a cap: each :meth:`reserve` holds the credits the call is expected to
    cost until :meth:`settle` replaces them with what it did cost.

    Args:
        max_queries: most answered provider calls in the run (None: no cap).
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
        self._held_calls = 0
        self._held_credits = 0.0
        self._lock = threading.Lock()

    @property
    def usd(self) -> Optional[float]:
        """Money spent so far, US dollars (None without a price)."""
        return None if not self.usd_per_1k else self.credits * self.usd_per_1k / 1000.0

    def _over(self, credits: float = 0.0, calls: int = 0) -> Optional[str]:
        if self.max_queries is not None and self.calls + self._held_calls + calls > self.max_queries:
            held = f" ({self._held_calls} in flight)" if self._held_calls else ""
            return f"{self.calls} provider calls{held} of --web_max_queries {self.max_queries}"
        if self.max_usd is not None:
            projected = (self.credits + self._held_credits + credits) * self.usd_per_1k / 1000.0
            if projected > self.max_usd + 1e-12:
                return f"US${self.usd:.4f} spent of --web_max_usd {self.max_usd:g} (the next call would pass it)"
        return None

    def reserve(self, credits: float = 1.0) -> float:
        """Hold one call expected to cost ``credits``; returns the credits held (give them to :meth:`settle`).
        Raises BudgetExhausted when the call could pass a cap (nothing held)."""
        credits = max(0.0, float(credits))
        with self._lock:
            over = self._over(credits, 1)
            if over:
                raise BudgetExhausted(f"web search budget reached: {over}")
            self._held_calls += 1
            self._held_credits += credits
        return credits

    def settle(self, held: float = 1.0, charged: Optional[float] = None) -> None:
        """The call reserved with ``held`` credits is over: ``charged`` credits when the provider answered (it is
        then counted as a paid call), None when it did not (nothing spent)."""
        with self._lock:
            self._held_calls = max(0, self._held_calls - 1)
            self._held_credits = max(0.0, self._held_credits - held)
            if charged is None:
                return
            self.calls += 1
            self.credits += max(0.0, float(charged))
            calls, spent = self.calls, self.credits
        if self.store is not None:
            self.store.save_spend(self.run, calls, spent)

    @property
    def exhausted(self) -> bool:
        with self._lock:
            return self._over(0.0, 1) is not None

    def info(self) -> dict:
        """Spend and caps for ``GET /health``."""
        return {"calls": self.calls, "credits": self.credits, "usd": self.usd, "max_queries": self.max_queries,
                "max_usd": self.max_usd, "usd_per_1k": self.usd_per_1k, "run": self.run, "exhausted": self.exhausted}
