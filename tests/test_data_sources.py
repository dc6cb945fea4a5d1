"""Dataset names mean the published sets: no product default reads a data folder beside the repo; every prompt file
says where its questions came from; held-out eval questions never reach training, however often the inputs repeat
them."""

import json
import os
import subprocess
import sys

import pytest

from tests.conftest import REPO_ROOT


def _prepare(*args, env=None):
    return subprocess.run([sys.executable, "-m", "openrlhf_search.cli.prepare_data", *args], cwd=REPO_ROOT,
                          capture_output=True, text=True, timeout=300, env=env)


def _offline_env(tmp_path):
    env = {k: v for k, v in os.environ.items() if k != "OPENRLHF_SEARCH_DATA_DIR"}
    env.update(HF_HUB_OFFLINE="1", HF_DATASETS_OFFLINE="1", HF_HOME=str(tmp_path / "hf"),
               PYTHONPATH=REPO_ROOT)
    return env


def test_no_default_data_folder(monkeypatch):
    from openrlhf_search.evaluation import loaders

    monkeypatch.delenv("OPENRLHF_SEARCH_DATA_DIR", raising=False)
    assert loaders.default_data_dir() is None
    assert loaders.resolve_dataset_path("flashrag:nq") is None  # the hub split, never ../shared/data's sample
    with pytest.raises(loaders.DatasetError, match="--data_dir"):
        loaders.resolve_dataset_path("hotpotqa_500")
    monkeypatch.setenv("OPENRLHF_SEARCH_DATA_DIR", "/somewhere")
    assert loaders.default_data_dir() == "/somewhere"


def test_flashrag_nq_without_the_hub_fails_in_one_line(tmp_path):
    proc = _prepare("--input", "flashrag:nq", "--protocol", "searchr1", "--no_chat_template", "--out",
                    str(tmp_path / "o.jsonl"), env=_offline_env(tmp_path))
    assert proc.returncode == 2 and not (tmp_path / "o.jsonl").exists()
    errors = [line for line in proc.stderr.splitlines() if line.startswith("error:")]
    assert len(errors) == 1 and "RUC-NLPIR/FlashRAG_datasets" in errors[0] and "'nq'" in errors[0], proc.stderr


def _write_questions(path, questions):
    with open(path, "w") as f:
        for i, q in enumerate(questions):
            f.write(json.dumps({"id": str(i), "question": q, "golden_answers": [f"a{i}"]}) + "\n")


def _questions(path):
    return [json.loads(line)["question"] for line in open(path)]


def test_a_file_given_three_times_leaks_no_eval_question(tmp_path):
    from openrlhf_search.cli.prepare_data import question_key

    src = tmp_path / "qs.jsonl"
    _write_questions(src, [f"Question number {i}?" for i in range(40)])
    out, ev = tmp_path / "train.jsonl", tmp_path / "eval.jsonl"
    proc = _prepare("--input", str(src), "--input", str(src), "--input", str(src), "--protocol", "r1searcher",
                    "--out", str(out), "--eval_out", str(ev), "--eval_size", "30")
    assert proc.returncode == 0, proc.stderr
    evq = {question_key(q) for q in _questions(ev)}
    assert len(_questions(ev)) == 30 and len(evq) == 30  # 30 distinct held-out questions
    assert not evq & {question_key(q) for q in _questions(out)}  # 30 of 30 leaked by the positional split
    assert len(_questions(out)) == 30  # the 10 others, three times each (the inputs' repeats kept)
    assert "repeat a held-out eval question" in proc.stderr
    rows = [json.loads(line) for line in open(out)]
    assert rows[0]["source"] == str(src)  # which file every prompt came from


def test_near_duplicate_questions_across_files_and_dedup(tmp_path):
    a, b = tmp_path / "stage1.jsonl", tmp_path / "stage2.jsonl"
    _write_questions(a, ["Who wrote Hamlet?", "What is the capital of Fiji?", "Q three?"])
    _write_questions(b, ["who wrote  hamlet", "Q four?", "q three"])
    out, ev = tmp_path / "train.jsonl", tmp_path / "eval.jsonl"
    proc = _prepare("--input", str(a), "--input", str(b), "--protocol", "r1searcher", "--out", str(out),
                    "--eval_out", str(ev), "--eval_size", "1")
    assert proc.returncode == 0, proc.stderr
    assert _questions(ev) == ["Who wrote Hamlet?"]
    assert "who wrote  hamlet" not in _questions(out)
    assert "1 training rows repeat a question" in proc.stderr  # "q three" after "Q three?", kept and reported
    proc = _prepare("--input", str(a), "--input", str(b), "--protocol", "r1searcher", "--out", str(out), "--dedup")
    assert proc.returncode == 0, proc.stderr
    assert _questions(out) == ["Who wrote Hamlet?", "What is the capital of Fiji?", "Q three?", "Q four?"]


def test_r1searcher_stage1_and_stage2_leak_no_eval_question(tmp_path):
    """R1-Searcher's two training files share questions: a positional 200-question eval split put 11 into training."""
    from openrlhf_search.cli.prepare_data import question_key
    from tests.conftest import shared_path

    s1, s2 = shared_path("qa", "r1searcher", "stage_1.jsonl"), shared_path("qa", "r1searcher", "stage_2.jsonl")
    out, ev = tmp_path / "train.jsonl", tmp_path / "eval.jsonl"
    proc = _prepare("--input", s2, "--input", s1, "--protocol", "r1searcher", "--shuffle", "--seed", "0",
                    "--out", str(out), "--eval_out", str(ev), "--eval_size", "200")
    assert proc.returncode == 0, proc.stderr
    evq = {question_key(q) for q in _questions(ev)}
    assert len(evq) == 200 and not evq & {question_key(q) for q in _questions(out)}
