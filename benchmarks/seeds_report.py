"""Every training seed of the CPU main job in one table: docs/cpu_job.md reports every seed, not the best.

Reads the ``bench_train_local.json`` that ``benchmarks/bench_train_local.py --seed S --out DIR`` wrote for each seed
and prints, one row per seed: EM, F1 and Cover-EM before -> after RL with the paired bootstrap 95% interval of the
difference (the job's ``eval_compare.json``), the trivial baselines' F1 on the same questions (before-RL answers cut
to their last word, to the best last-k suffix chosen on validation, the first entity of the asked type in the top
passage) and RL's F1 minus the strongest of them with its paired interval, the job's wall time and threads. Then the
job's three targets checked seed by seed (EM after RL >= 0.30; EM gain's interval above zero; F1 after RL above every
baseline, i.e. the paired interval of after RL - baseline above zero) and how many seeds meet each. Nothing is
averaged away: a seed that misses a target is a row that says so.

    PYTHONPATH=. .venv/bin/python benchmarks/seeds_report.py runs/seeds/*/bench_train_local.json [--md out.md]
"""

import argparse
import json
import sys

BASELINES = ("last_word", "last_k_words", "first_entity")
EM_TARGET = 0.30


def load(path: str) -> dict:
    """One seed's figures from a ``bench_train_local.json``.

    Raises:
        ValueError: the file is not JSON, not an object, has no before/after comparison or no baselines (a run
            stopped before its end, or one with ``--eval.baselines false``): it cannot be a row of a report on every
            seed.
    """
    try:
        d = json.load(open(path, encoding="utf-8"))
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise ValueError(f"{path}: not JSON ({e})") from None
    if not isinstance(d, dict):
        raise ValueError(f"{path}: not a bench_train_local.json object")
    cmp, ana = d.get("compare"), d.get("analysis") or {}
    if not isinstance(cmp, dict) or any(not isinstance(cmp.get(k), dict) for k in ("em", "f1", "cover_em")):
        raise ValueError(f"{path}: no before/after comparison of em, f1 and cover_em (did the run finish?)")
    for k in ("em", "f1", "cover_em"):
        if any(not isinstance(cmp[k].get(f), (int, float)) for f in ("before", "after", "diff", "low", "high")):
            raise ValueError(f"{path}: compare.{k} lacks before / after / diff / low / high numbers")
    if d.get("split", "heldout") not in ("heldout", "validation"):
        raise ValueError(f"{path}: split {d.get('split')!r} is neither heldout nor validation")
    base = ana.get("baselines") or {}
    missing = [b for b in BASELINES if b not in base]
    if missing:
        raise ValueError(f"{path}: baselines {missing} missing (run without --eval.baselines false)")
    num = lambda v: v if isinstance(v, (int, float)) else None  # a malformed time is left out
    # what ran: the preset (older files: "default" of their day) and the extra flags; rows of one table must agree
    setting = (d.get("preset") or "default", " ".join(str(d.get("job_args") or "").split()))
    return {"path": path, "seed": 42 if d.get("seed") is None else d["seed"], "split": d.get("split", "heldout"),
            "compare": cmp, "baselines": base, "job_s": num(d.get("job_wall_s")), "threads": d.get("omp_threads"),
            "load": num(d.get("load_average_end")), "setting": setting}


def targets(row: dict) -> dict:
    """The CPU main job's three targets for one seed: {name: bool}."""
    em, base = row["compare"]["em"], row["baselines"]
    return {"em_after_ge_0.30": em["after"] >= EM_TARGET,
            "em_gain_interval_above_0": em["low"] > 0,
            "f1_above_every_baseline": all(base[b]["after_minus"]["f1"]["low"] > 0 for b in BASELINES)}


def _d(c: dict) -> str:
    return f"{c['before']:.3f} -> {c['after']:.3f}, {c['diff']:+.3f} [{c['low']:+.3f}, {c['high']:+.3f}]"


def table(rows) -> str:
    """The markdown table of every seed, then the targets' tally (one line per target)."""
    out = ["| training seed | EM before -> after, diff [95%] | F1 before -> after, diff [95%] | Cover-EM before -> "
           "after, diff [95%] | baselines' F1: last word / best suffix / top-passage entity | RL's F1 minus the "
           "strongest baseline [95%] | job |",
           "| --- | --- | --- | --- | --- | --- | --- |"]
    for r in sorted(rows, key=lambda r: r["seed"]):
        b = r["baselines"]
        strongest = max(BASELINES, key=lambda k: b[k]["f1"][0])
        m = b[strongest]["after_minus"]["f1"]
        job = f"{r['job_s']:.0f} s, {r['threads']} thread(s)" if r["job_s"] else "-"
        if r.get("load") is not None:
            job += f", load {r['load']:.1f} at the end"
        out.append(f"| {r['seed']} | {_d(r['compare']['em'])} | {_d(r['compare']['f1'])} | "
                   f"{_d(r['compare']['cover_em'])} | " + " / ".join(f"{b[k]['f1'][0]:.3f}" for k in BASELINES)
                   + f" | {m['diff']:+.3f} [{m['low']:+.3f}, {m['high']:+.3f}] ({strongest}) | {job} |")
    splits = sorted({r["split"] for r in rows})
    out.append("")
    out.append(f"{len(rows)} seeds, split {'/'.join(splits)}, n = {rows[0]['compare']['f1'].get('n', '?')} each, "
               "greedy; intervals: paired bootstrap 95% over the same questions.")
    for name in ("em_after_ge_0.30", "em_gain_interval_above_0", "f1_above_every_baseline"):
        met = [r["seed"] for r in rows if targets(r)[name]]
        out.append(f"target {name}: met on {len(met)} of {len(rows)} seeds {sorted(met)}")
    return "\n".join(out)


def main(argv=None) -> str:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("results", nargs="+", help="bench_train_local.json of each seed")
    p.add_argument("--md", default=None, help="also write the table to this file")
    a = p.parse_args(argv)
    try:
        rows = [load(f) for f in a.results]
    except (OSError, ValueError) as e:
        raise SystemExit(f"seeds_report: {e}")
    seeds = [r["seed"] for r in rows]
    if len(set(seeds)) != len(seeds):
        raise SystemExit(f"seeds_report: the same seed twice in {seeds}: one row per training seed")
    if len({r["split"] for r in rows}) != 1:
        raise SystemExit("seeds_report: rows from different splits (validation and held-out) do not go in one table")
    settings = {r["setting"] for r in rows}
    if len(settings) != 1:
        raise SystemExit(f"seeds_report: rows of different settings (preset, job_args) {sorted(settings)}: one "
                         "table is one setting over its seeds")
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
