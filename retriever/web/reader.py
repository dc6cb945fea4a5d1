"""Page text of a web result through a reader service, cleaned of markup and capped in words.

The reader follows Jina Reader's convention (``GET {endpoint}/{page url}`` answers the page as text or markdown;
``Authorization: Bearer <key>`` when a key is set), which ASearcher uses for its page text; any service with that
contract works (a self-hosted one included). The text is cleaned (:func:`clean_page_text`: HTML tags with
script / style bodies, markdown images, link targets, emphasis and heading marks, bare URLs, the reader's own
``Title:`` / ``URL Source:`` header) and cut to ``max_words`` words starting at the paragraph where the result's
snippet is found (as Search-R1's Google server keeps the paragraphs that hold the snippet,
``search_r1/search/google_search_server.py:99-117``), else at the start. A page that cannot be read keeps its snippet.
"""

from __future__ import annotations

import asyncio
import html
import re
from html.parser import HTMLParser
from typing import Optional

import httpx

from .provider import redact

_MD_IMAGE = re.compile(r"!\[[^\]]*\]\([^)]*\)")
_MD_LINK = re.compile(r"\[([^\]]*)\]\([^)]*\)")
_URL = re.compile(r"https?://\S+")
_MD_MARKS = re.compile(r"(^|\s)[#>*+-]{1,6}\s+|[*_`~]{1,3}|\|")
_READER_HEADER = re.compile(r"^(Title|URL Source|Published Time|Markdown Content):.*$", re.MULTILINE)


class _Text(HTMLParser):
    """Text of an HTML document without script / style / noscript bodies; block tags end lines."""

    _SKIP = {"script", "style", "noscript", "template", "svg", "head"}
    _BLOCK = {"p", "div", "br", "li", "tr", "h1", "h2", "h3", "h4", "h5", "h6", "section", "article", "table"}

    def __init__(self):
        super().__init__(convert_charrefs=True)
        self.parts, self._skip = [], 0

    def handle_starttag(self, tag, attrs):
        if tag in self._SKIP:
            self._skip += 1
        elif tag in self._BLOCK:
            self.parts.append("\n")

    def handle_endtag(self, tag):
        if tag in self._SKIP and self._skip:
            self._skip -= 1
        elif tag in self._BLOCK:
            self.parts.append("\n")

    def handle_data(self, data):
        if not self._skip:
            self.parts.append(data)


def clean_page_text(text: str) -> str:
    """Readable text of a page given as HTML or markdown: paragraphs separated by a blank line, words by one space."""
    if re.search(r"<(html|body|p|div|span|a|script|br)\b", text, re.IGNORECASE):
        parser = _Text()
        parser.feed(text)
        parser.close()
        text = "".join(parser.parts)
    text = html.unescape(_READER_HEADER.sub("", text))
    text = _MD_IMAGE.sub(" ", text)
    text = _MD_LINK.sub(r"\1", text)
    text = _URL.sub(" ", text)
    paragraphs = []
    for block in re.split(r"\n\s*\n|\n", text):
        block = " ".join(_MD_MARKS.sub(" ", block).split())
        if block:
            paragraphs.append(block)
    return "\n\n".join(paragraphs)


def window(text: str, snippet: str, max_words: int) -> str:
    """At most ``max_words`` words of ``text``, from the paragraph holding the first snippet part of more than five
    words (the snippet split at "..."; its first six words, case aside, must appear there), else from the start."""
    paragraphs = text.split("\n\n")
    lowered = [" ".join(p.lower().split()) for p in paragraphs]
    start = 0
    for part in (p.strip() for p in snippet.split("...")):
        if len(part.split()) > 5:
            probe = " ".join(part.lower().split()[:6])
            hit = next((i for i, p in enumerate(lowered) if probe in p), None)
            if hit is not None:
                start = hit
                break
    words = " ".join(paragraphs[start:]).split()
    return " ".join(words[:max_words])


class PageReader:
    """Reads result pages through a reader service.

    Args:
        endpoint: the reader's base URL (``https://r.jina.ai`` for Jina Reader).
        api_key: sent as a bearer token when given; never logged.
        max_words: words of page text per passage.
        timeout_s: total deadline of one page read, seconds.

    Attributes:
        reads, failures: pages read / pages that fell back to their snippet.
    """

    def __init__(self, endpoint: str, api_key: Optional[str] = None, max_words: int = 200, timeout_s: float = 10.0):
        if max_words < 1:
            raise ValueError(f"max_words must be >= 1, got {max_words}")
        self.endpoint = endpoint.rstrip("/")
        self.api_key = api_key
        self.max_words = max_words
        self.timeout_s = timeout_s
        self.reads = 0
        self.failures = 0

    @property
    def variant(self) -> str:
        """Cache variant: what a cached passage's text is (``page<N>w``)."""
        return f"page{self.max_words}w"

    async def read(self, client: httpx.AsyncClient, url: str, snippet: str) -> Optional[str]:
        """Cleaned, capped text of ``url``; None when the page cannot be read within ``timeout_s`` (a total
        deadline) or holds no text."""
        if not url.startswith(("http://", "https://")):
            return None
        headers = {"Authorization": f"Bearer {self.api_key}"} if self.api_key else {}
        try:
            async with asyncio.timeout(self.timeout_s):
                response = await client.get(f"{self.endpoint}/{url}", headers=headers, timeout=self.timeout_s)
        except (httpx.HTTPError, TimeoutError):
            self.failures += 1
            return None
        if response.status_code != 200:
            self.failures += 1
            return None
        text = window(clean_page_text(redact(response.text, self.api_key)), snippet, self.max_words)
        self.reads += 1
        return text or None
