"""What a web search provider module supplies, and how one provider call's outcome is classified.

A provider module (``serper``, ``serpapi``) defines a :class:`Provider` subclass: how a query becomes an HTTP request
(its documented JSON API) and how the answer becomes :class:`WebResult` rows. :func:`call` sends the request and maps
every outcome to a result or one :class:`ProviderError` kind, which :mod:`retriever.web.backend` turns into the
retriever's HTTP answer (and so into the client's retry / failover / stop rules):

=====================================  =========================  ==========================================
provider outcome                        error                      retriever answer
=====================================  =========================  ==========================================
200                                     (results; may be empty)    passages
401, 403                                :class:`AuthError`         403 with ``stop_run``: the run stops
402, a 4xx (not 429) naming credits     :class:`QuotaError`        402 with ``stop_run``: the run stops
429                                     :class:`RateLimited`       waits Retry-After, then retries; 503 past the cap
other 4xx                               :class:`BadQuery`          no passages for that query
5xx, timeout, connection, bad JSON      :class:`Unavailable`       503: the client retries / fails over
=====================================  =========================  ==========================================

The status decides before the text: a 429 or a 5xx is temporary even when its message mentions a quota or credits
(a rate-limit text often does); only a provider's documented empty-account answer (SerpApi's 429 "Your account has
run out of searches.", sent without Retry-After) is read as one. Only a 200 is taken as charged.

The API key never appears in an error message: every text taken from a provider answer goes through
:func:`redact`, and messages never include a request URL (SerpApi's carries the key).
"""

from __future__ import annotations

import asyncio
import email.utils
import logging
import time
from dataclasses import dataclass, field
from typing import Optional

import httpx


@dataclass(frozen=True)
class WebResult:
    """One organic result: ``title``, ``snippet`` (the provider's text), ``url``."""

    title: str
    snippet: str
    url: str


@dataclass
class ProviderAnswer:
    """A provider's answer to one query: results best first, and the credits it says the call cost (1 when it
    does not say; 0 for a self-hosted engine)."""

    results: list = field(default_factory=list)
    credits: float = 1.0


class ProviderError(Exception):
    """A provider call that gave no results; ``status`` is the provider's HTTP status (None: no answer)."""

    def __init__(self, message: str, status: Optional[int] = None):
        super().__init__(message)
        self.status = status


class AuthError(ProviderError):
    """The provider refused the API key (401 / 403): no retry can help."""


class QuotaError(ProviderError):
    """The provider account has no searches / credits left: no retry can help until it is topped up."""


class RateLimited(ProviderError):
    """429: ``retry_after`` seconds before the next call (None when the provider did not say)."""

    def __init__(self, message: str, status: Optional[int] = 429, retry_after: Optional[float] = None):
        super().__init__(message, status)
        self.retry_after = retry_after


class Unavailable(ProviderError):
    """5xx, a timeout, a refused connection or an answer that is not the documented JSON: worth retrying
    (``retry_after``: the provider's Retry-After on a 503, None when it gave none)."""

    def __init__(self, message: str, status: Optional[int] = None, retry_after: Optional[float] = None):
        super().__init__(message, status)
        self.retry_after = retry_after


class BadQuery(ProviderError):
    """Another 4xx: the provider refused this query (the others are not affected)."""


def redact(text: str, secret: Optional[str]) -> str:
    """``text`` with every occurrence of ``secret`` replaced by ``***`` (no-op for an empty secret)."""
    text = str(text)
    return text.replace(secret, "***") if secret else text


class SecretFilter(logging.Filter):
    """Replaces secrets (API keys) in a log record's message and arguments with ``***`` (on a logger: the records
    it creates; on a handler: every record it writes)."""

    def __init__(self, secrets):
        super().__init__()
        self.secrets = [x for x in secrets if x]

    def filter(self, record: logging.LogRecord) -> bool:
        if self.secrets:
            text = record.getMessage()
            for secret in self.secrets:
                text = text.replace(secret, "***")
            record.msg, record.args = text, None
        return True


