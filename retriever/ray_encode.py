"""Passage encoding over a Ray cluster with Ray Data: the ``--ray`` path of ``python -m retriever.build_index``.

    python -m retriever.build_index --corpus C.jsonl --index_dir D --encoder e5-base-v2 --index_type flat \\
        --ray [--ray_address auto] [--ray_workers N] [--ray_gpus_per_worker 1] [--chunk_size 10000]

The corpus is cut into the same embedding chunks as the single-process path (``retriever.embeddings.encode_corpus``:
``chunk_XXXXXX.npy`` of ``chunk_size`` rows, ``meta.json`` pinning encoder, count and chunking). A Ray Dataset of
the chunks still missing goes through ``map_batches`` with a pool of encoder actors (one per GPU, or per
``cpus_per_worker`` CPUs without GPUs); each actor loads the encoder once, encodes a chunk's passages with the
same ``DenseEncoder`` (same prefixes, batch size, normalisation) and renames the finished chunk into place.
Resumable: a killed job leaves only whole chunks (temporary name, then rename), and the next run encodes only
the chunks that are missing, so it restarts where it stopped. The index (Flat / HNSW / IVF-PQ) is then built from
the chunks exactly as after a single-process encoding.

Shared storage: the actors read ``index_dir/passages.jsonl`` (+ ``offsets.npy``) and write the chunks into the
embeddings folder, so on a multi-node cluster both must be on a filesystem every node mounts (NFS, Lustre, a
FUSE bucket); on one machine any folder works.
"""

from __future__ import annotations

import logging
import os
import time

import numpy as np

from .corpus import PassageStore
from .encoders import DenseEncoder, EncoderSpec, get_encoder
from .embeddings import chunk_done, chunk_ranges, claim_embeddings_dir, embeddings_meta, save_chunk

logger = logging.getLogger(__name__)


class ChunkEncoder:
    """Ray Data actor: encodes whole chunks and writes them (``map_batches`` callable class).

    Input batch: ``{"chunk", "start", "end"}`` int64 arrays (chunk number, first row, end row). Output batch:
    ``{"chunk", "rows", "seconds"}``: what was written and how long the encoding took. Raises whatever the encoder
    raises (Ray Data fails the job; finished chunks stay).
    """

    def __init__(self, spec: dict, passages_path: str, offsets_path: str, emb_dir: str, batch_size: int,
                 device: str | None = None):
        self.encoder = get_encoder(EncoderSpec(**spec), device=device, batch_size=batch_size)
        self.store = PassageStore(passages_path, offsets_path)
        self.emb_dir = emb_dir

    def __call__(self, batch: dict) -> dict:
        rows, seconds = [], []
        for c, start, end in zip(batch["chunk"], batch["start"], batch["end"]):
            t0 = time.perf_counter()
            emb = self.encoder.encode_passages([self.store.get(i)["contents"] for i in range(int(start), int(end))])
            save_chunk(self.emb_dir, int(c), emb)
            rows.append(int(end - start))
            seconds.append(time.perf_counter() - t0)
        return {"chunk": np.asarray(batch["chunk"], dtype=np.int64), "rows": np.asarray(rows, dtype=np.int64),
                "seconds": np.asarray(seconds, dtype=np.float64)}


