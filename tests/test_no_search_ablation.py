"""``--train.no_search`` is search off at TRAINING time only: the warm start and every evaluation
see the real retriever's passages, only the RL rollouts get empty documents, also after a resume. A scripted engine
(always one search, then an answer) stands in for the tiny policy, which never searches by itself; the retriever is
the real BM25 service over the embedded default."""

from types import SimpleNamespace

import pytest

from openrlhf_search.cpu.data.qa import load_qa_jsonl
from openrlhf_search.cpu.main_job.args import parse_args

SMALL = ["--preset", "tiny", "--actor.tiny.hidden_size", "32", "--actor.tiny.num_layers", "1",
         "--actor.tiny.num_heads", "2", "--rollout.batch_size", "1", "--rollout.n_samples_per_prompt", "2",
         "--search.max_turns", "2", "--search.topk", "2", "--warmstart.sft_steps", "1", "--warmstart.num_examples", "2",
         "--warmstart.batch_size", "2", "--eval.max_samples", "2", "--eval.baselines", "false",
         "--train.max_steps", "2", "--ckpt.save_steps", "1", "--data.max_len", "512"]


class ScriptedEngine:
    """Turn 1: ``<search> QUESTION </search>``; turn 2: ``<answer> x </answer>`` (vLLM's RequestOutput shape)."""

    def __init__(self, tokenizer):
        self.tok = tokenizer

    async def generate(self, prompt_token_ids, sampling_params, multi_modal_data=None):
        # a turn after a documents block (the prompt itself names the tags: only its end tells)
        after_docs = self.tok.decode(prompt_token_ids).rstrip().endswith("</information>")
        reply = " <answer> x </answer>" if after_docs else " <search> capital of France </search>"
        ids = self.tok(reply, add_special_tokens=False)["input_ids"]
        return SimpleNamespace(outputs=[SimpleNamespace(token_ids=ids, logprobs=None, finish_reason="stop")])


def _trainer(out, url, data, extra=()):
    from openrlhf_search.cpu.main_job.train import make_warmstart
    from openrlhf_search.cpu.main_job.trainer import LocalSearchTrainer

    args = parse_args(SMALL + ["--search.retriever_urls", url, "--ckpt.output_dir", str(out)] + list(extra))
    t = LocalSearchTrainer(args, load_qa_jsonl(data.train_path, limit=40), load_qa_jsonl(data.eval_path, limit=2),
                           warmstart_fn=make_warmstart(args))
    t.timed_engine = ScriptedEngine(t.tokenizer)  # read by rollout() at call time
    seen = t.seen = []  # (greedy, passage ids of every search of every trajectory) per rollout call
    rollout = t.rollout

    def recording_rollout(rows, n, greedy=False, **kw):
        outs = rollout(rows, n, greedy=greedy, **kw)
        seen.append((greedy, [ids for o in outs for ids in (s["passage_ids"] for s in o["search_trace"])]))
        return outs

    t.rollout = recording_rollout
    return t


def _rl_searches(t):
    return [ids for greedy, calls in t.seen if not greedy for ids in calls]


def _warmstart_passages(monkeypatch):
    from openrlhf_search.cpu.main_job import warmstart

    got = []
    scripted = warmstart.scripted_trajectory

    def spy(prompt, question, answer, passages, *a, **kw):
        got.append([p.id for p in passages])
        return scripted(prompt, question, answer, passages, *a, **kw)

    monkeypatch.setattr(warmstart, "scripted_trajectory", spy)
    return got


@pytest.mark.timeout(300)
def test_no_search_is_off_only_in_the_rl_rollouts_also_after_resume(tmp_path, default_bm25_url, default_data,
                                                                    monkeypatch):
    """Mutations caught: NoSearchClient around every use (the former behaviour: warm start and evaluations without
    passages), around none (the RL rollouts would see passages), and a resume that rebuilds the RL executor with the
    real retriever."""
    warm = _warmstart_passages(monkeypatch)
    t = _trainer(tmp_path / "nosearch", default_bm25_url, default_data, ["--train.no_search"])
    try:
        t.setup()  # the warm start: its scripted search turns hold the real top passages
        assert len(warm) == 2 and all(len(ids) == 2 for ids in warm), warm
        ev = t.evaluate()  # evaluations search the real retriever
        assert ev["n"] == 2 and all(len(ids) == 2 for r in ev["records"] for ids in r["retrieved_ids"])
        assert all(len(r["retrieved_ids"]) == 1 for r in ev["records"])  # the scripted search did run
        t.train_step()
        t.step = 1
        rl = _rl_searches(t)
        assert len(rl) == 2 and all(ids == [] for ids in rl), rl  # the RL rollouts: empty documents
        t.save()
    finally:
        t.close()

    t2 = _trainer(tmp_path / "nosearch", default_bm25_url, default_data, ["--train.no_search"])
    try:
        t2.setup()
        assert t2.step == 1  # resumed, not warm-started again
        t2.timed_engine = ScriptedEngine(t2.tokenizer)  # the resume rebuilt the engine (and both executors)
        t2.train_step()
        rl = _rl_searches(t2)
        assert len(rl) == 2 and all(ids == [] for ids in rl), rl
        ev = t2.evaluate()
        assert all(len(ids) == 2 for r in ev["records"] for ids in r["retrieved_ids"])
    finally:
        t2.close()


@pytest.mark.timeout(300)
def test_without_the_flag_the_rl_rollouts_search(tmp_path, default_bm25_url, default_data):
    """The control: the same scripted rollouts get passages without ``--train.no_search`` (so the empty documents
    above come from the flag, not from the script)."""
    t = _trainer(tmp_path / "main", default_bm25_url, default_data, ["--warmstart.sft_steps", "0"])
    try:
        t.setup()
        t.train_step()
        rl = _rl_searches(t)
        assert len(rl) == 2 and all(len(ids) == 2 for ids in rl), rl
    finally:
        t.close()
