"""Advantage estimators for search trajectories: masked GAE and group baselines (pure tensor functions).

A search trajectory interleaves tokens the policy sampled (``action_mask`` 1) with tokens the environment wrote
(retrieved-document blocks, invalid-action messages; ``action_mask`` 0). ``docs/design.md``, "Masking rule": the
environment tokens are not decisions of the policy, so the MDP's time steps are the action tokens only.

* :func:`masked_gae`: GAE (arXiv 1506.02438, eq. 16) over the action tokens only: an action token bootstraps from
  the *next action token*, where OpenRLHF 0.11.2's ``get_advantages_and_returns`` bootstraps from 0 before a document
  block and decays the credit across the passage (Search-R1, arXiv 2503.09516 sec. 3.1, "retrieved token masking").
* :func:`group_baseline_rewards`: OpenRLHF 0.11.2's group estimators (``compute_advantages_and_returns``), plus a
  ``valid`` mask and two guards against float residue.
* :func:`masked_whiten`: OpenRLHF's ``masked_normalize`` over action tokens only.
"""

from typing import Optional, Tuple

import torch

import openrlhf_search._cpu_compat  # noqa: F401  (before any openrlhf import)
from openrlhf.models.utils import masked_normalize

GROUP_ESTIMATORS = ("group_norm", "reinforce_baseline", "dr_grpo", "rloo", "reinforce")

# OpenRLHF 0.11.2 divides by (std + 1e-9) for group_norm; kept identical so both paths agree to the bit
# whenever the group std is at least GROUP_NORM_STD_FLOOR.
GROUP_NORM_EPS = 1e-9

# Rewards (or advantages) count as equal when their spread max - min is at most EQUAL_ATOL + EQUAL_RTOL * max|x|.
# Why: equal float32 values that cannot be represented exactly (0.8, -1.2, 0.2: R1-Searcher's F1 and format
# rewards) leave a mean residue of ~1 ulp (6e-8 for eight 0.8s). OpenRLHF's group_norm divides that residue by a
# std of ~1e-8, which passes its 1e-9 guard: eight 0.8s got -0.921 each. 1e-6 relative is ~8
# float32 ulps (2^-23 = 1.2e-7), enough for the same value reached by two float paths, far below any reward
# difference that means something; the absolute part covers rewards near 0.
EQUAL_RTOL = 1e-6
EQUAL_ATOL = 1e-6

# group_norm leaves a group unnormalised (r - mean) when its unbiased std is below this floor: the floor NVIDIA
# NeMo-RL chose for the same fp32-residue fault (PR #4161, "STD_FLOOR = 1e-3 (rewards are O(1); a genuine std
# below that carries no usable signal). Groups under the floor keep the unnormalized reward - baseline").
# Without it a spread just above the equality tolerance would still be blown up to +-1 by the division.
GROUP_NORM_STD_FLOOR = 1e-3


def equal_within_tol(values: torch.Tensor, mask: torch.Tensor, dim: int = -1) -> torch.Tensor:
    """Whether the masked entries of ``values`` are all equal within float tolerance, along ``dim``.

    Equal means ``max - min <= EQUAL_ATOL + EQUAL_RTOL * max|x|`` over the masked entries (see the constants for
    why). The spread of identical floats is exactly 0, so identical inputs are always equal however many there are.

    Args:
        values: float tensor, e.g. [G, n] rewards of G prompt groups.
        mask: same shape, nonzero/True on the entries that count.
        dim: the dimension reduced.

    Returns:
        bool tensor with ``dim`` kept as size 1; True also where fewer than two entries are masked.
    """
    m = mask.to(torch.bool)
    big = torch.finfo(values.dtype).max
    hi = torch.where(m, values, torch.full_like(values, -big)).amax(dim, keepdim=True)
    lo = torch.where(m, values, torch.full_like(values, big)).amin(dim, keepdim=True)
    scale = torch.where(m, values.abs(), torch.zeros_like(values)).amax(dim, keepdim=True)
    spread = (hi - lo).clamp(min=0)
    return (spread <= EQUAL_ATOL + EQUAL_RTOL * scale) | (m.sum(dim, keepdim=True) < 2)


