"""Before a training job starts: every retriever URL answers ``GET /health`` and serves the same index.

``GET /health`` of ``retriever.server`` reports the index's ``fingerprint`` (``retriever.index.manifest_fingerprint``:
a hash of encoder, index type, passage count, build parameters and corpus file name). A job whose rollout actors
query two different indexes, or an index other than the one the launcher meant (a stale service left on the port),
would train on mixed or wrong evidence without any error; this module refuses to start it.

    python -m openrlhf_search.launch.retriever_check --urls http://127.0.0.1:8000,http://10.0.0.2:8000 \
        [--index_dir DIR | --fingerprint HEX] [--timeout 5]

exits 0 and prints the common fingerprint, or exits 1 with one line naming the URL and what is wrong.
"""

import argparse
import json
import os
import sys
import urllib.error
import urllib.request
from typing import Dict, List, Optional

from openrlhf_search.env.config import _is_http_url


#: an opener that ignores the proxy environment variables (the retriever is reached directly)
_DIRECT = urllib.request.build_opener(urllib.request.ProxyHandler({}))


class RetrieverCheckError(RuntimeError):
    """A retriever URL is down, is not our retriever service, or serves another index; the message is one line."""


def fetch_health(url: str, timeout: float = 5.0) -> Dict:
    """``GET url/health`` as JSON.

    Raises:
        RetrieverCheckError: no answer, an HTTP error, a body that is not a JSON object, or no ``fingerprint``.
    """
    try:
        # no proxy: HTTP_PROXY without NO_PROXY would send http://127.0.0.1:8000 to a node's internet proxy
        with _DIRECT.open(url.rstrip("/") + "/health", timeout=timeout) as r:
            body = json.loads(r.read())
    except (urllib.error.URLError, OSError, ValueError) as e:
        raise RetrieverCheckError(f"retriever {url}: /health did not answer ({e})") from e
    if not isinstance(body, dict):
        raise RetrieverCheckError(f"retriever {url}: /health is not a JSON object")
    if not body.get("fingerprint"):
        raise RetrieverCheckError(f"retriever {url}: /health names no index fingerprint (not retriever.server, "
                                  "or one older than the fingerprint field)")
    return body


def expected_fingerprint(index_dir: str) -> str:
    """Fingerprint of the index in ``index_dir`` (its ``manifest.json``).

    Raises:
        RetrieverCheckError: no readable manifest there.
    """
    from retriever.index import MANIFEST, manifest_fingerprint

    path = os.path.join(index_dir, MANIFEST)
    try:
        with open(path) as f:
            manifest = json.load(f)
    except (OSError, ValueError) as e:
        raise RetrieverCheckError(f"index {index_dir}: no readable {MANIFEST} ({e})") from e
    if not isinstance(manifest, dict):
        raise RetrieverCheckError(f"index {index_dir}: {MANIFEST} is not a JSON object")
    return manifest_fingerprint(manifest)


def _describe(h: Dict) -> str:
    return (f"{h.get('fingerprint')} ({h.get('encoder')} {h.get('index_type')}, {h.get('count')} passages of "
            f"{os.path.basename(str(h.get('corpus_path') or '?'))})")


def check_retrievers(urls: List[str], expected: Optional[str] = None, timeout: float = 5.0) -> str:
    """Check that every URL is healthy and all serve one index (``expected`` when given).

    Args:
        urls: retriever base URLs (``http://host:port``).
        expected: fingerprint they must serve, or None to only require that they agree.
        timeout: seconds per ``/health`` request.

    Returns:
        The common fingerprint.

    Raises:
        RetrieverCheckError: empty list, a bad URL, a URL down, or a fingerprint that differs (one line).
    """
    if not urls:
        raise RetrieverCheckError("no retriever URL to check")
    bad = [u for u in urls if not _is_http_url(u)]
    if bad:
        raise RetrieverCheckError(f"not an http(s) URL: {bad[0]!r}")
    first_url, first = None, None
    for url in urls:
        h = fetch_health(url, timeout)
        fp = h["fingerprint"]
        if expected is not None and fp != expected:
            raise RetrieverCheckError(f"retriever {url} serves index {_describe(h)}, expected {expected}")
        if first is not None and fp != first["fingerprint"]:
            raise RetrieverCheckError(f"retrievers disagree: {first_url} serves {_describe(first)}, {url} serves "
                                      f"{_describe(h)}")
        if first is None:
            first_url, first = url, h
    return first["fingerprint"]


def check_on_ray_nodes(urls: List[str], expected: Optional[str] = None, timeout: float = 5.0) -> str:
    """:func:`check_retrievers` run on every alive Ray node that has GPUs (every node when none has), so that
    loopback URLs (one retriever per node, ``http://127.0.0.1:PORT``) are checked where the rollout actors will
    query them. All nodes must agree on one fingerprint. Needs ``ray.init`` done.

    Raises:
        RetrieverCheckError: a node failed its check (its message, prefixed with the node address), or two nodes
            serve different indexes.
    """
    import ray
    from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

    nodes = [n for n in ray.nodes() if n.get("Alive")]
    gpu_nodes = [n for n in nodes if n.get("Resources", {}).get("GPU", 0) > 0]
    targets = gpu_nodes or nodes

    @ray.remote(num_cpus=0)
    def _probe():
        try:
            return True, check_retrievers(urls, expected, timeout)
        except RetrieverCheckError as e:
            return False, str(e)

    refs = [_probe.options(scheduling_strategy=NodeAffinitySchedulingStrategy(n["NodeID"], soft=False)).remote()
            for n in targets]
    results = ray.get(refs)
    seen = {}
    for node, (ok, value) in zip(targets, results):
        where = node.get("NodeManagerAddress", node["NodeID"])
        if not ok:
            raise RetrieverCheckError(f"node {where}: {value}")
        seen[where] = value
    if len(set(seen.values())) > 1:
        raise RetrieverCheckError(f"nodes serve different indexes: {seen}")
    return next(iter(seen.values()))


