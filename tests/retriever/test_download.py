"""retriever.download: the published artefacts' names and repositories, and their reassembly and adoption, tested on a
small MiniLM Flat index over real passages laid out exactly as Search-R1's repositories are (``part_*`` pieces of
the index file, a gzipped wiki-18 jsonl); offline it fails in one line."""

import gzip
import json
import os
import shutil

import pytest

from retriever.download import ARTEFACTS, Artefact, DownloadError, LocalSource, download_and_adopt, fetch_artefact
from retriever.index import load_index
from tests.conftest import shared_path

N = 48
TABLE = {
    "mini-corpus": Artefact("test/wiki-mini-corpus", "wiki-18.jsonl.gz", "wiki-18.jsonl", gunzip=True),
    "mini-flat": Artefact("test/wiki-mini-index", "part_*", "minilm_Flat.index", encoder="minilm",
                          corpus="mini-corpus"),
}


def test_published_names():
    """Repositories and files as Search-R1 names them (scripts/download.py:10-25, docs/retriever.md:5,86-90)."""
    assert ARTEFACTS["wiki18-e5-flat"].repo == "PeterJinGo/wiki-18-e5-index"
    assert ARTEFACTS["wiki18-e5-flat"].output == "e5_Flat.index"
    assert ARTEFACTS["wiki18-e5-hnsw64"].repo == "PeterJinGo/wiki-18-e5-index-HNSW64"
    assert ARTEFACTS["wiki18-corpus"].repo == "PeterJinGo/wiki-18-corpus"
    assert ARTEFACTS["wiki18-corpus"].pattern == "wiki-18.jsonl.gz"
    assert all(ARTEFACTS[k].encoder == "e5-base-v2" for k in ("wiki18-e5-flat", "wiki18-e5-hnsw64"))


