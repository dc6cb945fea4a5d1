"""Retrieval quality per index type: recall@1/3/5 of HotpotQA's supporting paragraphs.

    PYTHONPATH=. python benchmarks/retrieval_quality.py [--types bm25,flat,hnsw,ivfpq] [--write_docs docs/retriever.md]

Questions: ``../shared/data/qa/with_paragraphs/hotpotqa_dev500_ircot.jsonl`` (500 HotpotQA dev questions, 2
supporting paragraphs each). Corpus: ``../shared/data/wiki/hotpotqa_dev500_paragraphs.jsonl`` (4,858 paragraphs:
the 10 candidate paragraphs of every question, deduplicated; titles are unique, so a passage matches a
supporting paragraph by title). recall@k = mean over questions of (supporting paragraphs in the top k) / 2;
both@5 = share of questions with both supporting paragraphs in the top 5.

Dense indexes use one MiniLM encoding (embeddings chunk folder shared by Flat / HNSW / IVF-PQ, reused between
runs); index memory is the size of the serialized faiss index (what faiss holds in RAM), or of the bm25s
matrices. Build time is the index build alone; the shared encoding time is printed separately.
"""

import argparse
import json
import os
import sys
import time

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO)
from benchmarks.inputs import CORPUS, QUESTIONS, require_inputs  # noqa: E402
START, END = "<!-- retrieval-quality:start -->", "<!-- retrieval-quality:end -->"


def dir_bytes(path: str) -> int:
    if os.path.isfile(path):
        return os.path.getsize(path)
    return sum(os.path.getsize(os.path.join(r, f)) for r, _, fs in os.walk(path) for f in fs)


def load_questions(path: str):
    out = []
    with open(path) as f:
        for line in f:
            q = json.loads(line)
            sup = [c["title"] for c in q["contexts"] if c["is_supporting"]]
            out.append((q["question_text"], sup))
    return out


def recall(results, questions, k: int) -> float:
    tot = 0.0
    for hits, (_, sup) in zip(results, questions):
        titles = {h["title"] for h in hits[:k]}
        tot += sum(t in titles for t in sup) / len(sup)
    return tot / len(questions)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--questions", default=QUESTIONS)
    p.add_argument("--corpus", default=CORPUS)
    p.add_argument("--workdir", default=os.path.join(REPO, "runs", "retriever"))
    p.add_argument("--encoder", default="minilm")
    p.add_argument("--types", default="bm25,flat,hnsw,ivfpq")
    p.add_argument("--chunk_size", type=int, default=1000)
    p.add_argument("--rebuild", action="store_true", help="rebuild indexes (the embeddings are still reused)")
    p.add_argument("--write_docs", default=None, help="replace the table between markers in this markdown file")
    a = p.parse_args(argv)
    require_inputs(questions=a.questions, **({} if getattr(a, "index_dir", None) else {"corpus": a.corpus}))

    from retriever.index import MANIFEST, build_index, load_index

    questions = load_questions(a.questions)
    queries = [q for q, _ in questions]
    emb_dir = os.path.join(a.workdir, f"hotpot_{a.encoder}_emb")
    rows, encode_s = [], None
    for kind in a.types.split(","):
        enc = "bm25" if kind == "bm25" else a.encoder
        d = os.path.join(a.workdir, "hotpot_bm25" if kind == "bm25" else f"hotpot_{a.encoder}_{kind}")
        if a.rebuild or not os.path.exists(os.path.join(d, MANIFEST)):
            print(f"building {kind} in {d} ...", flush=True)
            build_index(a.corpus, d, encoder=enc, index_type=kind, embeddings_dir=None if kind == "bm25" else emb_dir,
                        chunk_size=a.chunk_size, overwrite=True)
        with open(os.path.join(d, MANIFEST)) as f:
            m = json.load(f)
        build_s = m.get("index_seconds", m.get("build_seconds"))
        if kind != "bm25" and encode_s is None:
            encode_s = m.get("encode_seconds")
        index = load_index(d)
        index.search(queries[:8], 5)  # warm-up
        t0 = time.perf_counter()
        res = index.search(queries, 5)
        search_ms = (time.perf_counter() - t0) * 1000 / len(queries)
        mem = dir_bytes(os.path.join(d, "bm25") if kind == "bm25" else os.path.join(d, "index.faiss"))
        both5 = sum(all(t in {h["title"] for h in hits} for t in sup) for hits, (_, sup) in zip(res, questions))
        row = {"index": "BM25 (bm25s)" if kind == "bm25" else f"{a.encoder} {kind} ({m['params'].get('factory')})",
               "r1": recall(res, questions, 1), "r3": recall(res, questions, 3), "r5": recall(res, questions, 5),
               "both5": both5 / len(questions), "mem_mb": mem / 2**20, "build_s": build_s, "ms": search_ms}
        rows.append(row)
        print(json.dumps(row), flush=True)
        index.close()

    lines = [f"Recall of the 2 supporting paragraphs of {len(questions)} HotpotQA dev questions over "
             f"{m['count']:,} paragraphs (`benchmarks/retrieval_quality.py`, 2 shared CPU cores).", "",
             "| index | recall@1 | recall@3 | recall@5 | both@5 | index memory (MB) | build (s) "
             "| encode+search (ms/query, batch 500) |",
             "| --- | --- | --- | --- | --- | --- | --- | --- |"]
    for r in rows:
        lines.append(f"| {r['index']} | {r['r1']:.3f} | {r['r3']:.3f} | {r['r5']:.3f} | {r['both5']:.3f} | "
                     f"{r['mem_mb']:.2f} | {r['build_s']:.1f} | {r['ms']:.2f} |")
    if encode_s is not None:
        lines += ["", f"Dense rows share one {a.encoder} encoding of the corpus ({encode_s:.0f} s here, "
                      "not included in build); recall@1 counts one of the two supporting paragraphs, so its "
                      "maximum is 0.5."]
    else:
        lines += ["", "recall@1 counts one of the two supporting paragraphs, so its maximum is 0.5."]
    table = "\n".join(lines)
    print("\n" + table)
    if a.write_docs:
        text = open(a.write_docs).read() if os.path.exists(a.write_docs) else f"{START}\n{END}\n"
        if START not in text:
            text += f"\n{START}\n{END}\n"
        head, rest = text.split(START, 1)
        tail = rest.split(END, 1)[1]
        with open(a.write_docs, "w") as f:
            f.write(f"{head}{START}\n{table}\n{END}{tail}")
        print(f"table written to {a.write_docs}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
