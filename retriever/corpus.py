"""Passage corpus rows: reading the accepted on-disk forms and writing the canonical one.

Canonical passage row (what the index directory stores and the service returns)::

    {"id": str, "title": str, "text": str, "contents": "\"Title\"\ntext"}

``contents`` follows FlashRAG / Search-R1's wiki-18 form (title in double quotes on the first line).

Accepted input rows (``normalize_row``):
- wiki-18 / FlashRAG: ``{"id", "contents": "\"Title\"\ntext"}``;
- ``{"id", "title", "text"}``;
- ``{"id", "title", "contents": "Title\ntext"}`` (the shared HotpotQA paragraph corpora: title unquoted).
"""

from __future__ import annotations

import json
import os
from typing import Iterator


class CorpusError(ValueError):
    """A corpus row cannot be read as a passage; the message names the file and line."""


def make_contents(title: str, text: str) -> str:
    """FlashRAG's ``contents`` string: ``"Title"`` on the first line, then the passage text."""
    return f'"{title}"\n{text}'


def _split_contents(contents: str) -> tuple[str, str]:
    """``"Title"\\ntext`` (quotes optional) -> (title, text); a single line is all text with no title."""
    if "\n" not in contents:
        return "", contents.strip()
    first, rest = contents.split("\n", 1)
    return _unquote(first.strip()), rest.strip()


def _unquote(title: str) -> str:
    if len(title) >= 2 and title[0] == '"' and title[-1] == '"':
        return title[1:-1]
    return title


def normalize_row(row: dict, default_id: str) -> dict:
    """One input row -> the canonical passage dict ``{"id","title","text","contents"}``.

    Args:
        row: a decoded jsonl row in one of the accepted forms (module docstring).
        default_id: id to use when the row has none (the caller passes the line number).
    Raises:
        CorpusError: the row is not a dict, or has neither ``contents`` nor ``text``.
    """
    if not isinstance(row, dict):
        raise CorpusError(f"row is a {type(row).__name__}, expected an object")
    pid = row.get("id", row.get("_id", default_id))
    pid = str(pid)
    title = row.get("title")
    text = row.get("text")
    contents = row.get("contents")
    if isinstance(text, str):
        title = title if isinstance(title, str) else ""
        text = text.strip()
    elif isinstance(contents, str):
        ctitle, ctext = _split_contents(contents)
        if isinstance(title, str) and title:
            # Shared HotpotQA corpora: "Title\ntext" with the title unquoted; keep the text after it.
            if ctitle == title or _unquote(ctitle) == title:
                text = ctext
            else:
                text = contents.strip()
        else:
            title, text = ctitle, ctext
    else:
        raise CorpusError("row has neither a 'text' nor a 'contents' string")
    return {"id": pid, "title": title, "text": text, "contents": make_contents(title, text)}


def is_gzip(path: str) -> bool:
    """True when ``path`` starts with the gzip magic bytes (whatever its name: ``wiki-18.jsonl.gz``, or renamed)."""
    with open(path, "rb") as f:
        return f.read(2) == b"\x1f\x8b"


def open_text(path: str):
    """Open a jsonl corpus for reading as UTF-8 text (bad bytes kept as surrogates), gunzipping on the fly when the
    file is gzip-compressed (Search-R1's published ``wiki-18.jsonl.gz`` is read as it is downloaded)."""
    if is_gzip(path):
        import gzip

        return gzip.open(path, "rt", encoding="utf-8", errors="surrogateescape")
    return open(path, "r", encoding="utf-8", errors="surrogateescape")


def iter_jsonl(path: str) -> Iterator[tuple[int, dict]]:
    """Yield (1-based line number, decoded object) for each non-blank line of a jsonl or jsonl.gz file; streaming.

    Raises:
        CorpusError: a line is not valid JSON or not UTF-8 (names file and line).
    """
    # surrogateescape: a bad byte stays on its own line (a strict decoder fails on a whole buffer, no line number)
    with open_text(path) as f:
        for line_no, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                line.encode("utf-8")
            except UnicodeEncodeError as e:
                raise CorpusError(f"{path}:{line_no}: not UTF-8 (byte 0x{ord(line[e.start]) - 0xDC00:02x} "
                                  f"at character {e.start})") from None
            try:
                yield line_no, json.loads(line)
            except json.JSONDecodeError as e:
                raise CorpusError(f"{path}:{line_no}: invalid JSON ({e})") from e


