"""Asynchronous training with search: OpenRLHF 0.11.2's ``PPOTrainerAsync`` with our classes inside.

``--train.async_enable`` makes OpenRLHF's ``train()`` build ``openrlhf.trainer.ppo_trainer_async.PPOTrainerAsync``
(``train_ppo_ray.py:145-146``, looked up at call time), whose constructor builds ``GenerateSamplesActor`` (prompts ->
vLLM rollouts -> a ``ray.util.queue.Queue`` of at most ``--train.async_queue_size`` batches) and ``TrainingActor``
(queue -> experience -> PPO update -> weight sync) from its module's globals (``ppo_trainer_async.py:258-280``).
``openrlhf_search.cli.train`` puts :data:`SearchPPOTrainerAsync` in that module; its constructor, running in its own
Ray worker, rebinds the module's two globals to :data:`SearchGenerateSamplesActor` / :data:`SearchTrainingActor`
before OpenRLHF's constructor runs. Nothing of OpenRLHF is copied; every class below subclasses OpenRLHF's plain class
(``__ray_actor_class__``) and is wrapped with ``ray.remote`` as OpenRLHF's decorators do.

What runs where, against the synchronous loop (``openrlhf_search.rl.trainer.SearchPPOTrainer``):

* **generator** (:class:`_SearchGenerateSamplesActor`): :class:`SearchSamplesGenerator`, the reward-stage switch, the
  step cap and eval (``--eval.steps``, with ``--search.eval_reward_scheme`` and the search eval metrics). Every batch
  carries exactly one training step (``TrainingActor.fit`` trains every payload), so the k-th batch produced is
  trained at step ``start + k``: before generating it the generator switches the engines to that step's scheme and
  drops its over-sampling buffer on a switch. Queued rollouts are thus scored by the scheme of the step they are
  trained at. At ``--train.max_steps`` it ends OpenRLHF's loop at once (:class:`StepCapReached`).
* **trainer** (:class:`_SearchTrainingActor`): :class:`SearchExperienceMaker`, ``rollout/*`` and ``search/*``
  statistics over trained samples, the step cap's final checkpoint, the step's time split, and a guard dropping
  samples scored under another scheme than the step's (``search/stale_stage_samples_dropped``; none by
  construction). After each weight sync every engine learns the step whose weights it holds, from which each
  trajectory's and each action token's policy version are recorded (``async/staleness_*``,
  ``async/samples_spanning_sync``, ``async/token_staleness_*``; :mod:`openrlhf_search.env.policy_versions`).

Staleness bound: ``--train.async_queue_size`` q. The generator takes a slot before generating a batch and the trainer
frees it when it takes the batch off the queue, so at most q batches are generated ahead: a batch trained at step s
started generating with the weights of step s - q or later (s - q - 1 with ``--train.partial_rollout_enable``, whose
trajectories may start under one version and finish under the next).

``--eval.before_training`` (Search-R1's ``val_before_train``): the generator evaluates the untrained policy before
its first batch and queues the metrics as OpenRLHF's own async eval does (``("eval", 0, metrics)``, a queue slot taken
first); the trainer logs them at step 0 and, as the sync trainer, saves no "best" checkpoint for them.
"""

import logging
import time
from typing import Dict, List, Optional

import ray

import openrlhf_search._cpu_compat  # noqa: F401  (before any openrlhf import)
import openrlhf.trainer.ppo_trainer_async as ppo_async
from openrlhf.trainer.ppo_trainer import BasePPOTrainer

from openrlhf_search.env import policy_versions
from openrlhf_search.rl.experience_maker import (
    SearchExperienceMaker,
    SearchSamplesGenerator,
    failed_mask,
    search_rollout_stats,
    turn_cut_warning,
    valid_rollout_stats,
)
from openrlhf_search.env.reward_schedule import RewardSchedule
from openrlhf_search.rl.schedules import StepCapTrainerMixin, scheduler_horizon
from openrlhf_search.rl.step_timing import StepTimingMixin, set_policy_version
from openrlhf_search.rl.trainer import search_eval_metrics, set_reward_scheme

logger = logging.getLogger(__name__)

SCHEME_ATTR = "_search_reward_scheme"  # on every sample: the reward scheme the executor scored it with
STEP_ATTR = "_search_train_step"  # on every sample: the global step the generator produced it for
WAIT_ATTR = "_search_engine_wait_s"  # on the first sample: seconds the generator waited before producing it


