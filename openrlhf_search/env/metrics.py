"""Answer metrics: SQuAD normalisation, EM, token F1, Cover-EM, and gold-answer parsing (pure functions).

- ``normalize_answer`` / ``exact_match`` / ``f1_score``: SQuAD v1.1 evaluation script (Rajpurkar et al. 2016), as
  used by FlashRAG and Search-R1 (arXiv 2503.09516, sec. 4.1 "Evaluation metrics": EM); F1 adds the HotpotQA rule
  that a yes/no/noanswer side scores 0 unless both sides are equal (Yang et al. 2018, ``hotpot_evaluate_v1.py``).
- ``cover_em``: R1-Searcher's ACC_R (arXiv 2503.05592, sec. 4.1 "Evaluation Metrics"): every gold token appears
  among the prediction's tokens, with R1-Searcher's own normalisation (``r1searcher_normalize``), which their
  reported numbers use (RUCAIBox/R1-Searcher ``evaluation/metric_calc_rule.py``).

Every metric takes several gold answers and returns the maximum over them, as a float in [0, 1].
"""

from __future__ import annotations

import json
import re
import string
from collections import Counter
from typing import Any, Iterable, List, Sequence, Union

__all__ = [
    "normalize_answer",
    "r1searcher_normalize",
    "exact_match",
    "f1_score",
    "cover_em",
    "cover_em_squad",
    "parse_golds",
    "mean",
]

_PUNCT = set(string.punctuation)
# R1-Searcher adds typographic quotes and accents to the punctuation it replaces with a space.
_R1_PUNCT = set(string.punctuation) | {"\u2018", "\u2019", "\u00b4", "`"}
_ARTICLES = re.compile(r"\b(a|an|the)\b")
_YES_NO = ("yes", "no", "noanswer")

Golds = Union[str, Sequence[str], dict, None]


def normalize_answer(s: str) -> str:
    """SQuAD normalisation: lower-case, delete punctuation, drop articles a/an/the, collapse whitespace."""
    s = str(s).lower()
    s = "".join(ch for ch in s if ch not in _PUNCT)
    s = _ARTICLES.sub(" ", s)
    return " ".join(s.split())


def r1searcher_normalize(s: str) -> str:
    """R1-Searcher's normalisation for Cover-EM (their ``evaluation/metric_calc_rule.py`` and reward server).

    Order: the exact strings "True"/"False" become "yes"/"no"; ``_`` becomes a space; lower-case; punctuation
    (string.punctuation plus ‘ ’ ´ `) is REPLACED by a space (not deleted, unlike SQuAD); articles dropped;
    whitespace collapsed. "Saxe-Coburg" gives "saxe coburg" here and "saxecoburg" under SQuAD.
    """
    s = str(s)
    if s == "True":
        s = "yes"
    elif s == "False":
        s = "no"
    s = s.replace("_", " ").lower()
    s = "".join(" " if ch in _R1_PUNCT else ch for ch in s)
    s = _ARTICLES.sub(" ", s)
    return " ".join(s.split())


