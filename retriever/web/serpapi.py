"""SerpApi (serpapi.com): Google results as JSON, the online search engine Search-R1 recommends and ships.

Search-R1's ``search_r1/search/serp_search_server.py`` (PeterGriffinJin/Search-R1@a14dc3a) sends ``GET`` with
``engine``, ``q``, ``api_key`` (lines 41-48) and turns ``answer_box`` (lines 60-66), the first ``topk``
``organic_results`` (lines 68-74) and the first ``topk`` ``related_questions`` (lines 76-82) into documents
``{"contents": "\\"title\\"\\nsnippet"}``, with "No title." / "No snippet available." for missing fields; its
``docs/retriever.md:109`` recommends SerpApi over Google's Custom Search API (which Google has since closed to new
customers). Here the same three parts in the same order are cut to ``topk`` passages in all, so a web passage list
has the length of a local one (Search-R1's server returns up to ``2 * topk + 1``).

Request (https://serpapi.com/search-api): ``GET https://serpapi.com/search?engine=google&q=...&api_key=...``.
Answer: ``{"search_metadata": {"status": "Success" | "Error", ...}, "answer_box"?, "organic_results": [{"position",
"title", "link", "snippet", ...}], "related_questions"?: [{"question", "snippet", "link"?}], ...}``; a search with no
results is a 200 with ``"error": "Google hasn't returned any results for this query."`` and status Success
(https://serpapi.com/search-errors). Errors (https://serpapi.com/api-status-and-error-codes): ``{"error": "..."}``
with 400, 401 (``"Invalid API key. ..."``), 403, 429 (hourly throughput, or ``"Your account has run out of
searches."``), 500 / 503.
"""

from typing import Optional

from .provider import Provider, ProviderAnswer, Unavailable, WebResult


class SerpApi(Provider):
    name = "serpapi"
    key_env = "SERPAPI_API_KEY"
    default_endpoint = "https://serpapi.com/search"
    docs = "https://serpapi.com/search-api"

    def request(self, endpoint: str, query: str, topk: int, key: str) -> dict:
        return {"method": "GET", "url": endpoint, "params": {"engine": "google", "q": query, "api_key": key}}

    def is_quota(self, status: int, message: str, retry_after: Optional[float] = None) -> bool:
        """Also SerpApi's documented empty account: a 429 "Your account has run out of searches." (no Retry-After;
        its hourly-throughput 429 says otherwise and is a rate limit)."""
        return super().is_quota(status, message, retry_after) or (
            status == 429 and retry_after is None and "run out of searches" in message.lower())

    def parse(self, body: dict, topk: int) -> ProviderAnswer:
        status = (body.get("search_metadata") or {}).get("status")
        if status == "Error":
            raise Unavailable(f"serpapi: search failed ({self.error_message(body) or 'status Error'})", 200)
        rows = []
        box = body.get("answer_box")
        if isinstance(box, dict) and box:
            rows.append((box.get("title"), box.get("snippet") or box.get("answer"), box.get("link")))
        rows += [(r.get("title"), r.get("snippet"), r.get("link"))
                 for r in body.get("organic_results") or [] if isinstance(r, dict)][:topk]
        rows += [(r.get("question"), r.get("snippet"), r.get("link"))
                 for r in body.get("related_questions") or [] if isinstance(r, dict)][:topk]
        results = [WebResult(str(t or "No title."), str(s or "No snippet available."), str(u or ""))
                   for t, s, u in rows]
        return ProviderAnswer(results[:topk])
