"""Every prompt-file hint leads somewhere: a launcher whose TRAIN_DATA / EVAL_DATA is missing names the prepare_data
command that makes it, and a prompt file the run's check refuses names the command that rewrites it; each command,
run on an offline tokenizer (the launcher's MODEL pointed at it), writes a file that the same check then accepts."""

import json
import os
import shlex
import shutil

import pytest

from openrlhf_search.cli import prepare_data
from openrlhf_search.cli.prepare_data import RenderingError, check_prompt_file, inputs_of_file
from tests.test_launchers import _argv, _run

#: every launcher family: Search-R1 base / instruct, R1-Searcher Qwen single / stage 1, Llama stages 1 / 2, chat_tools
LAUNCHERS = ["searchr1_grpo_qwen2.5-3b_base.sh", "searchr1_ppo_qwen2.5-7b_instruct.sh",
             "r1searcher_qwen7b_base_single.sh", "r1searcher_qwen7b_base_stage1.sh",
             "r1searcher_llama8b_instruct_stage1.sh", "r1searcher_llama8b_instruct_stage2.sh",
             "chat_tools_grpo_qwen3-4b.sh"]


@pytest.fixture(scope="module")
def qwen_dir():
    from cpu_demo.offline_assets import qwen_tokenizer_path

    return qwen_tokenizer_path()


@pytest.fixture(scope="module")
def qa_file(tmp_path_factory):
    """Three R1-Searcher-style questions (question, answer): what the commands' --input is swapped for offline."""
    path = tmp_path_factory.mktemp("qa") / "qa.jsonl"
    rows = [{"question": "Who wrote Hamlet", "answer": "William Shakespeare"},
            {"question": "What is the capital of France", "answer": "Paris"},
            {"question": "When did the Berlin Wall fall", "answer": "1989"}]
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return str(path)


def _command(text: str, marker: str) -> list:
    """The argv of the prepare_data command that follows ``marker`` in a one-line message."""
    line = next(ln for ln in text.splitlines() if marker in ln)
    argv = shlex.split(line.split(marker, 1)[1])
    assert argv[:3] == ["python", "-m", "openrlhf_search.cli.prepare_data"], line
    return argv[3:]


def _offline_inputs(argv: list, qa: str) -> list:
    """The command with each --input (a hub name or R1-Searcher's clone, not here) replaced by a local QA file."""
    out = list(argv)
    for i, a in enumerate(argv):
        if a == "--input":
            out[i + 1] = qa
    return out


def _policy_env(script, tmp_path, tok_dir):
    env = dict(DATA_DIR=str(tmp_path / "data"), MODEL=tok_dir, OUTPUT_ROOT=str(tmp_path / "out"), ALLOW_SHORT="1",
               RETRIEVER_URLS="http://127.0.0.1:9")
    if "stage2" in script:  # stage 2 starts from stage 1's HF folder; its prompts use the base model's tokenizer
        env.pop("MODEL")
        env.update(STAGE1_CKPT=tok_dir, BASE_MODEL=tok_dir)
    return env


@pytest.mark.parametrize("script", LAUNCHERS)
def test_a_missing_prompt_file_names_the_command_that_makes_an_accepted_one(script, tmp_path, qwen_dir,
                                                                              llama3_tokenizer_dir, qa_file):
    tok_dir = llama3_tokenizer_dir if "llama" in script else qwen_dir
    if "stage2" in script:  # an HF model folder: config.json beside the tokenizer
        ckpt = tmp_path / "stage1"
        shutil.copytree(tok_dir, ckpt)
        (ckpt / "config.json").write_text("{}")
        tok_dir = str(ckpt)
    env = _policy_env(script, tmp_path, tok_dir)
    argv = _argv(script, **env)
    flag = lambda name: argv[argv.index(name) + 1]
    protocol, chat = flag("--search.protocol"), flag("--search.chat_template").lower() == "true"
    made = []
    for what in ("TRAIN_DATA", "EVAL_DATA"):  # the training file first; once it exists, the eval file's turn
        res = _run(script, DRY_RUN="1", timeout=120, **env)
        assert res.returncode == 2 and res.stdout == "", res.stderr[-2000:]
        lines = [ln for ln in res.stderr.splitlines() if ln.strip()]
        assert len(lines) == 1 and f"error: {what} " in lines[0] and "does not exist; make it with: " in lines[0]
        cmd = _command(lines[0], "make it with: ")
        out = cmd[cmd.index("--out") + 1]
        assert out == flag("--data.prompt_dataset" if what == "TRAIN_DATA" else "--eval.dataset")
        assert ("--chat_template" if chat else "--no_chat_template") in cmd
        assert prepare_data.main(_offline_inputs(cmd, qa_file)) == 0
        made.append(out)
    for path in made:  # cli.train's own check, with the launcher's protocol, chat setting and policy
        record = check_prompt_file(path, protocol, chat, flag("--actor.model_name_or_path"))
        assert record["protocol"] == protocol and record["chat_template"] == chat


