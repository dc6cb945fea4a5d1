"""R1-Searcher's difficulty bucketing and ratio mixing of training questions (arXiv 2503.05592 sec. 3.1).

R1-Searcher sorts training questions into easy, medium and hard by the rollouts a reference model needed before a
correct answer (easy < 10, medium 10-20, hard > 20), and each stage mixes the buckets in fixed proportions. With a
fixed budget of ``N`` rollouts the observable equivalent is the number ``c`` of correct ones (Cover-EM by default;
expected rollouts to the first success ~ N / c): ``c <= hard_max`` -> hard, ``c >= easy_min`` -> easy, otherwise
medium. R1-Searcher's released stage-1 set (10 rollouts per question in ``pred_anses``) keeps only questions answered
at least once, so the default hard threshold is at most one correct rollout.
"""

import random
from collections import Counter
from typing import Callable, Dict, List, Sequence, Tuple

from openrlhf_search.env.metrics import cover_em, exact_match, f1_score

BUCKETS = ("easy", "medium", "hard")


def correctness_fn(metric: str) -> Callable[[str, List[str]], bool]:
    """Per-rollout correctness: "cover_em" (default), "em", or "f1>=T" (F1 at least T). Raises ValueError."""
    if metric == "cover_em":
        return lambda pred, golds: cover_em(pred, golds) >= 1.0
    if metric == "em":
        return lambda pred, golds: exact_match(pred, golds) >= 1.0
    if metric.startswith("f1>="):
        thr = float(metric[4:])
        return lambda pred, golds: f1_score(pred, golds) >= thr
    raise ValueError(f"unknown bucketing metric {metric!r}; use cover_em, em or f1>=T")


def count_correct(rollout_answers: Sequence[str], golds: List[str], metric: str = "cover_em") -> int:
    """How many rollout answers are correct. Empty answers (no answer block) count as wrong."""
    ok = correctness_fn(metric)
    return sum(1 for a in rollout_answers if (a or "").strip() and ok(a.strip(), golds))


def bucket_of(n_correct: int, n_rollouts: int, hard_max: int = 1, easy_min: int = -1) -> str:
    """Bucket name for ``n_correct`` of ``n_rollouts`` correct rollouts.

    Args:
        hard_max: at most this many correct -> "hard" (default 1).
        easy_min: at least this many correct -> "easy"; -1 means more than half (``n_rollouts // 2 + 1``).
    Raises:
        ValueError: thresholds overlap or n_rollouts is 0.
    """
    if n_rollouts <= 0:
        raise ValueError("bucket_of: no rollouts for this question")
    easy_min = n_rollouts // 2 + 1 if easy_min < 0 else easy_min
    if easy_min <= hard_max:
        raise ValueError(f"bucket thresholds overlap: easy_min {easy_min} <= hard_max {hard_max}")
    if n_correct <= hard_max:
        return "hard"
    if n_correct >= easy_min:
        return "easy"
    return "medium"


def parse_mix(spec: str) -> Dict[str, float]:
    """``"easy:medium:hard"`` ratio string (e.g. ``"0:2:1"``) -> normalised weights. Raises ValueError."""
    parts = spec.split(":")
    if len(parts) != 3:
        raise ValueError(f"--mix must be easy:medium:hard (three numbers), got {spec!r}")
    try:
        vals = [float(p) for p in parts]
    except ValueError as e:
        raise ValueError(f"--mix must hold numbers, got {spec!r}") from e
    if any(v < 0 for v in vals) or sum(vals) <= 0:
        raise ValueError(f"--mix ratios must be >= 0 with a positive sum, got {spec!r}")
    total = sum(vals)
    return {b: v / total for b, v in zip(BUCKETS, vals)}


def mix_buckets(items_by_bucket: Dict[str, list], weights: Dict[str, float], total: int = 0,
                seed: int = 0) -> Tuple[list, Dict[str, int]]:
    """Sample without replacement from each bucket in the given proportions.

    Args:
        items_by_bucket: bucket name -> items.
        weights: bucket name -> share (sums to 1).
        total: rows wanted; 0 = the largest total the buckets allow at exactly these proportions.
        seed: sampling seed.
    Returns:
        (shuffled mixed items, rows taken per bucket).
    Raises:
        ValueError: a bucket has too few items for the requested total.
    """
    rng = random.Random(seed)
    active = {b: w for b, w in weights.items() if w > 0}
    empty = [b for b in active if not items_by_bucket.get(b)]
    if empty:
        raise ValueError(f"the mix asks for bucket(s) {empty} but they are empty "
                         f"(sizes: { {b: len(v) for b, v in items_by_bucket.items()} }); change --mix or thresholds")
    if not total:
        total = min(int(len(items_by_bucket.get(b, [])) / w) for b, w in active.items())
    want = {b: int(round(total * w)) for b, w in active.items()}
    for b, n in want.items():
        have = len(items_by_bucket.get(b, []))
        if n > have:
            raise ValueError(f"bucket {b!r} has {have} questions, the mix asks for {n} (total {total}); "
                             f"lower --mix_total or change --mix")
    out = []
    for b in BUCKETS:
        if b in want:
            out.extend(rng.sample(list(items_by_bucket.get(b, [])), want[b]))
    rng.shuffle(out)
    return out, dict(Counter({b: want.get(b, 0) for b in BUCKETS}))
