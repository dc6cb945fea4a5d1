"""Evaluation checks what it can before anything long starts: ``cli.eval --check_only`` (run by ``eval.sh`` before it
builds or starts a retriever, dry runs included) refuses a missing model or data folder in one line, and a training
run's folder (a run stopped by hand has no final model) stands for its newest ``global_step*_hf`` copy."""

import json
import os
import subprocess
import sys

import pytest

from openrlhf_search.cli import eval as cli_eval
from tests.conftest import REPO_ROOT, shared_path

EVAL_SH = os.path.join(REPO_ROOT, "examples", "scripts", "eval.sh")


def _hf_copy(folder):
    os.makedirs(folder)
    with open(os.path.join(folder, "config.json"), "w") as f:
        json.dump({"model_type": "qwen2", "max_position_embeddings": 32768}, f)


def test_a_run_folder_stands_for_its_newest_hf_copy(tmp_path):
    run = tmp_path / "searchr1_grpo_run"
    for step in (100, 300, 20):
        _hf_copy(str(run / "ckpt" / f"global_step{step}_hf"))
    os.makedirs(run / "ckpt" / "global_step400_hf")  # being written when the run stopped: no config.json yet
    (run / "tensorboard").mkdir()
    path, note = cli_eval.resolve_model(str(run))
    assert path == str(run / "ckpt" / "global_step300_hf") and "step 300" in note  # 300 > 100 > 20 numerically
    model = str(run / "ckpt" / "global_step100_hf")
    assert cli_eval.resolve_model(model) == (model, None)  # an HF folder as it is
    assert cli_eval.resolve_model("Qwen/Qwen2.5-7B") == ("Qwen/Qwen2.5-7B", None)
    (tmp_path / "empty").mkdir()
    with pytest.raises(ValueError, match="no global_step\\*_hf copy"):
        cli_eval.resolve_model(str(tmp_path / "empty"))


def test_check_only_loads_model_and_sets_and_starts_nothing(tmp_path, capsys, monkeypatch):
    monkeypatch.delenv("OPENRLHF_SEARCH_DATA_DIR", raising=False)  # no data folder unless given
    run = tmp_path / "run"
    _hf_copy(str(run / "global_step30_hf"))
    argv = ["--model", str(run), "--protocol", "r1searcher", "--datasets", "bamboogle", "--check_only",
            "--retriever_url", "http://127.0.0.1:9"]  # nothing listens there: never asked
    assert cli_eval.main(argv + ["--data_dir", shared_path()]) == 0
    err = capsys.readouterr().err
    assert f"evaluating its newest HF copy {run / 'global_step30_hf'}" in err
    assert "ready: model " in err and "bamboogle (125 questions from " in err
    assert not (tmp_path / "eval_out").exists()
    assert cli_eval.main(argv) == 2  # R1-Searcher's sets are local files: without a data folder, one line
    assert "--data_dir" in capsys.readouterr().err.strip().splitlines()[-1]


def _eval_sh(tmp_path, model, **env):
    base = {k: v for k, v in os.environ.items()
            if not k.endswith(("_RETRIEVER_URL", "_CORPUS"))
            and k not in ("DATA_DIR", "OPENRLHF_SEARCH_DATA_DIR", "RETRIEVER_URLS", "ONLINE")}
    corpus = tmp_path / "corpus.jsonl"
    corpus.write_text(json.dumps({"id": "1", "contents": "T\ntext"}) + "\n")
    base.update(PYTHON=sys.executable, HOTPOTQA_CORPUS=str(corpus), KILT_CORPUS=str(corpus),
                OUT_DIR=str(tmp_path / "out"), **env)
    return subprocess.run(["bash", EVAL_SH, model, "r1searcher"], capture_output=True, text=True, timeout=120,
                          env=base)


@pytest.mark.parametrize("dry_run", ["1", "0"])
def test_eval_sh_refuses_missing_data_or_model_before_building_a_retriever(tmp_path, dry_run, tiny_model_dir):
    res = _eval_sh(tmp_path, tiny_model_dir, DRY_RUN=dry_run)  # no DATA_DIR: R1-Searcher's four sets are not here
    assert res.returncode == 2 and "--data_dir" in res.stderr.strip().splitlines()[-1], res.stderr[-2000:]
    assert "would start" not in res.stderr and "retriever starting" not in res.stderr
    assert not (tmp_path / "out").exists()  # no retriever log, no index
    res = _eval_sh(tmp_path, str(tmp_path / "no_such_run"), DRY_RUN=dry_run, DATA_DIR=shared_path())
    assert res.returncode == 2 and "no_such_run" in res.stderr.strip().splitlines()[-1], res.stderr[-2000:]
    assert "would start" not in res.stderr and "retriever starting" not in res.stderr
    if dry_run == "1":  # with both: the retrievers it would start, then the command
        res = _eval_sh(tmp_path, tiny_model_dir, DRY_RUN="1", DATA_DIR=shared_path())
        assert res.returncode == 0, res.stderr[-2000:]
        assert f"ready: model {tiny_model_dir}: local folder" in res.stderr and res.stderr.count("would start") == 2
        assert "openrlhf_search.cli.eval" in res.stdout