def parse_golds(label: Any) -> List[str]:
    """Gold answers as a list of strings, from any label form the datasets use.

    Accepts: a plain string; a JSON list string (``'["Paris", "Paris, France"]'``); a list/tuple (of strings or
    numbers); Search-R1's ``{"target": [...]}`` (also as a JSON string); FlashRAG's ``{"golden_answers": [...]}``;
    a numpy array. Empty strings are dropped; order is kept; duplicates are removed.

    Raises:
        ValueError: None, an empty list, or a form it cannot read (the message shows the value).
    """
    if label is None:
        raise ValueError("gold answers: label is None")
    if hasattr(label, "tolist") and not isinstance(label, (str, bytes)):
        label = label.tolist()
    if isinstance(label, bytes):
        label = label.decode("utf-8")
    if isinstance(label, str):
        text = label.strip()
        if text[:1] in ("[", "{"):
            try:
                return parse_golds(json.loads(text))
            except (json.JSONDecodeError, ValueError):
                pass  # a plain answer that happens to start with a bracket
        golds = [label.strip()]
    elif isinstance(label, dict):
        for key in ("target", "golden_answers", "answers", "answer", "ground_truth"):
            if key in label:
                return parse_golds(label[key])
        raise ValueError(f"gold answers: dict without target/golden_answers/answers key: {label!r:.200}")
    elif isinstance(label, (list, tuple)):
        golds = []
        for item in label:
            if isinstance(item, (list, tuple, dict)) or hasattr(item, "tolist"):
                golds.extend(parse_golds(item))
            elif item is not None:
                golds.append(str(item).strip())
    elif isinstance(label, (int, float)):
        golds = [str(label)]
    else:
        raise ValueError(f"gold answers: unsupported label type {type(label).__name__}: {label!r:.200}")
    out = []
    for g in golds:
        if g and g not in out:
            out.append(g)
    if not out:
        raise ValueError(f"gold answers: no non-empty answer in {label!r:.200}")
    return out


def _golds(golds: Golds) -> List[str]:
    return parse_golds(golds)


def exact_match(pred: str, golds: Golds) -> float:
    """EM: 1.0 when the SQuAD-normalised prediction equals any normalised gold answer, else 0.0.

    A prediction that normalises to "" (no answer, or only articles/punctuation) scores 0.
    """
    p = normalize_answer(pred or "")
    if not p:
        return 0.0  # no answer never matches (a gold such as "a" or "The" normalises to "")
    return float(any(p == normalize_answer(g) for g in _golds(golds)))


def _f1_single(pred_norm: str, gold_norm: str) -> float:
    if (pred_norm in _YES_NO or gold_norm in _YES_NO) and pred_norm != gold_norm:
        return 0.0
    p_tok, g_tok = pred_norm.split(), gold_norm.split()
    common = Counter(p_tok) & Counter(g_tok)
    same = sum(common.values())
    if same == 0:
        return 0.0
    precision, recall = same / len(p_tok), same / len(g_tok)
    return 2 * precision * recall / (precision + recall)


def f1_score(pred: str, golds: Golds, normalizer=normalize_answer) -> float:
    """Token-overlap F1 after normalisation, max over gold answers.

    If either side normalises to yes / no / noanswer and the two differ, F1 is 0 (HotpotQA rule). An empty
    prediction scores 0. ``normalizer`` defaults to SQuAD; R1-Searcher's released stage-2 reward passes
    ``r1searcher_normalize``.
    """
    p = normalizer(pred or "")
    return max(_f1_single(p, normalizer(g)) for g in _golds(golds))


def _cover(pred_norm: str, gold_norm: str) -> bool:
    if not gold_norm:
        return False
    pred_tokens = set(pred_norm.split(" "))
    return all(tok in pred_tokens for tok in gold_norm.split(" "))


def cover_em(pred: str, golds: Golds) -> float:
    """Cover-EM (R1-Searcher's ACC_R): 1.0 when every token of a gold answer appears among the prediction's
    tokens (order and contiguity ignored), under :func:`r1searcher_normalize`; max over gold answers.

    An empty prediction scores 0 (their code would let an all-punctuation gold match it; we do not).
    """
    p = r1searcher_normalize(pred or "")
    if not p:
        return 0.0
    return float(any(_cover(p, r1searcher_normalize(g)) for g in _golds(golds)))


def cover_em_squad(pred: str, golds: Golds) -> float:
    """Cover-EM with SQuAD normalisation (the variant FlashRAG-style evaluators compute); max over golds."""
    p = normalize_answer(pred or "")
    if not p:
        return 0.0
    return float(any(_cover(p, normalize_answer(g)) for g in _golds(golds)))


def mean(values: Iterable[float]) -> float:
    """Arithmetic mean; 0.0 for an empty iterable."""
    values = list(values)
    return sum(values) / len(values) if values else 0.0
