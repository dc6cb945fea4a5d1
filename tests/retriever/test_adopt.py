"""Adopting a faiss index built elsewhere (retriever/adopt.py): faiss Flat, HNSW and IVF indexes written by faiss over
real passages of ../shared/data/wiki (wiki-18 row form) with the MiniLM encoder, the way Search-R1's index builder
writes them (``index_factory(dim, "Flat" | "HNSW..", METRIC_INNER_PRODUCT)`` over the encoded ``contents``), served
through retriever.server with the same top-k as an index we build from the same vectors; wrong encoders, corpora in
another order, other sizes, dimensions and metrics refused with one line naming the check."""

import gzip
import json
import os
import shutil

import numpy as np
import pytest

from retriever.adopt import AdoptionError, adopt_index
from retriever.embeddings import save_chunk
from retriever.index import build_index, load_index, read_manifest
from tests.conftest import shared_path

N = 160  # passages: MiniLM encodes ~35 passages/s on these cores


@pytest.fixture(scope="module")
def work(tmp_path_factory):
    return tmp_path_factory.mktemp("adopt")


@pytest.fixture(scope="module")
def wiki18_rows():
    """The first N HotpotQA dev paragraphs as wiki-18 rows ``{"id", "contents": "\\"Title\\"\\ntext"}``."""
    rows = []
    with open(shared_path("wiki", "hotpotqa_dev500_paragraphs.jsonl"), encoding="utf-8") as f:
        for line in f:
            r = json.loads(line)
            text = r["contents"].split("\n", 1)[1] if "\n" in r["contents"] else r["contents"]
            rows.append({"id": str(len(rows)), "contents": f'"{r["title"]}"\n{text}'})
            if len(rows) == N:
                break
    return rows


def _write_jsonl(path, rows, gz=False):
    opener = gzip.open if gz else open
    with opener(path, "wt", encoding="utf-8") as f:
        for r in rows:
            f.write(json.dumps(r, ensure_ascii=False) + "\n")
    return str(path)


@pytest.fixture(scope="module")
def corpus(work, wiki18_rows):
    return _write_jsonl(work / "wiki18_sample.jsonl", wiki18_rows)


@pytest.fixture(scope="module")
def vectors(wiki18_rows):
    """MiniLM vectors of each row's ``contents`` as it is (what Search-R1's index_builder.py encodes), once."""
    from retriever.encoders import get_encoder, resolve_encoder

    return get_encoder(resolve_encoder("minilm")).encode_passages([r["contents"] for r in wiki18_rows])


def _faiss_file(path, vecs, factory):
    import faiss

    index = faiss.index_factory(vecs.shape[1], factory, faiss.METRIC_INNER_PRODUCT)
    if not index.is_trained:
        index.train(vecs)
    index.add(vecs)
    faiss.write_index(index, str(path))
    return str(path)


@pytest.fixture(scope="module")
def flat_file(work, vectors):
    return _faiss_file(work / "minilm_Flat.index", vectors, "Flat")


@pytest.fixture(scope="module")
def hnsw_file(work, vectors):
    return _faiss_file(work / "minilm_HNSW32.index", vectors, "HNSW32")


@pytest.fixture(scope="module")
def questions():
    with open(shared_path("qa", "with_paragraphs", "hotpotqa_dev500_ircot.jsonl")) as f:
        return [json.loads(line)["question_text"] for _, line in zip(range(24), f)]


def _own_index(corpus, index_dir, vectors, index_type):
    """Our own build of ``corpus`` whose encoding step writes ``vectors`` (the very vectors of the adopted file)."""
    def same_vectors(store, encoder, emb_dir, chunk_size):
        os.makedirs(emb_dir, exist_ok=True)
        save_chunk(emb_dir, 0, vectors)
        return vectors.shape[1]

    build_index(corpus, str(index_dir), encoder="minilm", index_type=index_type, chunk_size=len(vectors),
                overwrite=True, encode_fn=same_vectors)
    return str(index_dir)


@pytest.fixture(scope="module")
def adopted_flat(work, corpus, flat_file):
    from retriever.build_index import main

    out = str(work / "adopted_flat")
    assert main(["--corpus", corpus, "--index_dir", out, "--encoder", "minilm", "--faiss_index", flat_file]) == 0
    return out


def _ids(results):
    return [[p["id"] for p in hits] for hits in results]


