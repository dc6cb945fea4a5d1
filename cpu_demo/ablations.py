"""The papers' ablations on the CPU main job's own loop: retrieved-token masking, search, PPO against GRPO.

    python -m cpu_demo.ablations [--out runs/ablations] [--seeds 42 7 1] [--arms default no_mask no_search ppo]

Each arm is a full run of ``python -m cpu_demo.run --arm ARM`` (the product's RL loop and greedy evaluations) on the
same data, questions and settings as ``make demo``; per training seed the arms share the default arm's warm start
(and its before-RL evaluation, except ``no_search``, whose prompt differs), so they differ only in the RL phase:

- ``default``: retrieved tokens masked, GRPO, search;
- ``no_mask``: every response token trained on, documents blocks included (``--search.mask_retrieved false``);
- ``no_search``: the search tool removed (a prompt without it, one generation call): the policy answers from what
  it knows;
- ``ppo``: GAE with a critic instead of GRPO's group baseline.

The table: held-out EM / F1 / answer rate / searches per question of each arm after RL, per seed and pooled over
the seeds, with the paired bootstrap interval of its difference to the default arm (pooled: questions paired within
each seed), the warm-started policy before RL beside, and the papers' figures for the direction. Written to
``OUT/ablations.json`` and ``OUT/ablations.md``. A killed run resumes (finished arms are kept). Memory: as
``make demo`` (one arm at a time, 7.5-10.5 GiB peak); the ppo arm's critic trains every layer: 15.1-15.5 GiB.
"""

import argparse
import json
import os
import shutil
import subprocess
import sys
from typing import List, Optional

from cpu_demo.run import ARMS

METRICS = ("em", "f1", "answer_rate", "valid_searches")
# The papers' figures for the direction (not a target: a 135M model on 482 passages is not a 7B model on Wikipedia).
PAPERS = {
    "no_mask": "Search-R1 (Qwen2.5-7B base, average EM, its table 4): masked .431, not masked .343",
    "no_search": "R1-Searcher and Search-R1: RL with retrieval above RL without (no figure recorded here)",
    "ppo": "Search-R1 (Qwen2.5-7B base, average EM of its seven sets): PPO .431, GRPO .350",
}
SHARED = ("questions", "data", "warmstart")  # phases an arm takes from its seed's default run
OWN_BEFORE = ("no_search",)  # arms whose prompt differs: they evaluate the warm-started policy themselves


def arm_dir(out: str, seed: int, arm: str) -> str:
    return os.path.join(out, f"seed{seed}", arm)


def share_phases(default: str, target: str, arm: str) -> None:
    """Hard-link the default run's finished data, warm start (and before-RL evaluation) into ``target``."""
    os.makedirs(target, exist_ok=True)
    for name in SHARED:
        if not os.path.exists(os.path.join(target, name)):
            shutil.copytree(os.path.join(default, name), os.path.join(target, name), copy_function=os.link)
    before = os.path.join(target, "eval_before.json")
    if arm not in OWN_BEFORE and not os.path.exists(before):
        os.link(os.path.join(default, "eval_before.json"), before)


def run_arm(out: str, seed: int, arm: str, extra: List[str]) -> dict:
    """Run one arm to completion (or find it done); returns its after-RL evaluation summary. Raises RuntimeError."""
    folder = arm_dir(out, seed, arm)
    result = os.path.join(folder, "eval.json")
    if not os.path.exists(result):
        if arm != "default":
            share_phases(arm_dir(out, seed, "default"), folder, arm)
        print(f"== seed {seed}, arm {arm} -> {folder}", flush=True)
        rc = subprocess.call([sys.executable, "-m", "cpu_demo.run", "--out", folder, "--seed", str(seed), "--arm",
                              arm, *extra])
        if rc != 0:
            raise RuntimeError(f"seed {seed}, arm {arm}: cpu_demo.run exited {rc}; its logs: {folder}/logs")
    return load(result)


def load(path: str) -> dict:
    with open(path, encoding="utf-8") as f:
        return json.load(f)


def pooled(summaries: List[dict]) -> dict:
    """One summary of several seeds' evaluations: per-question lists concatenated (seed-major), so a paired
    comparison pairs each question with itself within its seed."""
    return {"per_question": {m: [v for s in summaries for v in s["per_question"][m]] for m in METRICS}}


