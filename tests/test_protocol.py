"""Protocols: registry, prompts, action parsing, document rendering, and adding a third protocol."""

import json
import time

import pytest

from openrlhf_search.env.config import ConfigError
from openrlhf_search.env.paper_protocols import R1SearcherProtocol, SearchR1Protocol
from openrlhf_search.env.protocol import PROTOCOLS, Protocol, get_protocol, register_protocol
from openrlhf_search.env.types import Passage
from tests.conftest import shared_path

R1 = get_protocol("r1searcher")
SR = get_protocol("searchr1")
PASSAGES = [Passage("1", "Paris", "Paris is the capital of France."),
            Passage("2", "Île-de-France", "A region\nof France.")]


# ------------------------------------------------------------------------------------------------ registry
def test_registry_has_both_papers_and_rejects_unknown_names():
    assert PROTOCOLS["r1searcher"] is R1SearcherProtocol
    assert PROTOCOLS["searchr1"] is SearchR1Protocol
    assert isinstance(get_protocol("searchr1"), SearchR1Protocol)
    assert get_protocol(R1) is R1
    with pytest.raises(ConfigError, match="r1searcher"):
        get_protocol("r1-searcher")


def test_register_rejects_bad_classes():
    with pytest.raises(TypeError):
        register_protocol(dict)

    class NoTags(Protocol):
        name = "notags"

    with pytest.raises(ValueError, match="query_open"):
        register_protocol(NoTags)
    assert "notags" not in PROTOCOLS


def test_stop_strings_are_the_closing_tags():
    assert R1.stop_strings == ("<|end_of_query|>", "</answer>")
    assert SR.stop_strings == ("</search>", "</answer>")


def test_a_third_protocol_is_a_subclass_plus_register():
    class ToolCallProtocol(Protocol):
        name = "toolcall_test"
        query_open, query_close = "<tool_call>", "</tool_call>"
        doc_open, doc_close = "\n<tool_response>\n", "\n</tool_response>\n"

        def build_prompt(self, question, tokenizer=None, chat=False):
            return f"Search with <tool_call>q</tool_call>. Question: {self._check_question(question)}\n"

        def format_passages(self, passages):
            return "\n".join(f"[{i + 1}] {p.title}: {p.text}" for i, p in enumerate(passages))

    register_protocol(ToolCallProtocol)
    try:
        proto = get_protocol("toolcall_test")
        assert proto.stop_strings == ("</tool_call>", "</answer>")
        assert proto.parse_action("<think>hm</think><tool_call> capital of France </tool_call>").content == \
            "capital of France"
        docs = proto.render_documents(PASSAGES[:1])
        assert docs == "\n<tool_response>\n[1] Paris: Paris is the capital of France.\n</tool_response>\n"
        response = "<tool_call>x</tool_call>" + docs + "<think>ok</think><answer>Paris</answer>"
        assert proto.extract_queries(response) == ["x"]
        assert proto.extract_answer(response) == "Paris"
        assert [s.kind for s in proto.split_turns(response)] == ["model", "environment", "model"]
        # the generic reward code works with it unchanged
        from openrlhf_search.env.rewards import check_format, compute_reward
        assert check_format(response, proto) == (True, "")
        assert compute_reward("r1searcher_stage2", response, ["Paris"], "toolcall_test").reward == 1.0
    finally:
        PROTOCOLS.pop("toolcall_test", None)


# ------------------------------------------------------------------------------------------------ prompts
def test_r1searcher_base_prompt_matches_their_template():
    prompt = R1.build_prompt("  Who wrote Hamlet? ")
    assert prompt.startswith("The User asks a question, and the Assistant solves it.\n")
    assert prompt.endswith("<|end_of_documents|>\".\n\nUser:Who wrote Hamlet?\nAssistant: <think>")
    assert '"<|begin_of_query|> search query (only list keywords, such as **"keyword_1 keyword_2 ..."**)' \
           '<|end_of_query|>"' in prompt
    assert "**the Assistant can perform searching**" in prompt


def test_r1searcher_chat_prompt_puts_instructions_in_system_and_opens_think(qwen_tokenizer):
    prompt = R1.build_prompt("Who wrote Hamlet?", qwen_tokenizer, chat=True)
    assert prompt.startswith("<|im_start|>system\nYou are a helpful assistant.\nGiven a question")
    assert "**you can perform searching for uncertain knowledge**" in prompt
    assert prompt.endswith("<|im_start|>user\nWho wrote Hamlet?<|im_end|>\n<|im_start|>assistant\n<think>")


def test_searchr1_prompt_equals_their_training_rows(qwen_tokenizer):
    with open(shared_path("qa", "searchr1", "nq_hotpotqa_train_sample.jsonl")) as f:
        rows = [json.loads(line) for line in f]
    assert len(rows) == 512
    for row in rows:
        assert SR.build_prompt(row["question"]) == row["prompt"][0]["content"]
    row = rows[0]
    assert SR.build_prompt(row["question"], qwen_tokenizer, chat=True) == qwen_tokenizer.apply_chat_template(
        row["prompt"], tokenize=False, add_generation_prompt=True)


def test_prompt_errors():
    with pytest.raises(ValueError, match="non-empty"):
        R1.build_prompt("   ")
    with pytest.raises(ValueError, match="chat template"):
        SR.build_prompt("q?", tokenizer=None, chat=True)


