"""bench_multihop's measures on the embedded default: the bridge entity of each 2-hop question,
whether a second query names it, and the pairing of before/after records. No model runs here."""

import json

import pytest

from benchmarks.bench_multihop import bridge_entity, follow_up_names_bridge, names_bridge, summarise
from openrlhf_search.cpu.data.default_dataset import build_default_dataset


@pytest.fixture(scope="module")
def default_ds(tmp_path_factory):
    ds = build_default_dataset(str(tmp_path_factory.mktemp("ds")), seed=0)
    titles = {r["id"]: r["title"] for r in map(json.loads, open(ds.corpus_path))}
    rows = [json.loads(line) for line in open(ds.train_path)] + [json.loads(line) for line in open(ds.eval_path)]
    return titles, rows


def test_bridge_is_the_country_of_the_answer_passage(default_ds):
    titles, rows = default_ds
    coc = next(r for r in rows if r["type"] == "currency_of_capital")
    # "What currency is used in the country whose capital is Z?": the bridge is the country, never the capital Z
    # (a mutation reading the first supporting passage's title would still pass here, the next case catches it)
    bridge = bridge_entity(coc, titles)
    assert not bridge.startswith("Economy of ") and bridge in titles.values()
    assert bridge.lower() not in coc["question"].lower()
    con = next(r for r in rows if r["type"] == "capital_of_neighbor")
    # "the capital of the country that borders X and uses the currency Y": the bridge is the neighbour, not X
    bridge = bridge_entity(con, titles)
    assert bridge == titles[con["supporting_ids"][-1]]
    assert bridge != titles[con["supporting_ids"][0]]
    assert bridge.lower() not in con["question"].lower()


def test_only_the_second_query_counts():
    assert names_bridge({"queries": ["capital Vaduz", "Liechtenstein currency"]}, "Liechtenstein")
    assert not names_bridge({"queries": ["Liechtenstein currency"]}, "Liechtenstein")  # one search: no second hop
    assert not names_bridge({"queries": ["Liechtenstein", "currency Vaduz"]}, "Liechtenstein")  # first, not second
    assert not names_bridge({"queries": []}, "Liechtenstein")
    # any follow-up query: the third one counts, the first does not
    assert follow_up_names_bridge({"queries": ["a", "b", "capital Liechtenstein"]}, "Liechtenstein")
    assert not follow_up_names_bridge({"queries": ["Liechtenstein", "b"]}, "Liechtenstein")


def _eval(questions, em, f1, searches, queries):
    return {"n": len(questions), "questions": questions,
            "per_question": {"em": em, "f1": f1, "valid_searches": searches},
            "records": [{"question": q, "queries": qs} for q, qs in zip(questions, queries)]}


def test_summary_is_paired_and_signed():
    qs = ["q1", "q2"]
    bridges = {"q1": "Peru", "q2": "Chad"}
    before = _eval(qs, [0.0, 0.0], [0.2, 0.4], [1.0, 1.0], [["a"], ["b"]])
    after = _eval(qs, [1.0, 0.0], [1.0, 0.6], [2.0, 2.0], [["a", "peru sol"], ["b", "chad"]])
    s = summarise(before, after, bridges)
    assert s["f1"]["diff"]["diff"] == pytest.approx(0.5)  # after - before, not before - after
    assert s["valid_searches"]["diff"]["diff"] == pytest.approx(1.0)
    assert s["bridge_in_second_query"]["before"] == 0.0 and s["bridge_in_second_query"]["after"] == 1.0
    assert s["bridge_in_follow_up"]["after"] == 1.0
    assert s["answer_passage_retrieved"]["before"] == 0.0  # records without the key count as not retrieved
    after["records"][1]["answer_passage_retrieved"] = True
    assert summarise(before, after, bridges)["answer_passage_retrieved"]["after"] == 0.5
    with pytest.raises(SystemExit, match="different questions"):
        summarise(before, _eval(["q2", "q1"], [0, 0], [0, 0], [0, 0], [[], []]), bridges)


def test_summarise_only_rereads_a_run_folder_and_keeps_its_job_time(tmp_path):
    """--summarise_only re-reads <out>/train (no training) and writes the table again, with the earlier run's job time
    and flags; without the run's evaluations it stops with one line."""
    from benchmarks.bench_multihop import main

    ds = build_default_dataset(str(tmp_path / "data"), seed=0)
    two_hop = [r for r in map(json.loads, open(ds.eval_path)) if r["hops"] == 2][:3]
    with pytest.raises(SystemExit, match="has no eval_before.json"):
        main(["--summarise_only", "--eval_n", "3", "--out", str(tmp_path)])
    qs = [r["question"] for r in two_hop]
    run = tmp_path / "train"
    run.mkdir()
    (run / "eval_before.json").write_text(json.dumps(_eval(qs, [0.0] * 3, [0.0] * 3, [1.0] * 3, [["a"]] * 3)))
    (run / "eval.json").write_text(json.dumps(_eval(qs, [1.0, 0.0, 0.0], [1.0, 0.5, 0.0], [2.0] * 3,
                                                    [["a", "b"]] * 3)))
    (run / "metrics.jsonl").write_text("".join(json.dumps({"step": k, "reward": 0.0, "valid_searches": 1.0 + k / 4})
                                               + "\n" for k in (1, 2)))
    (tmp_path / "multihop.json").write_text(json.dumps({"wall_s": 1234.0, "cmd": [
        "python", "--search.max_turns", "4", "--warmstart.hop_searches", "chain"]}))
    out = main(["--summarise_only", "--eval_n", "3", "--out", str(tmp_path)])
    assert out["wall_s"] == 1234.0 and out["summary"]["f1"]["diff"]["diff"] == pytest.approx(0.5)
    md = (tmp_path / "multihop.md").read_text()
    assert "--warmstart.hop_searches chain" in md and "job 1234 s" in md
