"""Training-length cap for the cluster trainer, added to OpenRLHF 0.11.2 by subclassing (nothing copied).

What OpenRLHF 0.11.2 already has is only *configured* by the launchers: a constant learning rate after a linear
warm-up (``--actor.lr_scheduler constant_with_warmup``: verl's ``get_constant_schedule_with_warmup`` that Search-R1
uses, ``verl/workers/fsdp_workers.py:240``); the k1 KL penalty inside the reward (``--algo.kl.use_loss`` off,
``--algo.kl.estimator k1``: Search-R1's ``apply_kl_penalty`` with ``kl_penalty: kl``,
``verl/trainer/ppo/ray_trainer.py:91-121``), which our experience maker masks to action tokens; the entropy bonus,
AdamW betas / weight decay and per-sequence loss averaging.

What it lacks, added here: an evaluation before the first step (``--eval.before_training``, Search-R1's
``val_before_train``) and a **step cap** (``--train.max_steps N``). OpenRLHF stops only when the prompt loader
has been read ``--train.num_episodes`` times, and sizes the learning-rate schedule to that horizon
(``PPOTrainer.get_max_steps`` -> ``train()`` -> ``init_model_from_pretrained(max_steps)``). Search-R1 instead
stops after ``trainer.total_training_steps=1005`` steps and sizes its warm-up to those steps
(``verl/trainer/ppo/ray_trainer.py:422-434, 845``). With ``--train.max_steps N``:

* training stops after N rollout/update steps (:class:`StepCapTrainerMixin`), whatever ``num_episodes`` allows;
* the scheduler horizon is N steps times the optimizer updates one step makes
  (:func:`updates_per_step`), so a warm-up ratio means the same fraction of training as in verl.

Units: a *step* is one rollout batch and its policy update (OpenRLHF's ``global_step``; verl's
``global_steps``); an *update* is one optimizer step (what the DeepSpeed scheduler counts).
"""

import argparse
import logging
import math
import os
from typing import Any, Optional, Tuple

try:  # OpenRLHF's logger prints INFO in the trainer actor, where the per-step line must be seen
    from openrlhf.utils.logging_utils import init_logger

    logger = init_logger(__name__)
except ImportError:  # pragma: no cover - OpenRLHF is a dependency; kept importable for docs tooling
    logger = logging.getLogger(__name__)

MAX_STEPS_FLAG = "--train.max_steps"


