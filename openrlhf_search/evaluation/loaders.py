"""Question loaders: one unified example type over the formats the papers ship.

Formats read (auto-detected per row):
- FlashRAG (Search-R1's eval format): ``{"id", "question", "golden_answers": [...]}``;
- R1-Searcher: ``{"idx", "question", "answer"}`` (answer a string or a list);
- Search-R1 training / test rows (parquet or jsonl): ``prompt`` (chat messages), ``reward_model.ground_truth.target``,
  ``data_source``; the question is taken from ``question`` when present, else from the last "Question:" of the prompt.

Datasets by name:

- ``hotpotqa_500``, ``2wiki_500``, ``musique_500``, ``bamboogle``: R1-Searcher's eval sets, in a named data folder
  (``--data_dir`` or ``$OPENRLHF_SEARCH_DATA_DIR``);
- a bare FlashRAG name (``nq``, ``triviaqa``, ...) or ``flashrag:<name>``: the FULL split Search-R1 evaluates on
  (``FLASHRAG_EVAL_SETS``) from FlashRAG's hub copy, never a local sample; ``flashrag:<name>`` reads
  ``qa/flashrag/<name>.test.jsonl`` of a named data folder instead when there is one (offline tests). No data folder
  is ever assumed; every example records where it came from (``QAExample.source``);
- ``NAME@TAG`` (``bamboogle@web``): the same questions as a separate row against the retriever routed to that name.
"""

import json
import os
from dataclasses import dataclass, field
from typing import Any, Dict, Iterable, List, Optional

from openrlhf_search.env.metrics import parse_golds

DATA_DIR_ENV = "OPENRLHF_SEARCH_DATA_DIR"
FLASHRAG_HUB_REPO = "RUC-NLPIR/FlashRAG_datasets"

#: R1-Searcher's eval sets (paper Table 1), relative to the data folder
R1SEARCHER_EVAL_SETS = {
    "hotpotqa_500": "qa/r1searcher/hotpotqa_500.jsonl",
    "2wiki_500": "qa/r1searcher/2wiki_500.jsonl",
    "musique_500": "qa/r1searcher/musique_500.jsonl",
    "bamboogle": "qa/r1searcher/bamboogle.jsonl",
}
#: FlashRAG dataset names (Search-R1's eval sets, paper Table 2) and the split Search-R1 evaluates on
FLASHRAG_EVAL_SETS = {
    "nq": "test", "triviaqa": "test", "popqa": "test", "hotpotqa": "dev", "2wikimultihopqa": "dev",
    "musique": "dev", "bamboogle": "test",
}


class DatasetError(ValueError):
    """A dataset name is unknown, a file is missing, or a row lacks a question or gold answers (the message says
    which row and which field)."""


@dataclass
class QAExample:
    """One question with its gold answers.

    Attributes:
        id: row id (``id`` / ``idx`` of the source, else the row number).
        question: question text.
        golds: gold answers, at least one, as strings.
        data_source: dataset name the row comes from ("nq", "hotpotqa", ...).
        extra: other fields of the source row kept for bucketing (e.g. R1-Searcher's ``pred_anses``).
        source: where the row was read: an absolute file path, or ``hub:<repo>/<config>/<split>``.
    """

    id: str
    question: str
    golds: List[str]
    data_source: str = ""
    extra: Dict[str, Any] = field(default_factory=dict)
    source: str = ""


def default_data_dir() -> Optional[str]:
    """The data folder dataset names are looked up in: ``$OPENRLHF_SEARCH_DATA_DIR``, else None (none is assumed)."""
    return os.environ.get(DATA_DIR_ENV) or None


def _question_from_prompt(prompt: Any) -> Optional[str]:
    if isinstance(prompt, (list, tuple)) or hasattr(prompt, "tolist"):
        messages = list(prompt.tolist() if hasattr(prompt, "tolist") else prompt)
        text = "\n".join(m.get("content", "") for m in messages if isinstance(m, dict) and m.get("role") == "user")
    else:
        text = str(prompt or "")
    if "Question:" in text:
        return text.rsplit("Question:", 1)[1].strip()
    return None