def _default_workers(gpus_per_worker: float, cpus_per_worker: float) -> int:
    import ray

    res = ray.cluster_resources()
    if gpus_per_worker > 0:
        return max(1, int(res.get("GPU", 0) // gpus_per_worker))
    return max(1, int(res.get("CPU", 1) // max(cpus_per_worker, 1e-9)))


def encode_corpus_ray(store: PassageStore, encoder: DenseEncoder, emb_dir: str, chunk_size: int = 10000,
                      address: str | None = None, workers: int | None = None, gpus_per_worker: float | None = None,
                      cpus_per_worker: float = 1.0, device: str | None = None, stats: dict | None = None) -> int:
    """Encode every passage of ``store`` into ``emb_dir`` chunks with Ray Data actors; returns the dimension.

    Same files and the same resumability as ``retriever.embeddings.encode_corpus`` (either can finish what the other
    started). ``encoder`` (loaded in this process) gives the spec, dimension and batch size; the actors load their
    own copy.

    Args:
        address: Ray cluster to join when Ray is not initialised yet (``auto``, ``HOST:6379``); None starts a
            local Ray, shut down at the end. An already initialised Ray is used as is and left running.
        workers: encoder actors; default one per GPU (``gpus_per_worker``) or per ``cpus_per_worker`` CPUs.
        gpus_per_worker: GPUs per actor; default 1 when the cluster has GPUs, else 0 (CPU encoding).
        device: the actors' encoder device (default: cuda inside a GPU actor, else cpu).
        stats: filled with ``chunks_total``, ``chunks_encoded`` (this run), ``passages_encoded``, ``seconds``,
            ``workers``, ``passages_per_second``.
    Raises:
        retriever.index.RetrieverIndexError: ``emb_dir`` holds embeddings of something else.
        ValueError: workers < 1, negative resources.
    """
    import ray

    if workers is not None and workers < 1:
        raise ValueError(f"workers must be >= 1, got {workers}")
    if (gpus_per_worker is not None and gpus_per_worker < 0) or cpus_per_worker < 0:
        raise ValueError("gpus_per_worker / cpus_per_worker must be >= 0")
    n = len(store)
    claim_embeddings_dir(emb_dir, embeddings_meta(store, encoder.spec, encoder.dim, chunk_size))
    todo = [(c, s, e) for c, s, e in chunk_ranges(n, chunk_size) if not chunk_done(emb_dir, c, e - s, encoder.dim)]
    out = {"chunks_total": len(chunk_ranges(n, chunk_size)), "chunks_encoded": 0, "passages_encoded": 0,
           "seconds": 0.0, "workers": 0}
    if stats is not None:
        stats.update(out)
    if not todo:
        logger.info("all %d embedding chunks already in %s", out["chunks_total"], emb_dir)
        return encoder.dim
    started = not ray.is_initialized()
    if started:
        ray.init(address=address, include_dashboard=False)
    try:
        import ray.data

        if gpus_per_worker is None:
            gpus_per_worker = 1.0 if ray.cluster_resources().get("GPU", 0) > 0 else 0.0
        if workers is None:
            workers = _default_workers(gpus_per_worker, cpus_per_worker)
        workers = min(workers, len(todo))
        logger.info("encoding %d of %d chunks (%d passages) with %d Ray Data worker(s), %s GPU / %s CPU each",
                    len(todo), out["chunks_total"], sum(e - s for _, s, e in todo), workers, gpus_per_worker,
                    cpus_per_worker)
        ctx = ray.data.DataContext.get_current()
        ctx.enable_progress_bars = False
        items = [{"chunk": c, "start": s, "end": e} for c, s, e in todo]
        ds = ray.data.from_items(items, override_num_blocks=len(items)).map_batches(
            ChunkEncoder, batch_size=1, concurrency=workers, num_gpus=gpus_per_worker, num_cpus=cpus_per_worker,
            fn_constructor_kwargs={"spec": encoder.spec.to_dict(), "passages_path": store.jsonl_path,
                                   "offsets_path": store.offsets_path, "emb_dir": os.path.abspath(emb_dir),
                                   "batch_size": encoder.batch_size, "device": device})
        t0 = time.perf_counter()
        for row in ds.iter_rows():  # streams: chunks are on disk as soon as each actor finishes one
            out["chunks_encoded"] += 1
            out["passages_encoded"] += int(row["rows"])
            if out["chunks_encoded"] % max(1, len(todo) // 20) == 0:
                logger.info("encoded %d/%d chunks", out["chunks_encoded"], len(todo))
        out["seconds"] = round(time.perf_counter() - t0, 2)
        out["workers"] = workers
        out["passages_per_second"] = round(out["passages_encoded"] / max(out["seconds"], 1e-9), 2)
    finally:
        if started:
            ray.shutdown()
        if stats is not None:
            stats.update(out)
    missing = [c for c, s, e in chunk_ranges(n, chunk_size) if not chunk_done(emb_dir, c, e - s, encoder.dim)]
    if missing:  # pragma: no cover - Ray Data raises first when an actor fails
        from .index import RetrieverIndexError

        raise RetrieverIndexError(f"{emb_dir}: chunks {missing[:5]} missing after the Ray encoding")
    return encoder.dim
