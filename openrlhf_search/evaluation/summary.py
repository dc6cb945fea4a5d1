"""Per-question scores, dataset summaries, and the table that puts our numbers beside the papers'.

Metrics (:mod:`openrlhf_search.env.metrics`): EM and F1 with SQuAD normalisation, Cover-EM (R1-Searcher's ACC_R, its own
normalisation), judge accuracy (ACC_L). All are fractions in [0, 1].
"""

from typing import Any, Dict, Iterable, List, Optional, Sequence

from openrlhf_search.evaluation.paper_reference import canonical_dataset, reference_numbers
from openrlhf_search.env.metrics import cover_em, exact_match, f1_score

METRIC_COLUMNS = ("em", "f1", "cover_em", "judge_acc")
_HEADERS = {"em": "EM", "f1": "F1", "cover_em": "Cover-EM", "judge_acc": "Judge acc"}


def score_prediction(prediction: str, golds: Sequence[str]) -> Dict[str, float]:
    """EM, F1 and Cover-EM of one prediction against its gold answers (max over golds), each in [0, 1]."""
    prediction = prediction or ""
    return {"em": float(exact_match(prediction, list(golds))), "f1": float(f1_score(prediction, list(golds))),
            "cover_em": float(cover_em(prediction, list(golds)))}


def _mean(values: List[float]) -> Optional[float]:
    return sum(values) / len(values) if values else None


def summarize(records: Iterable[Any], judge_labels: Optional[Sequence[Optional[bool]]] = None) -> Dict[str, Any]:
    """Aggregate metrics over predictions.

    Args:
        records: ``PredictionRecord``-like objects (``prediction``, ``golds``, ``judge``, ``extra``).
        judge_labels: verdicts to use instead of the records' own ``judge`` fields (None entries = not judged).
    Returns:
        dict with ``n``, ``em``, ``f1``, ``cover_em`` (means in [0, 1]), ``answer_rate`` (share with a non-empty
        prediction), ``judge_acc`` and ``n_judged`` when any verdict exists (judge accuracy is over all ``n``
        questions, an unjudged one counting as wrong, and ``n_judge_missing`` says how many that is), and the means
        of ``turns`` / ``searches`` when the records carry them.
    Raises:
        ValueError: no records.
    """
    records = list(records)
    if not records:
        raise ValueError("summarize: no predictions to score")
    scores = [score_prediction(r.prediction, r.golds) for r in records]
    out: Dict[str, Any] = {"n": len(records)}
    for key in ("em", "f1", "cover_em"):
        out[key] = _mean([s[key] for s in scores])
    out["answer_rate"] = _mean([1.0 if (r.prediction or "").strip() else 0.0 for r in records])
    labels = list(judge_labels) if judge_labels is not None else [r.judge for r in records]
    if len(labels) != len(records):
        raise ValueError(f"summarize: {len(labels)} judge labels for {len(records)} predictions")
    judged = [lab for lab in labels if lab is not None]
    if judged:
        out["judge_acc"] = sum(1.0 for lab in judged if lab) / len(records)
        out["n_judged"] = len(judged)
        out["n_judge_missing"] = len(records) - len(judged)
    for key in ("turns", "searches"):
        vals = [float(r.extra[key]) for r in records if isinstance(getattr(r, "extra", None), dict)
                and isinstance(r.extra.get(key), (int, float))]
        if vals:
            out[f"mean_{key}"] = _mean(vals)
    return out


def summarize_by_source(records: Sequence[Any], sources: Sequence[str]) -> Dict[str, Dict[str, Any]]:
    """``summarize`` per data source (e.g. the seven sets mixed in Search-R1's test file), in first-seen order.

    Args:
        records: predictions.
        sources: the data source of each record (same length).
    Returns:
        source -> summary; empty when all records share one source (the whole-set summary says it all).
    Raises:
        ValueError: lengths differ.
    """
    if len(records) != len(sources):
        raise ValueError(f"summarize_by_source: {len(sources)} sources for {len(records)} predictions")
    groups: Dict[str, list] = {}
    for rec, src in zip(records, sources):
        groups.setdefault(str(src or "unknown"), []).append(rec)
    if len(groups) < 2:
        return {}
    return {src: summarize(recs) for src, recs in groups.items()}


def _fmt(value: Optional[float]) -> str:
    return "–" if value is None else f"{value:.3f}"


def _caps(setup: Dict[str, Any]) -> str:
    """", documents block ..., context ..." for the setting line, when the setup records them (a cut that the
    released eval does not make must be visible beside the numbers)."""
    if "max_obs_tokens" not in setup and "max_length" not in setup:
        return ""
    obs = setup.get("max_obs_tokens")
    docs = "documents uncut" if obs is None else f"documents cut at {obs} tokens"
    length = setup.get("max_length")
    context = (f"context {length} tokens" if length is not None else
               f"context uncapped (the model's {setup.get('context_tokens', '?')} tokens)")
    return f", {docs}, {context}"


def format_table(summaries: Dict[str, Dict[str, Any]], setup: Dict[str, Any], paper: Optional[str] = None) -> str:
    """Markdown table: for each dataset our row, then every reference row of the papers for that dataset.

    Args:
        summaries: dataset name -> ``summarize`` output.
        setup: what produced our numbers: ``model``, ``corpus``, ``retriever``, ``topk`` (missing keys print "?").
        paper: restrict references to "r1searcher" or "searchr1" (None: both).
    Returns:
        the table as a string (GitHub markdown), followed by a legend of the paper setups.
    """
    head = ["dataset", "source", "model", "corpus", "retriever", "top-k", "n"] + [_HEADERS[m] for m in METRIC_COLUMNS]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    used_setups = {}
    for name, s in summaries.items():
        ours = [name, "ours", str(setup.get("model", "?")), str(s.get("corpus", setup.get("corpus", "?"))),
                str(s.get("retriever", setup.get("retriever", "?"))), str(setup.get("topk", "?")), str(s.get("n", ""))]
        ours += [_fmt(s.get(m)) for m in METRIC_COLUMNS]
        lines.append("| " + " | ".join(ours) + " |")
        by_model: Dict[str, Dict[str, Any]] = {}
        for ref in reference_numbers(name, paper):
            entry = by_model.setdefault(ref.model, {"setup": ref.setup})
            entry[ref.metric] = ref.value
        for model, entry in by_model.items():
            st = entry["setup"]
            used_setups[st.paper] = st
            row = [canonical_dataset(name) or name, st.paper.split(" (")[0], model, st.corpus, st.retriever,
                   str(st.topk), ""] + [_fmt(entry.get(m)) for m in METRIC_COLUMNS]
            lines.append("| " + " | ".join(row) + " |")
    if used_setups:
        lines.append("")
        for st in used_setups.values():
            judge = f"; judge {st.judge}" if st.judge else ""
            lines.append(f"- {st.paper}: {st.eval_set}; {st.corpus}; {st.retriever}; top-{st.topk}{judge}.")
    if setup.get("setting"):
        lines.append(f"- ours: {setup.get('protocol', '?')} {setup['setting']} eval setting (prompt template "
                     f"{setup.get('template', '?')}, chat template {setup.get('chat_template', '?')}, "
                     f"{setup.get('max_turns', '?')} turns x {setup.get('max_new_tokens', '?')} tokens, temperature "
                     f"{setup.get('temperature', '?')}{_caps(setup)}).")
    if setup.get("judge"):
        lines.append(f"- ours: judge {setup['judge']}.")
    return "\n".join(lines)
