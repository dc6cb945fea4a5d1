"""``vllm.logprobs.Logprob`` (same fields and defaults as vLLM 0.29.0)."""

from dataclasses import dataclass
from typing import Optional


@dataclass
class Logprob:
    """Log-probability of one token, its vocabulary rank (>= 1) and its decoded text."""

    logprob: float
    rank: Optional[int] = None
    decoded_token: Optional[str] = None