@pytest.mark.parametrize("case", ["llama_stage1_plain_file", "other_protocol", "other_tokenizer"])
def test_a_refused_prompt_file_names_the_command_that_fixes_it(case, tmp_path, qwen_dir, llama3_tokenizer_dir,
                                                                 qa_file):
    """The refusal's command, run as printed (its --input is the file the rows were read from), rewrites the file in
    place (a file for another template: beside it), and the same check accepts the result: no hint that writes the
    refused file again."""
    path = str(tmp_path / "prompts.jsonl")
    if case == "llama_stage1_plain_file":  # built without --chat_template; Llama stage 1 renders the chat template
        built = ["--protocol", "r1searcher", "--tokenizer", llama3_tokenizer_dir]
        run = ("r1searcher", True, llama3_tokenizer_dir)
    elif case == "other_protocol":  # a Search-R1 file for a chat_tools run
        built = ["--protocol", "searchr1", "--tokenizer", qwen_dir]
        run = ("chat_tools", True, qwen_dir)
    else:  # rendered with the Qwen template, the policy is the Llama-shaped one
        built = ["--protocol", "searchr1", "--tokenizer", qwen_dir]
        run = ("searchr1", True, llama3_tokenizer_dir)
    assert prepare_data.main(["--input", qa_file, "--out", path] + built) == 0
    with pytest.raises(RenderingError) as e:
        check_prompt_file(path, *run)
    message = str(e.value)
    assert len(message.splitlines()) == 1
    # another template: a second file (the refused one serves the launchers of its own template); else in place
    cmd = _command(message, "EVAL_DATA) with " if case == "other_tokenizer" else "regenerate it with ")
    target = cmd[cmd.index("--out") + 1]
    assert cmd[cmd.index("--input") + 1] == qa_file and (target != path if case == "other_tokenizer" else
                                                          target == path)
    assert prepare_data.main(cmd) == 0
    record = check_prompt_file(target, *run)
    assert record["protocol"] == run[0] and record["chat_template"] is run[1]


def test_the_inputs_of_a_file_come_from_its_rows(tmp_path):
    """Search-R1's merge of two hub train splits is named as prepare_data reads it; local files by their path."""
    merge, mixed = tmp_path / "merge.jsonl", tmp_path / "mixed.jsonl"
    hub = "hub:RUC-NLPIR/FlashRAG_datasets/{}/{}"
    merge.write_text("".join(json.dumps({"source": hub.format(s, "train")}) + "\n" for s in ("nq", "nq", "hotpotqa")))
    mixed.write_text(json.dumps({"source": "/data/a.jsonl"}) + "\n" + json.dumps({"source": hub.format("nq", "test")})
                     + "\n")
    assert inputs_of_file(str(merge)) == ["nq_hotpotqa_train"]
    assert inputs_of_file(str(mixed)) == ["/data/a.jsonl", "nq"]
    (tmp_path / "bare.jsonl").write_text(json.dumps({"prompt": "x"}) + "\n")
    assert inputs_of_file(str(tmp_path / "bare.jsonl")) == ["QA_FILE"]
    assert os.path.exists(merge)
