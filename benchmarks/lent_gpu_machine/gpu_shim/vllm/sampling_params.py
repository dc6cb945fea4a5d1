"""``vllm.SamplingParams`` reduced to the fields the CPU main job reads, with vLLM 0.29.0's defaults, its
normalisation in ``__post_init__`` (stop / stop_token_ids lists, seed -1, greedy resets, the stop-string output
buffer) and its argument checks. Unknown keyword arguments are a TypeError, so a caller that needs more of vLLM fails
loudly instead of being silently ignored."""

import math
from dataclasses import dataclass, field
from typing import List, Optional, Union

_SAMPLING_EPS = 1e-5
_MAX_TEMP = 1e-2


class VLLMValidationError(Exception):
    """An invalid sampling argument (like vLLM's ``vllm.exceptions.VLLMValidationError``, not a ValueError)."""


@dataclass
class SamplingParams:
    """Sampling parameters of one request (see vLLM's documentation for each field)."""

    n: int = 1
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    min_p: float = 0.0
    seed: Optional[int] = None
    stop: Union[str, List[str], None] = None
    stop_token_ids: Optional[List[int]] = None
    ignore_eos: bool = False
    max_tokens: Optional[int] = 16
    min_tokens: int = 0
    logprobs: Optional[int] = None
    prompt_logprobs: Optional[int] = None
    detokenize: bool = True
    skip_special_tokens: bool = True
    spaces_between_special_tokens: bool = True
    include_stop_str_in_output: bool = False
    output_text_buffer_length: int = 0
    _all_stop_token_ids: set = field(default_factory=set, repr=False)

    def __post_init__(self) -> None:
        if 0 < self.temperature < _MAX_TEMP:
            self.temperature = max(self.temperature, _MAX_TEMP)
        if self.seed == -1:
            self.seed = None
        if self.stop is None:
            self.stop = []
        elif isinstance(self.stop, str):
            self.stop = [self.stop]
        if self.stop_token_ids is None:
            self.stop_token_ids = []
        else:
            self.stop_token_ids = list(dict.fromkeys(self.stop_token_ids))
        if self.logprobs is True:
            self.logprobs = 1
        if self.prompt_logprobs is True:
            self.prompt_logprobs = 1
        if self.stop and not self.include_stop_str_in_output:
            self.output_text_buffer_length = max(len(s) for s in self.stop) - 1
        self._verify_args()
        if self.temperature < _SAMPLING_EPS:  # greedy
            self.top_p, self.top_k, self.min_p = 1.0, 0, 0.0
            if self.n > 1:
                raise VLLMValidationError(f"n must be 1 when using greedy sampling, got {self.n}.")
        self._all_stop_token_ids.update(self.stop_token_ids)

    def _verify_args(self) -> None:
        checks = [
            (-2.0 <= self.presence_penalty <= 2.0, f"presence_penalty must be in [-2, 2], got {self.presence_penalty}"),
            (-2.0 <= self.frequency_penalty <= 2.0,
             f"frequency_penalty must be in [-2, 2], got {self.frequency_penalty}"),
            (math.isfinite(self.repetition_penalty) and self.repetition_penalty > 0.0,
             f"repetition_penalty must be a finite number > 0, got {self.repetition_penalty}"),
            (math.isfinite(self.temperature) and 0.0 <= self.temperature <= 2.0,
             f"temperature must be in [0, 2], got {self.temperature}"),
            (0.0 < self.top_p <= 1.0, f"top_p must be in (0, 1], got {self.top_p}"),
            (isinstance(self.top_k, int) and self.top_k >= -1, f"top_k must be an int >= -1, got {self.top_k}"),
            (0.0 <= self.min_p <= 1.0, f"min_p must be in [0, 1], got {self.min_p}"),
            (self.max_tokens is None or self.max_tokens >= 1, f"max_tokens must be at least 1, got {self.max_tokens}"),
            (self.min_tokens >= 0, f"min_tokens must be >= 0, got {self.min_tokens}"),
            (self.max_tokens is None or self.min_tokens <= self.max_tokens,
             f"min_tokens must be <= max_tokens={self.max_tokens}, got {self.min_tokens}"),
            (self.logprobs is None or self.logprobs == -1 or self.logprobs >= 0,
             f"logprobs must be non-negative or -1, got {self.logprobs}"),
            (all(isinstance(t, int) for t in self.stop_token_ids),
             f"stop_token_ids must contain only integers, got {self.stop_token_ids}"),
            (all(self.stop), "stop cannot contain an empty string."),
            (not (self.stop and not self.detokenize), "stop strings are only supported when detokenize is True."),
        ]
        for ok, message in checks:
            if not ok:
                raise VLLMValidationError(message)

    @property
    def all_stop_token_ids(self) -> set:
        """The stop token ids (the engine adds EOS)."""
        return self._all_stop_token_ids
