"""The figures of ``benchmarks/gpu_smoke.sh``: step time and tokens/s of the timed run, its before/after table.

    python benchmarks/gpu_smoke_report.py --run RUN_DIR --steps N --out summary.json [--phases phases.tsv]

Only the standard library is imported at module level (the before/after table uses the project when importable).
"""

import argparse
import json
import os
import statistics
import sys
from typing import List, Optional


def _read_rows(path: str) -> List[dict]:
    rows = []
    with open(path) as fh:
        for line in fh:
            line = line.strip()
            if line:
                try:
                    rows.append(json.loads(line))
                except json.JSONDecodeError:  # a killed run's half line
                    continue
    return rows


def step_summary(rows: List[dict], main_steps: int) -> dict:
    """Step time and throughput of the RL steps ``1..main_steps`` of a ``metrics.jsonl`` (the GPU run), and the
    rows after them (the resume checks), from the trainer's per-step fields.

    Returns:
        {"steps", "step_s_mean", "step_s_median", "step_s_mean_after_first", "gen_tokens", "gen_tokens_per_s"
         (engine tokens / engine busy seconds), "tokens_per_s_of_step" (engine tokens / step seconds),
         "train_tokens_per_s" (batch tokens through experience + update / their seconds), "phase_share",
         "cuda_max_memory_mb", "rows" (per step), "after" (rows after main_steps)}
    Raises:
        ValueError: no timed step among ``1..main_steps``.
    """
    steps = [r for r in rows if "time_step_s" in r and r.get("step", 0) <= main_steps]
    if not steps:
        raise ValueError("no timed RL step in metrics.jsonl")
    times = [r["time_step_s"] for r in steps]
    gen_tok = sum(r.get("generated_tokens", 0) for r in steps)
    gen_s = sum(r.get("time_generation_s", 0.0) for r in steps)
    train_tok = sum(r.get("batch_tokens", 0) for r in steps)
    train_s = sum(r.get("time_experience_s", 0.0) + r.get("time_update_s", 0.0) for r in steps)
    total = sum(times)
    per_step = [{k: r.get(k) for k in ("step", "time_step_s", "generated_tokens", "gen_tokens_per_s",
                                       "train_tokens_per_s", "reward", "kl", "valid_searches")} for r in steps]
    after = [{k: r.get(k) for k in ("step", "time_step_s", "generated_tokens", "gen_tokens_per_s",
                                    "train_tokens_per_s", "reward")}
             for r in rows if "time_step_s" in r and r.get("step", 0) > main_steps]
    mem = [r["cuda_max_memory_mb"] for r in steps if "cuda_max_memory_mb" in r]
    return {
        "steps": len(steps),
        "step_s_mean": total / len(steps),
        "step_s_median": statistics.median(times),
        "step_s_mean_after_first": statistics.mean(times[1:]) if len(times) > 1 else times[0],
        "gen_tokens": gen_tok,
        "gen_tokens_per_s": gen_tok / gen_s if gen_s > 0 else 0.0,
        "tokens_per_s_of_step": gen_tok / total if total > 0 else 0.0,
        "train_tokens_per_s": train_tok / train_s if train_s > 0 else 0.0,
        "phase_share": {ph: sum(r.get(f"time_{ph}_s", 0.0) for r in steps) / total
                        for ph in ("generation", "retrieval", "reward", "experience", "update")},
        "cuda_max_memory_mb": max(mem) if mem else None,
        "rows": per_step,
        "after": after,
    }


