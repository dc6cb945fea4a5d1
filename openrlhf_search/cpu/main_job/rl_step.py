"""One RL update on a batch of search trajectories: experience, advantages and the masked policy/value update.

Kept apart from the rollout loop so that it can be driven by any trajectory source (the search executor in
:mod:`openrlhf_search.cpu.main_job.trainer`, a scripted toy environment in the learning-signal test).

- rewards -> per-sample shaped rewards: :func:`~openrlhf_search.advantages.group_baseline_rewards`
  (``group_norm`` = GRPO, DeepSeekMath eq. 3; ``reinforce_baseline`` = REINFORCE++ baseline, arXiv 2501.03262;
  ``rloo``; ``reinforce``), raw rewards for ``gae``;
- experience: actor and reference log-probs on action tokens, KL (``openrlhf.models.utils.compute_approx_kl``),
  critic values for ``gae``; per-token rewards with OpenRLHF's ``compute_reward`` (outcome reward at the last action
  token, minus ``kl_coef * KL`` unless the KL is a loss);
- advantages: ``gae`` -> :func:`~openrlhf_search.advantages.masked_gae` over action tokens (PPO, Schulman et al.
  2017; Search-R1 sec. 3.1); the others -> returns-to-go over action tokens (masked_gae with V = 0, lambda = 1);
  whitening over action tokens for gae / reinforce / reinforce_baseline, as OpenRLHF 0.11.2 does;
- update: :class:`~openrlhf_search.loss.MaskedPolicyLoss` (PPO clip, eq. 7) + optional KL loss (GRPO) and
  :class:`~openrlhf_search.loss.MaskedValueLoss` (eq. 9), AdamW, micro-batches accumulated into one step per epoch,
  gradient clipping, and a NaN guard that skips a step instead of writing NaN into the weights.
"""

import copy
import logging
from dataclasses import dataclass
from typing import Dict, List, Optional

import torch

import openrlhf_search._cpu_compat  # noqa: F401  (before any openrlhf import)
from openrlhf.models.utils import compute_approx_kl, compute_reward as kl_shaped_rewards, masked_mean

from openrlhf_search.advantages import group_baseline_rewards, masked_gae, masked_whiten
from openrlhf_search.cpu.main_job.critic import ValueCritic
from openrlhf_search.cpu.main_job.device import model_device
from openrlhf_search.cpu.main_job.experience import (Batch, Trajectory, action_log_probs, batched_action_log_probs,
                                              batched_trunk, collate, pad_trunk_states)
from openrlhf_search.cpu.main_job.freeze import trunk_boundary
from openrlhf_search.cpu.main_job.optim import make_adamw
from openrlhf_search.loss import MaskedPolicyLoss, MaskedValueLoss

logger = logging.getLogger(__name__)

WHITENED = ("gae", "reinforce", "reinforce_baseline")


