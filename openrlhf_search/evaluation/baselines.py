"""Trivial baselines beside an RL result: does RL beat post-processing of the answers the model already gave?

All three are scored on the same questions as the after-RL evaluation (EM / F1 with bootstrap intervals, and the
paired difference after RL - baseline), so a gain that a fixed rule gets as well is seen as such:

1. ``last word``: each before-RL answer cut to its last word ("The currency used in Malta is the EUR." -> "EUR.");
2. ``last k words``: ``k`` chosen on the validation split (:func:`choose_suffix_length`), never on the questions
   it is reported on unless the report is itself on validation;
3. ``first entity``: the first entity of the asked answer type (the embedded default's ``entity_vocabulary``) in the
   top-1 passage the run's retriever returns for the question text, independent of the policy
   (:func:`first_entity_predictions`).
"""

import re
from typing import Dict, List, Optional, Sequence, Tuple

from openrlhf_search.evaluation.summary import score_prediction

MAX_SUFFIX_WORDS = 10


def last_words(prediction: str, k: int) -> str:
    """The last ``k`` whitespace-separated words of ``prediction`` ("" stays "")."""
    if k < 1:
        raise ValueError(f"k must be >= 1, got {k}")
    return " ".join((prediction or "").split()[-k:])


def choose_suffix_length(records: Sequence[dict], max_k: int = MAX_SUFFIX_WORDS) -> Tuple[int, Dict[int, float]]:
    """The suffix length ``k`` (1..max_k) whose cut answers score the best mean F1 on ``records`` (the validation
    split's before-RL records: ``prediction``, ``gold``); ties go to the smaller ``k``.

    Returns:
        (k, {k: mean F1}).
    Raises:
        ValueError: no records.
    """
    if not records:
        raise ValueError("choose_suffix_length: no validation records")
    f1 = {k: sum(score_prediction(last_words(r["prediction"], k), r["gold"])["f1"] for r in records) / len(records)
          for k in range(1, max_k + 1)}
    best = max(f1.values())
    return min(k for k, v in f1.items() if v == best), f1


class EntityMatcher:
    """Finds the first entity of a type in a text: whole words, case-sensitive, the longest at the earliest position
    ("Mexico City" before "Mexico").

    Args:
        vocabulary: ``{entity type: [entity strings]}`` (``default_dataset.entity_vocabulary()``).
    """

    def __init__(self, vocabulary: Dict[str, Sequence[str]]):
        self._patterns = {}
        for etype, names in vocabulary.items():
            names = sorted({n for n in names if n}, key=len, reverse=True)
            if names:
                self._patterns[etype] = re.compile(r"(?<!\w)(?:" + "|".join(map(re.escape, names)) + r")(?!\w)")

    def first(self, text: str, entity_type: str) -> str:
        """The first entity of ``entity_type`` in ``text``; "" when none occurs or the type is unknown."""
        pattern = self._patterns.get(entity_type)
        m = pattern.search(text or "") if pattern is not None else None
        return m.group(0) if m else ""


def first_entity_predictions(questions: Sequence[dict], passages: Sequence[Sequence], matcher: EntityMatcher,
                             answer_type: Dict[str, str]) -> List[Optional[str]]:
    """Baseline 3's answer per question: the first entity of the question's answer type in its top-1 passage.

    Args:
        questions: rows with ``type``.
        passages: per question, the passages of a search with the question text (``Passage`` objects or dicts
            with ``text``); only the first is read.
        answer_type: question type -> entity type (``default_dataset.ANSWER_ENTITY_TYPE``).
    Returns:
        per question the answer ("" when no entity occurs), or None when its type has no entity type.
    """
    out = []
    for q, ps in zip(questions, passages):
        etype = answer_type.get(q.get("type") or "")
        if etype is None:
            out.append(None)
            continue
        top = ps[0] if ps else None
        text = (top.get("text") if isinstance(top, dict) else getattr(top, "text", "")) if top is not None else ""
        out.append(matcher.first(text or "", etype))
    return out


def baseline_scores(before_records: Sequence[dict], k: Optional[int],
                    entity_answers: Optional[Sequence[Optional[str]]] = None) -> Dict[str, dict]:
    """Per-question EM / F1 of every baseline on the questions of ``before_records`` (in their order).

    Args:
        before_records: the before-RL records of the reported questions (``prediction``, ``gold``).
        k: the suffix length chosen on validation (None: baseline 2 left out).
        entity_answers: baseline 3's answers (None entries: not defined for that question; None: left out).
    Returns:
        ``{name: {"label", "predictions", "em": [...], "f1": [...], "defined": [bool per question]}}``; a question
        where a baseline is not defined scores 0 there and is marked ``defined`` False.
    """
    out = {}

    def add(name, label, preds):
        em, f1, defined = [], [], []
        for r, p in zip(before_records, preds):
            s = score_prediction(p or "", r["gold"]) if p is not None else {"em": 0.0, "f1": 0.0}
            em.append(s["em"])
            f1.append(s["f1"])
            defined.append(p is not None)
        out[name] = {"label": label, "predictions": list(preds), "em": em, "f1": f1, "defined": defined}

    add("last_word", "before RL, last word", [last_words(r["prediction"], 1) for r in before_records])
    if k is not None:
        add("last_k_words", f"before RL, last {k} word{'s' if k > 1 else ''} (best k)",
            [last_words(r["prediction"], k) for r in before_records])
    if entity_answers is not None and any(a is not None for a in entity_answers):
        add("first_entity", "first entity of the asked type in the top-1 passage",
            list(entity_answers))
    return out
