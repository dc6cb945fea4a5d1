"""Prediction files: our eval output and the peers' published formats, read into one record type for rescoring.

Auto-detected formats:
- ``ours``: jsonl written by ``cli.eval`` (``question``, ``golds``, ``prediction``, ``trajectory``, ...; ``judge``
  when a judge ran);
- ``r1searcher``: R1-Searcher's ``eval_results`` jsonl (``question``, ``answer``, ``pred_ans``, ``gen_text_store``,
  ``gpt4o_output`` = the GPT-4o-mini judge's "True"/"False");
- ``flashrag``: FlashRAG's ``intermediate_data.json`` (Search-R1 runs): a JSON list of
  ``{"id", "question", "golden_answers", "output": {"pred", "metric_score", ...}}``.
"""

import json
import os
from dataclasses import dataclass, field
from typing import Any, Dict, List, Optional, Tuple

from openrlhf_search.env.metrics import parse_golds


class PredictionFormatError(ValueError):
    """The file is in none of the known formats, or a row lacks a required field (message names the row)."""


@dataclass
class PredictionRecord:
    """One scored-or-scorable prediction.

    Attributes:
        question: the question.
        golds: gold answers.
        prediction: the extracted final answer ("" when the model gave none).
        judge: the judge's verdict when the file carries one (True / False), else None.
        trajectory: full generated text (may be "").
        extra: the remaining source fields (turns, searches, stop reason, ...).
    """

    question: str
    golds: List[str]
    prediction: str
    judge: Optional[bool] = None
    trajectory: str = ""
    extra: Dict[str, Any] = field(default_factory=dict)


def parse_judge_label(value: Any) -> Optional[bool]:
    """A judge label as bool: True/False, "True"/"False" (any case, surrounding text allowed), 1/0; None if absent
    or unreadable."""
    if value is None:
        return None
    if isinstance(value, bool):
        return value
    if isinstance(value, (int, float)):
        return bool(value)
    text = str(value).strip().lower()
    if not text:
        return None
    if text.startswith(("true", "yes", "correct")):
        return True
    if text.startswith(("false", "no", "incorrect")):
        return False
    has_t, has_f = "true" in text, "false" in text
    if has_t != has_f:
        return has_t
    return None


def _read(path: str) -> Tuple[str, List[Any]]:
    if not os.path.isfile(path):
        raise PredictionFormatError(f"predictions file not found: {path}")
    with open(path, "rb") as f:
        data = f.read()
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError as e:
        line = data[:e.start].count(b"\n") + 1
        raise PredictionFormatError(f"{path}:{line}: not UTF-8 ({e.reason}, byte 0x{data[e.start]:02x})") from None
    stripped = text.lstrip()
    if stripped.startswith("["):
        try:
            return "json", json.loads(text)
        except json.JSONDecodeError as e:
            raise PredictionFormatError(f"{path}: starts like a JSON list but does not parse ({e})") from e
    rows = []
    for lineno, line in enumerate(text.splitlines(), 1):
        if line.strip():
            try:
                rows.append(json.loads(line))
            except json.JSONDecodeError as e:
                raise PredictionFormatError(f"{path}:{lineno}: not valid JSON ({e})") from e
    return "jsonl", rows


def detect_format(row: Dict[str, Any]) -> str:
    """Name the format of one row: "ours", "r1searcher" or "flashrag". Raises PredictionFormatError."""
    if not isinstance(row, dict):
        raise PredictionFormatError(f"expected JSON objects, got {type(row).__name__}")
    if "prediction" in row and "golds" in row:
        return "ours"
    if "pred_ans" in row and "answer" in row:
        return "r1searcher"
    if "golden_answers" in row and isinstance(row.get("output"), dict):
        return "flashrag"
    raise PredictionFormatError(
        "unknown predictions format; expected ours (prediction, golds), R1-Searcher eval_results "
        f"(question, answer, pred_ans) or FlashRAG intermediate_data (golden_answers, output.pred); got {sorted(row)}")


def _record(fmt: str, row: Dict[str, Any], i: int) -> PredictionRecord:
    record = _record_fields(fmt, row, i)
    if not isinstance(record.prediction, str):  # metrics would fail on it far from the row (no .strip())
        raise PredictionFormatError(f"row {i} ({fmt} format): the prediction is a "
                                    f"{type(record.prediction).__name__}, expected a string")
    return record


def _record_fields(fmt: str, row: Dict[str, Any], i: int) -> PredictionRecord:
    try:
        if fmt == "ours":
            return PredictionRecord(
                question=row.get("question", ""), golds=parse_golds(row["golds"]),
                prediction=row.get("prediction") or "", judge=parse_judge_label(row.get("judge")),
                trajectory=row.get("trajectory", ""),
                extra={k: v for k, v in row.items() if k not in ("question", "golds", "prediction", "judge",
                                                                  "trajectory")})
        if fmt == "r1searcher":
            return PredictionRecord(
                question=row.get("question", ""), golds=parse_golds(row["answer"]),
                prediction=row.get("pred_ans") or "", judge=parse_judge_label(row.get("gpt4o_output")),
                trajectory=row.get("gen_text_store", ""),
                extra={"stop_reason": row.get("stop_reason_final")})
        output = row["output"]
        return PredictionRecord(
            question=row.get("question", ""), golds=parse_golds(row["golden_answers"]),
            prediction=output.get("pred") or "", judge=parse_judge_label(output.get("judge")),
            trajectory=output.get("raw_pred", "") or "",
            extra={"id": row.get("id"), "metric_score": output.get("metric_score")})
    except KeyError as e:
        raise PredictionFormatError(f"row {i} ({fmt} format): missing field {e}") from e


def load_predictions(path: str) -> Tuple[str, List[PredictionRecord]]:
    """Read a predictions file in any known format.

    Returns:
        (format name, records in file order).
    Raises:
        PredictionFormatError: unknown format, missing file, or a bad row (the message names it).
    """
    _, rows = _read(path)
    if not rows:
        raise PredictionFormatError(f"{path}: no rows")
    try:
        fmt = detect_format(rows[0])
    except PredictionFormatError as e:
        raise PredictionFormatError(f"{path}: {e}") from e
    records = []
    for i, row in enumerate(rows):
        try:
            records.append(_record(fmt, row, i))
        except (PredictionFormatError, AttributeError, TypeError, ValueError) as e:
            raise PredictionFormatError(f"{path}: row {i}: {e}") from e
    return fmt, records
