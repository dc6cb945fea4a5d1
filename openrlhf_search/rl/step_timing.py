"""Where a training step's wall time goes, logged every step (sync and async trainers) and printed as one line.

OpenRLHF 0.11.2 already logs ``timing/generation``, ``timing/make_experience`` (experience: reference / critic
forwards, advantages), ``timing/ppo_train`` (update), ``timing/broadcast`` (weight sync) and ``timing/step_total``
(``ppo_trainer.py`` ``train_step`` / ``fit``; ``ppo_trainer_async.py`` ``TrainingActor.fit``). Added here, per rollout
batch, from instruments installed inside each vLLM rollout actor through Ray's ``actor.__ray_call__`` (no OpenRLHF
class is changed; :func:`install_in_rollout_actor`):

* ``retrieval/*`` (:func:`retrieval_stats`): every ``search`` call of the executor's retrieval client, as the
  trajectory waits for it (coalescing window included): counts, latency percentiles, searches per second of
  generation, the client's retries / failovers / attempts, and against a web retriever its calls, cache hits, skips
  and cost (``RetrievalClient.stats``), per step and since the engines started;
* ``step_time/search_in_flight_s``: wall time during the batch's generation with at least one search in flight in
  any engine (the union of the calls' spans), and its fraction of the generation time;
* async mode (:mod:`openrlhf_search.rl.async_trainer`): ``async/trainer_wait_s`` (the trainer blocked on the rollout
  queue), ``async/engine_wait_s`` (the generator blocked on a queue slot or on the vLLM lock of a weight sync), and
  the policy staleness of trajectories and tokens (:mod:`openrlhf_search.env.policy_versions`).

Units: seconds unless the key says ms; rates per second. The rollout-side figures travel with the batch as the
attribute :data:`TIMING_ATTR` of its first ``Experience`` (set by ``SearchSamplesGenerator.generate_samples``), so in
async mode they describe the batch being trained, not the one being generated.
"""

import logging
import math
import time
from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple

logger = logging.getLogger(__name__)

TIMING_ATTR = "_search_rollout_timing"
VERSION_ATTR = "_search_policy_version"  # on the rollout actor: the trainer step whose weights it holds
# RetrievalClient.stats of a web retriever
WEB_COUNTER_KEYS = ("web_calls", "web_cache_hits", "web_skipped", "web_credits", "web_usd")


# ---------------------------------------------------------------------------------------------------- rollout actor
def time_searches(client, record: Callable[[float, float, bool], None]) -> None:
    """Wrap ``client.search`` (async) so that every call ends with ``record(start, end, ok)``: wall-clock seconds
    since the epoch, and whether the search returned (False when it raised)."""
    search = client.search

    async def timed_search(query, *args, **kwargs):
        start, ok = time.time(), False
        try:
            out = await search(query, *args, **kwargs)
            ok = True
            return out
        finally:
            record(start, time.time(), ok)

    client.search = timed_search


def install_in_rollout_actor(actor, record_versions: bool = False) -> bool:
    """Runs inside a vLLM rollout actor (``actor.__ray_call__``): time every ``search`` of its executor's client and,
    with ``record_versions``, add ``policy_version_start`` / ``_end`` (the actor's :data:`VERSION_ATTR` when the
    trajectory began / ended) to every trajectory's ``extra_logs`` and tag every generated token with the version
    that produced it (:func:`openrlhf_search.env.policy_versions.wrap_llm_generate` on the actor's vLLM engine).
    Idempotent; returns whether a client was found."""
    executor = getattr(actor, "executor", None)
    client = getattr(executor, "client", None)
    if client is not None and not hasattr(client, "_search_spans") and callable(getattr(client, "search", None)):
        spans: List[Tuple[float, float, bool]] = []
        time_searches(client, lambda start, end, ok: spans.append((start, end, ok)))
        client._search_spans = spans
    if record_versions and executor is not None and not getattr(executor, "_search_versioned", False):
        execute = executor.execute

        async def versioned_execute(*args, **kwargs):  # OpenRLHF calls it with keywords (vllm_engine.py:196)
            start = getattr(actor, VERSION_ATTR, 0)
            out = await execute(*args, **kwargs)
            logs = out.setdefault("extra_logs", {})
            logs["policy_version_start"] = float(start)
            logs["policy_version_end"] = float(getattr(actor, VERSION_ATTR, 0))
            return out

        executor.execute = versioned_execute
        executor._search_versioned = True
    llm = getattr(actor, "llm", None)
    if record_versions and llm is not None and callable(getattr(llm, "generate", None)):
        from openrlhf_search.env.policy_versions import wrap_llm_generate

        wrap_llm_generate(llm, lambda: getattr(actor, VERSION_ATTR, 0))  # per-token versions (policy_versions)
    return client is not None