@dataclass
class RLSettings:
    """Hyper-parameters of the update (the CLI flag each one mirrors in brackets).

    Attributes:
        estimator: advantage estimator [--algo.advantage.estimator]: gae, group_norm, reinforce_baseline, rloo,
            reinforce.
        n_samples_per_prompt: group size [--rollout.n_samples_per_prompt].
        gamma, lambd: GAE discount and lambda [--algo.advantage.gamma / lambd]; gamma is 1 for the group estimators.
        no_std_norm: subtract the mean only when whitening [--algo.advantage.no_std_norm].
        kl_coef: KL coefficient [--algo.kl.init_coef]; kl_estimator k1/k2/k3 [--algo.kl.estimator].
        kl_use_loss: KL as a loss (GRPO) instead of a reward penalty [--algo.kl.use_loss].
        actor_lr, critic_lr: AdamW learning rates [--actor.adam.lr / --critic.adam.lr].
        betas, weight_decay: AdamW [--actor.adam.betas / weight_decay].
        eps_clip: PPO clip [--actor.eps_clip]; value_clip [--critic.value_clip]; max_norm [--actor.max_norm].
        micro_batch_size: sequences per forward/backward [--train.micro_batch_size].
        max_epochs: optimiser passes over a rollout batch [--train.max_epochs].
        temperature: rollout temperature; log-probs use logits / temperature [--rollout.temperature].
        max_len: sequences are cut to this many tokens [--data.max_len].
    """

    estimator: str = "reinforce_baseline"
    n_samples_per_prompt: int = 4
    gamma: float = 1.0
    lambd: float = 1.0
    no_std_norm: bool = False
    kl_coef: float = 0.001
    kl_estimator: str = "k3"
    kl_use_loss: bool = False
    actor_lr: float = 1e-4
    critic_lr: float = 1e-3
    betas: tuple = (0.9, 0.95)
    weight_decay: float = 0.0
    eps_clip: float = 0.2
    value_clip: float = 0.2
    max_norm: float = 1.0
    micro_batch_size: int = 4
    max_epochs: int = 1
    temperature: float = 1.0
    max_len: Optional[int] = None

    @classmethod
    def from_args(cls, args) -> "RLSettings":
        """From the nested namespace of :func:`openrlhf_search.cpu.main_job.args.parse_args`."""
        return cls(estimator=args.algo.advantage.estimator, n_samples_per_prompt=args.rollout.n_samples_per_prompt,
                   gamma=args.algo.advantage.gamma, lambd=args.algo.advantage.lambd,
                   no_std_norm=args.algo.advantage.no_std_norm, kl_coef=args.algo.kl.init_coef,
                   kl_estimator=args.algo.kl.estimator, kl_use_loss=args.algo.kl.use_loss,
                   actor_lr=args.actor.adam.lr, critic_lr=args.critic.adam.lr, betas=tuple(args.actor.adam.betas),
                   weight_decay=args.actor.adam.weight_decay, eps_clip=args.actor.eps_clip,
                   value_clip=args.critic.value_clip, max_norm=args.actor.max_norm,
                   micro_batch_size=args.train.micro_batch_size, max_epochs=args.train.max_epochs,
                   temperature=args.rollout.temperature or 1.0, max_len=args.data.max_len)


