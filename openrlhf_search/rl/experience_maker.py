"""Experience maker for search trajectories: OpenRLHF's ``RemoteExperienceMaker`` with masked credit assignment.

What changes against OpenRLHF 0.11.2 (everything else, model forwards included, is inherited):

* **Masked GAE** (``--algo.advantage.estimator gae``): :func:`openrlhf_search.rl.advantages.masked_gae` recurses
  over action tokens only (``docs/design.md``, "Masking rule"; Search-R1 arXiv 2503.09516 sec. 3.1); the
  REINFORCE-family returns use the same recursion with V = 0, so a discount < 1 applies per action token.
* **Masked KL and whitening**: the per-token KL enters the reward on action tokens only, and advantages are whitened
  with statistics of action tokens only (0 elsewhere).
* **Retrieval failures left out**: a sample whose executor reports ``extra_logs["retrieval_failed"] = 1`` says
  nothing about the policy and gets an all-zero action mask after the model forwards: no loss term (every OpenRLHF
  loss aggregates over the mask), no weight in its group's baseline nor in the search statistics. Above
  ``--search.max_failed_fraction`` of a batch, training stops with :class:`RetrievalFailureLimit`.
* **Trajectory length = tokens the policy sampled** (:func:`sampled_lengths`), for the length penalties and the
  ``rollout/response_length_mean`` log; the overlong penalty's budget is the trajectory's
  (:mod:`openrlhf_search.env.length_penalty`).
* **Dynamic filtering on the training reward's spread** (:class:`SearchSamplesGenerator`): a prompt group is kept
  when at least two of its samples retrieved successfully and their training rewards differ.
* **Reward-stage switch**: samples buffered under stage 1 are dropped when stage 2 starts
  (:meth:`SearchSamplesGenerator.discard_buffer`).
* **Per-token policy versions** (asynchronous training; :mod:`openrlhf_search.env.policy_versions`).
* **Search statistics**: the executor's ``extra_logs`` arrive in ``Experience.info``; every sample is given every
  key (:func:`fill_missing_info`) and :func:`search_rollout_stats` turns them into ``search/*`` curves.
"""

import itertools
from typing import Dict, List, Optional

import torch

import openrlhf_search._cpu_compat  # noqa: F401  (before any openrlhf import)
from openrlhf.models.utils import compute_reward
from openrlhf.trainer.ppo_utils.experience import Experience
from openrlhf.trainer.ppo_utils.experience_maker import RemoteExperienceMaker
from openrlhf.trainer.ppo_utils.length_penalty import apply_length_penalties
from openrlhf.trainer.ppo_utils.samples_generator import SamplesGenerator
from openrlhf.utils.logging_utils import init_logger

from openrlhf_search.env import policy_versions
from openrlhf_search.rl.advantages import group_baseline_rewards, masked_gae, masked_whiten, zero_padded_group_norm
from openrlhf_search.env.length_penalty import args_with_overlong_budget

logger = init_logger(__name__)

FAILED_KEY = "retrieval_failed"
# extra_logs of openrlhf_search.env.agent (docs/ARCHITECTURE.md); plotted as search/<key>_mean over trained samples.
SEARCH_STAT_KEYS = (
    "turns", "turns_cut", "valid_searches", "queries", "answer_present", "truncated", "retrieval_failures",
    "response_tokens", "obs_tokens", "em", "f1", "cover_em", "format_ok", "retrieval_failovers", "context_full",
    "tool_calls", "invalid_tool_calls",
)
GROUP_BASELINE_ESTIMATORS = ("group_norm", "reinforce_baseline", "dr_grpo", "rloo")
CUMULATIVE_ESTIMATORS = GROUP_BASELINE_ESTIMATORS + ("reinforce", "flash_reinforce")
WHITENED_ESTIMATORS = ("gae", "reinforce", "reinforce_baseline")  # as OpenRLHF 0.11.2


class RetrievalFailureLimit(RuntimeError):
    """More than ``--search.max_failed_fraction`` of a rollout batch had a failed retrieval; the message is one line
    (``openrlhf_search.cli.train`` prints it as the run's last line)."""


