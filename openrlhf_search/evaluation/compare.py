"""Before / after comparison of two evaluations on the same questions, with paired bootstrap intervals.

Used by the CPU main job (greedy evaluation of the held-out questions before RL and after RL) and by the learning
and ablation benchmarks. The interval of a difference is the percentile interval of the paired bootstrap (Efron &
Tibshirani 1993, ch. 13): the questions are resampled with replacement, the same resample for both runs, and the
mean of (after - before) is recomputed on each resample.

:func:`analyse` adds, from the per-question records (:mod:`openrlhf_search.evaluation.records`), the rows per question
group (1-hop and 2-hop, and each question type), the trivial baselines on the same questions
(:mod:`openrlhf_search.evaluation.baselines`) and the decomposition of each difference into retrieval, reading and
form (:mod:`openrlhf_search.evaluation.decompose`); :func:`format_analysis` prints them beside the before/after table.
"""

from typing import Dict, List, Optional, Sequence, Tuple

import numpy as np

# Per-question metrics compared (keys of the ``per_question`` lists of :func:`evaluation_summary`).
COMPARED = ("em", "f1", "cover_em", "answer_rate", "valid_searches", "searches")


def bootstrap_mean_ci(values: Sequence[float], n_resamples: int = 2000, confidence: float = 0.95,
                      seed: int = 0) -> Tuple[float, float, float]:
    """(mean, low, high): the mean of ``values`` and its percentile bootstrap interval.

    Raises:
        ValueError: empty ``values`` or a confidence outside (0, 1).
    """
    x = np.asarray(values, dtype=np.float64)
    if x.size == 0:
        raise ValueError("bootstrap: no values")
    if not 0.0 < confidence < 1.0:
        raise ValueError(f"bootstrap: confidence must be in (0, 1), got {confidence}")
    rng = np.random.default_rng(seed)
    idx = rng.integers(0, x.size, size=(n_resamples, x.size))
    means = x[idx].mean(axis=1)
    alpha = (1.0 - confidence) / 2.0
    return float(x.mean()), float(np.quantile(means, alpha)), float(np.quantile(means, 1.0 - alpha))


def paired_difference(before: Sequence[float], after: Sequence[float], n_resamples: int = 2000,
                      confidence: float = 0.95, seed: int = 0) -> Dict[str, float]:
    """Mean difference ``after - before`` over paired questions and its bootstrap interval.

    Args:
        before, after: per-question scores, same length and order (question i in both).
    Returns:
        {"before", "after", "diff", "low", "high", "n"}.
    Raises:
        ValueError: different lengths or no questions.
    """
    b, a = np.asarray(before, dtype=np.float64), np.asarray(after, dtype=np.float64)
    if b.shape != a.shape:
        raise ValueError(f"paired bootstrap: {b.size} scores before, {a.size} after (must be the same questions)")
    diff, low, high = bootstrap_mean_ci(a - b, n_resamples, confidence, seed)
    return {"before": float(b.mean()), "after": float(a.mean()), "diff": diff, "low": low, "high": high,
            "n": int(b.size)}


def evaluation_summary(rows: Sequence[dict]) -> dict:
    """What :func:`compare_evaluations` and :func:`analyse` read, from greedy evaluation rows
    (:func:`openrlhf_search.evaluation.runner.run_eval`, one sample per question, in question order).

    Questions whose retrieval failed or whose rollout raised are not scored (listed in ``failed_questions``).

    Returns:
        {"n", "em", "f1", "cover_em", "answer_rate", "valid_searches" (mean valid search calls per question),
         "valid_search_rate" (share with at least one), "turns", "response_tokens", "retrieval_failed",
         "questions" (scored, in order), "per_question" ({metric: [score per scored question]}),
         "records" (per scored question: the row with ``gold``; :mod:`openrlhf_search.evaluation.records`),
         "failed_questions", "examples" (the first three: question, gold, prediction)}
    """
    keys = ("em", "f1", "cover_em", "answer_rate", "valid_searches", "valid_search_rate", "turns", "response_tokens")
    scores = {k: [] for k in keys}
    failed, questions, records, examples = [], [], [], []
    for row in rows:
        if row.get("retrieval_failed") or row.get("error"):
            failed.append(row["question"])
            continue
        record = {**row, "gold": list(row.get("golds") or []), "valid_searches": int(row.get("searches", 0))}
        records.append(record)
        questions.append(row["question"])
        for k in ("em", "f1", "cover_em", "turns", "response_tokens", "valid_searches"):
            scores[k].append(float(record.get(k) or 0.0))
        scores["answer_rate"].append(float(bool(record.get("prediction"))))
        scores["valid_search_rate"].append(float(record["valid_searches"] > 0))
        if len(examples) < 3:
            examples.append({"question": row["question"], "gold": record["gold"], "prediction": row["prediction"]})
    out = {k: (sum(v) / len(v) if v else 0.0) for k, v in scores.items()}
    out.update(n=len(records), retrieval_failed=len(failed), questions=questions, per_question=scores,
               records=records, failed_questions=failed, examples=examples)
    return out


