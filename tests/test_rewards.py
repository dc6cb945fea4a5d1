"""Reward schemes (hand examples for each), the format checker, and OpenRLHF's reward_func file contract."""

import asyncio
import json
import os

import pytest
import torch

from openrlhf_search.env.protocol import get_protocol
from openrlhf_search.env.rewards import (
    REWARD_SCHEMES,
    RewardResult,
    check_format,
    compute_reward,
    register_reward_scheme,
    searchr1_valid_sequence,
    strip_end_of_turn,
)
from openrlhf_search.env.types import Passage

R1 = get_protocol("r1searcher")
SR = get_protocol("searchr1")
DOCS = [Passage("1", "Paris", "Paris is the capital and largest city of France."),
        Passage("2", "France", "France is a country in Western Europe.")]


def r1_response(answer="Paris", search=True, think_close=True, docs=DOCS):
    """An R1-Searcher response (the prompt ended with '<think>')."""
    text = " I should check.\n"
    if search:
        text += "<|begin_of_query|> capital France<|end_of_query|>" + R1.render_documents(docs) + "It is Paris."
    if think_close:
        text += "</think>\n\n"
    if answer is not None:
        text += f"<answer>{answer}</answer>"
    return text


def sr_response(answer="Paris", search=True, valid=True):
    text = "<think>I need the capital.</think>\n"
    if search:
        text += "<search> capital of France </search>" + SR.render_documents(DOCS)
        text += "<think>The documents say Paris.</think>\n" if valid else "The documents say Paris.\n"
    if answer is not None:
        text += f"<answer> {answer} </answer>"
    return text


# ----------------------------------------------------------------------------------------------- check_format
def test_check_format_accepts_well_formed_responses():
    assert check_format(r1_response(), R1) == (True, "")
    assert check_format(r1_response(search=False), R1) == (True, "")
    assert check_format(r1_response() + "<|eot_id|>", R1) == (True, "")  # end-of-turn string is not leakage
    assert check_format(sr_response(), SR) == (True, "")


@pytest.mark.parametrize("response,reason", [
    (r1_response(answer=None), "no answer block"),
    (r1_response() + "<answer>Lyon</answer>", "expected one answer block, found 2 open / 2 close tags"),
    (r1_response(answer="one two three four five six seven eight nine ten eleven"), "answer has 11 words (> 10)"),
    (r1_response(answer="Paris <think> maybe"), "tag inside the answer: '<think>'"),
    (r1_response(answer="Paris <|begin_of_query|> x"), "tag inside the answer: '<|begin_of_query|>'"),
    (r1_response(answer="   "), "empty answer"),
    (r1_response() + " and more text", "text after the answer"),
    (r1_response().replace("<|end_of_query|>", "", 1), "unbalanced query tags"),
    (" <|begin_of_query|> q<|end_of_query|>  <|begin_of_query|><|end_of_query|></think><answer>x</answer>",
     "empty query"),
    (" <|begin_of_query|> q<|end_of_query|> no documents came</think><answer>x</answer>",
     "1 queries but 0 documents blocks"),
    (" I invent documents" + R1.render_documents(DOCS) + "</think><answer>x</answer>",
     "documents block not preceded by a query"),
    (r1_response(think_close=False), "reasoning block not closed"),
    (r1_response().replace("</think>", "</think></think>"), "2 </think> tags: expected one reasoning block"),
    (r1_response() .replace("It is Paris.", "It is Paris.\nUser: thanks"), "role leakage: 'User:'"),
    (r1_response().replace("It is Paris.", "<|im_start|>assistant"), "role leakage: '<|im_start|>'"),
    (r1_response().replace("It is Paris.", "\nAssistant: sure"), "role leakage: 'Assistant:'"),
])
def test_check_format_rejects(response, reason):
    assert check_format(response, R1) == (False, reason)


def test_check_format_answer_word_cap_is_configurable_and_docs_are_not_checked_for_roles():
    long = r1_response(answer="a b c d e f g h i j k l")
    assert check_format(long, R1)[0] is False
    assert check_format(long, R1, answer_max_words=20) == (True, "")
    leaky_doc = [Passage("1", "Chat", "User: hello Assistant: hi")]
    assert check_format(r1_response(docs=leaky_doc), R1) == (True, "")


