"""Cluster trainer: OpenRLHF's ``PPOTrainer`` with search experience, a reward-stage schedule and search eval.

``PPOTrainer`` is a Ray actor class; Ray 2.x keeps the plain class as ``PPOTrainer.__ray_actor_class__``, which is
subclassed here and wrapped again with ``ray.remote``. ``openrlhf_search.cli.train`` puts
:data:`SearchPPOTrainer` where OpenRLHF's ``train()`` looks it up, and likewise the policy/critic actor classes
below, which build :mod:`openrlhf_search.rl.loss`'s masked losses.

Reward-stage schedule (:mod:`openrlhf_search.env.reward_schedule`): the executors live in the vLLM actors, which
OpenRLHF builds with no arguments, so between steps the trainer switches their scheme through Ray's
``actor.__ray_call__`` (:func:`set_reward_scheme_in_rollout_actor`) and checks the scheme each reports; a resumed run
re-applies the scheme of its step. The papers' own recipe, stage 2 as a second run from the stage-1 checkpoint, is
what ``examples/scripts/r1searcher_*_stage2.sh`` do.

Evaluation: OpenRLHF's ``--eval.dataset`` / ``--eval.steps`` loop, with the eval rollouts scored by
``--search.eval_reward_scheme`` (default: the scheme active at that step) and ``eval_*`` logs extended with
EM / F1 / Cover-EM / answer rate / turns per data source (:func:`search_eval_metrics`).
"""

import os
from datetime import timedelta
from typing import Dict, List, Optional

import ray
import torch

import openrlhf_search._cpu_compat  # noqa: F401  (before any openrlhf import)
from openrlhf.trainer.ppo_trainer import PPOTrainer, compute_eval_metrics
from openrlhf.trainer.ray.ppo_actor import PolicyModelActor
from openrlhf.trainer.ray.ppo_critic import CriticModelActor, CriticPPOTrainer
from openrlhf.utils.logging_utils import init_logger

from openrlhf_search.rl.experience_maker import (
    SearchExperienceMaker,
    SearchSamplesGenerator,
    failed_mask,
    search_rollout_stats,
    turn_cut_warning,
    valid_rollout_stats,
)
from openrlhf_search.rl.loss import EMPTY_MICRO_BATCH_WEIGHT, empty_mask_safe_actor_trainer, install_into_openrlhf
from openrlhf_search.env.reward_schedule import (  # noqa: F401  (re-exported)
    RewardSchedule,
    known_reward_schemes,
    set_reward_scheme_in_rollout_actor,
)
from openrlhf_search.rl.step_timing import StepTimingMixin

logger = init_logger(__name__)

EVAL_STAT_KEYS = ("em", "f1", "cover_em", "answer_present", "turns", "valid_searches", "format_ok")


def set_reward_scheme(rollout_actors, scheme: str) -> None:
    """Switch every rollout actor to ``scheme`` and check that each reports it (raises RuntimeError if not)."""
    if not rollout_actors:
        return
    got = ray.get([a.__ray_call__.remote(set_reward_scheme_in_rollout_actor, scheme) for a in rollout_actors])
    wrong = [g for g in got if g != scheme]
    if wrong:
        raise RuntimeError(f"reward scheme switch to {scheme!r} did not take effect: actors report {got}")


def search_eval_metrics(eval_dataloader, samples_list) -> Dict[str, float]:
    """Means of the executor's answer metrics over eval rollouts, per data source and overall.

    Returns ``eval_<datasource>_<key>`` and ``eval_<key>`` for ``key`` in :data:`EVAL_STAT_KEYS` present in the
    samples' ``info``, plus ``eval_retrieval_failed_rate``. Samples whose retrieval failed are left out of the
    means (their answer says nothing about the policy).
    """
    if not samples_list:
        return {}
    source_of = {}
    for datasources, prompts, _labels, _images in eval_dataloader:
        for prompt, ds in zip(prompts, datasources):
            source_of[prompt] = ds
    sums: Dict[str, Dict[str, List[float]]] = {}
    n_failed = n_total = 0
    for s in samples_list:
        failed = failed_mask(s)
        for i, prompt in enumerate(s.prompts):
            n_total += 1
            if failed[i]:
                n_failed += 1
                continue
            for ds in (source_of.get(prompt, "unknown"), None):
                bucket = sums.setdefault(ds, {})
                for key in EVAL_STAT_KEYS:
                    if key in s.info:
                        bucket.setdefault(key, []).append(float(torch.as_tensor(s.info[key]).reshape(-1)[i]))
    logs = {"eval_retrieval_failed_rate": n_failed / max(n_total, 1)}
    for ds, bucket in sums.items():
        prefix = "eval_" if ds is None else f"eval_{ds}_"
        for key, values in bucket.items():
            logs[f"{prefix}{key}"] = sum(values) / len(values)
    return logs


