"""Where a before/after difference comes from: retrieval, reading or answer form, question by question.

Every question of a paired evaluation (the same questions before and after RL, per-question records of
:mod:`openrlhf_search.evaluation.records`) is put in exactly one component, by the first rule that applies:

- ``retrieval``: whether retrieval did its part changed (the answer-bearing supporting passage retrieved, or the gold
  span in the retrieved text where the data names no supporting passage: ``records.retrieval_hit``);
- ``reading``: retrieval unchanged, but whether the gold span is in the answer changed (form absent <-> not absent);
- ``form``: the gold span is in both answers; what changed is the form around it (exact <-> contained, a shorter or
  longer answer: F1 moves with verbosity, EM with exactness);
- ``other``: the gold span is in neither answer (partial token overlap changed, or nothing did).

A component's part of a metric's difference is ``sum over its questions of (after - before) / n``, so the parts add
up to the whole difference exactly; each part gets a paired bootstrap 95% interval (the questions resampled, the same
resample for every part). The answer-form transition counts (exact / contained / absent before -> after) and the
retrieval rates are reported beside them.
"""

from collections import Counter
from typing import Dict, Sequence

import numpy as np

from openrlhf_search.evaluation.records import FORMS, retrieval_hit

COMPONENTS = ("retrieval", "reading", "form", "other")
COMPONENT_LABELS = {"retrieval": "retrieval (answer passage retrieved or not changed)",
                    "reading": "reading (gold span newly in or out of the answer)",
                    "form": "form (gold span in both answers: exact vs contained, length)",
                    "other": "other (gold span in neither answer)"}
METRICS = ("em", "f1", "cover_em")


def component_of(before: dict, after: dict) -> str:
    """The component of one question's change (module doc), from its before and after records."""
    if retrieval_hit(before) != retrieval_hit(after):
        return "retrieval"
    if bool(before["gold_in_answer"]) != bool(after["gold_in_answer"]):
        return "reading"
    return "form" if before["gold_in_answer"] else "other"


def decompose(before: Sequence[dict], after: Sequence[dict], metrics: Sequence[str] = METRICS, seed: int = 0,
              n_resamples: int = 2000, confidence: float = 0.95) -> dict:
    """Split each metric's before/after difference into the components of the module doc.

    Args:
        before, after: per-question records of the same questions in the same order.
    Returns:
        {"n", "components": {component: {"questions", "up" (questions whose F1 rose), "down",
         metric: {"diff", "low", "high"}}}, "total": {metric: diff}, "forms": {"before": {form: count},
         "after": {...}, "transitions": {"exact->contained": count, ...}}, "retrieval": {"before", "after"} (rates of
         records.retrieval_hit), "gold_in_retrieved": {"before", "after"}}
    Raises:
        ValueError: different lengths, different questions, or no questions.
    """
    if len(before) != len(after):
        raise ValueError(f"decompose: {len(before)} records before, {len(after)} after")
    if not before:
        raise ValueError("decompose: no questions")
    for b, a in zip(before, after):
        if b.get("question") != a.get("question"):
            raise ValueError(f"decompose: question {b.get('question')!r} paired with {a.get('question')!r}")
    n = len(before)
    comp = [component_of(b, a) for b, a in zip(before, after)]
    rng = np.random.default_rng(seed)
    idx = rng.integers(0, n, size=(n_resamples, n))
    alpha = (1.0 - confidence) / 2.0
    out = {"n": n, "components": {}, "total": {}}
    deltas = {m: np.array([float(a[m]) - float(b[m]) for b, a in zip(before, after)]) for m in metrics}
    for m in metrics:
        out["total"][m] = float(deltas[m].mean())
    for c in COMPONENTS:
        member = np.array([x == c for x in comp], dtype=np.float64)
        row = {"questions": int(member.sum()),
               "up": int(sum(1 for x, d in zip(comp, deltas.get("f1", [])) if x == c and d > 0)),
               "down": int(sum(1 for x, d in zip(comp, deltas.get("f1", [])) if x == c and d < 0))}
        for m in metrics:
            part = deltas[m] * member
            means = part[idx].mean(axis=1)
            row[m] = {"diff": float(part.mean()), "low": float(np.quantile(means, alpha)),
                      "high": float(np.quantile(means, 1.0 - alpha))}
        out["components"][c] = row
    out["forms"] = {"before": {f: sum(1 for r in before if r["form"] == f) for f in FORMS},
                    "after": {f: sum(1 for r in after if r["form"] == f) for f in FORMS},
                    "transitions": dict(Counter(f"{b['form']}->{a['form']}" for b, a in zip(before, after)))}
    out["retrieval"] = {"before": sum(map(retrieval_hit, before)) / n, "after": sum(map(retrieval_hit, after)) / n}
    out["gold_in_retrieved"] = {"before": sum(bool(r["gold_in_retrieved"]) for r in before) / n,
                                "after": sum(bool(r["gold_in_retrieved"]) for r in after) / n}
    return out


def _ci(d: Dict[str, float]) -> str:
    return f"{d['diff']:+.3f} [{d['low']:+.3f}, {d['high']:+.3f}]"


def format_decomposition(dec: dict, metrics: Sequence[str] = METRICS) -> str:
    """A plain-text table of :func:`decompose`'s result (parts of each difference with 95% intervals), then the
    answer-form transitions and the retrieval rates."""
    names = {"em": "EM", "f1": "F1", "cover_em": "Cover-EM"}
    lines = [f"== where the differences come from (per question, n={dec['n']}; parts add up to the total) ==",
             f"{'component':<62} {'questions (F1 up/down)':>22} " + " ".join(f"{names.get(m, m) + ' part':>24}"
                                                                           for m in metrics)]
    for c in COMPONENTS:
        row = dec["components"][c]
        count = f"{row['questions']} ({row['up']}/{row['down']})"
        lines.append(f"{COMPONENT_LABELS[c]:<62} {count:>22} " + " ".join(f"{_ci(row[m]):>24}" for m in metrics))
    lines.append(f"{'total':<62} {dec['n']:>22} " + " ".join(f"{dec['total'][m]:>+24.3f}" for m in metrics))
    fb, fa = dec["forms"]["before"], dec["forms"]["after"]
    lines.append("answer form before -> after: " + ", ".join(f"{f} {fb[f]} -> {fa[f]}" for f in FORMS)
                 + "; transitions: " + ", ".join(f"{k} {v}" for k, v in sorted(dec["forms"]["transitions"].items())))
    lines.append(f"retrieval did its part (answer passage retrieved): {dec['retrieval']['before']:.3f} -> "
                 f"{dec['retrieval']['after']:.3f}; gold span in the retrieved text: "
                 f"{dec['gold_in_retrieved']['before']:.3f} -> {dec['gold_in_retrieved']['after']:.3f}")
    return "\n".join(lines)
