"""Load time and memory of an adopted faiss Flat index: memory-mapped (``IO_FLAG_MMAP_IFC``, what
``retriever.adopt`` does for Flat / HNSW-Flat) vs read into RAM, on a synthetic index of e5-base-v2's dimension.

    python benchmarks/bench_adopt_load.py [--rows 400000] [--dim 768] [--queries 32] [--workdir /tmp/x]

Each mode runs in a fresh process: load time, private memory added by the load (resident minus file-backed
pages: what the process alone holds; a memory-mapped index's pages are page cache, shared by every process that maps
the file and reclaimable) and resident memory with those pages, then the first and the second
search of ``--queries`` random queries (top-3; a Flat search reads every vector, so the first search after a
memory-mapped load pages the file in unless it is in the page cache already). The file is written just before, so
it is in the page cache: these are warm-cache figures. Prints a JSON line per mode and a Markdown table; wiki-18 (21.0M
passages) figures are scaled linearly from the measured rows and labelled as such.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile

CHILD = r"""
import json, sys, time
import numpy as np, faiss, psutil
path, mode, nq = sys.argv[1], sys.argv[2], int(sys.argv[3])
p = psutil.Process()
m0 = p.memory_info()
rss0, anon0 = m0.rss, m0.rss - m0.shared
t = time.perf_counter()
flags = (faiss.IO_FLAG_MMAP_IFC | faiss.IO_FLAG_READ_ONLY) if mode == "mmap" else 0
index = faiss.read_index(path, flags)
load_s = time.perf_counter() - t
m1 = p.memory_info()
rss_load, anon_load = m1.rss - rss0, (m1.rss - m1.shared) - anon0
q = np.random.default_rng(0).standard_normal((nq, index.d)).astype("float32")
t = time.perf_counter(); index.search(q, 3); first = time.perf_counter() - t
t = time.perf_counter(); index.search(q, 3); second = time.perf_counter() - t
m2 = p.memory_info()
print(json.dumps({"mode": mode, "rows": index.ntotal, "dim": index.d, "load_s": load_s, "rss_after_load_mb":
                  rss_load / 2**20, "rss_after_search_mb": (m2.rss - rss0) / 2**20,
                  "private_after_load_mb": anon_load / 2**20,
                  "private_after_search_mb": ((m2.rss - m2.shared) - anon0) / 2**20,
                  "first_search_s": first, "second_search_s": second}))
"""

WIKI18_ROWS = 21_015_324  # wiki-18 passages (Search-R1's corpus, DPR's 100-word split)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rows", type=int, default=400_000)
    ap.add_argument("--dim", type=int, default=768)
    ap.add_argument("--queries", type=int, default=32)
    ap.add_argument("--workdir", default=None)
    a = ap.parse_args(argv)
    import faiss
    import numpy as np

    work = a.workdir or tempfile.mkdtemp(prefix="bench_adopt_load_")
    os.makedirs(work, exist_ok=True)
    path = os.path.join(work, f"synthetic_Flat_{a.rows}x{a.dim}.index")
    if not os.path.exists(path):
        index = faiss.IndexFlatIP(a.dim)
        rng = np.random.default_rng(0)
        for start in range(0, a.rows, 100_000):
            x = rng.standard_normal((min(100_000, a.rows - start), a.dim)).astype("float32")
            faiss.normalize_L2(x)
            index.add(x)
        faiss.write_index(index, path)
        del index
    size = os.path.getsize(path)
    rows = []
    for mode in ("ram", "mmap"):
        out = subprocess.run([sys.executable, "-c", CHILD, path, mode, str(a.queries)], capture_output=True, text=True,
                             check=True, env={**os.environ, "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "2")})
        r = json.loads(out.stdout.strip().splitlines()[-1])
        r["file_mb"] = size / 2**20
        print(json.dumps(r))
        rows.append(r)
    scale = WIKI18_ROWS / a.rows
    print(f"\n{a.rows:,} x {a.dim} Flat ({size / 2**30:.2f} GiB file), warm page cache, {a.queries} queries top-3:\n")
    print("| placement | load (s) | private memory after load / searches (MiB) | resident incl. page cache after "
          "searches (MiB) | first search (s) | second search (s) | wiki-18 load, scaled (s) |")
    print("| --- | --- | --- | --- | --- | --- | --- |")
    for r in rows:
        private = f"{r['private_after_load_mb']:.0f} / {r['private_after_search_mb']:.0f}"
        print(f"| {r['mode']} | {r['load_s']:.3f} | {private} | {r['rss_after_search_mb']:.0f} | "
              f"{r['first_search_s']:.3f} | {r['second_search_s']:.3f} | {r['load_s'] * scale:.1f} (scaled) |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