class RLUpdater:
    """Owns the policy's optimiser, the frozen reference and (for ``gae``) the critic; applies RL updates.

    Args:
        actor: the policy (a ``transformers`` causal LM), updated in place.
        settings: :class:`RLSettings`.
        pad_id: token id used for right padding.
        ref: the reference policy; a frozen deep copy of ``actor`` when None.
        critic: the value critic (``gae`` only); built from the actor's decoder when None.

    The reference, the critic and every tensor of an update live on the actor's device (``--train.device``): a
    reference or critic given on another device (one read from a checkpoint) is moved there.
    """

    def __init__(self, actor, settings: RLSettings, pad_id: int, ref=None, critic: Optional[ValueCritic] = None):
        s = self.settings = settings
        self.actor, self.pad_id = actor, pad_id
        self.device = model_device(actor)
        if ref is None:
            ref = copy.deepcopy(actor)
        self.ref = ref.to(self.device).eval()
        for p in self.ref.parameters():
            p.requires_grad_(False)
        # The reference shares the policy's frozen trunk (a copy made after the warm start, or reloaded from it), so
        # the trunk states cached for the policy serve the reference too.
        self.ref._trunk_boundary = trunk_boundary(actor)
        self.critic = critic if critic is not None or s.estimator != "gae" else ValueCritic.from_policy(actor)
        if self.critic is not None:
            self.critic.to(self.device)  # before its optimiser is built over its parameters
        self.actor_opt = make_adamw([p for p in actor.parameters() if p.requires_grad], lr=s.actor_lr,
                                    betas=tuple(s.betas), weight_decay=s.weight_decay)
        self.critic_opt = make_adamw(self.critic.parameters(), lr=s.critic_lr) if self.critic else None
        self.policy_loss = MaskedPolicyLoss(clip_eps_low=s.eps_clip, clip_eps_high=s.eps_clip)
        self.value_loss = MaskedValueLoss(clip_eps=s.value_clip)

    def optimizers(self) -> dict:
        """{"actor": AdamW[, "critic": AdamW]} (what a checkpoint stores)."""
        out = {"actor": self.actor_opt}
        if self.critic_opt is not None:
            out["critic"] = self.critic_opt
        return out

    # ------------------------------------------------------------------ rewards
    def shape_rewards(self, rewards: torch.Tensor, valid: torch.Tensor) -> torch.Tensor:
        """[N] outcome rewards (N = prompts x group size) -> [N] shaped rewards (group baseline unless gae)."""
        if self.settings.estimator == "gae":
            return torch.where(valid, rewards, torch.zeros_like(rewards))
        return group_baseline_rewards(rewards, self.settings.n_samples_per_prompt, self.settings.estimator,
                                      valid=valid)

    # ------------------------------------------------------------------ experience
    @torch.no_grad()
    def make_experience(self, trajs: List[Trajectory], shaped: torch.Tensor,
                        trunk_states: Optional[List[Optional[torch.Tensor]]] = None) -> dict:
        """Tensors of one rollout batch.

        Args:
            trajs: B trajectories kept for training.
            shaped: [B] shaped outcome rewards (from :meth:`shape_rewards`).
            trunk_states: per trajectory, the frozen trunk's states [len(tokens), H] the rollout engine already
                computed (:meth:`HFEngine.trunk_states`); used when every one is given, else the trunk is run again.
        Returns:
            dict with ``batch`` (:class:`Batch`), and [B, T-1] tensors ``old_logp``, ``ref_logp``, ``kl``,
            ``advantages``, ``returns``, ``values`` (None unless gae). All are 0 outside ``batch.action_mask``.
        """
        s = self.settings
        batch = collate(trajs, self.pad_id, s.max_len, device=self.device)
        mask = batch.action_mask
        trunk = None
        if trunk_states is not None and trunk_boundary(self.actor) > 0 and all(t is not None for t in trunk_states):
            trunk = pad_trunk_states(trunk_states, batch.input_ids.shape[1], device=self.device)
        else:
            trunk = batched_trunk(self.actor, batch, s.micro_batch_size)  # None unless the lower layers are frozen
        old_logp = batched_action_log_probs(self.actor, batch, s.micro_batch_size, s.temperature, trunk=trunk)
        ref_logp = batched_action_log_probs(self.ref, batch, s.micro_batch_size, s.temperature, trunk=trunk)
        kl = compute_approx_kl(old_logp, ref_logp, kl_estimator=s.kl_estimator) * mask
        kl_in_reward = 0.0 if s.kl_use_loss else s.kl_coef
        token_rewards = kl_shaped_rewards(shaped.float().to(self.device), kl_in_reward, kl, action_mask=mask)
        values = None
        if s.estimator == "gae":
            values = torch.zeros(mask.shape, device=mask.device)
            for i in range(0, len(batch), s.micro_batch_size):
                sub = batch.slice(slice(i, i + s.micro_batch_size))
                v = self.critic(sub.input_ids, sub.attention_mask)
                values[i: i + s.micro_batch_size, : v.shape[1]] = v
            values = values * mask
            adv, ret = masked_gae(token_rewards, values, mask, s.gamma, s.lambd)
        else:
            gamma = s.gamma if s.estimator == "reinforce" else 1.0  # OpenRLHF forces gamma 1 for the baselines
            adv, ret = masked_gae(token_rewards, torch.zeros(mask.shape, device=mask.device), mask, gamma, 1.0)
        if s.estimator in WHITENED:
            adv = masked_whiten(adv, mask, scale=not s.no_std_norm)
        return {"batch": batch, "trunk": trunk, "old_logp": old_logp, "ref_logp": ref_logp, "kl": kl, "values": values,
                "advantages": adv.float() * mask, "returns": ret.float()}

    # ------------------------------------------------------------------ update
    def update(self, exp: dict) -> Dict[str, float]:
        """Optimise the policy (and critic) on one experience batch.

        Returns:
            {"policy_loss", "kl_loss", "value_loss", "clip_ratio", "ppo_kl", "entropy", "grad_norm",
             "critic_grad_norm", "nan_skipped"}: means over epochs, per action token.
        """
        s = self.settings
        batch: Batch = exp["batch"]
        n_tokens = float(batch.action_mask.sum().item())
        stats = dict.fromkeys(("policy_loss", "kl_loss", "value_loss", "clip_ratio", "ppo_kl", "entropy",
                               "grad_norm", "critic_grad_norm"), 0.0)
        stats["nan_skipped"] = 0
        if n_tokens == 0:
            return stats
        self.actor.train()
        epochs = max(1, s.max_epochs)
        for _ in range(epochs):
            self.actor_opt.zero_grad(set_to_none=True)
            if self.critic_opt is not None:
                self.critic_opt.zero_grad(set_to_none=True)
            finite = True
            for i in range(0, len(batch), s.micro_batch_size):
                rows = slice(i, i + s.micro_batch_size)
                sub = batch.slice(rows)
                t, m = sub.action_mask.shape[1], sub.action_mask
                trunk = exp.get("trunk")
                logp, ent = action_log_probs(self.actor, sub, s.temperature, with_entropy=True,
                                             trunk=None if trunk is None else trunk[rows, :t + 1])
                loss, clip_ratio, ppo_kl, _, _ = self.policy_loss(
                    logp, exp["old_logp"][rows, :t], exp["advantages"][rows, :t], action_mask=m,
                    batch_num_tokens=n_tokens)
                total = loss
                if s.kl_use_loss and s.kl_coef > 0:
                    kl = compute_approx_kl(logp, exp["ref_logp"][rows, :t], kl_estimator=s.kl_estimator)
                    kl_loss = (kl * m).sum() / n_tokens
                    total = total + s.kl_coef * kl_loss
                    stats["kl_loss"] += float(kl_loss.detach()) / epochs
                if not torch.isfinite(total):
                    finite = False
                    break
                total.backward()
                share = float(m.sum()) / n_tokens
                stats["policy_loss"] += float(loss.detach()) / epochs
                stats["clip_ratio"] += float(clip_ratio) * share / epochs
                stats["ppo_kl"] += float(ppo_kl) * share / epochs
                stats["entropy"] += float((ent.detach() * m).sum()) / n_tokens / epochs
                if self.critic is not None:
                    v = self.critic(sub.input_ids, sub.attention_mask)
                    vloss = self.value_loss(v, exp["values"][rows, :t], exp["returns"][rows, :t], action_mask=m,
                                            batch_num_tokens=n_tokens)
                    if not torch.isfinite(vloss):
                        finite = False
                        break
                    vloss.backward()
                    stats["value_loss"] += float(vloss.detach()) / epochs
            trainable = [p for p in self.actor.parameters() if p.requires_grad]
            gnorm = torch.nn.utils.clip_grad_norm_(trainable, s.max_norm) if finite else None
            if gnorm is None or not torch.isfinite(gnorm):
                stats["nan_skipped"] += 1
                self.actor_opt.zero_grad(set_to_none=True)
                if self.critic_opt is not None:
                    self.critic_opt.zero_grad(set_to_none=True)
                logger.warning("non-finite loss or gradient: optimiser step skipped")
                continue
            stats["grad_norm"] = float(gnorm)
            self.actor_opt.step()
            if self.critic_opt is not None:
                cn = torch.nn.utils.clip_grad_norm_(self.critic.parameters(), s.max_norm)
                if torch.isfinite(cn):
                    self.critic_opt.step()
                    stats["critic_grad_norm"] = float(cn)
        self.actor.eval()
        return stats

    @staticmethod
    def batch_metrics(exp: dict) -> Dict[str, float]:
        """Response length (action tokens), total length, mean per-sample KL and |advantage| of a batch."""
        batch, mask = exp["batch"], exp["batch"].action_mask
        return {"response_length": float(mask.sum(-1).float().mean()),
                "total_length": float(batch.attention_mask.sum(-1).float().mean()),
                "kl": float(masked_mean(exp["kl"], mask, dim=-1).mean()),
                "advantage_abs": float(masked_mean(exp["advantages"].abs(), mask))}
