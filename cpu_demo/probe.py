"""Recording hooks on the real cluster path, for its end-to-end tests and ``benchmarks/bench_cluster_cpu.py``.

The CPU cluster mode's recording hook: a run loads it when ``OPENRLHF_SEARCH_PROBE_MODULE=cpu_demo.probe`` (see
:func:`probe_env`; :func:`openrlhf_search.cpu.cluster_mode.runtime.probe_hook` imports it in the driver and every Ray
worker). Off unless ``OPENRLHF_SEARCH_PROBE_DIR`` names a folder; then :func:`install` (run by the mode's Ray setup
hook in every worker) wraps, without changing what they compute:

* ``BasePPOTrainer.train_step`` / ``save_logs_and_checkpoints`` (trainer actor): one line of ``steps.jsonl`` per
  training step: the status dict OpenRLHF logs (every metric, ``timing/*`` included), the prompts and labels it
  trained on, and the checkpoint client states (episode, global step, consumed prompts); and, when asked, a hold at
  the end of one step (:func:`hold_at_step_end`) so that a test acts at that boundary;
* ``BasePPOTrainer.broadcast_to_vllm``: after every weight sync, the vLLM engine's parameters (read inside the
  engine worker) are compared with the policy's (read inside the DeepSpeed policy actor) -> ``sync.jsonl``
  (max |difference| per fused vLLM parameter, and a digest of the policy weights);
* ``SearchExperienceMaker.make_experience_batch``: the experience trained on -> ``experience_<n>.pt`` (sequences,
  masks, rewards, log-probs, values, the per-token KL that entered the reward, advantages, returns, info);
* ``ActorPPOTrainer.training_step`` (policy actor): per micro-batch the gradient of the loss with respect to the
  per-token log-probabilities, the log-probs, advantages, mask and policy loss -> ``policy_<n>.pt``; and the status
  ``ppo_train`` returns -> ``actor_status.jsonl``;
* the ``SearchAgentExecutor`` inside each vLLM actor (:func:`wrap_executor`, from :func:`wrap_rollout_actor`):
  prompt, response text, reward, the reward scheme the executor scored with and the process id ->
  ``executor_<pid>.jsonl``; and the wall-clock span of every search request -> ``retrieval_<pid>.jsonl``;
* the vLLM actor's ``generate`` (:func:`wrap_engine`): per request its prompt tokens and the tokens vLLM served from
  its prefix cache (``RequestOutput.num_cached_tokens``) -> ``prefill_<pid>.jsonl``; and every prefix-cache reset
  after a weight sync with its result -> ``cache_reset_<pid>.jsonl``;
* the prompt loader's position after each step (``data_loader_state_dict``, the state OpenRLHF checkpoints) ->
  ``loader_state_<step>.pt``;
* with ``OPENRLHF_SEARCH_PROBE_KILL_SAVE=<tag>``, DeepSpeed's save of that tag is killed midway (:func:`_kill_in_save`).

Files are written by the process that records them (one Ray node: one shared folder).
"""

import functools
import hashlib
import json
import os
import threading
import time
from typing import Any, Dict, List

ENV_DIR = "OPENRLHF_SEARCH_PROBE_DIR"
ENV_MODULE = "OPENRLHF_SEARCH_PROBE_MODULE"  # read by openrlhf_search.cpu.cluster_mode.runtime.probe_hook
_LOCK = threading.Lock()
_COUNTERS: Dict[str, int] = {}


def probe_dir():
    return os.environ.get(ENV_DIR) or None


def probe_env(folder: str) -> Dict[str, str]:
    """The environment variables that make a CPU-cluster run (``cli.train --cpu_cluster`` or a launcher with
    ``CPU_CLUSTER=1``) load this module and record into ``folder``."""
    return {ENV_MODULE: __name__, ENV_DIR: folder}


def _next(name: str) -> int:
    with _LOCK:
        _COUNTERS[name] = _COUNTERS.get(name, 0) + 1
        return _COUNTERS[name]


def _append_jsonl(name: str, row: Dict[str, Any]) -> None:
    path = os.path.join(probe_dir(), name)
    with _LOCK, open(path, "a", encoding="utf-8") as f:
        f.write(json.dumps(row, default=_jsonable) + "\n")


#: a file in the probe folder naming a step (e.g. "1"): the trainer waits at that step's end (see hold_at_step_end)
HOLD_FILE = "hold_after_step"


