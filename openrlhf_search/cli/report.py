"""Training curves and eval summaries of a run: the panels of the papers' training figures, as PNG and markdown.

The panels of R1-Searcher (Fig. 3/4) and Search-R1 (Fig. 2/3) over training steps: train reward, response length,
valid searches / turns, validation EM or F1, from ``metrics.jsonl`` (one JSON object per step; a row's step is
``step`` or ``global_step``); every panel whose key exists is drawn, absent keys are listed. Eval summaries (any
JSON of a folder that holds scores: ``cli.eval``'s, ``--rescore --summary_json``'s) become markdown tables.

Example::

    python -m openrlhf_search.cli.report --metrics runs/x/metrics.jsonl --eval runs/x/eval --out runs/x/report
"""

import argparse
import glob
import json
import logging
import math
import os
import sys
from typing import Dict, List, Optional, Tuple

logger = logging.getLogger("report")

#: panel key -> (title, y label); aliases are tried in order
PANELS: Dict[str, Tuple[str, str, Tuple[str, ...]]] = {
    "reward": ("Train reward", "reward", ("reward", "train/reward", "rewards")),
    "response_length": ("Response length", "tokens", ("response_length", "response_tokens", "train/response_length")),
    "valid_searches": ("Valid searches per rollout", "searches", ("valid_searches", "train/valid_searches")),
    "turns": ("Turns per rollout", "turns", ("turns", "train/turns")),
    "answer_rate": ("Answer rate", "fraction", ("answer_rate", "answer_present")),
    "em": ("Exact match", "EM", ("eval/em", "em", "val_em")),
    "f1": ("F1", "F1", ("eval/f1", "f1", "val_f1")),
    "cover_em": ("Cover-EM", "Cover-EM", ("eval/cover_em", "cover_em")),
    "kl": ("KL to reference", "KL", ("kl", "train/kl")),
    "entropy": ("Policy entropy", "nats", ("entropy", "policy_entropy")),
}


def flatten(row: dict, prefix: str = "") -> dict:
    """Nested dicts become ``parent/child`` keys: an eval row ``{"step", "eval": {"em", ...}}`` is read here as
    ``eval/em``."""
    out = {}
    for k, v in row.items():
        key = f"{prefix}{k}"
        if isinstance(v, dict):
            out.update(flatten(v, key + "/"))
        else:
            out[key] = v
    return out


def read_metrics(path: str) -> List[dict]:
    """Rows of a metrics jsonl; unreadable lines are skipped with a warning (a crashed run leaves a partial last
    line). Raises FileNotFoundError / ValueError when the file is missing or has no readable row."""
    if not os.path.isfile(path):
        raise FileNotFoundError(f"metrics file not found: {path}")
    rows = []
    with open(path, encoding="utf-8") as f:
        for lineno, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                row = json.loads(line)
            except json.JSONDecodeError:
                logger.warning("%s:%d: unreadable line skipped", path, lineno)
                continue
            if isinstance(row, dict):
                rows.append(flatten(row))
    if not rows:
        raise ValueError(f"{path}: no metrics rows")
    return rows


def series(rows: List[dict], aliases: Tuple[str, ...]) -> Tuple[List[float], List[float]]:
    """(steps, values) of the first alias that any row carries (one key per panel, so train-batch EM and held-out
    EM never mix); non-finite and non-numeric values are dropped."""
    key = next((k for k in aliases if any(_number(r.get(k)) for r in rows)), None)
    xs, ys = [], []
    if key is None:
        return xs, ys
    for i, row in enumerate(rows):
        v = row.get(key)
        if _number(v):
            xs.append(float(step_of(row) if _number(step_of(row)) else i))
            ys.append(float(v))
    return xs, ys


def step_of(row: dict):
    """The step of a metrics row: ``step`` (the CPU demo's rows) or ``global_step`` (the cluster trainer's
    ``metrics.jsonl``, ``schedules.append_step_metrics``); None when it has neither."""
    return row.get("step", row.get("global_step"))


def is_eval_summary(data) -> bool:
    """Whether a JSON document is an evaluation summary: ``cli.eval``'s run (``datasets`` / ``table``), one set's
    ``*.summary.json`` or a ``--rescore --summary_json`` output (scores at the top level)."""
    return isinstance(data, dict) and (isinstance(data.get("datasets"), dict) or isinstance(data.get("table"), str)
                                       or any(_number(data.get(k)) for k in ("em", "f1", "cover_em", "judge_acc")))