def table(out: str, seeds: List[int], arms: List[str]) -> dict:
    """Per arm: the after-RL means per seed and pooled over the seeds it finished, and the paired difference to the
    default arm on those seeds; the warm-started policy before RL as the first row. Seeds an arm has not finished are
    None in its ``per_seed`` (a table of a run cut short)."""
    from openrlhf_search.evaluation.compare import bootstrap_mean_ci, compare_evaluations

    def found(arm, seed, name="eval.json"):
        path = os.path.join(arm_dir(out, seed, arm), name)
        return load(path) if os.path.exists(path) else None

    def row_of(runs: List[Optional[dict]]) -> dict:
        done = [r for r in runs if r is not None]
        per_question = pooled(done)["per_question"]
        return {"per_seed": [None if r is None else {m: r[m] for m in METRICS} for r in runs],
                "pooled": {m: bootstrap_mean_ci(per_question[m]) for m in METRICS} if done else None}

    default = [found("default", s) for s in seeds]
    rows = {"before RL (warm start)": row_of([found("default", s, "eval_before.json") for s in seeds])}
    for a in [x for x in arms if x in OWN_BEFORE]:  # the warm-started policy under the arm's own prompt
        rows[f"before RL ({a})"] = row_of([found(a, s, "eval_before.json") for s in seeds])
    for a in arms:
        runs = [found(a, s) for s in seeds]
        row = row_of(runs)
        both = [(d, x) for d, x in zip(default, runs) if d is not None and x is not None]
        if a != "default" and both:
            row["vs_default"] = compare_evaluations(pooled([d for d, _ in both]), pooled([x for _, x in both]),
                                                    metrics=METRICS)
            row["vs_default_per_seed"] = [None if d is None or x is None else
                                          compare_evaluations(d, x, metrics=("em",))["em"]
                                          for d, x in zip(default, runs)]
        if a != "default":
            row["papers"] = PAPERS.get(a, "")
        rows[a] = row
    return {"seeds": seeds, "arms": arms, "rows": rows}


def format_table(t: dict) -> str:
    """The Markdown table of :func:`table`."""
    seeds = t["seeds"]
    lines = [f"Held-out EM after RL per training seed ({', '.join(map(str, seeds))}) and pooled (95% bootstrap "
             "interval; - = not run); the difference to the default arm is paired per question, on the seeds both "
             "finished.", "",
             "| arm | EM per seed | EM pooled | F1 | answer rate | searches / q | EM vs default | papers |",
             "| --- | --- | --- | --- | --- | --- | --- | --- |"]
    for name, row in t["rows"].items():
        p = row["pooled"]
        if p is None:
            continue
        per_seed = " / ".join("-" if x is None else f"{x['em']:.3f}" for x in row["per_seed"])
        vs = row.get("vs_default", {}).get("em")
        vs_text = f"{vs['diff']:+.3f} [{vs['low']:+.3f}, {vs['high']:+.3f}]" if vs else "-"
        lines.append(f"| {name} | {per_seed} | {p['em'][0]:.3f} [{p['em'][1]:.3f}, {p['em'][2]:.3f}] | "
                     f"{p['f1'][0]:.3f} | {p['answer_rate'][0]:.2f} | {p['valid_searches'][0]:.2f} | {vs_text} | "
                     f"{row.get('papers', '')} |")
    return "\n".join(lines)


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m cpu_demo.ablations", description=__doc__.split("\n\n")[0],
                                epilog="Flags after -- go to every cpu_demo.run (e.g. --steps 10 for a quick look).")
    p.add_argument("--out", default="runs/ablations", help="folder of every arm's run (seed<S>/<arm>)")
    p.add_argument("--seeds", type=int, nargs="+", default=[42, 7, 1], help="training seeds")
    p.add_argument("--arms", nargs="+", default=list(ARMS), choices=list(ARMS), help="arms (default is always run)")
    p.add_argument("--table_only", action="store_true", help="run nothing: the table of the runs finished so far")
    return p


def main(argv: Optional[List[str]] = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    extra: List[str] = []
    if "--" in argv:
        i = argv.index("--")
        argv, extra = argv[:i], argv[i + 1:]
    a = build_parser().parse_args(argv)
    arms = ["default"] + [x for x in a.arms if x != "default"]
    try:
        # the default arm on every seed first: a run cut short still has the main job's seeds
        for arm in [] if a.table_only else arms:
            for seed in a.seeds:
                run_arm(a.out, seed, arm, extra)
    except RuntimeError as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    t = table(a.out, a.seeds, arms)
    text = format_table(t)
    with open(os.path.join(a.out, "ablations.json"), "w", encoding="utf-8") as f:
        json.dump(t, f, indent=1)
    with open(os.path.join(a.out, "ablations.md"), "w", encoding="utf-8") as f:
        f.write(text + "\n")
    print("\n" + text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
