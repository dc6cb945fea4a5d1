"""Structural holes of R1-Searcher's format check, one table: response -> reward under the paper schemes
(``r1searcher_stage1/2``, :func:`openrlhf_search.env.rewards.check_format`, ``docs/design.md``, "Rewards") and under the
released schemes, whose expected values come from the logic of R1-Searcher's released reward servers
(RUCAIBox/R1-Searcher ``train/reward_server_qwen_zero.py`` = ``r1searcher_released_stage2``,
``train/reward_server_llama_stage1.py`` = ``r1searcher_released_stage1`` = ``r1searcher_released_llama_stage1``,
``train/reward_server_llama_stage2.py`` = ``r1searcher_released_llama_stage2``; line numbers below are of those
files). Every released value was derived by hand from those lines and checked by running the released
``MathRuleProxy.get_reward`` on ``prompt + response`` (outside this repository; the released code is not copied).

How the released servers score (all count tags, none checks their order):
  Qwen (qwen_zero.py): F1 of the last answer block (l. 109-110, 184-186; 0 without <answer>/</answer>, l. 192-193),
    -2 (l. 249-250) when the 7 query/documents counts differ (l. 199-210), "Assistant"/"assistant" appears anywhere,
    documents included (l. 212-217), not 0 <think> and 1 </think> (l. 219-224), not 1 answer block (l. 226-231), a
    query/documents tag in the answer (l. 233-237), > 10 answer words (l. 239-241), CJK outside documents (l. 243-246).
  Llama stage 1 (llama_stage1.py): +1 if the answer covers the gold else -1 (-1 without an answer block; l. 156-173),
    +0.5 when the 7 counts are equal and >= 1 (l. 176-190), +0.5 when 0 <think>, 1 </think>, 1 <answer>,
    1 </answer> (l. 192-198). No role, length or CJK rule.
  Llama stage 2 (llama_stage2.py): F1 (l. 183-193), -1 (l. 226-227) when the 7 counts differ (l. 198-208), the
    think/answer counts are not 0/1/1/1 (l. 211-219), or CJK outside documents (l. 221-224).
  All three score only what follows the LAST copy of the prompt's tail ("\\nAssistant: <think>", qwen l. 150-154;
  the Llama-3 assistant header + "<think>", llama_stage1 l. 122-125, llama_stage2 l. 149-152).

The paper rule (``check_format`` docstring) is stricter on order (answer before </think>, text after the answer,
an empty answer) and role markers in the model's own text only, and has no CJK rule.
"""

import pytest

from openrlhf_search.env.protocol import get_protocol
from openrlhf_search.env.rewards import check_format, compute_reward
from openrlhf_search.env.types import Passage

R1 = get_protocol("r1searcher")
SR = get_protocol("searchr1")
GOLD = ["Paris"]
Q = "<|begin_of_query|> capital of France<|end_of_query|>"
# "\n\n<|begin_of_documents|>\n(1)..."
D = R1.render_documents([Passage("1", "Paris", "Paris is the capital of France.")])
SEARCH = " I should search." + Q + D + "The documents say Paris."  # the prompt ended with "<think>"
OK = SEARCH + " </think>\n\n<answer> Paris </answer>"
QWEN_TURN = "\nAssistant: <think>"
LLAMA_TURN = "<|eot_id|><|start_header_id|>assistant<|end_header_id|>\n\n<think>"

