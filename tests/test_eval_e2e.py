"""End-to-end eval on CPU: the real retriever service (BM25 over real HotpotQA paragraphs), the real executor, all 125
Bamboogle questions, both protocols, through the CLI; the policy is a scripted engine (``tests/scripted_engine.py``)
injected in place of vLLM (``tests/test_eval_vllm.py`` runs the CLI on the real vLLM-CPU engine)."""

import json
import re

import pytest

from tests.conftest import shared_path
from openrlhf_search.evaluation.runner import ROW_FIELDS

CORPUS = ("wiki", "hotpotqa_dev500_paragraphs.jsonl")


@pytest.fixture(scope="module")
def retriever_url(tmp_path_factory):
    from retriever.launch import running_retriever

    workdir = tmp_path_factory.mktemp("retriever")
    with running_retriever(shared_path(*CORPUS), str(workdir), encoder="bm25", limit=300) as url:
        yield url


def _check_rows(path, n, protocol_name):
    from openrlhf_search.env.protocol import get_protocol

    rows = [json.loads(line) for line in open(path)]
    assert len(rows) == n
    bamboogle = [json.loads(line) for line in open(shared_path("qa", "r1searcher", "bamboogle.jsonl"))]
    assert [r["question"] for r in rows] == [b["question"].strip() for b in bamboogle[:n]]
    proto = get_protocol(protocol_name)
    for r in rows:
        assert set(ROW_FIELDS) <= set(r), set(ROW_FIELDS) - set(r)
        assert r["error"] is None and r["stop_reason"] != "error"
        assert isinstance(r["golds"], list) and r["golds"]
        assert isinstance(r["trajectory"], str) and r["trajectory"]
        assert r["prediction"] == proto.extract_answer(r["trajectory"]).strip()
        assert r["queries"] == proto.extract_queries(r["trajectory"])
        assert 1 <= r["turns"] <= 2 and 0 <= r["searches"] <= r["turns"]
        assert r["stop_reason"] in ("answer", "length", "max_turns", "no_action", "retrieval_failed")
        for m in ("em", "f1", "cover_em"):
            assert 0.0 <= r[m] <= 1.0
    return rows


@pytest.mark.parametrize("protocol", ["r1searcher", "searchr1"])
def test_eval_cli_scripted_policy_bamboogle(protocol, retriever_url, tiny_model_dir, scripted_engine, tmp_path,
                                            capsys):
    """Every question searches once and answers (the scripted turns write past their stop strings: a row with text
    after the closing tag, or a third turn, means a stop string was not honoured), and the summary counts them."""
    from openrlhf_search.cli.eval import main

    n = 125
    out = tmp_path / "out"
    built = scripted_engine(protocol)
    rc = main(["--model", tiny_model_dir, "--datasets", "bamboogle", "--data_dir", shared_path(), "--protocol",
               protocol, "--retriever_url", retriever_url, "--topk", "3", "--max_turns", "3", "--max_new_tokens",
               "32", "--max_length", "2048", "--out_dir", str(out), "--concurrency", "32"])
    assert rc == 0, capsys.readouterr().err[-3000:]
    assert len(built) == 1
    rows = _check_rows(out / "bamboogle.predictions.jsonl", n, protocol)
    assert all(r["turns"] == 2 and r["searches"] == 1 and r["stop_reason"] == "answer" for r in rows)
    assert all(r["queries"] == ["film"] and r["prediction"] == "film" for r in rows)
    assert not (out / "bamboogle.predictions.jsonl.partial").exists()
    summary = json.loads((out / "summary.json").read_text())
    s = summary["datasets"]["bamboogle"]
    assert s["n"] == n and s["n_errors"] == 0 and s["stop_reasons"] == {"answer": n}
    assert s["em"] == pytest.approx(sum(r["em"] for r in rows) / n)
    setup = summary["setup"]
    assert setup["model"] == tiny_model_dir and setup["backend"] == "scripted"
    assert setup["topk"] == 3 and setup["protocol"] == protocol
    assert "bm25" in setup["retriever"] and "300 passages" in setup["retriever"]
    assert setup["corpus"] == CORPUS[1]
    md = (out / "summary.md").read_text()
    assert f"| bamboogle | ours | {tiny_model_dir} | hotpotqa_dev500_paragraphs.jsonl |" in md
    assert ("0.504" in md) if protocol == "r1searcher" else ("0.432" in md)