def _check_same_shape(**tensors: torch.Tensor) -> None:
    shapes = {name: tuple(t.shape) for name, t in tensors.items()}
    if len(set(shapes.values())) != 1:
        raise ValueError(f"shape mismatch: {shapes}")
    for name, t in tensors.items():
        if t.dim() != 2:
            raise ValueError(f"{name} must be 2-D [batch, tokens], got shape {tuple(t.shape)}")


def compact_action_tokens(action_mask: torch.Tensor) -> Tuple[torch.Tensor, torch.Tensor]:
    """Positions of the action tokens of each row, left-aligned.

    Args:
        action_mask: [B, T], nonzero/True on action tokens.

    Returns:
        ``order`` [B, T] long: a permutation of 0..T-1 per row whose first ``n_b`` entries are the action positions
        of row b in increasing order; ``valid`` [B, K] bool with K = max_b n_b: True where ``order[:, :K]`` is an
        action token.
    """
    mask = action_mask.bool()
    # A stable sort of (not action) puts action positions first, in their original order.
    order = torch.sort((~mask).to(torch.int8), dim=1, stable=True).indices
    counts = mask.sum(dim=1)
    k = int(counts.max().item()) if mask.numel() else 0
    valid = torch.arange(k, device=mask.device).unsqueeze(0) < counts.unsqueeze(1)
    return order, valid


@torch.no_grad()
def masked_gae(
    rewards: torch.Tensor,
    values: torch.Tensor,
    action_mask: torch.Tensor,
    gamma: float,
    lambd: float,
) -> Tuple[torch.Tensor, torch.Tensor]:
    """Generalised advantage estimation over action tokens only.

    For the action tokens a_0 < a_1 < ... < a_{n-1} of one sequence (environment tokens skipped):
        delta_k = r[a_k] + gamma * V[a_{k+1}] - V[a_k]        (V[a_n] = 0: the episode ends)
        A_k     = delta_k + gamma * lambd * A_{k+1}            (A_n = 0)
        R_k     = A_k + V[a_k]                                  (the value target)
    Rewards and values at non-action positions are ignored (a KL penalty computed on passage tokens, a critic's
    output on a document block); advantages and returns are exactly 0 there. With a single contiguous action span
    this equals OpenRLHF's ``get_advantages_and_returns`` on the action tokens.

    Vectorised: action tokens are gathered left-aligned, the recursion runs over the K = max action count columns
    (one vector operation per column), and the results are scattered back.

    Args:
        rewards: [B, T] per-token rewards (outcome reward at the last action token plus any per-token KL penalty).
        values: [B, T] critic values V(s_t).
        action_mask: [B, T] bool or 0/1, 1 on tokens the policy sampled.
        gamma: discount per action token, in [0, 1].
        lambd: GAE lambda, in [0, 1].

    Returns:
        (advantages [B, T], returns [B, T]) in the dtype of ``values`` promoted with float32.

    Raises:
        ValueError: shapes differ or are not 2-D, or gamma/lambd outside [0, 1].
    """
    _check_same_shape(rewards=rewards, values=values, action_mask=action_mask)
    if not (0.0 <= gamma <= 1.0) or not (0.0 <= lambd <= 1.0):
        raise ValueError(f"gamma and lambd must be in [0, 1], got gamma={gamma}, lambd={lambd}")
    dtype = torch.promote_types(values.dtype, torch.float32)
    order, valid = compact_action_tokens(action_mask)
    k = valid.shape[1]
    advantages = torch.zeros(values.shape, dtype=dtype, device=values.device)
    returns = torch.zeros_like(advantages)
    if k == 0:
        return advantages, returns

    idx = order[:, :k]
    r = torch.gather(rewards.to(dtype), 1, idx) * valid
    v = torch.gather(values.to(dtype), 1, idx) * valid  # padding columns read as V = 0: the episode has ended
    adv = torch.zeros_like(v)
    last = torch.zeros(v.shape[0], dtype=dtype, device=v.device)
    for j in reversed(range(k)):
        next_v = v[:, j + 1] if j + 1 < k else torch.zeros_like(last)
        delta = r[:, j] + gamma * next_v - v[:, j]
        last = torch.where(valid[:, j], delta + gamma * lambd * last, torch.zeros_like(last))
        adv[:, j] = last
    ret = (adv + v) * valid
    advantages.scatter_(1, idx, adv)
    returns.scatter_(1, idx, ret)
    return advantages, returns


