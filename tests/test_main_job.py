"""The CPU main job's own pieces: the warm start's scripted trajectories (tokenised as rollouts, the policy's own
answers, no gold read), the evaluation summary the before/after table is made of, and the job's settings."""

import asyncio
from types import SimpleNamespace

import pytest

from openrlhf_search.env.agent import SearchAgentExecutor
from openrlhf_search.env.config import SearchConfig
from cpu_demo.warmstart import (SELF_ANSWER_PROMPT, answer_span, first_sentence,
                                                    scripted_query, scripted_trajectory, scripted_turns, self_answers)
from openrlhf_search.env.protocol import get_protocol
from openrlhf_search.env.rewards import check_format
from openrlhf_search.env.types import Passage

PASSAGE = Passage(id="FRA-geo", title="France",
                  text="France is a country in Western Europe. The capital of France is Paris, the seat of its "
                       "government and one of its largest cities. It covers 551695 square kilometres.")


def test_answer_span_drops_the_restated_question_only():
    """Catches answer words dropped (a multi-word capital cut to one word), the restatement kept, or an empty
    answer block."""
    assert answer_span("The capital of Tonga is Nuku'alofa.", "What is the capital of Tonga?") == "Nuku'alofa"
    assert answer_span("Asmara is the capital of Eritrea.", "What is the capital of Eritrea?") == "Asmara"
    assert answer_span("The currency used in Mexico is the MXN.", "Which currency is used in Mexico?") == "MXN"
    assert answer_span("The capital is St. Peter Port.", "What is the capital of Guernsey?") == "St. Peter Port"
    assert answer_span("The capital of Papua New Guinea is Port Moresby.",
                       "What is the capital of Papua New Guinea?") == "Port Moresby"
    assert answer_span("Samoa is a country in Polynesia.", "What is the capital of Samoa?") == "Polynesia"
    assert answer_span("It is the capital of France.", "What is the capital of France?") == \
        "It is the capital of France"
    assert first_sentence("The capital is St. Peter Port. It is small.") == "The capital is St. Peter Port."
    assert scripted_query("What is the capital of France?") == "capital France"


class _FakeEngine:
    """vLLM's generate contract; records the prompts and answers every request with one fixed reply."""

    def __init__(self, reply):
        self.reply, self.prompts = reply, []

    async def generate(self, ids, params):
        self.prompts.append(list(ids))
        return SimpleNamespace(outputs=[SimpleNamespace(text=self.reply)])


def test_self_answers_ask_the_policy_with_the_passage_and_keep_its_first_sentence(smollm2_tokenizer):
    """Catches the gold answer leaking into the request, the passage left out, or the whole reply kept."""
    eng = _FakeEngine("The capital of France is Paris. It is a large city.")
    out = self_answers(eng, smollm2_tokenizer, ["What is the capital of France?"], [[PASSAGE]], progress=False)
    assert out == ["The capital of France is Paris."]
    text = smollm2_tokenizer.decode(eng.prompts[0])
    assert PASSAGE.text in text and "What is the capital of France?" in text
    assert SELF_ANSWER_PROMPT.split("{question}")[1].strip() in text
    assert "<|im_start|>assistant" in text  # the policy's own chat template, generation prompt added
    assert self_answers(_FakeEngine(""), smollm2_tokenizer, ["q?"], [[PASSAGE]], progress=False) == ["unknown"]
    with pytest.raises(ValueError, match="1 questions but 2 passage lists"):
        self_answers(eng, smollm2_tokenizer, ["q?"], [[PASSAGE], [PASSAGE]], progress=False)


class _ReplayEngine:
    """Returns the next scripted turn's tokens for each call (vLLM ``RequestOutput`` fields the executor reads)."""

    def __init__(self, tokenizer, turns, stop):
        self.tok, self.turns, self.stop = tokenizer, list(turns), stop

    async def generate(self, prompt_token_ids, sampling_params, multi_modal_data=None):
        text = self.turns.pop(0)
        ids = self.tok(text, add_special_tokens=False)["input_ids"]
        stop = next((s for s in self.stop if text.endswith(s)), None)
        out = SimpleNamespace(token_ids=ids, text=text, finish_reason="stop", stop_reason=stop, logprobs=None,
                              cumulative_logprob=None)
        return SimpleNamespace(outputs=[out], prompt_token_ids=list(prompt_token_ids), num_cached_tokens=0)


