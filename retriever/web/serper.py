"""Serper (serper.dev): Google results as JSON, the API R1-Searcher's online evaluation calls.

R1-Searcher's ``evaluation/eval_search_online.py`` (RUCAIBox/R1-Searcher@631167c) names its function
``bing_web_search`` but speaks Serper's API: a POST of a JSON body with ``q`` and an ``X-API-KEY`` header (lines
200-217), results read from ``organic[*].title`` / ``link`` (lines 230-244); it appends ``site:en.wikipedia.org`` to
every query (line 406) and reads the top 3 results (line 410). ASearcher and slime use Serper too.

Request (https://serper.dev, the API playground's generated code; Serper publishes no separate reference page):
``POST https://google.serper.dev/search``, headers ``X-API-KEY: <key>``, ``Content-Type: application/json``, body
``{"q": query, "num": n}``. Answer: ``{"searchParameters": {...}, "organic": [{"title", "link", "snippet",
"position", ...}], "answerBox"?, "knowledgeGraph"?, "peopleAlsoAsk"?, "relatedSearches"?, "credits": 1}``; passages
come from ``organic`` only, as R1-Searcher reads them. Errors: ``{"message": "Unauthorized.", "statusCode": 403}``
for a refused key (as Serper users report it, e.g. crewAIInc/crewAI#633); an answer mentioning credits is taken as
the account being out of credits (Serper documents no quota error; not checked against the live service).
"""

from .provider import Provider, ProviderAnswer, WebResult


class Serper(Provider):
    name = "serper"
    key_env = "SERPER_API_KEY"
    default_endpoint = "https://google.serper.dev/search"
    docs = "https://serper.dev (API playground)"

    def request(self, endpoint: str, query: str, topk: int, key: str) -> dict:
        return {"method": "POST", "url": endpoint, "json": {"q": query, "num": max(10, topk)},
                "headers": {"X-API-KEY": key, "Content-Type": "application/json"}}

    def parse(self, body: dict, topk: int) -> ProviderAnswer:
        rows = body.get("organic") or []
        results = [WebResult(str(r.get("title") or ""), str(r.get("snippet") or ""), str(r.get("link") or ""))
                   for r in rows if isinstance(r, dict)][:topk]
        credits = body.get("credits")
        return ProviderAnswer(results, float(credits) if isinstance(credits, (int, float)) and credits > 0 else 1.0)
