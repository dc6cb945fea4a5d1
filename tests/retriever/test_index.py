"""Index round trips: build -> save -> load -> search, for BM25 and MiniLM Flat / HNSW / IVF-PQ, and resumable
encoding. Uses the first 128 HotpotQA dev paragraphs; one MiniLM encoding serves all dense types."""

import json
import os

import numpy as np
import pytest

from retriever.corpus import PassageStore, iter_passages
from retriever.encoders import get_encoder, resolve_encoder
from retriever.embeddings import encode_corpus
from retriever.index import RetrieverIndexError, build_index, load_index, read_manifest
from tests.conftest import shared_path

N = 128


@pytest.fixture(scope="module")
def corpus():
    return shared_path("wiki", "hotpotqa_dev500_paragraphs.jsonl")


@pytest.fixture(scope="module")
def passages(corpus):
    return list(iter_passages(corpus, limit=N))


@pytest.fixture(scope="module")
def dense_indexes(corpus, tmp_path_factory):
    """One MiniLM encoding shared by the three dense index types (as the embeddings_dir option intends)."""
    root = tmp_path_factory.mktemp("dense")
    emb = str(root / "emb")
    dirs = {}
    for kind in ("flat", "hnsw", "ivfpq"):
        dirs[kind] = str(root / kind)
        build_index(corpus, dirs[kind], encoder="minilm", index_type=kind, limit=N, embeddings_dir=emb,
                    chunk_size=64, nlist=4, pq_m=16)
    return dirs, emb


def _ids(results):
    return [[p["id"] for p in hits] for hits in results]


def test_bm25_round_trip(corpus, passages, tmp_path):
    d = str(tmp_path / "bm25")
    m = build_index(corpus, d, encoder="bm25", limit=N)
    assert m["count"] == N and m["index_type"] == "bm25" and read_manifest(d)["count"] == N
    queries = [p["title"] for p in passages[:40]]
    a, b = load_index(d), load_index(d)
    ra, rb = a.search(queries, 5), b.search(queries, 5)
    assert ra == rb  # two independent loads give identical passages and scores
    for q, hits, p in zip(queries, ra, passages[:40]):
        assert 1 <= len(hits) <= 5
        assert [h["score"] for h in hits] == sorted([h["score"] for h in hits], reverse=True)
        assert set(hits[0]) == {"id", "title", "text", "contents", "score"}
    # a passage's own title finds it in the top 5 for most titles
    assert np.mean([p["id"] in [h["id"] for h in hits] for p, hits in zip(passages, ra)]) >= 0.8
    assert a.search(["zzzxqv"], 3) == [[]]  # no shared term: no passage rather than arbitrary ones
    with pytest.raises(ValueError):
        a.search(["x"], 0)
    with pytest.raises(RetrieverIndexError):
        build_index(corpus, d, encoder="bm25", limit=N)  # refuses to overwrite silently


def test_dense_round_trips_match_brute_force(dense_indexes, passages):
    dirs, emb = dense_indexes
    flat = load_index(dirs["flat"])
    manifest = read_manifest(dirs["flat"])
    assert manifest["dim"] == 384 and manifest["count"] == N
    queries = [p["title"] + " " + " ".join(p["text"].split()[:6]) for p in passages[::4]]
    # Flat == exact inner product over the saved embeddings, computed here with numpy
    E = np.concatenate([np.load(os.path.join(emb, f)) for f in sorted(os.listdir(emb)) if f.startswith("chunk_")])
    assert E.shape == (N, 384)
    Q = flat.encoder.encode_queries(queries)
    exact = np.argsort(-(Q @ E.T), axis=1)[:, :5]
    res_flat = flat.search(queries, 5)
    assert _ids(res_flat) == [[passages[i]["id"] for i in row] for row in exact]
    np.testing.assert_allclose([[h["score"] for h in hits] for hits in res_flat],
                               np.take_along_axis(Q @ E.T, exact, axis=1), rtol=1e-4, atol=1e-5)
    for kind in ("hnsw", "ivfpq"):
        idx, again = load_index(dirs[kind]), load_index(dirs[kind])
        r1, r2 = idx.search(queries, 5), again.search(queries, 5)
        assert _ids(r1) == _ids(r2)  # reload gives the same results
        top1_agree = np.mean([a[0]["id"] == b[0]["id"] for a, b in zip(r1, res_flat)])
        assert top1_agree >= (0.95 if kind == "hnsw" else 0.6), (kind, top1_agree)
    m = read_manifest(dirs["ivfpq"])
    # 128 vectors: 8-entry codebooks
    assert m["params"]["nlist"] == 4 and m["params"]["pq_m"] == 16 and m["params"]["pq_nbits"] == 3
    # topk larger than the corpus is clamped, not an error
    assert len(flat.search(["anything"], 1000)[0]) == N


