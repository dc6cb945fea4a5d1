"""Reward-stage schedule: which reward scheme scores the rollouts of each training step.

R1-Searcher (arXiv 2503.05592 sec. 3.2) trains in two stages: stage 1 rewards retrieval and format, stage 2 answer
F1 and format. ``openrlhf_search.rl.trainer.SearchPPOTrainer`` applies this schedule to the rollout actors; the
``--search.*`` options that define it are parsed by ``openrlhf_search.cli.train``. Kept free of Ray/OpenRLHF
imports: ``--dry_run`` validates it quickly, and :func:`set_reward_scheme_in_rollout_actor`, which Ray ships to
the vLLM actors, does not pull DeepSpeed into them when unpickled.
"""

import json
import os
from dataclasses import dataclass
from typing import List, Optional

from openrlhf_search.env.config import ENV_VAR, SearchConfig


def known_reward_schemes() -> List[str]:
    from openrlhf_search.env.rewards import REWARD_SCHEMES

    return sorted(REWARD_SCHEMES)


@dataclass
class RewardSchedule:
    """Which reward scheme scores the rollouts of each training step.

    Attributes:
        stage1_scheme: scheme from step 0 (``--search.reward_scheme``).
        stage2_scheme: scheme from ``stage2_start_step`` on (``--search.stage2_reward_scheme``); None: one stage.
        stage2_start_step: first step (count of finished training steps) scored by stage 2; None or < 0: never.
        eval_scheme: scheme for eval rollouts (``--search.eval_reward_scheme``); None: the training scheme.
    """

    stage1_scheme: str
    stage2_scheme: Optional[str] = None
    stage2_start_step: Optional[int] = None
    eval_scheme: Optional[str] = None

    def __post_init__(self):
        if self.two_stage and not self.stage2_scheme:
            raise ValueError("--search.stage2_start_step needs --search.stage2_reward_scheme")

    @property
    def two_stage(self) -> bool:
        return self.stage2_start_step is not None and self.stage2_start_step >= 0

    def stage_at(self, step: int) -> int:
        """1 or 2: the stage whose reward scores the rollout made before training step ``step``."""
        return 2 if self.two_stage and step >= self.stage2_start_step else 1

    def scheme_at(self, step: int) -> str:
        return self.stage2_scheme if self.stage_at(step) == 2 else self.stage1_scheme

    def validate(self, known: List[str]) -> "RewardSchedule":
        """Raises ValueError naming the flag of an unknown scheme."""
        for flag, name in [("reward_scheme", self.stage1_scheme), ("stage2_reward_scheme", self.stage2_scheme),
                           ("eval_reward_scheme", self.eval_scheme)]:
            if name is not None and name not in known:
                raise ValueError(f"--search.{flag} {name!r} is not a reward scheme; known: {known}")
        return self

    @classmethod
    def from_args(cls, args) -> "RewardSchedule":
        """From ``args.search`` (hierarchized OpenRLHF args); the stage-1 scheme falls back to the env config."""
        search = getattr(args, "search", None)
        get = (lambda k: getattr(search, k, None)) if search is not None else (lambda k: None)
        stage1 = get("reward_scheme") or SearchConfig.from_env().reward_scheme
        return cls(stage1, get("stage2_reward_scheme"), get("stage2_start_step"), get("eval_reward_scheme"))


def set_reward_scheme_in_rollout_actor(actor, scheme: str) -> str:
    """Runs inside a rollout (vLLM) Ray actor via ``__ray_call__``: switch its agent executor's reward scheme.

    Args:
        actor: the ``RolloutRayActor`` instance (its ``executor`` attribute is our ``AgentExecutor``).
        scheme: a name in ``openrlhf_search.env.rewards.REWARD_SCHEMES``.

    Returns:
        The scheme the executor reports after the switch.

    Raises:
        RuntimeError: the actor has no executor, or the executor exposes neither ``set_reward_scheme`` nor a
            ``config`` with ``reward_scheme``.
    """
    executor = getattr(actor, "executor", None)
    if executor is None:
        raise RuntimeError(f"{type(actor).__name__} has no agent executor; was --train.agent_func_path set?")
    setter = getattr(executor, "set_reward_scheme", None)
    config = getattr(executor, "config", None)
    if callable(setter):
        setter(scheme)
    elif config is not None and hasattr(config, "reward_scheme"):
        config.reward_scheme = scheme
    else:
        raise RuntimeError(
            f"{type(executor).__name__} exposes neither set_reward_scheme() nor config.reward_scheme; "
            "the reward stage cannot be switched"
        )
    # Executors created later in this process (none today) read the environment.
    data = json.loads(os.environ.get(ENV_VAR) or "{}")
    data["reward_scheme"] = scheme
    os.environ[ENV_VAR] = json.dumps(data, sort_keys=True)
    config = getattr(executor, "config", None)
    return getattr(config, "reward_scheme", scheme)