def answer_list_stats(experiences) -> Dict[str, float]:
    """``rollout/answer_list_rate``: the share of trained samples (retrieval not failed) whose answer names more than
    one candidate (``rewards.answer_candidates``; the reward component ``answer_list``). Cover-EM and the released
    stage-1 reward score a list holding the gold like the bare gold, so a rising rate is the policy learning to
    list. {} when the reward scheme does not report ``answer_list``."""
    if not experiences or not all("answer_list" in e.info for e in experiences):
        return {}
    keep = torch.cat([~failed_mask(e) for e in experiences])
    values = torch.cat([torch.as_tensor(e.info["answer_list"]).reshape(-1).float().cpu() for e in experiences])
    if values.numel() != keep.numel() or not keep.any():
        return {}
    return {"rollout/answer_list_rate": values[keep].mean().item()}


class _SearchPPOTrainer(StepTimingMixin, PPOTrainer.__ray_actor_class__):
    """OpenRLHF ``PPOTrainer`` (plain class) with :class:`SearchExperienceMaker`, the reward-stage schedule,
    ``search/*`` rollout statistics, the step's time split (:class:`~openrlhf_search.rl.step_timing.StepTimingMixin`)
    and search eval metrics. Same constructor as ``PPOTrainer``."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.experience_maker = SearchExperienceMaker(
            self.actor_model_group,
            self.critic_model_group,
            self.reward_model_group,
            self.reference_model_group,
            self.kl_ctl,
            self.strategy,
            self.tokenizer,
        )
        self.reward_schedule = RewardSchedule.from_args(self.args)
        self.active_reward_scheme: Optional[str] = None
        self._install_search_samples_generator()

    def _install_search_samples_generator(self) -> None:
        """Replace OpenRLHF's ``SamplesGenerator`` by :class:`SearchSamplesGenerator` (same state: strategy,
        dataloaders, tokenizer, engines): sampled-token lengths and the training-reward dynamic filter."""
        old = getattr(self, "samples_generator", None)
        if old is None or isinstance(old, SearchSamplesGenerator):
            return
        self.samples_generator = SearchSamplesGenerator(
            strategy=old.strategy,
            prompts_dataloader=old.prompts_dataloader,
            eval_dataloader=old.eval_dataloader,
            tokenizer=old.tokenizer,
            vllm_engines=old.vllm_engines,
        )

    def apply_reward_scheme(self, step: int) -> str:
        """Make the rollout actors score with the scheme of ``step``; returns it. On a switch (not the first
        call), samples buffered under the previous scheme are dropped (:meth:`_drop_samples_of_previous_stage`)."""
        scheme = self.reward_schedule.scheme_at(step)
        if scheme != self.active_reward_scheme:
            set_reward_scheme(self.vllm_engines, scheme)
            logger.info(f"reward stage {self.reward_schedule.stage_at(step)} from step {step}: {scheme}")
            if self.active_reward_scheme is not None:
                self._drop_samples_of_previous_stage(scheme)
            self.active_reward_scheme = scheme
        return scheme

    def _drop_samples_of_previous_stage(self, scheme: str) -> int:
        """Never train on samples scored under the previous stage's reward. Returns the count."""
        discard = getattr(self.samples_generator, "discard_buffer", None)
        n = discard() if callable(discard) else 0
        if n:
            logger.warning(f"reward scheme switched to {scheme}: dropped {n} buffered samples scored under "
                           f"{self.active_reward_scheme}")
        return n

    def init_checkpoint_states(self) -> Dict:
        states = super().init_checkpoint_states()
        self.apply_reward_scheme(int(states.get("global_step", 0)))
        return states

    def train_step(self, rollout_samples, global_step: int):
        stage = self.reward_schedule.stage_at(global_step)
        status, next_step = super().train_step(rollout_samples, global_step)
        status["search/reward_stage"] = float(stage)
        self.apply_reward_scheme(next_step)
        return status, next_step

    def _compute_rollout_stats(self, experiences) -> Dict:
        stats = super()._compute_rollout_stats(experiences)
        stats.update(valid_rollout_stats(experiences))  # failed samples out of rollout/*: they are not trained on
        stats.update(search_rollout_stats(experiences))
        stats.update(answer_list_stats(experiences))
        search_args = getattr(getattr(self, "args", None), "search", None)  # bare test trainers carry no args
        cut = turn_cut_warning(stats, getattr(search_args, "max_new_tokens_per_turn", None))
        if cut:
            logger.warning(cut)
        return stats

    @torch.no_grad()
    def evaluate(self, global_step, **generate_kwargs):
        """OpenRLHF's evaluation with the eval reward scheme and search metrics added to its logs."""
        import time

        start = time.time()
        train_scheme = self.active_reward_scheme
        eval_scheme = self.reward_schedule.eval_scheme
        switched = eval_scheme is not None and eval_scheme != train_scheme
        if switched:
            set_reward_scheme(self.vllm_engines, eval_scheme)
        try:
            samples = self.samples_generator.generate_eval_samples(**generate_kwargs)
        finally:
            if switched and train_scheme is not None:
                set_reward_scheme(self.vllm_engines, train_scheme)
        logs = compute_eval_metrics(self.eval_dataloader, samples, generate_kwargs["n_samples_per_prompt"])
        logs.update(search_eval_metrics(self.eval_dataloader, samples))
        if self.wandb_logger:
            self.wandb_logger.log_eval(global_step, logs)
        if self.tensorboard_logger:
            self.tensorboard_logger.log_eval(global_step, logs)
        elapsed = str(timedelta(seconds=time.time() - start)).split(".")[0]
        logger.info(f"✨ Evaluation completed in {elapsed}, global_step {global_step}, eval_metrics: {logs}")
        return logs


