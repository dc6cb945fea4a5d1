"""LLM-as-judge accuracy (R1-Searcher's ACC_L, arXiv 2503.05592 sec. 4.1) over any OpenAI-compatible endpoint.

Given the question, the judge says whether the prediction fully matches the meaning and key information of the gold
answer: True or False. Any OpenAI-compatible server works (OpenAI, ``vllm serve MODEL``). Two prompts
(``JUDGE_PROMPTS``): ``"r1searcher"``, R1-Searcher's released judge (``evaluation/metric_calc_gpt_as_judge.py``,
:data:`R1SEARCHER_JUDGE_TEMPLATE`; ``cli.eval``'s default), and ``"strict"``, this project's earlier prompt (a
system turn, one-word reply, temperature 0, 8 tokens).

Requests run concurrently (a semaphore caps them), are retried with exponential backoff on connection errors, 429 and
5xx, and every verdict is cached in an SQLite file keyed by (model, question, golds, prediction), so a rerun or a
crashed run costs nothing twice.
"""

import asyncio
import hashlib
import json
import logging
import os
import sqlite3
import threading
from dataclasses import dataclass
from typing import List, Optional, Sequence, Tuple

import httpx

from openrlhf_search.evaluation.predictions import parse_judge_label

logger = logging.getLogger(__name__)

JUDGE_PROMPT_VERSION = "v1"  # of the "strict" prompt; the cache key also holds the prompt name
JUDGE_SYSTEM = "You are a strict and fair grader of question answering."
#: R1-Searcher's judge prompt, evaluation/metric_calc_gpt_as_judge.py:64-69 (verbatim, trailing "\n    " included)
R1SEARCHER_JUDGE_TEMPLATE = (
    "Given a Question and its Golden Answer, verify whether the Predicted Answer is correct. The prediction is "
    "correct if it fully aligns with the meaning and key information of the Golden Answer. Respond with True if the "
    "prediction is correct and False otherwise.\n\n"
    "Question: {question}\n"
    "Golden Answer: {reference}\n"
    "Predicted Answer: {prediction}\n"
    "    "
)
JUDGE_TEMPLATE = (
    "Given a question, its golden answer(s) and a predicted answer, judge whether the predicted answer fully "
    "matches the meaning and the key information of a golden answer. Differences in wording, case or formatting do "
    "not matter; missing or contradicting key information does.\n\n"
    "Question: {question}\n"
    "Golden answer(s): {golds}\n"
    "Predicted answer: {prediction}\n\n"
    "Reply with exactly one word: True or False."
)


class JudgeError(RuntimeError):
    """The judge endpoint failed past the retry budget, or answered with a non-retryable error (4xx)."""


@dataclass
class JudgeVerdict:
    """One judge result.

    Attributes:
        correct: the verdict; None when the reply could not be read as True/False or the request failed.
        raw: the judge's reply text (or the error message).
        cached: True when served from the disk cache.
    """

    correct: Optional[bool]
    raw: str
    cached: bool = False


@dataclass(frozen=True)
class JudgePrompt:
    """How one judge prompt is sent.

    Attributes:
        name: key in ``JUDGE_PROMPTS``.
        temperature: sampling temperature sent, or None to send none (the server's default).
        max_tokens: reply budget sent.
        source: where it comes from (file:line).
    """

    name: str
    temperature: Optional[float]
    max_tokens: int
    source: str


JUDGE_PROMPTS = {
    "r1searcher": JudgePrompt("r1searcher", None, 1024,
                              "R1-Searcher evaluation/metric_calc_gpt_as_judge.py:31-38 (max_tokens 1024, no "
                              "temperature), :64-69 (prompt), :90 (one user message)"),
    "strict": JudgePrompt("strict", 0.0, 8, "this project"),
}


def _reference(golds: Sequence[str]) -> str:
    # R1-Searcher formats its single ``answer`` string; a list would be formatted as Python writes it (str(list))
    return golds[0] if len(golds) == 1 else str(list(golds))


def build_judge_messages(question: str, golds: Sequence[str], prediction: str, prompt: str = "strict") -> List[dict]:
    """Chat messages of the judge prompt.

    Args:
        question, golds, prediction: the item judged.
        prompt: "strict" (system + user, golds joined by " | ") or "r1searcher" (one user message, R1-Searcher's
            text: question and prediction as given, the gold answer as their ``str.format`` writes it).
    Raises:
        ValueError: unknown prompt name.
    """
    if prompt == "r1searcher":
        user = R1SEARCHER_JUDGE_TEMPLATE.format(question=question, reference=_reference(golds),
                                                prediction=prediction or "")
        return [{"role": "user", "content": user}]
    if prompt != "strict":
        raise ValueError(f"unknown judge prompt {prompt!r}; known: {sorted(JUDGE_PROMPTS)}")
    user = JUDGE_TEMPLATE.format(question=question.strip(), golds=" | ".join(g.strip() for g in golds),
                                 prediction=(prediction or "").strip())
    return [{"role": "system", "content": JUDGE_SYSTEM}, {"role": "user", "content": user}]


