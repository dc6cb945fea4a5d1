"""The arithmetic of ``benchmarks/bench_cluster_cpu.py`` (no cluster run): the retrieval column is the wall-clock
union of the search spans inside each step's rollout window, and the step window is read back from the probe's
step time and OpenRLHF's ``timing/step_total``."""

import os

import pytest

from benchmarks.bench_cluster_cpu import format_table, phase_table
from openrlhf_search.rl.step_timing import union_seconds


def test_overlapping_searches_count_once_and_are_clipped_to_the_window():
    """Catches: concurrent searches summed instead of united (8 trajectories searching at once would report up to
    8x the wall time), spans outside the rollout window counted, a gap between spans filled in."""
    spans = [(1.0, 3.0), (2.0, 4.0), (2.5, 3.5), (6.0, 7.0), (9.0, 12.0), (-5.0, -4.0)]
    assert union_seconds(spans, (0.0, 10.0)) == pytest.approx(3.0 + 1.0 + 1.0)
    assert union_seconds(spans, (3.0, 6.5)) == pytest.approx(1.0 + 0.5)
    assert union_seconds([], (0.0, 10.0)) == 0.0


def test_phase_table_reads_each_step_window_from_its_end_time():
    """Step 2 ends at t=100 after 10 s, its rollout took the first 4 s: only the search in [90, 94] is its
    retrieval. Catches: the window anchored at the step's end instead of its start, generation not bounding it."""
    steps = [{"global_step": 2, "time": 100.0,
              "status": {"timing/step_total": 10.0, "timing/generation": 4.0, "timing/make_experience": 2.0,
                         "timing/ppo_train": 3.0, "timing/broadcast": 0.5}}]
    spans = [(91.0, 92.5), (95.0, 99.0), (80.0, 89.0)]
    (row,) = phase_table(steps, spans)
    assert row["retrieval"] == pytest.approx(1.5)
    assert (row["generation"], row["experience"], row["update"], row["weight sync"], row["step"]) == \
        (4.0, 2.0, 3.0, 0.5, 10.0)
    table = format_table([dict(row, step_index=1), row])
    assert table.splitlines()[-1].split()[0] == "mean>1"  # the first step (warm-up) is left out of the mean


def test_phase_table_reads_the_trainers_logged_retrieval_figures():
    """The benchmark reads the figures the trainer logs every step (step_timing), also in async mode where the
    step's window no longer bounds its generation: the probe's spans are not used when the logged key is there."""
    steps = [{"global_step": 1, "time": 100.0,
              "status": {"timing/step_total": 10.0, "timing/generation": 4.0, "timing/make_experience": 2.0,
                         "timing/ppo_train": 3.0, "timing/broadcast": 0.5, "step_time/search_in_flight_s": 1.25,
                         "retrieval/latency_p50_ms": 80.0, "retrieval/latency_p99_ms": 300.0, "retrieval/qps": 4.0,
                         "retrieval/retries": 0.0, "retrieval/failovers": 1.0, "async/trainer_wait_s": 0.5,
                         "async/engine_wait_s": 2.0}}]
    (row,) = phase_table(steps, [(90.0, 94.0)])
    assert row["retrieval"] == 1.25 and row["p99 ms"] == 300.0 and row["engine wait"] == 2.0
    header = format_table([row]).splitlines()[0]
    assert "p50 ms" in header and "trainer wait" in header


def _mode_result(step_s, rewards, samples_per_step=8):
    rows = [{"generation": 1.0, "retrieval": 0.5, "p50 ms": 210.0, "p99 ms": 300.0, "experience": 1.0,
             "update": 1.0, "weight sync": 0.2, "step": step_s / 2, "trainer wait": None, "engine wait": None,
             "staleness": None, "spanning sync": None, "reward": r, "step_index": i + 1}
            for i, r in enumerate(rewards)]
    # step 1 ends after a long start-up; later steps every step_s seconds
    times = [500.0] + [500.0 + step_s * k for k in range(1, len(rewards))]
    return {"rows": rows, "step_times": times, "samples_per_step": samples_per_step, "startup_s": 200.0}


def test_modes_are_compared_on_wall_time_between_steps_and_on_the_last_rewards(tmp_path):
    """Three modes: throughput from the interval between logged steps (step 1, which holds the start-up, left out),
    the reward of the last steps with a bootstrap interval, and the difference to the first mode. Catches: steps per
    hour from the whole run's wall time (start-up included) or from the trainer's own step time, the speed-up
    inverted, the mean over all steps instead of the last ones, a difference that holds 0 reported as separated,
    the curves not written."""
    import csv
    import json

    from benchmarks.bench_cluster_cpu import compare_modes, format_comparison, mode_args, write_curves

    results = {"sync": _mode_result(4.0, [0.0] * 10 + [0.5, 0.6, 0.5, 0.6]),
               "async": _mode_result(2.0, [0.9] * 10 + [0.0, 0.0, 0.0, 0.0]),
               "partial": _mode_result(2.5, [0.0] * 10 + [0.5, 0.6, 0.6, 0.5])}
    out = compare_modes(results, last_steps=4)
    assert out["sync"]["wall_per_step_s"] == 4.0 and out["sync"]["steps_per_hour"] == 900.0
    assert out["async"]["samples_per_s"] == 4.0 and out["async"]["speedup"] == 2.0
    assert out["sync"]["last_mean"] == pytest.approx(0.55) and out["async"]["last_mean"] == 0.0
    assert out["sync"]["last_low"] <= 0.55 <= out["sync"]["last_high"] < 0.6 + 1e-9
    assert out["async"]["separated"] and out["async"]["diff_high"] < 0
    assert not out["partial"]["separated"] and out["partial"]["diff_low"] <= 0 <= out["partial"]["diff_high"]
    assert out["sync"]["mean_split"]["trainer wait"] != out["sync"]["mean_split"]["trainer wait"]  # NaN: not logged
    text = format_comparison(out)
    assert "async - sync over the last 4 steps" in text and "not separated" in text.splitlines()[-1]
    paths = write_curves(out, str(tmp_path))
    with open(paths["csv"]) as f:
        table = list(csv.reader(f))
    assert table[0] == ["step", "sync", "async", "partial"] and len(table) == 15
    assert float(table[-1][2]) == 0.0 and float(table[1][2]) == 0.9
    assert json.load(open(paths["json"]))["async"]["separated"] is True
    assert os.path.getsize(paths["png"]) > 0
    assert mode_args("sync") == [] and "--train.partial_rollout_enable" in mode_args("partial")
    with pytest.raises(ValueError, match="unknown mode"):
        mode_args("fast")
