"""The papers' two central claims in miniature, on the CPU main job (embedded default, SmolLM2-135M-Instruct):

(a) retrieved-token masking on vs off (Search-R1, arXiv 2503.09516 sec. 5.3 / table 4): the same RL, but with the
    loss, KL and advantages also on the retrieved passages (``--train.mask_retrieved_tokens false``);
(b) RL with the retriever vs the same RL with search disabled (every search returns no passage, so the answers come
    from the model's own memory; ``--train.no_search``), the comparison behind both papers' main tables.

Every arm is the main job (``train_local --preset default``) with the same seed, data, warm start and held-out
questions, against one retriever service started here. Each cell is a mean over the held-out questions with its
bootstrap 95% interval; differences between arms are paired over the same questions. Reported as measured, whatever
the outcome. Takes about 3x the main job (at most ~30 minutes on 2 idle cores).

    PYTHONPATH=. .venv/bin/python benchmarks/bench_ablation.py [--steps N] [--seed S]
Writes ``<out>/ablation.json`` and ``<out>/ablation.md``.
"""

import argparse
import json
import os
import subprocess
import sys
import time

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO)

ARMS = {
    "RL with search, masking on (main job)": [],
    "(a) retrieved tokens in the loss (masking off)": ["--train.mask_retrieved_tokens", "false"],
    "(b) RL without search (empty documents)": ["--train.no_search"],
}


def run_arm(name, extra, ds, url, out, a) -> dict:
    run_dir = os.path.join(out, "arm_" + str(list(ARMS).index(name)))
    cmd = [sys.executable, "-m", "openrlhf_search.cli.train_local", "--preset", "default",
           "--train_data", ds.train_path, "--eval_data", ds.eval_path, "--search.retriever_urls", url,
           "--ckpt.output_dir", run_dir, "--ckpt.no_load"] + extra
    if a.steps is not None:
        cmd += ["--train.max_steps", str(a.steps)]
    if a.seed is not None:
        cmd += ["--train.seed", str(a.seed)]
    env = dict(os.environ, PYTHONPATH=REPO, TOKENIZERS_PARALLELISM="false", HF_HUB_OFFLINE="1",
               TRANSFORMERS_OFFLINE="1")
    t0 = time.perf_counter()
    print(f"== {name}: {' '.join(extra) or '(preset as is)'}", flush=True)
    with open(os.path.join(out, f"{os.path.basename(run_dir)}.log"), "w") as log:
        proc = subprocess.Popen(cmd, cwd=REPO, env=env, stdout=log, stderr=subprocess.STDOUT)
        _, status, usage = os.wait4(proc.pid, 0)
        rc = os.waitstatus_to_exitcode(status)
    if rc != 0:
        raise SystemExit(f"arm {name!r} failed (exit {rc}); see {log.name}")
    load = lambda f: json.load(open(os.path.join(run_dir, f)))  # noqa: E731
    wall = time.perf_counter() - t0
    print(f"   {wall:.0f} s, trainer peak RSS {usage.ru_maxrss / 1024:.0f} MiB", flush=True)
    return {"before": load("eval_before.json"), "after": load("eval.json"), "wall_s": wall,
            "peak_rss_mib": usage.ru_maxrss / 1024, "run_dir": run_dir}