def hold_at_step_end(global_step: int, poll_s: float = 0.2, timeout_s: float = 3600.0) -> bool:
    """Wait at the end of step ``global_step`` (its logs and checkpoint written, the next rollout not begun) when the
    probe folder's :data:`HOLD_FILE` names that step: write ``held_<step>``, then wait until ``release_<step>`` exists
    (or ``timeout_s`` passes). A test then acts at that exact step boundary (kills the retriever or the launcher)
    instead of racing the trainer. Returns whether it held."""
    try:
        with open(os.path.join(probe_dir(), HOLD_FILE), encoding="utf-8") as f:
            if int(f.read().strip()) != global_step:
                return False
    except (OSError, ValueError):  # no hold asked for
        return False
    open(os.path.join(probe_dir(), f"held_{global_step}"), "w").close()
    release, deadline = os.path.join(probe_dir(), f"release_{global_step}"), time.time() + timeout_s
    while not os.path.exists(release) and time.time() < deadline:
        time.sleep(poll_s)
    return True


def _jsonable(x):
    try:
        import torch

        if torch.is_tensor(x):
            return x.tolist()
    except ImportError:  # pragma: no cover
        pass
    return str(x)


def _save(name: str, obj) -> None:
    import torch

    path = os.path.join(probe_dir(), name)
    torch.save(obj, path + ".tmp")
    os.replace(path + ".tmp", path)


# ---------------------------------------------------------------------------------------------------- weights
FUSED = {"q_proj": ("qkv_proj", 0), "k_proj": ("qkv_proj", 1), "v_proj": ("qkv_proj", 2),
         "gate_proj": ("gate_up_proj", 0), "up_proj": ("gate_up_proj", 1)}


def vllm_view(hf_params: Dict[str, Any]) -> Dict[str, Any]:
    """HF parameter dict -> the parameters vLLM's Qwen2/Llama hold: q/k/v concatenated into ``qkv_proj`` and
    gate/up into ``gate_up_proj`` along dim 0 (vLLM's ``stacked_params_mapping``), ``lm_head`` dropped when tied."""
    import torch

    out, parts = {}, {}
    for name, p in hf_params.items():
        prefix, _, leaf = name.rpartition(".")
        mod_prefix, _, mod = prefix.rpartition(".")
        if mod in FUSED:
            fused, idx = FUSED[mod]
            parts.setdefault(f"{mod_prefix}.{fused}.{leaf}", {})[idx] = p
        else:
            out[name] = p
    for name, pieces in parts.items():
        out[name] = torch.cat([pieces[i] for i in sorted(pieces)], dim=0)
    return out


def compare_weights(policy: Dict[str, Any], engine: Dict[str, Any]) -> Dict[str, Any]:
    """Max |engine - policy| per vLLM parameter (rows of a padded vocabulary beyond the policy's are ignored).

    Returns {"max_abs_diff", "n_compared", "missing_in_engine", "not_from_policy", "per_param"}."""
    view = vllm_view(policy)
    per, missing = {}, []
    for name, p in view.items():
        e = engine.get(name)
        if e is None:
            if name.startswith("lm_head.") and "model.embed_tokens.weight" in engine:
                continue  # tied: vLLM keeps one matrix
            missing.append(name)
            continue
        e = e[: p.shape[0]] if e.dim() and e.shape[0] > p.shape[0] else e
        per[name] = float((e.float() - p.float()).abs().max()) if e.shape == p.shape else float("inf")
    extra = sorted(set(engine) - set(view))
    return {"max_abs_diff": max(per.values()) if per else float("inf"), "n_compared": len(per),
            "missing_in_engine": missing, "not_from_policy": extra, "per_param": per}


def digest(params: Dict[str, Any]) -> str:
    h = hashlib.sha1()
    for name in sorted(params):
        h.update(name.encode())
        h.update(params[name].float().numpy().tobytes())
    return h.hexdigest()


def _rank() -> int:
    """This process's rank in its DeepSpeed model group (0 without torch.distributed)."""
    import torch.distributed as dist

    return dist.get_rank() if dist.is_available() and dist.is_initialized() else 0


