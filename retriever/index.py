"""Passage indexes: building (dense faiss Flat / HNSW / IVF-PQ, sparse BM25) and loading for search.

An index directory is self-contained; the server needs nothing else::

    manifest.json      encoder, index type, corpus path, passage count, dim, build parameters (written last)
    passages.jsonl     canonical passages {"id","title","text","contents"} in index row order
    offsets.npy        int64 [N+1] byte offsets into passages.jsonl (memory-mapped at serving time)
    index.faiss        dense indexes: faiss index over the passage embeddings (inner product)
    bm25/              BM25 indexes: bm25s matrices + tokenizer vocabulary

Dense encoding is resumable: embeddings go to ``chunk_XXXXXX.npy`` files of ``chunk_size`` rows in the
embeddings folder (``index_dir/embeddings`` unless told otherwise); finished chunks are skipped on restart
(``retriever/embeddings.py``).

In-process API: ``load_index(dir).search(queries, topk)`` -> per query, a list of
``{"id","title","text","contents","score"}`` best first.
"""

from __future__ import annotations

import hashlib
import json
import logging
import math
import os
import time

import numpy as np

from .corpus import DuplicateCounter, PassageStore, iter_passages, normalized_text, write_passage_store
from .encoders import EncoderSpec, get_encoder, resolve_encoder
from .embeddings import encode_corpus, iter_embedding_chunks, train_sample
from .errors import RetrieverIndexError

logger = logging.getLogger(__name__)

INDEX_TYPES = ("flat", "hnsw", "ivfpq", "bm25")
MANIFEST = "manifest.json"
FORMAT_VERSION = 1


# ---------------------------------------------------------------------------------------------- building


FINGERPRINT_FIELDS = ("format_version", "index_type", "encoder", "count", "dim", "limit", "params")


def manifest_fingerprint(manifest: dict) -> str:
    """Identity of what an index serves, 16 hex chars (sha256), reported by ``GET /health`` as ``fingerprint``.

    Hashes the manifest fields that decide the results (:data:`FINGERPRINT_FIELDS`) and the corpus file's base
    name; build times and absolute paths are left out, so the same corpus indexed the same way on two nodes (or
    under two mount points) gets the same fingerprint. Launchers compare it across retriever URLs before a job.
    """
    core = {k: manifest.get(k) for k in FINGERPRINT_FIELDS}
    core["corpus"] = os.path.basename(manifest.get("corpus_path") or "")
    return hashlib.sha256(json.dumps(core, sort_keys=True, default=str).encode()).hexdigest()[:16]


def _store_marker(index_dir: str) -> str:
    return os.path.join(index_dir, "passages.done.json")


def read_store_report(index_dir: str) -> dict:
    """What :func:`prepare_store` recorded about the passage store (count, duplicates); {} when absent."""
    try:
        with open(_store_marker(index_dir)) as f:
            return json.load(f)
    except (OSError, ValueError):
        return {}