@pytest.fixture(scope="module")
def hub(tmp_path_factory):
    """A folder laid out like the two repositories: the corpus gzipped, the index file cut into part_aa..part_ac."""
    import faiss

    from retriever.encoders import get_encoder, resolve_encoder

    root = tmp_path_factory.mktemp("hub")
    rows = []
    with open(shared_path("wiki", "hipporag_musique_paragraphs.jsonl"), encoding="utf-8") as f:
        for line in f:
            r = json.loads(line)
            rows.append({"id": str(len(rows)), "contents": f'"{r["title"]}"\n{r["contents"].split(chr(10), 1)[-1]}'})
            if len(rows) == N:
                break
    os.makedirs(root / "test" / "wiki-mini-corpus")
    with gzip.open(root / "test" / "wiki-mini-corpus" / "wiki-18.jsonl.gz", "wt", encoding="utf-8") as f:
        f.write("".join(json.dumps(r) + "\n" for r in rows))
    vecs = get_encoder(resolve_encoder("minilm")).encode_passages([r["contents"] for r in rows])
    index = faiss.index_factory(vecs.shape[1], "Flat", faiss.METRIC_INNER_PRODUCT)
    index.add(vecs)
    whole = root / "whole.index"
    faiss.write_index(index, str(whole))
    data = whole.read_bytes()
    os.makedirs(root / "test" / "wiki-mini-index")
    cut = [0, len(data) // 3, 2 * len(data) // 3, len(data)]
    for name, a, b in zip(("part_aa", "part_ab", "part_ac"), cut, cut[1:]):
        (root / "test" / "wiki-mini-index" / name).write_bytes(data[a:b])
    return root, rows, vecs, data


def test_reassemble_and_adopt(hub, tmp_path):
    root, rows, vecs, data = hub
    save = tmp_path / "save"
    m = download_and_adopt("mini-flat", str(save), source=LocalSource(str(root)), artefacts=TABLE, verify_sample=16)
    assert (save / "minilm_Flat.index").read_bytes() == data  # parts concatenated in name order
    with open(save / "wiki-18.jsonl", encoding="utf-8") as f:  # gunzipped
        assert [json.loads(line) for line in f] == rows
    assert m["count"] == N and m["adopted"]["faiss_index"] == str(save / "minilm_Flat.index")
    assert m["adopted"]["verification"]["min_cosine"] > 0.999
    idx = load_index(str(save / "index_mini-flat"))
    try:
        hits = idx.search_embeddings(vecs[:5], 1)
        assert [h[0]["id"] for h in hits] == [r["id"] for r in rows[:5]]
        assert idx.info()["adopted_from"] == str(save / "minilm_Flat.index")
    finally:
        idx.close()
    # a second run reuses what is there without the source
    assert fetch_artefact(TABLE["mini-flat"], str(save), source=None) == str(save / "minilm_Flat.index")


def test_interrupted_part_refetched_and_short_fetch_refused(hub, tmp_path):
    root, _, _, data = hub
    save = tmp_path / "save"
    os.makedirs(save)
    shutil.copy(root / "test" / "wiki-mini-index" / "part_aa", save / "part_aa")
    (save / "part_ab").write_bytes((root / "test" / "wiki-mini-index" / "part_ab").read_bytes()[:-100])  # cut short
    assert open(fetch_artefact(TABLE["mini-flat"], str(save), LocalSource(str(root))), "rb").read() == data

    class ShortSource(LocalSource):
        def fetch(self, repo, name, dest_dir):
            path = super().fetch(repo, name, dest_dir)
            with open(path, "r+b") as f:
                f.truncate(os.path.getsize(path) - 100)
            return path

    short = r"part_aa: [\d,]+ bytes, test/wiki-mini-index lists [\d,]+ \(100 missing\)"
    with pytest.raises(DownloadError, match=short):
        fetch_artefact(TABLE["mini-flat"], str(tmp_path / "other"), ShortSource(str(root)))
    assert not os.path.exists(tmp_path / "other" / "minilm_Flat.index")


def test_corrupt_gzip_refused(hub, tmp_path):
    root, _, _, _ = hub
    bad = tmp_path / "badhub"
    shutil.copytree(root / "test" / "wiki-mini-corpus", bad / "test" / "wiki-mini-corpus")
    gz = bad / "test" / "wiki-mini-corpus" / "wiki-18.jsonl.gz"
    gz.write_bytes(gz.read_bytes()[:-50])
    with pytest.raises(DownloadError, match="not a complete gzip file"):
        fetch_artefact(TABLE["mini-corpus"], str(tmp_path / "save"), LocalSource(str(bad)))
    assert not os.path.exists(tmp_path / "save" / "wiki-18.jsonl")


def test_offline_fails_in_one_line(tmp_path, capsys, monkeypatch):
    from retriever.download import main

    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    assert main(["--index", "wiki18-e5-flat", "--save_path", str(tmp_path)]) == 2
    err = [x for x in capsys.readouterr().err.splitlines() if x.startswith("download:")]
    assert len(err) == 1 and err[0].startswith("download: error: cannot reach the Hugging Face Hub for "
                                               "PeterJinGo/wiki-18-corpus")
    assert "--from_dir" in err[0]


def test_parts_are_deleted_after_assembly_unless_kept_and_the_disk_is_checked_first(hub, tmp_path, monkeypatch):
    """Parts beside the assembled index double the disk (2 x 60 GiB for wiki-18's Flat index): they go once the
    result is checked, --keep_parts keeps them, and too little free space is refused before anything is fetched."""
    import retriever.download as download

    root, _, _, data = hub
    parts = ("part_aa", "part_ab", "part_ac")
    out = fetch_artefact(TABLE["mini-flat"], str(tmp_path / "a"), LocalSource(str(root)))
    assert open(out, "rb").read() == data and not any((tmp_path / "a" / p).exists() for p in parts)
    fetch_artefact(TABLE["mini-flat"], str(tmp_path / "b"), LocalSource(str(root)), keep_parts=True)
    assert all((tmp_path / "b" / p).exists() for p in parts)
    listing = LocalSource(str(root)).list("test/wiki-mini-index")
    need, why = download.disk_needed(TABLE["mini-flat"], listing, sorted(listing), str(tmp_path / "c"), False)
    assert need == 2 * len(data) and "side by side" in why  # the parts and the result
    usage = shutil.disk_usage(str(tmp_path))
    monkeypatch.setattr(download.shutil, "disk_usage", lambda p: usage._replace(free=len(data)))
    with pytest.raises(DownloadError, match="GB needed"):
        fetch_artefact(TABLE["mini-flat"], str(tmp_path / "c"), LocalSource(str(root)))
    assert not any((tmp_path / "c" / p).exists() for p in parts)  # refused before fetching