def compare_evaluations(before: dict, after: dict, metrics: Sequence[str] = COMPARED, seed: int = 0) -> dict:
    """Paired comparison of two ``evaluate()`` results on the same questions.

    Args:
        before, after: dicts with ``per_question`` = {metric: [score per question]} and ``questions`` (list of str).
    Returns:
        {metric: paired_difference(...)} for every metric present in both.
    Raises:
        ValueError: the two evaluations are not over the same questions in the same order.
    """
    qb, qa = before.get("questions"), after.get("questions")
    if qb is not None and qa is not None and list(qb) != list(qa):
        raise ValueError("before/after evaluations are over different questions; compare the same held-out set")
    pb, pa = before.get("per_question", {}), after.get("per_question", {})
    return {m: paired_difference(pb[m], pa[m], seed=seed) for m in metrics if m in pb and m in pa}


def format_comparison(cmp: dict, title: str = "held-out, greedy: before RL vs after RL",
                      labels: Tuple[str, str] = ("before RL", "after RL")) -> str:
    """A plain-text table: metric, before, after, difference and its 95% interval."""
    n = next(iter(cmp.values()))["n"] if cmp else 0
    lines = [f"== {title} (n={n}, paired bootstrap 95% interval) ==",
             f"{'metric':<15} {labels[0]:>10} {labels[1]:>10} {'diff':>8} {'95% interval':>18}"]
    for m, d in cmp.items():
        lines.append(f"{m:<15} {d['before']:>10.3f} {d['after']:>10.3f} {d['diff']:>+8.3f} "
                     f"{'[' + format(d['low'], '+.3f') + ', ' + format(d['high'], '+.3f') + ']':>18}")
    return "\n".join(lines)


def interval_str(d: Optional[dict]) -> str:
    """``+0.123 [+0.050, +0.190]`` for a :func:`paired_difference` result ("n/a" for None)."""
    if not d:
        return "n/a"
    return f"{d['diff']:+.3f} [{d['low']:+.3f}, {d['high']:+.3f}]"


def _group_key(name: str):
    hops, _, qtype = name.partition("/")
    return (int(hops.split("-")[0]) if hops.split("-")[0].isdigit() else 99, qtype != "", qtype)


def compare_by_group(before: Sequence[dict], after: Sequence[dict], metrics: Sequence[str] = ("em", "f1"),
                     seed: int = 0) -> Dict[str, dict]:
    """Paired before/after differences per question group (``records.group_of``: ``"1-hop"``, ``"1-hop/capital"``,
    ...), from per-question records of the same questions in the same order.

    Returns:
        {group: {"n", metric: paired_difference(...)}}, 1-hop groups first, each hop count before its types; {} when
        the records carry no ``hops``.
    """
    from openrlhf_search.evaluation.records import group_of

    members: Dict[str, List[int]] = {}
    for i, r in enumerate(after):
        for g in group_of(r):
            members.setdefault(g, []).append(i)
    out = {}
    for g in sorted(members, key=_group_key):
        ix = members[g]
        out[g] = {"n": len(ix)}
        for m in metrics:
            out[g][m] = paired_difference([before[i][m] for i in ix], [after[i][m] for i in ix], seed=seed)
    return out


def compare_baselines(after: Sequence[dict], baselines: Dict[str, dict], seed: int = 0) -> Dict[str, dict]:
    """EM / F1 of after-RL answers and of each baseline (:func:`baselines.baseline_scores`) on the same questions,
    with bootstrap intervals, and the paired difference after RL - baseline.

    Returns:
        {"after_rl": {"label", "n", "em": (mean, low, high), "f1": ...}, name: {... , "after_minus": {"em":
         paired_difference(baseline, after), "f1": ...}, "defined": questions where the baseline is defined}}.
    """
    out = {"after_rl": {"label": "after RL (the policy's answers)", "n": len(after), "defined": len(after)}}
    for m in ("em", "f1"):
        out["after_rl"][m] = bootstrap_mean_ci([r[m] for r in after], seed=seed)
    for name, b in baselines.items():
        row = {"label": b["label"], "n": len(after), "defined": int(sum(b["defined"])), "after_minus": {}}
        for m in ("em", "f1"):
            row[m] = bootstrap_mean_ci(b[m], seed=seed)
            row["after_minus"][m] = paired_difference(b[m], [r[m] for r in after], seed=seed)
        out[name] = row
    return out


