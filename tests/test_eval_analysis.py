"""Per-question records, the decomposition of before/after differences, the trivial baselines and
the validation split (pure functions on hand-made records)."""

import json

import pytest

from openrlhf_search.evaluation.baselines import (EntityMatcher, baseline_scores, choose_suffix_length,
                                                  first_entity_predictions, last_words)
from openrlhf_search.evaluation.compare import analyse, compare_by_group, format_analysis
from openrlhf_search.evaluation.decompose import component_of, decompose
from openrlhf_search.evaluation.records import answer_form, question_record, span_in, stop_reason
from openrlhf_search.env.protocol import get_protocol

PROTO = get_protocol("searchr1")


def _out(text, trace=(), **logs):
    base = {"turns": 2.0, "valid_searches": float(len(trace)), "answer_present": float("<answer>" in text)}
    base.update(logs)
    return {"response_text": text, "search_trace": [dict(t) for t in trace], "extra_logs": base}


def test_span_and_form_rules():
    assert span_in(["EUR"], "The currency is the EUR.") and not span_in(["EUR"], "Europe uses it")
    assert span_in(["St. Peter Port"], "it is st peter port") and not span_in([""], "anything")
    assert answer_form("Paris", ["Paris"]) == "exact"
    assert answer_form("The capital is Paris.", ["Paris"]) == "contained"
    assert answer_form("Lyon", ["Paris"]) == "absent"


def test_question_record_fields_from_an_executor_result():
    """Retrieved ids per search, supporting passage retrieved (any / the answer-bearing last one), gold span in the
    documents the policy read, answer length and form, stop reason. Mutations caught: ids of all searches merged
    into one list, the answer passage taken as the first supporting id, gold looked up in the answer instead of the
    documents."""
    text = ("<think>x</think>\n<search> capital Andorra </search>\n\n<information>Doc 1(Title: Andorra) The capital of "
            "Andorra is Andorra la Vella.</information>\n\n<search> econ Spain </search>\n\n<information>Doc 1(Title: "
            "Economy of Spain) The currency used in Spain is the EUR.</information>\n\n<answer> it is EUR </answer>")
    row = {"id": "q1", "question": "Q?", "golden_answers": ["EUR"], "type": "currency_of_capital", "hops": 2,
           "supporting_ids": ["AND-geo", "AND-econ"]}
    rec = question_record(row, _out(text, [{"query": "capital Andorra", "passage_ids": ["AND-geo"]},
                                           {"query": "econ Spain", "passage_ids": ["ESP-econ"]}]), PROTO, 3)
    assert rec["retrieved_ids"] == [["AND-geo"], ["ESP-econ"]]
    assert rec["queries"] == ["capital Andorra", "econ Spain"]
    assert rec["support_retrieved"] is True and rec["answer_passage_retrieved"] is False
    assert rec["gold_in_retrieved"] is True  # "EUR" is in Spain's passage, which the policy read
    assert rec["prediction"] == "it is EUR" and rec["answer_words"] == 3 and rec["form"] == "contained"
    assert rec["gold_in_answer"] and rec["em"] == 0.0 and rec["stop_reason"] == "answer"
    assert (rec["type"], rec["hops"], rec["gold"]) == ("currency_of_capital", 2, ["EUR"])
    bare = question_record({"question": "Q?", "golden_answers": ["x"]}, _out("<search> a </search>"), PROTO, 3)
    assert bare["support_retrieved"] is None and bare["answer_passage_retrieved"] is None
    assert stop_reason({"extra_logs": {"turns": 3}}, "", 3) == "max_turns"
    assert stop_reason({"extra_logs": {"turns": 1, "context_full": 1.0}}, "", 3) == "context_full"
    assert stop_reason({"truncated": True, "extra_logs": {"turns": 1}}, "", 3) == "length"
    assert stop_reason({"extra_logs": {"retrieval_failed": 1.0}}, "x", 3) == "retrieval_failed"


