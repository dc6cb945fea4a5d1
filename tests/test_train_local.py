"""The CPU main job: flags, a few real steps against the real retriever service, checkpoints, resume, exclusion of
samples whose retrieval failed, real data from ../shared, and kill-and-resume of the CLI process (slow)."""

import json
import os
import re
import signal
import subprocess
import sys
import time

import pytest
import torch

from openrlhf_search.cpu.data.qa import load_qa_jsonl
from openrlhf_search.cpu.main_job.args import parse_args
from tests.conftest import REPO_ROOT, shared_path

FAST = ["--actor.model_name_or_path", "tiny", "--search.max_new_tokens_per_turn", "12", "--search.max_turns", "2",
        "--search.topk", "2",
        "--search.max_obs_tokens", "120", "--data.max_len", "400", "--rollout.batch_size", "1",
        "--rollout.n_samples_per_prompt", "2", "--eval.max_samples", "2", "--actor.tiny.hidden_size", "32",
        "--actor.tiny.num_layers", "1", "--actor.tiny.num_heads", "2"]


@pytest.fixture(scope="module")
def retriever_url(default_bm25_url):  # conftest: one BM25 service over the embedded default per session
    return default_bm25_url


def test_flags_mirror_openrlhf_and_search_config():
    args = parse_args(["--algo.advantage.estimator", "group_norm", "--rollout.n_samples_per_prompt", "3",
                       "--actor.adam.lr", "2e-5", "--search.topk", "5", "--search.retriever_urls",
                       "http://a:1,http://b:2", "--train_data", "x.jsonl"])
    assert args.algo.advantage.estimator == "group_norm" and args.algo.kl.use_loss  # GRPO: KL in the loss
    assert args.rollout.n_samples_per_prompt == 3 and args.actor.adam.lr == 2e-5
    assert args.search_config.topk == 5 and args.search_config.retriever_urls == ["http://a:1", "http://b:2"]
    assert args.data.prompt_dataset == "x.jsonl"
    with pytest.raises(SystemExit):
        parse_args(["--search.topk", "0"])  # SearchConfig validation reaches the CLI
    with pytest.raises(SystemExit):
        parse_args(["--algo.advantage.estimator", "group_norm", "--rollout.n_samples_per_prompt", "1"])


def _trainer(tmp_path, url, default_data, extra):
    from openrlhf_search.cpu.main_job.trainer import LocalSearchTrainer

    args = parse_args(FAST + ["--search.retriever_urls", url, "--ckpt.output_dir", str(tmp_path / "run"),
                              "--ckpt.save_steps", "1"] + extra)
    train = load_qa_jsonl(default_data.train_path)
    evalq = load_qa_jsonl(default_data.eval_path, limit=2)
    return LocalSearchTrainer(args, train, evalq)


def _rows(path):
    return [json.loads(line) for line in open(path) if line.strip()]


