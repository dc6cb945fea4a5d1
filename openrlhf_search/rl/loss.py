"""Policy and value losses that give retrieved tokens exactly zero gradient (``docs/design.md``, "Masking rule").

OpenRLHF's ``PolicyLoss`` / ``ValueLoss`` multiply the per-token loss by ``action_mask`` in ``aggregate_loss``, but
``0 * inf`` and ``0 * nan`` are ``nan``: one non-finite quantity on a passage token (a stale rollout log-prob, the
ratio of a token the engine never sampled) turns the whole gradient into NaN, and ``action_mask=None`` silently
averages over every token. The subclasses below change only their inputs: outside the mask every differentiable
input is replaced by its detached value and every other input by a finite neutral value (advantage 0, log-ratio 0),
then OpenRLHF's own ``forward`` runs; the loss on action tokens is unchanged to the bit.

Empty action masks (a failed retrieval; with ``--train.micro_batch_size 1`` a whole micro-batch or accumulation
window): OpenRLHF's ``masked_mean`` and ``aggregate_loss`` divide 0 by 0 (NaN losses and metrics, which DeepSpeed
skips as an overflow, and a ``ZeroDivisionError`` in ``ppo_train``'s token-weighted metric average). Here an empty
mask gives a zero loss still in the graph and zero metrics of no weight (:func:`safe_masked_mean`,
:func:`safe_aggregate_loss`, :class:`EmptyMaskSafeActorTrainer`).

``install_into_openrlhf()`` makes OpenRLHF's Ray actors use these classes; the cluster entry point registers it
as Ray's ``worker_process_setup_hook`` so it runs in every worker process before models are built.
"""

from typing import Optional

import torch

import openrlhf_search._cpu_compat  # noqa: F401  (before any openrlhf import)
from openrlhf.models.loss import PolicyLoss, ValueLoss, aggregate_loss
from openrlhf.models.utils import masked_mean

# Token weight given to a micro-batch without action tokens in OpenRLHF's metric averages (it must not be 0: the
# average divides by the summed weight). Its metrics are 0, so it moves a token-weighted mean by at most this
# fraction of one token.
EMPTY_MICRO_BATCH_WEIGHT = 1e-6


def _require_mask(action_mask: Optional[torch.Tensor], like: torch.Tensor) -> torch.Tensor:
    if action_mask is None:
        raise ValueError("action_mask is required: without it retrieved tokens would be trained on")
    if action_mask.shape != like.shape:
        raise ValueError(f"action_mask shape {tuple(action_mask.shape)} != per-token tensor {tuple(like.shape)}")
    return action_mask.bool()


def mask_outside(x: Optional[torch.Tensor], mask: torch.Tensor, fill) -> Optional[torch.Tensor]:
    """``x`` on action tokens, ``fill`` (a tensor of x's shape or a scalar) elsewhere; None stays None."""
    if x is None:
        return None
    if not torch.is_tensor(fill):
        fill = torch.full_like(x, float(fill))
    return torch.where(mask, x, fill.to(x.dtype))


def _zero_like_graph(x: torch.Tensor) -> torch.Tensor:
    """A 0-dim zero that depends on ``x`` (zero gradient), so that ``backward()`` works on an empty micro-batch."""
    return x.masked_fill(torch.ones_like(x, dtype=torch.bool), 0.0).sum()


def safe_masked_mean(tensor: torch.Tensor, mask: Optional[torch.Tensor], dim: Optional[int] = None) -> torch.Tensor:
    """OpenRLHF's ``masked_mean`` (``openrlhf.models.utils``), but 0 where the mask is empty instead of 0/0 = NaN.

    Shapes as ``masked_mean``: ``tensor`` and ``mask`` [B, A]; reduces ``dim`` (all when None). Values outside the
    mask are ignored even when non-finite.
    """
    if mask is None:
        return masked_mean(tensor, mask, dim=dim)
    keep = mask.bool()
    count = keep.sum(dim=dim) if dim is not None else keep.sum()
    total = torch.where(keep, tensor, torch.zeros_like(tensor)).sum(dim=dim) if dim is not None else \
        torch.where(keep, tensor, torch.zeros_like(tensor)).sum()
    return torch.where(count > 0, total / count.clamp(min=1), torch.zeros_like(total))