# name: (response, paper stage 1, paper stage 2, released qwen, released llama stage 1, released llama stage 2)
TABLE = {
    # a well-formed trajectory: the retrieval inside the reasoning block, as R1-Searcher's prompt shows it
    "well_formed": (OK, 1.0, 1.0, 1.0, 2.0, 1.0),
    "no_search": (" I know it. </think>\n\n<answer> Paris </answer>", 0.5, 1.0, 1.0, 1.5, 1.0),
    # THE HOLE: a second reasoning block. Paper rule: the prompt opened the one reasoning block, the model writes no
    # <think> (was 1.0 / 1.0). Released: count(<think>) = 1 fails qwen l. 221 (1 - 2), llama_stage1 l. 197 (no +0.5:
    # 1 + 0.5), llama_stage2 l. 216 (1 - 1).
    "repeated_think": (SEARCH + " </think> <think> again </think>\n\n<answer> Paris </answer>",
                       0.5, -1.0, -1.0, 1.5, 0.0),
    "repeated_think_no_search": (" I know it. </think> <think> again </think>\n\n<answer> Paris </answer>",
                                 0.0, -1.0, -1.0, 1.0, 0.0),
    # a new reasoning block after the documents (Search-R1 style): released counts <think> = 1 -> same as above
    "new_think_after_documents": (" I should search." + Q + D
                                  + "<think> So Paris. </think>\n\n<answer> Paris </answer>",
                                  0.5, -1.0, -1.0, 1.5, 0.0),
    "reopened_think": ("<think> I know it. </think>\n\n<answer> Paris </answer>", 0.0, -1.0, -1.0, 1.0, 0.0),
    "nested_think": (SEARCH + " <think> inner </think> more </think>\n\n<answer> Paris </answer>",
                     0.5, -1.0, -1.0, 1.5, 0.0),
    # no </think>: count(</think>) = 0 fails every released think rule
    "no_think_close": (SEARCH + "\n\n<answer> Paris </answer>", 0.5, -1.0, -1.0, 1.5, 0.0),
    # the answer before the reasoning block ends: the released servers only count (0 <think>, 1 </think>, 1 answer
    # block): not punished anywhere; the paper rule fails it (text after the answer)
    "answer_before_think_end": (SEARCH + " <answer> Paris </answer> </think>", 0.5, -1.0, 1.0, 2.0, 1.0),
    # two answer blocks: count(<answer>) = 2 fails qwen l. 228, llama_stage1 l. 197, llama_stage2 l. 216; the
    # released answer is the last block's (l. 109-110), "Lyon" in the second row
    "answer_inside_and_after_think": (SEARCH + " <answer> Lyon </answer> </think>\n\n<answer> Paris </answer>",
                                      0.5, -1.0, -1.0, 1.5, 0.0),
    "two_answer_blocks": (OK + " <answer> Lyon </answer>", 0.5, -2.0, -2.0, -0.5, -1.0),
    "nested_answer": (SEARCH + " </think>\n\n<answer> <answer> Paris </answer> </answer>", 0.5, -1.0, -1.0, 1.5, 0.0),
    # text after </answer> (the released rollout does not stop at the answer): no released rule sees it
    "text_after_answer": (OK + " Anything else I can help with?", 0.5, -1.0, 1.0, 2.0, 1.0),
    # ... but a query after the answer unbalances the query/documents counts (qwen l. 207, llama l. 183 / 205)
    "query_after_answer": (OK + " " + Q, 0.5, -1.0, -1.0, 1.5, 0.0),
    # a retrieval after </think> and before the answer: counts all fine, and the paper rule allows it too
    "query_after_think": (" I should search. </think>" + Q + D + "<answer> Paris </answer>", 1.0, 1.0, 1.0, 2.0, 1.0),
    # a query inside the answer: qwen l. 234 and the counts (2 query tags, 1 documents block). F1 of the whole block:
    # SQuAD normalisation deletes "<|_" (5 tokens: 2 x 1/5 / (1/5 + 1) = 1/3); R1-Searcher's replaces them by spaces
    # (10 tokens: "begin of query", ...; 2 x 1/10 / (1/10 + 1) = 2/11)
    "query_in_answer": (SEARCH + " </think>\n\n<answer> Paris " + Q + " </answer>",
                        0.5, 1 / 3 - 2, 2 / 11 - 2, 1.5, 2 / 11 - 1),
    # documents the model wrote itself: 0 queries vs 1 documents block (counts differ)
    "model_written_documents": (" I invent" + D + "so Paris. </think>\n\n<answer> Paris </answer>",
                                0.0, -1.0, -1.0, 1.5, 0.0),
    "unclosed_query": (" I should search. <|begin_of_query|> capital of France </think>\n\n<answer> Paris </answer>",
                       0.0, -1.0, -1.0, 1.5, 0.0),
    # an empty answer: no released rule; F1 0, and Cover-EM of "" fails (-1 + 0.5 + 0.5)
    "empty_answer": (SEARCH + " </think>\n\n<answer>  </answer>", 0.5, -2.0, 0.0, 0.0, 0.0),
    # 11 words: qwen l. 240 only; F1 = 2 x 1/9 / (1/9 + 1) = 0.2 (9 tokens once the articles go)
    "long_answer": (SEARCH + " </think>\n\n<answer> Paris which is a large city in the north of France </answer>",
                    0.5, 0.2 - 2, 0.2 - 2, 2.0, 0.2),
    # role markers: the paper rule checks the model's text for "User:" / "Assistant:"; qwen counts only
    # "Assistant"/"assistant" (l. 212-217) but over documents too; the Llama servers have no role rule
    "role_user_in_model_text": (SEARCH.replace("The documents", "\nUser: thanks. The documents")
                                + " </think>\n\n<answer> Paris </answer>", 0.5, -1.0, 1.0, 2.0, 1.0),
    "role_assistant_in_model_text": (SEARCH.replace("The documents", "\nAssistant: sure. The documents")
                                     + " </think>\n\n<answer> Paris </answer>", 0.5, -1.0, -1.0, 2.0, 1.0),
    "assistant_only_in_documents": (OK.replace("Paris is the capital", "The assistant mayor of Paris is the capital"),
                                    1.0, 1.0, -1.0, 2.0, 1.0),
    # the model writes a new assistant turn: each released server scores only what follows the LAST copy of its
    # prompt tail (qwen l. 153, llama l. 124 / 151), so the first, wrong turn is not seen at all
    "new_qwen_turn": (" I know it. </think>\n\n<answer> Lyon </answer>" + QWEN_TURN
                      + " I know it. </think>\n\n<answer> Paris </answer>", 0.0, -1.0, 1.0, 1.0, 0.0),
    "new_llama_turn": (" I know it. </think>\n\n<answer> Lyon </answer>" + LLAMA_TURN
                       + " I know it. </think>\n\n<answer> Paris </answer>", 0.0, -1.0, -1.0, 1.5, 1.0),
    # CJK outside documents: qwen l. 243-246, llama_stage2 l. 221-224; no such rule in llama_stage1 or the paper
    "cjk_outside_documents": (SEARCH.replace("say Paris.", "say 巴黎.") + " </think>\n\n<answer> Paris </answer>",
                              1.0, 1.0, -1.0, 2.0, 0.0),
}
SCHEMES = ("r1searcher_stage1", "r1searcher_stage2", "r1searcher_released_stage2", "r1searcher_released_stage1",
           "r1searcher_released_llama_stage2")


