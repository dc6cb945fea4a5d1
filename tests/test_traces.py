"""The protocols, metrics and rewards on real rollouts of the two papers' trained models (../shared/data/traces)."""

import json
import re

import pytest

from openrlhf_search.env.metrics import cover_em, cover_em_squad, mean
from openrlhf_search.env.protocol import get_protocol
from openrlhf_search.env.rewards import check_format, compute_reward
from openrlhf_search.env.types import Passage
from tests.conftest import shared_path

R1 = get_protocol("r1searcher")
SR = get_protocol("searchr1")


@pytest.fixture(scope="module")
def searchr1_rollouts():
    """The two Search-R1 rollouts of searchr1_case.txt as (prompt, response) pairs."""
    with open(shared_path("traces", "searchr1_case.txt"), encoding="utf-8") as f:
        text = f.read()
    starts = [m.start() for m in re.finditer(r"<\|im_start\|>system", text)]
    assert len(starts) == 2
    out = []
    for i, start in enumerate(starts):
        chunk = text[start: starts[i + 1] if i + 1 < len(starts) else len(text)]
        prompt, response = chunk.split("<|im_start|>assistant\n", 1)
        out.append((prompt + "<|im_start|>assistant\n", response))
    return out


@pytest.fixture(scope="module")
def bamboogle_rows():
    with open(shared_path("traces", "r1searcher_bamboogle_llama.jsonl"), encoding="utf-8") as f:
        rows = [json.loads(line) for line in f]
    assert len(rows) == 125
    return rows


# ------------------------------------------------------------------------------------------------ Search-R1
def test_searchr1_case_queries_and_answers(searchr1_rollouts):
    (p1, r1), (p2, r2) = searchr1_rollouts
    assert SR.extract_queries(r1) == ["Paul Walker's cars in Fast and Furious",
                                      "list of cars paul walker drove in Fast and Furious"]
    assert SR.extract_answer(r1) == "Charger"
    assert SR.extract_queries(r2) == ["origin of heart's electrical impulses"]
    assert SR.extract_answer(r2) == "sinoatrial (SA) node"
    # the prompt holds the example answer "Beijing"; the response alone never yields it
    assert "<answer> Beijing </answer>" in p1 and SR.extract_answer(p1 + r1) == "Charger"
    assert SR.build_prompt("paul walkers cars in fast and furious list?") in p1


def test_searchr1_case_turn_by_turn_actions(searchr1_rollouts):
    _, response = searchr1_rollouts[0]
    turns = [s.text for s in SR.split_turns(response) if s.kind == "model"]
    actions = [SR.parse_action(t) for t in turns]
    assert [(a.kind, a.content) for a in actions] == [
        ("query", "Paul Walker's cars in Fast and Furious"),
        ("query", "list of cars paul walker drove in Fast and Furious"),
        ("answer", "Charger"),
    ]


def test_searchr1_information_blocks_re_render_exactly(searchr1_rollouts):
    for _, response in searchr1_rollouts:
        blocks = SR.documents_blocks(response)
        assert blocks
        for block in blocks:
            body = block[len(SR.doc_open):-len(SR.doc_close)]
            passages = []
            for line in body.split("\n"):
                m = re.match(r'Doc \d+\(Title: "(.*?)"\) (.*)', line)
                passages.append(Passage(str(len(passages)), m.group(1), m.group(2)))
            assert len(passages) == 3  # top-k 3
            assert SR.render_documents(passages) == block


def test_searchr1_case_rewards(searchr1_rollouts):
    (_, r1), (_, r2) = searchr1_rollouts
    assert compute_reward("searchr1_em", r1, ["Charger"], "searchr1").reward == 1.0
    assert compute_reward("searchr1_em", r2, ["sinoatrial node"], "searchr1").reward == 0.0
    # rollout 1 writes reasoning outside <think> after the documents: invalid sequence for 2505.15117
    fmt = compute_reward("searchr1_format", r1, ["Charger"], "searchr1")
    assert fmt.components["valid_sequence"] == 0.0
    assert fmt.reward == pytest.approx(0.8)
    # rollout 2 has two </think> for one <think>
    assert check_format(r2, "searchr1") == (False, "unbalanced think tags")


# ---------------------------------------------------------------------------------------------- R1-Searcher
def test_r1searcher_trace_answers_match_pred_ans(bamboogle_rows):
    for row in bamboogle_rows:
        assert R1.extract_answer(row["gen_text_store"]) == row["pred_ans"]


def test_r1searcher_trace_queries_and_documents(bamboogle_rows):
    n_queries = 0
    for row in bamboogle_rows:
        text = row["gen_text_store"]
        queries = R1.extract_queries(text)
        blocks = R1.documents_blocks(text)
        assert queries and len(queries) == len(blocks)
        assert "".join(s.text for s in R1.split_turns(text)) == text
        first_turn = R1.split_turns(text)[0].text
        assert R1.parse_action(first_turn).content == queries[0]
        n_queries += len(queries)
    assert n_queries == 339
    assert R1.extract_queries(bamboogle_rows[0]["gen_text_store"]) == ["last king Britain House Hanover died"]


def test_r1searcher_documents_re_render_exactly(bamboogle_rows):
    checked = 0
    for row in bamboogle_rows:
        for block in R1.documents_blocks(row["gen_text_store"]):
            body = block[len(R1.doc_open):-len(R1.doc_close)]
            passages = []
            for line in body.split("\n")[:-1]:
                m = re.match(r"\((\d+)\)(.*?)   (.*)", line)
                passages.append(Passage(m.group(1), m.group(2), m.group(3)))
            assert len(passages) == 5  # top-k 5 in their evaluation
            assert R1.render_documents(passages) == block
            checked += 1
    assert checked == 339


