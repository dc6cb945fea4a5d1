"""The dry run says what a short training file does before hours of work: fewer prompts than one step takes are
cut to nothing (a warning naming the numbers), fewer steps than the LR warm-up are refused unless ALLOW_SHORT=1
(then a warning that does not tell the user to set what is already set)."""

import json

import pytest

from openrlhf_search.cli import prepare_data
from tests.test_launchers import _run


@pytest.fixture(scope="module")
def qwen_dir():
    from cpu_demo.offline_assets import qwen_tokenizer_path

    return qwen_tokenizer_path()


def _files(tmp_path, qwen_dir, protocol, chat, rows=6):
    qa, out = tmp_path / "qa.jsonl", tmp_path / "prompts.jsonl"
    qa.write_text("".join(json.dumps({"question": f"question {i}", "answer": f"a{i}"}) + "\n" for i in range(rows)))
    assert prepare_data.main(["--input", str(qa), "--protocol", protocol, "--tokenizer", qwen_dir,
                              "--chat_template" if chat else "--no_chat_template", "--out", str(out)]) == 0
    corpus = tmp_path / "corpus.jsonl"
    corpus.write_text(json.dumps({"id": "1", "contents": "Title\ntext"}) + "\n")
    return dict(MODEL=qwen_dir, TRAIN_DATA=str(out), EVAL_DATA=str(out), RETRIEVER_CORPUS=str(corpus),
                OUTPUT_ROOT=str(tmp_path / "out"), DRY_RUN="1")


def test_a_file_shorter_than_one_step_is_named_in_the_dry_run(tmp_path, qwen_dir):
    env = _files(tmp_path, qwen_dir, "r1searcher", False, rows=6)
    res = _run("r1searcher_qwen7b_base_single.sh", timeout=300, **env)
    assert res.returncode == 0, res.stderr[-3000:]
    warning = [ln for ln in res.stderr.splitlines() if "fewer than the 64 of one step" in ln]
    assert len(warning) == 1 and "has 6 prompts" in warning[0] and "6 x 16 = 96 samples" in warning[0]
    assert "updates of 256" in warning[0] and "nothing trains" in warning[0]


def test_allow_short_warns_without_asking_for_itself(tmp_path, qwen_dir):
    env = _files(tmp_path, qwen_dir, "searchr1", True, rows=6)
    refused = _run("searchr1_grpo_qwen2.5-3b_base.sh", timeout=120, **env)
    assert refused.returncode == 2 and refused.stderr.rstrip().endswith("or set ALLOW_SHORT=1"), refused.stderr
    allowed = _run("searchr1_grpo_qwen2.5-3b_base.sh", timeout=300, ALLOW_SHORT="1", **env)
    assert allowed.returncode == 0, allowed.stderr[-3000:]
    warning = [ln for ln in allowed.stderr.splitlines() if "ALLOW_SHORT=1" in ln]
    assert len(warning) == 1 and "LR warm-up" in warning[0] and "set ALLOW_SHORT" not in warning[0]
    assert "nothing trains" in allowed.stderr  # 6 x 5 samples do not fill one update of 256
