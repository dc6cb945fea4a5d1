"""Benchmark of the CPU main job on the embedded default: does RL teach, how long, how much memory.

Runs exactly what ``examples/scripts/run_default.sh`` runs (``main_job.train --preset default``: SmolLM2-135M-Instruct,
warm start, greedy evaluation of the held-out questions before RL, RL with search, the same evaluation after RL)
against a real retriever service started here, then reads the job's outputs:

- the learning figure: EM (and F1, Cover-EM, answer rate, searches) before vs after RL on the same questions, with
  the paired bootstrap 95% interval of the difference (``eval_compare.json``), against the job's targets (EM after RL
  >= 0.30, the EM gain's interval above zero, F1 after RL above every trivial baseline; ``seeds_report.targets``)
  and the whole job <= 600 s on 2 idle cores; beside it the job's analysis
  (``eval_analysis.json``): rows per question group (1-hop / 2-hop, each type), the trivial baselines on the same
  questions and the decomposition of each difference into retrieval, reading and form;
- ``--split validation`` evaluates the validation split carved from the training questions instead of the held-out
  questions (``--eval.split validation``): trials, i.e. every choice of setting, run there; the reported run uses
  the held-out split (the default);

- peak RSS of the training process (``os.wait4`` rusage of that child; MiB) and of the retriever (sampled);
- RL steps/s (steps over the summed step wall time, warm start and evaluation excluded);
- the share of step time spent in generation, retrieval, reward, experience (log-probs, KL, advantages) and update.
  Generation and retrieval are busy times of concurrent rollouts (they overlap), so shares can add up to > 100%.

    PYTHONPATH=. .venv/bin/python benchmarks/bench_train_local.py            # the preset as is (BM25, 30 steps)
    PYTHONPATH=. .venv/bin/python benchmarks/bench_train_local.py --split validation \
        --job_args "--actor.adam.lr 1e-4" --out runs/trials/lr1e-4         # a trial of a setting, on validation

Prints a table and writes ``<out>/bench_train_local.json``.
"""

import argparse
import json
import os
import shlex
import subprocess
import sys
import threading
import time

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO)

PHASES = ("generation", "retrieval", "reward", "experience", "update")


def _sample_rss(pid: int, peak: dict, stop: threading.Event) -> None:
    """Record the peak RSS (MiB) of ``pid`` every 0.2 s (from /proc; Linux)."""
    while not stop.is_set():
        try:
            with open(f"/proc/{pid}/status") as fh:
                for line in fh:
                    if line.startswith("VmRSS:"):
                        peak["mib"] = max(peak.get("mib", 0.0), int(line.split()[1]) / 1024)
        except OSError:
            return
        stop.wait(0.2)