def safe_aggregate_loss(loss: torch.Tensor, loss_mask: torch.Tensor, token_level_loss: bool = True,
                        dp_size: int = 1, batch_num_tokens=None, global_batch_size=None) -> torch.Tensor:
    """OpenRLHF's ``aggregate_loss`` (``openrlhf.models.loss``; token mean or per-sequence mean over the
    optimizer-step window) with an empty ``loss_mask`` giving a graph-connected 0 instead of NaN.

    With a non-empty mask the result is ``aggregate_loss``'s, to the bit (values outside the mask are zeroed first,
    so a non-finite value there cannot reach the sum). An empty mask contributes nothing to the window's sum, so 0
    is the exact value whenever the window has tokens elsewhere, and the only finite one when it has none.
    """
    keep = loss_mask.bool()
    loss = torch.where(keep, loss, torch.zeros_like(loss))
    if not bool(keep.any()):
        return _zero_like_graph(loss)
    return aggregate_loss(loss, loss_mask, token_level_loss=token_level_loss, dp_size=dp_size,
                          batch_num_tokens=batch_num_tokens, global_batch_size=global_batch_size)


class MaskedPolicyLoss(PolicyLoss):
    """OpenRLHF ``PolicyLoss`` (PPO clip, dual clip, GSPO, IS correction) with no gradient outside ``action_mask``.

    Forward arguments and return value are those of ``PolicyLoss.forward``:
    ``(log_probs [B, A], old_log_probs [B, A], advantages [B, A], action_mask [B, A], rollout_log_probs [B, A] or
    None, dp_size, batch_num_tokens, global_batch_size) -> (loss, clip_ratio, ppo_kl, vllm_kl, is_filter_ratio)``.

    Outside the mask: ``log_probs`` is detached, ``old_log_probs`` and ``rollout_log_probs`` are set to that detached
    value (log-ratio 0, importance weight 1) and advantages to 0, so every per-token term there is a finite
    constant. Proximal Policy Optimization, Schulman et al. 2017 eq. 7; masking as Search-R1 sec. 3.1.

    An empty mask (a failed-retrieval sample alone in its micro-batch) returns a zero loss connected to
    ``log_probs`` and zero ``clip_ratio`` / ``ppo_kl`` / ``vllm_kl`` / ``is_filter_ratio`` (never NaN); OpenRLHF
    weights these metrics by the micro-batch's action tokens, so they count for nothing.

    Raises:
        ValueError: ``action_mask`` missing or of another shape than ``log_probs``.
    """

    def forward(
        self,
        log_probs: torch.Tensor,
        old_log_probs: torch.Tensor,
        advantages: torch.Tensor,
        action_mask: Optional[torch.Tensor] = None,
        rollout_log_probs: Optional[torch.Tensor] = None,
        dp_size: int = 1,
        batch_num_tokens: Optional[float] = None,
        global_batch_size: Optional[float] = None,
    ):
        mask = _require_mask(action_mask, log_probs)
        frozen = log_probs.detach()
        out = super().forward(
            mask_outside(log_probs, mask, frozen),
            mask_outside(old_log_probs, mask, frozen),
            mask_outside(advantages, mask, 0.0),
            action_mask=action_mask,
            rollout_log_probs=mask_outside(rollout_log_probs, mask, frozen),
            dp_size=dp_size,
            batch_num_tokens=batch_num_tokens,
            global_batch_size=global_batch_size,
        )
        if bool(mask.any()):
            return out
        loss, *metrics = out
        zero = frozen.new_zeros(())
        return (_zero_like_graph(log_probs), *[None if m is None else zero.clone() for m in metrics])