class JudgeCache:
    """SQLite cache of verdicts, safe across threads of one process (one connection under a lock)."""

    def __init__(self, path: str):
        os.makedirs(os.path.dirname(os.path.abspath(path)) or ".", exist_ok=True)
        self.path = path
        self._lock = threading.Lock()
        self._conn = sqlite3.connect(path, check_same_thread=False)
        # WAL + NORMAL: a committed verdict survives a crash of this process without an fsync per verdict
        self._conn.execute("PRAGMA journal_mode=WAL")
        self._conn.execute("PRAGMA synchronous=NORMAL")
        self._conn.execute("CREATE TABLE IF NOT EXISTS verdicts (key TEXT PRIMARY KEY, correct INTEGER, raw TEXT)")
        self._conn.commit()

    @staticmethod
    def key(model: str, question: str, golds: Sequence[str], prediction: str, prompt: str = "strict") -> str:
        version = [JUDGE_PROMPT_VERSION] if prompt == "strict" else [JUDGE_PROMPT_VERSION, prompt]
        payload = json.dumps(version + [model, question, list(golds), prediction], ensure_ascii=False)
        return hashlib.sha256(payload.encode("utf-8")).hexdigest()

    def get(self, key: str) -> Optional[Tuple[Optional[bool], str]]:
        with self._lock:
            row = self._conn.execute("SELECT correct, raw FROM verdicts WHERE key = ?", (key,)).fetchone()
        if row is None:
            return None
        return (None if row[0] is None else bool(row[0])), row[1]

    def put(self, key: str, correct: Optional[bool], raw: str) -> None:
        with self._lock:
            self._conn.execute("INSERT OR REPLACE INTO verdicts VALUES (?, ?, ?)",
                               (key, None if correct is None else int(correct), raw))
            self._conn.commit()

    def __len__(self) -> int:
        with self._lock:
            return self._conn.execute("SELECT COUNT(*) FROM verdicts").fetchone()[0]

    def close(self) -> None:
        with self._lock:
            self._conn.close()