@pytest.mark.parametrize("estimator", ["reinforce_baseline", "group_norm", "gae"])
def test_steps_checkpoint_and_resume_in_process(tmp_path, retriever_url, default_data, estimator):
    t1 = _trainer(tmp_path, retriever_url, default_data, ["--train.max_steps", "2", "--algo.advantage.estimator",
                                                          estimator])
    try:
        out = t1.fit()
    finally:
        t1.close()
    assert out["steps"] == 2 and out["resumed_from"] is None
    run = tmp_path / "run"
    rows = _rows(run / "metrics.jsonl")
    assert [r["step"] for r in rows] == [1, 2]
    for r in rows:
        for k in ("reward", "response_length", "turns", "valid_searches", "answer_rate", "em", "f1", "kl",
                  "policy_loss", "time_generation_s", "time_retrieval_s", "time_reward_s", "time_update_s"):
            assert k in r, k
        assert r["samples"] == 2 and r["excluded"] == 0
        # engine counters of the step: every prompt token was either run or read from the prefix cache, and the 2
        # samples of the group shared one prefill of their prompt
        assert r["generated_tokens"] >= 2 and r["engine_prefill_tokens"] > 0
        assert r["engine_prefill_tokens"] + r["engine_prefix_cache_hit_tokens"] < r["engine_prompt_tokens"]
    assert [r["data_pos"] for r in rows] == [0, 1]
    ck = run / "checkpoints" / "global_step2"
    assert (run / "checkpoints" / "latest").read_text() == "global_step2"
    for f in ("actor/config.json", "actor/model.safetensors", "actor/tokenizer_config.json", "optimizer.pt",
              "rng.pt", "trainer_state.json"):
        assert (ck / f).exists(), f
    assert (ck / "critic.pt").exists() == (estimator == "gae")
    state = json.loads((ck / "trainer_state.json").read_text())
    assert state["step"] == 2 and state["data"] == {"epoch": 0, "pos": 2}
    from transformers import AutoModelForCausalLM

    reloaded = AutoModelForCausalLM.from_pretrained(str(ck / "actor"))
    for (n, p), (_, q) in zip(t1.actor.named_parameters(), reloaded.named_parameters()):
        assert torch.equal(p, q), n
    ev = json.loads((run / "eval.json").read_text())
    assert ev["n"] == 2 and len(ev["records"]) == 2 and ev["split"] == "heldout"
    for rec in ev["records"]:  # a record per question
        for k in ("question", "type", "hops", "gold", "prediction", "answer_words", "queries", "retrieved_ids",
                  "support_retrieved", "gold_in_retrieved", "form", "stop_reason"):
            assert k in rec, k
    analysis = json.loads((run / "eval_analysis.json").read_text())
    assert {"by_group", "baselines", "decomposition"} <= set(analysis)

    t2 = _trainer(tmp_path, retriever_url, default_data, ["--train.max_steps", "3", "--algo.advantage.estimator",
                                                          estimator, "--eval.disable"])
    try:
        out2 = t2.fit()
        assert out2["resumed_from"] == 2 and out2["steps"] == 3
        opt_state = t2.updater.actor_opt.state_dict()["state"]
        assert opt_state and all(int(s["step"]) == 3 for s in opt_state.values())  # AdamW moments carried over
    finally:
        t2.close()
    rows = _rows(run / "metrics.jsonl")
    assert [r["step"] for r in rows] == [1, 2, 3] and rows[-1]["data_pos"] == 2


def test_resume_under_other_training_settings_is_refused(tmp_path, retriever_url, default_data, caplog):
    """A checkpoint trained under one reward (or prompt, warm start, lr, ...) is not continued under another: the
    resume stops with one error naming the flag, saved vs now, and writes nothing (a runs/default of the former
    default resumed under the new --preset default mixed two runs in one table). Training longer, another device,
    split or retriever URL stay resumable; a checkpoint from before the check resumes with a warning."""
    from openrlhf_search.cpu.main_job.trainer import TrainingError

    base = ["--train.max_steps", "1", "--eval.disable", "--search.reward_scheme", "r1searcher_stage2"]
    t1 = _trainer(tmp_path, retriever_url, default_data, base)
    try:
        t1.fit()
    finally:
        t1.close()
    run = tmp_path / "run"
    state_path = run / "checkpoints" / "global_step1" / "trainer_state.json"
    assert json.loads(state_path.read_text())["training_config"]["search.reward_scheme"] == "r1searcher_stage2"
    rows_before = (run / "metrics.jsonl").read_text()
    t2 = _trainer(tmp_path, retriever_url, default_data, ["--train.max_steps", "2", "--eval.disable",
                                                          "--search.reward_scheme", "searchr1_em"])
    try:
        with pytest.raises(TrainingError, match=r"search\.reward_scheme: 'r1searcher_stage2' -> 'searchr1_em'"):
            t2.fit()
    finally:
        t2.close()
    assert (run / "metrics.jsonl").read_text() == rows_before  # nothing of the refused run was written
    # a flag added after the checkpoint was written (absent from its settings) counts as its default there: a
    # resume at the default continues, another value is refused
    state = json.loads(state_path.read_text())
    del state["training_config"]["warmstart.hop_searches"]
    state_path.write_text(json.dumps(state))
    t2b = _trainer(tmp_path, retriever_url, default_data, base[2:] + ["--train.max_steps", "2",
                                                                       "--warmstart.hop_searches", "chain"])
    try:
        with pytest.raises(TrainingError, match=r"warmstart\.hop_searches: 'one' -> 'chain'"):
            t2b.fit()
    finally:
        t2b.close()
    t2c = _trainer(tmp_path, retriever_url, default_data, base[2:] + ["--train.max_steps", "2"])
    try:
        assert t2c.fit()["resumed_from"] == 1
    finally:
        t2c.close()
    # an older checkpoint (no recorded settings): resumed, with a warning, and allowed flags may change
    state_path = run / "checkpoints" / "global_step2" / "trainer_state.json"
    state = json.loads(state_path.read_text())
    del state["training_config"]
    state_path.write_text(json.dumps(state))
    t3 = _trainer(tmp_path, retriever_url, default_data, ["--train.max_steps", "3", "--eval.disable",
                                                          "--search.reward_scheme", "r1searcher_stage2",
                                                          "--eval.split", "validation"])
    try:
        with caplog.at_level("WARNING"):
            out = t3.fit()
    finally:
        t3.close()
    assert out["resumed_from"] == 2 and out["steps"] == 3
    assert "records no training settings" in caplog.text