def format_summary(s: dict, labels_after: Optional[List[str]] = None) -> str:
    """The step-time / tokens-per-second table of :func:`step_summary` as text."""
    lines = ["== RL steps (engine = HF transformers on the policy's device; tokens/s of the engine's busy time) ==",
             f"{'step':>4} {'step_s':>7} {'gen_tok':>8} {'gen_tok/s':>10} {'train_tok/s':>12} {'reward':>7} {'kl':>8}"]
    for r in s["rows"]:
        lines.append(f"{r['step']:>4} {r['time_step_s']:>7.2f} {r.get('generated_tokens') or 0:>8} "
                     f"{r.get('gen_tokens_per_s') or 0.0:>10.1f} {r.get('train_tokens_per_s') or 0.0:>12.0f} "
                     f"{r.get('reward') if r.get('reward') is not None else float('nan'):>7.3f} "
                     f"{r.get('kl') if r.get('kl') is not None else float('nan'):>8.4f}")
    lines.append(f"step time: mean {s['step_s_mean']:.2f} s, median {s['step_s_median']:.2f} s, mean without the "
                 f"first step {s['step_s_mean_after_first']:.2f} s ({s['steps']} steps)")
    lines.append(f"tokens/s: engine {s['gen_tokens_per_s']:.1f} (busy time), {s['tokens_per_s_of_step']:.1f} per step "
                 f"wall time; training batch {s['train_tokens_per_s']:.0f} (experience + update)")
    lines.append("share of step time: " + ", ".join(f"{k} {100 * v:.0f}%" for k, v in s["phase_share"].items())
                 + " (generation and retrieval overlap)")
    if s["cuda_max_memory_mb"] is not None:
        lines.append(f"peak CUDA memory allocated: {s['cuda_max_memory_mb']:.0f} MiB")
    for i, r in enumerate(s["after"]):
        label = labels_after[i] if labels_after and i < len(labels_after) else "resumed"
        lines.append(f"resume check ({label}): step {r['step']} took {r['time_step_s']:.2f} s, engine "
                     f"{r.get('gen_tokens_per_s') or 0.0:.1f} tokens/s, reward {r.get('reward') or 0.0:.3f}")
    return "\n".join(lines)


def summary(run_dir: str, main_steps: int, out_path: Optional[str] = None, phases_path: Optional[str] = None,
            labels_after: Optional[List[str]] = None, stream=sys.stdout) -> dict:
    """Print the step-time / tokens-per-second table and the before/after table of a run folder; write JSON.

    Args:
        run_dir: ``--ckpt.output_dir`` of the job (``metrics.jsonl``, ``eval_compare.json`` ...).
        main_steps: RL steps of the timed run (later rows are resume checks).
        out_path: where the JSON summary goes (None: nowhere).
        phases_path: ``phase<TAB>seconds<TAB>status`` lines written by gpu_smoke.sh.
        labels_after: a label per resume row (e.g. ``["cpu", "cuda"]``).
    Returns:
        the summary dict (``steps`` of :func:`step_summary` under "train", "compare", "phases").
    """
    out: dict = {"run_dir": os.path.abspath(run_dir)}
    metrics = os.path.join(run_dir, "metrics.jsonl")
    if os.path.exists(metrics):
        try:
            out["train"] = step_summary(_read_rows(metrics), main_steps)
            print(format_summary(out["train"], labels_after), file=stream)
        except ValueError as e:
            print(f"no step figures: {e}", file=stream)
    else:
        print(f"no step figures: {metrics} is missing", file=stream)
    cmp_path = os.path.join(run_dir, "eval_compare.json")
    if os.path.exists(cmp_path):
        with open(cmp_path) as fh:
            out["compare"] = json.load(fh)
        try:
            from openrlhf_search.evaluation.compare import format_comparison

            print("\n" + format_comparison(out["compare"]), file=stream)
        except ImportError as e:  # the project is not importable: print the raw numbers
            print(f"\n(before/after, raw: {e})\n" + json.dumps(out["compare"], indent=1), file=stream)
    else:
        print(f"\nno before/after table: {cmp_path} is missing", file=stream)
    if phases_path and os.path.exists(phases_path):
        out["phases"] = []
        with open(phases_path) as fh:
            for line in fh:
                parts = line.rstrip("\n").split("\t")
                if len(parts) == 3:
                    out["phases"].append({"phase": parts[0], "s": float(parts[1]), "status": parts[2]})
        print("\nphases: " + ", ".join(f"{p['phase']} {p['s']:.0f}s ({p['status']})" for p in out["phases"]),
              file=stream)
    if out_path:
        with open(out_path, "w") as fh:
            json.dump(out, fh, indent=1)
    return out


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--run", required=True, help="the job's --ckpt.output_dir")
    p.add_argument("--steps", type=int, required=True, help="RL steps of the timed run")
    p.add_argument("--out", default=None, help="JSON summary to write")
    p.add_argument("--phases", default=None, help="phase<TAB>seconds<TAB>status lines of the script")
    p.add_argument("--labels_after", default="", help="comma-separated labels of the rows after --steps")
    a = p.parse_args(argv)
    summary(a.run, a.steps, a.out, a.phases, [x for x in a.labels_after.split(",") if x])
    return 0


if __name__ == "__main__":
    sys.exit(main())