def test_cli_eval_rows_carry_the_record_fields():
    from openrlhf_search.evaluation.loaders import QAExample
    from openrlhf_search.evaluation.runner import RECORD_FIELDS, ROW_FIELDS, build_row

    ex = QAExample(id="q", question="Q?", golds=["Paris"], extra={"type": "capital", "hops": 1,
                                                                  "supporting_ids": ["FRA-geo"]})
    out = _out("<search> capital France </search>\n\n<information>The capital of France is Paris.</information>"
               "\n\n<answer> Paris </answer>", [{"query": "capital France", "passage_ids": ["FRA-geo"]}])
    row = build_row(ex, 0, out, PROTO, None, 3)
    assert set(ROW_FIELDS) <= set(row) and set(RECORD_FIELDS) <= set(row)
    assert row["retrieved_ids"] == [["FRA-geo"]] and row["answer_passage_retrieved"] and row["form"] == "exact"
    err = build_row(ex, 0, None, PROTO, None, 3, error="boom")
    assert set(ROW_FIELDS) <= set(err) and err["stop_reason"] == "error" and err["retrieved_ids"] == []
    json.dumps(row)  # a jsonl row


def _rec(q, pred, gold, retrieved=True, hops=1, qtype="capital"):
    from openrlhf_search.evaluation.summary import score_prediction

    s = score_prediction(pred, [gold])
    form = answer_form(pred, [gold], s["em"])
    return {"question": q, "prediction": pred, "gold": [gold], "hops": hops, "type": qtype, "form": form,
            "gold_in_answer": form != "absent", "answer_passage_retrieved": retrieved, "gold_in_retrieved": retrieved,
            **s}


def test_decomposition_puts_each_question_in_one_component_and_parts_add_up():
    """retrieval > reading > form > other; the parts of each metric sum to its difference. Mutation caught: a rule
    order that files a newly retrieved, newly correct answer under reading (retrieval then gets no credit)."""
    before = [_rec("a", "no idea", "Paris", retrieved=False), _rec("b", "Lyon", "Rome"),
              _rec("c", "The capital is Bern.", "Bern"), _rec("d", "Oslo city", "Madrid"),
              _rec("e", "Vienna", "Vienna")]
    after = [_rec("a", "Paris", "Paris"), _rec("b", "Rome", "Rome"), _rec("c", "Bern", "Bern"),
             _rec("d", "Madrid", "Madrid", retrieved=True) | {"gold_in_answer": False, "form": "absent"},
             _rec("e", "Vienna", "Vienna")]
    assert [component_of(b, a) for b, a in zip(before, after)] == ["retrieval", "reading", "form", "other", "form"]
    dec = decompose(before, after, seed=0)
    for m in ("em", "f1", "cover_em"):
        parts = sum(dec["components"][c][m]["diff"] for c in dec["components"])
        assert parts == pytest.approx(dec["total"][m])
    assert dec["components"]["retrieval"]["questions"] == 1 and dec["components"]["retrieval"]["em"]["diff"] == 0.2
    assert dec["forms"]["transitions"]["contained->exact"] == 1
    assert dec["retrieval"] == {"before": 0.8, "after": 1.0}
    with pytest.raises(ValueError, match="paired"):
        decompose(before, after[::-1])


def test_baselines_suffix_choice_and_first_entity():
    recs = [_rec("q1", "The capital is Paris.", "Paris"), _rec("q2", "It is New Delhi.", "New Delhi"),
            _rec("q3", "It is Buenos Aires.", "Buenos Aires")]
    assert last_words("The currency is the EUR.", 1) == "EUR." and last_words("", 2) == ""
    k, f1 = choose_suffix_length(recs)
    assert k == 2 and f1[2] > f1[1]  # two two-word answers; "is Paris." still scores F1 0.67
    # a one-word answer scores the same for every k: the tie goes to the smaller k (mutation caught: max instead)
    tie_k, tie_f1 = choose_suffix_length([_rec("q", "Paris", "Paris")])
    assert tie_k == 1 and set(tie_f1.values()) == {1.0}
    m = EntityMatcher({"capital": ["Mexico City", "Mexico", "Bern"], "currency": ["EUR", "USD"]})
    assert m.first("Mexico City is the capital of Mexico; Bern", "capital") == "Mexico City"
    assert m.first("EURO and USD", "currency") == "USD" and m.first("nothing", "capital") == ""
    preds = first_entity_predictions([{"type": "capital"}, {"type": "currency_of_capital"}, {"type": "other"}],
                                     [[{"text": "Bern is nice"}], [], [{"text": "EUR"}]], m,
                                     {"capital": "capital", "currency_of_capital": "currency"})
    assert preds == ["Bern", "", None]
    scores = baseline_scores(recs, 2, ["Paris", "", None])
    assert scores["last_word"]["em"] == [1.0, 0.0, 0.0] and scores["last_k_words"]["em"] == [0.0, 1.0, 1.0]
    assert scores["first_entity"]["defined"] == [True, True, False]