def trained_samples(experience) -> torch.Tensor:
    """[B] bool: the samples of a micro-batch that are trained on: retrieval did not fail and at least one action
    token is left (a failed sample's mask is zeroed by :class:`SearchExperienceMaker`; ``--data.max_len`` can cut a
    sample's actions away)."""
    mask = experience.action_mask
    has_actions = mask.reshape(len(mask), -1).sum(-1).cpu() > 0
    return has_actions & ~failed_mask(experience)


def trained_sample_status(status: Dict, trained: torch.Tensor) -> Dict:
    """OpenRLHF's per-micro-batch training status with samples not trained on left out.

    ``ActorPPOTrainer.training_step`` returns ``{"metrics", "weights", "num_samples", "num_action_tokens"}``;
    ``ppo_train`` averages every ``"sample"``-weighted metric (the per-sample ``info`` tensors: reward, return,
    response / total length, per-sample KL, the executor's search statistics) as ``mean(value) * num_samples``
    summed over micro-batches and ranks, divided by the summed ``num_samples``. Here each such [B] tensor keeps only
    the ``trained`` rows and ``num_samples`` becomes their count, so the logged means are over trained samples
    only. A micro-batch with none gets zeros and the weight :data:`EMPTY_MICRO_BATCH_WEIGHT` (the average divides
    by the summed weight; the keys stay, as the all-reduce needs them). Token-weighted metrics (losses, ``ppo_kl``,
    clip ratio) already aggregate over the action mask, which is zero on failed samples.

    Args:
        status: ``training_step``'s dict (changed in place and returned).
        trained: [B] bool from :func:`trained_samples`.
    """
    n_rows = len(trained)
    n = int(trained.sum())
    metrics, weights = status["metrics"], status["weights"]
    for key, weight in weights.items():
        value = metrics.get(key)
        if weight != "sample" or not torch.is_tensor(value) or value.dim() == 0 or value.shape[0] != n_rows:
            continue
        metrics[key] = value[trained.to(value.device)] if n else value.new_zeros((1,) + tuple(value.shape[1:]))
    status["num_samples"] = float(n) if n else EMPTY_MICRO_BATCH_WEIGHT
    return status


