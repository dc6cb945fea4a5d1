"""Corpus preparation: the KILT 100-word chunker on real KILT pages, and the wiki-18 / plain row forms."""

import json

import pytest

from retriever.corpus import CorpusError, iter_passages, normalize_row
from retriever.prepare_corpus import chunk_kilt_page, clean_kilt_paragraph, iter_prepared, main
from tests.conftest import shared_path


def _pages():
    with open(shared_path("wiki", "kilt_pages_sample99.jsonl")) as f:
        return [json.loads(line) for line in f]


def test_kilt_chunks_are_100_words_markers_gone_no_text_lost():
    pages = _pages()
    assert len(pages) == 99
    total_chunks = 0
    for page in pages:
        title, paras = page["wikipedia_title"], page["text"]
        chunks = chunk_kilt_page(title, paras)
        # every chunk but the page's last has exactly 100 words; the last has 1..100
        assert all(len(c.split()) == 100 for c in chunks[:-1])
        assert chunks and 1 <= len(chunks[-1].split()) <= 100
        assert not any("BULLET::::" in c or "Section::::" in c for c in chunks)
        # no text lost or repeated: the chunks' words are the cleaned body's words, in order
        body = paras  # R1-Searcher keeps the title paragraph as the first words of the first passage
        assert chunks[0].startswith(title.strip())
        expected = " ".join(clean_kilt_paragraph(p) for p in body).split()
        assert " ".join(chunks).split() == expected
        # independent count: every letter/digit of the body survives except those of the markers themselves
        alnum = sum(ch.isalnum() for p in body for ch in p)
        markers = sum(p.count("BULLET::::") * 6 + p.count("Section::::") * 7 for p in body)
        assert sum(ch.isalnum() for c in chunks for ch in c) == alnum - markers
        total_chunks += len(chunks)
    rows = list(iter_prepared(shared_path("wiki", "kilt_pages_sample99.jsonl"), "auto"))
    assert len(rows) == total_chunks
    assert [r["id"] for r in rows] == [str(i) for i in range(len(rows))]
    titles = {p["wikipedia_title"] for p in pages}
    assert {r["title"] for r in rows} == titles  # every page kept, under its title
    for r in rows[:50]:
        assert r["contents"] == f'"{r["title"]}"\n{r["text"]}'


def test_marker_cleaning_keeps_heading_and_bullet_words():
    assert clean_kilt_paragraph("Section::::History.:Typographic variants.\n") == "History. Typographic variants."
    assert clean_kilt_paragraph("BULLET::::- the open back vowel;\n") == "the open back vowel;"
    # the title paragraph is kept by default (R1-Searcher's passages start "Title Title ..."), dropped on request
    assert chunk_kilt_page("X", ["X\n", "a b"]) == ["X a b"]
    assert chunk_kilt_page("X", ["X\n", "a b"], drop_title_paragraph=True) == ["a b"]
    assert chunk_kilt_page("X", ["Not the title\n", "a b"], drop_title_paragraph=True) == ["Not the title a b"]
    assert chunk_kilt_page("X", ["X\n"], drop_title_paragraph=True) == []
    with pytest.raises(ValueError):
        chunk_kilt_page("X", ["a"], words_per_passage=0)


def test_wiki18_and_plain_rows(tmp_path):
    rows = list(iter_prepared(shared_path("wiki", "wiki18_example10.jsonl")))
    assert len(rows) == 10
    with open(shared_path("wiki", "wiki18_example10.jsonl")) as f:
        raw = [json.loads(line) for line in f]
    for r, src in zip(rows, raw):
        assert r["id"] == src["id"]
        assert r["contents"] == src["contents"]  # FlashRAG form round-trips exactly
        assert src["contents"].startswith(f'"{r["title"]}"\n')
    # the shared HotpotQA corpus: {"id","title","contents":"Title\ntext"} with the title unquoted
    hp = next(iter_passages(shared_path("wiki", "hotpotqa_dev500_paragraphs.jsonl")))
    assert hp["title"] == "Meet Corliss Archer" and hp["text"].startswith("Meet Corliss Archer, a program")
    assert normalize_row({"id": 7, "title": "T", "text": " body "}, "0") == \
        {"id": "7", "title": "T", "text": "body", "contents": '"T"\nbody'}
    with pytest.raises(CorpusError):
        normalize_row({"id": "1", "title": "no text"}, "0")


