"""Retriever URLs are checked before a job: healthy, and all serving one index (the /health fingerprint), on the
driver and on every Ray node."""

import copy

import pytest

from openrlhf_search.launch.retriever_check import (RetrieverCheckError, check_on_ray_nodes, check_retrievers,
                                             expected_fingerprint, fetch_health, main)
from retriever.index import manifest_fingerprint
from tests.test_launchers import _FakeHealth, _free_port

MANIFEST = {"format_version": 1, "index_type": "flat", "encoder": {"name": "e5-base-v2", "query_prefix": "query: "},
            "count": 21015324, "dim": 768, "limit": None, "params": {}, "corpus_path": "/data/a/wiki-18.jsonl",
            "build_seconds": 1.0, "built_at": "2026-01-01T00:00:00", "embeddings_dir": "/data/a/emb"}


def test_fingerprint_names_what_is_served_not_where_or_when():
    fp = manifest_fingerprint(MANIFEST)
    moved = dict(MANIFEST, corpus_path="/mnt/other/wiki-18.jsonl", built_at="2027-02-02T00:00:00",
                 build_seconds=99.0, embeddings_dir="/x")
    assert manifest_fingerprint(moved) == fp and len(fp) == 16
    for key, value in [("count", 4858), ("index_type", "hnsw"), ("dim", 384), ("limit", 300),
                       ("corpus_path", "/data/a/kilt_100w.jsonl")]:
        assert manifest_fingerprint(dict(MANIFEST, **{key: value})) != fp, key
    other_encoder = copy.deepcopy(MANIFEST)
    other_encoder["encoder"]["name"] = "bge-large-en-v1.5"
    assert manifest_fingerprint(other_encoder) != fp


def test_check_retrievers_on_fake_services():
    a, a2, b = _FakeHealth("a" * 16), _FakeHealth("a" * 16), _FakeHealth("b" * 16)
    try:
        assert check_retrievers([a.url, a2.url]) == "a" * 16
        assert check_retrievers([a.url], expected="a" * 16) == "a" * 16
        with pytest.raises(RetrieverCheckError, match="retrievers disagree"):
            check_retrievers([a.url, b.url])
        with pytest.raises(RetrieverCheckError, match=f"retriever {b.url} serves index bbbb.*expected aaaa"):
            check_retrievers([a.url, b.url], expected="a" * 16)
        dead = f"http://127.0.0.1:{_free_port()}"
        with pytest.raises(RetrieverCheckError, match="did not answer"):
            check_retrievers([a.url, dead], timeout=2)
        with pytest.raises(RetrieverCheckError, match="no retriever URL"):
            check_retrievers([])
        with pytest.raises(RetrieverCheckError, match="not an http"):
            check_retrievers(["localhost:8000"])
    finally:
        for s in (a, a2, b):
            s.close()


def test_a_service_without_fingerprint_is_refused():
    s = _FakeHealth(None)
    try:
        with pytest.raises(RetrieverCheckError, match="names no index fingerprint"):
            fetch_health(s.url)
    finally:
        s.close()


def test_cli_and_the_real_server_report_the_manifest_fingerprint(tmp_path, capsys):
    from retriever.launch import running_retriever
    from tests.conftest import shared_path

    corpus = shared_path("wiki", "hotpotqa_dev500_paragraphs.jsonl")
    with running_retriever(corpus, str(tmp_path), encoder="bm25", limit=100) as url:
        health = fetch_health(url)
        index_dir = health["index_dir"]
        assert health["fingerprint"] == expected_fingerprint(index_dir)
        assert main(["--urls", url, "--index_dir", index_dir]) == 0
        assert capsys.readouterr().out.strip() == health["fingerprint"]
        assert main(["--urls", f"{url},{url}", "--fingerprint", "f" * 16]) == 1
        err = capsys.readouterr().err
        assert err.startswith("error: retriever") and err.count("\n") == 1  # one line
    with pytest.raises(RetrieverCheckError, match="no readable manifest.json"):
        expected_fingerprint(str(tmp_path / "nothing"))


def test_check_on_every_ray_node():
    """The driver's check runs where the rollout actors run (here the one local node, which has no GPU)."""
    import ray

    good, bad = _FakeHealth("c" * 16), _FakeHealth("d" * 16)
    ray.init(num_cpus=1, include_dashboard=False, log_to_driver=False)
    try:
        assert check_on_ray_nodes([good.url]) == "c" * 16
        with pytest.raises(RetrieverCheckError, match=r"^node .*: retrievers disagree"):
            check_on_ray_nodes([good.url, bad.url])
        with pytest.raises(RetrieverCheckError, match="expected eeee"):
            check_on_ray_nodes([good.url], expected="e" * 16)
    finally:
        ray.shutdown()
        good.close()
        bad.close()


def test_train_cli_refuses_to_start_when_the_check_fails(monkeypatch, capsys):
    """cli.train.main: a failed retriever check is one line and exit 1; train() is never called."""
    from openrlhf_search.cli import train as cli

    called = []

    def fake_run(args, cfg):
        raise RetrieverCheckError("retriever http://x:1: /health did not answer (refused)")

    monkeypatch.setattr(cli, "run", fake_run)
    monkeypatch.setenv("MEMORY_CHECK", "0")  # OpenRLHF's defaults put a 7B policy on one GPU at ZeRO-2
    monkeypatch.setenv("DISK_CHECK", "0")
    rc = cli.main(["--actor.model_name_or_path", "Qwen/Qwen2.5-7B", "--data.prompt_dataset", "x.jsonl"])
    assert rc == 1 and not called
    err = capsys.readouterr().err.strip().splitlines()[-1]
    assert err == "error: retriever http://x:1: /health did not answer (refused) (the job does not start)"