def test_encoding_resumes_from_finished_chunks(corpus, tmp_path):
    d = str(tmp_path / "idx")
    build_index(corpus, d, encoder="minilm", index_type="flat", limit=24, chunk_size=8)
    emb = os.path.join(d, "embeddings")
    chunks = sorted(f for f in os.listdir(emb) if f.startswith("chunk_"))
    assert chunks == ["chunk_000000.npy", "chunk_000001.npy", "chunk_000002.npy"]
    before = {f: os.path.getmtime(os.path.join(emb, f)) for f in chunks}
    kept = np.load(os.path.join(emb, chunks[0]))
    os.remove(os.path.join(emb, chunks[1]))  # as if the run died while encoding chunk 1
    store = PassageStore(os.path.join(d, "passages.jsonl"), os.path.join(d, "offsets.npy"))
    enc = get_encoder(resolve_encoder("minilm"))
    encode_corpus(store, enc, emb, chunk_size=8)
    assert os.path.getmtime(os.path.join(emb, chunks[0])) == before[chunks[0]]  # skipped
    assert os.path.getmtime(os.path.join(emb, chunks[2])) == before[chunks[2]]
    assert os.path.exists(os.path.join(emb, chunks[1]))
    np.testing.assert_array_equal(np.load(os.path.join(emb, chunks[0])), kept)
    with pytest.raises(RetrieverIndexError):  # a folder made with another chunking is not silently mixed
        encode_corpus(store, enc, emb, chunk_size=4)
    store.close()


def test_incomplete_index_is_refused(tmp_path):
    os.makedirs(tmp_path / "half")
    with pytest.raises(RetrieverIndexError, match="did not finish"):
        load_index(str(tmp_path / "half"))
    with pytest.raises(ValueError):
        build_index("x.jsonl", str(tmp_path / "y"), encoder="bm25", index_type="flat")


def test_unloadable_encoder_is_a_clear_error_before_any_work(corpus, tmp_path, capsys):
    from retriever.build_index import main

    for bad in (str(tmp_path / "no_such_model"), corpus):  # missing path; a file, not a model folder
        d = tmp_path / "idx"
        with pytest.raises(ValueError, match="cannot load encoder"):
            build_index(corpus, str(d), encoder=bad, index_type="flat", limit=8)
        assert not (d / "passages.jsonl").exists()  # failed before copying the corpus
        assert main(["--corpus", corpus, "--index_dir", str(d), "--encoder", bad, "--limit", "8"]) == 2
        assert "cannot load encoder" in capsys.readouterr().err
    # --overwrite with a typo'd encoder leaves the complete index it would have replaced
    d = tmp_path / "bm25"
    build_index(corpus, str(d), encoder="bm25", limit=8)
    with pytest.raises(ValueError, match="cannot load encoder"):
        build_index(corpus, str(d), encoder="e5-bsae-v2", index_type="flat", limit=8, overwrite=True)
    assert load_index(str(d)).search(["Shirley Temple"], 1)


@pytest.mark.parametrize("kw, says", [({"chunk_size": 0}, "chunk_size"),
                                      ({"index_type": "hnsw", "hnsw_m": 0}, "hnsw_m"),
                                      ({"index_type": "ivfpq", "nlist": 1000}, "nlist=1000"),
                                      ({"index_type": "ivfpq", "pq_m": 7}, "pq_m=7")])
def test_bad_build_parameters_are_clear_errors_before_encoding(corpus, tmp_path, kw, says):
    """chunk_size 0 was a ZeroDivisionError, hnsw_m 0 aborted the process inside faiss, nlist > N a faiss
    RuntimeError after encoding."""
    kw = {"index_type": "flat", **kw}
    d = tmp_path / "idx"
    with pytest.raises(ValueError, match=says):
        build_index(corpus, str(d), encoder="minilm", limit=40, **kw)
    assert not (d / "embeddings").exists()  # nothing was encoded


