"""The embedded default data: answers are in the corpus, 2-hop questions need two passages, builds are deterministic."""

import json
import os
import re

import pytest

from cpu_demo.data.default_dataset import build_corpus, build_default_dataset, build_questions
from cpu_demo.data.countries import load_country_facts
from cpu_demo.data.qa import QADataError, load_qa_jsonl
from tests.conftest import shared_path


@pytest.fixture(scope="module")
def built(tmp_path_factory):
    out = tmp_path_factory.mktemp("default_data")
    ds = build_default_dataset(str(out), seed=3)
    corpus = {r["id"]: r for r in map(json.loads, open(ds.corpus_path))}
    train = [json.loads(line) for line in open(ds.train_path)]
    evalq = [json.loads(line) for line in open(ds.eval_path)]
    return ds, corpus, train, evalq


def _has(text, s):
    return re.search(r"(?<!\w)" + re.escape(s) + r"(?!\w)", text) is not None


def test_corpus_rows_and_sizes(built):
    ds, corpus, train, evalq = built
    assert ds.n_passages == len(corpus) > 300
    for row in corpus.values():
        assert set(row) == {"id", "title", "text", "contents"}
        assert row["contents"] == f'"{row["title"]}"\n{row["text"]}'
        assert 30 <= len(row["text"].split()) <= 160
    assert len(train) == ds.n_train and len(evalq) == ds.n_eval
    assert {r["hops"] for r in train} == {1, 2}
    assert not {r["id"] for r in train} & {r["id"] for r in evalq}


def test_answers_supported_by_corpus(built):
    _, corpus, train, evalq = built
    for row in train + evalq:
        assert row["answer"] == row["golden_answers"][0]
        support = [corpus[i] for i in row["supporting_ids"]]
        # the last supporting passage states the answer; the first one matches the question's anchor entity
        assert _has(support[-1]["text"], row["answer"]), row
        assert _has(support[0]["text"], row["anchors"][0]), row


def test_two_hop_needs_two_passages(built):
    _, corpus, train, evalq = built
    two_hop = [r for r in train + evalq if r["hops"] == 2]
    assert len(two_hop) > 100
    texts = [c["text"] for c in corpus.values()]
    for row in two_hop:
        assert len(set(row["supporting_ids"])) >= 2
        # no single passage holds every anchor of the question together with the answer
        for text in texts:
            assert not (all(_has(text, a) for a in row["anchors"]) and _has(text, row["answer"])), (row, text)


def test_deterministic_by_seed(tmp_path):
    a = build_default_dataset(str(tmp_path / "a"), seed=7)
    b = build_default_dataset(str(tmp_path / "b"), seed=7)
    c = build_default_dataset(str(tmp_path / "c"), seed=8)
    for name in ("corpus_path", "train_path", "eval_path"):
        assert open(getattr(a, name), "rb").read() == open(getattr(b, name), "rb").read()
    assert open(a.train_path).read() != open(c.train_path).read()
    assert open(a.corpus_path).read() == open(c.corpus_path).read()  # the corpus does not depend on the seed


def test_refuses_package_tree():
    import cpu_demo
    import openrlhf_search

    pkg, demo = os.path.dirname(openrlhf_search.__file__), os.path.dirname(cpu_demo.__file__)
    for inside in (os.path.join(pkg, "data_out"), os.path.join(demo, "data", "out"), os.path.join(demo, "x")):
        with pytest.raises(ValueError, match="package source"):
            build_default_dataset(inside)
        assert not os.path.exists(inside)


def test_question_generation_is_consistent_with_facts():
    facts = load_country_facts()
    by_code = {f.code: f for f in facts}
    qs = build_questions(facts)
    corpus_ids = {r["id"] for r in build_corpus(facts)}
    for q in qs:
        assert set(q["supporting_ids"]) <= corpus_ids
        if q["type"] == "capital":
            assert q["answer"] == by_code[q["supporting_ids"][0].split("-")[0]].capital


def test_load_qa_real_formats(tmp_path):
    r1 = load_qa_jsonl(shared_path("qa", "r1searcher", "stage_1.jsonl"), limit=5)
    assert len(r1) == 5 and all(r["golden_answers"] and r["question"] for r in r1)
    fr = load_qa_jsonl(shared_path("qa", "flashrag", "nq.test.jsonl"), limit=5)
    assert all(isinstance(r["golden_answers"], list) for r in fr)
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"question": "q?"}\n')
    with pytest.raises(QADataError, match="bad.jsonl: row 0: no gold answer"):
        load_qa_jsonl(str(bad))
    (tmp_path / "empty.jsonl").write_text("\n")
    with pytest.raises(QADataError, match="no QA rows"):
        load_qa_jsonl(str(tmp_path / "empty.jsonl"))
    with pytest.raises(QADataError, match="not found"):
        load_qa_jsonl(str(tmp_path / "missing.jsonl"))