def _policy_named_parameters(actor) -> Dict[str, Any]:
    """Runs in each policy actor (``__ray_call__``): its DeepSpeed module's full parameters on CPU. Under ZeRO-3 each
    parameter is gathered on its own (a collective: call it on every rank of the group at once); one gather of many
    parameters takes DeepSpeed's coalesced path, which on gloo can hand back a buffer still being filled
    (``cpu/cluster_mode/runtime.py``, :data:`~openrlhf_search.cpu.cluster_mode.settings.ZERO3_CPU_SETTINGS`)."""
    model = actor.actor.model.module if hasattr(actor.actor.model, "module") else actor.actor.model
    if hasattr(model, "peft_config"):  # LoRA: the merged base-model weights the sync sends, under vLLM's names
        from openrlhf_search.rl.trainer import lora_sync_tensors

        zero3 = any(hasattr(p, "ds_id") for p in model.parameters())
        return {n: t.detach().to("cpu").clone() for n, t in lora_sync_tensors(model, zero3=zero3)}
    named = list(model.named_parameters())
    if any(hasattr(p, "ds_id") for _, p in named):  # ZeRO-3 partitioned parameters
        import deepspeed

        out = {}
        for n, p in named:
            with deepspeed.zero.GatheredParameters([p]):  # one parameter: DeepSpeed's sequential, blocking gather
                out[n] = p.detach().to("cpu").clone()
        return out
    return {n: p.detach().to("cpu").clone() for n, p in named}


# ---------------------------------------------------------------------------------------------------- trainer hooks
def _wrap_trainer(module) -> None:
    cls = module.BasePPOTrainer
    if getattr(cls, "_probe_installed", False):
        return
    train_step, broadcast, save = cls.train_step, cls.broadcast_to_vllm, cls.save_logs_and_checkpoints

    @functools.wraps(train_step)
    def probed_train_step(self, rollout_samples, global_step):
        self._probe_prompts = [p for s in rollout_samples for p in s.prompts]
        self._probe_labels = [lab for s in rollout_samples for lab in (s.labels or [])]
        return train_step(self, rollout_samples, global_step)

    @functools.wraps(save)
    def probed_save(self, global_step, logs_dict=None, client_states=None):
        # fit() calls this once per step with the full status (timing/generation and step_total included)
        row = {k: v for k, v in (logs_dict or {}).items() if k != "generated_samples"}
        states = {k: v for k, v in (client_states or {}).items() if k != "data_loader_state_dict"}
        if (client_states or {}).get("data_loader_state_dict"):  # where the data resumes after this step
            _save(f"loader_state_{global_step}.pt", client_states["data_loader_state_dict"])
        _append_jsonl("steps.jsonl", {"global_step": global_step, "prompts": getattr(self, "_probe_prompts", []),
                                      "labels": getattr(self, "_probe_labels", []), "status": row,
                                      "client_states": states, "time": time.time(), "pid": os.getpid()})
        out = save(self, global_step, logs_dict, client_states)
        hold_at_step_end(global_step)
        return out

    @functools.wraps(broadcast)
    def probed_broadcast(self):
        import ray

        out = broadcast(self)
        # every rank at once (a ZeRO-3 gather is collective); each must hold the weights rank 0 broadcast
        per_rank = ray.get([h.__ray_call__.remote(_policy_named_parameters)
                            for h in self.actor_model_group._actor_handlers])
        policy = per_rank[0]
        rows = []
        for i, engine in enumerate(self.vllm_engines or []):
            weights = ray.get(engine.engine_named_parameters.remote())
            cmp = compare_weights(policy, weights)
            rows.append({"engine": i, **{k: cmp[k] for k in ("max_abs_diff", "n_compared", "missing_in_engine",
                                                             "not_from_policy")},
                         # layers computing from a packed copy would ignore the synced weights compared above
                         "packed_layers": ray.get(engine.engine_packed_layers.remote())})
        ranks = [digest(p) for p in per_rank]
        # where another rank differs from rank 0: parameter -> max |difference| (empty when the ranks agree)
        rank_diffs = [{n: float((t.float() - policy[n].float()).abs().max()) for n, t in p.items()
                       if n in policy and (t.shape != policy[n].shape or not bool((t == policy[n]).all()))}
                      for p in per_rank[1:]]
        _append_jsonl("sync.jsonl", {"call": _next("sync"), "policy_digest": digest(policy), "engines": rows,
                                     "rank_digests": ranks, "rank_diffs": rank_diffs, "time": time.time()})
        return out

    cls.train_step = probed_train_step
    cls.save_logs_and_checkpoints = probed_save
    cls.broadcast_to_vllm = probed_broadcast
    cls._probe_installed = True


