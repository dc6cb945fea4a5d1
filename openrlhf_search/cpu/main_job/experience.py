"""Trajectories -> padded tensors -> log-probabilities on action tokens (the CPU twin of OpenRLHF's experience).

Alignment follows OpenRLHF 0.11.2 (``samples_generator._process_response_into_experience``): for a sequence of T
tokens, position j of every per-token tensor ([B, T-1]) is about token j+1, predicted from tokens 0..j. So
``action_mask[:, j] = 1`` when token j+1 was sampled by the policy (inside one of the executor's
``action_ranges``), and ``log_probs[:, j] = log p(token j+1 | tokens <= j)``.

Log-probabilities are computed on action tokens only: the decoder's hidden states are gathered at action positions
before the LM head, so a 151k-token vocabulary never materialises logits for prompt or document tokens
(R1-Searcher / Search-R1 observations are most of a trajectory).

Device: :func:`collate` builds a batch on the host and moves it once to ``device``; every tensor made here follows
its inputs' device (``--train.device``, :mod:`openrlhf_search.cpu.main_job.device`).
"""

from dataclasses import dataclass, field
from typing import List, Optional, Sequence, Tuple

import torch

from openrlhf_search.cpu.main_job.freeze import decoder_hidden, trunk_boundary, trunk_hidden


@dataclass
class Trajectory:
    """One rollout as the executor returned it, plus what the trainer needs.

    Attributes:
        tokens: prompt + response token ids (model turns and environment blocks), length T.
        action_ranges: [start, end) spans of ``tokens`` sampled by the policy.
        reward: scalar outcome reward.
        group: index of the prompt group (samples of the same prompt share it).
        logs: the executor's ``extra_logs`` (floats).
        response_text: decoded response (after the prompt), for metrics and eval.
        golds: gold answers.
    """

    tokens: List[int]
    action_ranges: List[Tuple[int, int]]
    reward: float
    group: int
    logs: dict = field(default_factory=dict)
    response_text: str = ""
    golds: List[str] = field(default_factory=list)


@dataclass
class Batch:
    """Right-padded tensors of a list of trajectories.

    Attributes:
        input_ids: [B, T] long (pad id on padding).
        attention_mask: [B, T] long, 1 on real tokens.
        action_mask: [B, T-1] bool, True where the predicted token (position j+1) was sampled by the policy.
    """

    input_ids: torch.Tensor
    attention_mask: torch.Tensor
    action_mask: torch.Tensor

    def __len__(self):
        return self.input_ids.shape[0]

    def to(self, device) -> "Batch":
        """The same batch on ``device`` (tensors already there are not copied)."""
        return Batch(self.input_ids.to(device), self.attention_mask.to(device), self.action_mask.to(device))

    def slice(self, idx) -> "Batch":
        """Rows ``idx`` (slice or index tensor), trimmed to the longest remaining sequence."""
        ids, att, act = self.input_ids[idx], self.attention_mask[idx], self.action_mask[idx]
        t = int(att.sum(-1).max().item())
        return Batch(ids[:, :t], att[:, :t], act[:, : t - 1])


def action_mask_from_ranges(length: int, action_ranges: Sequence[Tuple[int, int]]) -> torch.Tensor:
    """[length-1] bool mask over next-token positions for the given [start, end) token spans.

    Raises:
        ValueError: a range outside [1, length] or with end < start (a span must never cover the first token,
            which has no prediction).
    """
    mask = torch.zeros(length, dtype=torch.bool)
    for start, end in action_ranges:
        if not (1 <= start <= end <= length):
            raise ValueError(f"action range ({start}, {end}) outside a sequence of {length} tokens")
        mask[start:end] = True
    return mask[1:]


def collate(trajectories: Sequence[Trajectory], pad_id: int, max_len: Optional[int] = None,
            device=None) -> Batch:
    """Pad trajectories on the right into a :class:`Batch`; sequences longer than ``max_len`` are cut.

    ``device``: where the batch goes (built on the host, then moved in one copy per tensor); None keeps it on the CPU.

    Raises:
        ValueError: empty input or a trajectory with fewer than 2 tokens.
    """
    if not trajectories:
        raise ValueError("collate: no trajectories")
    seqs = [list(t.tokens[:max_len] if max_len else t.tokens) for t in trajectories]
    if min(len(s) for s in seqs) < 2:
        raise ValueError("collate: a trajectory has fewer than 2 tokens")
    t_max = max(len(s) for s in seqs)
    ids = torch.full((len(seqs), t_max), pad_id, dtype=torch.long)
    att = torch.zeros((len(seqs), t_max), dtype=torch.long)
    act = torch.zeros((len(seqs), t_max - 1), dtype=torch.bool)
    for i, (s, tr) in enumerate(zip(seqs, trajectories)):
        ids[i, : len(s)] = torch.tensor(s)
        att[i, : len(s)] = 1
        ranges = [(a, min(b, len(s))) for a, b in tr.action_ranges if a < len(s)]
        act[i, : len(s) - 1] = action_mask_from_ranges(len(s), ranges)
    batch = Batch(ids, att, act)
    return batch if device is None else batch.to(device)


