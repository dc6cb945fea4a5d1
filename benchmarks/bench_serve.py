"""Ray Serve retriever (1 and 2 replicas) vs the plain server: queries/s and latency, same index, one run.

    PYTHONPATH=. python benchmarks/bench_serve.py [--index_dir D | --corpus C --encoder bm25 --limit N]
        [--clients 32] [--seconds 8] [--json_out runs/bench_serve.json] [--write_docs docs/retriever.md]

What it measures, in this order, all on this machine:
1. the plain server (``python -m retriever.server``), N concurrent clients each sending one single-query
   ``POST /retrieve`` after another (``bench_retriever.service_run``, what rollout workers do), ``--seconds``;
2. a local Ray (``num_cpus`` = this machine's cores) running ``retriever.serve``'s application with 1 replica, then
   with 2 replicas (each ``cores / replicas`` CPUs), the same load through Serve's HTTP proxy;
3. the plain server again (the machine is shared: the plain figure is the mean of both runs).
Printed: queries/s, p50 and p99 per setting and each Serve setting's ratio to the plain server. Server, Ray's
proxy, replicas and clients all share the cores: on a small machine a second replica cannot add compute, and the
proxy hop is a cost the plain server does not pay; on a cluster each replica brings its own cores or GPU.
"""

import argparse
import asyncio
import json
import os
import sys
import time

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO)
sys.path.insert(0, os.path.join(REPO, "benchmarks"))
SHARED = os.path.join(os.path.dirname(REPO), "shared", "data")

from bench_retriever import load_queries, replace_between_markers, service_run  # noqa: E402  (the same load generator as the plain bench)