def test_adopted_flat_manifest_and_verification(adopted_flat, flat_file, wiki18_rows):
    m = read_manifest(adopted_flat)
    assert m["count"] == N and m["dim"] == 384 and m["index_type"] == "flat"
    assert m["adopted"]["faiss_index"] == os.path.abspath(flat_file)
    assert m["adopted"]["mmap"] is True  # IO_FLAG_MMAP_IFC maps Flat vectors
    v = m["adopted"]["verification"]
    assert v["method"] == "reconstruct" and v["sample"] == 64 and v["min_cosine"] > 0.999
    # nothing copied: no index.faiss, no embeddings in the index folder
    assert not os.path.exists(os.path.join(adopted_flat, "index.faiss"))
    assert not os.path.exists(os.path.join(adopted_flat, "embeddings"))
    # the passage store keeps each row's contents byte for byte (what the vectors were encoded from)
    with open(os.path.join(adopted_flat, "passages.jsonl"), encoding="utf-8") as f:
        stored = [json.loads(line) for line in f]
    assert [p["contents"] for p in stored] == [r["contents"] for r in wiki18_rows]
    assert [p["id"] for p in stored] == [r["id"] for r in wiki18_rows]


@pytest.mark.parametrize("kind", ["flat", "hnsw"])
def test_adopted_index_has_the_top_k_of_our_own_build(kind, work, corpus, vectors, flat_file, hnsw_file,
                                                        adopted_flat, questions):
    if kind == "flat":
        adopted = adopted_flat
    else:
        adopted = str(work / "adopted_hnsw")
        adopt_index(corpus, adopted, hnsw_file, "minilm")
        assert read_manifest(adopted)["params"]["ef_search"] == 16  # faiss' default, kept from the file
    own = _own_index(corpus, work / f"own_{kind}", vectors, kind)
    a = load_index(adopted, ef_search=128)
    b = load_index(own, ef_search=128)
    try:
        ra, rb = a.search(questions, 5), b.search(questions, 5)
        assert _ids(ra) == _ids(rb)
        assert np.allclose([[p["score"] for p in h] for h in ra], [[p["score"] for p in h] for h in rb], atol=1e-5)
        assert a.info()["adopted"] is True and a.info()["adopted_from"].endswith(os.path.basename(
            flat_file if kind == "flat" else hnsw_file))
        assert b.info()["adopted"] is False
    finally:
        a.close()
        b.close()


def test_adopted_flat_served_by_retriever_server(adopted_flat, flat_file, corpus, vectors, work, questions):
    import httpx

    from retriever.launch import start_server_process, stop_server_process

    own = load_index(_own_index(corpus, work / "own_flat_served", vectors, "flat"))
    expected = _ids(own.search(questions[:8], 3))
    own.close()
    proc, url = start_server_process(adopted_flat)
    try:
        h = httpx.get(url + "/health", timeout=30).json()
        assert h["adopted"] is True and h["adopted_from"] == os.path.abspath(flat_file)
        assert h["placement"] == "mmap" and h["count"] == N
        r = httpx.post(url + "/retrieve", json={"queries": questions[:8], "topk": 3}, timeout=60).json()
        assert [[d["id"] for d in hits] for hits in r["result"]] == expected
    finally:
        stop_server_process(proc)


def test_wrong_encoder_refused_in_one_line(work, corpus, flat_file, capsys):
    """The same MiniLM weights with CLS pooling instead of mean (same 384 dims): the encoding check fails."""
    from retriever.build_index import main
    from retriever.encoders import minilm_model_path

    cls_model = work / "minilm_cls"
    if not cls_model.exists():
        shutil.copytree(minilm_model_path(), cls_model)
        cfg_path = cls_model / "1_Pooling" / "config.json"
        cfg = json.loads(cfg_path.read_text())
        cfg.update(pooling_mode_cls_token=True, pooling_mode_mean_tokens=False)
        cfg_path.write_text(json.dumps(cfg))
    out = work / "refused_encoder"
    rc = main(["--corpus", corpus, "--index_dir", str(out), "--encoder", str(cls_model), "--faiss_index", flat_file])
    lines = [x for x in capsys.readouterr().err.splitlines() if x.startswith("build_index:")]  # not progress bars
    assert rc == 2 and len(lines) == 1
    err = lines[0]
    assert err.startswith("build_index: error: encoding: 64 of 64 sampled passages"), err
    assert "cosine median" in err
    assert not os.path.exists(out / "manifest.json")  # nothing to serve


