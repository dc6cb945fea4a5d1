"""Web search providers behind the retriever API (``python -m retriever.server --web PROVIDER``).

Modules: :mod:`.provider` (the provider interface and how a call's outcome is classified), one module per provider
(:mod:`.serper`, :mod:`.serpapi`, :mod:`.searxng` self-hosted), :mod:`.cache` (query cache and run budget),
:mod:`.ratelimit`, :mod:`.reader` (page text), :mod:`.backend` (``WebIndex``: all of it behind
``search(queries, topk)``). Errors: :mod:`retriever.errors`.
"""

from .provider import Provider
from .searxng import SearxNG
from .serpapi import SerpApi
from .serper import Serper

PROVIDERS = {p.name: p for p in (Serper, SerpApi, SearxNG)}


def get_provider(name: str) -> Provider:
    """The provider called ``name``. Raises ValueError naming the known ones."""
    try:
        return PROVIDERS[name]()
    except KeyError:
        raise ValueError(f"unknown web provider {name!r}; known: {', '.join(sorted(PROVIDERS))}") from None