def test_analyse_reports_groups_baselines_and_decomposition():
    before = {"records": [_rec("a", "The capital is Paris.", "Paris"),
                          _rec("b", "The EUR.", "EUR", qtype="currency"),
                          _rec("c", "Lima", "Quito", hops=2, qtype="capital_of_neighbor")]}
    after = {"records": [_rec("a", "Paris", "Paris"), _rec("b", "EUR", "EUR", qtype="currency"),
                         _rec("c", "Quito", "Quito", hops=2, qtype="capital_of_neighbor")]}
    groups = compare_by_group(before["records"], after["records"])
    assert list(groups) == ["1-hop", "1-hop/capital", "1-hop/currency", "2-hop", "2-hop/capital_of_neighbor"]
    assert groups["1-hop"]["n"] == 2 and groups["2-hop"]["em"]["diff"] == 1.0
    an = analyse(before, after, suffix_k={"k": 1, "f1_by_k": {1: 0.5}, "chosen_on": "validation", "n": 3},
                 entity_answers=["Paris", "EUR", "Lima"])
    assert an["baselines"]["first_entity"]["em"][0] == pytest.approx(2 / 3)
    assert an["baselines"]["last_word"]["after_minus"]["em"]["diff"] == pytest.approx(1 / 3)
    text = format_analysis(an)
    for s in ("per question group", "trivial baselines", "last word", "first entity", "where the differences",
              "  capital_of_neighbor", "reading"):
        assert s in text, s
    with pytest.raises(ValueError, match="different questions"):
        analyse(before, {"records": after["records"][::-1]})


def test_validation_split_is_deterministic_disjoint_and_never_trained_on(default_data):
    """The main job's data (``cpu_demo/run.py``): validation carved from the training questions by the data
    seed, disjoint from held-out and from the rows trained on; another data seed gives another split. Mutation
    caught: validation drawn from the held-out file, or left in the training rows."""
    from cpu_demo.data.default_dataset import validation_split
    from cpu_demo.data.qa import load_qa_jsonl

    rows = load_qa_jsonl(default_data.train_path)
    held = load_qa_jsonl(default_data.eval_path)
    train, val = validation_split(rows, 64, seed=0)
    assert len(val) == 64 and len(train) + len(val) == len(rows)
    q = lambda rs: {r["question"] for r in rs}
    assert not q(val) & q(train) and not q(val) & q(held) and not q(train) & q(held)
    train2, val2 = validation_split(rows, 64, seed=0)
    assert [r["question"] for r in val2] == [r["question"] for r in val] and train2 == train
    assert q(validation_split(rows, 64, seed=5)[1]) != q(val)
    assert validation_split(rows, 0, seed=0)[1] == []
    small_train, small_val = validation_split(list(range(10)), 3, seed=1)
    assert len(small_val) == 3 and sorted(small_train + small_val) == list(range(10))
    with pytest.raises(ValueError, match="leaves no training"):
        validation_split([1, 2], 2)


def test_entity_vocabulary_lists_answers_of_every_type(default_data):
    from cpu_demo.data.default_dataset import ANSWER_ENTITY_TYPE, entity_vocabulary

    vocab = entity_vocabulary()
    assert "Paris" in vocab["capital"] and "EUR" in vocab["currency"] and "France" in vocab["country"]
    rows = [json.loads(line) for line in open(default_data.eval_path)]
    for r in rows:  # every gold answer is an entity of its question's answer type
        assert r["answer"] in vocab[ANSWER_ENTITY_TYPE[r["type"]]], r