def failed_mask(experience: Experience) -> torch.Tensor:
    """[B] bool: samples whose retrieval failed (``info["retrieval_failed"] > 0.5``); all False without the key."""
    value = experience.info.get(FAILED_KEY)
    if value is not None:
        return torch.as_tensor(value).reshape(-1).float().cpu() > 0.5
    for batch in (experience.action_mask, experience.sequences):
        if batch is not None:
            return torch.zeros(len(batch), dtype=torch.bool)
    return torch.zeros(len(experience.prompts), dtype=torch.bool)


def fill_missing_info(samples: List[Experience], default: float = 0.0) -> List[str]:
    """Give every sample every ``info`` key seen in the batch (OpenRLHF concatenates info per key, and a key absent
    from one sample would misalign the others). Returns the keys that were missing somewhere."""
    keys = set(itertools.chain.from_iterable(s.info.keys() for s in samples))
    missing = set()
    for s in samples:
        n = len(s.sequences)
        for k in keys:
            if k not in s.info:
                s.info[k] = torch.full((n,), default)
                missing.add(k)
    return sorted(missing)


def sampled_lengths(experience: Experience) -> torch.Tensor:
    """[B] long: tokens the policy sampled per sample (the action-mask sum), the length of a search trajectory.

    OpenRLHF 0.11.2 (``samples_generator._process_response_into_experience``) takes last minus first action
    position + 1, which counts every documents block in between: 70 sampled tokens around one 500-token block are
    570 there and 70 here.
    """
    if experience.action_mask is None:
        raise ValueError("sampled_lengths: the experience has no action_mask")
    return experience.action_mask.reshape(len(experience.action_mask), -1).long().sum(-1).cpu()


def valid_rollout_stats(experiences: List[Experience]) -> Dict[str, float]:
    """OpenRLHF's ``rollout/*`` statistics (``PPOTrainer._compute_rollout_stats``) over samples whose retrieval
    did not fail: ``rollout/reward_mean``, ``reward_std``, ``response_length_mean`` (tokens the policy sampled),
    ``truncated_rate`` and ``num_samples`` (the number of samples trained on). Returns {} when no sample is valid
    or there is no reward."""
    if not experiences or not all("reward" in e.info for e in experiences):
        return {}
    keep = torch.cat([~failed_mask(e) for e in experiences])
    rewards = torch.cat([torch.as_tensor(e.info["reward"]).reshape(-1).float().cpu() for e in experiences])[keep]
    if rewards.numel() == 0:
        return {"rollout/num_samples": 0.0}
    stats = {
        "rollout/reward_mean": rewards.mean().item(),
        "rollout/reward_std": rewards.std().item() if rewards.numel() > 1 else 0.0,
        "rollout/num_samples": float(rewards.numel()),
    }
    if all(e.response_length is not None for e in experiences):
        lengths = torch.cat([e.response_length.reshape(-1).float().cpu() for e in experiences])[keep]
        stats["rollout/response_length_mean"] = lengths.mean().item()
    if all(e.truncated is not None for e in experiences):
        truncated = torch.cat([e.truncated.reshape(-1).float().cpu() for e in experiences])[keep]
        stats["rollout/truncated_rate"] = truncated.mean().item()
    return stats


def group_has_signal(group: List[Experience], min_spread: float = 1e-6) -> bool:
    """Dynamic-filtering rule for one prompt group (DAPO's dynamic sampling, arXiv 2503.14476 sec. 3.2, on the
    reward that is trained on): True when at least two samples have a successful retrieval and their training
    rewards (``Experience.rewards``, the executor's reward of the active scheme) differ by more than
    ``min_spread``. Samples whose retrieval failed are left out. A group with no spread has zero advantage under
    every group baseline, so it carries no signal; the answer score (``Experience.scores``) is not used: in
    R1-Searcher's stage 1 it is 0 for most samples while the retrieval/format reward varies.
    """
    rewards = []
    for exp in group:
        failed = failed_mask(exp)
        for i in range(len(failed)):
            if not failed[i]:
                rewards.append(float(torch.as_tensor(exp.rewards).reshape(-1)[i]))
    return len(rewards) >= 2 and max(rewards) - min(rewards) > min_spread


