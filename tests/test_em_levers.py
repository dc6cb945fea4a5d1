"""The CPU main job's levers for exact answers: the bare-answer instruction, the self-answer
prompt and form of the warm start, and the reward curriculum (--search.stage2_reward_scheme / stage2_start_step)."""

import json
import os
from types import SimpleNamespace

import pytest

from openrlhf_search.config import SearchConfig
from openrlhf_search.cpu.main_job.args import parse_args
from openrlhf_search.protocol import get_protocol
from openrlhf_search.reward_schedule import RewardSchedule


# ------------------------------------------------------------------------------------------------ instruction
def test_bare_protocol_asks_for_the_bare_span_and_keeps_searchr1_short_parsing(qwen_tokenizer):
    """searchr1_bare = searchr1_short with another instruction: catches the variant not registered, its template not
    swapped (the same prompt as searchr1_short), or different tags / parsing."""
    short, bare = get_protocol("searchr1_short"), get_protocol("searchr1_bare")
    q = "What is the capital of Tonga"
    p_short, p_bare = short.build_prompt(q, chat=False), bare.build_prompt(q, chat=False)
    assert p_short != p_bare and "no sentence" in p_bare and "no sentence" not in p_short
    assert p_bare.endswith("Question: What is the capital of Tonga?\n")  # Search-R1's "?" completion kept
    assert "e.g. <answer> Beijing </answer>" in p_bare
    assert (bare.query_open, bare.query_close, bare.doc_open, bare.doc_close) == \
        (short.query_open, short.query_close, short.doc_open, short.doc_close)
    resp = "<think> x </think>\n<search> capital Tonga </search>\n\n<information>Doc 1(Title: \"Tonga\") t" \
           "</information>\n\n<answer> Nuku'alofa </answer>"
    assert bare.extract_answer(resp) == short.extract_answer(resp) == "Nuku'alofa"
    assert bare.invalid_action_message() == short.invalid_action_message()
    chat = bare.build_prompt(q, qwen_tokenizer, chat=True)
    assert "only the name or code" in chat
    args = parse_args(["--search.protocol", "searchr1_bare"])
    assert args.search_config.protocol == "searchr1_bare"


# ------------------------------------------------------------------------------------------------ warm start
def test_answer_span_drops_the_restated_question_only():
    """The 'span' form keeps the reply's own answer words: catches dropping answer words that are not in the question
    (e.g. a multi-word capital cut to one word), keeping the restatement, or an empty answer block."""
    from openrlhf_search.cpu.main_job.warmstart import answer_span

    assert answer_span("The capital of Tonga is Nuku'alofa.", "What is the capital of Tonga?") == "Nuku'alofa"
    assert answer_span("Asmara is the capital of Eritrea.", "What is the capital of Eritrea?") == "Asmara"
    assert answer_span("The currency used in Mexico is the MXN.", "Which currency is used in Mexico?") == "MXN"
    assert answer_span("The capital of Saudi Arabia is Riyadh.", "What is the capital of Saudi Arabia?") == "Riyadh"
    assert answer_span("The capital is St. Peter Port.", "What is the capital of Guernsey?") == "St. Peter Port"
    assert answer_span("The capital of Papua New Guinea is Port Moresby.",
                       "What is the capital of Papua New Guinea?") == "Port Moresby"
    # a wrong reply stays wrong (no gold is read): only its restating words go
    assert answer_span("Samoa is a country in Polynesia.", "What is the capital of Samoa?") == "Polynesia"
    # nothing but restatement: the reply itself, never an empty block
    assert answer_span("It is the capital of France.", "What is the capital of France?") == \
        "It is the capital of France"


class _FakeEngine:
    """vLLM generate contract; records the prompts and answers every request with one fixed reply."""

    def __init__(self, reply):
        self.reply, self.prompts = reply, []

    async def generate(self, ids, params):
        self.prompts.append(list(ids))
        return SimpleNamespace(outputs=[SimpleNamespace(text=self.reply)])


