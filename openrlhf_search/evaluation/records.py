"""Per-question evaluation records: what one evaluated question did, so that a result can be checked without a re-run.

One record per question, written by the CPU job's ``evaluate`` (``eval_before.json`` / ``eval.json``, key
``records``) and carried by ``cli.eval``'s prediction rows (:func:`openrlhf_search.evaluation.runner.build_row`)::

    {"id", "question", "type", "hops", "gold", "prediction", "answer_words", "queries", "retrieved_ids",
     "supporting_ids", "support_retrieved", "answer_passage_retrieved", "gold_in_retrieved", "gold_in_answer",
     "form", "stop_reason", "em", "f1", "cover_em", "turns", "valid_searches", "response_tokens", "trajectory"}

- ``retrieved_ids``: per search that returned, the ids of the passages of its documents block (turn order);
- ``supporting_ids``: the passages a perfect searcher reads (the embedded default's rows; None for other data), the
  last of which holds the answer; ``support_retrieved``: at least one of them was retrieved at some turn;
  ``answer_passage_retrieved``: the last one was (None without ``supporting_ids``);
- ``gold_in_retrieved``: a gold answer occurs as a whole-word span (SQuAD normalisation) in the documents text the
  policy was shown (passages cut to ``max_obs_tokens``);
- ``form``: ``exact`` (EM 1), ``contained`` (a gold span occurs in the answer, but the answer is longer), ``absent``;
  ``gold_in_answer`` = form is not absent;
- ``stop_reason``: :func:`stop_reason`.
"""

from typing import List, Optional, Sequence

from openrlhf_search.env.metrics import normalize_answer
from openrlhf_search.evaluation.summary import score_prediction

FORMS = ("exact", "contained", "absent")


def span_in(golds: Sequence[str], text: str) -> bool:
    """True when some gold answer, SQuAD-normalised, occurs in ``text`` as a run of whole words ("eur" in "the eur
    is used" but not in "europe"). An empty gold never matches."""
    hay = f" {normalize_answer(text or '')} "
    return any(g and f" {g} " in hay for g in (normalize_answer(x) for x in golds))


def answer_form(prediction: str, golds: Sequence[str], em: Optional[float] = None) -> str:
    """``exact`` (EM 1), ``contained`` (a gold span in a longer answer) or ``absent`` (see the module doc)."""
    from openrlhf_search.env.metrics import exact_match

    if (em if em is not None else exact_match(prediction, list(golds))) >= 1.0:
        return "exact"
    return "contained" if span_in(golds, prediction) else "absent"


def retrieved_text(protocol, response_text: str) -> str:
    """The documents text the policy was shown, its tags replaced by spaces (so that "EUR.</information>" does not
    normalise to "eurinformation")."""
    text = " ".join(protocol.documents_blocks(response_text))
    for tag in (protocol.doc_open_tag, protocol.doc_close_tag):
        if tag:
            text = text.replace(tag, " ")
    return text


def stop_reason(out: dict, prediction: str, max_turns: int) -> str:
    """How a trajectory ended: "retrieval_failed", "answer" (an answer block), "length" (a token budget cut the last
    turn), "context_full" (a documents block did not fit), "max_turns", or "no_action" (a turn with neither a query
    nor an answer ended it)."""
    logs = out.get("extra_logs") or {}

    def flag(key):
        try:
            return float(logs.get(key, 0) or 0) > 0
        except (TypeError, ValueError):
            return False

    if flag("retrieval_failed"):
        return "retrieval_failed"
    if prediction or flag("answer_present"):
        return "answer"
    if out.get("truncated") or flag("truncated"):
        return "length"
    if flag("context_full"):
        return "context_full"
    if int(float(logs.get("turns", 0) or 0)) >= max_turns:
        return "max_turns"
    return "no_action"


def question_record(row: dict, out: dict, protocol, max_turns: int) -> dict:
    """The record of one evaluated question.

    Args:
        row: the question: ``question``, ``golden_answers`` (or ``golds``), optional ``id``, ``type``, ``hops``,
            ``supporting_ids``.
        out: the executor's result (``response_text``, ``extra_logs``, ``search_trace``; see
            :class:`openrlhf_search.env.agent.SearchAgentExecutor`).
        protocol: the rollout's :class:`~openrlhf_search.env.protocol.Protocol` (answer, query and documents parsing).
        max_turns: the turn budget (for the stop reason).
    Returns:
        the record dict of the module doc.
    """
    golds = list(row.get("golden_answers") or row.get("golds") or [])
    text = out.get("response_text") or ""
    logs = out.get("extra_logs") or {}
    prediction = protocol.extract_answer(text).strip()
    scores = score_prediction(prediction, golds)
    trace = out.get("search_trace") or []
    retrieved = [list(t.get("passage_ids") or []) for t in trace]
    seen = {pid for ids in retrieved for pid in ids}
    support = row.get("supporting_ids")
    support = list(support) if support else None
    form = answer_form(prediction, golds, scores["em"])
    return {
        "id": row.get("id"), "question": row.get("question"), "type": row.get("type"), "hops": row.get("hops"),
        "gold": golds, "prediction": prediction, "answer_words": len(prediction.split()),
        "queries": protocol.extract_queries(text), "retrieved_ids": retrieved, "supporting_ids": support,
        "support_retrieved": None if support is None else any(s in seen for s in support),
        "answer_passage_retrieved": None if support is None else support[-1] in seen,
        "gold_in_retrieved": span_in(golds, retrieved_text(protocol, text)),
        "gold_in_answer": form != "absent", "form": form,
        "stop_reason": stop_reason(out, prediction, max_turns),
        **scores,
        "turns": int(float(logs.get("turns", 0) or 0)),
        "valid_searches": int(float(logs.get("valid_searches", 0) or 0)),
        "response_tokens": int(float(logs.get("response_tokens", 0) or 0)),
        "trajectory": text,
    }


def retrieval_hit(record: dict) -> bool:
    """Whether retrieval did its part for a question: the answer-bearing supporting passage was retrieved when the
    data names it, else the gold span was in the retrieved text."""
    hit = record.get("answer_passage_retrieved")
    return bool(record.get("gold_in_retrieved")) if hit is None else bool(hit)


def group_of(record: dict) -> List[str]:
    """The table groups a record belongs to: ``"<h>-hop"`` and ``"<h>-hop/<type>"`` when known, else ``[]``."""
    hops, qtype = record.get("hops"), record.get("type")
    if hops is None:
        return []
    out = [f"{hops}-hop"]
    if qtype:
        out.append(f"{hops}-hop/{qtype}")
    return out
