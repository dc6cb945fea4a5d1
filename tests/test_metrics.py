"""Answer metrics: normalisation, EM, F1, Cover-EM and gold parsing, on hand-made edge cases."""

import json

import numpy as np
import pytest

from openrlhf_search.env.metrics import (
    cover_em,
    cover_em_squad,
    exact_match,
    f1_score,
    mean,
    normalize_answer,
    parse_golds,
    r1searcher_normalize,
)
from tests.conftest import shared_path


def test_squad_normalisation():
    assert normalize_answer("The  Eiffel-Tower!") == "eiffeltower"
    assert normalize_answer("An apple, a pear and THE plum.") == "apple pear and plum"
    assert normalize_answer("  theater  ") == "theater"  # 'the' only as a whole word
    assert normalize_answer("") == ""


def test_r1searcher_normalisation_replaces_punctuation_by_space():
    assert r1searcher_normalize("Saxe-Coburg") == "saxe coburg"
    assert normalize_answer("Saxe-Coburg") == "saxecoburg"
    assert r1searcher_normalize("True") == "yes" and r1searcher_normalize("False") == "no"
    assert r1searcher_normalize("true") == "true"  # only the exact Python-bool strings are mapped
    assert r1searcher_normalize("New_York") == "new york"
    assert r1searcher_normalize("Rock ‘n’ roll´s `hit`") == "rock n roll s hit"


def test_exact_match_several_golds_and_empty():
    assert exact_match("the Beatles", ["Beatles", "The Fab Four"]) == 1.0
    assert exact_match("Fab Four!", '["Beatles", "The Fab Four"]') == 1.0
    assert exact_match("Rolling Stones", ["Beatles"]) == 0.0
    assert exact_match("", ["Beatles"]) == 0.0
    assert exact_match(None, ["Beatles"]) == 0.0
    assert exact_match("", ["a"]) == 0.0  # the gold normalises to "" too; no answer must not match
    assert exact_match("the", ["The"]) == 0.0


def test_f1_partial_overlap_and_max_over_golds():
    # pred tokens {barack, obama}, gold {obama}: P=1/2, R=1 -> F1=2/3
    assert f1_score("Barack Obama", ["Obama"]) == pytest.approx(2 / 3)
    assert f1_score("Barack Obama", ["Michelle", "Barack Obama"]) == 1.0
    assert f1_score("", ["Obama"]) == 0.0
    assert f1_score("a the an", ["Obama"]) == 0.0  # only articles: nothing left


def test_f1_yes_no_rule():
    assert f1_score("yes", ["no"]) == 0.0
    assert f1_score("yes it is", ["yes"]) == 0.0  # one side is 'yes', the other is not exactly 'yes'
    assert f1_score("Yes.", ["yes"]) == 1.0
    assert f1_score("noanswer", ["no answer"]) == 0.0


def test_cover_em():
    assert cover_em("He was born in Paris, France", ["Paris"]) == 1.0
    assert cover_em("France Paris", ["Paris, France"]) == 1.0  # order ignored
    assert cover_em("Paris", ["Paris, France"]) == 0.0  # every gold token is needed
    assert cover_em("Titan IIIE/Centaur", ["Titan IIIE"]) == 1.0
    assert cover_em_squad("Titan IIIE/Centaur", ["Titan IIIE"]) == 0.0  # the 0.504 vs 0.496 difference
    assert cover_em("", ["Paris"]) == 0.0
    assert cover_em("!!!", ["?"]) == 0.0
    assert cover_em("True", ["yes"]) == 1.0


def test_unicode():
    assert exact_match("Île-de-France", ["île de france"]) == 0.0  # SQuAD deletes '-' -> 'îledefrance'
    assert exact_match("Île-de-France", ["ÎledeFrance"]) == 1.0
    assert cover_em("Île-de-France", ["île de france"]) == 1.0
    assert f1_score("北京", ["北京"]) == 1.0
    assert exact_match("Zürich", ["zurich"]) == 0.0  # accents are kept, as in SQuAD


def test_parse_golds_forms():
    assert parse_golds("Paris") == ["Paris"]
    assert parse_golds('["Paris", "Paris, France"]') == ["Paris", "Paris, France"]
    assert parse_golds(["Paris", "", "Paris", 1837]) == ["Paris", "1837"]
    assert parse_golds({"target": ["a", "b"]}) == ["a", "b"]
    assert parse_golds(json.dumps({"target": ["a"]})) == ["a"]
    assert parse_golds(np.array(["x", "y"], dtype=object)) == ["x", "y"]
    assert parse_golds("[not json") == ["[not json"]
    for bad in (None, [], "", {"foo": 1}, object()):
        with pytest.raises(ValueError):
            parse_golds(bad)


def test_parse_golds_reads_every_shared_dataset_format():
    with open(shared_path("qa", "searchr1", "test_sample.jsonl")) as f:
        row = json.loads(f.readline())
    assert parse_golds(row["reward_model"]["ground_truth"]) == parse_golds(row["golden_answers"])
    with open(shared_path("qa", "flashrag", "nq.test.jsonl")) as f:
        row = json.loads(f.readline())
    assert parse_golds(row["golden_answers"]) and parse_golds(row) == parse_golds(row["golden_answers"])


def test_mean():
    assert mean([]) == 0.0
    assert mean([1.0, 0.0, 0.5]) == 0.5
