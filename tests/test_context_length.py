"""--data.max_len against the policy's context, refused when a run starts (openrlhf_search/env/context_length.py):
before, a run whose trajectories outgrew the engine's context failed mid-step (vLLM: ``prompt has 753 tokens,
max_model_len is 700``). Mutation caught: the check dropped from the cluster CLI, the CPU trainer or cli.eval, or
comparing with >= (a max_len equal to the context is valid)."""

import json

import pytest

from openrlhf_search.env.config import ConfigError
from openrlhf_search.env.context_length import context_error, model_context_length
from tests.test_cluster_wiring import _parse


def _model_dir(tmp_path, context=700):
    d = tmp_path / "policy"
    d.mkdir()
    (d / "config.json").write_text(json.dumps({"model_type": "qwen2", "max_position_embeddings": context}))
    return str(d)


def test_context_read_from_a_local_config_and_unknown_for_a_hub_name(tmp_path):
    assert model_context_length(_model_dir(tmp_path)) == 700
    assert model_context_length("Qwen/Qwen2.5-7B") is None and model_context_length(None) is None
    assert context_error(700, 700) is None and context_error(512, None) is None and context_error(None, 700) is None
    msg = context_error(753, 700)
    assert msg.startswith("--data.max_len 753 exceeds the policy's context of 700 tokens") and "\n" not in msg


def test_cluster_cli_refuses_a_max_len_above_the_policys_context(tmp_path):
    model = _model_dir(tmp_path)
    with pytest.raises(ConfigError, match="--data.max_len 753 exceeds the policy's context of 700"):
        _parse("--actor.model_name_or_path", model, "--data.max_len", "753")
    args, _ = _parse("--actor.model_name_or_path", model, "--data.max_len", "700")
    assert args.data.max_len == 700


def test_eval_cli_refuses_a_max_length_above_the_models_context(tmp_path, capsys):
    from openrlhf_search.cli.eval import main
    from tests.conftest import shared_path

    rc = main(["--model", _model_dir(tmp_path), "--datasets", "bamboogle", "--data_dir", shared_path(),
               "--protocol", "r1searcher", "--max_length", "800", "--limit", "1", "--out_dir", str(tmp_path / "o")])
    assert rc == 2 and "--max_length 800 exceeds the policy's context of 700" in capsys.readouterr().err
