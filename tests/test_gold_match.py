"""The gold-in-documents check of ``searchr1_format``: whole tokens by default, the released substring rule on
request."""

import pytest

from openrlhf_search.env.protocol import get_protocol
from openrlhf_search.env.rewards import compute_reward, gold_in_documents
from openrlhf_search.env.types import Passage

P = get_protocol("searchr1")


def _resp(text, answer="wrong guess"):
    return ("<think> a </think>\n<search> q </search>" + P.render_documents([Passage("1", "T", text)])
            + f"<think> b </think>\n<answer> {answer} </answer>")


@pytest.mark.parametrize("gold, text", [("1", "It was founded in 1990."), ("no", "This is not it."),
                                        ("US", "The USSR fell."), ("Yes", "It rained yesterday.")])
def test_gold_inside_a_longer_word_is_not_retrieved(gold, text):
    assert not gold_in_documents(_resp(text), [gold], P)
    assert gold_in_documents(_resp(text), [gold], P, match="substring")  # the released rule
    kw = dict(retrieval_score=0.1)
    assert compute_reward("searchr1_format", _resp(text), [gold], P, **kw).reward == pytest.approx(0.2)
    assert compute_reward("searchr1_format", _resp(text), [gold], P, gold_match="substring",
                          **kw).reward == pytest.approx(0.3)


@pytest.mark.parametrize("gold, text", [("1", "Number 1, again."), ("United States", "the United States' army"),
                                        ("Suva", "Suva")])
def test_gold_as_whole_tokens_is_retrieved(gold, text):
    assert gold_in_documents(_resp(text), [gold], P)
    res = compute_reward("searchr1_format", _resp(text), [gold], P, retrieval_score=0.1)
    assert res.reward == pytest.approx(0.3) and res.components["gold_in_information"] == 1.0


def test_unknown_gold_match_is_refused():
    with pytest.raises(ValueError, match="gold_match"):
        compute_reward("searchr1_format", _resp("x"), ["x"], P, gold_match="fuzzy")