class SearchSamplesGenerator(SamplesGenerator):
    """OpenRLHF's ``SamplesGenerator`` with the search trajectory length and the search dynamic filter.

    * every sample's ``response_length`` is :func:`sampled_lengths` (also what eval logs read);
    * with ``--algo.dynamic_filtering_enable`` a prompt group is kept by :func:`group_has_signal` (training-reward
      spread over samples whose retrieval succeeded) instead of OpenRLHF's mean answer score inside
      ``--algo.dynamic_filtering_range`` (that range is not read). Filtered prompts are replaced by new ones, as
      OpenRLHF does: the parent's generation runs again (without its own filter) for as many prompts as were
      dropped, until enough groups pass or the data runs out;
    * the tokenizer crosses Ray once per rollout process, not with every prompt (:meth:`_dispatch_prompts_to_vllm`).
    """

    _stop_after_discard = False
    _tokenizer_handle = None

    def _dispatch_prompts_to_vllm(self, prompts, labels, **generate_kwargs):
        """The parent's dispatch with the tokenizer sent as a :class:`~openrlhf_search.env.tokenizer_handle.
        TokenizerHandle` (~400 bytes per call; each rollout actor fetches and unpickles the tokenizer once and
        reuses that object for every later prompt) instead of the pickled tokenizer with every prompt. Without an
        initialised Ray (unit tests with fake engines) the tokenizer goes as it is."""
        import ray

        if self.tokenizer is None or not ray.is_initialized():
            return super()._dispatch_prompts_to_vllm(prompts, labels, **generate_kwargs)
        from openrlhf_search.env.tokenizer_handle import TokenizerHandle

        tokenizer = self.tokenizer
        if self._tokenizer_handle is None or self._tokenizer_handle.tokenizer is not tokenizer:
            self._tokenizer_handle = TokenizerHandle(tokenizer)
        self.tokenizer = self._tokenizer_handle  # read by the parent only as generate_responses' hf_tokenizer
        try:
            return super()._dispatch_prompts_to_vllm(prompts, labels, **generate_kwargs)
        finally:
            self.tokenizer = tokenizer

    def discard_buffer(self) -> int:
        """Drop the samples generated but not yet trained on (``_sample_buffer``, filled when
        ``--rollout.vllm_generate_batch_size`` exceeds ``--rollout.batch_size``); returns how many.

        Called when the reward stage switches: those samples were scored, and dynamically
        filtered, under the previous stage's reward. They are dropped rather than re-scored: re-scoring would need
        the executor's decoding and reward configuration in the trainer process and would also have to redo the
        group filter; the switch happens once per run and costs at most one generation batch. When the prompt
        iterator was already exhausted, the next :meth:`generate_samples` call reports the end of the episode
        (the parent would otherwise start the data over inside the same episode).
        """
        buffer = getattr(self, "_sample_buffer", None) or []
        n = len(buffer)
        if n:
            self._sample_buffer = []
            if getattr(self, "_dataloader_iter", None) is None:
                self._stop_after_discard = True
        return n

    record_policy_versions = False  # async mode: trajectories carry the policy version they ran under

    def generate_samples(self, **generate_kwargs):
        """The parent's batch, with the retrieval figures of its generation attached (:mod:`step_timing`)."""
        if self._stop_after_discard:
            self._stop_after_discard = False
            return [], None, 0, True
        from openrlhf_search.rl import step_timing

        if getattr(self, "_rollout_timer", None) is None:
            self._rollout_timer = step_timing.RolloutTimer(self.vllm_engines, self.record_policy_versions)
        self._rollout_timer.start()
        samples, pass_rate, consumed, exhausted = super().generate_samples(**generate_kwargs)
        step_timing.attach(samples, self._rollout_timer.finish())
        return self._even_share(samples, generate_kwargs), pass_rate, consumed, exhausted

    def _even_share(self, samples, generate_kwargs):
        """``samples`` cut to whole micro-batches on every data-parallel rank and whole train batches
        (:mod:`openrlhf_search.rl.even_batches`: a partial last batch would leave ranks waiting inside collectives)."""
        from openrlhf_search.rl.even_batches import even_share, unit_of

        unit = unit_of(self.args, self._group_size(generate_kwargs))
        kept, dropped = even_share(samples, unit)
        if dropped:
            self.dropped_samples = getattr(self, "dropped_samples", 0) + dropped
            logger.warning(f"short rollout batch: {len(samples)} samples do not fill whole micro-batches on every "
                           f"rank and whole train batches (units of {unit}); training on {len(kept)}, dropping "
                           f"{dropped} ({self.dropped_samples} this run)")
        return kept

    def _process_response_into_experience(self, response, **generate_kwargs) -> Experience:
        experience = super()._process_response_into_experience(response, **generate_kwargs)
        experience.response_length = sampled_lengths(experience)
        if response.get("action_versions"):  # per-token policy versions (async training, policy_versions)
            setattr(experience, policy_versions.TENSOR_ATTR, policy_versions.versions_tensor(
                response["action_versions"], response["action_ranges"], len(response["observation_tokens"]),
                generate_kwargs.get("max_len", 2048)))
        return experience

    def _group_size(self, generate_kwargs) -> int:
        return int(generate_kwargs.get("n_samples_per_prompt", self.args.rollout.n_samples_per_prompt))

    def _generate_vllm(self, dataloader_iter, num_prompts: int, dynamic_filtering, **generate_kwargs):
        if not dynamic_filtering:
            return super()._generate_vllm(dataloader_iter, num_prompts, False, **generate_kwargs)
        n = self._group_size(generate_kwargs)
        accepted: List[Experience] = []
        consumed, kept, exhausted = 0, 0, False
        while kept < num_prompts and not exhausted:
            experiences, used, exhausted = super()._generate_vllm(
                dataloader_iter, num_prompts - kept, False, **generate_kwargs)
            consumed += used
            if len(experiences) % n:
                raise RuntimeError(f"dynamic filtering: {len(experiences)} samples are not groups of {n}")
            for start in range(0, len(experiences), n):
                group = experiences[start:start + n]
                if group_has_signal(group):
                    accepted.extend(group)
                    kept += 1
                else:
                    logger.info("Filtered out a group without training-reward spread: rewards="
                                f"{[round(float(e.rewards.reshape(-1)[0]), 3) for e in group]}")
            if used == 0:
                break
        return accepted, consumed, exhausted