def prepare_store(corpus_path: str, index_dir: str, limit: int | None = None, raw_contents: bool = False) -> int:
    """Copy the first ``limit`` passages of ``corpus_path`` (jsonl or jsonl.gz) into the index's passage store
    (skipped if done), counting duplicates on the way.

    A repeated id is refused: results, traces and supporting-passage checks name passages by id, and two passages
    under one id would be silently confused. Repeated passage texts (``corpus.normalized_text``) are allowed, logged
    with their count and recorded in ``passages.done.json`` (``duplicates``; the manifest copies it); the server's
    ``--dedup`` keeps them out of one result list. ``raw_contents``: see ``corpus.iter_passages`` (adoption).

    Returns the number of passages. Raises ``corpus.CorpusError`` on an unreadable row, RetrieverIndexError on
    an empty corpus or a repeated id (one line: how many rows, the first ids and their rows).
    """
    marker = _store_marker(index_dir)
    want = {"corpus_path": os.path.abspath(corpus_path), "limit": limit,
            "corpus_size": os.path.getsize(corpus_path), "corpus_mtime": os.path.getmtime(corpus_path),
            "raw_contents": raw_contents}
    if os.path.exists(marker):
        done = read_store_report(index_dir)
        if all(done.get(k) == v for k, v in want.items()) and "duplicates" in done:
            return int(done["count"])
        os.remove(marker)
    from tqdm import tqdm

    dups = DuplicateCounter()
    n = write_passage_store(dups.wrap(tqdm(iter_passages(corpus_path, limit, raw_contents=raw_contents),
                                           desc="passages", unit="p", mininterval=5)), index_dir)
    if n == 0:
        raise RetrieverIndexError(f"{corpus_path}: no passages")
    store = PassageStore(os.path.join(index_dir, "passages.jsonl"), os.path.join(index_dir, "offsets.npy"))
    try:
        report = dups.report(store.get)
    finally:
        store.close()
    if report["duplicate_id_rows"]:
        ex = "; ".join(f"id {e['id']!r} at rows {', '.join(map(str, e['rows']))}" for e in report["duplicate_ids"][:3])
        raise RetrieverIndexError(f"{corpus_path}: {report['duplicate_id_rows']} of {n} passages repeat an id already "
                                  f"used ({ex}); ids must be unique: give each passage its own id")
    if report["duplicate_text_rows"]:
        logger.warning("%s: %d of %d passages repeat the text of an earlier one (%d texts repeated, the most "
                       "often %d times); serve with --dedup to keep copies out of one result list",
                       corpus_path, report["duplicate_text_rows"], n, report["duplicate_text_groups"],
                       report["largest_duplicate_text_group"])
    with open(marker, "w") as f:
        json.dump({**want, "count": n, "duplicates": report}, f)
    return n


