"""A small critic for PPO on CPU: a copy of the policy's decoder with a scalar value head.

OpenRLHF's critic is a separate model initialised from a pretrained checkpoint with a value head; on CPU we
initialise the decoder from the policy's (after the warm start) and a zero-initialised linear head, so the first
values are 0 and GAE starts as REINFORCE (Schulman et al. 2017, PPO, sec. 5).
"""

import copy

import torch
from torch import nn


class ValueCritic(nn.Module):
    """V(s_t) for every prefix of a sequence.

    Args:
        decoder: a ``transformers`` decoder (returns ``last_hidden_state`` [B, T, H]); owned by the critic.
        hidden_size: H.
    """

    def __init__(self, decoder: nn.Module, hidden_size: int):
        super().__init__()
        self.decoder = decoder
        self.value_head = nn.Linear(hidden_size, 1)
        nn.init.zeros_(self.value_head.weight)
        nn.init.zeros_(self.value_head.bias)

    @classmethod
    def from_policy(cls, policy) -> "ValueCritic":
        """A critic whose decoder is a deep copy of ``policy``'s (never shared with the policy), on its device."""
        decoder = policy.get_decoder() if hasattr(policy, "get_decoder") else policy.base_model
        critic = cls(copy.deepcopy(decoder), policy.config.hidden_size)
        return critic.to(next(policy.parameters()).device)

    def forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
        """Values aligned with next-token positions.

        Args:
            input_ids, attention_mask: [B, T].
        Returns:
            values [B, T-1] float32: ``values[:, j]`` is V of the state after tokens 0..j (OpenRLHF's alignment:
            the value of the state in which token j+1 is chosen).
        """
        hidden = self.decoder(input_ids=input_ids, attention_mask=attention_mask).last_hidden_state
        return self.value_head(hidden[:, :-1]).squeeze(-1).float()