def example_from_row(row: Dict[str, Any], index: int, data_source: str = "") -> QAExample:
    """Build a ``QAExample`` from one row of any supported format.

    Args:
        row: the parsed row.
        index: row number, used as id when the row has none and in error messages.
        data_source: default dataset name when the row carries no ``data_source``.
    Raises:
        DatasetError: no question or no gold answer.
    """
    if not isinstance(row, dict):
        raise DatasetError(f"row {index}: expected a JSON object, got {type(row).__name__}")
    golds_raw = None
    for key in ("golden_answers", "golds", "answer", "answers"):
        if row.get(key) is not None:
            golds_raw = row[key]
            break
    if golds_raw is None:
        rm = row.get("reward_model") or {}
        gt = rm.get("ground_truth") if isinstance(rm, dict) else None
        if isinstance(gt, dict):
            golds_raw = gt.get("target")
        elif gt is not None:
            golds_raw = gt
    if hasattr(golds_raw, "tolist"):  # numpy arrays from parquet
        golds_raw = golds_raw.tolist()
    try:
        golds = parse_golds(golds_raw) if golds_raw is not None else []
    except ValueError as e:
        raise DatasetError(f"row {index}: unreadable gold answers ({e})") from e
    golds = [str(g) for g in golds if str(g).strip()]
    question = row.get("question")
    if not question and "prompt" in row:
        question = _question_from_prompt(row["prompt"])
    if not question or not str(question).strip():
        raise DatasetError(f"row {index}: no question (fields: {sorted(row)})")
    if not golds:
        raise DatasetError(f"row {index}: no gold answer (looked for golden_answers, answer, "
                           f"reward_model.ground_truth.target; fields: {sorted(row)})")
    rid = row.get("id", row.get("idx", index))
    source = row.get("data_source") or row.get("datasource") or data_source
    extra = {k: v for k, v in row.items() if k in ("pred_anses", "metadata", "extra_info", "hops", "type",
                                                    "supporting_ids")}
    return QAExample(id=str(rid), question=str(question).strip(), golds=golds, data_source=str(source), extra=extra)


def _read_rows(path: str) -> List[Dict[str, Any]]:
    if path.endswith(".parquet"):
        import pandas as pd

        return pd.read_parquet(path).to_dict(orient="records")
    if not path.endswith(".json"):
        return list(iter_jsonl(path))
    with open(path, encoding="utf-8") as f:
        data = json.load(f)
    if isinstance(data, dict):
        data = data.get("data", data.get("rows"))
    if not isinstance(data, list):
        raise DatasetError(f"{path}: a .json file must hold a list of rows")
    return data


def load_examples_file(path: str, data_source: str = "", limit: Optional[int] = None) -> List[QAExample]:
    """Read a jsonl / json / parquet file of questions in any supported format.

    Raises:
        DatasetError: missing file or a bad row (the message names file and row).
    """
    if not os.path.isfile(path):
        raise DatasetError(f"dataset file not found: {path}")
    source = data_source or _stem(path)
    rows = _read_rows(path)
    if limit is not None:
        rows = rows[:limit]
    out = []
    for i, row in enumerate(rows):
        try:
            out.append(example_from_row(row, i, source))
        except DatasetError as e:
            raise DatasetError(f"{path}: {e}") from e
        out[-1].source = os.path.abspath(path)
    return out


def _stem(path: str) -> str:
    name = os.path.basename(path)
    for suffix in (".jsonl", ".json", ".parquet"):
        if name.endswith(suffix):
            name = name[: -len(suffix)]
    return name.replace(".test", "").replace(".dev", "")


def load_flashrag_hub(name: str, split: str, limit: Optional[int] = None) -> List[QAExample]:
    """FlashRAG's hub copy (``RUC-NLPIR/FlashRAG_datasets``), needs network access or a warm HF cache.

    Raises:
        DatasetError: the hub is unreachable or the name / split does not exist.
    """
    try:
        import datasets

        ds = datasets.load_dataset(FLASHRAG_HUB_REPO, name, split=split)
    except Exception as e:  # offline, unknown config, ... : one clear message
        first = (str(e).strip().splitlines() or [""])[0]
        raise DatasetError(f"FlashRAG dataset {name!r} split {split!r} could not be loaded from the hub "
                           f"{FLASHRAG_HUB_REPO} ({type(e).__name__}: {first}); no local sample is used in its place "
                           f"(a local copy: --data_dir DIR holding qa/flashrag/{name}.{split}.jsonl, or a file "
                           f"path)") from e
    rows = ds if limit is None else ds.select(range(min(limit, len(ds))))
    out = [example_from_row(dict(r), i, name) for i, r in enumerate(rows)]
    for ex in out:
        ex.source = f"hub:{FLASHRAG_HUB_REPO}/{name}/{split}"
    return out