def _ivfpq_params(n: int, dim: int, nlist: int | None, pq_m: int | None) -> tuple[int, int, int]:
    """Cells, sub-quantizers and bits per code for ``n`` vectors: about 4*sqrt(n) cells but at least 39
    training vectors per cell (faiss' k-means rule of thumb), ``m`` dividing ``dim`` at ~8 dims per code,
    and 8 bits unless fewer than 2,560 vectors exist to train the 256-entry PQ codebooks."""
    if nlist is None:
        nlist = max(1, min(int(4 * math.sqrt(n)), n // 39, 65536))
    elif nlist > n:  # faiss' k-means raises a RuntimeError deep in the build otherwise
        raise ValueError(f"nlist={nlist} cells for {n} passages: IVF needs at least one passage per cell")
    if pq_m is None:
        pq_m = next(m for m in range(max(1, dim // 8), 0, -1) if dim % m == 0)
    if dim % pq_m:
        raise ValueError(f"pq_m={pq_m} must divide dim={dim}")
    # 8-bit codebooks need >= ~10 training vectors per centroid; smaller corpora get smaller codebooks
    nbits = 8 if n >= 2560 else max(1, min(8, int(math.log2(max(n, 20) / 10))))
    return nlist, pq_m, nbits


def _factory_string(index_type: str, n: int, dim: int, hnsw_m: int, nlist: int | None,
                    pq_m: int | None) -> tuple[str, dict]:
    if index_type == "flat":
        return "Flat", {}
    if index_type == "hnsw":
        return f"HNSW{hnsw_m}", {"hnsw_m": hnsw_m}
    if index_type == "ivfpq":
        nlist, m, nbits = _ivfpq_params(n, dim, nlist, pq_m)
        return f"IVF{nlist},PQ{m}x{nbits}", {"nlist": nlist, "pq_m": m, "pq_nbits": nbits}
    raise ValueError(f"unknown dense index type {index_type!r}; choose from flat, hnsw, ivfpq")


def build_index(corpus_path: str, index_dir: str, encoder: str = "bm25", index_type: str | None = None,
                limit: int | None = None, embeddings_dir: str | None = None, chunk_size: int = 10000,
                batch_size: int = 64, device: str | None = None, hnsw_m: int = 32,
                ef_construction: int = 200, ef_search: int = 128, nlist: int | None = None,
                pq_m: int | None = None, nprobe: int | None = None, query_prefix: str | None = None,
                passage_prefix: str | None = None, max_seq_length: int | None = None,
                overwrite: bool = False, encode_fn=None) -> dict:
    """Build a self-contained index directory and return its manifest.

    Args:
        corpus_path: passage jsonl in any accepted row form (``retriever.corpus``).
        index_dir: output folder (created). An existing complete index raises unless ``overwrite``.
        encoder: ``bm25``, a dense preset (``e5-base-v2``, ``bge-large-en-v1.5``, ``minilm``) or a model path.
        index_type: ``flat`` (exact inner product), ``hnsw`` (graph, M=hnsw_m), ``ivfpq`` (compressed),
            ``bm25``; default ``bm25`` for the bm25 encoder, else ``flat``.
        limit: index only the first ``limit`` passages.
        embeddings_dir: where the resumable embedding chunks go (share it to build several index types
            from one encoding); default ``index_dir/embeddings``.
        chunk_size: passages per embedding chunk file.
        encode_fn: ``(store, encoder, emb_dir, chunk_size) -> dim`` writing the embedding chunks; default
            ``encode_corpus`` (this process); ``retriever.ray_encode`` gives one encoding over a Ray cluster.
    Raises:
        ValueError: unknown index type, or an encoder/index-type mismatch.
        RetrieverIndexError: existing index without ``overwrite``; embeddings folder made with something else.
        corpus.CorpusError: unreadable corpus row.
    """
    if index_type is None:
        index_type = "bm25" if encoder == "bm25" else "flat"
    if index_type not in INDEX_TYPES:
        raise ValueError(f"unknown index type {index_type!r}; choose from {INDEX_TYPES}")
    if (index_type == "bm25") != (encoder == "bm25"):
        raise ValueError(f"index type {index_type!r} does not go with encoder {encoder!r} "
                         "(bm25 needs --encoder bm25 and --index_type bm25)")
    # before any work: 0 would divide by zero (chunk_size) or abort the process inside faiss (hnsw_m)
    for name, value, least in (("chunk_size", chunk_size, 1), ("batch_size", batch_size, 1), ("hnsw_m", hnsw_m, 2),
                               ("ef_construction", ef_construction, 1), ("ef_search", ef_search, 1),
                               ("nlist", nlist, 1), ("pq_m", pq_m, 1), ("nprobe", nprobe, 1)):
        if value is not None and value < least:
            raise ValueError(f"{name} must be >= {least}, got {value}")
    if index_type != "bm25":  # load the encoder first: a bad name fails now, not after copying the corpus
        # or after --overwrite dropped the old manifest
        spec = resolve_encoder(encoder, query_prefix, passage_prefix, max_seq_length)
        enc = get_encoder(spec, device=device, batch_size=batch_size)
    manifest_path = os.path.join(index_dir, MANIFEST)
    if os.path.exists(manifest_path):
        if not overwrite:
            raise RetrieverIndexError(f"{index_dir} already holds an index (pass overwrite=True / --overwrite)")
        os.remove(manifest_path)
    os.makedirs(index_dir, exist_ok=True)
    t0 = time.time()
    n = prepare_store(corpus_path, index_dir, limit)
    if index_type == "ivfpq":
        _ivfpq_params(n, enc.dim, nlist, pq_m)  # a bad nlist / pq_m fails before hours of encoding
    store = PassageStore(os.path.join(index_dir, "passages.jsonl"), os.path.join(index_dir, "offsets.npy"))
    manifest = {"format_version": FORMAT_VERSION, "index_type": index_type,
                "corpus_path": os.path.abspath(corpus_path), "limit": limit, "count": n,
                "duplicates": read_store_report(index_dir).get("duplicates")}
    try:
        if index_type == "bm25":
            manifest.update(_build_bm25(store, index_dir))
            manifest["encoder"] = {"name": "bm25"}
            manifest["dim"] = None
        else:
            emb_dir = embeddings_dir or os.path.join(index_dir, "embeddings")
            t_enc = time.time()
            dim = (encode_fn or encode_corpus)(store, enc, emb_dir, chunk_size)
            manifest["encode_seconds"] = round(time.time() - t_enc, 2)
            t_idx = time.time()
            params = _build_faiss(emb_dir, n, chunk_size, dim, index_type, index_dir, hnsw_m,
                                  ef_construction, ef_search, nlist, pq_m, nprobe)
            manifest["index_seconds"] = round(time.time() - t_idx, 2)
            manifest.update({"encoder": spec.to_dict(), "dim": dim, "params": params,
                             "embeddings_dir": os.path.abspath(emb_dir)})
    finally:
        store.close()
    manifest["build_seconds"] = round(time.time() - t0, 2)
    manifest["built_at"] = time.strftime("%Y-%m-%dT%H:%M:%S")
    tmp = manifest_path + ".tmp"
    with open(tmp, "w") as f:
        json.dump(manifest, f, indent=2)
    os.replace(tmp, manifest_path)  # the manifest's presence marks a complete index
    return manifest


def _bm25_tokenizer():
    from bm25s.tokenization import Tokenizer

    return Tokenizer(lower=True, stopwords="en", stemmer=None)


def _build_bm25(store: PassageStore, index_dir: str) -> dict:
    """Tokenise every passage's ``contents`` and write the bm25s index to ``index_dir/bm25``.

    bm25s gives a text without tokens (empty, whitespace, stopwords only) the empty-string token by default
    (``allow_empty=True``), and a query without known tokens gets that same token, so a query of unknown
    words or stopwords "matches" every token-less passage (score ~0.37). Here token-less passages get no
    token at all (``allow_empty=False``): they can never be retrieved, and a warning gives their count
    (also recorded as ``params.tokenless_passages`` in the manifest).
    """
    import bm25s

    tok = _bm25_tokenizer()
    n = len(store)
    tokens = tok.tokenize((store.get(i)["contents"] for i in range(n)), length=n, return_as="ids",
                          show_progress=n > 10000, allow_empty=False)
    tokenless = sum(1 for t in tokens if len(t) == 0)
    if tokenless:
        logger.warning("BM25: %d of %d passages have no token after lower-casing and English stopword removal "
                       "(empty, whitespace or stopwords only); no query can retrieve them", tokenless, n)
    model = bm25s.BM25()
    model.index(tokens, show_progress=n > 10000)
    out = os.path.join(index_dir, "bm25")
    model.save(out)
    tok.save_vocab(out)
    tok.save_stopwords(out)
    return {"params": {"k1": model.k1, "b": model.b, "method": model.method, "vocab": len(tok.get_vocab_dict()),
                       "tokenless_passages": tokenless}}


def _build_faiss(emb_dir, n, chunk_size, dim, index_type, index_dir, hnsw_m, ef_construction, ef_search,
                 nlist, pq_m, nprobe) -> dict:
    import faiss

    factory, params = _factory_string(index_type, n, dim, hnsw_m, nlist, pq_m)
    index = faiss.index_factory(dim, factory, faiss.METRIC_INNER_PRODUCT)
    if index_type == "hnsw":
        index.hnsw.efConstruction = ef_construction
        params.update(ef_construction=ef_construction, ef_search=ef_search)
    if index_type == "ivfpq":
        train = train_sample(emb_dir, n, chunk_size, max_train=max(256 * 39, params["nlist"] * 256))
        index.train(train)
        params["nprobe"] = nprobe or min(params["nlist"], 32)
    for chunk in iter_embedding_chunks(emb_dir, n, chunk_size):
        index.add(np.ascontiguousarray(chunk, dtype=np.float32))
    if index.ntotal != n:
        raise RetrieverIndexError(f"faiss index holds {index.ntotal} vectors, expected {n}")
    tmp = os.path.join(index_dir, "index.faiss.tmp")
    faiss.write_index(index, tmp)
    os.replace(tmp, os.path.join(index_dir, "index.faiss"))
    params["factory"] = factory
    return params


# ---------------------------------------------------------------------------------------------- searching


def _check_topk(topk) -> int:
    if isinstance(topk, bool) or not isinstance(topk, (int, np.integer)) or topk < 1:
        raise ValueError(f"topk must be a positive integer, got {topk!r}")
    return int(topk)


class _BaseIndex:
    """Common parts: manifest, passage store, result formatting."""

    def __init__(self, index_dir: str, manifest: dict):
        self.index_dir = index_dir
        self.manifest = manifest
        self.store = PassageStore(os.path.join(index_dir, "passages.jsonl"), os.path.join(index_dir, "offsets.npy"))
        if len(self.store) != manifest["count"]:
            raise RetrieverIndexError(f"{index_dir}: passage store has {len(self.store)} rows, manifest says "
                              f"{manifest['count']}")

    def __len__(self) -> int:
        return len(self.store)

    def _hits(self, rows, scores) -> list[dict]:
        out = []
        for r, s in zip(rows, scores):
            r = int(r)
            if r < 0:  # faiss pads with -1 when fewer than k vectors are reachable
                continue
            p = self.store.get(r)
            p["score"] = float(s)
            out.append(p)
        return out

    def info(self) -> dict:
        """Manifest summary for ``GET /health``."""
        m = self.manifest
        return {"index_dir": os.path.abspath(self.index_dir), "index_type": m["index_type"],
                "encoder": m["encoder"].get("name"), "count": m["count"], "dim": m.get("dim"),
                "corpus_path": m.get("corpus_path"), "params": m.get("params", {}),
                "fingerprint": manifest_fingerprint(m)}

    def search(self, queries: list[str], topk: int) -> list[list[dict]]:  # pragma: no cover - abstract
        raise NotImplementedError

    def close(self) -> None:
        self.store.close()


class DenseIndex(_BaseIndex):
    """faiss index over normalised passage embeddings; ``score`` is the inner product (cosine).

    Args:
        faiss_gpu: move Flat / IVF-PQ indexes to GPUs, fp16, sharded (only if faiss has GPU support and GPUs
            exist; otherwise stays on CPU with a log line). HNSW has no GPU form in faiss.
        gpus / faiss_temp_gb: which GPUs and how much faiss temporary memory (:func:`gpu_plan`; env
            ``RETRIEVER_GPUS`` / ``RETRIEVER_FAISS_TEMP_GB`` when None); the query encoder goes on the first.
        nprobe / ef_search: search-time accuracy knobs overriding the manifest's values.
    """

    def __init__(self, index_dir: str, manifest: dict, device: str | None = None, faiss_gpu: bool = True,
                 nprobe: int | None = None, ef_search: int | None = None, omp_threads: int | None = None,
                 gpus: str | None = None, faiss_temp_gb: float | None = None):
        import faiss

        super().__init__(index_dir, manifest)
        if omp_threads:
            faiss.omp_set_num_threads(omp_threads)
        self.spec = EncoderSpec(**manifest["encoder"])
        plan = None
        if faiss_gpu and manifest["index_type"] in ("flat", "ivfpq", "ivf"):
            ngpu = faiss.get_num_gpus() if hasattr(faiss, "get_num_gpus") else 0
            plan = gpu_plan(ngpu, gpus, faiss_temp_gb)
        if device is None and plan and plan["encoder_device"]:
            device = plan["encoder_device"]  # the query encoder beside the index, not on whatever cuda:0 is
        self.encoder = get_encoder(self.spec, device=device)
        if self.encoder.dim != manifest["dim"]:
            raise RetrieverIndexError(f"encoder {self.spec.model} gives dim {self.encoder.dim}, "
                                      f"index has {manifest['dim']}")
        adopted = manifest.get("adopted")
        self.mmapped = False
        if adopted:  # an index someone else built (retriever.adopt): its own file, memory-mapped where faiss can
            from .faiss_files import read_faiss_index

            path = adopted["faiss_index"]
            size = os.path.getsize(path) if os.path.isfile(path) else None
            if size != adopted["bytes"]:
                raise RetrieverIndexError(f"{index_dir}: adopted faiss index {path} "
                                          f"{'is missing' if size is None else f'has {size} bytes'}, it had "
                                          f"{adopted['bytes']} when verified: adopt it again")
            index, self.mmapped = read_faiss_index(path, mmap=adopted.get("mmap", True))
        else:
            path = os.path.join(index_dir, "index.faiss")
            index = faiss.read_index(path)
        self.faiss_path = path
        params = manifest.get("params", {})
        if manifest["index_type"] == "hnsw":
            faiss.downcast_index(index).hnsw.efSearch = ef_search or params.get("ef_search", 128)
        if manifest["index_type"] in ("ivfpq", "ivf"):
            faiss.extract_index_ivf(index).nprobe = nprobe or params.get("nprobe", 32)
        self.on_gpu = False
        if plan and plan["devices"]:
            index, self.on_gpu = _to_gpus(index, plan)
        self.index = index
        logger.info("loaded faiss index %s (%d vectors) %s", path, index.ntotal,
                    "on GPU" if self.on_gpu else "memory-mapped" if self.mmapped else "in RAM")

    def info(self) -> dict:
        """Manifest summary for ``GET /health``, plus where the vectors are (``placement``: gpu, mmap, ram) and,
        for an adopted index, ``adopted: true`` and ``adopted_from`` (the faiss file served)."""
        out = super().info()
        out["placement"] = "gpu" if self.on_gpu else "mmap" if self.mmapped else "ram"
        out["faiss_index"] = self.faiss_path
        adopted = self.manifest.get("adopted")
        out["adopted"] = bool(adopted)
        if adopted:
            out["adopted_from"] = adopted["faiss_index"]
            out["verification"] = adopted.get("verification")
        return out

    def search_embeddings(self, emb: np.ndarray, topk: int) -> list[list[dict]]:
        """Search with precomputed query embeddings [n, dim] float32."""
        topk = min(_check_topk(topk), len(self))
        scores, rows = self.index.search(np.ascontiguousarray(emb, dtype=np.float32), topk)
        return [self._hits(r, s) for r, s in zip(rows, scores)]

    def search(self, queries: list[str], topk: int) -> list[list[dict]]:
        """Top-``topk`` passages per query, best first: list (len n_queries) of lists of passage dicts with
        ``score``. Raises ValueError on a non-positive ``topk``."""
        _check_topk(topk)
        if not queries:
            return []
        return self.search_embeddings(self.encoder.encode_queries(list(queries)), topk)


DEFAULT_FAISS_TEMP_GB = 1.5  # faiss-gpu's own default cap on a large GPU, set explicitly so the estimate can count it


def gpu_plan(ngpu: int, gpus: str | None = None, temp_gb: float | None = None) -> dict:
    """Where a dense index goes on this host's ``ngpu`` visible GPUs.

    Args:
        gpus: ``RETRIEVER_GPUS`` / ``--gpus``: ``all`` (default: every GPU), ``none`` (CPU), or comma-separated
            device ids (``6,7``: the vLLM GPUs of a split layout, which the launchers choose).
        temp_gb: faiss temporary memory per GPU, GiB (``--faiss_temp_gb``; default :data:`DEFAULT_FAISS_TEMP_GB`).

    Returns ``{"devices": [ids], "temp_memory_bytes": int, "encoder_device": "cuda:<first id>" or None}``; raises
    ValueError (one line) for an id that is not a visible GPU or a malformed list."""
    text = (gpus if gpus is not None else os.environ.get("RETRIEVER_GPUS") or "all").strip().lower()
    if temp_gb is None:
        temp_gb = float(os.environ.get("RETRIEVER_FAISS_TEMP_GB") or DEFAULT_FAISS_TEMP_GB)
    if temp_gb < 0:
        raise ValueError(f"faiss temporary memory must be >= 0 GiB, got {temp_gb}")
    if text in ("none", "cpu", "") or ngpu <= 0:
        devices = []
    elif text == "all":
        devices = list(range(ngpu))
    else:
        try:
            devices = sorted({int(x) for x in text.split(",") if x.strip()})
        except ValueError:
            raise ValueError(f"RETRIEVER_GPUS must be all, none or comma-separated GPU ids, got {gpus!r}") from None
        bad = [d for d in devices if not 0 <= d < ngpu]
        if bad:
            raise ValueError(f"RETRIEVER_GPUS names GPU(s) {bad}, this host has {ngpu} (ids 0..{ngpu - 1})")
    return {"devices": devices, "temp_memory_bytes": int(temp_gb * 2**30),
            "encoder_device": f"cuda:{devices[0]}" if devices else None}


def _to_gpus(index, plan: dict):
    """fp16 copy of ``index`` sharded over ``plan["devices"]`` (:func:`gpu_plan`), each GPU with an explicit faiss
    temporary memory; (index, False) when faiss has no GPU support or the transfer fails."""
    import faiss

    if not hasattr(faiss, "GpuMultipleClonerOptions"):
        return index, False
    try:
        co = faiss.GpuMultipleClonerOptions()
        co.useFloat16 = True  # halves memory: wiki-18 e5 Flat is ~62 GB in fp32
        co.shard = True       # each GPU holds 1/len(devices) of the vectors
        resources = []
        for _ in plan["devices"]:
            res = faiss.StandardGpuResources()
            res.setTempMemory(plan["temp_memory_bytes"])
            resources.append(res)
        logger.info("moving faiss index to GPU(s) %s, fp16, sharded, %.2f GiB temporary memory each",
                    plan["devices"], plan["temp_memory_bytes"] / 2**30)
        gpu_index = faiss.index_cpu_to_gpu_multiple_py(resources, index, co=co, gpus=plan["devices"])
        gpu_index.referenced_objects = resources  # keep the resources alive as long as the index
        return gpu_index, True
    except Exception as e:  # pragma: no cover - a real faiss-gpu failure
        logger.warning("faiss GPU transfer failed (%s); searching on CPU", e)
        return index, False


class BM25Index(_BaseIndex):
    """bm25s sparse index over ``contents``; ``score`` is the BM25 score (Robertson et al.'s Okapi BM25 in
    bm25s' Lucene variant, k1 1.5, b 0.75). Passages sharing no term with the query (score 0) are left out,
    so a query may get fewer than ``topk`` passages, and a query with no known term (unknown words,
    stopwords only) gets none: bm25s' empty-string token is never used for queries, and never matched
    (indexes built before that change index token-less passages under it; see ``_build_bm25``)."""

    def __init__(self, index_dir: str, manifest: dict, mmap: bool = False):
        import bm25s

        super().__init__(index_dir, manifest)
        path = os.path.join(index_dir, "bm25")
        self.model = bm25s.BM25.load(path, mmap=mmap, show_progress=False, verbosity=0)
        self.tokenizer = _bm25_tokenizer()
        self.tokenizer.load_vocab(path)
        self.tokenizer.load_stopwords(path)
        self._empty_id = self.tokenizer.get_vocab_dict().get("")  # only in indexes built with allow_empty=True

    def search(self, queries: list[str], topk: int) -> list[list[dict]]:
        """Top-``topk`` passages per query by BM25, best first (see class docstring). Raises ValueError on
        a non-positive ``topk``."""
        topk = min(_check_topk(topk), len(self))
        if not queries:
            return []
        ids = self.tokenizer.tokenize(list(queries), update_vocab=False, return_as="ids", show_progress=False,
                                      allow_empty=False)
        ids = [[t for t in q if t != self._empty_id] for q in ids]
        with_terms = [i for i, q in enumerate(ids) if q]
        out: list[list[dict]] = [[] for _ in ids]
        if not with_terms:
            return out
        rows, scores = self.model.retrieve([ids[i] for i in with_terms], k=topk, show_progress=False,
                                           n_threads=0)
        for i, r, s in zip(with_terms, rows, scores):
            keep = s > 0
            out[i] = self._hits(r[keep], s[keep])
        return out


class DedupIndex:
    """An index whose result lists never hold two passages with the same text (``corpus.normalized_text``): a
    corpus with copies of a passage (30 copies of one paragraph took 2 of 3 result slots, BM25 and dense alike)
    otherwise spends the model's few result slots on repeats. Each query's search is widened (2x topk, then 4x
    more each round, up to the whole index) until ``topk`` distinct passages are found or none are left; the best
    scoring copy is kept. Server flag ``--dedup``; ``/health`` reports ``dedup`` and ``duplicates_removed``.
    """

    def __init__(self, index):
        self.index = index
        self.removed = 0  # copies left out of result lists so far

    def __len__(self) -> int:
        return len(self.index)

    def search(self, queries: list[str], topk: int) -> list[list[dict]]:
        """As the wrapped index's ``search``, with copies removed (see class docstring)."""
        topk = _check_topk(topk)
        n = len(self.index)
        out: list = [None] * len(queries)
        pending = list(range(len(queries)))
        k = min(n, 2 * topk)
        while pending:
            results = self.index.search([queries[i] for i in pending], k)
            again = []
            for i, hits in zip(pending, results):
                seen, kept, skipped = set(), [], 0
                for h in hits:
                    key = normalized_text(h)
                    if key in seen:
                        skipped += 1
                        continue
                    seen.add(key)
                    kept.append(h)
                    if len(kept) == topk:
                        break
                if len(kept) < topk and len(hits) == k and k < n:  # more distinct passages may lie deeper
                    again.append(i)
                else:
                    self.removed += skipped
                    out[i] = kept
            pending, k = again, min(n, 4 * k)
        return out

    def info(self) -> dict:
        return {**self.index.info(), "dedup": True, "duplicates_removed": self.removed}

    def close(self) -> None:
        self.index.close()

    def __getattr__(self, name):  # store, manifest, encoder ... of the wrapped index
        return getattr(self.index, name)


def read_manifest(index_dir: str) -> dict:
    """The manifest of a complete index. Raises RetrieverIndexError when missing (e.g. an interrupted build)."""
    path = os.path.join(index_dir, MANIFEST)
    if not os.path.exists(path):
        raise RetrieverIndexError(f"{index_dir} has no {MANIFEST}: not an index, or its build did not finish")
    try:
        with open(path) as f:
            m = json.load(f)
    except ValueError as e:
        raise RetrieverIndexError(f"{path} is not valid JSON ({e}): rebuild the index") from e
    if not isinstance(m, dict) or m.get("format_version") != FORMAT_VERSION:
        raise RetrieverIndexError(f"{path}: format_version {m.get('format_version') if isinstance(m, dict) else m} "
                                  f"!= {FORMAT_VERSION}")
    return m


def load_index(index_dir: str, **kwargs):
    """Load a built index directory -> ``DenseIndex`` or ``BM25Index`` with ``search(queries, topk)``.

    ``kwargs`` go to the class (``device``, ``faiss_gpu``, ``gpus``, ``faiss_temp_gb``, ``nprobe``, ``ef_search`` for
    dense; ``mmap`` for
    BM25); unknown ones for the other kind are ignored; ``dedup=True`` wraps the index in :class:`DedupIndex`.
    Raises RetrieverIndexError for a missing/incomplete index.
    """
    m = read_manifest(index_dir)
    dedup = kwargs.pop("dedup", False)
    if m["index_type"] == "bm25":
        index = BM25Index(index_dir, m, **{k: v for k, v in kwargs.items() if k in ("mmap",)})
    else:
        dense_keys = ("device", "faiss_gpu", "nprobe", "ef_search", "omp_threads", "gpus", "faiss_temp_gb")
        index = DenseIndex(index_dir, m, **{k: v for k, v in kwargs.items() if k in dense_keys})
    return DedupIndex(index) if dedup else index