class _OneClient:
    async def search(self, query, topk=None):
        return [PASSAGE]

    async def search_batch(self, queries, topk=None):
        return [[PASSAGE] for _ in queries]


@pytest.mark.parametrize("name", ["searchr1_bare", "r1searcher"])
def test_scripted_trajectory_is_the_rollout_the_executor_builds(smollm2_tokenizer, name):
    """The warm start trains on exactly the tokens a rollout holds: the executor, fed the scripted turns by a
    replaying engine and the same passage, returns the same token ids and action spans. Catches a documents block
    rendered or cut otherwise than the executor's (the twin's old whole-block cut), prompt tokens with special
    tokens added, or spans off by one. The answer turn passes the format rule and its answer is the span."""
    proto = get_protocol(name)
    cfg = SearchConfig(protocol=name, topk=1, max_obs_tokens=40, max_turns=3, max_new_tokens_per_turn=48,
                       reward_scheme="searchr1_em", chat_template=True)
    executor = SearchAgentExecutor(cfg, retrieval_client=_OneClient())
    q = "What is the capital of France?"
    prompt = proto.build_prompt(q, tokenizer=smollm2_tokenizer, chat=True)
    first, second = scripted_turns(prompt, q, "Paris", "The capital of France is Paris.", proto)
    row = scripted_trajectory(prompt, [(first, [PASSAGE]), (second, None)], executor, smollm2_tokenizer)
    from vllm import SamplingParams

    out = asyncio.run(executor.execute(prompt, '["Paris"]', SamplingParams(max_tokens=48, stop=list(
        proto.stop_strings), include_stop_str_in_output=True), 512, smollm2_tokenizer,
        _ReplayEngine(smollm2_tokenizer, [first, second], proto.stop_strings)))
    assert out["observation_tokens"] == row["input_ids"]
    assert [list(r) for r in out["action_ranges"]] == row["action_ranges"]
    response = smollm2_tokenizer.decode(row["input_ids"][row["action_ranges"][0][0]:])
    assert proto.extract_answer(response) == "Paris" and check_format(response, proto) == (True, "")
    assert float(out["reward"]) == 1.0


def test_evaluation_summary_scores_each_question_and_leaves_failures_out():
    """Catches a failed retrieval scored as a wrong answer, per-question lists out of order with ``questions``, and a
    record without ``gold`` (the baselines read it)."""
    from openrlhf_search.evaluation.compare import compare_evaluations, evaluation_summary

    def row(q, em, pred, searches=1, failed=False):
        return {"question": q, "golds": ["A"], "prediction": pred, "em": em, "f1": em, "cover_em": em,
                "searches": searches, "turns": 2, "response_tokens": 20, "retrieval_failed": failed, "error": None}

    s = evaluation_summary([row("q1", 1.0, "A"), row("q2", 0.0, "", 0), row("q3", 1.0, "A", failed=True)])
    assert s["n"] == 2 and s["failed_questions"] == ["q3"] and s["questions"] == ["q1", "q2"]
    assert s["em"] == 0.5 and s["answer_rate"] == 0.5 and s["valid_search_rate"] == 0.5
    assert s["per_question"]["em"] == [1.0, 0.0] and s["records"][0]["gold"] == ["A"]
    after = evaluation_summary([row("q1", 1.0, "A"), row("q2", 1.0, "A")])
    cmp = compare_evaluations(s, after)
    assert cmp["em"]["diff"] == pytest.approx(0.5) and cmp["em"]["n"] == 2