class SearchActorPPOTrainer(empty_mask_safe_actor_trainer()):
    """OpenRLHF's ``ActorPPOTrainer`` (through :class:`openrlhf_search.rl.loss.EmptyMaskSafeActorTrainer`) whose
    per-sample training statistics leave out samples that are not trained on (:func:`trained_sample_status`), and
    whose weight sync sends only the trained tensors when lower layers are frozen (``--actor.trainable_layers``)."""

    def training_step(self, experience, kl_ctl, step, loss_batch_info=None):
        trained = trained_samples(experience)
        status = super().training_step(experience, kl_ctl, step, loss_batch_info)
        return trained_sample_status(status, trained)

    def broadcast_to_vllm(self):
        """OpenRLHF's sync; with frozen layers it sends only ``requires_grad`` tensors (the engines loaded the frozen
        ones from the same checkpoint, and they never change). OpenRLHF's own filter does exactly that for a VLM
        (``p.requires_grad or not is_vlm``, :data:`SYNC_FILTER_LINE`), and ``is_vlm`` is read nowhere else during a
        sync, so the flag is raised for its duration instead of copying the method. With LoRA
        (``--ds.lora.rank``) the merged base-model weights are sent under vLLM's names (:meth:`_broadcast_lora`)."""
        if getattr(self.strategy.args.ds, "lora", None) is not None and (self.strategy.args.ds.lora.rank or 0) > 0:
            return self._broadcast_lora()
        if not getattr(self.strategy.args.actor, "trainable_layers", 0):
            return super().broadcast_to_vllm()
        saved = getattr(self.actor, "is_vlm", False)
        self.actor.is_vlm = True
        try:
            return super().broadcast_to_vllm()
        finally:
            self.actor.is_vlm = saved


    def _broadcast_lora(self) -> int:
        """The LoRA weight sync: OpenRLHF 0.11.2 would send the PEFT model's own parameters
        (``base_model.model....base_layer.weight``, ``...lora_A.default.weight``), which vLLM's ``load_weights``
        rejects. Here every base-model parameter is sent once, merged (``W + scaling x B @ A``, PEFT's own
        ``get_delta_weight``) and named as in the base model (:func:`lora_sync_tensors`), over OpenRLHF's transport
        (the model-update group or CUDA IPC, as ``ActorPPOTrainer.broadcast_to_vllm``); the trained weights stay
        unmerged. Every rank runs it (ZeRO-3 gathers are collective); rank 0 sends. Returns the tensors sent."""
        import torch.distributed as dist

        rank = dist.get_rank() if dist.is_initialized() else 0
        args = self.strategy.args
        cache_resets = []
        if getattr(args.vllm, "enable_prefix_caching", False) and rank == 0:
            cache_resets = [engine.reset_prefix_cache.remote() for engine in self.vllm_engines]
        cuda = torch.cuda.is_available()
        if cuda:
            torch.cuda.empty_cache()
        model = self.actor.model.module if hasattr(self.actor.model, "module") else self.actor.model
        names = lora_sync_names(model)
        sent = 0
        for name, tensor in lora_sync_tensors(model, zero3=args.ds.zero_stage == 3):
            sent += 1
            last = sent == len(names)
            if getattr(self, "use_cuda_ipc", False):
                self._lora_send_cuda_ipc(name, tensor, last, rank)
            elif rank == 0:
                refs = [engine.update_weight.remote(name, dtype=tensor.dtype, shape=tensor.shape, empty_cache=last)
                        for engine in self.vllm_engines]
                if getattr(args.vllm, "sync_with_ray", False):
                    import ray.util.collective as collective

                    collective.broadcast(tensor, 0, group_name=self._model_update_group)
                else:
                    self._model_update_group.broadcast(tensor, src=0,
                                                       stream=torch.cuda.current_stream() if cuda else None)
                ray.get(refs)
        if cache_resets:
            ray.get(cache_resets)
        if cuda:
            torch.cuda.empty_cache()
        if dist.is_initialized():
            from openrlhf.utils.distributed_util import torch_dist_barrier_and_cuda_sync

            torch_dist_barrier_and_cuda_sync()
        return sent

    def _lora_send_cuda_ipc(self, name, tensor, last: bool, rank: int) -> None:
        """One merged tensor over CUDA IPC, as OpenRLHF's ``_handle_cuda_ipc`` (every rank hands its handle)."""
        import torch.distributed as dist
        from openrlhf.utils.distributed_util import torch_dist_barrier_and_cuda_sync
        from openrlhf.trainer.ray.utils import get_physical_gpu_id
        from torch.multiprocessing.reductions import reduce_tensor

        handle = {get_physical_gpu_id(): reduce_tensor(tensor.clone())}
        handles = [None] * dist.get_world_size()
        dist.all_gather_object(handles, handle)
        if rank == 0:
            merged = {}
            for h in handles:
                merged.update(h)
            ray.get([engine.update_weight_cuda_ipc.remote(name, dtype=tensor.dtype, shape=tensor.shape,
                                                          ipc_handles=merged, empty_cache=last)
                     for engine in self.vllm_engines])
        torch_dist_barrier_and_cuda_sync()


