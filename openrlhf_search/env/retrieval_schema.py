"""What a retriever answers and what it means to the client: the schema of a ``POST /retrieve`` answer
(``docs/design.md``, "Retriever schemas"), the errors a ``search`` raises, and the headers and bodies that say when
to retry or to stop the run. Pure functions of the answer; the sending (coalescing, failover, retries) is
:mod:`openrlhf_search.env.retrieval_client`'s.
"""

import email.utils
import time
from typing import Optional

import httpx

from openrlhf_search.env.types import Passage

__all__ = ["RetrievalError", "QueryRejected", "RetrievalStopped", "QueryUnavailable", "passage_from_document",
           "parse_retrieve_answer", "retry_after_seconds", "stop_message"]


class RetrievalError(RuntimeError):
    """The retriever could not answer within the retry budget (all endpoints down, timeouts, bad responses)."""


class QueryRejected(RetrievalError):
    """The retriever refused this one query (a per-query error, or a 4xx for a request holding it alone): the
    query is at fault, not the service; the other queries coalesced with it were answered. A subclass of
    ``RetrievalError`` so that callers that do not tell the two apart still see a failure."""


class RetrievalStopped(RetrievalError):
    """The retriever says the run must stop (a web provider refused the API key, the account or the run's web
    budget is spent): no retry or failover can help. The message is one line, the retriever's own."""


def passage_from_document(doc: dict, score=None) -> Passage:
    """Turn one ``document`` of the ``/retrieve`` response into a ``Passage``.

    Accepts ``{"id", "title", "text"}`` or the wiki-18 / FlashRAG form ``{"id", "contents": "\\"Title\\"\\ntext"}``.
    Raises ValueError when the document has neither ``text`` nor ``contents``.
    """
    if not isinstance(doc, dict):
        raise ValueError(f"document must be an object, got {type(doc).__name__}")
    pid = str(doc.get("id", ""))
    if "text" in doc and doc.get("text") is not None:
        title = str(doc.get("title") or "")
        text = str(doc["text"])
    elif "contents" in doc:
        contents = str(doc["contents"])
        head, sep, rest = contents.partition("\n")
        if sep:
            title, text = head.strip().strip('"'), rest
        else:
            title, text = str(doc.get("title") or ""), contents
    else:
        raise ValueError(f"document without text or contents: keys {sorted(doc)}")
    return Passage(id=pid, title=title, text=text, score=None if score is None else float(score))


def parse_retrieve_answer(body, n_queries: int, url: str = "") -> list:
    """Parse ``{"result": [[{"document": {...}, "score": s}, ...], ...], "errors": [null | str, ...],
    "unavailable": [i, ...], "retry_after": s}`` (all but ``result`` optional): per query its passages, an
    ``QueryUnavailable`` for an index in ``unavailable`` (retried), or a :class:`QueryRejected` where ``errors``
    names one. ValueError when malformed."""
    if not isinstance(body, dict) or "result" not in body:
        raise ValueError("retriever response has no 'result'")
    result = body["result"]
    if not isinstance(result, list) or len(result) != n_queries:
        raise ValueError(f"retriever returned {len(result) if isinstance(result, list) else '?'} result lists "
                         f"for {n_queries} queries")
    errors = body.get("errors")
    if errors is not None and (not isinstance(errors, list) or len(errors) != n_queries
                               or not all(e is None or isinstance(e, str) for e in errors)):
        raise ValueError(f"retriever returned malformed per-query errors for {n_queries} queries")
    unavailable = body.get("unavailable") or []
    if not isinstance(unavailable, list) or not all(isinstance(i, int) and 0 <= i < n_queries and errors
                                                    and errors[i] for i in unavailable):
        raise ValueError("retriever returned malformed 'unavailable' indices")
    wait = body.get("retry_after")
    wait = float(wait) if isinstance(wait, (int, float)) and not isinstance(wait, bool) and wait > 0 else None
    parsed = []
    for i, hits in enumerate(result):
        if i in unavailable:  # the server could not serve this query now: worth sending again
            parsed.append(QueryUnavailable(f"retriever {url}: {errors[i]}", wait))
            continue
        if errors is not None and errors[i] is not None:
            parsed.append(QueryRejected(f"retriever {url} refused the query: {errors[i]}"))
            continue
        passages = []
        for hit in hits:
            if isinstance(hit, dict) and "document" in hit:
                passages.append(passage_from_document(hit["document"], hit.get("score")))
            else:  # return_scores=False form: the document itself
                passages.append(passage_from_document(hit))
        parsed.append(passages)
    return parsed


class QueryUnavailable(Exception):
    """The server could not serve this query now (``"unavailable"`` in its answer); ``retry_after``:
    seconds it asks to wait (None: not said)."""

    def __init__(self, message: str, retry_after: Optional[float] = None):
        super().__init__(message)
        self.retry_after = retry_after


def retry_after_seconds(response: httpx.Response) -> Optional[float]:
    """Seconds of a ``Retry-After`` header (delta-seconds or an HTTP date); None when absent or unreadable."""
    value = (response.headers.get("retry-after") or "").strip()
    if not value:
        return None
    try:
        return max(0.0, float(value))
    except ValueError:
        pass
    try:
        return max(0.0, email.utils.parsedate_to_datetime(value).timestamp() - time.time())
    except (TypeError, ValueError):
        return None


def stop_message(response: httpx.Response, url: str) -> Optional[str]:
    """The retriever's one-line reason when a 4xx answer carries ``"stop_run": true``, else None."""
    try:
        body = response.json()
    except ValueError:
        return None
    if not isinstance(body, dict) or body.get("stop_run") is not True:
        return None
    detail = " ".join(str(body.get("detail") or f"HTTP {response.status_code}").split())
    return f"retriever {url}: {detail}"
