"""CLI + functions: turn a Wikipedia dump into the canonical passage corpus ``{"id","title","text","contents"}``.

    python -m retriever.prepare_corpus --input X.jsonl --output Y.jsonl \\
        [--format kilt|hotpotqa_abstracts|wiki18|plain|auto]

Formats:
- ``kilt``: KILT knowledge-source pages ``{"wikipedia_title", "text": [paragraph, ...]}`` -> 100-word
  non-overlapping passages (R1-Searcher's recipe, ``wiki_corpus_index_bulid``), see ``chunk_kilt_page``;
- ``hotpotqa_abstracts``: HotpotQA's 2017 Wikipedia abstracts (``enwiki-20171001-pages-meta-current-withlinks-
  abstracts.tar.bz2`` from the HotpotQA site, the corpus R1-Searcher's released training retrieves from,
  ``train/wiki_corpus_load.py:55-56``): the ``.tar.bz2`` itself, its unpacked folder (``AA/wiki_00.bz2``, ...) or a
  jsonl of its rows ``{"title", "text": [sentence, ...]}`` -> one passage per article, the sentences joined by a
  space (``" ".join``: HotpotQA's sentences after the first start with a space, which gives the double spaces of
  R1-Searcher's passages, "Texas.  Nidal Hasan"), ids 0, 1, ... in dump order as in their TSV; an article without
  text is skipped. ``openrlhf_search.env.paper_protocols.R1SearcherProtocol`` with
  ``passage_format="hotpotqa_abstracts"`` writes each passage back as the released TSV line,
  ``(1)Title: T Text:  abstract``;
- ``wiki18``: FlashRAG / Search-R1 rows ``{"id", "contents": "\"Title\"\ntext"}``, passed through;
- ``plain``: ``{"id", "title", "text"}`` rows (or ``{"id","title","contents"}``), passed through;
- ``auto``: decided from the first row.
Streaming: one page in memory at a time, whatever the dump size.

Chunking choices (checked on ``kilt_pages_sample99.jsonl``, where every page's first paragraph is its title):
1. the first paragraph, which repeats the page title, is kept as the passage's first words: R1-Searcher's own
   passages read "House of Hanover   House of Hanover The House of Hanover ..." (title, then text starting with the
   title again) in its published traces; ``drop_title_paragraph=True`` (``--drop_title_paragraph``) drops it;
2. ``BULLET::::`` markers (with the list dash after them, ``BULLET::::- item``) are removed, the item kept;
3. ``Section::::`` markers are removed and the heading words kept, nested headings ``A.:B.`` becoming
   ``A. B.`` (R1-Searcher's passages read "... Unification of Germany. Early life. Prince George ...");
4. the remaining paragraphs are joined and cut into consecutive 100-word pieces (words = whitespace
   tokens); the last piece of a page may be shorter; no words are dropped or repeated.
"""

import argparse
import bz2
import json
import os
import re
import sys
import tarfile
from typing import Iterable, Iterator

from .corpus import CorpusError, DuplicateCounter, iter_jsonl, make_contents, normalize_row

FORMATS = ("auto", "kilt", "hotpotqa_abstracts", "wiki18", "plain")
_BULLET = re.compile(r"BULLET::::\s*-?\s*")
_SECTION = re.compile(r"Section::::")


def clean_kilt_paragraph(paragraph: str) -> str:
    """Remove KILT's ``BULLET::::`` / ``Section::::`` markers from one paragraph (see module docstring)."""
    if paragraph.startswith("Section::::"):
        paragraph = paragraph[len("Section::::"):].replace(".:", ". ")
    paragraph = _SECTION.sub("", paragraph)
    return _BULLET.sub("", paragraph).strip()


def chunk_kilt_page(title: str, paragraphs: list[str], words_per_passage: int = 100,
                    drop_title_paragraph: bool = False) -> list[str]:
    """One KILT page -> its passage texts: markers removed, ``words_per_passage``-word non-overlapping chunks.

    Args:
        title: ``wikipedia_title``.
        drop_title_paragraph: drop a first paragraph equal to the title (default keeps it, as R1-Searcher).
        paragraphs: KILT ``text`` list (each ends with a newline).
    Returns:
        passage texts (words joined by single spaces); [] for a page with no words.
    Raises:
        ValueError: ``words_per_passage`` < 1.
    """
    if words_per_passage < 1:
        raise ValueError("words_per_passage must be >= 1")
    paras = list(paragraphs)
    if drop_title_paragraph and paras and paras[0].strip() == title.strip():
        paras = paras[1:]
    words: list[str] = []
    for p in paras:
        words.extend(clean_kilt_paragraph(p).split())
    return [" ".join(words[i:i + words_per_passage]) for i in range(0, len(words), words_per_passage)]