LORA_PREFIX = "base_model.model."


def lora_sync_names(model) -> List[str]:
    """The base-model names (vLLM's) of a PEFT LoRA model's parameters, in :func:`lora_sync_tensors` order:
    ``base_model.model.`` dropped, ``.base_layer`` removed, the adapters' own tensors left out."""
    out = []
    for name, _ in model.named_parameters():
        if ".lora_" in name or ".lora_magnitude_vector" in name:
            continue
        out.append(_base_name(name))
    return out


def _base_name(name: str) -> str:
    if name.startswith(LORA_PREFIX):
        name = name[len(LORA_PREFIX):]
    return name.replace(".base_layer.", ".")


def lora_sync_tensors(model, zero3: bool = False):
    """Yield ``(base-model name, tensor)`` for every base parameter of a PEFT LoRA model, one at a time: a LoRA
    layer's weight merged with its active adapters (``base + get_delta_weight``, in the base weight's dtype), every
    other parameter as it is. Under ZeRO-3 the base weight and its adapters are gathered together (a collective:
    every rank must iterate). The model is not changed."""
    import deepspeed
    from peft.tuners.lora import LoraLayer

    modules = dict(model.named_modules())
    for name, param in list(model.named_parameters()):
        if ".lora_" in name or ".lora_magnitude_vector" in name:
            continue
        owner = modules.get(name.rsplit(".base_layer.", 1)[0]) if ".base_layer." in name else None
        merge = isinstance(owner, LoraLayer) and name.endswith(".base_layer.weight") and not owner.merged
        adapters = [a for a in (owner.active_adapters if merge else []) if a in owner.lora_A]
        extra = [p for a in adapters for p in (owner.lora_A[a].weight, owner.lora_B[a].weight)]
        # no_grad: the adapters require grad, so a merged tensor built under autograd is a non-leaf that
        # requires grad, and CUDA IPC's reduce_tensor refuses to serialise one
        with deepspeed.zero.GatheredParameters([param] + extra, enabled=zero3), torch.no_grad():
            tensor = param.data
            if adapters:
                delta = sum(owner.get_delta_weight(a) for a in adapters)
                tensor = (tensor.float() + delta.float()).to(param.dtype)
            elif zero3:
                tensor = tensor.clone()  # the gathered buffer is released on exit
        yield _base_name(name), tensor


# The line of openrlhf/trainer/ray/ppo_actor.py that SearchActorPPOTrainer.broadcast_to_vllm relies on (checked by
# tests/test_freeze.py against the installed OpenRLHF).
SYNC_FILTER_LINE = 'if p.requires_grad or not getattr(self.actor, "is_vlm", False)'


