"""Retriever service throughput and latency vs the in-process floor (one corpus + encoder, one run).

    PYTHONPATH=. python benchmarks/bench_retriever.py [--index_dir D | --corpus C --encoder minilm --limit N]
        [--clients 1,8,32] [--seconds 10]

What it measures:
- floor: ``load_index(D).search(batch, topk)`` in this process (encode + search, no HTTP), batches of 1 and of
  the largest client count, as queries/s;
- service, in two modes of the same server (``python -m retriever.server``), both running, measured in turn at
  each client count: micro-batching on (the default) and off (``--no_batching``: one search per request, the
  baseline); N concurrent clients (aiohttp), each sending one single-query ``POST /retrieve`` after another
  (what rollout workers do), for ``--seconds``: queries/s, p50/p99 request latency;
- two ratios: batching on / off at 1 client (target >= 1.0: batching must cost a lone client
  nothing) and service(largest client count, batching on) / floor(batch of that size) (floor measured before
  and after the services, averaged; target >= 0.8).
Server and clients share this machine's cores, so on a small CPU the client's own HTTP work is part of the gap.
"""

import argparse
import asyncio
import json
import os
import statistics
import sys
import time

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO)
from benchmarks.inputs import CORPUS, QUESTIONS, require_inputs  # noqa: E402