def abstract_text(sentences) -> str:
    """One HotpotQA abstract from its ``text`` field: sentences joined by a space (nested lists flattened).

    Raises:
        CorpusError: ``text`` is not a list of strings (or of lists of strings).
    """
    if not isinstance(sentences, list):
        raise CorpusError("HotpotQA abstract row needs 'text' as a list of sentences")
    flat: list[str] = []
    for item in sentences:
        items = item if isinstance(item, list) else [item]
        if not all(isinstance(x, str) for x in items):
            raise CorpusError("HotpotQA abstract 'text' holds something that is not a sentence string")
        flat.extend(items)
    return " ".join(flat).strip()


def _abstract_rows(path: str) -> Iterator[tuple[str, int, object]]:
    """(where, line number, decoded row) over a HotpotQA abstracts dump: ``.tar.bz2`` / ``.tar``, an unpacked folder
    of ``.bz2`` (or plain) JSON-lines files, or one such file. Raises CorpusError on a line that is not JSON."""
    def lines_of(name: str, raw: bytes) -> Iterator[tuple[str, int, object]]:
        data = bz2.decompress(raw) if name.endswith(".bz2") else raw
        for n, line in enumerate(data.decode("utf-8").splitlines(), 1):
            if line.strip():
                try:
                    yield name, n, json.loads(line)
                except json.JSONDecodeError as e:
                    raise CorpusError(f"{name}:{n}: invalid JSON ({e})") from e

    if os.path.isdir(path):
        for root, dirs, files in os.walk(path):
            dirs.sort()
            for f in sorted(files):
                if not f.startswith("."):
                    full = os.path.join(root, f)
                    with open(full, "rb") as fh:
                        yield from lines_of(full, fh.read())
    elif tarfile.is_tarfile(path):
        with tarfile.open(path, "r|*") as tar:  # streaming: members in archive order, one file in memory
            for member in tar:
                if member.isfile() and not os.path.basename(member.name).startswith("."):
                    yield from lines_of(f"{path}:{member.name}", tar.extractfile(member).read())
    elif path.endswith(".bz2"):
        with open(path, "rb") as fh:
            yield from lines_of(path, fh.read())
    else:
        for line_no, row in iter_jsonl(path):
            yield path, line_no, row


def iter_hotpotqa_abstracts(path: str) -> Iterator[dict]:
    """Canonical passages ``{"id","title","text","contents"}`` from a HotpotQA 2017 abstracts dump (module doc).

    Raises:
        CorpusError: a row without a string ``title`` or a sentence-list ``text`` (names file and line), or no
            passage at all.
    """
    n = 0
    for where, line_no, row in _abstract_rows(path):
        try:
            if not isinstance(row, dict) or not isinstance(row.get("title"), str):
                raise CorpusError("HotpotQA abstract row needs a 'title' string")
            text = abstract_text(row.get("text"))
        except CorpusError as e:
            raise CorpusError(f"{where}:{line_no}: {e}") from e
        if not text:
            continue
        title = row["title"].strip()
        yield {"id": str(n), "title": title, "text": text, "contents": make_contents(title, text)}
        n += 1
    if n == 0:
        raise CorpusError(f"{path}: no passages")


def detect_format(row: dict) -> str:
    """``kilt`` / ``hotpotqa_abstracts`` / ``wiki18`` / ``plain`` from one decoded row. Raises CorpusError if none
    fits."""
    if isinstance(row, dict):
        if "wikipedia_title" in row and isinstance(row.get("text"), list):
            return "kilt"
        if isinstance(row.get("title"), str) and isinstance(row.get("text"), list):
            return "hotpotqa_abstracts"
        if isinstance(row.get("text"), str):
            return "plain"
        if isinstance(row.get("contents"), str):
            return "plain" if isinstance(row.get("title"), str) else "wiki18"
    keys = sorted(row) if isinstance(row, dict) else type(row)
    raise CorpusError(f"cannot tell the corpus format from a row with keys {keys}")