class SearchCriticPPOTrainer(CriticPPOTrainer):
    """OpenRLHF's ``CriticPPOTrainer`` whose logged status leaves out micro-batches without a trained sample.

    ``CriticPPOTrainer.ppo_train`` reports the unweighted mean of its micro-batches' ``critic_loss`` / ``values``
    (token means over the action mask, so failed samples inside a micro-batch are already left out), but a
    micro-batch of failed samples only contributes zeros and pulls the means down. Here the mean is over the
    micro-batches that hold an action token (summed over data-parallel ranks); ``critic_lr`` and
    ``critic_grad_norm`` are the last values, as OpenRLHF's actor reports them. Identical to OpenRLHF's numbers
    when no micro-batch is empty."""

    LAST_VALUE_KEYS = ("critic_lr", "critic_grad_norm")

    def training_step(self, experience, step, loss_batch_info=None):
        status = super().training_step(experience, step, loss_batch_info)
        tokens = float(experience.action_mask.sum().item())
        self._search_status.append((dict(status), tokens))
        return status

    def ppo_train(self):
        self._search_status = []
        status = super().ppo_train()
        kept = [s for s, tokens in self._search_status if tokens > 0]
        if not self._search_status:
            return status
        sums = {k: float(sum(s[k] for s in kept)) for k in self._search_status[0][0]
                if k not in self.LAST_VALUE_KEYS}
        sums["_count"] = float(len(kept))
        sums = self.strategy.all_reduce(sums, op="sum")
        count = sums.pop("_count")
        out = {k: (v / count if count else 0.0) for k, v in sums.items()}
        for k in self.LAST_VALUE_KEYS:
            if k in status:
                out[k] = status[k]
        return out


class _SearchPolicyModelActor(PolicyModelActor.__ray_actor_class__):
    """OpenRLHF policy actor whose PPO loss is :class:`openrlhf_search.rl.loss.MaskedPolicyLoss` and whose trainer
    is :class:`SearchActorPPOTrainer`. With ``--actor.trainable_layers K`` the lower layers are frozen before
    DeepSpeed builds the optimiser (:func:`openrlhf_search.rl.freeze.freeze_lower_layers`) and the update reuses the
    frozen layers' states of the experience forward (:class:`openrlhf_search.rl.freeze.TrunkCache`, ZeRO-0 to 2)."""

    trunk_cache = None
    reference_top = None

    def init_model_from_pretrained(self, strategy, *args, **kwargs):
        import openrlhf.trainer.ray.ppo_actor as ppo_actor

        install_into_openrlhf()  # rebinds the loss class looked up while the actor's trainer is built
        ppo_actor.ActorPPOTrainer = SearchActorPPOTrainer
        k = getattr(strategy.args.actor, "trainable_layers", 0)
        if not k:
            out = super().init_model_from_pretrained(strategy, *args, **kwargs)
        else:
            from openrlhf_search.rl.freeze import freeze_before_prepare

            from openrlhf_search.rl import shared_reference

            # ZeRO-3 gathers every layer in its own hooks whether it runs or not: no trunk cache there
            frozen = freeze_before_prepare(strategy, k, trunk_cache=strategy.args.ds.zero_stage < 3,
                                           keep_reference=shared_reference.enabled(strategy.args) is None)
            out = super().init_model_from_pretrained(strategy, *args, **kwargs)
            self.trunk_cache = frozen.get("trunk_cache")
            self.reference_top = frozen.get("reference_top")
        check_checkpoint_loaded(strategy.args, self.checkpoint_states)
        return out

    def reference_forward(self, sequences, action_mask=None, attention_mask=None, packed_seq_lens=None,
                          mm_train_inputs_list=None) -> torch.Tensor:
        """The reference model's action log-probs [B, A], computed here with the initial top layers over the frozen
        trunk (:mod:`openrlhf_search.rl.shared_reference`); the call and result of ``ReferenceModelActor.forward``.
        Raises RuntimeError when this actor keeps no reference (the run starts a reference model instead)."""
        from openrlhf_search.rl.shared_reference import reference_log_probs

        if self.reference_top is None:
            raise RuntimeError("reference_forward: this policy actor keeps no reference top (see "
                               "openrlhf_search.rl.shared_reference.enabled)")
        device = torch.cuda.current_device()
        self.actor.eval()
        try:
            log_probs = reference_log_probs(self.actor, self.reference_top, sequences.to(device),
                                            action_mask.to(device), attention_mask.to(device),
                                            ring_attn_group=self.strategy.ring_attn_group)
        finally:
            self.actor.train()
        return log_probs.to("cpu")

    def fit(self, kl_ctl: float = 0):
        status = super().fit(kl_ctl)
        if self.trunk_cache is not None:  # one rollout batch at a time: the next step's sequences are new
            status["trunk_cache_hits"] = float(self.trunk_cache.hits)
            self.trunk_cache.clear()
        return status

    def save_checkpoint(self, tag, client_states=None, metric_value=None, metric_key=None):
        """OpenRLHF's save, then the ``--ckpt.save_hf`` copies bounded like the DeepSpeed states: rank 0 keeps the
        newest ``--ckpt.max_num`` ``global_step*_hf`` and as many ``best_global_step*_hf`` folders
        (:func:`prune_hf_copies`; OpenRLHF rotates only the DeepSpeed states)."""
        out = super().save_checkpoint(tag, client_states=client_states, metric_value=metric_value,
                                      metric_key=metric_key)
        args = self.strategy.args
        if self.save_hf_ckpt and self.strategy.is_rank_0():
            prune_hf_copies(args.ckpt.path, args.ckpt.max_num)
        return out


