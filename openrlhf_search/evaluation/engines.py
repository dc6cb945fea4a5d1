"""Generation engines for evaluation, all behind the token-in/token-out ``generate`` of OpenRLHF's rollout actor.

- GPU: ``VLLMAsyncEngine`` wraps ``vllm.AsyncLLMEngine`` exactly as ``openrlhf.trainer.ray.vllm_engine.
  RolloutRayActor.generate`` does (a ``TokensPrompt``, one request id per call, the last streamed output), so the
  executor that trains is the executor that is evaluated, with continuous batching across concurrent questions.
- CPU: ``openrlhf_search.local.engine.HFEngine`` over a ``transformers`` causal LM.
- ``model="tiny"``: the tiny random Qwen2 of ``local.offline_assets`` on the HF engine, for smoke runs.
"""

import logging
import uuid
from copy import deepcopy
from typing import Optional, Tuple

logger = logging.getLogger(__name__)


class VLLMAsyncEngine:
    """``vllm.AsyncLLMEngine`` with ``generate(prompt_token_ids, sampling_params, multi_modal_data=None)``.

    Args:
        model: HF model path or name.
        tensor_parallel_size: GPUs per engine.
        gpu_memory_utilization: share of GPU memory vLLM may take (weights + KV cache).
        max_model_len: context length (prompt + all turns), tokens.
        seed: engine seed.
        dtype: "auto", "bfloat16", ...
    """

    def __init__(self, model: str, tensor_parallel_size: int = 1, gpu_memory_utilization: float = 0.85,
                 max_model_len: Optional[int] = None, seed: int = 0, dtype: str = "auto",
                 enforce_eager: bool = False):
        import vllm

        args = vllm.AsyncEngineArgs(model=model, tensor_parallel_size=tensor_parallel_size,
                                    gpu_memory_utilization=gpu_memory_utilization, max_model_len=max_model_len,
                                    seed=seed, dtype=dtype, enable_prefix_caching=True, enforce_eager=enforce_eager)
        self.llm = vllm.AsyncLLMEngine.from_engine_args(args)

    async def generate(self, prompt_token_ids, sampling_params, multi_modal_data=None):
        """One request; returns the final ``vllm.RequestOutput`` (``outputs[0].token_ids``, ``text``, ...)."""
        from vllm.inputs import TokensPrompt

        prompt = TokensPrompt(prompt_token_ids=list(prompt_token_ids))
        if multi_modal_data:
            prompt["multi_modal_data"] = multi_modal_data
        final = None
        async for out in self.llm.generate(prompt, deepcopy(sampling_params), request_id=uuid.uuid4().hex):
            final = out
        return final

    def shutdown(self) -> None:
        shutdown = getattr(self.llm, "shutdown", None)
        if callable(shutdown):
            shutdown()


def cuda_available() -> bool:
    try:
        import torch

        return torch.cuda.is_available()
    except Exception:  # a broken torch install must not hide the clear CPU fallback
        return False


def build_engine(model: str, backend: str = "auto", tokenizer_path: Optional[str] = None, seed: int = 0,
                 max_model_len: Optional[int] = None, tensor_parallel_size: int = 1,
                 gpu_memory_utilization: float = 0.85, dtype: str = "auto") -> Tuple[object, object, str]:
    """Build (engine, tokenizer, backend name).

    Args:
        model: path / hub name, or "tiny" for the tiny random Qwen2 (always the HF engine).
        backend: "vllm", "hf" or "auto" (vLLM when CUDA is available).
        tokenizer_path: tokenizer to use instead of the model's own (for "tiny": one with the Qwen vocabulary).
    Raises:
        ValueError: unknown backend, or "vllm" without a GPU.
    """
    if backend not in ("auto", "vllm", "hf"):
        raise ValueError(f"backend must be auto, vllm or hf, got {backend!r}")
    if model == "tiny":
        from openrlhf_search.local.engine import HFEngine
        from openrlhf_search.local.offline_assets import build_tiny_qwen2, load_qwen_tokenizer

        tok = load_qwen_tokenizer()
        if tokenizer_path:  # the same vocabulary under another chat template (prompt-rendering checks)
            from transformers import AutoTokenizer

            tok = AutoTokenizer.from_pretrained(tokenizer_path)
            if len(tok) != len(load_qwen_tokenizer()):
                raise ValueError(f"--tokenizer {tokenizer_path} does not share the tiny model's Qwen vocabulary")
            if tok.pad_token is None:
                tok.pad_token = tok.eos_token
        model = build_tiny_qwen2(tok, seed=seed)
        return HFEngine(model, tok, seed=seed, max_model_len=max_model_len), tok, "hf"
    from transformers import AutoTokenizer

    use_vllm = backend == "vllm" or (backend == "auto" and cuda_available())
    if use_vllm:
        if not cuda_available():
            raise ValueError("backend vllm needs a CUDA GPU; use --backend hf on CPU")
        tok = AutoTokenizer.from_pretrained(tokenizer_path or model)
        if tok.pad_token is None:
            tok.pad_token = tok.eos_token
        return VLLMAsyncEngine(model, tensor_parallel_size, gpu_memory_utilization, max_model_len, seed,
                               dtype), tok, "vllm"
    from openrlhf_search.local.engine import HFEngine
    from openrlhf_search.local.offline_assets import load_hf_policy

    logger.info("no GPU: evaluating %s with the CPU HF engine (slow for real models)", model)
    hf, tok = load_hf_policy(model, tokenizer_path)
    return HFEngine(hf, tok, seed=seed, max_model_len=max_model_len), tok, "hf"