def test_cli_writes_corpus_and_reports_bad_rows(tmp_path, capsys):
    out = tmp_path / "p.jsonl"
    assert main(["--input", shared_path("wiki", "kilt_pages_sample99.jsonl"), "--output", str(out),
                 "--format", "kilt", "--words", "50"]) == 0
    rows = [json.loads(line) for line in open(out)]
    assert rows and all(len(r["text"].split()) <= 50 for r in rows)
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"wikipedia_title": "A", "text": ["A\\n", "x y"]}\n{not json\n')
    assert main(["--input", str(bad), "--output", str(tmp_path / "o.jsonl")]) == 2
    assert "bad.jsonl:2" in capsys.readouterr().err
    assert not (tmp_path / "o.jsonl").exists() and not (tmp_path / "o.jsonl.tmp").exists()


def test_cli_clear_errors_on_empty_non_utf8_and_unknown_rows(tmp_path, capsys):
    out = tmp_path / "o.jsonl"
    out.write_text('{"id": "0", "title": "T", "text": "a corpus made before"}\n')
    cases = {"empty.jsonl": b"", "blank.jsonl": b"\n\n",
             "latin1.jsonl": b'{"id": "1", "title": "x", "text": "ok"}\n{"id": "2", "title": "caf\xe9", "text": "t"}\n',
             "list.jsonl": b"[1, 2]\n",
             "kilt_int_paragraph.jsonl": b'{"wikipedia_title": "x", "text": ["x\\n", 1, null]}\n'}
    for name, data in cases.items():
        (tmp_path / name).write_bytes(data)
        assert main(["--input", str(tmp_path / name), "--output", str(out)]) == 2, name
        err = capsys.readouterr().err
        assert f"{name}:" in err and "Traceback" not in err, err
        # the earlier output is untouched, no temporary file is left
        assert out.read_text() == '{"id": "0", "title": "T", "text": "a corpus made before"}\n'
        assert not (tmp_path / "o.jsonl.tmp").exists()
    assert "latin1.jsonl:2: not UTF-8 (byte 0xe9" in (main(["--input", str(tmp_path / "latin1.jsonl"), "--output",
                                                             str(out)]) and capsys.readouterr().err)


def test_cli_refuses_to_write_over_its_input(tmp_path, capsys):
    src = tmp_path / "pages.jsonl"
    src.write_text('{"wikipedia_title": "A", "text": ["A\\n", "' + "word " * 150 + '"]}\n')
    before = src.read_text()
    with pytest.raises(SystemExit) as e:
        main(["--input", str(src), "--output", str(tmp_path / "." / "pages.jsonl")])
    assert e.value.code == 2 and "is the input file" in capsys.readouterr().err
    assert src.read_text() == before  # the KILT dump is still there


def test_hotpotqa_abstract_rows_auto_detected_and_bad_rows_named(tmp_path):
    from retriever.prepare_corpus import abstract_text, detect_format

    assert detect_format({"title": "T", "text": ["A.", " B."]}) == "hotpotqa_abstracts"
    assert abstract_text(["A.", " B.", [" C."]]) == "A.  B.  C."  # HotpotQA sentences keep their leading space
    with pytest.raises(CorpusError):
        abstract_text("not a list")
    src = tmp_path / "abs.jsonl"
    src.write_text('{"title": "T", "text": ["First.", " Second."]}\n{"title": "Empty", "text": []}\n'
                   '{"title": "U", "text": ["Only."]}\n')
    rows = list(iter_prepared(str(src)))
    assert rows == [{"id": "0", "title": "T", "text": "First.  Second.", "contents": '"T"\nFirst.  Second.'},
                    {"id": "1", "title": "U", "text": "Only.", "contents": '"U"\nOnly.'}]  # the empty one skipped
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"title": "T", "text": ["x"]}\n{"title": 3, "text": ["y"]}\n')
    assert main(["--input", str(bad), "--output", str(tmp_path / "o.jsonl"), "--format", "hotpotqa_abstracts"]) == 2


def test_prepare_reports_copies_and_refuses_repeated_ids(tmp_path, capsys):
    """Duplicates counted at prepare time: copies of a text reported with counts; two passages under one id refused."""
    from retriever.prepare_corpus import main

    rows = [{"id": str(i), "title": "T", "text": f"passage {i}"} for i in range(5)]
    rows += [{"id": f"c{i}", "title": "T", "text": "Passage  1"} for i in range(3)]  # 3 more copies of row 1
    src = tmp_path / "in.jsonl"
    src.write_text("".join(json.dumps(r) + "\n" for r in rows))
    assert main(["--input", str(src), "--output", str(tmp_path / "out.jsonl"), "--format", "plain"]) == 0
    out = capsys.readouterr().out
    assert "wrote 8 passages" in out and "3 repeat the text of an earlier passage (1 texts repeated, the most " \
        "often 4 times" in out
    rows[6]["id"] = "2"
    src.write_text("".join(json.dumps(r) + "\n" for r in rows))
    assert main(["--input", str(src), "--output", str(tmp_path / "out2.jsonl"), "--format", "plain"]) == 2
    err = capsys.readouterr().err.strip().splitlines()[-1]
    assert err.startswith("prepare_corpus: error: 1 of 8 passages repeat an id already used (id '2' at rows 2, 6)")
    assert not (tmp_path / "out2.jsonl").exists()
