"""``vllm.outputs.CompletionOutput`` and ``RequestOutput``: the fields OpenRLHF's executors and the HF engine use,
with vLLM 0.29.0's names and defaults."""

from dataclasses import dataclass
from typing import Any, List, Optional, Sequence, Union


@dataclass
class CompletionOutput:
    """One completion of a request (``token_ids``, ``text``, ``finish_reason``, ``stop_reason``, ``logprobs``)."""

    index: int
    text: str
    token_ids: Sequence[int]
    cumulative_logprob: Optional[float]
    logprobs: Optional[list]
    routed_experts: Any = None
    finish_reason: Optional[str] = None
    stop_reason: Union[int, str, None] = None
    lora_request: Any = None

    def finished(self) -> bool:
        """True once ``finish_reason`` is set."""
        return self.finish_reason is not None


class RequestOutput:
    """The output of one request: ``request_id``, ``prompt_token_ids``, ``outputs`` (CompletionOutput list)."""

    def __init__(self, request_id: str, prompt: Optional[str], prompt_token_ids: Optional[List[int]],
                 prompt_logprobs: Optional[list], outputs: List[CompletionOutput], finished: bool, metrics=None,
                 lora_request=None, encoder_prompt=None, encoder_prompt_token_ids=None, num_cached_tokens=None,
                 **kwargs: Any) -> None:
        self.request_id = request_id
        self.prompt = prompt
        self.prompt_token_ids = prompt_token_ids
        self.prompt_logprobs = prompt_logprobs
        self.outputs = outputs
        self.finished = finished
        self.metrics = metrics
        self.lora_request = lora_request
        self.encoder_prompt = encoder_prompt
        self.encoder_prompt_token_ids = encoder_prompt_token_ids
        self.num_cached_tokens = num_cached_tokens
