"""Training-curve report: PNG panels from a synthetic metrics.jsonl, eval summaries as markdown."""

import json
import math
import subprocess
import sys

from tests.conftest import REPO_ROOT


def _write_metrics(path, n=30, with_garbage=True):
    with open(path, "w") as f:
        for step in range(n):
            row = {"step": step, "reward": 0.2 + 0.02 * step, "response_length": 300 - 3 * step,
                   "valid_searches": 0.5 + 0.05 * step, "turns": 1 + step / 10,
                   "answer_rate": min(1.0, 0.5 + step / 40)}
            if step == 7:
                row["reward"] = float("nan")  # a NaN step must not break the plot
            f.write(json.dumps(row) + "\n")
            if step % 5 == 0:  # eval rows as the CPU trainer logs them: nested under "eval"
                f.write(json.dumps({"step": step, "eval": {"em": 0.1 + 0.01 * step, "n": 20}}) + "\n")
        if with_garbage:
            f.write('{"step": 30, "reward": 0.9')  # a crashed run's partial last line


def _is_png(path):
    with open(path, "rb") as f:
        return f.read(8) == b"\x89PNG\r\n\x1a\n"


def test_report_pngs_and_markdown(tmp_path):
    metrics = tmp_path / "metrics.jsonl"
    _write_metrics(metrics)
    summary = tmp_path / "eval" / "bamboogle.summary.json"
    summary.parent.mkdir()
    summary.write_text(json.dumps({"dataset": "bamboogle", "n": 125, "em": 0.2, "f1": 0.3, "cover_em": 0.25,
                                   "setup": {"model": "tiny", "corpus": "c", "retriever": "bm25", "topk": 3}}))
    out = tmp_path / "report"
    proc = subprocess.run([sys.executable, "-m", "openrlhf_search.cli.report", "--metrics", str(metrics), "--eval",
                           str(summary.parent), "--out", str(out), "--smooth", "5"],
                          cwd=REPO_ROOT, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr
    for name in ("reward", "response_length", "valid_searches", "turns", "answer_rate", "em", "overview"):
        png = out / f"{name}.png"
        assert png.exists() and _is_png(png) and png.stat().st_size > 5000, name
    assert not (out / "f1.png").exists() and not (out / "kl.png").exists()
    md = (out / "report.md").read_text()
    assert "30 steps" in md
    assert "Not in the metrics file" in md and "f1" in md and "kl" in md
    assert "| bamboogle | ours | tiny | c | bm25 | 3 | 125 | 0.200 |" in md
    assert "0.504" in md  # the paper's Llama Bamboogle Cover-EM beside ours


def test_series_drops_nan_and_uses_aliases():
    from openrlhf_search.cli.report import series

    rows = [{"step": 0, "train/reward": 1.0}, {"step": 1, "reward": float("nan")}, {"step": 2, "reward": 2.0},
            {"step": 3, "reward": "x"}]
    xs, ys = series(rows, ("reward", "train/reward"))
    assert xs == [2.0] and ys == [2.0] and all(math.isfinite(y) for y in ys)
    # one key per panel: held-out eval EM wins and train-batch EM is not mixed in
    mixed = [{"step": 1, "em": 0.9}, {"step": 1, "eval/em": 0.2}, {"step": 2, "em": 0.8}]
    assert series(mixed, ("eval/em", "em")) == ([1.0], [0.2])
    assert series([{"step": 1, "em": 0.9}], ("eval/em", "em")) == ([1.0], [0.9])
    from openrlhf_search.cli.report import flatten

    assert flatten({"step": 3, "eval": {"em": 0.5, "x": {"y": 1}}}) == {"step": 3, "eval/em": 0.5, "eval/x/y": 1}
    assert series([flatten({"step": 5, "eval": {"em": 0.25}})], ("eval/em",)) == ([5.0], [0.25])


def test_report_errors(tmp_path):
    empty = tmp_path / "m.jsonl"
    empty.write_text("")
    proc = subprocess.run([sys.executable, "-m", "openrlhf_search.cli.report", "--metrics", str(empty), "--out",
                           str(tmp_path / "o")], cwd=REPO_ROOT, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 2 and "no metrics rows" in proc.stderr


def test_cluster_metrics_count_global_steps_and_every_summary_is_found(tmp_path):
    """The cluster trainer writes ``global_step`` (schedules.append_step_metrics): 30 steps are 30, not 1; a folder's
    summaries are found by content, whatever their names (a --rescore --summary_json output among them)."""
    from openrlhf_search.rl.schedules import append_step_metrics

    metrics = tmp_path / "metrics.jsonl"
    for step in range(1, 31):
        append_step_metrics(str(metrics), step, {"reward": 0.1 * step, "response_length": 200.0})
    folder = tmp_path / "eval_out"
    folder.mkdir()
    (folder / "rescore_bamboogle_llama.json").write_text(json.dumps({"n": 125, "cover_em": 0.504, "em": 0.44,
                                                                     "dataset": "bamboogle", "setup": {}}))
    (folder / "summary.json").write_text(json.dumps({"datasets": {"nq": {"n": 3, "em": 0.5}}, "setup": {},
                                                     "table": "| nq | ours |"}))
    (folder / "settings.json").write_text(json.dumps({"topk": 3}))  # not a summary: skipped
    out = tmp_path / "report"
    proc = subprocess.run([sys.executable, "-m", "openrlhf_search.cli.report", "--metrics", str(metrics), "--eval",
                           str(folder), "--out", str(out)], cwd=REPO_ROOT, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr
    md = (out / "report.md").read_text()
    assert "(30 steps)" in md
    assert "### rescore_bamboogle_llama.json" in md and "### summary.json" in md and "settings.json" not in md
    assert "0.504" in md