def test_check_format_searchr1_specifics():
    # a second reasoning block with no retrieval before it is one phase written twice (Search-R1's
    # is_valid_sequence rejects it too)
    twice = sr_response().replace("<answer>", "<think>x</think><answer>", 1)
    assert check_format(twice, SR) == (False, "repeated reasoning block without a retrieval in between")
    assert searchr1_valid_sequence(twice, SR)[0] is False
    invalid_turn = "<think>a</think>oops" + SR.invalid_action_message() + "<think>b</think><answer>x</answer>"
    assert check_format(invalid_turn, SR) == (False, "invalid action in trajectory")
    assert check_format("<answer>x</answer><think>late</think>", SR) == (False, "text after the answer")


def test_searchr1_valid_sequence():
    assert searchr1_valid_sequence(sr_response(), SR) == (True, "")
    assert searchr1_valid_sequence(sr_response(search=False), SR) == (True, "")
    assert searchr1_valid_sequence(sr_response(valid=False), SR)[0] is False
    assert searchr1_valid_sequence(sr_response(answer=None), SR) == (False, "incomplete sequence")
    assert searchr1_valid_sequence("<answer>x</answer>", SR)[0] is False  # must think first
    assert searchr1_valid_sequence(sr_response() + "<|im_end|>", SR) == (True, "")
    # R1-Searcher's prompt already opened <think>
    assert searchr1_valid_sequence(" hmm</think><answer>x</answer>", R1) == (True, "")


# ---------------------------------------------------------------------------------------------------- schemes
def test_every_scheme_is_registered():
    assert set(REWARD_SCHEMES) >= {"r1searcher_stage1", "r1searcher_stage2", "r1searcher_released_stage1",
                                   "r1searcher_released_stage2", "r1searcher_released_llama_stage2",
                                   "searchr1_em", "searchr1_format"}


def test_r1searcher_stage1_hand_examples():
    def r(resp):
        return compute_reward("r1searcher_stage1", resp, ["Paris"], R1).reward
    assert r(r1_response()) == 1.0                       # retrieval 0.5 + format 0.5
    assert r(r1_response(answer="Lyon")) == 1.0          # no answer term in stage 1
    assert r(r1_response(search=False)) == 0.5           # format only
    assert r(r1_response(answer=None)) == 0.5            # retrieval only (no answer: format fails)
    assert r(r1_response(search=False, answer=None)) == 0.0


def test_r1searcher_stage2_hand_examples():
    def r(resp, golds=("Paris",)):
        return compute_reward("r1searcher_stage2", resp, list(golds), R1)
    assert r(r1_response()).reward == 1.0
    assert r(r1_response(), ["Paris, France"]).reward == pytest.approx(2 / 3)   # F1: P=1, R=1/2
    assert r(r1_response(answer="Lyon")).reward == 0.0
    bad = r(r1_response(answer="I am quite sure that the answer to this is Paris"))
    # 10 tokens after dropping 'the': P=1/10, R=1
    assert bad.reward == pytest.approx(2 * 0.1 / 1.1 - 2) and bad.components["format_ok"] == 0.0
    assert r(r1_response(answer=None)).reward == -2.0
    assert r(r1_response(answer="True"), ["yes"]).reward == 0.0   # SQuAD normalisation: 'true' != 'yes'


def test_r1searcher_released_stage2_hand_examples():
    def r(resp, golds=("Paris",)):
        return compute_reward("r1searcher_released_stage2", resp, list(golds), R1)
    assert r(r1_response()).reward == 1.0
    assert r(r1_response(answer="True"), ["yes"]).reward == 1.0   # their bool mapping
    assert r(r1_response(answer="Saxe-Coburg"), ["Saxe Coburg"]).reward == 1.0
    # the word 'assistant' anywhere, retrieved documents included, costs 2
    leaky = r(r1_response(docs=[Passage("1", "Siri", "Siri is a virtual assistant.")]))
    assert leaky.reward == -1.0 and "assistant" in leaky.format_reason
    assert r(r1_response().replace("It is Paris.", "巴黎")).reward == -1.0
    cjk_in_docs = r1_response(docs=[Passage("1", "Paris", "巴黎 Paris")])
    assert r(cjk_in_docs).reward == 1.0
    assert r(r1_response(answer=None)).reward == -2.0
    with pytest.raises(ValueError, match="r1searcher protocol"):
        compute_reward("r1searcher_released_stage2", sr_response(), ["Paris"], SR)


# Values transcribed from RUCAIBox/R1-Searcher train/reward_server_llama_stage1.py (MathRuleProxy.get_reward):
# l. 164-173 answer term +1 (Cover-EM) / -1 (wrong or no <answer>...</answer>); l. 175-190 +0.5 when the seven
# documents/query tag counts are all equal and >= 1; l. 192-198 +0.5 when <think> x0, </think> x1, <answer> x1,
# </answer> x1. No role, CJK or answer-length check in that file.
RELEASED_STAGE1_FILE = "RUCAIBox/R1-Searcher train/reward_server_llama_stage1.py"