@torch.no_grad()
def group_baseline_rewards(
    rewards: torch.Tensor,
    group_size: int,
    estimator: str,
    valid: Optional[torch.Tensor] = None,
) -> torch.Tensor:
    """Baseline-subtracted outcome rewards within prompt groups (OpenRLHF 0.11.2 definitions).

    ``rewards`` holds ``group_size`` consecutive samples per prompt. Per group with rewards r_1..r_n:
        group_norm:          (r_i - mean) / (std + 1e-9), std unbiased (GRPO, DeepSeekMath eq. 3);
                             r_i - mean when std < GROUP_NORM_STD_FLOOR (1e-3, NeMo-RL PR #4161)
        reinforce_baseline:  r_i - mean (REINFORCE++-baseline); ``dr_grpo`` is the same shaping
        rloo:                r_i - (sum_{j != i} r_j) / (n - 1)
        reinforce:           r_i (no baseline)
    A group whose valid rewards are equal within :func:`equal_within_tol` gets exactly 0 under every baselined
    estimator (it says nothing about which sample was better; see ``EQUAL_RTOL``). With ``valid`` given, the
    statistics use the valid samples of each group only (n = number valid) and invalid samples get 0. A group with a
    single valid sample gets 0 for the baselined estimators (no baseline can be formed, as OpenRLHF refuses
    n_samples_per_prompt = 1 for them).

    Args:
        rewards: [N] float, N a multiple of group_size.
        group_size: samples per prompt (``--rollout.n_samples_per_prompt``).
        estimator: one of GROUP_ESTIMATORS.
        valid: optional [N] bool, False for samples left out of training.

    Returns:
        [N] float32 (or wider) shaped rewards.

    Raises:
        ValueError: unknown estimator, N not a multiple of group_size, group_size < 1, non-finite rewards among
            the valid samples (a NaN reward would poison the whole group silently).
    """
    if estimator not in GROUP_ESTIMATORS:
        raise ValueError(f"unknown advantage estimator {estimator!r}; expected one of {GROUP_ESTIMATORS}")
    if rewards.dim() != 1:
        raise ValueError(f"rewards must be 1-D [N], got shape {tuple(rewards.shape)}")
    if group_size < 1 or rewards.numel() % group_size:
        raise ValueError(f"{rewards.numel()} rewards cannot be split into groups of {group_size}")
    dtype = torch.promote_types(rewards.dtype, torch.float32)
    r = rewards.to(dtype)
    ok = torch.ones_like(r, dtype=torch.bool) if valid is None else valid.to(torch.bool).reshape(r.shape)
    if not torch.isfinite(r[ok]).all():
        raise ValueError(f"non-finite reward among valid samples: {r[ok & ~torch.isfinite(r)].tolist()}")
    r = torch.where(ok, r, torch.zeros_like(r))
    if estimator == "reinforce":
        return r

    g = r.reshape(-1, group_size)
    m = ok.reshape(-1, group_size).to(dtype)
    n = m.sum(-1, keepdim=True)
    total = (g * m).sum(-1, keepdim=True)
    if estimator == "rloo":
        baseline = (total - g) / (n - 1).clamp(min=1)
        out = g - baseline
    else:
        mean = total / n.clamp(min=1)
        out = g - mean
        if estimator == "group_norm":
            std = ((((g - mean) * m) ** 2).sum(-1, keepdim=True) / (n - 1).clamp(min=1)).sqrt()
            out = torch.where(std >= GROUP_NORM_STD_FLOOR, out / (std + GROUP_NORM_EPS), out)
    informative = (m > 0) & (n > 1) & ~equal_within_tol(g, m)
    out = torch.where(informative, out, torch.zeros_like(out))
    return out.reshape(-1)


