"""benchmarks/trials_em.py analyze: the figures docs/trials_em.md quotes, on hand-made per-question records (no model).

Mutations caught: a stopped trial (no eval.json) treated as finished (analyze raises instead of reporting its
before-RL half); the top-passage entity baseline reading a later passage or the answer instead of the top passage;
the last-word baseline reading the after-RL answers; the paired EM difference with its sign flipped; a crashed
run's trial_part record ignored (no wall time).
"""

import importlib.util
import json
import os

import pytest

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@pytest.fixture()
def trials(tmp_path, monkeypatch):
    spec = importlib.util.spec_from_file_location("trials_em", os.path.join(REPO, "benchmarks", "trials_em.py"))
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    monkeypatch.setattr(mod, "TRIALS", str(tmp_path / "trials"))
    monkeypatch.setattr(mod, "SPLIT", str(tmp_path / "split"))
    return mod


def _doc(title, text):
    return f'\n\n<information>Doc 1(Title: "{title}") {text}</information>\n\n'


QUESTIONS = [  # (question, type, gold, top passage)
    ("What is the capital of Namibia?", "capital", ["Windhoek"],
     "Namibia is a country in Africa. The capital of Namibia is Windhoek, the seat of its government."),
    ("Which currency is used in Benin?", "currency", ["XOF"],
     "The currency used in Benin is the XOF; prices in Benin are paid in XOF."),
    ("What is the capital of Tonga?", "capital", ["Nuku'alofa"],
     "Tonga is a country in Oceania. Its largest island is Tongatapu."),  # the answer is not in the passage
]


def _records(predictions):
    recs = [{"question": q, "type": t, "gold": g, "prediction": p, "queries": ["q"], "documents": [_doc(q, d)],
             "response": "", "retrieval_failed": False} for (q, t, g, d), p in zip(QUESTIONS, predictions)]
    # a second search for Namibia whose passage names another capital: the baseline must read the first one
    recs[0]["queries"].append("q2")
    recs[0]["documents"].append(_doc("Angola", "Luanda is the capital of Angola."))
    return recs


def _write_trial(trials, name, before, after=None, part=None):
    out = os.path.join(trials.TRIALS, name)
    os.makedirs(out)
    os.makedirs(trials.SPLIT, exist_ok=True)
    with open(os.path.join(trials.SPLIT, "val.jsonl"), "w") as fh:
        for q, t, g, _ in QUESTIONS:
            fh.write(json.dumps({"question": q, "type": t, "golden_answers": g}) + "\n")
    json.dump({"records": _records(before)}, open(os.path.join(out, "eval_before.json"), "w"))
    if after is not None:
        json.dump({"records": _records(after)}, open(os.path.join(out, "eval.json"), "w"))
    if part is not None:
        json.dump(part, open(os.path.join(out, "trial_part1.json"), "w"))


BEFORE = ["The capital of Namibia is Windhoek.", "The currency used in Benin is XOF.", "Namibia"]


def test_stopped_trial_reports_its_before_half_and_baselines(trials):
    _write_trial(trials, "stopped", BEFORE, part={"name": "stopped", "rc": -6, "wall_s": 3492.7})
    res = trials.analyze("stopped")
    assert res["finished"] is False and res["n"] == 3
    assert res["em"]["before"] == 0.0  # sentences are never exact
    assert list(res["decomposition"]) == ["before"]
    assert res["decomposition"]["before"] == {"exact": 0, "form": 2, "reading": 0, "retrieval": 1, "searched": 3,
                                              "words": pytest.approx(14 / 3)}
    # (a) last word: "Windhoek." and "XOF." are exact once normalised, "Namibia" is not
    assert res["baselines"]["a_last_word"]["f1"] == pytest.approx(2 / 3)
    # (c) the first capital / currency code of the TOP passage: Windhoek, XOF, none for Tonga
    assert res["baselines"]["c_top_entity"]["f1"] == pytest.approx(2 / 3)
    assert "c_top_entity_after" not in res["baselines"]
    assert res["trial"]["wall_s"] == 3492.7  # the crashed run's record, when there is no trial.json


def test_finished_trial_pairs_before_and_after(trials):
    _write_trial(trials, "done", BEFORE, after=["Windhoek", "XOF", "Tonga Nuku'alofa"])
    res = trials.analyze("done")
    assert res["finished"] is True
    assert res["em"]["diff"] == pytest.approx(2 / 3) and res["em"]["after"] == pytest.approx(2 / 3)
    assert res["decomposition"]["after"]["exact"] == 2 and res["decomposition"]["after"]["form"] == 1
    # the last-word baseline is computed from the BEFORE answers (2/3), not the after ones (1): F1 after RL is
    # (1 + 1 + 2/3) / 3 = 8/9, so after minus it is 8/9 - 2/3
    assert res["baselines"]["a_last_word"]["after_minus"]["diff"] == pytest.approx(8 / 9 - 2 / 3)
    # "The capital of Namibia is Windhoek.": 5 tokens without the article, 1 right: F1 1/3; "Namibia": 0
    assert res["by_type"]["capital"] == {"n": 2, "em_before": 0.0, "em_after": 0.5,
                                         "f1_before": pytest.approx((1 / 3) / 2), "f1_after": pytest.approx(5 / 6)}
