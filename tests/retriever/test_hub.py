"""A hub model that cannot be had fails in one line naming it, without huggingface_hub's retry flood.

Measured on this 2-core machine without network, load ~5, with a made-up encoder name:
``python -m retriever.build_index --corpus c.jsonl --index_dir D --encoder nosuchorg/made-up-encoder-xyz``
(HF_HUB_OFFLINE unset) took 100 s and printed 77 lines (five retries per file request) before the error; with
``retriever.hub.resolve_model_path`` it takes 19 s (10 s of CPU, all of it imports) and prints the error as its only
line after the import warnings (HF_HUB_OFFLINE=1: 16 s, the same one line naming the model and ``hf download``).
The tests here need no network: the hub is either disabled (HF_HUB_OFFLINE=1) or ``model_info`` is replaced by one
that raises what huggingface_hub raises.
"""

from __future__ import annotations

import time

import httpx
import pytest
from huggingface_hub import constants
from huggingface_hub.errors import RepositoryNotFoundError

import huggingface_hub
from retriever.hub import resolve_model_path

FAKE = "nosuchorg/made-up-encoder-xyz"


def _fake_cache(root, repo: str, sha: str = "0" * 40):
    """A Hugging Face hub cache holding ``repo`` at ``sha`` (main), as ``hf download`` lays it out."""
    base = root / ("models--" + repo.replace("/", "--"))
    snap = base / "snapshots" / sha
    snap.mkdir(parents=True)
    (snap / "config.json").write_text("{}")
    (base / "refs").mkdir()
    (base / "refs" / "main").write_text(sha)
    return snap


def test_offline_unknown_hub_name_fails_fast_in_one_line(monkeypatch, tmp_path):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", True)
    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(tmp_path))
    t0 = time.monotonic()
    with pytest.raises(ValueError) as e:
        resolve_model_path(FAKE, "encoder")
    assert time.monotonic() - t0 < 5
    msg = str(e.value)
    assert "\n" not in msg and msg.startswith(f"cannot load encoder {FAKE!r}: ")
    assert "HF_HUB_OFFLINE=1" in msg and f"hf download {FAKE}" in msg


def test_cached_hub_name_resolves_to_its_snapshot_without_network(monkeypatch, tmp_path):
    snap = _fake_cache(tmp_path, FAKE)
    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(tmp_path))
    monkeypatch.setattr(huggingface_hub, "model_info", lambda *a, **k: pytest.fail("hub asked for a cached model"))
    for offline in (True, False):
        monkeypatch.setattr(constants, "HF_HUB_OFFLINE", offline)
        monkeypatch.setenv("HF_HUB_OFFLINE", "1" if offline else "0")
        assert resolve_model_path(FAKE) == str(snap)


def test_local_folder_is_returned_and_missing_path_names_the_cwd(tmp_path, monkeypatch):
    assert resolve_model_path(str(tmp_path)) == str(tmp_path)
    monkeypatch.chdir(tmp_path)
    with pytest.raises(ValueError, match=f"no such folder .*resolved against {tmp_path}"):
        resolve_model_path("./models/e5", "encoder")


@pytest.mark.parametrize("exc, expect", [
    (httpx.ConnectError("[Errno -2] Name or service not known"), "hub is unreachable (ConnectError"),
    (RepositoryNotFoundError("404", response=httpx.Response(404, request=httpx.Request("GET", "https://x"))),
     "no such model on the Hugging Face hub"),
])
def test_online_hub_failure_is_one_line(monkeypatch, tmp_path, exc, expect):
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", False)
    monkeypatch.setenv("HF_HUB_OFFLINE", "0")
    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(tmp_path))
    calls = []

    def model_info(name, timeout=None):
        calls.append((name, timeout))
        raise exc

    monkeypatch.setattr(huggingface_hub, "model_info", model_info)
    with pytest.raises(ValueError) as e:
        resolve_model_path(FAKE, "encoder")
    assert calls == [(FAKE, 10.0)]  # one request, with a timeout: no retry loop
    assert expect in str(e.value) and FAKE in str(e.value) and "\n" not in str(e.value)


def test_hub_model_that_exists_is_left_to_the_loader(monkeypatch, tmp_path):
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", False)
    monkeypatch.setenv("HF_HUB_OFFLINE", "0")
    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(tmp_path))
    monkeypatch.setattr(huggingface_hub, "model_info", lambda name, timeout=None: object())
    assert resolve_model_path(FAKE) == FAKE


def test_get_encoder_reports_the_one_line(monkeypatch, tmp_path):
    from retriever.encoders import get_encoder, resolve_encoder

    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", True)
    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(tmp_path))
    with pytest.raises(ValueError) as e:
        get_encoder(resolve_encoder(FAKE))
    assert str(e.value).startswith(f"cannot load encoder {FAKE!r}: not a local folder") and "\n" not in str(e.value)


def _offline(monkeypatch, tmp_path):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", True)
    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(tmp_path))


def test_eval_engine_reports_the_one_line(monkeypatch, tmp_path):
    """cli.eval's engine (vLLM) checks the model and tokenizer names first: one line each, before vLLM is asked."""
    from openrlhf_search.evaluation.engines import EngineLoadError, build_engine

    _offline(monkeypatch, tmp_path)
    with pytest.raises(EngineLoadError, match=f"^cannot load model '{FAKE}': not a local folder"):
        build_engine(FAKE)
    with pytest.raises(EngineLoadError, match=f"^cannot load tokenizer '{FAKE}': not a local folder"):
        build_engine(str(tmp_path), tokenizer_path=FAKE)


def test_a_file_is_not_a_model_folder(tmp_path):
    f = tmp_path / "corpus.jsonl"
    f.write_text("{}\n")
    with pytest.raises(ValueError, match="a file, not a model folder"):
        resolve_model_path(str(f), "encoder")
