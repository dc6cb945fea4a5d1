"""Every training seed of the CPU main job in one table: docs/cpu_job.md reports every seed, not the best.

    PYTHONPATH=. .venv/bin/python benchmarks/seeds_report.py runs/seed42 runs/seed7 runs/seed1 [--split validation]
        [--md out.md]

Reads what ``python -m cpu_demo.run --out DIR --seed S`` wrote in each run folder (``job.json``,
``eval_compare.json``, ``eval_analysis.json``; with ``--split validation`` the ``*_validation.json`` files) and prints
one row per seed: EM, F1 and Cover-EM before -> after RL with the paired bootstrap 95% interval of the difference, the
trivial baselines' EM on the same questions (before-RL answers cut to their last word; the first entity of the asked
type in the top passage) and RL's EM minus the last-word baseline with its paired interval, and the job's wall time,
load and peak memory. Then the job's targets checked seed by seed (EM after RL >= 0.60; the EM gain's interval above
zero; EM after RL above the last-word baseline) and how many seeds meet each. Nothing is averaged away: a seed that
misses a target is a row that says so.
"""

import argparse
import json
import os
import sys

EM_TARGET = 0.60
BASELINES = ("last_word", "first_entity")


def load(folder: str, split: str = "heldout") -> dict:
    """One seed's figures from a run folder.

    Raises:
        ValueError: a file missing or without the figures (a run stopped before its end), or another split's run.
    """
    tag = "" if split == "heldout" else f"_{split}"
    paths = {k: os.path.join(folder, f"{k}{tag}.json") for k in ("job", "eval_compare", "eval_analysis")}
    data = {}
    for key, path in paths.items():
        try:
            data[key] = json.load(open(path, encoding="utf-8"))
        except FileNotFoundError:
            raise ValueError(f"{path}: missing (did the run finish, on the {split} split?)") from None
        except (json.JSONDecodeError, UnicodeDecodeError) as e:
            raise ValueError(f"{path}: not JSON ({e})") from None
    cmp, base = data["eval_compare"], (data["eval_analysis"].get("baselines") or {})
    for k in ("em", "f1", "cover_em"):
        if not isinstance(cmp.get(k), dict) or any(not isinstance(cmp[k].get(f), (int, float))
                                                   for f in ("before", "after", "diff", "low", "high")):
            raise ValueError(f"{paths['eval_compare']}: no before / after / diff / low / high of {k}")
    if "last_word" not in base:
        raise ValueError(f"{paths['eval_analysis']}: no last-word baseline")
    job = data["job"]
    settings = dict(job.get("settings") or {})
    seed = settings.pop("seed", None)
    for key in ("out", "split"):
        settings.pop(key, None)
    return {"folder": folder, "seed": seed, "split": split, "compare": cmp, "baselines": base, "job": job,
            "setting": json.dumps(settings, sort_keys=True)}


def targets(row: dict) -> dict:
    """The CPU main job's targets for one seed: {name: bool}."""
    em, last = row["compare"]["em"], row["baselines"]["last_word"]
    return {f"em_after_ge_{EM_TARGET:.2f}": em["after"] >= EM_TARGET,
            "em_gain_interval_above_0": em["low"] > 0,
            "em_after_above_last_word": em["after"] > last["em"][0]}


def _d(c: dict) -> str:
    return f"{c['before']:.3f} -> {c['after']:.3f}, {c['diff']:+.3f} [{c['low']:+.3f}, {c['high']:+.3f}]"


def table(rows) -> str:
    """The markdown table of every seed, then the targets' tally (one line per target)."""
    out = ["| training seed | EM before -> after, diff [95%] | F1 before -> after, diff [95%] | Cover-EM before -> "
           "after, diff [95%] | baselines' EM: last word / top-passage entity | RL's EM minus last word [95%] | "
           "job |", "| --- | --- | --- | --- | --- | --- | --- |"]
    for r in sorted(rows, key=lambda r: r["seed"]):
        b, job = r["baselines"], r["job"]
        m = b["last_word"]["after_minus"]["em"]
        entity = f"{b['first_entity']['em'][0]:.3f}" if "first_entity" in b else "-"
        load = job.get("load_average_start") or [None]
        run = f"{job['wall_s']:.0f} s, load {load[0]:.1f} at the start, {job.get('peak_pss_gib', 0):.1f} GiB peak"
        out.append(f"| {r['seed']} | {_d(r['compare']['em'])} | {_d(r['compare']['f1'])} | "
                   f"{_d(r['compare']['cover_em'])} | {b['last_word']['em'][0]:.3f} / {entity} | "
                   f"{m['diff']:+.3f} [{m['low']:+.3f}, {m['high']:+.3f}] | {run} |")
    out.append("")
    out.append(f"{len(rows)} seeds, {rows[0]['split']} questions, n = {rows[0]['compare']['em'].get('n', '?')} each, "
               "greedy; intervals: paired bootstrap 95% over the same questions.")
    for name in targets(rows[0]):
        met = [r["seed"] for r in rows if targets(r)[name]]
        out.append(f"target {name}: met on {len(met)} of {len(rows)} seeds {sorted(met)}")
    return "\n".join(out)


def main(argv=None) -> str:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("runs", nargs="+", help="run folder of each seed")
    p.add_argument("--split", default="heldout", choices=["heldout", "validation"])
    p.add_argument("--md", default=None, help="also write the table to this file")
    a = p.parse_args(argv)
    try:
        rows = [load(f, a.split) for f in a.runs]
    except (OSError, ValueError) as e:
        raise SystemExit(f"seeds_report: {e}")
    seeds = [r["seed"] for r in rows]
    if len(set(seeds)) != len(seeds):
        raise SystemExit(f"seeds_report: the same seed twice in {seeds}: one row per training seed")
    if len({r["setting"] for r in rows}) != 1:
        raise SystemExit("seeds_report: runs of different settings: one table is one setting over its seeds")
    text = table(rows)
    print(text)
    if a.md:
        try:
            with open(a.md, "w") as fh:
                fh.write(text + "\n")
        except OSError as e:
            raise SystemExit(f"seeds_report: cannot write --md {a.md}: {e}")
    return text


if __name__ == "__main__":
    sys.exit(0 if main() else 1)