def test_self_answers_prompt_flag_and_answer_block_forms(qwen_tokenizer):
    """--warmstart.self_prompt picks the chat request, --warmstart.self_form what the answer turn holds; catches a
    flag that is parsed but not passed through (the default request / first sentence whatever the flag), a
    think_span that loses its reasoning or puts the sentence in the answer, and unknown names accepted."""
    from openrlhf_search.cpu.main_job.warmstart import SELF_ANSWER_PROMPTS, answer_blocks, self_answers
    from openrlhf_search.types import Passage

    qs = ["What is the capital of France?"]
    ps = [[Passage(id="FRA-geo", title="France", text="The capital of France is Paris.")]]
    reply = "The capital of France is Paris. It is a large city."
    for prompt in ("few_words", "bare"):
        eng = _FakeEngine(reply)
        assert self_answers(eng, qwen_tokenizer, qs, ps, progress=False, prompt=prompt) == \
            ["The capital of France is Paris."]
        text = qwen_tokenizer.decode(eng.prompts[0])
        assert SELF_ANSWER_PROMPTS[prompt].split("{question}")[1].strip() in text, (prompt, text)
        other = SELF_ANSWER_PROMPTS["bare" if prompt == "few_words" else "few_words"]
        assert other.split("{question}")[1].strip() not in text
    s = ["The capital of France is Paris."]
    assert answer_blocks(s, qs, "sentence") == [("The capital of France is Paris.", None)]
    assert answer_blocks(s, qs, "span") == [("Paris", None)]
    assert answer_blocks(s, qs, "think_span") == [("Paris", "The capital of France is Paris.")]
    with pytest.raises(ValueError, match="unknown prompt"):
        self_answers(_FakeEngine(reply), qwen_tokenizer, qs, ps, progress=False, prompt="terse")
    with pytest.raises(ValueError, match="unknown form"):
        answer_blocks(s, qs, "word")
    with pytest.raises(ValueError, match="1 replies but 2 questions"):
        answer_blocks(s, qs * 2, "span")
    a = parse_args([])
    assert (a.warmstart.self_prompt, a.warmstart.self_form) == ("few_words", "sentence")  # documented defaults
    a = parse_args(["--warmstart.self_prompt", "bare", "--warmstart.self_form", "think_span"])
    assert (a.warmstart.self_prompt, a.warmstart.self_form) == ("bare", "think_span")
    with pytest.raises(SystemExit):
        parse_args(["--warmstart.self_form", "word"])


@pytest.mark.parametrize("name", ["searchr1_bare", "r1searcher"])
def test_think_span_trajectory_is_well_formed_and_trains_on_both_blocks(qwen_tokenizer, name):
    """The think_span answer turn: the reply in a reasoning block, then the span alone in the answer block, in both
    prompt shapes (Search-R1: the turn opens <think>; R1-Searcher: the prompt already opened it); the response passes
    R1-Searcher's format rule and the answer extracted is the span. Catches the reasoning dropped, written into the
    answer block, or an unbalanced think block (a -2 format penalty on every scripted trajectory)."""
    from openrlhf_search.cpu.main_job.warmstart import scripted_trajectory
    from openrlhf_search.rewards import check_format
    from openrlhf_search.types import Passage

    proto = get_protocol(name)
    q = "What is the capital of France?"
    prompt = proto.build_prompt(q, qwen_tokenizer, chat=True)
    ps = [Passage(id="FRA-geo", title="France", text="The capital of France is Paris.")]
    traj = scripted_trajectory(prompt, q, "Paris", ps, proto, qwen_tokenizer,
                               reasoning="The capital of France is Paris.")
    response = qwen_tokenizer.decode(traj.tokens[traj.action_ranges[0][0]:])
    assert proto.extract_answer(response) == "Paris"
    assert check_format(response, proto) == (True, "")
    a, b = traj.action_ranges[1]
    second = qwen_tokenizer.decode(traj.tokens[a:b])
    assert "The capital of France is Paris. " + proto.think_close in second  # trained on: the reasoning ...
    assert second.rstrip().endswith(f"{proto.answer_open} Paris {proto.answer_close}")  # ... and the bare span
    plain = scripted_trajectory(prompt, q, "Paris", ps, proto, qwen_tokenizer)
    assert "capital of France is Paris" not in qwen_tokenizer.decode(plain.tokens[plain.action_ranges[1][0]:])