def find_summaries(folder: str) -> List[str]:
    """Every evaluation summary JSON directly in ``folder`` (:func:`is_eval_summary`, whatever its name), sorted;
    other JSON files are skipped."""
    out = []
    for path in sorted(glob.glob(os.path.join(folder, "*.json"))):
        try:
            with open(path, encoding="utf-8") as f:
                data = json.load(f)
        except (OSError, ValueError):
            continue
        if is_eval_summary(data):
            out.append(path)
    return out


def _number(v) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)


def _used_key(rows: List[dict], aliases: Tuple[str, ...]) -> Optional[str]:
    return next((k for k in aliases if any(_number(r.get(k)) for r in rows)), None)


def plot_curves(rows: List[dict], out_dir: str, smooth: int = 1) -> Tuple[Dict[str, str], List[str]]:
    """Draw one PNG per present panel and one overview figure.

    Args:
        rows: metrics rows.
        out_dir: output folder (created).
        smooth: moving-average window in steps (1 = raw), drawn over the raw curve.
    Returns:
        (panel key -> PNG path including "overview", names of panels with no data).
    """
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    os.makedirs(out_dir, exist_ok=True)
    present, missing = {}, []
    for key, (title, ylabel, aliases) in PANELS.items():
        xs, ys = series(rows, aliases)
        if xs:
            used = _used_key(rows, aliases)
            # say where the numbers come from: held-out eval rows or the training batch
            where = " (held-out eval)" if used.startswith("eval/") else (" (train batch)" if key in (
                "em", "f1", "cover_em") else "")
            present[key] = (title + where, ylabel, xs, ys)
        else:
            missing.append(key)
    paths: Dict[str, str] = {}

    def draw(ax, title, ylabel, xs, ys):
        ax.plot(xs, ys, lw=1, alpha=0.5 if smooth > 1 else 1.0)
        if smooth > 1 and len(ys) >= smooth:
            sm = [sum(ys[max(0, i - smooth + 1):i + 1]) / len(ys[max(0, i - smooth + 1):i + 1])
                  for i in range(len(ys))]
            ax.plot(xs, sm, lw=2)
        ax.set_title(title)
        ax.set_xlabel("step")
        ax.set_ylabel(ylabel)
        ax.grid(alpha=0.3)

    for key, (title, ylabel, xs, ys) in present.items():
        fig, ax = plt.subplots(figsize=(5, 3.5))
        draw(ax, title, ylabel, xs, ys)
        fig.tight_layout()
        paths[key] = os.path.join(out_dir, f"{key}.png")
        fig.savefig(paths[key], dpi=100)
        plt.close(fig)
    if present:
        n = len(present)
        cols = min(3, n)
        nrows = (n + cols - 1) // cols
        fig, axes = plt.subplots(nrows, cols, figsize=(5 * cols, 3.5 * nrows), squeeze=False)
        for ax, (title, ylabel, xs, ys) in zip(axes.flat, present.values()):
            draw(ax, title, ylabel, xs, ys)
        for ax in list(axes.flat)[n:]:
            ax.axis("off")
        fig.tight_layout()
        paths["overview"] = os.path.join(out_dir, "overview.png")
        fig.savefig(paths["overview"], dpi=100)
        plt.close(fig)
    return paths, missing


# The four panels of the main job's learning-curve figure: (title, metrics key, y label).
LEARNING_PANELS = (("reward (train batch)", "reward", "mean reward"),
                   ("valid searches per trajectory", "valid_searches", "count"),
                   ("response length (policy tokens)", "response_length", "tokens"),
                   ("KL to the reference", "kl", "nats / token"))


def fit_trend(xs: List[float], ys: List[float]) -> Tuple[float, float]:
    """Least-squares line ``y = slope * x + intercept`` (numpy.polyfit degree 1); (slope, intercept).

    Raises:
        ValueError: fewer than two points.
    """
    import numpy as np

    if len(xs) < 2:
        raise ValueError("a trend needs at least two points")
    slope, intercept = np.polyfit(np.asarray(xs, dtype=float), np.asarray(ys, dtype=float), 1)
    return float(slope), float(intercept)


