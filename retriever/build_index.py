"""CLI: build a self-contained retriever index directory from a passage corpus.

    python -m retriever.build_index --corpus C.jsonl --index_dir D \\
        --encoder bm25|e5-base-v2|bge-large-en-v1.5|minilm|PATH --index_type flat|hnsw|ivfpq|bm25 \\
        [--limit N] [--embeddings_dir E] [--overwrite]

Dense encoding is resumable: rerun the same command after an interruption and finished embedding chunks are
skipped. See ``retriever.index.build_index`` for the meaning of every option.

``--faiss_index FILE.index`` adopts an index someone else built over this corpus (Search-R1's ``e5_Flat.index`` /
``e5_HNSW64.index``, FlashRAG's indexes) instead of encoding: nothing is re-encoded, the index file stays where it
is, and it is verified against the corpus and the encoder first (``retriever.adopt``).

``--ray`` encodes with Ray Data over every GPU (or CPU) of a Ray cluster (``retriever.ray_encode``): same chunks,
same resumability, same index types; ``--ray_address auto`` joins a running cluster, else a local Ray is started.
"""

from __future__ import annotations

import argparse
import json
import logging
import sys

from .index import INDEX_TYPES, RetrieverIndexError, build_index


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m retriever.build_index", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--corpus", required=True, help="passage jsonl ({id,contents} / {id,title,text} rows)")
    p.add_argument("--index_dir", required=True, help="output folder (self-contained index)")
    p.add_argument("--encoder", default="bm25",
                   help="bm25, a preset (e5-base-v2, bge-large-en-v1.5, minilm) or a sentence-transformers path")
    p.add_argument("--index_type", choices=INDEX_TYPES, default=None,
                   help="default: bm25 for --encoder bm25, else flat")
    p.add_argument("--limit", type=int, default=None, help="index only the first N passages")
    p.add_argument("--embeddings_dir", default=None, help="resumable embedding chunks (default INDEX_DIR/embeddings)")
    p.add_argument("--chunk_size", type=int, default=10000, help="passages per embedding chunk file")
    p.add_argument("--batch_size", type=int, default=64, help="encoder batch size")
    p.add_argument("--device", default=None, help="encoder device (cpu, cuda, cuda:1); default: auto")
    p.add_argument("--hnsw_m", type=int, default=32, help="HNSW neighbours per node")
    p.add_argument("--ef_construction", type=int, default=200)
    p.add_argument("--ef_search", type=int, default=128)
    p.add_argument("--nlist", type=int, default=None, help="IVF cells (default ~4*sqrt(N), >=39 vectors/cell)")
    p.add_argument("--pq_m", type=int, default=None, help="PQ sub-quantizers (must divide dim; default dim/8)")
    p.add_argument("--nprobe", type=int, default=None, help="IVF cells visited per query (default min(nlist,32))")
    p.add_argument("--query_prefix", default=None, help="override the preset's query prefix")
    p.add_argument("--passage_prefix", default=None, help="override the preset's passage prefix")
    p.add_argument("--max_seq_length", type=int, default=None)
    p.add_argument("--overwrite", action="store_true", help="replace an existing complete index")
    ad = p.add_argument_group("adopting an existing faiss index (retriever/adopt.py)")
    ad.add_argument("--faiss_index", default=None,
                    help="a faiss index file built over --corpus in its row order (e.g. Search-R1's e5_Flat.index); "
                         "adopted without re-encoding")
    ad.add_argument("--verify_sample", type=int, default=64, help="passages re-encoded to check the stored vectors")
    ad.add_argument("--verify_seed", type=int, default=0)
    ad.add_argument("--verify_min_cosine", type=float, default=0.99,
                    help="Flat / HNSW: least cosine between a re-encoded passage and its stored vector")
    ad.add_argument("--verify_min_rank1", type=float, default=1.0,
                    help="IVF / PQ: least share of sampled passages that retrieve themselves at rank 1")
    ad.add_argument("--no_mmap", action="store_true", help="load the adopted index into RAM instead of mapping it")
    r = p.add_argument_group("Ray (distributed encoding, retriever/ray_encode.py)")
    r.add_argument("--ray", action="store_true", help="encode with Ray Data actors over the Ray cluster")
    r.add_argument("--ray_address", default=None, help="cluster to join (auto, HOST:6379); default: a local Ray")
    r.add_argument("--ray_workers", type=int, default=None, help="encoder actors (default: one per GPU, else per CPU)")
    r.add_argument("--ray_gpus_per_worker", type=float, default=None, help="default 1 with GPUs in the cluster, else 0")
    r.add_argument("--ray_cpus_per_worker", type=float, default=1.0)
    a = p.parse_args(argv)
    if a.ray_workers is not None and a.ray_workers < 1:
        p.error(f"--ray_workers must be >= 1, got {a.ray_workers}")
    if (a.ray_gpus_per_worker or 0) < 0 or a.ray_cpus_per_worker < 0:
        p.error("--ray_gpus_per_worker / --ray_cpus_per_worker must be >= 0")
    if a.faiss_index is not None:
        if a.encoder == "bm25":
            p.error("--faiss_index needs the dense --encoder that built it (e.g. e5-base-v2 for Search-R1's indexes)")
        clash = [f"--{n}" for n in ("index_type", "limit", "embeddings_dir") if getattr(a, n) is not None] + \
            (["--ray"] if a.ray else [])
        if clash:
            p.error(f"--faiss_index adopts a finished index: {', '.join(clash)} do not apply")
        if a.verify_sample < 1:
            p.error(f"--verify_sample must be >= 1, got {a.verify_sample}")
    return a