def test_damaged_index_is_refused_at_load(corpus, tmp_path):
    """A truncated passages.jsonl loaded fine and then failed (500) on every batch touching a lost passage."""
    import shutil

    from retriever.corpus import CorpusError

    good = tmp_path / "good"
    build_index(corpus, str(good), encoder="bm25", limit=N)
    cut = tmp_path / "cut"
    shutil.copytree(good, cut)
    os.truncate(cut / "passages.jsonl", 10_000)
    with pytest.raises(CorpusError, match="rebuild the index"):
        load_index(str(cut))
    bad = tmp_path / "bad"
    shutil.copytree(good, bad)
    (bad / "manifest.json").write_text("{not json")
    with pytest.raises(RetrieverIndexError, match="manifest.json is not valid JSON"):
        load_index(str(bad))
    (bad / "manifest.json").write_text("[]")
    with pytest.raises(RetrieverIndexError, match="format_version"):
        load_index(str(bad))
    assert load_index(str(good)).search(["Shirley Temple"], 1)


def test_cli_paths_of_the_wrong_kind_are_one_line_errors(corpus, tmp_path, capsys):
    from retriever.build_index import main

    (tmp_path / "afile").write_text("x")
    assert main(["--corpus", corpus, "--index_dir", str(tmp_path / "afile"), "--limit", "8"]) == 2
    assert "File exists" in capsys.readouterr().err
    assert main(["--corpus", str(tmp_path), "--index_dir", str(tmp_path / "idx"), "--limit", "8"]) == 2
    assert "Is a directory" in capsys.readouterr().err


# bm25s gives token-less texts (empty, whitespace, stopwords only) the empty-string token, and a
# query without known tokens got the same token, so it "matched" passages 2 and 0 with score 0.37.
TOKENLESS_CORPUS = [{"id": "0", "title": "", "text": ""},
                    {"id": "1", "title": "Paris", "text": "Paris is the capital of France."},
                    {"id": "2", "title": "", "text": "The of and"},
                    {"id": "3", "title": "Rome", "text": "Rome is in Italy."}]


def _write_tokenless_corpus(tmp_path) -> str:
    path = tmp_path / "tokenless.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in TOKENLESS_CORPUS))
    return str(path)


def test_bm25_never_returns_passages_sharing_no_term_with_the_query(tmp_path, caplog):
    d = str(tmp_path / "bm25")
    with caplog.at_level("WARNING", logger="retriever.index"):
        m = build_index(_write_tokenless_corpus(tmp_path), d, encoder="bm25")
    warnings = [r.getMessage() for r in caplog.records if r.levelname == "WARNING"]
    assert any("2 of 4 passages have no token" in w for w in warnings), warnings
    assert m["params"]["tokenless_passages"] == 2
    index = load_index(d)
    res = index.search(["zzqxv", "what is the", "Italy", "   ", "Paris, Italy"], 4)
    assert res[0] == [] and res[1] == [] and res[3] == []
    assert _ids(res[2:3]) == [["3"]]
    assert sorted(_ids(res[4:5])[0]) == ["1", "3"]
    # Lucene BM25 as bm25s computes it, by hand: idf = ln(1 + (N - df + 0.5) / (df + 0.5)) with N 4, df 1;
    # tf 1; BM25 reads ``contents`` (title + text): |d| 3 ("rome", "rome", "italy"), avgdl (0 + 4 + 0 + 3) / 4:
    # token-less passages have length 0 (with the empty token they had 1, avgdl 2.25, score 0.419)
    idf = np.log(1 + (4 - 1 + 0.5) / (1 + 0.5))
    expected = idf * 1 / (1 + 1.5 * (1 - 0.75 + 0.75 * 3 / 1.75))
    assert res[2][0]["score"] == pytest.approx(expected, rel=1e-5)


def test_bm25_index_built_with_the_empty_token_still_matches_nothing(tmp_path):
    """An index built before the fix (bm25s defaults: token-less passages indexed under "") is searched the
    same way: the empty-string token is never part of a query."""
    import bm25s

    from retriever.corpus import PassageStore
    from retriever.index import _bm25_tokenizer

    d = str(tmp_path / "bm25")
    build_index(_write_tokenless_corpus(tmp_path), d, encoder="bm25")
    store = PassageStore(os.path.join(d, "passages.jsonl"), os.path.join(d, "offsets.npy"))
    tok = _bm25_tokenizer()
    ids = tok.tokenize([store.get(i)["contents"] for i in range(len(store))], return_as="ids",
                       show_progress=False)  # the old build: allow_empty=True
    store.close()
    assert "" in tok.get_vocab_dict()
    model = bm25s.BM25()
    model.index(ids, show_progress=False)
    model.save(os.path.join(d, "bm25"))
    tok.save_vocab(os.path.join(d, "bm25"))
    index = load_index(d)
    assert index.search(["zzqxv", "what is the", "Italy"], 4)[:2] == [[], []]
    assert _ids(index.search(["Italy"], 4)) == [["3"]]