def plot_learning_curves(rows: List[dict], path: str) -> str:
    """One PNG with the per-step reward, valid-search count, response length and KL, each with its fitted linear
    trend (slope per step in the legend).

    Args:
        rows: metrics rows of a training run (``metrics.jsonl``; evaluation rows are skipped).
        path: output PNG path (its folder is created).
    Returns:
        ``path``.
    Raises:
        ValueError: no training step with a reward in ``rows``.
    """
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    steps = [r for r in rows if _number(r.get("reward")) and _number(step_of(r))]
    if not steps:
        raise ValueError("no training steps with a reward to plot")
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    fig, axes = plt.subplots(1, len(LEARNING_PANELS), figsize=(4.2 * len(LEARNING_PANELS), 3.4))
    for ax, (title, key, ylabel) in zip(axes, LEARNING_PANELS):
        pts = [(float(step_of(r)), float(r[key])) for r in steps if _number(r.get(key))]
        ax.set_title(title, fontsize=10)
        ax.set_xlabel("RL step")
        ax.set_ylabel(ylabel)
        ax.grid(alpha=0.3)
        if not pts:
            ax.text(0.5, 0.5, "not logged", ha="center", va="center", transform=ax.transAxes)
            continue
        xs, ys = zip(*pts)
        ax.plot(xs, ys, "o-", ms=3, lw=1, label=key)
        if len(xs) >= 2:
            slope, icpt = fit_trend(list(xs), list(ys))
            ax.plot([xs[0], xs[-1]], [slope * xs[0] + icpt, slope * xs[-1] + icpt], "--", lw=2,
                    label=f"trend {slope:+.3g}/step")
        ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return path


def eval_markdown(summary_paths: List[str]) -> str:
    """Markdown of eval summaries (``cli.eval`` writes ``table`` in each summary JSON; otherwise a plain table)."""
    from openrlhf_search.evaluation.summary import format_table

    parts = []
    for path in summary_paths:
        with open(path, encoding="utf-8") as f:
            data = json.load(f)
        parts.append(f"### {os.path.basename(path)}\n")
        if isinstance(data.get("table"), str):
            parts.append(data["table"])
        else:
            datasets = data.get("datasets") or {data.get("dataset", "dataset"): data}
            parts.append(format_table(datasets, data.get("setup", {})))
        parts.append("")
    return "\n".join(parts)


def main(argv: Optional[List[str]] = None) -> int:
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--metrics", default=None, help="metrics.jsonl of a training run")
    p.add_argument("--eval", nargs="*", default=[],
                   help="eval summary JSON files, or folders: every summary JSON in them (cli.eval's, --rescore "
                        "--summary_json outputs)")
    p.add_argument("--out", required=True, help="output folder for PNGs and report.md")
    p.add_argument("--smooth", type=int, default=1, help="moving-average window (steps)")
    args = p.parse_args(argv)
    if not args.metrics and not args.eval:
        print("error: give --metrics and/or --eval", file=sys.stderr)
        return 2
    os.makedirs(args.out, exist_ok=True)
    lines = ["# Run report", ""]
    if args.metrics:
        try:
            rows = read_metrics(args.metrics)
        except (FileNotFoundError, ValueError) as e:
            print(f"error: {e}", file=sys.stderr)
            return 2
        paths, missing = plot_curves(rows, args.out, args.smooth)
        n_steps = len({step_of(r) for r in rows if not any(k.startswith("eval/") for k in r)})
        lines += [f"Training curves from `{args.metrics}` ({n_steps} steps).", ""]
        for key, path in paths.items():
            if key != "overview":
                lines.append(f"![{PANELS[key][0]}]({os.path.basename(path)})")
        if missing:
            lines += ["", "Not in the metrics file (no panel): " + ", ".join(missing) + "."]
        last = [r for r in rows if not any(k.startswith("eval/") for k in r)] or rows
        lines += ["", "Last step: " + ", ".join(f"{k}={v:.4g}" if isinstance(v, float) else f"{k}={v}"
                                                  for k, v in last[-1].items() if isinstance(v, (int, float))), ""]
        logger.info("wrote %d PNGs to %s (missing panels: %s)", len(paths), args.out, missing)
    summaries = []
    for item in args.eval:
        if os.path.isdir(item):
            summaries += find_summaries(item)
        elif os.path.isfile(item):
            summaries.append(item)
        else:
            print(f"error: eval summary not found: {item}", file=sys.stderr)
            return 2
    if summaries:
        lines += ["## Evaluation", "", eval_markdown(summaries)]
    with open(os.path.join(args.out, "report.md"), "w", encoding="utf-8") as f:
        f.write("\n".join(lines) + "\n")
    print(os.path.join(args.out, "report.md"))
    return 0


if __name__ == "__main__":
    sys.exit(main())
