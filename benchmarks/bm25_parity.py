"""BM25 parity with Search-R1's: Pyserini (Lucene) vs this service's bm25s, same parameters, HotpotQA dev paragraphs.

    JAVA_HOME=/usr/lib/jvm/JDK PYTHONPATH=DIR_WITH_PYSERINI python benchmarks/bm25_parity.py [--workdir W]

Search-R1's BM25 retriever is Pyserini's ``LuceneSearcher`` (``search_r1/search/retrieval_server.py:146-157``) with its
default BM25 parameters (k1 0.9, b 0.4) over an index built with ``python -m pyserini.index.lucene --collection
JsonCollection --generator DefaultLuceneDocumentGenerator --threads 1`` (``search_r1/search/index_builder.py:151-157``),
whose default analyzer lower-cases, removes English stopwords and Porter-stems. This service's ``--encoder bm25`` is
bm25s (Lucene's BM25 formula) with k1 1.5, b 0.75, lower-casing and English stopwords, no stemming.

On the 4,858 paragraphs of ``../shared/data/wiki/hotpotqa_dev500_paragraphs.jsonl`` and the 500 HotpotQA dev questions
of ``../shared/data/qa/with_paragraphs/hotpotqa_dev500_ircot.jsonl`` it reports, in one run: recall@3 of the two
supporting paragraphs (as ``benchmarks/retrieval_quality.py``) for Pyserini and for bm25s at Pyserini's parameters
and at ours, and the top-3 overlap with Pyserini (mean share of Pyserini's top-3 ids also in bm25s' top-3).
Pyserini is not a dependency of this project: install it (``pip install pyserini``; it needs a JDK, 21 or newer for
pyserini >= 0.23) to run this.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SHARED = os.path.join(os.path.dirname(ROOT), "shared", "data")


def lucene_searcher(index_dir: str):
    """Pyserini's ``LuceneSearcher``; when ``pyserini.search.lucene`` cannot be imported for want of the packages its
    neural encoders need (onnxruntime, an OpenAI key: pyserini 1.x imports them eagerly), the Anserini
    ``SimpleSearcher`` it wraps, which ``LuceneSearcher.search(q, k)`` / ``set_bm25`` call as they are."""
    try:
        from pyserini.search.lucene import LuceneSearcher

        return LuceneSearcher(index_dir)
    except Exception:
        from pyserini.pyclass import autoclass

        return autoclass("io.anserini.search.SimpleSearcher")(index_dir)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--workdir", default=None)
    ap.add_argument("--k", type=int, default=3)
    a = ap.parse_args(argv)
    sys.path.insert(0, ROOT)
    import bm25s

    from benchmarks.retrieval_quality import load_questions
    from retriever.corpus import iter_passages
    from retriever.index import _bm25_tokenizer

    work = a.workdir or tempfile.mkdtemp(prefix="bm25_parity_")
    passages = list(iter_passages(os.path.join(SHARED, "wiki", "hotpotqa_dev500_paragraphs.jsonl")))
    questions = load_questions(os.path.join(SHARED, "qa", "with_paragraphs", "hotpotqa_dev500_ircot.jsonl"))
    queries = [q for q, _ in questions]
    title = {p["id"]: p["title"] for p in passages}
    # Pyserini, as Search-R1 builds and searches it
    os.makedirs(os.path.join(work, "input"), exist_ok=True)
    with open(os.path.join(work, "input", "corpus.jsonl"), "w", encoding="utf-8") as f:
        for p in passages:
            f.write(json.dumps({"id": p["id"], "contents": p["contents"]}, ensure_ascii=False) + "\n")
    index_dir = os.path.join(work, "lucene")
    if not os.path.isdir(index_dir):
        subprocess.run([sys.executable, "-m", "pyserini.index.lucene", "--collection", "JsonCollection", "--input",
                        os.path.join(work, "input"), "--index", index_dir, "--generator",
                        "DefaultLuceneDocumentGenerator", "--threads", "1"], check=True, capture_output=True)
    searcher = lucene_searcher(index_dir)
    searcher.set_bm25(0.9, 0.4)
    t = time.perf_counter()
    pys = [[h.docid for h in searcher.search(q, a.k)] for q in queries]
    pys_s = time.perf_counter() - t
    # bm25s, this service's tokenizer, two parameter sets
    tok = _bm25_tokenizer()
    corpus_ids = tok.tokenize([p["contents"] for p in passages], return_as="ids", show_progress=False,
                              allow_empty=False)
    q_ids = tok.tokenize(queries, update_vocab=False, return_as="ids", show_progress=False, allow_empty=False)
    runs = {}
    for name, k1, b in (("bm25s k1 0.9 b 0.4 (Pyserini's)", 0.9, 0.4), ("bm25s k1 1.5 b 0.75 (ours)", 1.5, 0.75)):
        model = bm25s.BM25(k1=k1, b=b, method="lucene")
        model.index(corpus_ids, show_progress=False)
        rows, scores = model.retrieve(q_ids, k=a.k, show_progress=False, n_threads=0)
        runs[name] = [[passages[int(r)]["id"] for r, s in zip(rr, ss) if s > 0] for rr, ss in zip(rows, scores)]

    def recall(results):
        tot = 0.0
        for ids, (_, sup) in zip(results, questions):
            titles = {title[i] for i in ids[:a.k]}
            tot += sum(t in titles for t in sup) / len(sup)
        return tot / len(questions)

    def overlap(results):
        return sum(len(set(r) & set(p)) / max(1, len(p)) for r, p in zip(results, pys)) / len(pys)

    print(f"{len(questions)} HotpotQA dev questions over {len(passages):,} paragraphs, top-{a.k} "
          f"(Pyserini {pys_s * 1000 / len(queries):.1f} ms/query):\n")
    print(f"| retriever | recall@{a.k} | top-{a.k} overlap with Pyserini | identical top-{a.k} lists |")
    print("| --- | --- | --- | --- |")
    print(f"| Pyserini (Lucene) k1 0.9 b 0.4, Search-R1's | {recall(pys):.3f} | 1.000 | {len(pys)} |")
    for name, res in runs.items():
        same = sum(r == p for r, p in zip(res, pys))
        print(f"| {name} | {recall(res):.3f} | {overlap(res):.3f} | {same} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