def search_rollout_stats(experiences: List[Experience]) -> Dict[str, float]:
    """Search statistics of one rollout batch for the trainer's logs (paper figures: R1-Searcher fig. 3,
    Search-R1 fig. 2: reward, response length, turns, valid searches).

    Returns ``search/retrieval_failed_rate`` over all samples, ``search/num_trained_samples`` and, over samples that
    were trained on, ``search/<key>_mean`` for every key of :data:`SEARCH_STAT_KEYS` present plus
    ``search/answer_rate`` (= mean of ``answer_present``) and ``search/reward_mean``.
    """
    if not experiences:
        return {}
    failed = torch.cat([failed_mask(e) for e in experiences])
    keep = ~failed
    stats = {
        "search/retrieval_failed_rate": failed.float().mean().item(),
        "search/num_trained_samples": float(keep.sum().item()),
    }
    if not keep.any():
        return stats
    for key in SEARCH_STAT_KEYS + ("reward",):
        if all(key in e.info for e in experiences):
            values = torch.cat([torch.as_tensor(e.info[key]).reshape(-1).float().cpu() for e in experiences])
            if values.numel() == keep.numel():
                stats[f"search/{key}_mean"] = values[keep].mean().item()
    if "search/answer_present_mean" in stats:
        stats["search/answer_rate"] = stats["search/answer_present_mean"]
    if stats.get("search/turns_mean") and "search/turns_cut_mean" in stats:
        stats["search/turn_cut_rate"] = stats["search/turns_cut_mean"] / stats["search/turns_mean"]
    return stats


TURN_CUT_WARN_RATE = 0.5


def turn_cut_warning(stats: Dict[str, float], max_new_tokens_per_turn: Optional[int]) -> Optional[str]:
    """One line when most of a step's turns were cut by their token budget (``search/turn_cut_rate`` above
    :data:`TURN_CUT_WARN_RATE`): a thinking model (Qwen3) that reasons past ``--search.max_new_tokens_per_turn``
    never closes its tool call or answer, so those turns earn no reward. None otherwise."""
    rate = stats.get("search/turn_cut_rate")
    if rate is None or rate <= TURN_CUT_WARN_RATE:
        return None
    return (f"{rate:.0%} of this step's turns hit their token budget (--search.max_new_tokens_per_turn "
            f"{max_new_tokens_per_turn}): raise it (a thinking model reasons inside the turn) or THINKING=0")