def main(argv=None) -> int:
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    a = parse_args(argv)
    encode_fn = None
    if a.ray:
        if a.encoder == "bm25":
            logging.getLogger("retriever.build_index").warning("--ray: bm25 has nothing to encode; building here")
        else:
            import functools

            from .ray_encode import encode_corpus_ray

            encode_fn = functools.partial(encode_corpus_ray, address=a.ray_address, workers=a.ray_workers,
                                          gpus_per_worker=a.ray_gpus_per_worker, cpus_per_worker=a.ray_cpus_per_worker,
                                          device=a.device)
    if a.faiss_index is not None:
        from .adopt import adopt_index

        try:
            manifest = adopt_index(a.corpus, a.index_dir, a.faiss_index, a.encoder, query_prefix=a.query_prefix,
                                   passage_prefix=a.passage_prefix, max_seq_length=a.max_seq_length, device=a.device,
                                   batch_size=a.batch_size, verify_sample=a.verify_sample, verify_seed=a.verify_seed,
                                   min_cosine=a.verify_min_cosine, min_rank1=a.verify_min_rank1,
                                   mmap=not a.no_mmap, overwrite=a.overwrite)
        except (RetrieverIndexError, ValueError, OSError) as e:
            print(f"build_index: error: {e}", file=sys.stderr)
            return 2
        print(json.dumps(manifest, indent=2))
        return 0
    try:
        manifest = build_index(a.corpus, a.index_dir, encoder=a.encoder, index_type=a.index_type, limit=a.limit,
                               embeddings_dir=a.embeddings_dir, chunk_size=a.chunk_size, batch_size=a.batch_size,
                               device=a.device, hnsw_m=a.hnsw_m, ef_construction=a.ef_construction,
                               ef_search=a.ef_search, nlist=a.nlist, pq_m=a.pq_m, nprobe=a.nprobe,
                               query_prefix=a.query_prefix, passage_prefix=a.passage_prefix,
                               max_seq_length=a.max_seq_length, overwrite=a.overwrite, encode_fn=encode_fn)
    # OSError: a corpus that is a folder, an index_dir that is a file
    except (RetrieverIndexError, ValueError, OSError) as e:
        print(f"build_index: error: {e}", file=sys.stderr)
        return 2
    print(json.dumps(manifest, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