def drain_rollout_actor(actor) -> Dict[str, Any]:
    """Runs inside a vLLM rollout actor: the search spans recorded since the last drain (emptied) and a copy of the
    client's counters."""
    client = getattr(getattr(actor, "executor", None), "client", None)
    spans = getattr(client, "_search_spans", None)
    out = list(spans) if spans is not None else []
    if spans is not None:
        spans.clear()
    return {"spans": out, "counters": dict(getattr(client, "stats", None) or {})}


def set_policy_version(actor, version: int) -> int:
    """Runs inside a vLLM rollout actor: record that it now holds the weights of trainer step ``version``."""
    setattr(actor, VERSION_ATTR, int(version))
    return int(version)


class RolloutTimer:
    """Retrieval figures of one generation window over a list of rollout actors (``SearchSamplesGenerator``).

    ``start()`` installs the instruments (first call), drops spans left over from earlier calls (an evaluation) and
    snapshots the counters; ``finish()`` drains and returns :func:`retrieval_stats` of the window."""

    def __init__(self, engines: Sequence, record_versions: bool = False):
        # Ray actor handles only (unit tests hand the generator plain objects, which have no instruments)
        self.engines = [e for e in engines or [] if hasattr(e, "__ray_call__")]
        self.record_versions = record_versions
        self._installed = False
        self._counters: List[Dict[str, float]] = []
        self._t0 = 0.0

    def _call_all(self, fn, *args) -> List[Any]:
        import ray

        return ray.get([e.__ray_call__.remote(fn, *args) for e in self.engines])

    def start(self) -> None:
        if not self.engines:
            return
        if not self._installed:
            self._call_all(install_in_rollout_actor, self.record_versions)
            self._installed = True
        self._counters = [d["counters"] for d in self._call_all(drain_rollout_actor)]
        self._t0 = time.time()

    def finish(self) -> Dict[str, float]:
        if not self.engines:
            return {}
        t1 = time.time()
        drained = self._call_all(drain_rollout_actor)
        spans = [s for d in drained for s in d["spans"]]
        return retrieval_stats(spans, (self._t0, t1), self._counters, [d["counters"] for d in drained])


# ---------------------------------------------------------------------------------------------------- figures
def quantile(values: Sequence[float], q: float) -> float:
    """Linear-interpolation quantile (numpy's default) of a non-empty sequence; NaN when empty."""
    if not values:
        return float("nan")
    v = sorted(values)
    pos = (len(v) - 1) * q
    lo, hi = math.floor(pos), math.ceil(pos)
    return v[lo] + (v[hi] - v[lo]) * (pos - lo)


def union_seconds(spans: Sequence[Tuple[float, float]], window: Tuple[float, float]) -> float:
    """Length of the union of ``[start, end]`` spans clipped to ``window``, seconds."""
    w0, w1 = window
    clipped = sorted((max(s, w0), min(e, w1)) for s, e in spans if min(e, w1) > max(s, w0))
    total, cur_s, cur_e = 0.0, None, None
    for s, e in clipped:
        if cur_e is None or s > cur_e:
            if cur_e is not None:
                total += cur_e - cur_s
            cur_s, cur_e = s, e
        else:
            cur_e = max(cur_e, e)
    if cur_e is not None:
        total += cur_e - cur_s
    return total


def retrieval_stats(spans: Sequence[Tuple[float, float, bool]], window: Tuple[float, float],
                    counters_before: Sequence[Dict[str, float]], counters_after: Sequence[Dict[str, float]]
                    ) -> Dict[str, float]:
    """Figures of one generation window.

    Args:
        spans: (start, end, ok) wall-clock seconds of every search call in the window, all engines.
        window: (start, end) of the generation, seconds.
        counters_before, counters_after: each engine's ``RetrievalClient.stats`` at the window's ends.
    Returns:
        ``retrieval/searches``, ``failed_searches``, ``latency_p50_ms``, ``latency_p99_ms`` (NaN without a search),
        ``qps``, ``retries``, ``failovers``, ``attempts``, ``step_time/search_in_flight_s`` /
        ``step_time/search_in_flight_frac``, and ``retrieval/web_calls``, ``web_cache_hits``, ``web_skipped``,
        ``web_credits``, ``web_usd`` (this window) and ``web_credits_run``, ``web_usd_run`` (since the clients
        started) once any engine's client has counted a web answer (never against a local index).
    """
    duration = max(window[1] - window[0], 1e-9)
    latencies = [(e - s) * 1000.0 for s, e, _ok in spans]
    out = {
        "retrieval/searches": float(len(spans)),
        "retrieval/failed_searches": float(sum(1 for *_, ok in spans if not ok)),
        "retrieval/latency_p50_ms": quantile(latencies, 0.5),
        "retrieval/latency_p99_ms": quantile(latencies, 0.99),
        "retrieval/qps": len(spans) / duration,
    }
    for key, name in (("retries", "retries"), ("failovers", "failovers"), ("requests", "attempts")):
        out[f"retrieval/{name}"] = float(sum(a.get(key, 0) - b.get(key, 0)
                                             for b, a in zip(counters_before, counters_after)))
    if any(a.get(key) for a in counters_after for key in WEB_COUNTER_KEYS):
        for key in WEB_COUNTER_KEYS:
            out[f"retrieval/{key}"] = float(sum(a.get(key, 0) - b.get(key, 0)
                                                for b, a in zip(counters_before, counters_after)))
        for key in ("web_credits", "web_usd"):  # since the engines' clients started: the run so far
            out[f"retrieval/{key}_run"] = float(sum(a.get(key, 0) for a in counters_after))
    in_flight = union_seconds([(s, e) for s, e, _ in spans], window)
    out["step_time/search_in_flight_s"] = in_flight
    out["step_time/search_in_flight_frac"] = in_flight / duration
    return out