def iter_passages(path: str, limit: int | None = None, raw_contents: bool = False) -> Iterator[dict]:
    """Stream canonical passages from a corpus jsonl / jsonl.gz (any accepted row form), at most ``limit`` of them.

    Args:
        raw_contents: keep a row's own ``contents`` string byte for byte (title line, quotes and whitespace as
            published) instead of the rebuilt ``"Title"\ntext``: what an adopted index's vectors were encoded from,
            and what Search-R1's server returns (the corpus row itself, ``retrieval_server.py:34-36``).
    Raises:
        CorpusError: bad JSON or a row that is not a passage (names file and line).
    """
    n = 0
    for line_no, row in iter_jsonl(path):
        if limit is not None and n >= limit:
            return
        try:
            p = normalize_row(row, default_id=str(line_no - 1))
        except CorpusError as e:
            raise CorpusError(f"{path}:{line_no}: {e}") from e
        if raw_contents and isinstance(row.get("contents"), str):
            p["contents"] = row["contents"]
        yield p
        n += 1


def normalized_text(passage: dict) -> str:
    """The key passages are compared by for duplicates: the passage text (``contents`` when it has none),
    lower-cased, whitespace runs collapsed to one space. Two chunks of one page share a title, so the title is
    left out; the same paragraph filed under two titles counts as one."""
    text = passage.get("text") or passage.get("contents") or ""
    return " ".join(text.lower().split())


def _hash64(s: str) -> int:
    import hashlib

    return int.from_bytes(hashlib.blake2b(s.encode("utf-8", "surrogateescape"), digest_size=8).digest(), "little",
                          signed=True)


class DuplicateCounter:
    """Counts repeated ids and repeated passage texts (:func:`normalized_text`) over a stream of passages.

    Memory: two int64 hashes per passage (336 MB for wiki-18's 21M rows), not the strings. ``report(store)`` confirms
    each hash match against the stored passages, so a hash collision is never reported as a duplicate.
    """

    def __init__(self):
        from array import array

        self.id_hashes = array("q")
        self.text_hashes = array("q")

    def add(self, passage: dict) -> dict:
        self.id_hashes.append(_hash64(passage["id"]))
        self.text_hashes.append(_hash64(normalized_text(passage)))
        return passage

    def wrap(self, passages):
        """Pass ``passages`` through unchanged, counting each."""
        for p in passages:
            yield self.add(p)

    @staticmethod
    def _groups(hashes) -> list:
        import numpy as np

        h = np.frombuffer(hashes, dtype=np.int64) if len(hashes) else np.zeros(0, np.int64)
        order = np.argsort(h, kind="stable")
        hs = h[order]
        if len(hs) < 2:
            return []
        edges = np.diff(np.concatenate([[0], (hs[1:] == hs[:-1]).astype(np.int8), [0]]))
        starts, ends = np.flatnonzero(edges == 1), np.flatnonzero(edges == -1)
        # sorted positions starts[j] .. ends[j] (inclusive) share one hash
        return [sorted(int(r) for r in order[a:b + 1]) for a, b in zip(starts, ends)]

    def rows_to_check(self) -> set:
        """Rows whose id or text hash is shared with another row: the only rows :meth:`report` reads."""
        return {r for hashes in (self.id_hashes, self.text_hashes) for g in self._groups(hashes) for r in g}

    def report(self, get) -> dict:
        """Duplicates among the passages added, confirmed with ``get(row) -> passage``.

        Returns:
            ``{"passages", "duplicate_id_rows", "duplicate_ids" (up to 5 examples: id and rows),
            "duplicate_text_rows" (rows whose text repeats an earlier row's), "duplicate_text_groups",
            "largest_duplicate_text_group"}``.
        """
        dup_id_rows, examples = 0, []
        for rows in self._groups(self.id_hashes):
            by_id: dict = {}
            for r in rows:
                by_id.setdefault(get(r)["id"], []).append(r)
            for pid, rs in by_id.items():
                if len(rs) > 1:
                    dup_id_rows += len(rs) - 1
                    if len(examples) < 5:
                        examples.append({"id": pid, "rows": rs[:5]})
        dup_text_rows, text_groups, largest = 0, 0, 1
        for rows in self._groups(self.text_hashes):
            by_text: dict = {}
            for r in rows:
                by_text.setdefault(normalized_text(get(r)), []).append(r)
            for rs in by_text.values():
                if len(rs) > 1:
                    dup_text_rows += len(rs) - 1
                    text_groups += 1
                    largest = max(largest, len(rs))
        return {"passages": len(self.id_hashes), "duplicate_id_rows": dup_id_rows, "duplicate_ids": examples,
                "duplicate_text_rows": dup_text_rows, "duplicate_text_groups": text_groups,
                "largest_duplicate_text_group": largest}