@pytest.mark.parametrize("name", list(TABLE))
def test_structure_table(name):
    """Mutations caught: dropping the one-reasoning-block rule (repeated_think gets 1.0 / 1.0 again), scoring the
    released schemes on the whole response instead of the released solution (new_*_turn), any released count rule
    (its rows)."""
    response, *expected = TABLE[name]
    got = [compute_reward(s, response, GOLD, R1).reward for s in SCHEMES]
    assert got == pytest.approx(expected, abs=1e-6), dict(zip(SCHEMES, got))
    assert compute_reward("r1searcher_released_llama_stage1", response, GOLD, R1).reward == pytest.approx(expected[3])


def test_the_issue_example_and_its_reason():
    response = TABLE["repeated_think"][0]
    assert check_format(response, R1) == (False, "<think> written by the model: the prompt opened the one reasoning "
                                                 "block")
    assert check_format(TABLE["repeated_think_no_search"][0].replace(" <think> again </think>", ""), R1) == (True, "")


# Search-R1's tags under the paper rule: a reasoning block after every documents block is the protocol's design;
# two reasoning blocks with no retrieval between them are the same hole (Search-R1's is_valid_sequence rejects it)
SR_DOCS = SR.render_documents([Passage("1", "Paris", "Paris is the capital of France.")])
SR_OK = "<think> I need the capital. </think><search> capital of France </search>" + SR_DOCS + \
    "<think> The documents say Paris. </think>\n<answer> Paris </answer>"


@pytest.mark.parametrize("response,ok", [
    (SR_OK, True),
    (SR_OK.replace("\n<answer>", " <think> again </think>\n<answer>"), False),
    ("<think> a </think> <think> b </think><answer> Paris </answer>", False),
    (SR_OK.replace("<search>", "<think> more </think><search>"), False),
    ("<think> I know it. </think>\n<answer> Paris </answer>", True),
])
def test_searchr1_tags_one_reasoning_block_per_phase(response, ok):
    assert check_format(response, SR)[0] is ok
    assert compute_reward("r1searcher_stage2", response, GOLD, SR).reward == (1.0 if ok else -1.0)