class MaskedValueLoss(ValueLoss):
    """OpenRLHF ``ValueLoss`` (clipped squared error, PPO eq. 9) with no gradient outside ``action_mask``.

    ``forward(values [B, A], old_values [B, A], returns [B, A], action_mask [B, A], ...) -> scalar``. Outside the
    mask the critic's values are detached and the targets set to them (error 0). An empty mask gives a zero loss
    connected to ``values``.

    Raises:
        ValueError: ``action_mask`` missing or of another shape than ``values``.
    """

    def forward(
        self,
        values: torch.Tensor,
        old_values: torch.Tensor,
        returns: torch.Tensor,
        action_mask: Optional[torch.Tensor] = None,
        dp_size: int = 1,
        batch_num_tokens: Optional[float] = None,
        global_batch_size: Optional[float] = None,
    ) -> torch.Tensor:
        mask = _require_mask(action_mask, values)
        if not bool(mask.any()):
            return _zero_like_graph(values)
        frozen = values.detach()
        return super().forward(
            mask_outside(values, mask, frozen),
            mask_outside(old_values, mask, frozen),
            mask_outside(returns, mask, frozen),
            action_mask=action_mask,
            dp_size=dp_size,
            batch_num_tokens=batch_num_tokens,
            global_batch_size=global_batch_size,
        )


def empty_mask_safe_actor_trainer():
    """``EmptyMaskSafeActorTrainer``: OpenRLHF's ``ActorPPOTrainer`` whose ``training_step`` reports a micro-batch
    without action tokens with the token weight :data:`EMPTY_MICRO_BATCH_WEIGHT` instead of 0.

    ``ActorPPOTrainer.ppo_train`` divides each token-weighted metric by the micro-batch's action-token count summed
    over data-parallel ranks, a Python float: 0 raises ``ZeroDivisionError`` (one failed sample with
    ``--train.micro_batch_size 1``). The metrics of an empty micro-batch are 0 (:class:`MaskedPolicyLoss`,
    :func:`safe_aggregate_loss`), so the tiny weight leaves every average as if the micro-batch were skipped, and
    every rank still reports the same metric keys (the all-reduce needs them). Built on first use: importing
    ``ppo_actor`` pulls DeepSpeed.
    """
    global EmptyMaskSafeActorTrainer
    if EmptyMaskSafeActorTrainer is None:
        from openrlhf.trainer.ray.ppo_actor import ActorPPOTrainer

        class _EmptyMaskSafeActorTrainer(ActorPPOTrainer):
            __doc__ = empty_mask_safe_actor_trainer.__doc__

            def training_step(self, experience, kl_ctl, step, loss_batch_info=None):
                status = super().training_step(experience, kl_ctl, step, loss_batch_info)
                if not status["num_action_tokens"]:
                    status["num_action_tokens"] = EMPTY_MICRO_BATCH_WEIGHT
                return status

        _EmptyMaskSafeActorTrainer.__name__ = _EmptyMaskSafeActorTrainer.__qualname__ = "EmptyMaskSafeActorTrainer"
        EmptyMaskSafeActorTrainer = _EmptyMaskSafeActorTrainer
    return EmptyMaskSafeActorTrainer


EmptyMaskSafeActorTrainer = None


def install_into_openrlhf() -> None:
    """Make OpenRLHF's policy and critic Ray actors build the masked losses and survive empty action masks.

    ``PolicyModelActor`` / ``CriticModelActor`` look up ``PolicyLoss`` / ``ValueLoss`` / ``ActorPPOTrainer`` and the
    helpers ``aggregate_loss`` / ``masked_mean`` (KL loss, entropy, logged means) in their module globals when the
    model is initialised or a step runs, so rebinding those names before ``init_model_from_pretrained`` is enough.
    Idempotent. Used as Ray's ``worker_process_setup_hook`` by ``openrlhf_search.cli.train``.
    """
    import openrlhf.trainer.ray.ppo_actor as ppo_actor
    import openrlhf.trainer.ray.ppo_critic as ppo_critic

    ppo_actor.PolicyLoss = MaskedPolicyLoss
    ppo_critic.ValueLoss = MaskedValueLoss
    ppo_actor.aggregate_loss = safe_aggregate_loss
    ppo_actor.masked_mean = safe_masked_mean
    ppo_critic.masked_mean = safe_masked_mean
    ppo_actor.ActorPPOTrainer = empty_mask_safe_actor_trainer()