def test_wrong_prefix_refused(work, corpus, flat_file):
    with pytest.raises(AdoptionError, match=r"^encoding: \d+ of 64 sampled passages .*prefix 'passage: '"):
        adopt_index(corpus, str(work / "refused_prefix"), flat_file, "minilm", passage_prefix="passage: ")


def test_shuffled_corpus_refused(work, wiki18_rows, flat_file):
    rows = list(wiki18_rows)
    np.random.default_rng(1).shuffle(rows)
    shuffled = _write_jsonl(work / "shuffled.jsonl", rows)
    with pytest.raises(AdoptionError) as e:
        adopt_index(shuffled, str(work / "refused_shuffled"), flat_file, "minilm")
    msg = str(e.value)
    assert msg.startswith("corpus order: ") and "stored at another row" in msg and "\n" not in msg


def test_size_dimension_and_metric_refused(work, wiki18_rows, vectors, corpus, flat_file):
    shorter = _write_jsonl(work / "shorter.jsonl", wiki18_rows[:-3])
    with pytest.raises(AdoptionError, match=r"^row count: the index holds 160 vectors, the corpus 157 passages "
                                            r"\(3 more in the index\)"):
        adopt_index(shorter, str(work / "refused_rows"), flat_file, "minilm")
    wide = _faiss_file(work / "wide.index", np.hstack([vectors, vectors]) / np.sqrt(2), "Flat")
    with pytest.raises(AdoptionError, match=r"^dimension: the index's vectors have 768 dims, encoder minilm gives 384"):
        adopt_index(corpus, str(work / "refused_dim"), wide, "minilm")
    import faiss

    l2 = faiss.IndexFlatL2(384)
    l2.add(vectors)
    faiss.write_index(l2, str(work / "l2.index"))
    with pytest.raises(AdoptionError, match=r"^metric: the index ranks by L2"):
        adopt_index(corpus, str(work / "refused_l2"), str(work / "l2.index"), "minilm")


def test_ivf_index_verified_by_self_retrieval(work, corpus, vectors, wiki18_rows, questions):
    """IVF has no exact stored vectors: each sampled passage must retrieve itself at rank 1."""
    ivf = _faiss_file(work / "ivf.index", vectors, "IVF4,Flat")
    import faiss

    ix = faiss.read_index(ivf)
    faiss.extract_index_ivf(ix).nprobe = 4  # all cells: exact
    faiss.write_index(ix, ivf)
    m = adopt_index(corpus, str(work / "adopted_ivf"), ivf, "minilm")
    assert m["adopted"]["verification"]["method"] == "self_retrieval"
    assert m["adopted"]["verification"]["rank1"] == 1.0 and m["params"]["nprobe"] == 4
    a = load_index(str(work / "adopted_ivf"))
    own = load_index(_own_index(corpus, work / "own_flat_ivf", vectors, "flat"))
    try:
        assert _ids(a.search(questions, 3)) == _ids(own.search(questions, 3))
    finally:
        a.close()
        own.close()
    rows = list(wiki18_rows)
    np.random.default_rng(2).shuffle(rows)
    with pytest.raises(AdoptionError, match=r"^encoding: \d+ of 64 sampled passages .* do not retrieve themselves"):
        adopt_index(_write_jsonl(work / "shuffled_ivf.jsonl", rows), str(work / "refused_ivf"), ivf, "minilm")


def test_gz_corpus_and_replaced_index_file(work, wiki18_rows, vectors):
    """The corpus read straight from jsonl.gz (Search-R1 publishes wiki-18.jsonl.gz); an index file that changed
    after adoption is refused at load time instead of serving other vectors."""
    gz = _write_jsonl(work / "wiki18_sample.jsonl.gz", wiki18_rows, gz=True)
    src = _faiss_file(work / "gz_Flat.index", vectors, "Flat")
    adopt_index(gz, str(work / "adopted_gz"), src, "minilm")
    idx = load_index(str(work / "adopted_gz"))
    assert len(idx) == N and idx.store.get(5)["contents"] == wiki18_rows[5]["contents"]
    idx.close()
    _faiss_file(src, vectors[:-1], "Flat")
    from retriever.index import RetrieverIndexError

    with pytest.raises(RetrieverIndexError, match="adopt it again"):
        load_index(str(work / "adopted_gz"))