def _search_generator(old) -> SearchSamplesGenerator:
    """OpenRLHF's ``SamplesGenerator`` rebuilt as :class:`SearchSamplesGenerator` from the same state."""
    gen = SearchSamplesGenerator(strategy=old.strategy, prompts_dataloader=old.prompts_dataloader,
                                 eval_dataloader=old.eval_dataloader, tokenizer=old.tokenizer,
                                 vllm_engines=old.vllm_engines)
    gen.record_policy_versions = True
    return gen


class _TimedQueue:
    """A ``ray.util.queue.Queue`` whose blocking ``get`` adds its wait to :attr:`waited` (seconds)."""

    def __init__(self, queue):
        self.queue = queue
        self.waited = 0.0
        self.last = None

    def get(self, *args, **kwargs):
        t0 = time.time()
        try:
            item = self.queue.get(*args, **kwargs)
        finally:
            self.waited += time.time() - t0
        self.last = item
        return item

    def pop_waited(self) -> float:
        waited, self.waited = self.waited, 0.0
        return waited

    def __getattr__(self, name):
        return getattr(self.queue, name)


class _TimedLock:
    """The ``VLLMLock`` actor handle with ``acquire.remote()`` blocking here (timed) and returning a ready ref, so
    that OpenRLHF's ``ray.get(lock.acquire.remote())`` keeps its meaning."""

    class _Acquire:
        def __init__(self, outer):
            self.outer = outer

        def remote(self):
            t0 = time.time()
            ray.get(self.outer.lock.acquire.remote())
            self.outer.waited += time.time() - t0
            return ray.put(None)

    def __init__(self, lock):
        self.lock = lock
        self.waited = 0.0
        self.acquire = _TimedLock._Acquire(self)

    def __getattr__(self, name):
        return getattr(self.lock, name)


class StepCapReached(Exception):
    """Raised inside OpenRLHF's generator loop when ``--train.max_steps`` batches are produced; caught by
    :meth:`_SearchGenerateSamplesActor.fit`, which ends the loop (``"done"`` on the queue)."""

    def __init__(self, step: int):
        super().__init__(f"step cap {step} reached")
        self.step = step


class _SearchGenerateSamplesActor(ppo_async.GenerateSamplesActor.__ray_actor_class__):
    """OpenRLHF's ``GenerateSamplesActor`` with :class:`SearchSamplesGenerator`, the reward-stage switch, the step cap
    and the search eval (see the module docstring). Same constructor."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.samples_generator = _search_generator(self.samples_generator)
        self.reward_schedule = RewardSchedule.from_args(self.args)
        self.active_reward_scheme: Optional[str] = None
        self.step_cap: Optional[int] = getattr(self.args.train, "max_steps", None)
        self.start_step = 0
        self.produced = 0
        self.rollout_slots = _TimedQueue(self.rollout_slots)
        self.vllm_lock = _TimedLock(self.vllm_lock)
        self._eval_samples: List = []
        self._generate = self.samples_generator.generate_samples
        generate_eval = self.samples_generator.generate_eval_samples

        def generate_eval_samples(**kwargs):
            self._eval_samples = generate_eval(**kwargs)
            return self._eval_samples

        self.samples_generator.generate_samples = self._generate_samples
        self.samples_generator.generate_eval_samples = generate_eval_samples

    def _generate_samples(self, **kwargs):
        """The generator's batch for step ``start_step + produced``, tagged with its step and reward scheme; raises
        :class:`StepCapReached` once ``--train.max_steps`` batches have been produced."""
        step = self.start_step + self.produced
        if self.step_cap is not None and step >= self.step_cap:
            raise StepCapReached(step)
        scheme = self.apply_reward_scheme(step)
        samples, pass_rate, consumed, exhausted = self._generate(**kwargs)
        if samples:
            self.produced += 1
            for s in samples:
                setattr(s, SCHEME_ATTR, scheme)
                setattr(s, STEP_ATTR, step)
            setattr(samples[0], WAIT_ATTR, self.rollout_slots.pop_waited() + self._pop_lock_wait())
        return samples, pass_rate, consumed, exhausted

    def _pop_lock_wait(self) -> float:
        waited, self.vllm_lock.waited = self.vllm_lock.waited, 0.0
        return waited

    def fit(self, episode: int, total_consumed_prompts: int) -> None:
        """OpenRLHF's generator loop, after the evaluation of ``--eval.before_training`` (not on resume)."""
        if getattr(self.args.eval, "before_training", False) and self.start_step == 0 and self.eval_dataloader:
            self.rollout_slots.get(block=True)  # the trainer returns the slot when it takes the eval payload
            ray.get(self.vllm_lock.acquire.remote())
            try:
                metrics = self._run_eval()
            finally:
                ray.get(self.vllm_lock.release.remote())
            self.rollout_slots.pop_waited()
            self._pop_lock_wait()
            self.rollout_queue.put(("eval", 0, metrics), block=True)
        try:
            return super().fit(episode, total_consumed_prompts)
        except StepCapReached as cap:
            # OpenRLHF's loop would treat the cap as exhausted data and run every remaining episode (each a slot
            # round trip and a progress bar): end it here, as its own end does
            logger.info(f"step cap --train.max_steps {cap.step} reached: the generator stops")
            self.rollout_queue.put("done", block=True)
            return None

    def set_start_step(self, step: int) -> int:
        """The global step training starts (or resumes) at; batch k is produced for step ``step + k``."""
        self.start_step, self.produced = int(step), 0
        return self.start_step

    def get_max_steps(self):
        """OpenRLHF's horizon, capped by ``--train.max_steps`` (``schedules.scheduler_horizon``), in updates."""
        horizon, warning = scheduler_horizon(self.args, super().get_max_steps())
        if warning:
            logger.warning(warning)
        return horizon

    def apply_reward_scheme(self, step: int) -> str:
        """Make every engine score with the scheme of ``step``; on a switch drop the buffered samples (scored under
        the previous scheme). Returns the scheme."""
        scheme = self.reward_schedule.scheme_at(step)
        if scheme != self.active_reward_scheme:
            set_reward_scheme(self.samples_generator.vllm_engines, scheme)
            logger.info(f"reward stage {self.reward_schedule.stage_at(step)} from step {step}: {scheme}")
            if self.active_reward_scheme is not None:
                dropped = self.samples_generator.discard_buffer()
                if dropped:
                    logger.warning(f"reward scheme switched to {scheme}: dropped {dropped} buffered samples scored "
                                   f"under {self.active_reward_scheme}")
            self.active_reward_scheme = scheme
        return scheme

    def _run_eval(self):
        """OpenRLHF's async eval with ``--search.eval_reward_scheme`` and the search eval metrics."""
        train_scheme = self.active_reward_scheme
        eval_scheme = self.reward_schedule.eval_scheme
        switched = eval_scheme is not None and eval_scheme != train_scheme
        engines = self.samples_generator.vllm_engines
        if switched:
            set_reward_scheme(engines, eval_scheme)
        try:
            logs = super()._run_eval()
        finally:
            if switched and train_scheme is not None:
                set_reward_scheme(engines, train_scheme)
        logs.update(search_eval_metrics(self.eval_dataloader, self._eval_samples))
        self._eval_samples = []
        return logs