def _decoder_and_head(model):
    decoder = model.get_decoder() if hasattr(model, "get_decoder") else model.base_model
    head = model.get_output_embeddings()
    if head is None:
        raise TypeError(f"{type(model).__name__} has no output embeddings (LM head)")
    return decoder, head


def action_log_probs(model, batch: Batch, temperature: float = 1.0, with_entropy: bool = False,
                     trunk: Optional[torch.Tensor] = None) -> Tuple[torch.Tensor, Optional[torch.Tensor]]:
    """log pi(token_{j+1} | tokens_{<=j}) on action positions, 0 elsewhere.

    Args:
        model: a ``transformers`` causal LM (``get_decoder()`` + ``get_output_embeddings()``).
        batch: the padded batch.
        temperature: logits are divided by it (the rollout temperature, as OpenRLHF's actor does).
        with_entropy: also return the policy entropy at action positions.
        trunk: [B, T, H] frozen-trunk hidden states of this batch
        (:func:`openrlhf_search.cpu.main_job.freeze.trunk_hidden`);
            when given and the model has a frozen trunk, only its top layers run.

    Returns:
        (log_probs [B, T-1] float32, entropy [B, T-1] float32 or None); gradients flow when grad is enabled.
    """
    _, head = _decoder_and_head(model)
    hidden = decoder_hidden(model, batch.input_ids, batch.attention_mask, trunk)  # [B, T, H]
    h = hidden[:, :-1][batch.action_mask]  # [N_act, H]
    labels = batch.input_ids[:, 1:][batch.action_mask]  # [N_act]
    logits = head(h).float()
    if temperature != 1.0:
        logits = logits / temperature
    logp_all = torch.log_softmax(logits, dim=-1)
    lp = logp_all.gather(-1, labels.unsqueeze(-1)).squeeze(-1)
    out = torch.zeros(batch.action_mask.shape, dtype=torch.float32, device=lp.device)
    out = out.masked_scatter(batch.action_mask, lp)
    ent = None
    if with_entropy:
        e = -(logp_all.exp() * logp_all).sum(-1)
        ent = torch.zeros(batch.action_mask.shape, dtype=torch.float32, device=e.device).masked_scatter(
            batch.action_mask, e)
    return out, ent


@torch.no_grad()
def batched_action_log_probs(model, batch: Batch, micro_batch_size: int, temperature: float = 1.0,
                             trunk: Optional[torch.Tensor] = None) -> torch.Tensor:
    """:func:`action_log_probs` without gradients, in micro-batches (bounded memory). Returns [B, T-1].

    ``trunk``: optional [B, T, H] cached frozen-trunk states of the whole batch (see :func:`batched_trunk`)."""
    out = torch.zeros(batch.action_mask.shape, dtype=torch.float32, device=batch.action_mask.device)
    for s in range(0, len(batch), micro_batch_size):
        mb = batch.slice(slice(s, s + micro_batch_size))
        tr = None if trunk is None else trunk[s: s + micro_batch_size, : mb.input_ids.shape[1]]
        lp, _ = action_log_probs(model, mb, temperature, trunk=tr)
        out[s: s + micro_batch_size, : lp.shape[1]] = lp
    return out


def pad_trunk_states(states: Sequence[torch.Tensor], length: int, device=None) -> torch.Tensor:
    """Right-pad per-sequence frozen-trunk states into one [B, length, H] tensor (zeros after each sequence; a longer
    sequence is cut to ``length``, as :func:`collate` cuts its tokens), on ``device`` (default: the states').

    Args:
        states: B tensors [T_i, H] (from :func:`openrlhf_search.cpu.main_job.freeze.trunk_hidden` or the rollout
        engine).
    Raises:
        ValueError: no states.
    """
    if not states:
        raise ValueError("pad_trunk_states: no states")
    first = states[0]
    out = first.new_zeros((len(states), length, first.shape[-1]), device=device)
    for i, h in enumerate(states):
        n = min(h.shape[0], length)
        out[i, :n] = h[:n]
    return out


@torch.no_grad()
def batched_trunk(model, batch: Batch, micro_batch_size: int) -> Optional[torch.Tensor]:
    """[B, T, H] frozen-trunk hidden states of a whole batch, in micro-batches; None when the model has no frozen
    trunk (``--actor.trainable_layers 0``). Computed once per rollout batch and shared by the policy, the reference
    and every update pass (:mod:`openrlhf_search.cpu.main_job.freeze`)."""
    if trunk_boundary(model) == 0:
        return None
    out = None
    for s in range(0, len(batch), micro_batch_size):
        mb = batch.slice(slice(s, s + micro_batch_size))
        h = trunk_hidden(model, mb.input_ids, mb.attention_mask)
        if out is None:
            out = torch.zeros(len(batch), batch.input_ids.shape[1], h.shape[-1], dtype=h.dtype, device=h.device)
        out[s: s + micro_batch_size, : h.shape[1]] = h
    return out
