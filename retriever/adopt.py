"""Adopt a faiss index someone else built (Search-R1's ``e5_Flat.index`` / ``e5_HNSW64.index``, FlashRAG's indexes)
and its jsonl corpus as an index directory, without re-encoding the corpus.

    python -m retriever.build_index --corpus wiki-18.jsonl --index_dir indexes/wiki18_e5_flat \\
        --encoder e5-base-v2 --faiss_index e5_Flat.index

Writes the passage store (``passages.jsonl`` + ``offsets.npy``, each row's ``contents`` kept byte for byte) and a
``manifest.json`` pointing at the given index file, which stays where it is (nothing is copied: wiki-18's e5 Flat is
~62 GB). The server then loads it like any index of ours, memory-mapped where faiss can (``IO_FLAG_MMAP_IFC``: Flat
and HNSW-Flat vectors stay in the page cache, not in the process).

Before the manifest is written the index is verified against the corpus and the encoder (:func:`verify_index`):
row count, dimension, inner-product metric, then a random sample of passages is re-encoded the way the publishers
encoded them (Search-R1's ``search_r1/search/index_builder.py:201-234`` and FlashRAG's builder encode each row's
``contents`` string as it is, with the encoder's passage prefix, its pooling and L2 normalisation) and compared with
the stored vectors. A failed check is refused with one line naming the check and by how much.
"""

from __future__ import annotations

import json
import logging
import os
import time

import numpy as np

from .corpus import PassageStore, normalized_text
from .encoders import get_encoder, resolve_encoder
from .errors import AdoptionError, RetrieverIndexError
from .faiss_files import base_index, exact_storage, index_kind, read_faiss_index
from .index import FORMAT_VERSION, MANIFEST, prepare_store, read_store_report

logger = logging.getLogger(__name__)


def _metric_name(metric: int) -> str:
    import faiss

    return {faiss.METRIC_INNER_PRODUCT: "inner product", faiss.METRIC_L2: "L2"}.get(metric, f"metric {metric}")


def verify_index(index, store: PassageStore, encoder, sample: int = 64, seed: int = 0, min_cosine: float = 0.99,
                 min_rank1: float = 1.0) -> dict:
    """Check that ``index`` holds ``encoder``'s vectors of ``store``'s passages, in the store's order.

    Checks, in order (the first failure raises):
      1. row count: ``index.ntotal == len(store)``;
      2. dimension: ``index.d == encoder.dim``;
      3. metric: inner product (the encoder's scores are cosines of normalised vectors);
      4. encoding: ``sample`` random rows (``seed``) re-encoded from their ``contents`` with the passage prefix.
         Flat / HNSW-Flat: each re-encoded vector's cosine to ``index.reconstruct(row)`` must be >= ``min_cosine``
         (the publisher's fp16 GPU encoding differs from fp32 by ~1e-3); a sampled passage whose vector is found at
         another row is reported as a corpus in another order. Other index types (IVF, PQ: no exact vectors): each
         re-encoded vector searched in the index must find its own row (or a passage with the same text) at rank 1,
         in at least ``min_rank1`` of the sample.
    Returns:
        what was checked and measured (the manifest's ``adopted.verification``).
    Raises:
        AdoptionError: one line naming the failed check and by how much.
    """
    import faiss

    n = len(store)
    if index.ntotal != n:
        diff = index.ntotal - n
        raise AdoptionError(f"row count: the index holds {index.ntotal:,} vectors, the corpus {n:,} passages "
                            f"({abs(diff):,} {'more' if diff > 0 else 'fewer'} in the index): not this corpus's index")
    if index.d != encoder.dim:
        raise AdoptionError(f"dimension: the index's vectors have {index.d} dims, encoder {encoder.spec.name} gives "
                            f"{encoder.dim}: another encoder built this index")
    if index.metric_type != faiss.METRIC_INNER_PRODUCT:
        raise AdoptionError(f"metric: the index ranks by {_metric_name(index.metric_type)}, the encoder's scores are "
                            "inner products (rebuild it with faiss.METRIC_INNER_PRODUCT)")
    k = min(int(sample), n)
    if k < 1:
        raise ValueError(f"verify sample must be >= 1, got {sample}")
    rows = np.sort(np.random.default_rng(seed).choice(n, size=k, replace=False))
    passages = [store.get(int(r)) for r in rows]
    emb = encoder.encode_passages([p["contents"] for p in passages])
    out = {"sample": k, "seed": seed, "rows": [int(r) for r in rows[:8]]}
    _, top = index.search(emb, 1)
    top = top[:, 0]
    if exact_storage(index):
        stored = np.stack([index.reconstruct(int(r)) for r in rows]).astype(np.float32)
        norms = np.linalg.norm(stored, axis=1)
        cos = (emb * stored).sum(1) / np.maximum(norms * np.linalg.norm(emb, axis=1), 1e-12)
        out.update(method="reconstruct", min_cosine_required=min_cosine, median_cosine=round(float(np.median(cos)), 5),
                   min_cosine=round(float(cos.min()), 5), median_norm=round(float(np.median(norms)), 4))
        bad = np.flatnonzero(cos < min_cosine)
        if len(bad):
            moved = [i for i in bad if top[i] >= 0 and top[i] != rows[i]
                     and float(np.dot(emb[i], index.reconstruct(int(top[i])))) >= min_cosine * norms[i]]
            if len(moved) >= len(bad) / 2:
                i = moved[0]
                raise AdoptionError(f"corpus order: {len(moved)} of {k} sampled passages are stored at another row "
                                    f"(row {int(rows[i])}'s passage is vector {int(top[i])}): the corpus is not in the "
                                    "index's order (shuffled, filtered or another version)")
            raise AdoptionError(f"encoding: {len(bad)} of {k} sampled passages re-encoded with {encoder.spec.name} "
                                f"(passage prefix {encoder.spec.passage_prefix!r}) differ from the stored vectors: "
                                f"cosine median {np.median(cos):.3f}, min {cos.min():.3f}, need >= {min_cosine} "
                                "(another encoder, pooling or prefix, or another corpus order)")
        if encoder.spec.normalize and not np.allclose(norms, 1.0, atol=0.02):
            raise AdoptionError(f"encoding: stored vectors have norms {norms.min():.3f}..{norms.max():.3f}, the "
                                "encoder normalises to 1: inner products would not be the encoder's scores")
    else:
        hit = np.array([top[i] == rows[i] or (top[i] >= 0 and normalized_text(store.get(int(top[i]))) ==
                                               normalized_text(passages[i])) for i in range(k)])
        rate = float(hit.mean())
        out.update(method="self_retrieval", rank1=round(rate, 4), min_rank1_required=min_rank1)
        if rate < min_rank1:
            raise AdoptionError(f"encoding: {int((~hit).sum())} of {k} sampled passages re-encoded with "
                                f"{encoder.spec.name} do not retrieve themselves at rank 1 ({rate:.1%}, need "
                                f">= {min_rank1:.0%}): another encoder, pooling, prefix or corpus order")
    return out