def resolve_dataset_path(name: str, data_dir: Optional[str] = None) -> Optional[str]:
    """Local file of a named dataset, or None when only the hub has it.

    Names: a path; an R1-Searcher eval set (``hotpotqa_500``, ``2wiki_500``, ``musique_500``, ``bamboogle``);
    ``flashrag:<name>`` looked up as ``qa/flashrag/<name>.test.jsonl`` (or ``.dev.jsonl``) under the data folder.
    A bare FlashRAG name (``nq``, ...) has no local file: it means the full hub split (Search-R1's eval).
    """
    if os.path.isfile(name):
        return name
    data_dir = data_dir or default_data_dir()
    if name in R1SEARCHER_EVAL_SETS:
        if not data_dir:
            raise DatasetError(f"dataset {name!r} is a local file ({R1SEARCHER_EVAL_SETS[name]} of R1-Searcher's "
                               f"data/eval_set, renamed): name its folder with --data_dir DIR or ${DATA_DIR_ENV}, "
                               f"or pass the file's path")
        return os.path.join(data_dir, R1SEARCHER_EVAL_SETS[name])
    if not name.startswith("flashrag:") or not data_dir:
        return None
    flash = name.split(":", 1)[1]
    for split in ("test", "dev"):
        path = os.path.join(data_dir, "qa", "flashrag", f"{flash}.{split}.jsonl")
        if os.path.isfile(path):
            return path
    return None


def load_eval_dataset(name: str, data_dir: Optional[str] = None, split: Optional[str] = None,
                      limit: Optional[int] = None) -> List[QAExample]:
    """Load questions by name or path (see the module docstring and ``resolve_dataset_path``).

    Args:
        name: dataset name or file path. A bare FlashRAG name loads the full hub split Search-R1 evaluates on
            (``scripts/data_process/qa_search_test_merge.py:61-69``: test, else dev), every question.
        data_dir: folder of local copies (default ``default_data_dir()``: ``$OPENRLHF_SEARCH_DATA_DIR`` or none).
        split: hub split (default: the split Search-R1 evaluates on).
        limit: keep the first ``limit`` questions.
    Raises:
        DatasetError: unknown name, missing file, bad row.
    """
    from openrlhf_search.evaluation.paper_reference import split_tag

    name = split_tag(name)[0]
    path = resolve_dataset_path(name, data_dir)
    source = name.split(":", 1)[-1] if not os.path.isfile(name) else ""
    if path is not None:
        if not os.path.isfile(path):
            raise DatasetError(f"dataset {name!r}: file {path} not found (set --data_dir or ${DATA_DIR_ENV})")
        return load_examples_file(path, data_source=source, limit=limit)
    flash = name.split(":", 1)[1] if name.startswith("flashrag:") else name
    if flash in FLASHRAG_EVAL_SETS or name.startswith("flashrag:"):
        return load_flashrag_hub(flash, split or FLASHRAG_EVAL_SETS.get(flash, "test"), limit)
    raise DatasetError(f"unknown dataset {name!r}: not a file, not one of {sorted(R1SEARCHER_EVAL_SETS)} and not a "
                       f"FlashRAG name {sorted(FLASHRAG_EVAL_SETS)} (full hub split) or flashrag:<name> (the hub "
                       f"split, or qa/flashrag/<name>.test.jsonl of --data_dir)")


def iter_jsonl(path: str) -> Iterable[Dict[str, Any]]:
    """Rows of a jsonl file (blank lines skipped). Raises DatasetError with the line number on bad JSON."""
    with open(path, encoding="utf-8") as f:
        for lineno, line in enumerate(f, 1):
            if line.strip():
                try:
                    yield json.loads(line)
                except json.JSONDecodeError as e:
                    raise DatasetError(f"{path}:{lineno}: not valid JSON ({e})") from e