class ScriptedEngine:
    """A policy stand-in that searches for the question on turn 1 and answers with the top passage title on turn 2,
    so that retrieval, document rendering and answer extraction run for real (the tiny random policy never emits a
    well-formed search call)."""

    def __init__(self, tokenizer, protocol):
        self.tok, self.proto = tokenizer, protocol

    async def generate(self, prompt_token_ids, sampling_params, multi_modal_data=None):
        from vllm.outputs import CompletionOutput, RequestOutput

        text_so_far = self.tok.decode(prompt_token_ids)
        question = text_so_far.split("Question:")[-1].split("User:")[-1].split("\n")[0].strip()
        if not text_so_far.rstrip().endswith(self.proto.doc_close_tag):  # first turn (the prompt names the tags)
            text = f" I need to search. {self.proto.query_open} {question} {self.proto.query_close}"
        else:
            docs = text_so_far.rsplit(self.proto.doc_open_tag, 1)[1]
            # first passage title: R1-Searcher "(1)Title   text", Search-R1 'Doc 1(Title: "Title") text'
            m = re.search(r'Doc 1\(Title: "?(.+?)"?\) ', docs) or re.search(r"\(1\)(.+?)   ", docs)
            title = m.group(1).strip() if m else "none"
            text = f" Found it. {self.proto.think_close} {self.proto.answer_open} {title} {self.proto.answer_close}"
        ids = self.tok(text, add_special_tokens=False)["input_ids"][: sampling_params.max_tokens]
        out = CompletionOutput(index=0, text=self.tok.decode(ids), token_ids=ids, cumulative_logprob=None,
                               logprobs=None, finish_reason="stop", stop_reason=None)
        return RequestOutput(request_id="s", prompt=None, prompt_token_ids=list(prompt_token_ids),
                             prompt_logprobs=None, outputs=[out], finished=True)


@pytest.mark.parametrize("protocol", ["r1searcher", "searchr1"])
def test_runner_with_real_retrieval(protocol, retriever_url, qwen_tokenizer):
    from openrlhf_search.evaluation.loaders import load_eval_dataset
    from openrlhf_search.env.config import SearchConfig
    from openrlhf_search.evaluation.runner import EvalSettings, protocol_reward_scheme, run_eval_sync
    from openrlhf_search.env.protocol import get_protocol

    examples = load_eval_dataset("bamboogle", data_dir=shared_path())[:20]
    search = SearchConfig(protocol=protocol, retriever_urls=retriever_url, topk=3, max_turns=3,
                          max_new_tokens_per_turn=64, reward_scheme=protocol_reward_scheme(protocol))
    settings = EvalSettings(search=search, model="scripted", max_length=4096, concurrency=8)
    streamed = []
    rows = run_eval_sync(examples, settings, engine=ScriptedEngine(qwen_tokenizer, get_protocol(protocol)),
                         tokenizer=qwen_tokenizer, on_row=streamed.append)
    assert len(rows) == len(streamed) == 20
    for ex, r in zip(examples, rows):
        assert r["id"] == ex.id and r["error"] is None
        assert r["queries"] == [ex.question] and r["searches"] == 1 and r["turns"] == 2
        assert r["stop_reason"] == "answer" and r["prediction"] and r["prediction"] != "none"
        assert get_protocol(protocol).doc_open_tag in r["trajectory"]
        # the predicted title is one of the retrieved passages shown in the trajectory
        assert r["prediction"] in r["trajectory"].split(get_protocol(protocol).doc_open_tag)[1]


def test_runner_marks_retriever_down(qwen_tokenizer):
    """Retriever unreachable: rows are kept with stop_reason retrieval_failed, the run does not crash."""
    import socket

    from openrlhf_search.evaluation.loaders import load_eval_dataset
    from openrlhf_search.env.config import SearchConfig
    from openrlhf_search.evaluation.runner import EvalSettings, run_eval_sync
    from openrlhf_search.env.protocol import get_protocol

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    examples = load_eval_dataset("bamboogle", data_dir=shared_path())[:3]
    search = SearchConfig(protocol="r1searcher", retriever_urls=f"http://127.0.0.1:{port}", max_turns=3,
                          max_new_tokens_per_turn=64, retrieval_max_retries=1, retrieval_backoff_s=0.01,
                          retrieval_timeout_s=2.0)
    settings = EvalSettings(search=search, model="scripted")
    rows = run_eval_sync(examples, settings, engine=ScriptedEngine(qwen_tokenizer, get_protocol("r1searcher")),
                         tokenizer=qwen_tokenizer)
    assert [r["stop_reason"] for r in rows] == ["retrieval_failed"] * 3
    assert all(r["retrieval_failed"] and r["prediction"] == "" for r in rows)


def test_eval_cli_refuses_a_dead_retriever(tmp_path, tiny_model_dir, scripted_engine, capsys):
    """A dead retriever stops cli.eval before any question, in one line with exit 2 (it used to score every question
    0 under a normal-looking table, exit 0). Mutation caught: the check removed or its failure only logged."""
    import socket

    from openrlhf_search.cli.eval import main

    scripted_engine("r1searcher")
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    rc = main(["--model", tiny_model_dir, "--datasets", "bamboogle", "--data_dir", shared_path(), "--protocol",
               "r1searcher", "--retriever_url", f"http://127.0.0.1:{port}", "--limit", "2", "--out_dir",
               str(tmp_path / "out")])
    err = capsys.readouterr().err.strip().splitlines()
    assert rc == 2 and err[-1].startswith("error: bamboogle: retriever http://127.0.0.1:")
    assert "did not answer" in err[-1] and not (tmp_path / "out" / "summary.json").exists()