def parse_retry_after(value: Optional[str], now: Optional[float] = None) -> Optional[float]:
    """Seconds from a ``Retry-After`` header: delta-seconds or an HTTP date (RFC 9110 sec. 10.2.3); None when absent
    or unreadable; never negative."""
    if value is None or not str(value).strip():
        return None
    value = str(value).strip()
    try:
        return max(0.0, float(value))
    except ValueError:
        pass
    try:
        when = email.utils.parsedate_to_datetime(value)
    except (TypeError, ValueError):
        return None
    if when is None:
        return None
    return max(0.0, when.timestamp() - (time.time() if now is None else now))


class Provider:
    """One web search API. Subclasses set the class attributes and implement :meth:`request` and :meth:`parse`.

    Attributes:
        name: ``--web`` name.
        key_env: environment variable holding the API key.
        default_endpoint: the provider's public search URL.
        docs: the public documentation page the request / response shapes follow.
    """

    name = ""
    key_env = ""
    default_endpoint = ""
    docs = ""
    needs_key = True        # False: a self-hosted engine without a key (SearxNG)
    credits_per_call = 1.0  # what one answered call is expected to cost, before the provider says

    def request(self, endpoint: str, query: str, topk: int, key: str) -> dict:  # pragma: no cover - abstract
        """Keyword arguments of ``httpx.Client.request`` for one query (method, url, headers, params / json)."""
        raise NotImplementedError

    def parse(self, body: dict, topk: int) -> ProviderAnswer:  # pragma: no cover - abstract
        """The documented JSON of a 200 answer -> at most ``topk`` results. Raises Unavailable when the provider
        reports a failed search inside a 200."""
        raise NotImplementedError

    def error_message(self, body) -> str:
        """The human-readable message of an error body (``{"error": ...}`` or ``{"message": ...}``), else ''."""
        if isinstance(body, dict):
            for key in ("error", "message", "detail"):
                if isinstance(body.get(key), str):
                    return body[key]
        return ""

    def is_quota(self, status: int, message: str, retry_after: Optional[float] = None) -> bool:
        """True when an error answer says the account is out of searches / credits: a 402, or another 4xx (not a
        429: that is a rate limit) whose text says so. A 429 / 5xx is never taken for an empty account here."""
        text = message.lower()
        return status == 402 or (400 <= status < 500 and status not in (408, 429)
                                 and ("credits" in text or "quota" in text or "run out of searches" in text))


async def call(provider: Provider, client: httpx.AsyncClient, endpoint: str, key: str, query: str, topk: int,
               timeout_s: float) -> ProviderAnswer:
    """One provider call for one query; the answer or one :class:`ProviderError` (see the module table).

    ``timeout_s`` is a deadline on the whole call, from connecting to the last byte of the answer (httpx's own
    timeouts bound only each phase: a provider trickling its answer held a call for 5 s against 1 s)."""
    who = provider.name
    try:
        async with asyncio.timeout(timeout_s):
            response = await client.request(**provider.request(endpoint, query, topk, key), timeout=timeout_s)
    except (TimeoutError, httpx.TimeoutException):
        raise Unavailable(f"{who}: no complete answer within {timeout_s:g}s") from None
    except httpx.HTTPError as e:  # connection refused / reset, protocol errors: the class name, never the URL
        raise Unavailable(f"{who}: request failed ({type(e).__name__})") from None
    status = response.status_code
    try:
        body = response.json()
    except ValueError:
        body = None
    message = redact(provider.error_message(body) or response.text[:200], key).strip().replace("\n", " ")
    if status == 200:
        if not isinstance(body, dict):
            raise Unavailable(f"{who}: HTTP 200 without the documented JSON object")
        return provider.parse(body, topk)
    retry_after = parse_retry_after(response.headers.get("retry-after"))
    # the status decides first: a 429 or a 5xx is temporary whatever its text says ("quota" in a rate-limit
    # message), unless the provider documents that exact answer as an empty account (SerpApi's 429)
    if provider.is_quota(status, message, retry_after):
        raise QuotaError(f"{who} says the account is out of searches (HTTP {status}: {message})", status)
    if status == 429:
        raise RateLimited(f"{who} rate limit (HTTP 429: {message})", status, retry_after)
    if status in (401, 403):
        raise AuthError(f"{who} refused the API key (HTTP {status}: {message})", status)
    if 400 <= status < 500 and status != 408:
        raise BadQuery(f"{who} refused the query (HTTP {status}: {message})", status)
    raise Unavailable(f"{who}: HTTP {status} ({message})", status, retry_after)