def _experience_record(exp) -> Dict[str, Any]:
    import torch

    fields = ("sequences", "attention_mask", "action_mask", "action_log_probs", "base_action_log_probs",
              "rollout_log_probs", "values", "returns", "advantages", "rewards", "scores", "index", "prompts",
              "labels", "response_length")
    rec = {}
    for f in fields:
        v = getattr(exp, f, None)
        rec[f] = v.detach().cpu().clone() if torch.is_tensor(v) else v
    rec["info"] = {k: (v.detach().cpu().clone() if torch.is_tensor(v) else v) for k, v in exp.info.items()}
    rec["kl"] = getattr(exp, "_probe_kl", None)  # per-token KL, before the advantages consumed it
    return rec


def _wrap_experience_maker(module) -> None:
    cls = module.SearchExperienceMaker
    if getattr(cls, "_probe_installed", False):
        return
    make, forwards = cls.make_experience_batch, cls.make_experience

    @functools.wraps(forwards)
    def probed_forwards(self, samples_list):
        experiences = forwards(self, samples_list)
        for e in experiences:  # OpenRLHF drops the reference log-probs when the KL goes into the reward
            e._probe_kl = e.kl.detach().cpu().clone() if e.kl is not None else None
        return experiences

    @functools.wraps(make)
    def probed(self, rollout_samples):
        experiences = make(self, rollout_samples)
        args = self.strategy.args
        settings = {"estimator": args.algo.advantage.estimator, "gamma": args.algo.advantage.gamma,
                    "lambd": args.algo.advantage.lambd, "n_samples_per_prompt": args.rollout.n_samples_per_prompt,
                    "kl_coef": self.kl_ctl.value, "kl_estimator": args.algo.kl.estimator,
                    "kl_use_loss": args.algo.kl.use_loss, "no_std_norm": args.algo.advantage.no_std_norm,
                    "temperature": args.rollout.temperature, "eps_clip": args.actor.eps_clip,
                    "value_clip": args.critic.value_clip, "loss_agg_mode": args.actor.loss_agg_mode}
        _save(f"experience_{_next('experience')}.pt",
              {"settings": settings, "experiences": [_experience_record(e) for e in experiences]})
        return experiences

    cls.make_experience_batch = probed
    cls.make_experience = probed_forwards
    cls._probe_installed = True


def _wrap_actor_trainer(module) -> None:
    cls = module.ActorPPOTrainer
    if getattr(cls, "_probe_installed", False):
        return
    training_step, ppo_train = cls.training_step, cls.ppo_train

    @functools.wraps(training_step)
    def probed_step(self, experience, kl_ctl, step, loss_batch_info=None):
        import torch

        real_loss = self.actor_loss_fn
        seen: Dict[str, Any] = {}

        def loss_fn(log_probs, *args, **kwargs):
            if log_probs.requires_grad:
                log_probs.register_hook(lambda g: seen.__setitem__("grad", g.detach().cpu().clone()))
            out = real_loss(log_probs, *args, **kwargs)
            seen.update(log_probs=log_probs.detach().cpu().clone(), loss=float(out[0].detach()),
                        kwargs={k: (float(v) if torch.is_tensor(v) and v.numel() == 1 else v)
                                for k, v in kwargs.items() if k != "rollout_log_probs"})
            return out

        self.actor_loss_fn = loss_fn
        try:
            status = training_step(self, experience, kl_ctl, step, loss_batch_info)
        finally:
            self.actor_loss_fn = real_loss
        batches = getattr(self, "_probe_batches", [])
        batches.append({"sequences": experience.sequences.detach().cpu().clone(),
                        "attention_mask": experience.attention_mask.detach().cpu().clone(),
                        "action_mask": experience.action_mask.detach().cpu().clone(),
                        "advantages": experience.advantages.detach().cpu().clone(),
                        "old_log_probs": experience.action_log_probs.detach().cpu().clone(),
                        "retrieval_failed": experience.info.get("retrieval_failed"),
                        "logp_grad": seen.get("grad"), "log_probs": seen.get("log_probs"),
                        "policy_loss": seen.get("loss"), "loss_kwargs": seen.get("kwargs")})
        self._probe_batches = batches
        return status

    @functools.wraps(ppo_train)
    def probed_train(self, kl_ctl):
        self._probe_batches = []
        status = ppo_train(self, kl_ctl)
        n, rank = _next("policy"), _rank()
        _save(f"policy_{n}.pt" if rank == 0 else f"policy_{n}_rank{rank}.pt", self._probe_batches)
        _append_jsonl("actor_status.jsonl", {"call": n, "rank": rank, "status": status, "pid": os.getpid()})
        self._probe_batches = []
        return status

    cls.training_step = probed_step
    cls.ppo_train = probed_train
    cls._probe_installed = True