def load_queries(path: str, n: int) -> list[str]:
    out = []
    with open(path) as f:
        for line in f:
            out.append(json.loads(line)["question_text"])
    return (out * (n // len(out) + 1))[:n]


def floor_qps(index, queries: list[str], batch: int, topk: int, seconds: float) -> float:
    """In-process queries/s at a fixed batch size, over at least ``seconds``."""
    index.search(queries[:batch], topk)  # warm-up
    done, i, t0 = 0, 0, time.perf_counter()
    while time.perf_counter() - t0 < seconds:
        b = [queries[(i + j) % len(queries)] for j in range(batch)]
        index.search(b, topk)
        done += batch
        i += batch
    return done / (time.perf_counter() - t0)


async def service_run(url: str, queries: list[str], clients: int, topk: int, seconds: float) -> dict:
    import aiohttp

    latencies: list[float] = []
    errors = 0
    stop_at = time.perf_counter() + 1.0  # warm-up round first

    async def client(cid: int, session):
        nonlocal errors
        i = cid
        while time.perf_counter() < stop_at:
            q = queries[i % len(queries)]
            i += clients
            t = time.perf_counter()
            async with session.post(url + "/retrieve", json={"queries": [q], "topk": topk,
                                                              "return_scores": True}) as r:
                await r.read()
                if r.status != 200:
                    errors += 1
                    continue
            latencies.append(time.perf_counter() - t)

    conn = aiohttp.TCPConnector(limit=clients)
    async with aiohttp.ClientSession(connector=conn, timeout=aiohttp.ClientTimeout(total=120)) as s:
        await asyncio.gather(*[client(c, s) for c in range(min(clients, 4))])  # warm-up round
        latencies.clear()
        stop_at = time.perf_counter() + seconds
        t0 = time.perf_counter()
        await asyncio.gather(*[client(c, s) for c in range(clients)])
        wall = time.perf_counter() - t0
    lat = sorted(latencies)
    return {"clients": clients, "qps": len(lat) / wall, "p50_ms": 1000 * statistics.median(lat),
            "p99_ms": 1000 * lat[min(len(lat) - 1, int(0.99 * len(lat)))], "requests": len(lat), "errors": errors}


def server_stats(url: str) -> dict:
    """The ``stats`` of the server's ``GET /health``."""
    import urllib.request

    return json.loads(urllib.request.urlopen(url + "/health").read())["stats"]


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--index_dir", default=None, help="an existing index; else one is built from --corpus")
    p.add_argument("--corpus", default=CORPUS)
    p.add_argument("--encoder", default="minilm")
    p.add_argument("--index_type", default=None)
    p.add_argument("--limit", type=int, default=None)
    p.add_argument("--workdir", default=os.path.join(REPO, "runs", "retriever"))
    p.add_argument("--questions", default=QUESTIONS)
    p.add_argument("--clients", default="1,8,32")
    p.add_argument("--seconds", type=float, default=10.0, help="per measurement")
    p.add_argument("--topk", type=int, default=3)
    p.add_argument("--batch_window_ms", type=float, default=2.0)
    p.add_argument("--batch_max_wait_ms", type=float, default=50.0)
    p.add_argument("--write_docs", default=None, help="replace the table between markers in this markdown file")
    a = p.parse_args(argv)
    require_inputs(questions=a.questions, **({} if getattr(a, "index_dir", None) else {"corpus": a.corpus}))

    from retriever.index import load_index
    from retriever.launch import ensure_index, start_server_process, stop_server_process

    index_dir = a.index_dir
    if index_dir is None:
        flat = os.path.join(a.workdir, f"hotpot_{a.encoder}_flat")  # made by retrieval_quality.py
        if a.encoder != "bm25" and a.limit is None and a.index_type in (None, "flat") and \
                os.path.exists(os.path.join(flat, "manifest.json")):
            index_dir = flat
        else:
            index_dir = ensure_index(a.corpus, a.workdir, encoder=a.encoder, limit=a.limit, index_type=a.index_type)
    clients = [int(c) for c in a.clients.split(",")]
    queries = load_queries(a.questions, 2000)
    index = load_index(index_dir)
    info = index.info()
    print(f"index: {info['index_type']} / {info['encoder']} / {info['count']} passages ({index_dir})", flush=True)
    print(f"threads: OMP_NUM_THREADS={os.environ.get('OMP_NUM_THREADS', 'unset')}, cpus={os.cpu_count()}", flush=True)
    floors = {}
    for b in sorted({1, max(clients)}):
        floors[b] = floor_qps(index, queries, b, a.topk, a.seconds)
        print(f"in-process floor, batch {b:>3}: {floors[b]:8.1f} queries/s", flush=True)

    common = ["--batch_window_ms", str(a.batch_window_ms), "--batch_max_wait_ms", str(a.batch_max_wait_ms)]
    servers = {}
    try:
        for mode, extra in (("off", ["--no_batching"]), ("on", [])):
            servers[mode] = start_server_process(index_dir, extra_args=common + extra, timeout_s=300)
        results = {"off": [], "on": []}
        for c in clients:  # both modes at one client count back to back: drifting load hits both alike
            for mode in ("off", "on"):
                before = server_stats(servers[mode][1])
                r = asyncio.run(service_run(servers[mode][1], queries, c, a.topk, a.seconds))
                after = server_stats(servers[mode][1])
                r.update({k: after[k] - before[k] for k in ("batches", "waits")})  # incl. the warm-up round
                results[mode].append(r)
                print(f"service, batching {mode:>3}, {c:>3} clients: {r['qps']:8.1f} queries/s  p50 "
                      f"{r['p50_ms']:7.1f} ms  p99 {r['p99_ms']:7.1f} ms  ({r['requests']} requests, "
                      f"{r['errors']} errors; server: {r['batches']} batches, {r['waits']} waited)", flush=True)
        stats = {mode: server_stats(url) for mode, (_, url) in servers.items()}
    finally:
        for proc, _ in servers.values():
            stop_server_process(proc)
    # the machine is shared: measure the floor again after the service runs and compare with the mean
    again = floor_qps(index, queries, max(clients), a.topk, a.seconds)
    print(f"in-process floor, batch {max(clients):>3}, again: {again:8.1f} queries/s", flush=True)
    floors[max(clients)] = (floors[max(clients)] + again) / 2
    index.close()
    top = results["on"][-1]
    ratio = top["qps"] / floors[max(clients)]
    by_c = {mode: {r["clients"]: r for r in rs} for mode, rs in results.items()}
    lone = min(clients)
    lone_ratio = by_c["on"][lone]["qps"] / by_c["off"][lone]["qps"]
    print(f"server batches (batching on): {stats['on']['batches']} for {stats['on']['requests']} requests "
          f"(largest batch {stats['on']['max_batch_queries_seen']} queries, {stats['on']['waits']} waited)")
    for c in clients:
        print(f"batching on / off at {c:>3} clients: {by_c['on'][c]['qps'] / by_c['off'][c]['qps']:.2f} queries/s")
    print(f"ratio batching on / off at {lone} client(s): {lone_ratio:.2f} (target >= 1.00)")
    print(f"ratio service({top['clients']} clients, batching on) / floor(batch {max(clients)}): {ratio:.2f} "
          "(target >= 0.80)")
    print(json.dumps({"floor": floors, "service": results, "ratio": ratio, "lone_ratio": lone_ratio}))
    if a.write_docs:
        write_docs(a.write_docs, info, floors, results, ratio, lone_ratio, stats["on"], a)
    return 0


def replace_between_markers(path: str, start: str, end: str, body: str) -> None:
    """Rewrite ``path`` with ``body`` between the marker lines ``start`` and ``end`` (both kept; what lay between
    them is dropped). Raises ValueError when a marker is missing (nothing is written then)."""
    text = open(path).read()
    if start not in text or end not in text.split(start, 1)[1]:
        raise ValueError(f"{path}: markers {start} ... {end} not found")
    head, rest = text.split(start, 1)
    tail = rest.split(end, 1)[1]
    with open(path, "w") as f:
        f.write(f"{head}{start}\n{body}\n{end}{tail}")


def write_docs(path, info, floors, results, ratio, lone_ratio, stats, a) -> None:
    """Replace the text between the bench-retriever markers of ``path`` with this run's table."""
    start, end = "<!-- bench-retriever:start -->", "<!-- bench-retriever:end -->"
    big = max(floors)
    lines = [f"`benchmarks/bench_retriever.py --seconds {a.seconds:g}`: {info['encoder']} {info['index_type']} over "
             f"{info['count']:,} passages, top-{a.topk}, single-query requests, OMP_NUM_THREADS="
             f"{os.environ.get('OMP_NUM_THREADS', 'unset')}, {os.cpu_count()} CPU cores shared with the clients "
             "and with other jobs (figures vary by 2x between runs here).", "",
             "| setting | queries/s | p50 (ms) | p99 (ms) |", "| --- | --- | --- | --- |"]
    for b, q in sorted(floors.items()):
        lines.append(f"| in-process floor, batch {b} | {q:.1f} | - | - |")
    for off, on in zip(results["off"], results["on"]):
        for mode, r in (("off", off), ("on", on)):
            lines.append(f"| service, batching {mode}, {r['clients']} clients | {r['qps']:.1f} | {r['p50_ms']:.0f} | "
                         f"{r['p99_ms']:.0f} |")
    top = results["on"][-1]
    lines += ["", f"Batching on / off at {results['on'][0]['clients']} client(s): **{lone_ratio:.2f}** (target 1.00); "
                  f"service at {top['clients']} clients (batching on) / floor at batch {big}: **{ratio:.2f}** "
                  f"(target 0.80); {stats['batches']} server batches for {stats['requests']} requests, largest "
                  f"{stats['max_batch_queries_seen']} queries."]
    replace_between_markers(path, start, end, "\n".join(lines))


if __name__ == "__main__":
    sys.exit(main())