def serving_line(health: Dict, paper_encoder: str = "", paper_index_type: str = "") -> List[str]:
    """What a retriever serves, as log lines: ``serving: <encoder> <index type> over <n> passages of <corpus>
    (fingerprint)``, then ``warning: ...`` when the encoder or index type differs from the paper setting's (a name
    compares by its last path part, case-insensitive: ``intfloat/e5-base-v2`` is ``e5-base-v2``)."""
    enc, itype = str(health.get("encoder") or "?"), str(health.get("index_type") or "?")
    corpus = str(health.get("corpus_path") or "?")
    lines = [f"serving: {enc} {itype} index over {health.get('count')} passages of {corpus} "
             f"(fingerprint {health.get('fingerprint')})"]
    norm = lambda x: str(x).rstrip("/").split("/")[-1].lower()
    diffs = []
    if paper_encoder and norm(paper_encoder) != norm(enc):
        diffs.append(f"encoder {enc} (paper: {paper_encoder})")
    if paper_index_type and paper_index_type.lower() != itype.lower():
        diffs.append(f"index type {itype} (paper: {paper_index_type})")
    if diffs:
        lines.append(f"warning: the retrievers differ from the paper setting: {'; '.join(diffs)}; results will not "
                     f"be comparable with the paper's (restart them with the paper's encoder, e.g. "
                     f"RETRIEVER_ENCODER={paper_encoder or enc} cluster_node_setup.sh)")
    return lines


def web_preflight(health: Dict, prompts: int, samples: int, turns: int, steps: Optional[int] = None
                  ) -> Optional[tuple]:
    """Compare a run's likely web search use with a web retriever's budget and rate (its ``GET /health``).

    Args:
        health: the ``/health`` answer of ``retriever.server --web`` (anything else: None is returned).
        prompts, samples, turns: rollout batch size, samples per prompt, most turns per trajectory; their product is
            the most searches one step can make (each turn searches at most once).
        steps: the run's planned steps (``--train.max_steps``; None: unknown, only one step is checked).
    Returns:
        (line, fits): a one-line summary (searches per step, paid calls after the cache's measured hit rate,
        the budget left and the steps it covers, the seconds per step the provider's rate allows); ``fits`` False
        when the budget cannot cover the planned steps (one step when unknown) and the server stops the run at
        its budget (``on_budget`` stop). None for an index retriever.
    """
    web = health.get("web") if isinstance(health, dict) else None
    if health.get("backend") != "web" or not isinstance(web, dict):
        return None
    per_step = prompts * samples * turns
    cache = web.get("cache") or {}
    hit = float(cache.get("hit_rate") or 0.0) if cache.get("lookups") else 0.0
    paid = per_step * (1.0 - hit)
    budget = web.get("budget") or {}
    left = []
    if budget.get("max_queries") is not None:
        left.append(max(0, budget["max_queries"] - budget.get("calls", 0)))
    if budget.get("max_usd") is not None and budget.get("usd_per_1k"):
        usd_left = max(0.0, budget["max_usd"] - (budget.get("usd") or 0.0))
        left.append(int(usd_left / (budget["usd_per_1k"] / 1000.0)))  # at one credit per search
    calls_left = min(left) if left else None
    covers = None if calls_left is None else (calls_left / paid if paid else float("inf"))
    need = steps or 1
    fits = covers is None or covers >= need or web.get("on_budget") == "continue"
    cost = (f", about US${paid * budget['usd_per_1k'] / 1000.0:.2f} per step" if budget.get("usd_per_1k") else "")
    qps = web.get("qps")
    rate = f"; at {qps:g} calls/s the provider needs about {paid / qps:.0f} s per step" if qps else ""
    left_text = ("no cap" if calls_left is None else
                 f"{calls_left} paid calls left, enough for {covers:.1f} of {need if steps else 'the first'} step"
                 f"{'s' if steps else ''}")
    line = (f"web search pre-flight ({health.get('provider')}): up to {per_step} searches per step ({prompts} "
            f"prompts x {samples} samples x {turns} turns), about {paid:.0f} paid after the cache's "
            f"{100 * hit:.0f}% hit rate{cost}; budget: {left_text}{rate}")
    return line, fits


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--urls", required=True, help="comma-separated retriever base URLs")
    group = p.add_mutually_exclusive_group()
    group.add_argument("--index_dir", help="the index they must serve (its manifest.json)")
    group.add_argument("--fingerprint", help="the fingerprint they must serve")
    p.add_argument("--timeout", type=float, default=5.0)
    p.add_argument("--describe", action="store_true",
                   help="also print to stderr what they serve (encoder, index type, passages, corpus)")
    p.add_argument("--paper_encoder", default="", help="with --describe: warn when the encoder differs from this")
    p.add_argument("--paper_index_type", default="", help="with --describe: warn when the index type differs")
    a = p.parse_args(argv)
    urls = [u.strip() for u in a.urls.split(",") if u.strip()]
    try:
        expected = expected_fingerprint(a.index_dir) if a.index_dir else a.fingerprint
        fp = check_retrievers(urls, expected, a.timeout)
        if a.describe:
            for line in serving_line(fetch_health(urls[0], a.timeout), a.paper_encoder, a.paper_index_type):
                print(line, file=sys.stderr)
    except RetrieverCheckError as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    print(fp)
    return 0


if __name__ == "__main__":
    sys.exit(main())