def adopt_index(corpus_path: str, index_dir: str, faiss_index: str, encoder: str, query_prefix: str | None = None,
                passage_prefix: str | None = None, max_seq_length: int | None = None, device: str | None = None,
                batch_size: int = 64, verify_sample: int = 64, verify_seed: int = 0, min_cosine: float = 0.99,
                min_rank1: float = 1.0, mmap: bool = True, overwrite: bool = False) -> dict:
    """Make ``index_dir`` serve ``faiss_index`` over ``corpus_path`` (jsonl / jsonl.gz) with ``encoder``; returns the
    manifest.

    The faiss file is not copied; the manifest records its absolute path, size and modification time, and loading
    refuses a file that changed since. The passage store keeps each row's ``contents`` as published. Verification:
    :func:`verify_index` (``verify_sample`` rows, ``min_cosine`` / ``min_rank1``). ``mmap``: load memory-mapped
    where faiss can (:func:`read_faiss_index`).

    Raises:
        AdoptionError: a failed check (no manifest is written, so nothing serves the index).
        RetrieverIndexError: ``index_dir`` already holds an index and not ``overwrite``; a repeated passage id.
        ValueError: ``encoder`` is not a dense encoder or cannot be loaded.
        corpus.CorpusError: an unreadable corpus row.
    """
    spec = resolve_encoder(encoder, query_prefix, passage_prefix, max_seq_length)
    enc = get_encoder(spec, device=device, batch_size=batch_size)
    faiss_index = os.path.abspath(faiss_index)
    index, mmapped = read_faiss_index(faiss_index, mmap=mmap)
    manifest_path = os.path.join(index_dir, MANIFEST)
    if os.path.exists(manifest_path):
        if not overwrite:
            raise RetrieverIndexError(f"{index_dir} already holds an index (pass overwrite=True / --overwrite)")
        os.remove(manifest_path)
    os.makedirs(index_dir, exist_ok=True)
    t0 = time.time()
    n = prepare_store(corpus_path, index_dir, raw_contents=True)
    store = PassageStore(os.path.join(index_dir, "passages.jsonl"), os.path.join(index_dir, "offsets.npy"))
    try:
        t_v = time.time()
        verification = verify_index(index, store, enc, sample=verify_sample, seed=verify_seed,
                                    min_cosine=min_cosine, min_rank1=min_rank1)
        verification["seconds"] = round(time.time() - t_v, 2)
    finally:
        store.close()
    import faiss

    kind = index_kind(index)
    base = base_index(index)
    st = os.stat(faiss_index)
    params = {"faiss_class": type(base).__name__, "source_file": os.path.basename(faiss_index),
              "source_bytes": st.st_size}
    if kind == "hnsw":
        params["ef_search"] = int(base.hnsw.efSearch)
        params["hnsw_m"] = int(base.hnsw.nb_neighbors(1))
    if kind == "ivf":
        params["nprobe"] = int(faiss.extract_index_ivf(index).nprobe)
        params["nlist"] = int(faiss.extract_index_ivf(index).nlist)
    manifest = {"format_version": FORMAT_VERSION, "index_type": kind, "corpus_path": os.path.abspath(corpus_path),
                "limit": None, "count": n, "duplicates": read_store_report(index_dir).get("duplicates"),
                "encoder": spec.to_dict(), "dim": int(index.d), "params": params,
                "adopted": {"faiss_index": faiss_index, "bytes": st.st_size, "mtime": st.st_mtime, "mmap": mmapped,
                            "verification": verification},
                "build_seconds": round(time.time() - t0, 2), "built_at": time.strftime("%Y-%m-%dT%H:%M:%S")}
    tmp = manifest_path + ".tmp"
    with open(tmp, "w") as f:
        json.dump(manifest, f, indent=2)
    os.replace(tmp, manifest_path)
    logger.info("adopted %s (%s, %d vectors, %s) over %s: verified by %s", faiss_index, params["faiss_class"], n,
                "memory-mapped" if mmapped else "in RAM", corpus_path, verification["method"])
    return manifest
