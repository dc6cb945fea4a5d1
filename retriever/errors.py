"""Error types shared by the retrieval service (``retriever.server``), its backends (``retriever.web``) and the
index modules (``retriever.index``, ``retriever.adopt``, ``retriever.faiss_files``).

They live in their own module so that the server and a backend never import each other: under
``python -m retriever.server`` the server module runs as ``__main__``, and a backend importing the class from
``retriever.server`` would raise a second copy of it that the app's exception handler never matches (every web
error then became an opaque 500 with a traceback).
"""


class BackendError(RuntimeError):
    """The search backend (a web provider) failed for a request or one query.

    ``status`` 503 (or 504): temporary, the client's retry / failover rules apply; ``retry_after`` seconds go out
    as a Retry-After header. A 4xx with ``stop_run`` True: no retry can help (refused API key, empty account, the
    run's budget spent): the body says so and the client stops the run with the message, which is one line."""

    def __init__(self, message: str, status: int = 503, stop_run: bool = False,
                 retry_after: float | None = None):
        super().__init__(message)
        self.status, self.stop_run, self.retry_after = status, stop_run, retry_after


class RetrieverIndexError(RuntimeError):
    """An index directory is missing, incomplete or inconsistent (message says what and where)."""


class AdoptionError(RetrieverIndexError):
    """The given faiss index does not match the corpus or the encoder; the message names the failed check."""