def test_r1searcher_trace_rescored_gives_the_paper_numbers(bamboogle_rows):
    preds = [R1.extract_answer(r["gen_text_store"]) for r in bamboogle_rows]
    golds = [r["answer"] for r in bamboogle_rows]
    # R1-Searcher table 2, Llama-3.1-8B-Instruct, Bamboogle: ACC_R 0.504, ACC_L 0.544
    assert round(mean(cover_em(p, g) for p, g in zip(preds, golds)), 3) == 0.504
    assert round(mean(cover_em_squad(p, g) for p, g in zip(preds, golds)), 3) == 0.496
    assert round(mean(r["gpt4o_output"] == "True" for r in bamboogle_rows), 3) == 0.544


def test_r1searcher_trace_format_and_rewards(bamboogle_rows):
    oks = [check_format(r["gen_text_store"], R1)[0] for r in bamboogle_rows]
    assert all(oks)  # the trained model follows the format on every Bamboogle question
    stage1 = [compute_reward("r1searcher_stage1", r["gen_text_store"], r["answer"], R1) for r in bamboogle_rows]
    assert all(res.reward == 1.0 for res in stage1)
    released = [compute_reward("r1searcher_released_stage2", r["gen_text_store"], r["answer"], R1)
                for r in bamboogle_rows]
    punished = [res for res in released if res.components["released_format_ok"] == 0.0]
    # their role check also counts "assistant" inside retrieved documents
    assert punished and all("assistant" in res.format_reason for res in punished)


def test_r1searcher_released_later_turn_prompts_equal_the_published_trace(bamboogle_rows, llama3_tokenizer):
    """Under the released eval setting, the prompt our executor gives the engine at every later
    turn (the released eval prompt, the model's earlier turns, every documents block, uncut) is the text
    R1-Searcher's released loop built for that turn (``base_prompt_v0`` + ``gen_text_store`` up to that block,
    ``evaluation/eval_search_loacl.py:62,235,284``) with the token ids vLLM gave it (Llama-3's BOS in front,
    add_special_tokens=True), and each query reaches the retriever cleaned as released (line 228).

    The model's turns are replayed from the trace and the retriever returns each block's own passages, so what is
    compared is everything our side adds: prompt, BOS, document rendering, the absence of a cap, turn assembly."""
    import asyncio
    import os
    from types import SimpleNamespace

    from vllm import SamplingParams

    from openrlhf_search.env.agent import SearchAgentExecutor
    from openrlhf_search.evaluation.runner import EvalSettings
    from openrlhf_search.evaluation.settings import eval_setting, for_dataset

    tok = llama3_tokenizer
    fixture = os.path.join(os.path.dirname(os.path.abspath(__file__)), "fixtures",
                           "r1searcher_eval_prompt_v0.bamboogle_idx1.txt")
    with open(fixture, encoding="utf-8") as f:
        instructions = f.read().split("\n\nUser:", 1)[0]  # base_prompt_v0 up to its {question}
    paper = eval_setting("r1searcher", "released")
    search = paper.search_config(passage_format=for_dataset(paper.passage_formats, "bamboogle"),
                                 retriever_urls=["http://127.0.0.1:9"])
    settings = EvalSettings(search=search, template=paper.template, max_length=paper.max_length,
                            engine_special_tokens=paper.engine_special_tokens)
    assert settings.search.max_obs_tokens is None and settings.search.passage_format == "kilt"
    released_clean = lambda q: q.replace('"', "").replace("'", "").replace("\t", " ").replace("...", "")

    checked_turns = 0
    for row in bamboogle_rows:
        text = row["gen_text_store"]
        segments = R1.split_turns(text)
        model_turns = [s.text for s in segments if s.kind == "model"]
        blocks = [s.text for s in segments if s.kind == "environment"]
        block_passages = []
        for block in blocks:
            lines = block[len(R1.doc_open):-len(R1.doc_close)].split("\n")[:-1]
            block_passages.append([Passage(m.group(1), m.group(2), m.group(3))
                                   for m in (re.match(r"\((\d+)\)(.*?)   (.*)", line) for line in lines)])
        calls, sent = [], []

        class Engine:
            async def generate(self, prompt_token_ids, sampling_params, multi_modal_data=None):
                calls.append(list(prompt_token_ids))
                ids = tok(model_turns[len(calls) - 1], add_special_tokens=False).input_ids
                return SimpleNamespace(outputs=[SimpleNamespace(token_ids=ids, finish_reason="stop", logprobs=None)])

        class Client:
            async def search(self, query):
                sent.append(query)
                return block_passages[len(sent) - 1]

        executor = SearchAgentExecutor(settings.search, retrieval_client=Client())
        prompt = settings.render_prompt(row["question"], tok)
        asyncio.run(executor.execute(prompt, json.dumps([row["answer"]]), SamplingParams(max_tokens=512),
                                     10 ** 6, tok, Engine()))
        released_prompt = f"{instructions}\n\nUser:{row['question']}\nAssistant: <think>"
        assert len(calls) == len(model_turns) == len(blocks) + 1
        for k, ids in enumerate(calls):
            released = released_prompt + "".join(s.text for s in segments[:2 * k])  # k model turns + k blocks
            assert tok.decode(ids) == "<|begin_of_text|>" + released
            assert ids == tok(released, add_special_tokens=True).input_ids  # vLLM's ids of that text
            checked_turns += k > 0
        raw = [t.split(R1.query_open)[-1].split(R1.query_close)[0] for t in model_turns[:-1]]
        assert [q.strip() for q in sent] == [released_clean(q).strip() for q in raw]
    assert checked_turns == 339  # every later turn of the 125 trajectories (one per retrieval)
