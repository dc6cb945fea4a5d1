"""QA rows for the CPU demo, as plain dicts ``{"id", "question", "golden_answers", "data_source", ...}``.

Reading and validation are :mod:`openrlhf_search.evaluation.loaders`' (FlashRAG ``golden_answers``, R1-Searcher
``answer``, Search-R1 ``reward_model.ground_truth.target`` rows; jsonl, json or parquet): one loader for training
and evaluation, so a file that trains also evaluates.
"""

from typing import List, Optional

from openrlhf_search.evaluation.loaders import DatasetError, load_examples_file


class QADataError(ValueError):
    """A QA file is missing, empty, or has a row without a question or an answer; the message names file and row."""


def load_qa_jsonl(path: str, limit: Optional[int] = None) -> List[dict]:
    """Load QA rows as ``{"id", "question", "golden_answers": [str, ...], "data_source"}`` (plus R1-Searcher's
    ``pred_anses`` / Search-R1's ``metadata``, ``extra_info`` when present).

    Args:
        path: jsonl / json / parquet file.
        limit: keep only the first ``limit`` rows.
    Raises:
        QADataError: unreadable file, invalid JSON, a row without ``question`` or without any gold answer, or no rows.
    """
    try:
        examples = load_examples_file(path, limit=limit)
    except (DatasetError, OSError) as e:
        raise QADataError(str(e)) from e
    if not examples:
        raise QADataError(f"no QA rows in {path}")
    return [{**ex.extra, "id": ex.id, "question": ex.question, "golden_answers": ex.golds,
             "data_source": ex.data_source} for ex in examples]