def analyse(before: dict, after: dict, suffix_k: Optional[dict] = None,
            entity_answers: Optional[Sequence[Optional[str]]] = None, seed: int = 0) -> dict:
    """Everything printed beside the before/after table, from two ``evaluate()`` results with ``records``.

    Args:
        before, after: evaluations of the same questions (``records`` in the same order).
        suffix_k: {"k", "f1_by_k", "chosen_on", "n"}: baseline 2's suffix length and where it was chosen (None: left
            out).
        entity_answers: baseline 3's answer per question (``baselines.first_entity_predictions``; None: left out).
    Returns:
        {"n", "by_group", "baselines", "suffix_k", "decomposition"}.
    Raises:
        ValueError: records missing or over different questions.
    """
    from openrlhf_search.evaluation.baselines import baseline_scores
    from openrlhf_search.evaluation.decompose import decompose

    rb, ra = before.get("records"), after.get("records")
    if not rb or not ra:
        raise ValueError("analyse: both evaluations need per-question records")
    if [r["question"] for r in rb] != [r["question"] for r in ra]:
        raise ValueError("analyse: before/after records are over different questions")
    k = suffix_k["k"] if suffix_k else None
    return {"n": len(ra), "by_group": compare_by_group(rb, ra, seed=seed),
            "baselines": compare_baselines(ra, baseline_scores(rb, k, entity_answers), seed=seed),
            "suffix_k": suffix_k, "decomposition": decompose(rb, ra, seed=seed)}


def _mean_ci(t) -> str:
    return f"{t[0]:.3f} [{t[1]:.3f}, {t[2]:.3f}]"


def format_analysis(analysis: dict) -> str:
    """Plain-text tables of :func:`analyse`: per-group rows, baselines, decomposition."""
    from openrlhf_search.evaluation.decompose import format_decomposition

    lines = []
    groups = analysis.get("by_group") or {}
    if groups:
        lines.append("== per question group: before RL vs after RL (paired bootstrap 95%) ==")
        lines.append(f"{'group':<28} {'n':>4} {'EM before':>10} {'EM after':>9} {'EM diff [95%]':>26} "
                     f"{'F1 before':>10} {'F1 after':>9} {'F1 diff [95%]':>26}")
        for g, row in groups.items():
            name = g if "/" not in g else "  " + g.split("/", 1)[1]
            lines.append(f"{name:<28} {row['n']:>4} {row['em']['before']:>10.3f} {row['em']['after']:>9.3f} "
                         f"{interval_str(row['em']):>26} {row['f1']['before']:>10.3f} {row['f1']['after']:>9.3f} "
                         f"{interval_str(row['f1']):>26}")
        lines.append("")
    base = analysis.get("baselines") or {}
    if base:
        sk = analysis.get("suffix_k")
        lines.append(f"== trivial baselines on the same {analysis['n']} questions (mean [bootstrap 95%]; "
                     f"after RL - baseline paired) ==")
        lines.append(f"{'answer':<56} {'EM':>21} {'F1':>21} {'after RL - it, EM':>25} {'after RL - it, F1':>25}")
        for name, row in base.items():
            label = row["label"] + (f" [defined for {row['defined']}]" if row["defined"] < row["n"] else "")
            em_d = interval_str(row["after_minus"]["em"]) if "after_minus" in row else "-"
            f1_d = interval_str(row["after_minus"]["f1"]) if "after_minus" in row else "-"
            lines.append(f"{label:<56} {_mean_ci(row['em']):>21} {_mean_ci(row['f1']):>21} {em_d:>25} {f1_d:>25}")
        if sk and sk.get("f1_by_k"):
            lines.append(f"best k: chosen on the {sk['chosen_on']} split's before-RL answers (n = {sk['n']}); F1 by k: "
                         + ", ".join(f"{int(k)}: {v:.3f}" for k, v in sorted(sk["f1_by_k"].items(),
                                                                             key=lambda kv: int(kv[0]))))
        elif sk:
            lines.append(f"k = {sk['k']} from {sk['chosen_on']}")
        if "first_entity" in base:
            lines.append("first entity: of the asked answer type (capital, currency code), in the top-1 passage that a "
                         "search with the question text returns (the run's retriever), whole words")
        lines.append("")
    if analysis.get("decomposition"):
        lines.append(format_decomposition(analysis["decomposition"]))
    return "\n".join(lines).rstrip()