def test_parser_refuses_abbreviations_and_unknown_protocols():
    """argparse's prefix matching let "--pres tiny" set args.preset without the preset's flags; an unknown protocol
    parsed and failed later, after the data and index were built."""
    with pytest.raises(SystemExit):
        parse_args(["--pres", "tiny"])
    with pytest.raises(SystemExit):
        parse_args(["--search.protocol", "nope"])
    assert parse_args(["--search.protocol", "searchr1_bare"]).search_config.protocol == "searchr1_bare"


class _StubExecutor:
    """Returns executor dicts; the samples of the first prompt come back with ``retrieval_failed``."""

    def __init__(self, n):
        self.calls, self.n = 0, n

    async def execute(self, prompt, label, sampling_params, max_length, hf_tokenizer, llm_engine, images=None):
        i = self.calls
        self.calls += 1
        failed = i < self.n
        toks = hf_tokenizer(prompt, add_special_tokens=False)["input_ids"][:20] + [100, 200, 300]
        return {"observation_tokens": toks, "action_ranges": [(len(toks) - 3, len(toks))],
                "reward": 0.0 if failed else float(i % 2), "response_text": "x",
                "extra_logs": {"retrieval_failed": float(failed), "turns": 1.0, "valid_searches": float(not failed),
                               "answer_present": 0.0}}


def test_retrieval_failed_samples_left_out(tmp_path, retriever_url, default_data):
    t = _trainer(tmp_path, retriever_url, default_data, ["--train.max_steps", "1", "--rollout.batch_size", "2",
                                                         "--rollout.n_samples_per_prompt", "2"])
    try:
        t.setup()
        t.executor = _StubExecutor(n=2)
        row = t.train_step()
    finally:
        t.close()
    assert row["samples"] == 4 and row["excluded_retrieval_failed"] == 2 and row["excluded"] == 2
    assert row["valid_searches"] == 1.0  # the metrics average the kept samples only
    assert row["reward"] == 0.5 and row["response_length"] == 3.0


