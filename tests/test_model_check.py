"""The dry run checks a hub model name against the local cache or the hub, says which, and refuses a misspelling."""

import os
import subprocess

import pytest

from openrlhf_search.launch.model_check import ModelCheckError, check_model
from tests.test_launchers import QA, SCRIPTS, _env


def test_misspelled_hub_name_is_refused_offline(monkeypatch, tmp_path):
    from huggingface_hub import constants

    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(tmp_path / "empty_cache"))
    with pytest.raises(ModelCheckError, match="Qwen2.5-7B-Bsae.*not in the Hugging Face cache"):
        check_model("Qwen/Qwen2.5-7B-Bsae", offline=True)
    assert "paper model, not checked" in check_model("Qwen/Qwen2.5-7B", offline=True)


def test_local_folder_and_cache_are_named(tmp_path, monkeypatch):
    folder = tmp_path / "m"
    folder.mkdir()
    with pytest.raises(ModelCheckError, match="without config.json"):
        check_model(str(folder))
    (folder / "config.json").write_text("{}")
    assert "local folder" in check_model(str(folder))
    from huggingface_hub import constants

    cache = tmp_path / "hub"  # a cache entry as huggingface_hub writes it: models--org--name/snapshots/<rev>/
    snap = cache / "models--someorg--tiny-model" / "snapshots" / ("a" * 40)
    snap.mkdir(parents=True)
    (snap / "config.json").write_text("{}")
    (cache / "models--someorg--tiny-model" / "refs").mkdir()
    (cache / "models--someorg--tiny-model" / "refs" / "main").write_text("a" * 40)
    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(cache))
    assert "local Hugging Face cache" in check_model("someorg/tiny-model", offline=True)


def test_dry_run_refuses_a_misspelled_hub_model(tmp_path):
    env = _env(DRY_RUN="1", MODEL="Qwen/Qwen2.5-7B-Bsae", TRAIN_DATA=QA, EVAL_DATA=QA,
               RETRIEVER_URLS="http://127.0.0.1:9", OUTPUT_ROOT=str(tmp_path / "out"), ALLOW_SHORT="1",
               HF_HUB_OFFLINE="1", HF_HUB_CACHE=str(tmp_path / "empty_cache"))
    res = subprocess.run(["bash", os.path.join(SCRIPTS, "searchr1_ppo_qwen2.5-7b_base.sh")], env=env,
                         capture_output=True, text=True, timeout=300)
    assert res.returncode == 2, res.stderr[-2000:]
    assert "Qwen/Qwen2.5-7B-Bsae" in res.stderr and "MODEL_CHECK=0" in res.stderr


def test_an_unreachable_hub_tokenizer_fails_at_once(monkeypatch, tmp_path):
    """Offline, transformers retried a hub tokenizer for about 70 s before its error; now one request decides."""
    import time

    from huggingface_hub import constants

    from openrlhf_search.cli.prepare_data import RenderingError, load_policy_tokenizer

    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(tmp_path / "empty_cache"))
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", False)
    start = time.monotonic()
    with pytest.raises(RenderingError, match="no-such-model-38"):
        load_policy_tokenizer("openrlhf-search-tests/no-such-model-38")
    assert time.monotonic() - start < 20
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", True)
    with pytest.raises(RenderingError, match="HF_HUB_OFFLINE"):
        load_policy_tokenizer("openrlhf-search-tests/no-such-model-38")
