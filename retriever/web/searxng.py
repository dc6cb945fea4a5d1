"""SearxNG (docs.searxng.org): a self-hosted metasearch engine, so a run can search the web without a paid key.

Request (https://docs.searxng.org/dev/search_api.html): ``GET {instance}/search?q=...&format=json`` (also
``pageno``, ``language``, ``categories``; here only ``q`` and ``format``). The instance must allow the JSON format
(``search: formats: [html, json]`` in its ``settings.yml``); otherwise it answers 403, read here as a refused
request that stops the run, naming the setting. Answer: ``{"query", "number_of_results", "results": [{"url",
"title", "content", "engine", ...}], "answers", "suggestions", "unresponsive_engines", ...}``; passages come from
``results`` in order (title, ``content`` as the snippet, ``url``). No key and no charge: a call costs 0 credits, so
a money cap never stops it, while the query cap, the cache and the rate limit (the instance's own limiter answers
429) apply as for a paid provider.
"""

from .provider import Provider, ProviderAnswer, WebResult


class SearxNG(Provider):
    name = "searxng"
    key_env = "SEARXNG_API_KEY"  # optional: sent as a bearer token when set (an instance behind a proxy)
    default_endpoint = "http://127.0.0.1:8888/search"
    docs = "https://docs.searxng.org/dev/search_api.html"
    needs_key = False
    credits_per_call = 0.0

    def request(self, endpoint: str, query: str, topk: int, key: str) -> dict:
        headers = {"Authorization": f"Bearer {key}"} if key else {}
        return {"method": "GET", "url": endpoint, "params": {"q": query, "format": "json"}, "headers": headers}

    def parse(self, body: dict, topk: int) -> ProviderAnswer:
        rows = body.get("results") or []
        results = [WebResult(str(r.get("title") or ""), str(r.get("content") or ""), str(r.get("url") or ""))
                   for r in rows if isinstance(r, dict)][:topk]
        return ProviderAnswer(results, 0.0)