class PassageStore:
    """Random access to the canonical passages stored in an index directory, by row number.

    Files: ``passages.jsonl`` (one canonical row per line) and ``offsets.npy`` (int64 [N+1] byte offsets).
    The file is memory-mapped, so memory stays small whatever the corpus size.
    """

    def __init__(self, jsonl_path: str, offsets_path: str):
        import mmap

        import numpy as np

        self.jsonl_path, self.offsets_path = jsonl_path, offsets_path  # for workers that open their own store
        self.offsets = np.load(offsets_path, mmap_mode="r")
        self._f = open(jsonl_path, "rb")
        size = os.fstat(self._f.fileno()).st_size
        if self.offsets.ndim != 1 or len(self.offsets) < 1 or int(self.offsets[-1]) != size:
            self._f.close()  # a truncated or replaced passages file: every later read would be garbage
            raise CorpusError(f"{jsonl_path} has {size} bytes but {offsets_path} indexes "
                              f"{int(self.offsets[-1]) if self.offsets.size else 0}: rebuild the index")
        self._mm = mmap.mmap(self._f.fileno(), 0, access=mmap.ACCESS_READ) if size else None

    def __len__(self) -> int:
        return int(self.offsets.shape[0]) - 1

    def get(self, i: int) -> dict:
        """Passage at row ``i`` (0-based). Raises IndexError when out of range."""
        if i < 0 or i >= len(self):
            raise IndexError(f"passage row {i} out of range [0, {len(self)})")
        start, end = int(self.offsets[i]), int(self.offsets[i + 1])
        return json.loads(self._mm[start:end])

    def close(self) -> None:
        if self._mm is not None:
            self._mm.close()
        self._f.close()


def write_passage_store(passages, out_dir: str) -> int:
    """Write canonical passages to ``out_dir/passages.jsonl`` + ``offsets.npy``; returns the count.

    ``passages`` is any iterable of canonical dicts (consumed once, streaming). Written atomically
    (temporary names, then rename) so an interrupted build never leaves a half store behind.
    """
    import numpy as np

    os.makedirs(out_dir, exist_ok=True)
    jpath = os.path.join(out_dir, "passages.jsonl")
    tmp = jpath + ".tmp"
    from array import array

    offsets = array("q", [0])  # 8 bytes per passage, not a Python int object each
    with open(tmp, "wb") as f:
        for p in passages:
            line = (json.dumps(p, ensure_ascii=False) + "\n").encode("utf-8")
            f.write(line)
            offsets.append(offsets[-1] + len(line))
    arr = np.frombuffer(offsets, dtype=np.int64)
    np.save(os.path.join(out_dir, "offsets.tmp.npy"), arr)
    os.replace(tmp, jpath)
    os.replace(os.path.join(out_dir, "offsets.tmp.npy"), os.path.join(out_dir, "offsets.npy"))
    return len(offsets) - 1