def test_rl_flags_parse_with_the_product_parser(tmp_path):
    """The job's RL phase runs cli.train with flags its own parser accepts (a renamed OpenRLHF flag fails here, not
    after the warm start), extra flags after ``--`` last (they win), GRPO with the KL in the loss, the precision
    given, and the search settings from the job's one file."""
    from openrlhf_search.cli.train import build_parser
    from cpu_demo.run import Job, PhaseError, parse_args as job_args
    from cpu_demo.run import rl_flags

    a = job_args(["--out", str(tmp_path), "--steps", "7", "--", "--actor.adam.lr", "3e-5"])
    job = Job(a)
    with pytest.raises(PhaseError, match="retriever"):  # no search.json naming a retriever that is not running
        job.search_file()
    job.url = "http://127.0.0.1:9"
    argv = rl_flags(a, "model", "prompts.jsonl", job.search_file(), str(tmp_path / "rl"), "bf16") + a.extra
    flat = vars(build_parser().parse_args(argv))
    assert flat["train.max_steps"] == 7 and flat["actor.adam.lr"] == 3e-5 and flat["ds.param_dtype"] == "bf16"
    assert flat["algo.advantage.estimator"] == "group_norm" and flat["algo.kl.use_loss"]
    assert flat["actor.trainable_layers"] == 4 and flat["cpu_cluster"] and not flat["critic.model_name_or_path"]
    assert flat["rollout.batch_size"] * flat["rollout.n_samples_per_prompt"] == flat["train.batch_size"]
    cfg = SearchConfig.from_file(flat["search.config"])
    assert (cfg.protocol, cfg.max_turns, cfg.topk, cfg.retriever_urls) == ("searchr1_bare", 3, 1, ["http://127.0.0.1:9"])
    assert cfg.mask_retrieved and flat["rollout.max_new_tokens"] == cfg.max_new_tokens_per_turn


@pytest.mark.parametrize("arm, changed", [
    ("no_mask", {"mask_retrieved": False}),
    ("no_search", {"protocol": "searchr1_bare_nosearch", "max_turns": 1}),
    ("ppo", {}),
])
def test_each_ablation_arm_changes_only_its_own_setting(tmp_path, arm, changed):
    """Each arm's RL flags and search file differ from the default arm's in exactly the arm's setting (catches an
    arm that silently runs the default, or one that changes a second knob)."""
    from openrlhf_search.cli.train import build_parser
    from cpu_demo.run import Job, parse_args as job_args
    from cpu_demo.run import rl_flags

    def flags_and_search(name):
        a = job_args(["--out", str(tmp_path / name), "--arm", name])
        job = Job(a)
        job.url = "http://127.0.0.1:9"
        flat = vars(build_parser().parse_args(rl_flags(a, "model", "p.jsonl", job.search_file(), "rl", "fp32")))
        cfg = SearchConfig.from_file(flat.pop("search.config"))
        return flat, cfg

    base_flags, base_cfg = flags_and_search("default")
    flags, cfg = flags_and_search(arm)
    diff = {k for k in base_cfg.__dict__ if getattr(cfg, k) != getattr(base_cfg, k)}
    assert diff == set(changed) and all(getattr(cfg, k) == v for k, v in changed.items())
    flag_diff = {k for k in set(flags) | set(base_flags) if flags.get(k) != base_flags.get(k)}
    if arm == "ppo":
        assert flags["algo.advantage.estimator"] == "gae" and flags["critic.model_name_or_path"] == "model"
        assert flag_diff == {"algo.advantage.estimator", "critic.model_name_or_path", "critic.adam.lr"}
        assert flags["algo.advantage.gamma"] == flags["algo.advantage.lambd"] == 1.0  # Search-R1's GAE
    else:
        assert flag_diff == set()


def test_a_run_folder_of_other_settings_is_refused(tmp_path):
    """A second run in the same folder continues it only with the same settings (another --split is allowed: it
    evaluates the same trained policies); catches a resumed warm start or policy trained under other flags."""
    from cpu_demo.run import Job, PhaseError, parse_args

    Job(parse_args(["--out", str(tmp_path), "--lr", "1e-4"])).check_settings()
    Job(parse_args(["--out", str(tmp_path), "--lr", "1e-4", "--split", "validation"])).check_settings()
    with pytest.raises(PhaseError, match=r"lr: 0.0001 there, 0.0002 now"):
        Job(parse_args(["--out", str(tmp_path), "--lr", "2e-4"])).check_settings()


def test_scripted_queries_retrieve_the_supporting_passage(default_bm25_url, default_data):
    """The warm start's keyword queries ("capital France") find the passage that holds the gold answer through the
    real BM25 retriever over the embedded corpus, for at least 80% of 40 one-hop questions (catches a query that
    keeps only function words, or drops the entity)."""
    import json

    from openrlhf_search.env.retrieval_client import RetrievalClient

    rows = [json.loads(line) for line in open(default_data.train_path)]
    one_hop = [r for r in rows if r["hops"] == 1][:40]
    client = RetrievalClient.from_config(SearchConfig(retriever_urls=[default_bm25_url], topk=3))

    async def search():
        try:
            return await client.search_batch([scripted_query(r["question"]) for r in one_hop])
        finally:
            await client.aclose()

    results = asyncio.run(search())
    found = sum(r["supporting_ids"][-1] in [p.id for p in ps] for r, ps in zip(one_hop, results))
    assert found >= 0.8 * len(one_hop), f"{found}/{len(one_hop)} keyword queries found the supporting passage"