@torch.no_grad()
def zero_padded_group_norm(rewards: torch.Tensor, group_size: int,
                           valid: Optional[torch.Tensor] = None) -> torch.Tensor:
    """R1-Searcher's released Llama stage-1 ``group_norm``: each prompt's samples normalised in two rows of
    ``group_size`` values, ``group_size / 2`` of its samples and as many zeros.

    Why that shape: ``train/reward_server_llama_stage1.py:226`` returns ``[score, 0]`` per sample, the vendored
    ``train_ppo_ray.py:21-22`` ``reward_fn`` keeps the [M, 2] tensor, and ``experience_maker.py:564-567`` normalises
    the concatenated [N, 2] rewards with ``reshape(-1, n_samples_per_prompt)`` (rows of 16 values = 8 consecutive
    samples' scores and their 8 zeros, ``std`` unbiased, ``+ 1e-9``); with ``--micro_rollout_batch_size 1``
    (``scripts/llama_reinforce_plus_train_stage1.sh:58``) each sample's reward is the first value of its own pair
    (``models/utils.py:74-77``), its normalised score. A group whose 8 samples all score s > 0 gets
    s / 2 / std([s] * 8 + [0] * 8) = +0.968 each instead of 0.

    Args:
        rewards: [N] float, ``group_size`` consecutive samples per prompt (prompt order), N a multiple of it.
        group_size: samples per prompt; even.
        valid: optional [N] bool; invalid samples get 0 and leave their row (its zeros stay).
    Returns:
        [N] float32 (or wider) shaped rewards.
    Raises:
        ValueError: odd ``group_size``, N not a multiple of it, non-finite rewards among the valid samples.
    """
    if group_size < 2 or group_size % 2:
        raise ValueError(f"zero-padded group_norm needs an even group size, got {group_size}")
    base = group_baseline_rewards(rewards, group_size, "reinforce", valid=valid)  # checks, zeroes invalid samples
    dtype = base.dtype
    half = group_size // 2
    ok = torch.ones_like(base, dtype=torch.bool) if valid is None else valid.to(torch.bool).reshape(base.shape)
    g = base.reshape(-1, half)
    m = ok.reshape(-1, half).to(dtype)
    n = m.sum(-1, keepdim=True) + half  # the row's valid samples and its zeros
    mean = (g * m).sum(-1, keepdim=True) / n
    var = ((((g - mean) * m) ** 2).sum(-1, keepdim=True) + half * mean ** 2) / (n - 1)
    out = (g - mean) / (var.sqrt() + GROUP_NORM_EPS)
    return torch.where(m > 0, out, torch.zeros_like(out)).reshape(-1)


@torch.no_grad()
def masked_whiten(x: torch.Tensor, mask: torch.Tensor, scale: bool = True, eps: float = 1e-8) -> torch.Tensor:
    """Whiten ``x`` with the mean and (population) variance of its masked entries, all entries pooled.

    This is the advantage normalisation of OpenRLHF's ``compute_advantages_and_returns`` restricted to action
    tokens (via OpenRLHF's ``masked_normalize``); entries outside the mask become 0. When the masked entries are
    all equal within :func:`equal_within_tol` the result is exactly 0: their float mean leaves a residue of ~1 ulp,
    which the variance floor ``eps`` would scale by 1/sqrt(eps) = 1e4 (eight 0.8s whitened to -6e-4 each).

    Args:
        x: any shape, e.g. [B, T] advantages.
        mask: same shape, 1 on action tokens.
        scale: False to subtract the mean only (``--algo.advantage.no_std_norm``).
        eps: variance floor.

    Returns:
        Tensor of x's shape, float32 or wider. All zeros when the mask is empty or its entries are equal.

    Raises:
        ValueError: shapes differ.
    """
    if x.shape != mask.shape:
        raise ValueError(f"shape mismatch: x {tuple(x.shape)} vs mask {tuple(mask.shape)}")
    dtype = torch.promote_types(x.dtype, torch.float32)
    flat = x.reshape(1, -1).to(dtype)
    m = mask.reshape(1, -1).to(dtype)
    if equal_within_tol(flat, m).all():
        return torch.zeros(x.shape, dtype=dtype, device=x.device)
    if scale:
        out = masked_normalize(flat, m, dim=1, eps=eps)
    else:
        mean = (flat * m).sum() / m.sum().clamp(min=1)
        out = (flat - mean) * m
    return out.reshape(x.shape)