def test_r1searcher_released_stage1_values_of_the_released_file():
    def r(resp, golds=("Paris",)):
        return compute_reward("r1searcher_released_stage1", resp, list(golds), R1).reward
    assert r(r1_response()) == 2.0                          # one search + answer, correct: 1 + 0.5 + 0.5
    assert r(r1_response(answer="Lyon")) == 0.0             # one search + answer, wrong: -1 + 0.5 + 0.5
    assert r(r1_response(search=False)) == 1.5              # no search, correct: 1 + 0 + 0.5
    assert r(r1_response(answer=None)) == -0.5              # search, no answer: -1 + 0.5 + 0
    assert r(r1_response(search=False, answer=None)) == -1.0
    assert r(r1_response(answer="Paris, France")) == 2.0    # Cover-EM: the gold's tokens inside the answer
    assert r(r1_response(answer="True"), ["yes"]) == 2.0     # their bool mapping
    # a query that got no documents block: counts 1,1 vs 0 -> no retrieval term
    unanswered = r1_response(search=False).replace(" I should check.", "<|begin_of_query|> x<|end_of_query|>")
    assert r(unanswered) == 1.5
    # the model opening <think> again costs the +0.5 of l. 197
    assert r(r1_response().replace("It is Paris.", "<think>It is Paris.")) == 1.5
    # checks the Qwen stage-2 server has and this file has not: role word in documents, CJK, > 10 words
    assert r(r1_response(docs=[Passage("1", "Siri", "Siri is a virtual assistant.")])) == 2.0
    assert r(r1_response().replace("It is Paris.", "巴黎")) == 2.0
    assert r(r1_response(answer="I am quite sure that the answer to this question is Paris")) == 2.0
    # the end-of-turn string their server appends (l. 143-146) changes nothing
    assert r(r1_response() + "<|eot_id|>") == 2.0
    with pytest.raises(TypeError, match="does not take"):
        compute_reward("r1searcher_released_stage1", r1_response(), ["Paris"], R1, format_penalty=-1.0)


# RUCAIBox/R1-Searcher train/reward_server_llama_stage2.py: F1 (l. 183-185), 0 without answer tags (l. 191-193);
# -1 (l. 226-227) when the seven tag counts differ (l. 197-208, zero allowed), the think/answer counts are wrong
# (l. 211-219) or CJK appears outside documents (l. 221-224).
def test_r1searcher_released_llama_stage2_values_of_the_released_file():
    def r(resp, golds=("Paris",)):
        return compute_reward("r1searcher_released_llama_stage2", resp, list(golds), R1).reward
    assert r(r1_response()) == 1.0
    assert r(r1_response(search=False)) == 1.0            # zero retrievals: all counts 0, equal
    assert r(r1_response(answer="Lyon")) == 0.0
    assert r(r1_response(answer=None)) == -1.0            # F1 0, answer counts wrong
    assert r(r1_response().replace("It is Paris.", "巴黎")) == 0.0
    assert r(r1_response(docs=[Passage("1", "Siri", "Siri is a virtual assistant.")])) == 1.0   # no role check
    long = r(r1_response(answer="I am quite sure that the answer to this question is Paris"))
    assert long == pytest.approx(2 * (1 / 11) / (1 / 11 + 1))   # F1, no length cap ('the' dropped: 11 tokens)
    unanswered = r1_response(search=False).replace(" I should check.", "<|begin_of_query|> x<|end_of_query|>")
    assert r(unanswered) == 0.0                           # counts differ: 1 - 1


def test_searchr1_em_hand_examples():
    def r(resp, golds=("Paris",)):
        return compute_reward("searchr1_em", resp, list(golds), SR).reward
    assert r(sr_response()) == 1.0
    assert r(sr_response(answer="the city of Paris")) == 0.0   # EM, not containment
    assert r(sr_response(answer="The Paris!")) == 1.0
    assert r(sr_response(answer=None)) == 0.0
    assert r(sr_response(answer="Lutetia"), ["Paris", "Lutetia"]) == 1.0