def attach(samples: List, timing: Dict[str, float]) -> None:
    """Carry ``timing`` with a rollout batch (attribute of its first sample; pickled with it across Ray)."""
    if samples:
        setattr(samples[0], TIMING_ATTR, dict(timing))


def attached(samples: List) -> Dict[str, float]:
    """What :func:`attach` put on a batch ({} when nothing)."""
    return dict(getattr(samples[0], TIMING_ATTR, None) or {}) if samples else {}


# ---------------------------------------------------------------------------------------------------- the line
def _f(status: Dict[str, Any], key: str) -> Optional[float]:
    value = status.get(key)
    try:
        value = float(value)
    except (TypeError, ValueError):
        return None
    return value


def split_line(global_step: int, status: Dict[str, Any]) -> str:
    """One printable line of a step's time split from its logged status (keys absent are left out)."""
    def sec(key):
        v = _f(status, key)
        return None if v is None else f"{v:.1f} s"

    parts = []
    gen = sec("timing/generation")
    if gen is not None:
        detail = []
        if _f(status, "retrieval/searches") is not None:
            detail.append(f"search in flight {status['step_time/search_in_flight_s']:.1f} s")
            detail.append(f"{int(status['retrieval/searches'])} searches")
            if status["retrieval/searches"]:
                detail.append(f"p50 {status['retrieval/latency_p50_ms']:.0f} ms, "
                              f"p99 {status['retrieval/latency_p99_ms']:.0f} ms")
            detail.append(f"{status['retrieval/qps']:.1f} qps")
            detail.append(f"{int(status['retrieval/retries'])} retries, {int(status['retrieval/failovers'])} "
                          "failovers")
            if _f(status, "retrieval/web_calls") is not None:
                web = (f"{int(status['retrieval/web_calls'])} web calls, "
                       f"{int(status.get('retrieval/web_cache_hits', 0))} cache hits")
                if status.get("retrieval/web_skipped"):
                    web += f", {int(status['retrieval/web_skipped'])} skipped by the web budget"
                if _f(status, "retrieval/web_usd_run"):
                    web += f", US${status['retrieval/web_usd']:.4f} (run US${status['retrieval/web_usd_run']:.4f})"
                elif _f(status, "retrieval/web_credits_run"):
                    web += (f", {status['retrieval/web_credits']:g} credits "
                            f"(run {status['retrieval/web_credits_run']:g})")
                detail.append(web)
        parts.append(f"generation {gen}" + (f" ({', '.join(detail)})" if detail else ""))
    for key, name in (("timing/make_experience", "experience"), ("timing/ppo_train", "update"),
                      ("timing/broadcast", "weight sync")):
        if sec(key) is not None:
            parts.append(f"{name} {sec(key)}")
    if _f(status, "async/trainer_wait_s") is not None:
        parts.append(f"trainer waited {status['async/trainer_wait_s']:.1f} s, engines waited "
                     f"{status.get('async/engine_wait_s', float('nan')):.1f} s, staleness "
                     f"{status.get('async/staleness_mean', float('nan')):.2f}")
    if sec("timing/step_total") is not None:
        parts.append(f"step {sec('timing/step_total')}")
    return f"step {global_step} time split: " + " | ".join(parts)


class StepTimingMixin:
    """Trainer mixin (OpenRLHF ``BasePPOTrainer`` subclasses): merges the batch's rollout figures into the step's
    status (``train_step``) and prints :func:`split_line` when the step is logged (``save_logs_and_checkpoints``,
    which OpenRLHF calls once per step with the full status, ``timing/generation`` and ``step_total`` included)."""

    def train_step(self, rollout_samples, global_step: int):
        timing = attached(rollout_samples)
        status, next_step = super().train_step(rollout_samples, global_step)
        status.update(timing)
        return status, next_step

    def save_logs_and_checkpoints(self, global_step: int, logs_dict=None, client_states=None) -> None:
        if logs_dict and "timing/ppo_train" in logs_dict:
            line = split_line(global_step, logs_dict)
            logger.info(line)
            print(line, flush=True)
        return super().save_logs_and_checkpoints(global_step, logs_dict, client_states)