def main(argv=None) -> dict:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--steps", type=int, default=None, help="RL steps per arm (default: the preset's)")
    p.add_argument("--seed", type=int, default=None, help="--train.seed of every arm (default: the preset's)")
    p.add_argument("--encoder", default="bm25", choices=["minilm", "bm25"])
    p.add_argument("--out", default=os.path.join(REPO, "runs", "bench_ablation"))
    p.add_argument("--reuse_main", default=None, metavar="RUN_DIR",
                   help="take the main-job arm from a finished run of the same preset and seed (e.g. the train/ "
                        "folder of benchmarks/bench_train_local.py) instead of running it again; its held-out "
                        "questions must be the ones of this benchmark")
    a = p.parse_args(argv)

    from openrlhf_search.data.default_dataset import build_default_dataset
    from openrlhf_search.evaluation.compare import interval_str, mean_interval_str, paired_difference
    from retriever.launch import ensure_index, start_server_process, stop_server_process

    os.makedirs(a.out, exist_ok=True)
    ds = build_default_dataset(os.path.join(a.out, "data"), seed=0)
    index_dir = ensure_index(ds.corpus_path, os.path.join(a.out, "index"), encoder=a.encoder)
    server, url = start_server_process(index_dir, log_path=os.path.join(a.out, "retriever.log"))
    t0 = time.perf_counter()
    results = {}
    if a.reuse_main:
        main_name = next(iter(ARMS))
        load = lambda f: json.load(open(os.path.join(a.reuse_main, f)))  # noqa: E731
        results[main_name] = {"before": load("eval_before.json"), "after": load("eval.json"), "wall_s": float("nan"),
                              "peak_rss_mib": float("nan"), "run_dir": a.reuse_main}
        print(f"== {main_name}: reused from {a.reuse_main}", flush=True)
    try:
        for name, extra in ARMS.items():
            if name not in results:
                results[name] = run_arm(name, extra, ds, url, a.out, a)
    finally:
        stop_server_process(server)
    main_arm = results[next(iter(ARMS))]
    for name, r in results.items():  # paired differences need the same questions in the same order
        if r["after"]["questions"] != main_arm["after"]["questions"]:
            raise SystemExit(f"arm {name!r} was evaluated on other questions than the main job")
    header = ("| arm | F1 before RL | F1 after RL | F1 after - before | EM after | answer rate after | searches after "
              "| F1 after vs main job | job time, peak RSS |")
    lines = [header, "|" + " --- |" * 9]
    out = {}
    for name, r in results.items():
        pb, pa = r["before"]["per_question"], r["after"]["per_question"]
        same_q = r["after"]["questions"] == main_arm["after"]["questions"]
        vs_main = (paired_difference(main_arm["after"]["per_question"]["f1"], pa["f1"])
                   if same_q and r is not main_arm else None)
        row = {"f1_before": mean_interval_str(pb["f1"]), "f1_after": mean_interval_str(pa["f1"]),
               "f1_diff": interval_str(paired_difference(pb["f1"], pa["f1"])),
               "em_after": mean_interval_str(pa["em"]), "answer_rate_after": mean_interval_str(pa["answer_rate"]),
               "searches_after": mean_interval_str(pa["searches"]),
               # paired_difference(main, arm) = arm - main: negative = the arm is worse than the main job
               "f1_after_vs_main": "-" if vs_main is None else interval_str(vs_main),
               "n": r["after"]["n"], "wall_s": None if r["wall_s"] != r["wall_s"] else round(r["wall_s"]),
               "peak_rss_mib": None if r["peak_rss_mib"] != r["peak_rss_mib"] else round(r["peak_rss_mib"])}
        out[name] = row
        lines.append(f"| {name} | {row['f1_before']} | {row['f1_after']} | {row['f1_diff']} | {row['em_after']} | "
                     f"{row['answer_rate_after']} | {row['searches_after']} | {row['f1_after_vs_main']} | "
                     + (f"{row['wall_s']} s, {row['peak_rss_mib']} MiB |" if row["wall_s"] is not None
                        else f"reused: {r['run_dir']} |"))
    n = main_arm["after"]["n"]
    table = "\n".join(lines)
    note = (f"\n{n} held-out questions, greedy; mean [bootstrap 95% interval]; differences paired over the same "
            f"questions; total {time.perf_counter() - t0:.0f} s, load average at the end {os.getloadavg()[0]:.1f}.")
    print(table + note)
    with open(os.path.join(a.out, "ablation.md"), "w") as fh:
        fh.write(table + note + "\n")
    with open(os.path.join(a.out, "ablation.json"), "w") as fh:
        json.dump(out, fh, indent=1)
    return out


if __name__ == "__main__":
    main()
