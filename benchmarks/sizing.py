"""Sizing the retriever for full KILT and wiki-18: passages, index memory, encoding hours, Serve replicas.

    PYTHONPATH=. python benchmarks/sizing.py [--bench_json runs/bench_serve.json | --replica_qps Q]
        [--measure_encode 64] [--write_docs docs/retriever.md]

Measured here:
- passages per page: the 99-page KILT sample (``../shared/data/wiki/kilt_pages_sample99.jsonl``) streamed through
  ``retriever.prepare_corpus.iter_prepared`` (R1-Searcher's 100-word chunker, the one ``prepare_corpus`` runs), and
  the bytes of each canonical passage row in an index's ``passages.jsonl``;
- MiniLM encoding throughput on this machine's CPU (``--measure_encode`` passages of the sample);
- a Serve replica's queries/s: ``benchmarks/bench_serve.py``'s 1-replica figure (``--bench_json``).
Computed (formulas in ``index_bytes``): index memory per type, encoding hours, replicas for a Search-R1 step.
Estimates, marked ``(est.)``: GPU encoding and GPU search throughputs (no GPU was available to measure them).
"""

import argparse
import json
import math
import os
import statistics
import sys
import time

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO)
SHARED = os.path.join(os.path.dirname(REPO), "shared", "data")

# KILT knowledge source pages (2019-08-01 dump): facebookresearch/KILT README.md, "count entries - 5903530"
KILT_PAGES = 5_903_530
WIKI18_PASSAGES = 21_015_324  # DPR / Search-R1 wiki-18 100-word passages (Karpukhin et al. 2020, sec. 4.1)
HNSW_M = 32                   # retriever.index default (--hnsw_m)

# GPU throughputs: ESTIMATES (not measured here; no GPU). Encoding: e5-base-v2 (110M params) in fp16 at ~150
# tokens per 100-word passage is ~2 * 86M * 150 = 26 GFLOP per passage; at ~80 TFLOP/s sustained on an A100/H100
# class GPU that is ~3,000 passages/s; bge-large-en-v1.5 (335M) ~3x the FLOPs -> ~1,000/s.
EST_GPU_ENCODE_PPS = {"e5-base-v2": 3000.0, "bge-large-en-v1.5": 1000.0}
# Search: one GPU replica holding wiki-18 e5 Flat in fp16 (32 GB) answers a batch of 512 queries with 512 x 21M x 768
# x 2 = 16.5 TFLOP, ~0.2 s -> ~2,500 queries/s; 2,000 used.
EST_GPU_REPLICA_QPS = 2000.0
DIMS = {"e5-base-v2": 768, "bge-large-en-v1.5": 1024}


def kilt_sample_stats(path: str) -> dict:
    """Stream the KILT pages through the chunker: passages per page (mean, median, max), bytes per stored row."""
    from retriever.prepare_corpus import iter_prepared

    per_title: dict[str, int] = {}
    row_bytes = []
    pages = 0
    with open(path) as f:
        pages = sum(1 for line in f if line.strip())
    for p in iter_prepared(path, "kilt"):
        per_title[p["title"]] = per_title.get(p["title"], 0) + 1
        row_bytes.append(len(json.dumps(p, ensure_ascii=False).encode("utf-8")) + 1)
    counts = list(per_title.values())
    n = sum(counts)
    return {"pages": pages, "pages_with_passages": len(counts), "passages": n, "per_page_mean": n / pages,
            "per_page_median": statistics.median(counts + [0] * (pages - len(counts))), "per_page_max": max(counts),
            "bytes_per_row": statistics.mean(row_bytes)}


