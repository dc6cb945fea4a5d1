"""benchmarks/sizing.py's figures: the memory formulas against real faiss indexes built the way retriever.index
builds them, and the passages-per-page count against the chunker run on the KILT sample."""

import os
import sys

import numpy as np
import pytest

from tests.conftest import REPO_ROOT, shared_path

sys.path.insert(0, os.path.join(REPO_ROOT, "benchmarks"))
import sizing


@pytest.mark.parametrize("kind", ["flat32", "hnsw", "ivfpq"])
def test_index_memory_formula_matches_a_real_faiss_index(kind):
    import faiss

    from retriever.index import _factory_string

    # 8-bit PQ training takes minutes on this machine's faiss; below 2,560 vectors retriever.index uses smaller
    # codebooks (here 300 vectors -> IVF7,PQ8x4), which the formula takes as pq_nbits
    n, dim = (300, 64) if kind == "ivfpq" else (3000, 64)
    x = np.random.default_rng(0).standard_normal((n, dim)).astype(np.float32)
    factory, params = _factory_string({"flat32": "flat"}.get(kind, kind), n, dim, sizing.HNSW_M, None, None)
    index = faiss.index_factory(dim, factory, faiss.METRIC_INNER_PRODUCT)
    if kind == "ivfpq":
        index.train(x)
    index.add(x)
    real = faiss.serialize_index(index).nbytes
    assert sizing.index_bytes(n, dim, kind, params.get("pq_nbits", 8)) == pytest.approx(real, rel=0.05), (factory, real)


def test_kilt_passages_per_page_come_from_the_chunker():
    from retriever.prepare_corpus import iter_prepared

    path = shared_path("wiki", "kilt_pages_sample99.jsonl")
    s = sizing.kilt_sample_stats(path)
    n = sum(1 for _ in iter_prepared(path, "kilt"))
    assert s["pages"] == 99 and s["passages"] == n
    assert s["per_page_mean"] == pytest.approx(n / 99)
    assert 1 <= s["per_page_median"] <= s["per_page_max"]
    with pytest.raises(ValueError):
        sizing.index_bytes(10, 8, "lsh")
