"""Faults found by replaying public bug reports on the retriever: a corpus holding copies of one passage (its copies
took 2 of the 3 result slots with BM25 and dense), two passages sharing one id (indexed silently), and a chunked
request body read in full before the 413 (the limit only looked at Content-Length)."""

import asyncio
import json

import pytest

from retriever.index import DedupIndex, RetrieverIndexError, build_index, load_index, read_manifest
from retriever.server import Limits, create_app, parse_args
from tests.conftest import shared_path

COPIES = 30
REAL = 15  # real paragraphs besides the copies (MiniLM encodes every row: keep the corpus small)


@pytest.fixture(scope="module")
def paragraphs():
    with open(shared_path("wiki", "hotpotqa_dev500_paragraphs.jsonl"), encoding="utf-8") as f:
        return [json.loads(line) for _, line in zip(range(REAL), f)]


@pytest.fixture(scope="module")
def dup_corpus(tmp_path_factory, paragraphs):
    """15 real paragraphs, then 29 more copies of paragraph 0 (30 in all) under their own ids."""
    path = tmp_path_factory.mktemp("dups") / "corpus.jsonl"
    rows = [dict(p) for p in paragraphs] + [dict(paragraphs[0], id=f"copy{i}") for i in range(1, COPIES)]
    with open(path, "w", encoding="utf-8") as f:
        for r in rows:
            f.write(json.dumps(r) + "\n")
    return str(path)


@pytest.mark.parametrize("encoder", ["bm25", "minilm"])
def test_copies_counted_at_build_and_kept_out_of_results_with_dedup(tmp_path, dup_corpus, paragraphs, encoder, caplog):
    with caplog.at_level("WARNING", logger="retriever.index"):
        build_index(dup_corpus, str(tmp_path / "i"), encoder=encoder, chunk_size=128)
    d = read_manifest(str(tmp_path / "i"))["duplicates"]
    assert d["duplicate_text_rows"] == COPIES - 1 and d["duplicate_text_groups"] == 1
    assert d["largest_duplicate_text_group"] == COPIES and d["duplicate_id_rows"] == 0
    assert f"{COPIES - 1} of {REAL + COPIES - 1} passages repeat the text" in caplog.text
    query = paragraphs[0]["title"] + " " + " ".join(paragraphs[0]["contents"].split()[:12])
    plain = load_index(str(tmp_path / "i"))
    top = plain.search([query], 3)[0]
    assert len({" ".join(h["text"].lower().split()) for h in top}) < 3  # the fault: copies fill the slots
    plain.close()
    dedup = load_index(str(tmp_path / "i"), dedup=True)
    assert isinstance(dedup, DedupIndex)
    top = dedup.search([query, paragraphs[5]["title"]], 3)
    texts = [" ".join(h["text"].lower().split()) for h in top[0]]
    assert len(top[0]) == 3 and len(set(texts)) == 3
    copied = " ".join(paragraphs[0]["contents"].split("\n", 1)[1].lower().split())
    assert texts.count(copied) == 1
    assert dedup.info()["dedup"] is True and dedup.info()["duplicates_removed"] >= 1
    # scores stay sorted and are the wrapped index's own
    assert [h["score"] for h in top[0]] == sorted([h["score"] for h in top[0]], reverse=True)
    dedup.close()


def test_dedup_searches_deeper_until_enough_distinct(tmp_path, paragraphs):
    """topk 3 over 30 copies ranked first: the widened searches (6, then 24) hold one distinct text; it must go on
    to the whole index."""
    rows = [dict(paragraphs[0], id=f"c{i}") for i in range(COPIES)] + [dict(p) for p in paragraphs[1:6]]
    path = tmp_path / "c.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    build_index(str(path), str(tmp_path / "i"), encoder="bm25")
    idx = load_index(str(tmp_path / "i"), dedup=True)
    copied_words = " ".join(paragraphs[0]["contents"].split("\n", 1)[1].split()[:15])
    hits = idx.search([copied_words], 3)[0]
    assert hits[0]["id"].startswith("c")  # the copies rank first: searches of 6 and 24 hold one distinct text
    assert len({h["text"] for h in hits}) == len(hits)
    assert idx.removed == COPIES - 1
    idx.close()


def test_duplicate_ids_refused_at_build(tmp_path, paragraphs):
    rows = [dict(p) for p in paragraphs[:10]]
    rows[7]["id"] = rows[2]["id"]  # two different passages, one id
    path = tmp_path / "c.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    with pytest.raises(RetrieverIndexError) as e:
        build_index(str(path), str(tmp_path / "i"), encoder="bm25")
    msg = str(e.value)
    assert "\n" not in msg and f"1 of 10 passages repeat an id already used (id {rows[2]['id']!r} at rows 2, 7)" in msg
    assert not (tmp_path / "i" / "manifest.json").exists()


def test_server_flag_dedup():
    assert parse_args(["--index_dir", "x", "--dedup"]).dedup is True
    assert parse_args(["--index_dir", "x"]).dedup is False


async def _post_chunked(app, n_chunks: int, chunk: bytes):
    """POST /retrieve with a chunked body (no Content-Length) straight into the ASGI app; counts the chunks the app
    pulled before answering."""
    pulled = 0

    async def receive():
        nonlocal pulled
        pulled += 1
        return {"type": "http.request", "body": chunk, "more_body": pulled < n_chunks}

    sent = []

    async def send(message):
        sent.append(message)

    scope = {"type": "http", "asgi": {"version": "3.0"}, "http_version": "1.1", "method": "POST", "scheme": "http",
             "path": "/retrieve", "raw_path": b"/retrieve", "query_string": b"", "root_path": "",
             "headers": [(b"host", b"t"), (b"content-type", b"application/json"), (b"transfer-encoding", b"chunked")],
             "client": ("127.0.0.1", 1), "server": ("127.0.0.1", 80)}
    await app(scope, receive, send)
    status = next(m["status"] for m in sent if m["type"] == "http.response.start")
    body = b"".join(m.get("body", b"") for m in sent if m["type"] == "http.response.body")
    return pulled, status, body


def test_chunked_body_cut_off_at_the_limit(hotpotqa_bm25_index):
    """A 256 MiB chunked body against a 1 MiB limit: 413 after reading ~1 MiB, not after all 256 MiB."""
    index = load_index(hotpotqa_bm25_index)
    limit, chunk = 1 << 20, b"x" * (64 << 10)
    app = create_app(index, Limits(max_body_bytes=limit))
    pulled, status, body = asyncio.run(_post_chunked(app, 4096, chunk))
    assert status == 413 and b"request body over 1048576 bytes" in body
    assert pulled <= limit // len(chunk) + 2, pulled  # read until the limit, no further
    # a body under the limit in chunks is still served
    from fastapi.testclient import TestClient

    small = json.dumps({"queries": ["Who wrote Hamlet?"], "topk": 2}).encode()
    with TestClient(app) as c:  # an iterator body goes out chunked, without Content-Length
        r = c.post("/retrieve", content=iter([small[:10], small[10:]]), headers={"content-type": "application/json"})
    assert r.status_code == 200 and len(r.json()["result"][0]) == 2
    index.close()
