"""Search-R1's wiki-18 corpus as published (``{"id", "contents": "\\"Title\\"\\ntext"}``, jsonl or jsonl.gz) read
directly, served, and rendered exactly as Search-R1's rollouts show it: against Search-R1's ``example/corpus.jsonl``
(../shared/data/wiki/wiki18_example10.jsonl) and the documents blocks of its two published rollouts
(../shared/data/traces/searchr1_case.txt)."""

import gzip
import json
import re
import shutil

import pytest

from openrlhf_search.env.protocol import get_protocol
from openrlhf_search.env.retrieval_schema import passage_from_document
from retriever.index import build_index, load_index
from retriever.server import create_app
from tests.conftest import shared_path

SR = get_protocol("searchr1")


def searchr1_passages2string(retrieval_result):
    """Search-R1's renderer, as released (``search_r1/llm_agent/generation.py:460-469``), applied to the
    ``/retrieve`` result of one query (``[{"document": {..., "contents"}, "score"}, ...]``)."""
    format_reference = ''
    for idx, doc_item in enumerate(retrieval_result):
        content = doc_item['document']['contents']
        title = content.split("\n")[0]
        text = "\n".join(content.split("\n")[1:])
        format_reference += f"Doc {idx+1}(Title: {title}) {text}\n"
    return format_reference


def _served(index_dir, queries, topk):
    from fastapi.testclient import TestClient

    index = load_index(index_dir)
    try:
        with TestClient(create_app(index)) as c:
            r = c.post("/retrieve", json={"queries": queries, "topk": topk, "return_scores": True})
            assert r.status_code == 200, r.text
            return r.json()["result"]
    finally:
        index.close()


@pytest.mark.parametrize("gz", [False, True])
def test_example_corpus_read_directly_and_rendered_as_searchr1(tmp_path, gz):
    src = shared_path("wiki", "wiki18_example10.jsonl")
    with open(src, encoding="utf-8") as f:
        rows = [json.loads(line) for line in f]
    corpus = str(tmp_path / ("corpus.jsonl.gz" if gz else "corpus.jsonl"))
    if gz:
        with open(src, "rb") as fi, gzip.open(corpus, "wb") as fo:
            shutil.copyfileobj(fi, fo)
    else:
        shutil.copy(src, corpus)
    build_index(corpus, str(tmp_path / "bm25"), encoder="bm25")
    # one query per passage: its title; the passage must come back with its id and contents as published
    titles = [r["contents"].split("\n")[0].strip('"') for r in rows]
    results = _served(str(tmp_path / "bm25"), titles, 3)
    by_id = {r["id"]: r for r in rows}
    for row, hits in zip(rows, results):
        assert row["id"] in [h["document"]["id"] for h in hits]
        for h in hits:
            assert h["document"]["contents"] == by_id[h["document"]["id"]]["contents"]
        ours = SR.format_passages([passage_from_document(h["document"]) for h in hits])
        assert ours == searchr1_passages2string(hits).strip()


def _trace_blocks():
    """(query, [contents of Doc 1..3], the whole documents block) for every search in searchr1_case.txt."""
    with open(shared_path("traces", "searchr1_case.txt"), encoding="utf-8") as f:
        text = f.read()
    out = []
    for m in re.finditer(r"<search>(.*?)</search>(\n\n<information>(.*?)</information>\n\n)", text, re.S):
        docs = re.split(r"\n(?=Doc \d+\(Title: )", m.group(3))
        contents = []
        for i, d in enumerate(docs, 1):
            dm = re.match(rf"Doc {i}\(Title: (\"[^\n]*?\")\) (.*)", d, re.S)
            assert dm, d[:80]
            contents.append(dm.group(1) + "\n" + dm.group(2))  # the inverse of _passages2string
        out.append((m.group(1).strip(), contents, m.group(2)))
    return out


def test_searchr1_case_documents_blocks_reproduced(tmp_path):
    blocks = _trace_blocks()
    assert len(blocks) == 3 and all(len(c) == 3 for _, c, _ in blocks)
    unique = list(dict.fromkeys(c for _, cs, _ in blocks for c in cs))
    assert len(unique) == 6  # the second Paul Walker search got the same three passages
    corpus = tmp_path / "wiki-18.jsonl.gz"
    with gzip.open(corpus, "wt", encoding="utf-8") as f:
        for i, c in enumerate(unique):
            f.write(json.dumps({"id": str(i), "contents": c}) + "\n")
    build_index(str(corpus), str(tmp_path / "bm25"), encoder="bm25")
    results = _served(str(tmp_path / "bm25"), [q for q, _, _ in blocks], 3)
    for (query, contents, block), hits in zip(blocks, results):
        got = {h["document"]["contents"] for h in hits}
        assert got == set(contents), query
        # BM25 ranks them its own way (Search-R1 ranked with e5): put them in the trace's order, then render
        hits = sorted(hits, key=lambda h: contents.index(h["document"]["contents"]))
        assert SR.render_documents([passage_from_document(h["document"]) for h in hits]) == block
        assert "\n\n<information>" + searchr1_passages2string(hits).strip() + "</information>\n\n" == block
