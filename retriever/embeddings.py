"""Resumable dense embeddings of a corpus: ``chunk_XXXXXX.npy`` files of ``chunk_size`` rows in an embeddings folder,
pinned by its ``meta.json`` (encoder, passage count, chunk size). Written by :func:`encode_corpus` here or by
``retriever.ray_encode.encode_corpus_ray`` (same files, so either finishes what the other started); read by
``retriever.index.build_index``.
"""

from __future__ import annotations

import json
import os

import numpy as np

from .corpus import PassageStore
from .encoders import DenseEncoder, EncoderSpec
from .errors import RetrieverIndexError


def embeddings_meta(store: PassageStore, spec: EncoderSpec, dim: int, chunk_size: int) -> dict:
    """What ``emb_dir/meta.json`` pins: encoder spec, passage count, chunk size, dim, first and last passage id."""
    n = len(store)
    return {"encoder": spec.to_dict(), "count": n, "chunk_size": chunk_size, "dim": dim,
            "first_id": store.get(0)["id"], "last_id": store.get(n - 1)["id"]}


def claim_embeddings_dir(emb_dir: str, meta: dict) -> None:
    """Create ``emb_dir`` and write ``meta.json``, or check that an existing one equals ``meta``.

    Raises RetrieverIndexError when the folder holds embeddings of another corpus/encoder/chunking.
    """
    os.makedirs(emb_dir, exist_ok=True)
    meta_path = os.path.join(emb_dir, "meta.json")
    if os.path.exists(meta_path):
        with open(meta_path) as f:
            old = json.load(f)
        if old != meta:
            raise RetrieverIndexError(f"{emb_dir} holds embeddings of another corpus/encoder/chunking "
                                      f"({old}); use a fresh --embeddings_dir")
    else:
        with open(meta_path, "w") as f:
            json.dump(meta, f)


def chunk_path(emb_dir: str, c: int) -> str:
    """``emb_dir/chunk_XXXXXX.npy``: rows ``[c * chunk_size, min(n, (c + 1) * chunk_size))``."""
    return os.path.join(emb_dir, f"chunk_{c:06d}.npy")


def chunk_ranges(n: int, chunk_size: int) -> list[tuple[int, int, int]]:
    """(chunk number, first row, end row) of every chunk of ``n`` rows."""
    return [(c, c * chunk_size, min(n, (c + 1) * chunk_size)) for c in range((n + chunk_size - 1) // chunk_size)]


def chunk_done(emb_dir: str, c: int, rows: int, dim: int) -> bool:
    """True when chunk ``c`` exists with shape [rows, dim] (chunks are renamed into place only when complete)."""
    path = chunk_path(emb_dir, c)
    return os.path.exists(path) and np.load(path, mmap_mode="r").shape == (rows, dim)


def save_chunk(emb_dir: str, c: int, emb: np.ndarray) -> None:
    """Write chunk ``c`` under a temporary name, then rename: a killed writer never leaves a truncated chunk."""
    path = chunk_path(emb_dir, c)
    tmp = path[:-4] + f".tmp{os.getpid()}.npy"
    np.save(tmp, emb)
    os.replace(tmp, path)


def encode_corpus(store: PassageStore, encoder: DenseEncoder, emb_dir: str, chunk_size: int = 10000) -> int:
    """Encode every passage's ``contents`` into ``emb_dir/chunk_XXXXXX.npy`` ([rows, dim] float32 each).

    Resumable: a chunk file that exists with the expected shape is skipped; each chunk is written under a
    temporary name and renamed, so a killed run never leaves a truncated chunk. ``emb_dir/meta.json``
    pins the encoder, passage count and chunk size; reusing a folder made with others raises RetrieverIndexError.
    Returns the embedding dimension. (``retriever.ray_encode.encode_corpus_ray`` is the same over a Ray cluster.)
    """
    from tqdm import tqdm

    n = len(store)
    claim_embeddings_dir(emb_dir, embeddings_meta(store, encoder.spec, encoder.dim, chunk_size))
    bar = tqdm(total=n, desc="encoding", unit="p", mininterval=1)
    # Progress per group of encoder batches, not per chunk: a 10,000-passage chunk is ~5 minutes of MiniLM on 2 CPU
    # cores, which must not pass in silence.
    step = max(1, 4 * int(getattr(encoder, "batch_size", 64) or 64))
    for c, start, end in chunk_ranges(n, chunk_size):
        if chunk_done(emb_dir, c, end - start, encoder.dim):
            bar.update(end - start)
            continue
        texts = [store.get(i)["contents"] for i in range(start, end)]
        parts = []
        for b in range(0, len(texts), step):
            parts.append(encoder.encode_passages(texts[b: b + step]))
            bar.update(len(texts[b: b + step]))
        save_chunk(emb_dir, c, np.concatenate(parts) if len(parts) > 1 else parts[0])
    bar.close()
    return encoder.dim


def iter_embedding_chunks(emb_dir: str, n: int, chunk_size: int):
    """Yield the [rows, dim] float32 chunks in row order (memory-mapped)."""
    for c in range((n + chunk_size - 1) // chunk_size):
        yield np.load(os.path.join(emb_dir, f"chunk_{c:06d}.npy"), mmap_mode="r")


def train_sample(emb_dir: str, n: int, chunk_size: int, max_train: int, seed: int = 0) -> np.ndarray:
    """``max_train`` rows drawn at random (seeded) from the chunks, in row order: a faiss index's training set."""
    rng = np.random.default_rng(seed)
    rows = np.sort(rng.choice(n, size=min(n, max_train), replace=False))
    out = []
    for c, chunk in enumerate(iter_embedding_chunks(emb_dir, n, chunk_size)):
        sel = rows[(rows >= c * chunk_size) & (rows < c * chunk_size + chunk.shape[0])] - c * chunk_size
        if len(sel):
            out.append(np.asarray(chunk[sel], dtype=np.float32))
    return np.ascontiguousarray(np.concatenate(out))