def wrap_rollout_actor(actor) -> None:
    """Record what the CPU rollout actor ``actor`` runs (its executor and its engine's requests); called by the actor
    once its engine is up. A no-op without ``OPENRLHF_SEARCH_PROBE_DIR``."""
    wrap_executor(getattr(actor, "executor", None))
    wrap_engine(actor)


def wrap_executor(executor) -> None:
    """Record every trajectory ``executor`` (the ``SearchAgentExecutor`` OpenRLHF built inside a vLLM actor) rolls
    out; a no-op without ``OPENRLHF_SEARCH_PROBE_DIR``.

    (OpenRLHF loads the agent file as a fresh module ``agent_module``, so the instance is wrapped, not the class.)"""
    if not probe_dir() or executor is None or getattr(executor, "_probe_installed", False):
        return
    execute = executor.execute

    async def probed(prompt, label, sampling_params, max_length, hf_tokenizer, llm_engine, images=None):
        scheme = getattr(getattr(executor, "config", None), "reward_scheme", None)
        out = await execute(prompt, label, sampling_params, max_length, hf_tokenizer, llm_engine, images)
        _append_jsonl(f"executor_{os.getpid()}.jsonl",
                      {"prompt": prompt, "label": label, "response_text": out.get("response_text"),
                       "reward": out["reward"], "scheme": scheme, "extra_logs": out["extra_logs"],
                       "action_ranges": out["action_ranges"], "n_tokens": len(out["observation_tokens"]),
                       "pid": os.getpid(), "time": time.time()})
        return out

    executor.execute = probed
    client = getattr(executor, "client", None)
    if client is not None and callable(getattr(client, "search", None)):  # wall-clock spans of retrieval (benchmark)
        from openrlhf_search.rl.step_timing import time_searches

        time_searches(client, lambda start, end, ok: _append_jsonl(f"retrieval_{os.getpid()}.jsonl",
                                                                   {"start": start, "end": end, "ok": ok}))
    executor._probe_installed = True


def wrap_engine(actor) -> None:
    """Record, per request of the vLLM actor ``actor`` (``RolloutRayActor.generate``, what the executor calls every
    turn), the prompt tokens and how many of them vLLM took from its prefix cache -> ``prefill_<pid>.jsonl`` rows
    ``{"prompt_tokens", "cached_tokens", "output_tokens", "start", "end"}`` (read by :func:`prefill_summary`).
    A no-op without ``OPENRLHF_SEARCH_PROBE_DIR``."""
    if not probe_dir() or actor is None or getattr(actor, "_probe_engine_installed", False):
        return
    generate = actor.generate

    async def probed_generate(prompt_token_ids, sampling_params, multi_modal_data=None):
        t0 = time.time()
        out = await generate(prompt_token_ids, sampling_params, multi_modal_data)
        _append_jsonl(f"prefill_{os.getpid()}.jsonl",
                      {"prompt_tokens": len(prompt_token_ids), "cached_tokens": int(out.num_cached_tokens or 0),
                       "output_tokens": sum(len(o.token_ids) for o in out.outputs), "start": t0, "end": time.time()})
        return out

    actor.generate = probed_generate
    actor._probe_engine_installed = True


def record_cache_reset(ok: bool) -> None:
    """One ``cache_reset_<pid>.jsonl`` row per prefix-cache reset after a weight sync (no-op without the probe)."""
    if probe_dir():
        _append_jsonl(f"cache_reset_{os.getpid()}.jsonl", {"ok": bool(ok), "time": time.time()})


KILL_SAVE_ENV = "OPENRLHF_SEARCH_PROBE_KILL_SAVE"