def test_ablation_table_pairs_each_arm_with_the_default_within_each_seed(tmp_path):
    """The ablation table's pooled difference is the mean of the per-question differences over every seed (questions
    paired within their seed), the per-seed EM is each run's own, and an arm shares the default run's warm start by
    hard links (catches pairing across seeds, a pooled mean of means, or a copied warm start)."""
    import json
    import os

    from cpu_demo import ablations

    em = {(42, "default"): [1, 0, 1, 1], (42, "no_mask"): [0, 0, 1, 0],
          (7, "default"): [1, 1, 0, 0], (7, "no_mask"): [1, 0, 0, 0], (1, "default"): [0, 0, 0, 0]}
    for (seed, arm), scores in em.items():
        folder = ablations.arm_dir(str(tmp_path), seed, arm)
        os.makedirs(folder)
        per_q = {m: [float(x) for x in scores] for m in ablations.METRICS}
        summary = {**{m: sum(scores) / 4 for m in ablations.METRICS}, "per_question": per_q}
        for name in ("eval.json", "eval_before.json"):
            with open(os.path.join(folder, name), "w") as f:
                json.dump(summary, f)
    t = ablations.table(str(tmp_path), [42, 7, 1], ["default", "no_mask"])
    row = t["rows"]["no_mask"]
    assert [s and s["em"] for s in row["per_seed"]] == [0.25, 0.25, None]  # seed 1's arm not run (cut short)
    assert row["vs_default"]["em"]["diff"] == pytest.approx((1 - 4) / 8)  # only the seeds both finished
    assert [d and d["diff"] for d in row["vs_default_per_seed"]] == [pytest.approx(-0.5), pytest.approx(-0.25), None]
    assert t["rows"]["default"]["pooled"]["em"][0] == pytest.approx(5 / 12)  # every seed it finished
    assert "| no_mask | 0.250 / 0.250 / - |" in ablations.format_table(t) and "table 4" in row["papers"]

    default, arm = tmp_path / "d", tmp_path / "a"
    for name in ablations.SHARED:
        (default / name).mkdir(parents=True)
        (default / name / "f").write_text(name)
    (default / "eval_before.json").write_text("{}")
    ablations.share_phases(str(default), str(arm), "no_search")
    assert os.path.samefile(arm / "warmstart" / "f", default / "warmstart" / "f")
    assert not (arm / "eval_before.json").exists()  # no_search evaluates its own before-RL policy


def test_precision_auto_is_bf16_only_with_native_bf16_kernels(tmp_path):
    """auto: bf16 where /proc/cpuinfo lists avx512_bf16 or amx_bf16, fp32 on an AVX2-only CPU (where torch emulates
    bf16 matmuls an order of magnitude slower) or without a cpuinfo; a forced choice is kept, a typo refused."""
    from cpu_demo.run import resolve_cpu_precision

    def cpuinfo(flags):
        path = tmp_path / f"cpuinfo_{len(flags)}"
        path.write_text(f"processor\t: 0\nmodel name\t: X\nflags\t\t: fpu sse2 {flags}\n")
        return str(path)

    assert resolve_cpu_precision("auto", cpuinfo("avx2 avx512f avx512_bf16"))[0] == "bf16"
    assert resolve_cpu_precision("auto", cpuinfo("avx2 amx_bf16 amx_tile"))[0] == "bf16"
    assert resolve_cpu_precision("auto", cpuinfo("avx2 avx512f")) == ("fp32", "auto: the CPU has no native bf16 "
                                                                      "kernels (AVX512-BF16 / AMX)")
    assert resolve_cpu_precision("auto", str(tmp_path / "missing"))[0] == "fp32"
    assert resolve_cpu_precision("fp32", cpuinfo("avx512_bf16"))[0] == "fp32"
    with pytest.raises(ValueError, match="auto, bf16 or fp32"):
        resolve_cpu_precision("fp16")