class _SupportExecutor:
    """Even calls retrieve every supporting passage of the training data, odd calls search nothing; outcome reward 0."""

    def __init__(self, supporting_ids, answered=(1.0, 1.0)):
        self.calls, self.ids, self.answered = 0, sorted(supporting_ids), answered

    async def execute(self, prompt, label, sampling_params, max_length, hf_tokenizer, llm_engine, images=None):
        found = self.calls % 2 == 0
        self.calls += 1
        toks = hf_tokenizer(prompt, add_special_tokens=False)["input_ids"][:20] + [100, 200, 300]
        return {"observation_tokens": toks, "action_ranges": [(len(toks) - 3, len(toks))], "reward": 0.0,
                "response_text": "x", "search_trace": [{"query": "q", "passage_ids": self.ids}] if found else [],
                "extra_logs": {"retrieval_failed": 0.0, "turns": 1.0, "valid_searches": float(found),
                               "answer_present": self.answered[(self.calls - 1) % 4 // 2]}}


def test_support_bonus_adds_the_fraction_of_supporting_passages_retrieved(tmp_path, retriever_url, default_data):
    from openrlhf_search.cpu.main_job.trainer import TrainingError

    t = _trainer(tmp_path, retriever_url, default_data, ["--train.max_steps", "1", "--rollout.batch_size", "2",
                                                         "--rollout.n_samples_per_prompt", "2",
                                                         "--reward.support_bonus", "0.5"])
    try:
        t.setup()
        t.executor = _SupportExecutor({i for r in t.train_rows for i in r["supporting_ids"]})
        row = t.train_step()
    finally:
        t.close()
    # half the rollouts retrieved all their supporting passages: reward 0 + 0.5 * 1 for them, 0 for the others
    assert row["support_recall"] == 0.5 and row["reward"] == 0.25
    assert row["reward_std"] > 0  # the bonus reaches the group baseline (GRPO gets a non-zero advantage)
    # the first prompt's rollouts answer, the second's do not: only the answering one that retrieved is paid, unless
    # --reward.support_bonus_if_answered false
    for if_answered, reward in (("true", 0.125), ("false", 0.25)):
        t = _trainer(tmp_path, retriever_url, default_data, ["--train.max_steps", "1", "--rollout.batch_size", "2",
                                                             "--rollout.n_samples_per_prompt", "2", "--ckpt.no_load",
                                                             "--reward.support_bonus", "0.5",
                                                             "--reward.support_bonus_if_answered", if_answered])
        try:
            t.setup()
            t.executor = _SupportExecutor({i for r in t.train_rows for i in r["supporting_ids"]}, answered=(1.0, 0.0))
            row = t.train_step()
        finally:
            t.close()
        assert row["support_recall"] == 0.5 and row["reward"] == reward, (if_answered, row["reward"])
    with pytest.raises(TrainingError, match="supporting_ids"):
        from openrlhf_search.cpu.main_job.trainer import LocalSearchTrainer

        args = parse_args(FAST + ["--search.retriever_urls", retriever_url, "--ckpt.output_dir", str(tmp_path / "b"),
                                  "--reward.support_bonus", "0.5"])
        LocalSearchTrainer(args, [{"question": "q?", "golden_answers": ["a"]}])
    for bad in ("-1", "nan"):
        with pytest.raises(SystemExit):
            parse_args(FAST + ["--reward.support_bonus", bad])


def test_real_data_r1searcher_stage1_over_hotpotqa_paragraphs(tmp_path):
    """R1-Searcher's stage-1 questions, HotpotQA paragraphs indexed by the CLI itself (BM25), one step."""
    from openrlhf_search.cpu.main_job.train import main

    train = shared_path("qa", "r1searcher", "stage_1.jsonl")
    corpus = shared_path("wiki", "hotpotqa_dev500_paragraphs.jsonl")
    evalq = shared_path("qa", "r1searcher", "hotpotqa_500.jsonl")
    out = tmp_path / "real"
    rc = main(FAST + ["--train_data", train, "--eval_data", evalq, "--corpus", corpus, "--retriever.encoder", "bm25",
                      "--data.max_samples", "8", "--train.max_steps", "1", "--ckpt.output_dir", str(out),
                      "--data.max_len", "600"])
    assert rc == 0
    rows = _rows(out / "metrics.jsonl")
    assert len(rows) == 1 and rows[0]["samples"] == 2 and rows[0]["excluded"] == 0
    ev = json.loads((out / "eval.json").read_text())
    assert ev["n"] == 2 and 0.0 <= ev["f1"] <= 1.0


def test_cli_eval_split_validation_for_trials_and_heldout_for_the_report(tmp_path, retriever_url, default_data,
                                                                        capsys):
    """``--eval.split validation``: before/after on validation questions only (never held-out ones, never trained
    on). ``heldout``: the held-out questions, plus a before-RL pass over validation that chooses the suffix length of
    the "last k words" baseline; the printed table carries the per-group rows, the baselines and the decomposition.
    Mutations caught: the split flag ignored, k chosen on the reported questions."""
    from openrlhf_search.cpu.main_job.train import main

    common = FAST + ["--train_data", default_data.train_path, "--eval_data", default_data.eval_path,
                     "--search.retriever_urls", retriever_url, "--train.max_steps", "1", "--data.validation_size", "3",
                     "--eval.max_samples", "3", "--data.max_hops", "1"]
    held = {json.loads(line)["question"] for line in open(default_data.eval_path)}
    for split in ("validation", "heldout"):
        out = tmp_path / split
        assert main(common + ["--ckpt.output_dir", str(out), "--eval.split", split]) == 0
        printed = capsys.readouterr().out
        ev = json.loads((out / "eval.json").read_text())
        before = json.loads((out / "eval_before.json").read_text())
        assert ev["split"] == before["split"] == split and before["questions"] == ev["questions"]
        assert (set(ev["questions"]) <= held) == (split == "heldout")
        assert not set(ev["questions"]) & held if split == "validation" else True
        analysis = json.loads((out / "eval_analysis.json").read_text())
        val_path = out / "eval_before_validation.json"
        assert val_path.exists() == (split == "heldout")
        if split == "heldout":
            val = json.loads(val_path.read_text())
            assert not set(val["questions"]) & held and analysis["suffix_k"]["n"] == len(val["records"])
        assert analysis["suffix_k"]["chosen_on"] == "validation"
        for s in (f"{'held-out' if split == 'heldout' else 'validation'}, greedy: before RL vs after RL",
                  "per question group", "trivial baselines", "where the differences come from"):
            assert s in printed, s


def test_cli_bad_data_corpus_and_dead_retriever_are_one_line_errors(tmp_path, capsys, caplog):
    """Missing / malformed train files, a bad --corpus and a dead retriever: an exit code and one line, no traceback."""
    from openrlhf_search.cpu.main_job.train import main

    (tmp_path / "trunc.jsonl").write_text('{"question": "q1?", "golden_answers": ["a"]}\n{"question": "q2?"\n')
    (tmp_path / "noans.jsonl").write_text('{"question": "q1?"}\n')
    (tmp_path / "ok.jsonl").write_text('{"question": "q1?", "golden_answers": ["a"]}\n')
    (tmp_path / "empty.jsonl").write_text("")
    dead = ["--search.retriever_urls", "http://127.0.0.1:9"]  # discard port: nothing listens
    out = ["--ckpt.output_dir", str(tmp_path / "run"), "--train.max_steps", "1"]
    cases = [(["--train_data", str(tmp_path / "missing.jsonl")] + dead, 2, "missing.jsonl"),
             (["--train_data", str(tmp_path / "trunc.jsonl")] + dead, 2, "trunc.jsonl:2"),
             (["--train_data", str(tmp_path / "noans.jsonl")] + dead, 2, "no gold answer"),
             (["--train_data", str(tmp_path / "ok.jsonl"), "--corpus", str(tmp_path / "missing.jsonl")], 2,
              "missing.jsonl"),
             (["--train_data", str(tmp_path / "ok.jsonl"), "--corpus", str(tmp_path / "empty.jsonl")], 2,
              "no passages"),
             (["--train_data", str(tmp_path / "ok.jsonl"), "--warmstart.sft_steps", "1",
               "--search.retrieval_max_retries", "0"] + dead, 1, "retriever unavailable")]
    for extra, rc, says in cases:
        caplog.clear()
        assert main(FAST + out + extra) == rc, extra
        err = capsys.readouterr().err + caplog.text  # "training stopped: ..." is logged
        assert says in err and "Traceback" not in err, (extra, err[-2000:])


@pytest.mark.slow
def test_kill_and_resume_cli_subprocess(tmp_path, retriever_url, default_data):
    """Start the CLI, SIGKILL it after checkpoint 2, start it again: step count and data position continue."""
    out = tmp_path / "killed"
    cmd = [sys.executable, "-m", "openrlhf_search.cpu.main_job.train"] + FAST + [
        "--train_data", default_data.train_path, "--eval_data", default_data.eval_path,
        "--search.retriever_urls", retriever_url, "--ckpt.output_dir", str(out), "--ckpt.save_steps", "1",
        "--train.max_steps", "5", "--rollout.batch_size", "2", "--eval.disable"]
    env = dict(os.environ, PYTHONPATH=REPO_ROOT, OMP_NUM_THREADS="1")
    latest = out / "checkpoints" / "latest"
    proc = subprocess.Popen(cmd, cwd=REPO_ROOT, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        deadline = time.time() + 400
        while time.time() < deadline and proc.poll() is None:
            if latest.exists() and latest.read_text() in ("global_step2", "global_step3"):
                break
            time.sleep(0.2)
        assert proc.poll() is None, "the job ended before it could be killed"
        proc.send_signal(signal.SIGKILL)
        proc.wait()
    finally:
        if proc.poll() is None:
            proc.kill()
    killed_at = int(latest.read_text()[len("global_step"):])
    assert killed_at in (2, 3)
    res = subprocess.run(cmd, cwd=REPO_ROOT, env=env, capture_output=True, text=True, timeout=500)
    assert res.returncode == 0, res.stderr[-3000:]
    summary = json.loads(res.stdout.strip().splitlines()[-1])
    assert summary == {"steps": 5, "resumed_from": killed_at, "output_dir": str(out)}
    rows = _rows(out / "metrics.jsonl")
    assert [r["step"] for r in rows] == [1, 2, 3, 4, 5]
    assert [r["data_pos"] for r in rows] == [0, 2, 4, 6, 8]
    state = json.loads((out / "checkpoints" / "global_step5" / "trainer_state.json").read_text())
    assert state["step"] == 5 and state["data"]["pos"] == 10


@pytest.mark.slow
@pytest.mark.timeout(3000)  # pytest.ini's 600 s is less than the script's warm start + 2 evaluations + 8 steps
def test_run_default_script_end_to_end(tmp_path):
    """``examples/scripts/run_default.sh``: data, BM25 index, retriever process, warm start, >= 8 RL steps with
    search, evaluation table, retriever stopped, exit 0 (the script's wiring: 8 of the 20 steps, 16 questions, the
    suffix baseline's validation pass skipped, extra flags passed through as the script's header says; 10-20 minutes
    on 2 cores; timed by the benchmark, not here; the whole job's learning is test_learning_e2e's)."""
    env = dict(os.environ, RUN_DIR=str(tmp_path / "default"), OMP_NUM_THREADS="2")
    extra = ["--train.max_steps", "8", "--eval.max_samples", "16", "--eval.suffix_words", "1"]
    res = subprocess.run(["bash", os.path.join(REPO_ROOT, "examples", "scripts", "run_default.sh")] + extra,
                         cwd=REPO_ROOT, env=env, capture_output=True, text=True, timeout=2800)
    assert res.returncode == 0, res.stdout[-2000:] + res.stderr[-3000:]
    assert "before RL vs after RL" in res.stdout
    rows = _rows(tmp_path / "default" / "train" / "metrics.jsonl")
    assert len(rows) >= 8
    assert sum(r["valid_searches"] for r in rows) > 0, "no search happened during RL"
    started = re.search(r"retriever service started at http://127\.0\.0\.1:(\d+)", res.stderr)
    assert started, res.stderr[-3000:]
    port = int(started.group(1))
    import socket

    with socket.socket() as s:  # the retriever was stopped: nothing listens on its port any more
        assert s.connect_ex(("127.0.0.1", port)) != 0


def test_scripted_warmstart_queries_retrieve_the_supporting_passage(retriever_url, default_data):
    """The warm start's keyword queries ("capital France") find the passage that holds the gold answer (real
    retriever), and the scripted trajectory's last action tokens are the answer block with that answer."""
    import asyncio

    from openrlhf_search.config import SearchConfig
    from openrlhf_search.cpu.main_job.offline_assets import load_qwen_tokenizer
    from openrlhf_search.cpu.main_job.warmstart import scripted_query, scripted_trajectory
    from openrlhf_search.protocol import get_protocol
    from openrlhf_search.retrieval_client import RetrievalClient

    assert scripted_query("What is the capital of France?") == "capital France"
    assert scripted_query("What is the?") == "What is the"  # nothing but function words: the question itself
    rows = [json.loads(line) for line in open(default_data.train_path)]
    one_hop = [r for r in rows if r["hops"] == 1][:40]
    client = RetrievalClient.from_config(SearchConfig(retriever_urls=[retriever_url], topk=3))
    loop = asyncio.new_event_loop()
    try:
        results = loop.run_until_complete(client.search_batch([scripted_query(r["question"]) for r in one_hop]))
        loop.run_until_complete(client.aclose())
    finally:
        loop.close()
    found = sum(r["supporting_ids"][-1] in [p.id for p in ps] for r, ps in zip(one_hop, results))
    assert found >= 0.8 * len(one_hop), f"{found}/{len(one_hop)} keyword queries found the supporting passage"
    proto, tok = get_protocol("searchr1"), load_qwen_tokenizer()
    r = one_hop[0]
    traj = scripted_trajectory(proto.build_prompt(r["question"], tok, chat=True), r["question"], r["answer"],
                               results[0], proto, tok, max_obs_tokens=200)
    a, b = traj.action_ranges[-1]
    assert tok.decode(traj.tokens[a:b]).endswith(f"<answer> {r['answer']} </answer>")
    # --warmstart.answers none: the protocol only; the trajectory stops at the answer's open tag
    proto_only = scripted_trajectory(proto.build_prompt(r["question"], tok, chat=True), r["question"], None,
                                     results[0], proto, tok, max_obs_tokens=200)
    a, b = proto_only.action_ranges[-1]
    assert tok.decode(proto_only.tokens[a:b]).endswith("<answer>") and r["answer"] not in tok.decode(
        proto_only.tokens[a:b])
    assert proto_only.tokens[:a] == traj.tokens[:a]  # same prompt, search call and documents


def test_chained_warmstart_searches_again_for_the_entity_the_first_search_found(retriever_url, default_data):
    """--warmstart.hop_searches chain: a 2-hop row's scripted trajectory searches a second time, for the asked
    attribute of the entity its first search's top passage is about (read from the retrieval, no gold), and that
    second search finds the answer passage for most currency-of-capital rows (real retriever); the trajectory is the
    one-search trajectory up to the first documents block, then the follow-up turn, its documents and the answer."""
    import asyncio

    from openrlhf_search.config import SearchConfig
    from openrlhf_search.cpu.main_job.offline_assets import load_qwen_tokenizer
    from openrlhf_search.cpu.main_job.warmstart import (follow_up_query, passage_entity, scripted_query,
                                                 scripted_trajectory)
    from openrlhf_search.protocol import get_protocol
    from openrlhf_search.retrieval_client import RetrievalClient
    from openrlhf_search.types import Passage

    tkm = Passage(id="TKM-geo", title="Turkmenistan", text="The capital of Turkmenistan is Ashgabat.")
    q = "What currency is used in the country whose capital is Ashgabat?"
    q1 = scripted_query(q)
    assert passage_entity(Passage(id="x", title="Economy of Turkmenistan", text="")) == "Turkmenistan"
    assert follow_up_query(q, [q1], [tkm]) == "currency Turkmenistan"  # the bridge's asked attribute
    assert follow_up_query(q, [q1, "currency Turkmenistan"], [tkm]) is None  # the attribute query was the last
    assert follow_up_query(q, [q1], []) is None  # the search returned nothing: no chain
    assert follow_up_query(q, [q1], [Passage(id="x", title="", text="t")]) is None
    with pytest.raises(ValueError, match="no query yet"):
        follow_up_query(q, [], [tkm])
    # the top passage is about the question's own anchor: search for the other anchor, then the bridge's attribute
    n = "What is the capital of the country that borders Croatia and uses the currency BAM?"
    hrv = Passage(id="HRV-geo", title="Croatia", text="Croatia shares land borders with ...")
    bih = Passage(id="BIH-econ", title="Economy of Bosnia and Herzegovina", text="... BAM ...")
    n1 = scripted_query(n)
    assert follow_up_query(n, [n1], [hrv]) == "capital country borders uses currency BAM"
    assert follow_up_query(n, [n1, "capital country borders uses currency BAM"], [bih]) == \
        "capital Bosnia and Herzegovina"
    assert follow_up_query(n, [n1, "capital country borders uses currency BAM"], [hrv]) is None  # nothing new

    rows = [json.loads(line) for line in open(default_data.train_path)]
    two_hop = [r for r in rows if r["type"] == "currency_of_capital"][:30]
    client = RetrievalClient.from_config(SearchConfig(retriever_urls=[retriever_url], topk=1))
    loop = asyncio.new_event_loop()
    try:
        first = loop.run_until_complete(client.search_batch([scripted_query(r["question"]) for r in two_hop]))
        follow = [follow_up_query(r["question"], [scripted_query(r["question"])], ps) for r, ps in zip(two_hop, first)]
        second = loop.run_until_complete(client.search_batch([f or "" for f in follow]))
        loop.run_until_complete(client.aclose())
    finally:
        loop.close()
    found = sum(f is not None and ps and ps[0].id == r["supporting_ids"][-1]
                for r, f, ps in zip(two_hop, follow, second))
    assert found >= 0.7 * len(two_hop), f"{found}/{len(two_hop)} second searches found the answer passage"

    proto, tok = get_protocol("searchr1"), load_qwen_tokenizer()
    i = next(k for k, f in enumerate(follow) if f)
    r, prompt = two_hop[i], proto.build_prompt(two_hop[i]["question"], tok, chat=True)
    one = scripted_trajectory(prompt, r["question"], "X", first[i], proto, tok, max_obs_tokens=200)
    chain = scripted_trajectory(prompt, r["question"], "X", first[i], proto, tok, max_obs_tokens=200,
                                follow_ups=[(follow[i], second[i])])
    assert len(one.action_ranges) == 2 and len(chain.action_ranges) == 3
    (a1, b1), (a2, b2), (a3, b3) = chain.action_ranges
    assert chain.tokens[:a2] == one.tokens[:one.action_ranges[1][0]]  # same prompt, first search and documents
    assert tok.decode(chain.tokens[a2:b2]).endswith(f"<search> {follow[i]} </search>")
    between = tok.decode(chain.tokens[b2:a3])  # the environment's second documents block, not trained on
    assert "<information>" in between and second[i][0].title in between
    assert tok.decode(chain.tokens[a3:b3]).endswith("<answer> X </answer>") and b3 == len(chain.tokens)


def test_first_sentence_keeps_abbreviations_and_cuts_long_replies():
    from openrlhf_search.cpu.main_job.warmstart import first_sentence

    assert first_sentence(" The currency used in Malta is the Euro. It replaced the lira.") == \
        "The currency used in Malta is the Euro."
    assert first_sentence("The capital of Guernsey is St. Peter Port. It is a harbour.") == \
        "The capital of Guernsey is St. Peter Port."
    assert first_sentence("Paris\nThe capital of France.") == "Paris"
    assert first_sentence("Is it Paris? Yes.") == "Is it Paris?"
    long = first_sentence("word " * 60, max_chars=30)
    assert len(long) <= 30 and long.endswith("word")
    assert first_sentence("") == ""


def test_self_answers_are_the_policys_own_greedy_first_sentences(qwen_tokenizer, tiny_policy):
    """--warmstart.answers self: each answer is the first sentence of the engine's greedy reply to a chat turn
    holding the passage and the question (the gold answer is never used)."""
    import asyncio

    from vllm import SamplingParams

    from openrlhf_search.cpu.main_job.engine import HFEngine
    from openrlhf_search.cpu.main_job.warmstart import SELF_ANSWER_TEMPLATE, first_sentence, self_answers
    from openrlhf_search.types import Passage

    engine = HFEngine(tiny_policy, qwen_tokenizer, seed=0)
    questions = ["What is the capital of France?", "Which currency is used in Malta?"]
    passages = [[Passage(id="FRA-geo", title="France", text="The capital of France is Paris.")],
                [Passage(id="MLT-econ", title="Economy of Malta", text="The currency used in Malta is the EUR.")]]
    got = self_answers(engine, qwen_tokenizer, questions, passages, max_tokens=8, progress=False)
    assert len(got) == 2 and all(got)
    for q, ps, answer in zip(questions, passages, got):
        text = qwen_tokenizer.apply_chat_template(
            [{"role": "user", "content": SELF_ANSWER_TEMPLATE.format(passage=ps[0].text, question=q)}],
            tokenize=False, add_generation_prompt=True)
        ids = qwen_tokenizer(text, add_special_tokens=False)["input_ids"]
        ref = asyncio.run(engine.generate(ids, SamplingParams(temperature=0.0, max_tokens=8))).outputs[0].text
        assert answer == (first_sentence(ref) or "unknown")
    with pytest.raises(ValueError, match="2 questions but 1 passage"):
        self_answers(engine, qwen_tokenizer, questions, passages[:1], progress=False)