class _PolicyVersionBroadcast(BasePPOTrainer):
    """Placed after OpenRLHF's ``TrainingActor`` in the MRO, so that its ``broadcast_to_vllm`` (lock, pause /
    resume with partial rollouts) wraps this one: right after the weights are loaded, and before generation resumes,
    every engine records the step whose weights it now holds."""

    _policy_version = 0

    def broadcast_to_vllm(self) -> None:
        super().broadcast_to_vllm()
        if self.vllm_engines:
            version = self._policy_version
            ray.get([e.__ray_call__.remote(set_policy_version, version) for e in self.vllm_engines])


class _SearchTrainingActor(StepTimingMixin, StepCapTrainerMixin, ppo_async.TrainingActor.__ray_actor_class__,
                           _PolicyVersionBroadcast):
    """OpenRLHF's ``TrainingActor`` with :class:`SearchExperienceMaker`, search statistics, the step cap's final
    checkpoint, the time split and the stage guard (see the module docstring). Same constructor."""

    eval_dataloader = None  # evaluation runs in the generator (StepCapTrainerMixin reads the attribute)

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.experience_maker = SearchExperienceMaker(
            self.actor_model_group, self.critic_model_group, self.reward_model_group, self.reference_model_group,
            self.kl_ctl, self.strategy, self.tokenizer)
        self.reward_schedule = RewardSchedule.from_args(self.args)
        self.rollout_queue = _TimedQueue(self.rollout_queue)

    def _wrap_generator(self) -> None:
        """The cap is enforced by the generator actor (it stops producing); nothing to wrap here."""

    def broadcast_to_vllm(self) -> None:
        """OpenRLHF's ``TrainingActor.broadcast_to_vllm`` (vLLM lock; pause / resume with partial rollouts), reached
        through this class. Needed: Ray wraps every method of an actor class on its top class and pickles those
        wrappers by value; OpenRLHF's plain ``TrainingActor`` is not importable by name (the module's name holds the
        ``ray.remote`` wrapper), so an inherited method would arrive as a copy whose zero-argument ``super()`` names a
        copy of the class, and fail ("super(type, obj): obj must be an instance or subtype of type")."""
        return super().broadcast_to_vllm()

    def init_checkpoint_states(self) -> Dict:
        states = super().init_checkpoint_states()
        self._policy_version = int(states.get("global_step", 0))  # a resumed run re-syncs the checkpoint's weights
        return states

    def save_best_checkpoint(self, eval_metrics, global_step, client_states=None):
        """OpenRLHF's best-checkpoint rule, except for the evaluation before training (step 0), which the sync
        trainer does not checkpoint either."""
        if global_step == 0:
            return None
        return super().save_best_checkpoint(eval_metrics, global_step, client_states)

    def checkpoint_step(self) -> int:
        """The global step training starts at (0, or the checkpoint's when resuming); no side effect."""
        return int(BasePPOTrainer.init_checkpoint_states(self).get("global_step", 0))

    def train_step(self, rollout_samples, global_step: int):
        scheme = self.reward_schedule.scheme_at(global_step)
        kept = [s for s in rollout_samples if getattr(s, SCHEME_ATTR, scheme) == scheme]
        dropped = len(rollout_samples) - len(kept)
        if dropped:
            logger.warning(f"step {global_step}: dropped {dropped} samples scored under another reward scheme than "
                           f"{scheme}")
        if not kept:
            raise RuntimeError(f"step {global_step}: every sample of the batch was scored under another reward "
                               f"scheme than {scheme} (generator and trainer disagree on the step count)")
        if dropped and rollout_samples[0] is not kept[0]:  # keep the batch's rollout figures with the batch
            for attr in ("_search_rollout_timing", WAIT_ATTR):
                if hasattr(rollout_samples[0], attr):
                    setattr(kept[0], attr, getattr(rollout_samples[0], attr))
        engine_wait = float(getattr(kept[0], WAIT_ATTR, 0.0))
        starts = [float(s.info["policy_version_start"].reshape(-1)[0]) for s in kept
                  if "policy_version_start" in s.info]
        ends = [float(s.info["policy_version_end"].reshape(-1)[0]) for s in kept if "policy_version_end" in s.info]
        token_stats = policy_versions.batch_stats(  # over trained samples: failed retrievals are left out
            [getattr(s, policy_versions.TENSOR_ATTR, None) for s in kept if not failed_mask(s).any()], global_step)
        self._policy_version = global_step + 1  # what the engines hold after this step's sync
        status, next_step = super().train_step(kept, global_step)
        status["search/reward_stage"] = float(self.reward_schedule.stage_at(global_step))
        status["search/stale_stage_samples_dropped"] = float(dropped)
        status["async/trainer_wait_s"] = self.rollout_queue.pop_waited()
        status["async/engine_wait_s"] = engine_wait
        if starts:
            staleness = [global_step - v for v in starts]
            status["async/staleness_mean"] = sum(staleness) / len(staleness)
            status["async/staleness_max"] = float(max(staleness))
            status["async/samples_spanning_sync"] = float(sum(1 for a, b in zip(starts, ends) if b > a))
        status.update(token_stats)  # per-token versions, when recorded: spanning = action tokens of 2+ versions
        return status, next_step

    def _compute_rollout_stats(self, experiences) -> Dict:
        stats = super()._compute_rollout_stats(experiences)
        stats.update(valid_rollout_stats(experiences))
        stats.update(search_rollout_stats(experiences))
        cut = turn_cut_warning(stats, getattr(getattr(self.args, "search", None), "max_new_tokens_per_turn", None))
        if cut:
            logger.warning(cut)
        return stats


class _SearchPPOTrainerAsync(ppo_async.PPOTrainerAsync.__ray_actor_class__):
    """OpenRLHF's ``PPOTrainerAsync`` building :data:`SearchGenerateSamplesActor` and :data:`SearchTrainingActor`.
    Same constructor; ``fit`` first tells the generator the step training starts at."""

    def __init__(self, *args, **kwargs):
        # PPOTrainerAsync.__init__ builds the two actors from its module's globals, in this (its own) process
        ppo_async.GenerateSamplesActor = SearchGenerateSamplesActor
        ppo_async.TrainingActor = SearchTrainingActor
        super().__init__(*args, **kwargs)

    def fit(self) -> None:
        step = ray.get(self.trainer_actor.checkpoint_step.remote())
        ray.get(self.generator_actor.set_start_step.remote(step))
        if step:
            logger.info(f"async training resumes at step {step}")
        return super().fit()


# Same Ray options as OpenRLHF's decorators (a bare @ray.remote on all three).
SearchGenerateSamplesActor = ray.remote(_SearchGenerateSamplesActor)
SearchTrainingActor = ray.remote(_SearchTrainingActor)
SearchPPOTrainerAsync = ray.remote(_SearchPPOTrainerAsync)
