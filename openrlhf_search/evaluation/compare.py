"""Before / after comparison of two evaluations on the same questions, with paired bootstrap intervals.

Used by the CPU main job (greedy evaluation of the held-out questions before RL and after RL) and by the learning
and ablation benchmarks. The interval of a difference is the percentile interval of the paired bootstrap (Efron &
Tibshirani 1993, ch. 13): the questions are resampled with replacement, the same resample for both runs, and the
mean of (after - before) is recomputed on each resample.
"""

from typing import Dict, List, Optional, Sequence, Tuple

import numpy as np

# Per-question metrics compared (keys of the ``per_question`` lists written by ``LocalSearchTrainer.evaluate``).
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


def mean_interval_str(values: List[float], seed: int = 0) -> str:
    """``0.412 [0.330, 0.495]``: mean and bootstrap interval of per-question scores."""
    m, lo, hi = bootstrap_mean_ci(values, seed=seed)
    return f"{m:.3f} [{lo:.3f}, {hi:.3f}]"
