"""Reading a faiss index file someone else built (memory-mapped where faiss can) and telling its kind.

Shared by :mod:`retriever.index` (loading an adopted index) and :mod:`retriever.adopt` (verifying it), which
therefore never import each other.
"""

from __future__ import annotations

import os

from .errors import AdoptionError


def base_index(index):
    """The index under an ``IndexIDMap`` / ``IndexPreTransform`` wrapper, downcast to its faiss class."""
    import faiss

    index = faiss.downcast_index(index)
    while hasattr(index, "index") and isinstance(index, (faiss.IndexIDMap, faiss.IndexPreTransform)):
        index = faiss.downcast_index(index.index)
    return index


def index_kind(index) -> str:
    """``flat``, ``hnsw``, ``ivf`` or ``other``: what the loader tunes (efSearch for HNSW, nprobe for IVF)."""
    import faiss

    b = base_index(index)
    if isinstance(b, faiss.IndexHNSW):
        return "hnsw"
    if isinstance(b, faiss.IndexIVF):
        return "ivf"
    if isinstance(b, faiss.IndexFlat):
        return "flat"
    return "other"


def exact_storage(index) -> bool:
    """True when ``reconstruct`` returns the stored float32 vectors exactly (Flat, HNSW over Flat storage)."""
    import faiss

    b = base_index(index)
    if isinstance(b, faiss.IndexHNSW):
        return isinstance(faiss.downcast_index(b.storage), faiss.IndexFlat)
    return isinstance(b, faiss.IndexFlat)


def read_faiss_index(path: str, mmap: bool = True):
    """``faiss.read_index`` memory-mapped where faiss can; returns ``(index, mmapped)``.

    ``IO_FLAG_MMAP_IFC`` maps the vectors of Flat and HNSW-Flat indexes (faiss >= 1.10): loading is instant and the
    vectors live in the page cache. Other types (IVF, PQ) are read into RAM. Raises AdoptionError for a file faiss
    cannot read.
    """
    import faiss

    if not os.path.isfile(path):
        raise AdoptionError(f"faiss index {path}: no such file")
    flag = getattr(faiss, "IO_FLAG_MMAP_IFC", None)
    if mmap and flag is not None:
        try:
            index = faiss.read_index(path, flag | faiss.IO_FLAG_READ_ONLY)
            return index, exact_storage(index)
        except RuntimeError:
            pass
    try:
        return faiss.read_index(path), False
    except RuntimeError as e:
        raise AdoptionError(f"faiss index {path}: faiss cannot read it ({str(e).splitlines()[0][:200]})") from e