def add_schedule_arguments(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """Add ``--train.max_steps`` (default None: OpenRLHF's own episode-based length) and
    ``--eval.before_training`` (default off). Returns ``parser``.

    Raises:
        argparse.ArgumentError: the parser already has a flag (a newer OpenRLHF added it: use theirs).
    """
    parser.add_argument(MAX_STEPS_FLAG, type=int, default=None,
                        help="stop after this many training steps (rollout batch + update) and size the LR "
                             "schedule to them (openrlhf_search.rl.schedules; Search-R1 total_training_steps)")
    parser.add_argument("--eval.before_training", action="store_true", default=False,
                        help="evaluate once at step 0 before training (Search-R1 val_before_train); not on resume")
    return parser


def validate_schedule_args(args) -> None:
    """Raise ValueError (one line) on a cap that is not a positive integer."""
    cap = getattr(args.train, "max_steps", None)
    if cap is not None and (not isinstance(cap, int) or isinstance(cap, bool) or cap <= 0):
        raise ValueError(f"{MAX_STEPS_FLAG} must be a positive integer, got {cap!r}")


def updates_per_step(args) -> int:
    """Optimizer updates one training step makes: ``rollout.batch_size * n_samples_per_prompt // train.batch_size``
    mini-batches, ``train.max_epochs`` times (OpenRLHF's ``prepare_datasets`` counts the same way).

    Raises:
        ValueError: a rollout batch smaller than one training batch (OpenRLHF would make 0 updates).
    """
    samples = args.rollout.batch_size * args.rollout.n_samples_per_prompt
    per_epoch = samples // args.train.batch_size
    if per_epoch < 1:
        raise ValueError(f"rollout batch of {samples} samples is smaller than --train.batch_size "
                         f"{args.train.batch_size}: no update would run")
    return per_epoch * args.train.max_epochs


def scheduler_horizon(args, data_updates: int) -> Tuple[int, Optional[str]]:
    """Updates the LR scheduler is sized to, and a warning when the data cannot reach the cap.

    Args:
        args: nested OpenRLHF args (``args.train.max_steps`` may be None).
        data_updates: OpenRLHF's own horizon (``prepare_datasets``' ``max_steps``: prompts x samples //
            train batch x episodes x epochs), in updates.

    Returns:
        (horizon in updates, warning or None). Without a cap: ``(data_updates, None)``.
    """
    cap = getattr(args.train, "max_steps", None)
    if cap is None:
        return data_updates, None
    horizon = cap * updates_per_step(args)
    warning = None
    if data_updates < horizon:
        warning = (f"{MAX_STEPS_FLAG} {cap} needs {horizon} updates but the data gives {data_updates} "
                   f"({args.train.num_episodes} episode(s)); training ends when the data does: raise "
                   "--train.num_episodes")
    return horizon, warning


def warmup_updates(args, horizon: int, who: str = "actor") -> int:
    """Warm-up updates DeepSpeed's scheduler will use: ``ceil(horizon * lr_warmup_ratio)`` (OpenRLHF 0.11.2)."""
    return math.ceil(horizon * getattr(args, who).lr_warmup_ratio)


class StepCapReached(Exception):
    """Raised by the wrapped ``generate_samples`` once ``--train.max_steps`` steps are done; ends ``fit``."""


class StepCapTrainerMixin:
    """Mixin for OpenRLHF's plain ``PPOTrainer`` class (before ``ray.remote``): stop after ``--train.max_steps``,
    and evaluate at step 0 with ``--eval.before_training``.

    Put it first in the bases: ``class T(StepCapTrainerMixin, SomePPOTrainer.__ray_actor_class__)``.
    ``get_max_steps`` returns :func:`scheduler_horizon`; ``train_step`` records the step; the sample generator's
    ``generate_samples`` is wrapped so that once the cap is reached it raises :class:`StepCapReached`, which
    :meth:`fit` catches: OpenRLHF's ``fit`` would otherwise open a progress bar for every remaining episode. The
    step at which the cap is reached is checkpointed even when it is not a multiple of ``--ckpt.save_steps``
    (unless saving is off). Progress is one ``step k of N`` line per step (N: the cap, or what the data gives), in
    place of OpenRLHF's per-episode bar over prompts (``Episode [1/15]``), which kept spinning to its end after a cap.
    """

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self._init_step_cap()

    def _init_step_cap(self) -> None:
        """Read the cap from ``self.args`` and wrap ``self.samples_generator`` (after the base ``__init__``)."""
        validate_schedule_args(self.args)
        self.step_cap: Optional[int] = getattr(self.args.train, "max_steps", None)
        self._steps_done = 0
        if self.step_cap is not None:
            self._wrap_generator()

    def _wrap_generator(self) -> None:
        generator = self.samples_generator
        original = generator.generate_samples

        def generate_samples(**kwargs):
            if self.cap_reached:
                raise StepCapReached(self.step_cap)
            return original(**kwargs)

        generator.generate_samples = generate_samples

    def fit(self, global_step: int = 0) -> None:
        """OpenRLHF's ``fit`` without its per-episode prompt bar, ended at the step cap (loggers closed as ``fit``
        closes them)."""
        import functools

        import openrlhf.trainer.ppo_trainer as ppo_trainer_module
        from tqdm import tqdm

        # fit() builds its per-episode bar from this module global (ppo_trainer.py:522); the step line replaces it
        ppo_trainer_module.tqdm = functools.partial(tqdm, disable=True)
        try:
            return super().fit(global_step)
        except StepCapReached:
            for tracker in (getattr(self, "wandb_logger", None), getattr(self, "tensorboard_logger", None)):
                if tracker:
                    tracker.close()

    def total_steps(self) -> Optional[int]:
        """N of ``step k of N``: the cap, else episodes x prompt batches per episode (None if unknown)."""
        if self.step_cap is not None:
            return self.step_cap
        try:
            return int(self.args.train.num_episodes) * len(self.prompts_dataloader)
        except (AttributeError, TypeError):
            return None

    @property
    def cap_reached(self) -> bool:
        return self.step_cap is not None and self._steps_done >= self.step_cap

    def get_max_steps(self):
        horizon, warning = scheduler_horizon(self.args, super().get_max_steps())
        if warning:
            logger.warning(warning)
        return horizon

    def train_step(self, rollout_samples, global_step: int):
        status, next_step = super().train_step(rollout_samples, global_step)
        self._steps_done = next_step
        total = self.total_steps()
        logger.info(f"step {next_step} of {total if total is not None else '?'}: reward "
                    f"{status.get('rollout/reward_mean', status.get('reward', float('nan'))):.4f}")
        if self.cap_reached:
            status["train/step_cap_reached"] = 1.0
            logger.info(f"{MAX_STEPS_FLAG} {self.step_cap} reached at step {next_step}: stopping")
        return status, next_step

    def init_checkpoint_states(self):
        states = super().init_checkpoint_states()
        self._steps_done = int(states.get("global_step", 0))  # a resumed run counts the steps already made
        if getattr(self.args.eval, "before_training", False) and self._steps_done == 0 and self.eval_dataloader:
            # Search-R1's val_before_train (ray_trainer.py:665): the untrained policy's eval numbers at step 0.
            # Here, because OpenRLHF's fit() calls this right before its loop; a resumed run skips it.
            kwargs = dict(self.generate_kwargs)
            kwargs["temperature"] = self.args.eval.temperature
            kwargs["n_samples_per_prompt"] = self.args.eval.n_samples_per_prompt
            self.evaluate(0, **kwargs)
        return states

    def save_logs_and_checkpoints(self, global_step: int, logs_dict=None, client_states=None) -> None:
        ckpt = self.args.ckpt
        if getattr(ckpt, "output_dir", None):  # OpenRLHF's parser always sets it; a bare trainer may not
            append_step_metrics(os.path.join(ckpt.output_dir, METRICS_FILE), global_step, logs_dict)
        final = self.step_cap is not None and global_step == self.step_cap
        if final and math.isfinite(ckpt.save_steps) and global_step % ckpt.save_steps != 0:
            saved = ckpt.save_steps
            ckpt.save_steps = global_step  # this call saves; the next never comes
            try:
                return super().save_logs_and_checkpoints(global_step, logs_dict, client_states)
            finally:
                ckpt.save_steps = saved
        return super().save_logs_and_checkpoints(global_step, logs_dict, client_states)


METRICS_FILE = "metrics.jsonl"


def append_step_metrics(path: str, global_step: int, logs_dict) -> None:
    """Append one JSON line ``{"global_step": N, <every scalar of the step's logs>}`` (non-finite
    values as null) to ``path`` (the trainer's
    ``--ckpt.output_dir``/``metrics.jsonl``, beside wandb / tensorboard, which OpenRLHF offers alone). A relaunch
    that repeats a step appends it again; readers keep the last row per step."""
    import json
    import numbers

    row = {"global_step": int(global_step)}
    for key, value in (logs_dict or {}).items():
        if hasattr(value, "item") and getattr(value, "numel", lambda: 1)() == 1:
            value = value.item()
        if isinstance(value, numbers.Number) and not isinstance(value, bool):
            row[key] = float(value) if math.isfinite(float(value)) else None  # NaN / inf: JSON null
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    with open(path, "a", encoding="utf-8") as f:
        f.write(json.dumps(row) + "\n")


def with_step_cap(trainer_cls: type) -> type:
    """``trainer_cls`` (a plain PPOTrainer class) with :class:`StepCapTrainerMixin` in front."""
    return type(f"StepCapped{trainer_cls.__name__.lstrip('_')}", (StepCapTrainerMixin, trainer_cls),
                {"__module__": __name__, "__doc__": trainer_cls.__doc__})


def resolved_schedule(args) -> dict:
    """What the schedule will be, for ``--dry_run``: cap, updates per step, warm-up (in steps) per model."""
    out: dict[str, Any] = {"max_steps": getattr(args.train, "max_steps", None)}
    try:
        ups = updates_per_step(args)
    except ValueError as e:
        return {**out, "error": str(e)}
    out["updates_per_step"] = ups
    models = ["actor"] + (["critic"] if getattr(getattr(args, "critic", None), "model_name_or_path", None) else [])
    if out["max_steps"] is not None:
        horizon = out["max_steps"] * ups
        out["horizon_updates"] = horizon
        for who in models:
            w = warmup_updates(args, horizon, who)
            out[f"{who}_warmup_updates"] = w
            out[f"{who}_warmup_steps"] = w / ups
    for who in models:
        out[f"{who}_lr_scheduler"] = getattr(args, who).lr_scheduler
    return out