def check_checkpoint_loaded(args, checkpoint_states: Dict) -> None:
    """Raise RuntimeError (one line) when ``--ckpt.load_enable`` loaded no state: OpenRLHF's actor only warns
    when DeepSpeed finds no checkpoint and then trains from step 0, over the run it was meant to continue."""
    if getattr(args.ckpt, "load_enable", False) and not checkpoint_states:
        raise RuntimeError(f"--ckpt.load_enable: no checkpoint was loaded from {os.path.join(args.ckpt.path, '_actor')}"
                           " (DeepSpeed found no complete state there); refusing to train from step 0 over the "
                           "run being resumed: fix the folder's 'latest' file, or start over without the flag")


def prune_hf_copies(ckpt_path: str, keep: int) -> List[str]:
    """Delete all but the ``keep`` newest (by step number) ``global_step<N>_hf`` folders in ``ckpt_path``, and
    likewise ``best_global_step<N>_hf``; returns the deleted paths. ``keep`` < 1 keeps everything."""
    import re
    import shutil

    if keep < 1 or not os.path.isdir(ckpt_path):
        return []
    removed = []
    for prefix in ("global_step", "best_global_step"):
        pattern = re.compile(rf"^{prefix}(\d+)_hf$")
        found = sorted((int(m.group(1)), name) for name in os.listdir(ckpt_path)
                       if (m := pattern.match(name)) and os.path.isdir(os.path.join(ckpt_path, name)))
        for _, name in found[:-keep]:
            shutil.rmtree(os.path.join(ckpt_path, name), ignore_errors=True)
            removed.append(os.path.join(ckpt_path, name))
    return removed


class _SearchCriticModelActor(CriticModelActor.__ray_actor_class__):
    """OpenRLHF critic actor whose value loss is :class:`openrlhf_search.rl.loss.MaskedValueLoss` and whose trainer
    is :class:`SearchCriticPPOTrainer`."""

    def init_model_from_pretrained(self, *args, **kwargs):
        import openrlhf.trainer.ray.ppo_critic as ppo_critic

        install_into_openrlhf()
        ppo_critic.CriticPPOTrainer = SearchCriticPPOTrainer
        return super().init_model_from_pretrained(*args, **kwargs)


# Same Ray options as OpenRLHF's decorators (@ray.remote on PPOTrainer, @ray.remote(num_gpus=1) on the actors).
SearchPPOTrainer = ray.remote(_SearchPPOTrainer)
SearchPolicyModelActor = ray.remote(num_gpus=1)(_SearchPolicyModelActor)
SearchCriticModelActor = ray.remote(num_gpus=1)(_SearchCriticModelActor)