class SearchExperienceMaker(RemoteExperienceMaker):
    """``RemoteExperienceMaker`` for multi-turn search rollouts (see the module docstring for what changes).

    Constructed exactly like its parent (``SearchPPOTrainer`` swaps it in). Reads ``args.search.max_failed_fraction``
    (default 0.5) when present.
    """

    def _max_failed_fraction(self) -> float:
        search = getattr(self.args, "search", None)
        value = getattr(search, "max_failed_fraction", None) if search is not None else None
        return 0.5 if value is None else float(value)

    def split_rollout_samples(self, rollout_samples):
        missing = fill_missing_info(rollout_samples)
        if missing:
            logger.warning(f"info keys missing on some samples, filled with 0: {missing}")
        return super().split_rollout_samples(rollout_samples)

    @torch.no_grad()
    def make_experience_batch(self, rollout_samples) -> List[Experience]:
        """OpenRLHF's pipeline (split, model forwards, advantages) with the failure guard in front.

        Raises:
            RetrievalFailureLimit: more than ``max_failed_fraction`` of the samples had a failed retrieval.
        """
        for sample in rollout_samples:  # before the length penalties read it
            if sample.action_mask is not None:
                sample.response_length = sampled_lengths(sample)
        if rollout_samples:
            failed = torch.cat([failed_mask(s) for s in rollout_samples])
            frac = failed.float().mean().item()
            if frac > self._max_failed_fraction():
                raise RetrievalFailureLimit(
                    f"{int(failed.sum())} of {len(failed)} rollouts had a failed retrieval "
                    f"(> --search.max_failed_fraction {self._max_failed_fraction()}): the retriever is down or "
                    "overloaded; refusing to train on this batch. Check the retriever services' /health."
                )
        experiences = super().make_experience_batch(rollout_samples)
        policy_versions.attach_to_experiences(experiences, rollout_samples)
        return experiences

    @torch.no_grad()
    def make_experience(self, samples_list: List[Experience]) -> List[Experience]:
        """Parent's forwards, then: action mask of failed samples zeroed, KL masked, KL logs of failed samples 0."""
        experiences = super().make_experience(samples_list)
        for exp in experiences:
            failed = failed_mask(exp)
            if failed.any():
                exp.action_mask = exp.action_mask.clone()
                exp.action_mask[failed.to(exp.action_mask.device)] = 0
            # per-sample KL logs of samples without action tokens (failed, or cut away by max_len) are 0/0 = NaN
            # in the parent's masked_mean: 0 instead
            empty = (exp.action_mask.reshape(len(exp.action_mask), -1).sum(-1) == 0).cpu() | failed
            if empty.any():
                for key in ("kl", "logprobs_diff"):
                    value = exp.info.get(key)
                    if torch.is_tensor(value) and value.numel() == len(empty):
                        exp.info[key] = torch.where(empty.to(value.device), torch.zeros_like(value), value)
            if exp.kl is not None:
                exp.kl = exp.kl * exp.action_mask.to(exp.kl.dtype)
        return experiences

    @torch.no_grad()
    def get_advantages_and_returns(self, values, rewards, action_mask, gamma, lambd):
        """Masked GAE (:func:`openrlhf_search.rl.advantages.masked_gae`) in place of OpenRLHF's per-position GAE."""
        return masked_gae(rewards, values, action_mask, gamma, lambd)

    @torch.no_grad()
    def get_cumulative_returns(self, rewards, action_mask, gamma):
        """Discounted reward-to-go over action tokens only (masked GAE with V = 0, lambda = 1)."""
        returns, _ = masked_gae(rewards, torch.zeros_like(rewards, dtype=torch.float32), action_mask, gamma, 1.0)
        return returns

    @torch.no_grad()
    def compute_advantages_and_returns(self, experiences: List[Experience]) -> List[Experience]:
        """Shaped rewards, advantages and returns, masked to action tokens (OpenRLHF's order of operations:
        length penalties, group baseline, per-token reward with KL, GAE or reward-to-go, whitening).

        Raises:
            ValueError: unknown estimator, or a non-finite reward on a trained sample.
        """
        args = self.strategy.args
        estimator = args.algo.advantage.estimator
        if estimator != "gae" and estimator not in CUMULATIVE_ESTIMATORS:
            raise ValueError(f"unknown advantage estimator {estimator!r}")
        n = args.rollout.n_samples_per_prompt

        for exp in experiences:
            exp.rewards = exp.rewards.to(torch.promote_types(exp.rewards.dtype, torch.float32))
        apply_length_penalties(experiences, args_with_overlong_budget(args))  # L_max: all turns, not one

        # Back to prompt order so that groups are contiguous (micro-batches may cut across groups).
        exp_len = [len(exp.index) for exp in experiences]
        indices = torch.tensor(list(itertools.chain.from_iterable(exp.index for exp in experiences)))
        raw = torch.cat([exp.rewards for exp in experiences])
        raw_valid = ~torch.cat([failed_mask(exp) for exp in experiences])
        rewards = torch.empty_like(raw)
        valid = torch.empty_like(raw_valid)
        rewards[indices] = raw
        valid[indices] = raw_valid

        if n > 1:
            g = rewards.reshape(-1, n)
            m = valid.reshape(-1, n).float()
            cnt = m.sum(-1, keepdim=True)
            mean = (g * m).sum(-1, keepdim=True) / cnt.clamp(min=1)
            std = ((((g - mean) * m) ** 2).sum(-1, keepdim=True) / (cnt - 1).clamp(min=1)).sqrt()
            stds = std.expand(-1, n).reshape(-1)[indices].split(exp_len)
            for exp, s in zip(experiences, stds):
                exp.info["group_reward_std"] = s

        if estimator == "group_norm" and getattr(getattr(args, "search", None), "group_norm_zero_pad", False):
            shaped = zero_padded_group_norm(rewards, n, valid=valid)  # R1-Searcher's released Llama stage 1
        elif estimator in GROUP_BASELINE_ESTIMATORS:
            shaped = group_baseline_rewards(rewards, n, estimator, valid=valid)
        elif estimator == "flash_reinforce":
            mean = rewards[valid].mean() if valid.any() else rewards.new_zeros(())
            shaped = torch.where(valid, rewards - mean, torch.zeros_like(rewards))
        else:
            shaped = group_baseline_rewards(rewards, 1, "reinforce", valid=valid)  # checks finiteness, zeroes failed
        shaped = shaped.reshape(-1)[indices].split(exp_len)

        gamma, lambd = args.algo.advantage.gamma, args.algo.advantage.lambd
        if estimator in GROUP_BASELINE_ESTIMATORS + ("flash_reinforce",) and gamma != 1.0:
            logger.warning(f"gamma is set to 1.0 for {estimator}")
            args.algo.advantage.gamma = gamma = 1.0

        for exp, r in zip(experiences, shaped):
            mask = exp.action_mask
            kl = exp.kl if exp.kl is not None else torch.zeros(mask.shape, dtype=torch.float32)
            reward = compute_reward(r, self.kl_ctl.value, kl, action_mask=mask,
                                    reward_clip_range=args.reward.clip_range)
            reward = reward * mask.to(reward.dtype)
            if estimator == "gae":
                exp.advantages, exp.returns = self.get_advantages_and_returns(exp.values, reward, mask, gamma, lambd)
            else:
                exp.returns = self.get_cumulative_returns(reward, mask, gamma)
                exp.advantages = exp.returns.clone()
            exp.info["return"] = reward.sum(dim=-1)
            exp.kl = None

        if estimator in WHITENED_ESTIMATORS:
            flat_adv = torch.cat([exp.advantages.flatten() for exp in experiences])
            flat_mask = torch.cat([exp.action_mask.flatten() for exp in experiences])
            if flat_mask.any():
                white = masked_whiten(flat_adv, flat_mask, scale=not args.algo.advantage.no_std_norm)
                for exp, part in zip(experiences, white.split([e.advantages.numel() for e in experiences])):
                    exp.advantages = part.reshape(exp.advantages.shape)
        return experiences