def main(argv=None) -> dict:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--steps", type=int, default=None, help="RL steps (default: the preset's)")
    p.add_argument("--seed", type=int, default=None, help="--train.seed of the job (default: the preset's)")
    p.add_argument("--preset", default="default", choices=["default", "f1_sentences", "tiny"],
                   help="main_job.train preset: 'default' (the main job, EM reward) or 'f1_sentences' (the former "
                        "default: F1 reward, sentence answers; docs/cpu_job.md, 'The earlier default')")
    p.add_argument("--sft_steps", type=int, default=None, help="warm-start SFT steps (default: the preset's)")
    p.add_argument("--encoder", default="bm25", choices=["minilm", "bm25"])
    p.add_argument("--out", default=os.path.join(REPO, "runs", "bench_train_local"))
    p.add_argument("--threads", type=int, default=2, help="OMP_NUM_THREADS of the training process")
    p.add_argument("--split", default="heldout", choices=["heldout", "validation"],
                   help="--eval.split of the job: 'validation' for trials (choosing settings), 'heldout' for the "
                        "reported run")
    p.add_argument("--job_args", default="", help="more main_job.train flags, one string, appended after the preset "
                                                   "(e.g. \"--actor.adam.lr 2e-4 --train.max_epochs 1\")")
    a = p.parse_args(argv)
    try:  # before any work: a bad --job_args string is one line, not a traceback after the index is built
        job_args = shlex.split(a.job_args)
    except ValueError as e:
        p.error(f"--job_args: {e}")
    owned = sorted({f for f in job_args if f.split("=")[0] in ("--preset", "--eval.split", "--train.seed",
                                                                 "--ckpt.output_dir", "--ckpt.no_load")})
    if owned:  # the JSON records --preset / --split / --seed: a copy inside --job_args would silently win
        p.error(f"--job_args: {owned} are set by this script's own options (--preset, --split, --seed, --out)")

    from openrlhf_search.cpu.data.default_dataset import build_default_dataset
    from retriever.launch import ensure_index, start_server_process, stop_server_process

    os.makedirs(a.out, exist_ok=True)
    t0 = time.perf_counter()
    ds = build_default_dataset(os.path.join(a.out, "data"), seed=0)
    index_dir = ensure_index(ds.corpus_path, os.path.join(a.out, "index"), encoder=a.encoder)
    t_index = time.perf_counter() - t0
    server, url = start_server_process(index_dir, log_path=os.path.join(a.out, "retriever.log"))
    server_peak, stop = {}, threading.Event()
    threading.Thread(target=_sample_rss, args=(server.pid, server_peak, stop), daemon=True).start()
    run_dir = os.path.join(a.out, "train")
    cmd = [sys.executable, "-m", "openrlhf_search.cpu.main_job.train", "--preset", a.preset,
           "--train_data", ds.train_path, "--eval_data", ds.eval_path, "--search.retriever_urls", url,
           "--ckpt.output_dir", run_dir, "--ckpt.no_load"]
    if a.steps is not None:
        cmd += ["--train.max_steps", str(a.steps)]
    if a.seed is not None:
        cmd += ["--train.seed", str(a.seed)]
    if a.sft_steps is not None:
        cmd += ["--warmstart.sft_steps", str(a.sft_steps)]
    cmd += ["--eval.split", a.split]
    cmd += job_args
    env = dict(os.environ, PYTHONPATH=REPO, OMP_NUM_THREADS=str(a.threads), TOKENIZERS_PARALLELISM="false",
               HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1")
    try:
        t1 = time.perf_counter()
        log = open(os.path.join(a.out, "train.log"), "w")
        proc = subprocess.Popen(cmd, cwd=REPO, env=env, stdout=log, stderr=subprocess.STDOUT)
        _, status, usage = os.wait4(proc.pid, 0)
        proc.returncode = os.waitstatus_to_exitcode(status)
        t_job = time.perf_counter() - t1
        log.close()
    finally:
        stop.set()
        stop_server_process(server)
    if proc.returncode != 0:
        tail = open(os.path.join(a.out, "train.log")).read()[-3000:]
        raise SystemExit(f"training job failed ({proc.returncode}):\n{tail}")

    rows = [json.loads(line) for line in open(os.path.join(run_dir, "metrics.jsonl")) if line.strip()]
    steps = [r for r in rows if "time_step_s" in r]
    total = sum(r["time_step_s"] for r in steps)
    shares = {ph: sum(r.get(f"time_{ph}_s", 0.0) for r in steps) / total for ph in PHASES}
    result = {
        "steps": len(steps),
        "steps_per_s": len(steps) / total,
        "step_s_mean": total / len(steps),
        "phase_share": shares,
        "trainer_peak_rss_mib": usage.ru_maxrss / 1024,  # Linux: KiB
        "retriever_peak_rss_mib": server_peak.get("mib"),
        "job_wall_s": t_job,
        "data_and_index_s": t_index,
        "encoder": a.encoder,
        "omp_threads": a.threads,
        "seed": a.seed,  # --train.seed of the job; None: the preset's (42)
        "preset": a.preset,
        "job_args": a.job_args,
        "load_average_end": os.getloadavg()[0],
        "valid_searches_per_step": [round(r.get("valid_searches", 0.0), 3) for r in steps],
        "reward_per_step": [round(r.get("reward", 0.0), 3) for r in steps],
        # prefix caching: share of the rollouts' prompt tokens (every turn) that the engine actually ran
        "prompt_tokens_run_share": (sum(r.get("engine_prefill_tokens", 0) for r in steps)
                                    / max(1, sum(r.get("engine_prompt_tokens", 0) for r in steps))),
        "generated_tokens_per_s": (sum(r.get("generated_tokens", 0) for r in steps)
                                   / max(1e-9, sum(r.get("time_generation_s", 0.0) for r in steps))),
    }
    cmp_path = os.path.join(run_dir, "eval_compare.json")
    cmp = json.load(open(cmp_path)) if os.path.exists(cmp_path) else None
    result["compare"] = cmp
    analysis_path = os.path.join(run_dir, "eval_analysis.json")
    result["analysis"] = json.load(open(analysis_path)) if os.path.exists(analysis_path) else None
    result["split"] = a.split
    result["whole_s"] = t_index + t_job  # data + index + the job (model load, warm start, 2 evaluations, RL)
    with open(os.path.join(a.out, "bench_train_local.json"), "w") as fh:
        json.dump(result, fh, indent=1)
    from openrlhf_search.evaluation.compare import format_analysis, format_comparison

    split = {"heldout": "held-out", "validation": "validation"}[a.split]
    if cmp:
        print(format_comparison(cmp, title=f"{split}, greedy: before RL vs after RL"))
        if result["analysis"]:
            print()
            print(format_analysis(result["analysis"]))
            print()
        if result["analysis"] and result["analysis"].get("baselines"):
            from benchmarks.seeds_report import targets

            em = cmp["em"]
            met = targets({"compare": cmp, "baselines": result["analysis"]["baselines"]})
            print(f"target: EM after RL >= 0.30: {em['after']:.3f} -> "
                  f"{'met' if met['em_after_ge_0.30'] else 'NOT met'}")
            print(f"target: EM gain's 95% interval above 0: {em['diff']:+.3f} [{em['low']:+.3f}, {em['high']:+.3f}]"
                  f" -> {'met' if met['em_gain_interval_above_0'] else 'NOT met'}")
            print(f"target: F1 after RL above every trivial baseline (paired interval above 0): "
                  f"{'met' if met['f1_above_every_baseline'] else 'NOT met'}")
    else:
        print("no before/after comparison (eval_compare.json missing)")
    print(f"target: data + index + job <= 600 s on 2 idle cores: {result['whole_s']:.0f} s -> "
          f"{'met' if result['whole_s'] <= 600 else 'NOT met'} (load average at the end: {os.getloadavg()[0]:.1f})")
    print(f"learning curves: {os.path.join(run_dir, 'learning_curves.png')}")
    print(f"CPU main job, embedded default ({a.encoder} retriever, {a.threads} threads, {len(steps)} RL steps)")
    print(f"  steps/s                 {result['steps_per_s']:.3f}  ({result['step_s_mean']:.1f} s per step)")
    print(f"  trainer peak RSS        {result['trainer_peak_rss_mib']:.0f} MiB")
    if result["retriever_peak_rss_mib"]:
        print(f"  retriever peak RSS      {result['retriever_peak_rss_mib']:.0f} MiB")
    print(f"  whole job (incl. warm start, eval)  {t_job:.0f} s; data + index {t_index:.0f} s")
    print("  share of step time:")
    for ph in PHASES:
        print(f"    {ph:<11} {100 * shares[ph]:5.1f} %")
    print(f"  rollout prompt tokens run (rest read from the prefix cache or shared in a batch) "
          f"{100 * result['prompt_tokens_run_share']:.0f} %; {result['generated_tokens_per_s']:.0f} generated tokens/s")
    print("  valid searches per step:", result["valid_searches_per_step"])
    return result


if __name__ == "__main__":
    main()