# ------------------------------------------------------------------------------------------------ curriculum
def test_reward_curriculum_flags_build_the_cluster_schedule():
    """Catches the schedule flags leaking into SearchConfig (ConfigError 'unknown field'), a stage-2 scheme that is
    silently ignored without a start step, and an unknown scheme accepted."""
    a = parse_args(["--search.reward_scheme", "r1searcher_stage2", "--search.stage2_reward_scheme", "searchr1_em",
                    "--search.stage2_start_step", "12"])
    s = a.reward_schedule
    assert isinstance(s, RewardSchedule) and s.two_stage
    assert [s.scheme_at(k) for k in (0, 11, 12, 19)] == ["r1searcher_stage2"] * 2 + ["searchr1_em"] * 2
    assert a.search_config.reward_scheme == "r1searcher_stage2"
    one = parse_args([]).reward_schedule
    assert not one.two_stage and one.scheme_at(100) == SearchConfig().reward_scheme  # default: one stage
    with pytest.raises(SystemExit):
        parse_args(["--search.stage2_reward_scheme", "searchr1_em"])  # no start step
    with pytest.raises(SystemExit):
        parse_args(["--search.stage2_reward_scheme", "searchr1_emm", "--search.stage2_start_step", "3"])
    with pytest.raises(SystemExit):
        parse_args(["--search.stage2_start_step", "3"])  # a start step without a stage-2 scheme


def test_trainer_switches_the_executor_scheme_at_the_start_step():
    """The rollout of step k (k finished steps) is scored by stage 2 exactly from k = stage2_start_step: catches an
    off-by-one (> instead of >=) and a switch that changes the trainer's config instead of the executor's."""
    from openrlhf_search.cpu.main_job.trainer import LocalSearchTrainer

    cfg = SearchConfig(reward_scheme="r1searcher_stage2")
    fake = SimpleNamespace(args=SimpleNamespace(reward_schedule=RewardSchedule("r1searcher_stage2", "searchr1_em", 2)),
                           executor=SimpleNamespace(config=cfg), step=0)
    seen = []
    for step in range(4):
        fake.step = step
        seen.append((LocalSearchTrainer._apply_reward_schedule(fake), fake.executor.config.reward_scheme))
    assert seen == [("r1searcher_stage2",) * 2] * 2 + [("searchr1_em",) * 2] * 2
    assert cfg.reward_scheme == "r1searcher_stage2"  # the shared SearchConfig is not mutated
    # one stage (what parse_args builds without the stage-2 flags) or no schedule: the configured scheme, and an
    # executor without a config (tests' stub executors) is not read: catches a schedule that reads it every step
    for args in (SimpleNamespace(reward_schedule=RewardSchedule("r1searcher_stage2", None, -1)), SimpleNamespace()):
        fake = SimpleNamespace(args=args, cfg=cfg, executor=object(), step=5)
        assert LocalSearchTrainer._apply_reward_schedule(fake) == "r1searcher_stage2"


def test_curriculum_scores_real_steps_with_each_stage(tmp_path, default_bm25_url, default_data):
    """Two real RL steps (tiny policy, real retriever): step 1 scored by R1-Searcher's stage 2 (F1, -2 format
    penalty), step 2 by Search-R1's EM; the reward of step 2 is then exactly its mean EM. Catches the schedule not
    reaching the executor (step 2 would still carry the -2 penalties of the untrained policy)."""
    from openrlhf_search.cpu.data.qa import load_qa_jsonl
    from openrlhf_search.cpu.main_job.trainer import LocalSearchTrainer
    from tests.test_train_local import FAST

    args = parse_args(FAST + ["--search.retriever_urls", default_bm25_url, "--ckpt.output_dir", str(tmp_path / "r"),
                              "--train.max_steps", "2", "--eval.disable", "--search.reward_scheme",
                              "r1searcher_stage2", "--search.stage2_reward_scheme", "searchr1_em",
                              "--search.stage2_start_step", "1", "--rollout.n_samples_per_prompt", "4"])
    trainer = LocalSearchTrainer(args, load_qa_jsonl(default_data.train_path), [])
    try:
        trainer.fit()
    finally:
        trainer.close()
    rows = [json.loads(x) for x in open(os.path.join(str(tmp_path / "r"), "metrics.jsonl")) if x.strip()]
    rows = [r for r in rows if "reward" in r]
    assert [r["reward_scheme"] for r in rows] == ["r1searcher_stage2", "searchr1_em"]
    assert rows[1]["reward"] == pytest.approx(rows[1]["em"], abs=1e-6)
    assert rows[0]["reward"] < 0  # the untrained policy's format is wrong: stage 2's -2 penalty