def _kill_in_save(module) -> None:
    """With ``OPENRLHF_SEARCH_PROBE_KILL_SAVE=<tag>``: DeepSpeed's save of that tag creates the tag's folder and
    then SIGKILLs its own process, as a node lost midway through a save (OpenRLHF's rotation has already run)."""
    import signal

    cls = module.DeepSpeedEngine
    if getattr(cls, "_probe_kill_installed", False):
        return
    save = cls.save_checkpoint

    @functools.wraps(save)
    def killed_save(self, save_dir, tag=None, *args, **kwargs):
        if tag is not None and tag == os.environ.get(KILL_SAVE_ENV):
            os.makedirs(os.path.join(save_dir, tag), exist_ok=True)
            os.kill(os.getpid(), signal.SIGKILL)
        return save(self, save_dir, tag, *args, **kwargs)

    cls.save_checkpoint = killed_save
    cls._probe_kill_installed = True


HOOKS = (
    ("openrlhf.trainer.ppo_trainer", _wrap_trainer),
    ("openrlhf_search.rl.experience_maker", _wrap_experience_maker),
    ("openrlhf.trainer.ray.ppo_actor", _wrap_actor_trainer),
)


def install() -> bool:
    """Register the recording hooks when ``OPENRLHF_SEARCH_PROBE_DIR`` is set; returns whether it is."""
    if not probe_dir():
        return False
    import wrapt

    os.makedirs(probe_dir(), exist_ok=True)
    for name, hook in HOOKS:
        wrapt.register_post_import_hook(hook, name)
    if os.environ.get(KILL_SAVE_ENV):
        wrapt.register_post_import_hook(_kill_in_save, "deepspeed.runtime.engine")
    return True


# ---------------------------------------------------------------------------------------------------- reading
def read_jsonl(path: str) -> List[Dict[str, Any]]:
    if not os.path.exists(path):
        return []
    with open(path, encoding="utf-8") as f:
        return [json.loads(line) for line in f if line.strip()]


def read_executor_records(folder: str, prefix: str = "executor_") -> List[Dict[str, Any]]:
    """Every ``<prefix><pid>.jsonl`` row of ``folder`` (all vLLM actors), in time order."""
    rows = []
    for name in sorted(os.listdir(folder)):
        if name.startswith(prefix) and name.endswith(".jsonl"):
            rows += read_jsonl(os.path.join(folder, name))
    return sorted(rows, key=lambda r: r.get("time", r.get("start", 0.0)))


def prefill_summary(records: List[Dict[str, Any]]) -> Dict[str, Any]:
    """Prefill work of a set of vLLM requests from :func:`wrap_engine`'s rows.

    Each row's ``prompt_tokens`` (what the request sent, the whole context so far in a multi-turn rollout) and
    ``cached_tokens`` (vLLM's ``RequestOutput.num_cached_tokens``: prompt tokens whose KV came from the prefix cache,
    never computed). Returns ``{"requests", "prompt_tokens", "cached_tokens", "computed_tokens",
    "computed_fraction"}``: computed = prompt - cached, the prefill the engine actually ran; the fraction is
    computed / prompt (1.0 without caching; None for no prompt tokens). Raises ValueError for a row with negative
    counts or more cached tokens than prompt tokens (a miscounted row would fake a saving).
    """
    prompt = cached = 0
    for r in records:
        p, c = int(r["prompt_tokens"]), int(r.get("cached_tokens") or 0)
        if p < 0 or c < 0 or c > p:
            raise ValueError(f"prefill record with prompt_tokens={p} cached_tokens={c}")
        prompt, cached = prompt + p, cached + c
    return {"requests": len(records), "prompt_tokens": prompt, "cached_tokens": cached,
            "computed_tokens": prompt - cached, "computed_fraction": (prompt - cached) / prompt if prompt else None}


def split_by_step(records: List[Dict[str, Any]], step_ends: List[float]) -> List[List[Dict[str, Any]]]:
    """Requests per training step of a synchronous run: the rows whose ``end`` falls after the previous step's end
    and by this one's (``step_ends``: the probe's ``steps.jsonl`` ``time`` of each step, ascending; a step's rollout
    finishes before the step is logged). Rows after the last step (none in a finished run) are left out."""
    out: List[List[Dict[str, Any]]] = [[] for _ in step_ends]
    for r in records:
        for i, end in enumerate(step_ends):
            if r["end"] <= end and (i == 0 or r["end"] > step_ends[i - 1]):
                out[i].append(r)
                break
    return out