class JudgeClient:
    """Async client of an OpenAI-compatible ``/v1/chat/completions`` endpoint that returns True/False verdicts.

    Args:
        url: base URL (``http://127.0.0.1:8001`` or ``.../v1``); ``/v1/chat/completions`` is appended as needed.
        model: model name sent in the request ("gpt-4o-mini" in R1-Searcher).
        api_key: bearer token; default ``$OPENAI_API_KEY`` (may be unset for local servers).
        concurrency: most requests in flight.
        max_retries: retries after the first failure (connection error, timeout, 429, 5xx).
        backoff_s: first retry delay in seconds, doubled each retry.
        timeout_s: per-request timeout in seconds.
        cache_path: SQLite file for verdicts; None disables caching.
        max_tokens: reply budget; None: the prompt's own (``JUDGE_PROMPTS``: 8 strict, 1024 r1searcher).
        prompt: "strict" or "r1searcher" (``JUDGE_PROMPTS``); sets the messages and the temperature sent.
    Attributes:
        stats: counts of ``requests`` (HTTP calls), ``retries``, ``cache_hits``, ``failures``, ``unparsed``.
    """

    def __init__(self, url: str, model: str = "gpt-4o-mini", api_key: Optional[str] = None, concurrency: int = 16,
                 max_retries: int = 4, backoff_s: float = 1.0, timeout_s: float = 60.0,
                 cache_path: Optional[str] = None, max_tokens: Optional[int] = None, prompt: str = "strict"):
        if not url.startswith(("http://", "https://")):
            raise ValueError(f"judge url must be http(s), got {url!r}")
        if prompt not in JUDGE_PROMPTS:
            raise ValueError(f"unknown judge prompt {prompt!r}; known: {sorted(JUDGE_PROMPTS)}")
        self.prompt = JUDGE_PROMPTS[prompt]
        if concurrency <= 0:
            raise ValueError(f"judge concurrency must be positive, got {concurrency}")
        base = url.rstrip("/")
        if base.endswith("/chat/completions"):
            self.endpoint = base
        elif base.endswith("/v1"):
            self.endpoint = base + "/chat/completions"
        else:
            self.endpoint = base + "/v1/chat/completions"
        self.model = model
        self.api_key = api_key if api_key is not None else os.environ.get("OPENAI_API_KEY")
        self.max_retries = max_retries
        self.backoff_s = backoff_s
        self.timeout_s = timeout_s
        self.max_tokens = max_tokens if max_tokens is not None else self.prompt.max_tokens
        self.cache = JudgeCache(cache_path) if cache_path else None
        self.concurrency = concurrency
        self._sem: Optional[asyncio.Semaphore] = None
        self._client: Optional[httpx.AsyncClient] = None
        self._loop = None
        self.stats = {"requests": 0, "retries": 0, "cache_hits": 0, "failures": 0, "unparsed": 0}

    def _bind_loop(self) -> None:
        # the semaphore and the HTTP client belong to one event loop; a new loop (a second asyncio.run) gets new ones
        loop = asyncio.get_running_loop()
        if loop is not self._loop:
            self._loop = loop
            self._sem = asyncio.Semaphore(self.concurrency)
            self._client = None

    def _http(self) -> httpx.AsyncClient:
        if self._client is None:
            headers = {"Authorization": f"Bearer {self.api_key}"} if self.api_key else {}
            self._client = httpx.AsyncClient(timeout=self.timeout_s, headers=headers)
        return self._client

    async def _complete(self, messages: List[dict]) -> str:
        body = {"model": self.model, "messages": messages, "max_tokens": self.max_tokens}
        if self.prompt.temperature is not None:
            body["temperature"] = self.prompt.temperature
        delay = self.backoff_s
        last_error = ""
        for attempt in range(self.max_retries + 1):
            if attempt:
                self.stats["retries"] += 1
                await asyncio.sleep(delay)
                delay *= 2
            try:
                self.stats["requests"] += 1
                resp = await self._http().post(self.endpoint, json=body)
            except (httpx.TransportError, httpx.TimeoutException) as e:
                last_error = f"{type(e).__name__}: {e}"
                continue
            if resp.status_code == 429 or resp.status_code >= 500:
                last_error = f"HTTP {resp.status_code}: {resp.text[:200]}"
                continue
            if resp.status_code >= 400:
                raise JudgeError(f"judge endpoint {self.endpoint} refused the request: HTTP {resp.status_code} "
                                 f"{resp.text[:300]}")
            try:
                return resp.json()["choices"][0]["message"]["content"] or ""
            except (ValueError, KeyError, IndexError, TypeError) as e:
                raise JudgeError(f"judge endpoint {self.endpoint} returned no chat completion: {resp.text[:300]}") \
                    from e
        raise JudgeError(f"judge endpoint {self.endpoint} failed after {self.max_retries + 1} attempts: {last_error}")

    async def judge(self, question: str, golds: Sequence[str], prediction: str) -> JudgeVerdict:
        """Verdict for one prediction. An empty prediction is judged False without a request.

        Raises:
            JudgeError: the endpoint failed past the retry budget or refused the request.
        """
        golds = [str(g) for g in golds]
        if not (prediction or "").strip():
            return JudgeVerdict(False, "(empty prediction)")
        key = JudgeCache.key(self.model, question, golds, prediction, self.prompt.name)
        if self.cache is not None:
            hit = self.cache.get(key)
            if hit is not None:
                self.stats["cache_hits"] += 1
                return JudgeVerdict(hit[0], hit[1], cached=True)
        self._bind_loop()
        async with self._sem:
            raw = await self._complete(build_judge_messages(question, golds, prediction, self.prompt.name))
        correct = parse_judge_label(raw)
        if correct is None:
            self.stats["unparsed"] += 1
            logger.warning("judge reply not readable as True/False: %r", raw[:100])
        if self.cache is not None:
            self.cache.put(key, correct, raw)
        return JudgeVerdict(correct, raw)

    async def judge_many(self, items: Sequence[Tuple[str, Sequence[str], str]]) -> List[JudgeVerdict]:
        """Verdicts for (question, golds, prediction) triples, concurrently, in input order.

        A triple whose request fails past the retry budget gets ``JudgeVerdict(None, error)`` and is counted in
        ``stats["failures"]``; the others are kept (a judge outage loses no finished work).
        """
        async def one(item):
            try:
                return await self.judge(*item)
            except JudgeError as e:
                self.stats["failures"] += 1
                logger.error("judge failed: %s", e)
                return JudgeVerdict(None, str(e))

        return list(await asyncio.gather(*(one(it) for it in items)))

    async def aclose(self) -> None:
        """Close the HTTP client (when still on its own event loop; a finished loop took its sockets) and the cache."""
        if self._client is not None:
            if asyncio.get_running_loop() is self._loop:
                await self._client.aclose()
            self._client = None
        if self.cache is not None:
            self.cache.close()
            self.cache = None