# ------------------------------------------------------------------------------------------- parse_action
@pytest.mark.parametrize("proto", [R1, SR], ids=["r1searcher", "searchr1"])
def test_parse_action_cases(proto):
    qo, qc = proto.query_open, proto.query_close
    assert proto.parse_action(f"<think>I need facts.</think>{qo} capital of France {qc}").kind == "query"
    assert proto.parse_action(f"{qo} capital of France {qc}").content == "capital of France"
    # unclosed earlier open tag: the last open tag before the close wins
    assert proto.parse_action(f"{qo} draft {qo} real query {qc}").content == "real query"
    empty = proto.parse_action(f"{qo}   {qc}")
    assert (empty.kind, empty.content) == ("invalid", "empty query")
    assert proto.parse_action(f"{qo} never closed").content == f"unclosed {qo}"
    assert proto.parse_action("I just think.").kind == "invalid"
    assert proto.parse_action("").kind == "invalid"
    assert proto.parse_action(f"stray {qc}").kind == "invalid"
    # answers: text after the answer and tags inside it do not change the action
    ans = proto.parse_action("</think>\n\n<answer> Paris </answer> trailing words")
    assert (ans.kind, ans.content) == ("answer", "Paris")
    tagged = proto.parse_action(f"<answer> Paris {qo} x </answer>")
    assert (tagged.kind, tagged.content) == ("answer", f"Paris {qo} x")
    assert proto.parse_action("<answer> unclosed").content == "unclosed <answer>"
    # the first completed action decides (the engine stops there)
    assert proto.parse_action(f"<answer>A</answer> {qo} q {qc}").kind == "answer"
    assert proto.parse_action(f"{qo} q {qc} <answer>A</answer>").kind == "query"
    # non-ASCII
    assert proto.parse_action(f"{qo} Île-de-France 首都 {qc}").content == "Île-de-France 首都"
    assert proto.parse_action(123).kind == "invalid"


def test_parse_action_on_very_long_text_is_fast():
    long_turn = "reasoning " * 50_000 + "<|begin_of_query|> q <|end_of_query|>"
    start = time.perf_counter()
    action = R1.parse_action(long_turn)
    assert action.content == "q"
    assert R1.extract_answer(long_turn * 3) == ""
    assert time.perf_counter() - start < 5.0  # pathological regex backtracking would take minutes


def test_extract_answer_is_the_last_model_answer_and_ignores_documents():
    response = ("<think>x</think><answer> first </answer><search>q</search>"
                + SR.render_documents([Passage("1", "T", "the doc says <answer> Beijing </answer>")])
                + "<think>y</think><answer> second </answer>")
    assert SR.extract_answer(response) == "second"
    assert SR.extract_answers(response) == ["first", "second"]
    only_doc = "<search>q</search>" + SR.render_documents([Passage("1", "T", "<answer> Beijing </answer>")])
    assert SR.extract_answer(only_doc) == ""
    assert SR.extract_answer("") == ""


# -------------------------------------------------------------------------------------------- documents
def test_r1searcher_documents_block_exact():
    block = R1.render_documents(PASSAGES)
    assert block == ("\n\n<|begin_of_documents|>\n(1)Paris   Paris is the capital of France.\n"
                     "(2)Île-de-France   A region of France.\n<|end_of_documents|>\n\n")
    assert R1.invalid_action_message() is None


def test_searchr1_documents_block_and_invalid_message_exact():
    block = SR.render_documents(PASSAGES)
    assert block == ('\n\n<information>Doc 1(Title: "Paris") Paris is the capital of France.\n'
                     'Doc 2(Title: "Île-de-France") A region\nof France.</information>\n\n')
    assert SR.render_documents([Passage("1", '"Quoted"', "t")]) == \
        '\n\n<information>Doc 1(Title: "Quoted") t</information>\n\n'
    assert SR.render_documents([]) == "\n\n<information></information>\n\n"
    assert SR.invalid_action_message() == (
        "\nMy previous action is invalid. If I want to search, I should put the query between <search> and "
        "</search>. If I want to give the final answer, I should put the answer between <answer> and </answer>. "
        "Let me try again.\n")


@pytest.mark.parametrize("proto", [R1, SR], ids=["r1searcher", "searchr1"])
def test_split_turns_round_trips_and_labels_environment(proto):
    response = (f"<think>a</think>{proto.query_open} q1 {proto.query_close}" + proto.render_documents(PASSAGES)
                + "junk turn" + (proto.invalid_action_message() or "")
                + f"{proto.query_open} q2 {proto.query_close}" + proto.render_documents(PASSAGES[:1])
                + "<think>b</think><answer> Paris </answer>")
    segments = proto.split_turns(response)
    assert "".join(s.text for s in segments) == response
    env = [s for s in segments if s.kind == "environment"]
    assert len(env) == (3 if proto is SR else 2)
    assert proto.extract_queries(response) == ["q1", "q2"]
    assert len(proto.documents_blocks(response)) == 2
    # a truncated rollout that ends inside a documents block
    cut = response[: response.index("capital") + 3]
    assert segments_kinds(proto, cut)[-1] == "environment"


def segments_kinds(proto, text):
    return [s.kind for s in proto.split_turns(text)]