def _line(name: str, r: dict, base: float | None) -> str:
    ratio = f"  x{r['qps'] / base:.2f} of plain" if base else ""
    return (f"{name:<22} {r['qps']:8.1f} queries/s  p50 {r['p50_ms']:7.1f} ms  p99 {r['p99_ms']:7.1f} ms  "
            f"({r['requests']} requests, {r['errors']} errors){ratio}")


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--index_dir", default=None, help="an existing index; else one is built from --corpus")
    p.add_argument("--corpus", default=os.path.join(SHARED, "wiki", "hotpotqa_dev500_paragraphs.jsonl"))
    p.add_argument("--encoder", default="bm25")
    p.add_argument("--limit", type=int, default=None)
    p.add_argument("--workdir", default=os.path.join(REPO, "runs", "retriever"))
    p.add_argument("--questions", default=os.path.join(SHARED, "qa", "with_paragraphs", "hotpotqa_dev500_ircot.jsonl"))
    p.add_argument("--clients", type=int, default=32)
    p.add_argument("--seconds", type=float, default=8.0, help="per measurement")
    p.add_argument("--topk", type=int, default=3)
    p.add_argument("--replicas", default="1,2", help="Serve replica counts to measure")
    p.add_argument("--json_out", default=None, help="write the figures here (benchmarks/sizing.py reads them)")
    p.add_argument("--write_docs", default=None, help="replace the table between markers in this markdown file")
    a = p.parse_args(argv)
    if a.clients < 1 or a.seconds <= 0:
        p.error("--clients must be >= 1 and --seconds > 0")
    replica_counts = [int(x) for x in a.replicas.split(",")]

    from retriever.launch import ensure_index, start_server_process, stop_server_process

    index_dir = a.index_dir or ensure_index(a.corpus, a.workdir, encoder=a.encoder, limit=a.limit)
    with open(os.path.join(index_dir, "manifest.json")) as f:
        m = json.load(f)
    queries = load_queries(a.questions, 2000)
    cpus = os.cpu_count()
    print(f"index: {m['index_type']} / {m['encoder'].get('name')} / {m['count']} passages ({index_dir}); "
          f"{a.clients} clients, {a.seconds:g} s each, {cpus} CPUs; load average {os.getloadavg()[0]:.1f}", flush=True)
    t_start = time.time()

    def plain() -> dict:
        proc, url = start_server_process(index_dir, timeout_s=300)
        try:
            return asyncio.run(service_run(url, queries, a.clients, a.topk, a.seconds))
        finally:
            stop_server_process(proc)

    plain1 = plain()
    print(_line("plain server", plain1, None), flush=True)

    import ray
    from ray import serve

    from retriever.serve import _free_port, build_application, deploy

    served = {}
    ray.init(num_cpus=cpus, include_dashboard=False, log_to_driver=False)
    try:
        port = _free_port("127.0.0.1")
        for n in replica_counts:
            t0 = time.perf_counter()
            app = build_application(index_dir, replicas=n, replica_cpus=cpus / n)
            url = deploy(app, port=port, app_name="bench")
            up = time.perf_counter() - t0
            r = asyncio.run(service_run(url, queries, a.clients, a.topk, a.seconds))
            r["deploy_seconds"] = round(up, 1)
            served[n] = r
            print(_line(f"Serve, {n} replica(s)", r, plain1["qps"]) + f"  [deployed in {up:.0f} s]", flush=True)
            serve.delete("bench")
    finally:
        try:
            serve.shutdown()
        finally:
            ray.shutdown()
    plain2 = plain()
    print(_line("plain server, again", plain2, None), flush=True)
    base = {"qps": (plain1["qps"] + plain2["qps"]) / 2, "p50_ms": (plain1["p50_ms"] + plain2["p50_ms"]) / 2,
            "p99_ms": (plain1["p99_ms"] + plain2["p99_ms"]) / 2}
    for n, r in served.items():
        print(f"Serve {n} replica(s) / plain (mean of both runs): {r['qps'] / base['qps']:.2f} queries/s, "
              f"p99 x{r['p99_ms'] / base['p99_ms']:.2f}")
    out = {"index": {"type": m["index_type"], "encoder": m["encoder"].get("name"), "count": m["count"]},
           "clients": a.clients, "seconds": a.seconds, "cpus": cpus, "plain": [plain1, plain2], "plain_mean": base,
           "serve": {str(n): r for n, r in served.items()}, "wall_seconds": round(time.time() - t_start, 1),
           "load_average_end": round(os.getloadavg()[0], 1), "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())}
    print(json.dumps(out))
    if a.json_out:
        os.makedirs(os.path.dirname(os.path.abspath(a.json_out)), exist_ok=True)
        with open(a.json_out, "w") as f:
            json.dump(out, f, indent=2)
    if a.write_docs:
        write_docs(a.write_docs, out, a)
    return 0


def write_docs(path: str, out: dict, a) -> None:
    """Replace the text between the bench-serve markers of ``path`` with this run's table."""
    start, end = "<!-- bench-serve:start -->", "<!-- bench-serve:end -->"
    base = out["plain_mean"]
    ix = out["index"]
    lines = [f"`benchmarks/bench_serve.py --clients {a.clients} --seconds {a.seconds:g}` ({out['date']}): "
             f"{ix['encoder']} {ix['type']} over {ix['count']:,} passages, top-{a.topk}, single-query requests from "
             f"{a.clients} concurrent clients; one local Ray, {out['cpus']} CPU cores shared by the server, Ray's "
             f"proxy, the replicas, the clients and other jobs (load average "
             f"{out['load_average_end']} at the end), {out['wall_seconds']:.0f} s in all.", "",
             "| setting | queries/s | p50 (ms) | p99 (ms) | queries/s vs plain |", "| --- | --- | --- | --- | --- |"]
    for i, r in enumerate(out["plain"]):
        lines.append(f"| plain server{' (again, after Serve)' if i else ''} | {r['qps']:.1f} | {r['p50_ms']:.0f} | "
                     f"{r['p99_ms']:.0f} | {r['qps'] / base['qps']:.2f} |")
    for n, r in out["serve"].items():
        lines.append(f"| Ray Serve, {n} replica{'s' if n != '1' else ''} | {r['qps']:.1f} | {r['p50_ms']:.0f} | "
                     f"{r['p99_ms']:.0f} | {r['qps'] / base['qps']:.2f} |")
    replace_between_markers(path, start, end, "\n".join(lines))


if __name__ == "__main__":
    sys.exit(main())