def index_bytes(n: int, dim: int, kind: str, pq_nbits: int = 8) -> float:
    """Memory of a faiss index of ``n`` ``dim``-d vectors, as ``retriever.index`` builds it (bytes).

    flat32: n*dim*4. flat16: n*dim*2 (faiss GPU ``useFloat16``). hnsw: flat32 + level-0 links 2*M int32 per vector +
    upper levels M/(M-1) links per vector on average (faiss' level multiplier 1/ln M) + 12 bytes of offsets and
    levels. ivfpq: codes of dim/8 sub-quantizers x ``pq_nbits`` bits + an int64 id per vector, nlist =
    min(4*sqrt(n), 65536) float32 centroids, 256-entry codebooks. Checked against the 4,858-passage 384-d MiniLM
    indexes measured in docs/retriever.md (Flat 7.12, HNSW 8.37, IVF-PQ 0.82 MiB): these formulas give 7.12, 8.38 and
    0.82 MiB.
    """
    if kind == "flat32":
        return n * dim * 4.0
    if kind == "flat16":
        return n * dim * 2.0
    if kind == "hnsw":
        return n * (dim * 4.0 + (2 * HNSW_M + HNSW_M / (HNSW_M - 1)) * 4 + 12)
    if kind == "ivfpq":
        m = dim // 8
        nlist = max(1, min(int(4 * math.sqrt(n)), n // 39, 65536))
        return n * (math.ceil(m * pq_nbits / 8) + 8.0) + nlist * dim * 4.0 + (2 ** pq_nbits) * dim * 4.0
    raise ValueError(f"unknown index kind {kind!r}")


def measure_cpu_encode(path: str, n: int) -> float:
    """MiniLM passages/s on this machine's CPU over the first ``n`` sample passages (after a warm-up batch)."""
    from retriever.encoders import get_encoder, resolve_encoder
    from retriever.prepare_corpus import iter_prepared

    texts = []
    for p in iter_prepared(path, "kilt"):
        texts.append(p["contents"])
        if len(texts) >= n + 16:
            break
    enc = get_encoder(resolve_encoder("minilm"), batch_size=16)
    enc.encode_passages(texts[:16])
    t0 = time.perf_counter()
    enc.encode_passages(texts[16:16 + n])
    return n / (time.perf_counter() - t0)


def fmt_bytes(b: float) -> str:
    return f"{b / 2**30:,.0f} GiB" if b >= 2**30 else f"{b / 2**20:,.0f} MiB"


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--kilt_sample", default=os.path.join(SHARED, "wiki", "kilt_pages_sample99.jsonl"))
    p.add_argument("--bench_json", default=os.path.join(REPO, "runs", "bench_serve.json"),
                   help="benchmarks/bench_serve.py --json_out file (its 1-replica queries/s)")
    p.add_argument("--replica_qps", type=float, default=None,
                   help="measured replica queries/s (instead of --bench_json)")
    p.add_argument("--measure_encode", type=int, default=64, help="MiniLM CPU passages to time (0: skip)")
    p.add_argument("--prompts", type=int, default=512)
    p.add_argument("--samples", type=int, default=5)
    p.add_argument("--searches", type=int, default=4)
    p.add_argument("--budgets", default="10,30,60", help="seconds of retrieval per rollout step")
    p.add_argument("--write_docs", default=None)
    a = p.parse_args(argv)
    measured_from = None
    if a.replica_qps is None:
        if not os.path.exists(a.bench_json):
            p.error(f"no --replica_qps and no {a.bench_json}: run benchmarks/bench_serve.py --json_out {a.bench_json}")
        with open(a.bench_json) as f:
            bench = json.load(f)
        a.replica_qps = bench["serve"]["1"]["qps"]
        ix = bench["index"]
        measured_from = (f"bench_serve.py {bench['date']}: Serve, 1 replica, {ix['encoder']} {ix['type']} over "
                         f"{ix['count']:,} passages, {bench['cpus']} shared CPU cores")
    if a.replica_qps <= 0:
        p.error("--replica_qps must be > 0")

    s = kilt_sample_stats(a.kilt_sample)
    print(f"KILT sample: {s['pages']} pages -> {s['passages']} passages: {s['per_page_mean']:.2f} per page (median "
          f"{s['per_page_median']:g}, max {s['per_page_max']}); {s['bytes_per_row']:.0f} bytes per stored passage row")
    cpu_pps = measure_cpu_encode(a.kilt_sample, a.measure_encode) if a.measure_encode > 0 else None
    if cpu_pps:
        print(f"MiniLM on this CPU: {cpu_pps:.1f} passages/s ({a.measure_encode} passages, {os.cpu_count()} cores, "
              f"load average {os.getloadavg()[0]:.1f})")

    corpora = [("KILT, sample rate (upper bound)", round(KILT_PAGES * s["per_page_mean"])),
               ("KILT, at wiki-18's density (assumed)", WIKI18_PASSAGES),
               ("wiki-18 (DPR 100-word passages)", WIKI18_PASSAGES)]
    lines = [f"Passages per KILT page, measured: **{s['per_page_mean']:.2f}** (99 sample pages -> {s['passages']:,} "
             f"passages; median {s['per_page_median']:g}, max {s['per_page_max']}). The sample is the first 99 pages "
             "of the dump, old and long articles (A, Autism, Anarchism, Academy Awards ...), so 5.9M pages x this rate "
             "is an upper bound; wiki-18's 100-word split of a 2018 dump of comparable size holds 21.0M passages "
             f"(about {WIKI18_PASSAGES / KILT_PAGES:.1f} per page), the likelier size for KILT too.", ""]
    for enc, dim in DIMS.items():
        lines += [f"**{enc}** ({dim} d). Index memory (formulas in `benchmarks/sizing.py`, checked against the "
                  "measured small indexes); encoding at an estimated "
                  f"{EST_GPU_ENCODE_PPS[enc]:,.0f} passages/s per GPU (est.).", "",
                  "| corpus | passages | passage store | Flat fp32 | Flat fp16 (GPU) | HNSW32 | IVF-PQ | "
                  "encode GPU-hours (est.) |",
                  "| --- | --- | --- | --- | --- | --- | --- | --- |"]
        for name, n in corpora:
            if enc != "e5-base-v2" and name.startswith("KILT, sample"):
                continue
            row = (f"| {name} | {n / 1e6:,.1f}M | {fmt_bytes(n * (s['bytes_per_row'] + 8))} | "
                   f"{fmt_bytes(index_bytes(n, dim, 'flat32'))} | {fmt_bytes(index_bytes(n, dim, 'flat16'))} | "
                   f"{fmt_bytes(index_bytes(n, dim, 'hnsw'))} | {fmt_bytes(index_bytes(n, dim, 'ivfpq'))} | "
                   f"{n / EST_GPU_ENCODE_PPS[enc] / 3600:,.1f} |")
            lines.append(row)
        lines.append("")
    lines += ["Index memory formulas reproduce the measured 4,858-passage MiniLM indexes (Flat 7.12, HNSW 8.38, IVF-PQ "
              "0.82 MiB); wiki-18 e5 Flat fp32 = 21.0M x 768 x 4 B = 64.6 GB (60 GiB), the ~62 GB Search-R1's users "
              "report (its issues #54, #57). The passage store (`passages.jsonl`, measured bytes per row) is "
              "memory-mapped: page cache, not process memory. HNSW has no GPU form in faiss; IVF-PQ (m = dim/8, "
              "8-bit codes) fits one GPU or a small CPU node but loses recall (Retrieval quality, above).", ""]
    if cpu_pps:
        lines += [f"CPU encoding, measured: MiniLM (384 d, 6 layers, much lighter than e5) ran at {cpu_pps:.1f} "
                  f"passages/s on this machine's {os.cpu_count()} shared cores (load average "
                  f"{os.getloadavg()[0]:.1f}); 21.0M "
                  f"passages would take {WIKI18_PASSAGES / cpu_pps / 3600:,.0f} hours: dense encoding of full "
                  "Wikipedia is a GPU job, which `build_index --ray` spreads over every GPU of the cluster "
                  "(hours / number of GPUs).", ""]
    per_step = a.prompts * a.samples * a.searches
    budgets = [float(b) for b in a.budgets.split(",")]
    lines += [f"Serve replicas for one Search-R1 rollout step: {a.prompts} prompts x {a.samples} samples x up to "
              f"{a.searches} searches = **{per_step:,} queries** (in {a.searches} turns of up to "
              f"{a.prompts * a.samples:,}), replicas = ceil(queries / (replica queries/s x seconds of retrieval "
              "allowed per step)).", "",
              "| replica | queries/s per replica | " + " | ".join(f"replicas for {b:g} s" for b in budgets) + " |",
              "| --- | --- | " + " | ".join("---" for _ in budgets) + " |"]
    for name, qps in ((f"measured: {measured_from or 'given --replica_qps'}", a.replica_qps),
                      ("estimate: 1 GPU, wiki-18 e5 Flat fp16 (est.)", EST_GPU_REPLICA_QPS)):
        replicas = (str(math.ceil(per_step / (qps * b))) for b in budgets)
        lines.append(f"| {name} | {qps:,.0f} | " + " | ".join(replicas) + " |")
    lines += ["", "The measured replica is a small CPU index: a 21M-passage index answers more slowly per query on CPU "
              "(BM25 and Flat cost grow with the corpus), which is why the GPU Flat row is the one to plan with; "
              "measure it with `benchmarks/bench_serve.py --index_dir YOUR_INDEX` on the cluster before sizing."]
    text = "\n".join(lines)
    print(text)
    if a.write_docs:
        from bench_retriever import replace_between_markers

        when = time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())
        cmd = f"`benchmarks/sizing.py --measure_encode {a.measure_encode}` ({when})"
        replace_between_markers(a.write_docs, "<!-- sizing:start -->", "<!-- sizing:end -->", f"{cmd}:\n\n{text}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