def test_searchr1_format_hand_examples():
    def r(resp, golds=("Paris",), **kw):
        return compute_reward("searchr1_format", resp, list(golds), SR, **kw).reward
    assert r(sr_response()) == 1.0                                          # EM, valid
    assert r(sr_response(valid=False)) == pytest.approx(0.8)                # EM, invalid: 1 - 0.2
    assert r(sr_response(answer="Lyon")) == pytest.approx(0.2)              # wrong, valid: lambda_f
    assert r(sr_response(answer="Lyon"), retrieval_score=0.1) == pytest.approx(0.3)   # gold in <information>
    assert r(sr_response(answer="Lyon"), ["Berlin"], retrieval_score=0.1) == pytest.approx(0.2)
    assert r(sr_response(answer="Lyon", valid=False)) == pytest.approx(0.1)  # wrong, invalid, answered
    assert r(sr_response(answer=None, valid=False)) == 0.0                   # nothing


def test_reward_components_are_floats_for_logging():
    res = compute_reward("r1searcher_stage2", r1_response(), ["Paris"], "r1searcher")
    assert isinstance(res, RewardResult)
    for key in ("em", "f1", "cover_em", "format_ok", "answer_present", "valid_searches", "score"):
        assert isinstance(res.components[key], float), key
    assert res.components["valid_searches"] == 1.0 and res.score == 1.0


def test_compute_reward_errors():
    with pytest.raises(ValueError, match="unknown reward scheme"):
        compute_reward("f1_only", "x", ["a"], R1)
    with pytest.raises(TypeError, match="format_penalty"):
        compute_reward("searchr1_em", "x", ["a"], SR, format_penalty=-1)
    with pytest.raises(ValueError, match="gold answers"):
        compute_reward("searchr1_em", "x", [], SR)
    assert compute_reward("searchr1_em", None, ["a"], SR).reward == 0.0


def test_register_reward_scheme():
    def length_penalty(response_text, golds, protocol, answer_max_words=10):
        return RewardResult(-len(response_text) / 100.0, {"score": 0.0})
    register_reward_scheme("test_length_penalty", length_penalty)
    try:
        assert compute_reward("test_length_penalty", "x" * 50, ["a"], R1).reward == -0.5
    finally:
        REWARD_SCHEMES.pop("test_length_penalty")


def test_strip_end_of_turn():
    assert strip_end_of_turn("<answer>a</answer><|im_end|>\n<|endoftext|><|endoftext|>") == "<answer>a</answer>"
    assert strip_end_of_turn("plain") == "plain"


# ------------------------------------------------------------------------------------------------ reward_func
def _set_config(monkeypatch, **fields):
    monkeypatch.setenv("OPENRLHF_SEARCH_CONFIG", json.dumps(fields))


def test_reward_func_contract(monkeypatch):
    from openrlhf_search.env.reward_func import reward_func

    _set_config(monkeypatch, protocol="r1searcher", reward_scheme="r1searcher_stage2")
    prompt = R1.build_prompt("What is the capital of France?")
    queries = [prompt + r1_response() + "<|endoftext|>", prompt + r1_response(answer=None)]
    out = reward_func(queries, [prompt, prompt], ["Paris", '["Lyon"]'])
    assert out["rewards"].shape == (2,) and out["rewards"].dtype == torch.float32
    assert out["rewards"].tolist() == [1.0, -2.0]
    assert out["scores"].tolist() == [1.0, 0.0]
    assert out["extra_logs"]["format_ok"].tolist() == [1.0, 0.0]
    with pytest.raises(ValueError, match="3 labels"):
        reward_func(queries, [prompt, prompt], ["a", "b", "c"])
    with pytest.raises(ValueError, match="sample 0"):
        reward_func(["unrelated text"], [prompt], ["Paris"])


def test_reward_func_loaded_by_openrlhf_single_turn_executor(monkeypatch, qwen_tokenizer):
    """OpenRLHF's own executor loads the file by path and reads the dict it returns."""
    import openrlhf_search._cpu_compat  # noqa: F401
    from openrlhf.utils.agent import SingleTurnAgentExecutor

    _set_config(monkeypatch, protocol="searchr1", reward_scheme="searchr1_format")
    path = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))),
                        "openrlhf_search", "env", "reward_func.py")
    executor = SingleTurnAgentExecutor(remote_rm_url=path)
    assert executor.reward_func is not None
    prompt = SR.build_prompt("What is the capital of France?", qwen_tokenizer, chat=True)
    ids = qwen_tokenizer(prompt + sr_response() + "<|im_end|>", add_special_tokens=False)["input_ids"]
    query = qwen_tokenizer.decode(ids, skip_special_tokens=False)  # what the executor passes
    (info,) = asyncio.run(executor._fetch_rewards_via_func([query], [prompt], [{"target": ["Paris"]}]))
    assert info["rewards"].tolist() == [1.0]
    assert info["extra_logs"]["valid_sequence"].tolist() == [1.0]