def iter_prepared(path: str, fmt: str = "auto", words_per_passage: int = 100,
                  drop_title_paragraph: bool = False) -> Iterator[dict]:
    """Stream canonical passages from ``path`` in format ``fmt`` (KILT pages chunked, others normalised).

    KILT passages get ids ``0, 1, 2, ...`` in order; other formats keep their ids (line number if absent).
    Raises CorpusError with file:line on a row of the wrong shape, and when the file holds no passage.
    """
    if fmt not in FORMATS:
        raise ValueError(f"unknown format {fmt!r}; choose from {FORMATS}")
    if fmt == "auto" and (os.path.isdir(path) or path.endswith(".bz2") or
                          (os.path.isfile(path) and tarfile.is_tarfile(path))):
        fmt = "hotpotqa_abstracts"  # a dump folder / archive: only the HotpotQA abstracts come that way
    if fmt == "hotpotqa_abstracts":
        yield from iter_hotpotqa_abstracts(path)
        return
    next_id = 0
    n = 0
    for line_no, row in iter_jsonl(path):
        try:
            if fmt == "auto":
                fmt = detect_format(row)
                if fmt == "hotpotqa_abstracts":
                    yield from iter_hotpotqa_abstracts(path)
                    return
            if fmt == "kilt":
                title = row.get("wikipedia_title") if isinstance(row, dict) else None
                text = row.get("text") if isinstance(row, dict) else None
                if (not isinstance(title, str) or not isinstance(text, list)
                        or not all(isinstance(t, str) for t in text)):
                    raise CorpusError("KILT row needs 'wikipedia_title' (str) and 'text' (list of paragraphs)")
                for chunk in chunk_kilt_page(title, text, words_per_passage, drop_title_paragraph):
                    yield {"id": str(next_id), "title": title, "text": chunk, "contents": make_contents(title, chunk)}
                    next_id += 1
                    n += 1
            else:
                yield normalize_row(row, default_id=str(line_no - 1))
                n += 1
        except CorpusError as e:
            raise CorpusError(f"{path}:{line_no}: {e}") from e
    if n == 0:  # an empty or truncated-to-nothing input must not pass for a corpus
        raise CorpusError(f"{path}: no passages")


def write_jsonl(rows: Iterable[dict], output: str) -> int:
    """Write rows to ``output`` atomically (temporary name, then rename); returns the row count."""
    os.makedirs(os.path.dirname(os.path.abspath(output)), exist_ok=True)
    tmp = output + ".tmp"
    n = 0
    try:
        with open(tmp, "w", encoding="utf-8") as f:
            for r in rows:
                f.write(json.dumps(r, ensure_ascii=False) + "\n")
                n += 1
    except BaseException:
        os.remove(tmp)  # never leave a half-written corpus that looks usable
        raise
    os.replace(tmp, output)
    return n


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m retriever.prepare_corpus", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--input", required=True,
                   help="KILT knowledge source / HotpotQA abstracts (.tar.bz2, folder or jsonl) / wiki-18 / "
                        "plain jsonl")
    p.add_argument("--output", required=True, help="canonical passage jsonl to write")
    p.add_argument("--format", choices=FORMATS, default="auto")
    p.add_argument("--words", type=int, default=100, help="words per KILT passage")
    p.add_argument("--drop_title_paragraph", action="store_true",
                   help="drop a KILT page's first paragraph when it only repeats the title (R1-Searcher keeps it)")
    a = p.parse_args(argv)
    if os.path.exists(a.output) and os.path.exists(a.input) and os.path.samefile(a.input, a.output):
        p.error(f"--output {a.output} is the input file: it would be replaced by its passages")
    from tqdm import tqdm

    dups = DuplicateCounter()
    try:
        passages = iter_prepared(a.input, a.format, a.words, a.drop_title_paragraph)
        n = write_jsonl(dups.wrap(tqdm(passages, desc="passages", unit="p", mininterval=5)), a.output)
        report = duplicate_report(dups, a.output)
    except (CorpusError, ValueError, OSError) as e:
        print(f"prepare_corpus: error: {e}", file=sys.stderr)
        return 2
    if report["duplicate_id_rows"]:
        os.remove(a.output)
        ex = "; ".join(f"id {e['id']!r} at rows {', '.join(map(str, e['rows']))}" for e in report["duplicate_ids"][:3])
        print(f"prepare_corpus: error: {report['duplicate_id_rows']} of {n} passages repeat an id already used ({ex}); "
              "ids must be unique (build_index refuses them)", file=sys.stderr)
        return 2
    print(f"wrote {n} passages to {a.output}; {report['duplicate_text_rows']} repeat the text of an earlier passage "
          f"({report['duplicate_text_groups']} texts repeated, the most often {report['largest_duplicate_text_group']} "
          "times; the server's --dedup keeps copies out of one result list)")
    return 0


def duplicate_report(dups: DuplicateCounter, path: str) -> dict:
    """``dups.report`` for the rows just written to ``path``, reading back only the rows that share a hash."""
    need = dups.rows_to_check()
    rows = {}
    if need:
        for i, (_, row) in enumerate(iter_jsonl(path)):
            if i in need:
                rows[i] = row
    return dups.report(rows.__getitem__)


if __name__ == "__main__":
    sys.exit(main())
