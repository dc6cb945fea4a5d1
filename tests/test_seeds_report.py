"""benchmarks/seeds_report.py: one row per training seed and the CPU main job's targets checked seed by seed.

Mutations caught: a target read from the point estimate instead of the interval (a gain of +0.05 with its interval
touching zero counted as met); the strongest baseline taken as the first or the weakest; a seed silently dropped or
counted twice; a run without baselines or comparison accepted as a row.
"""

import json

import pytest

from benchmarks import seeds_report


def _c(before, after, low, high):
    return {"before": before, "after": after, "diff": after - before, "low": low, "high": high, "n": 64}


def _bench(tmp_path, seed, em, f1, base_f1, minus_low, name=None):
    base = {}
    for k, v, lo in zip(seeds_report.BASELINES, base_f1, minus_low):
        base[k] = {"label": k, "em": [v, v, v], "f1": [v, v - 0.1, v + 0.1],
                   "after_minus": {"f1": _c(v, f1[1], lo, lo + 0.2), "em": _c(v, em[1], -1, 1)}}
    d = {"seed": seed, "split": "heldout", "job_wall_s": 600.0, "omp_threads": 2,
         "compare": {"em": _c(*em), "f1": _c(*f1), "cover_em": _c(0.5, 0.6, 0.0, 0.2)},
         "analysis": {"baselines": base}}
    p = tmp_path / (name or f"s{seed}.json")
    p.write_text(json.dumps(d))
    return str(p)


def test_targets_read_from_intervals_and_every_seed_kept(tmp_path, capsys):
    ok = _bench(tmp_path, 1, (0.2, 0.45, 0.05, 0.30), (0.3, 0.7, 0.2, 0.6), (0.5, 0.5, 0.6), (0.01, 0.01, 0.02))
    touching = _bench(tmp_path, 2, (0.3, 0.35, 0.0, 0.1), (0.3, 0.7, 0.2, 0.6), (0.5, 0.5, 0.6), (0.01, 0.01, 0.02))
    low_em = _bench(tmp_path, 3, (0.0, 0.25, 0.1, 0.4), (0.3, 0.7, 0.2, 0.6), (0.5, 0.5, 0.9), (0.01, 0.01, -0.3))
    text = seeds_report.main([ok, touching, low_em])
    assert "target em_after_ge_0.30: met on 2 of 3 seeds [1, 2]" in text
    assert "target em_gain_interval_above_0: met on 2 of 3 seeds [1, 3]" in text  # seed 2: low = 0, not above
    assert "target f1_above_every_baseline: met on 2 of 3 seeds [1, 2]" in text  # seed 3: below the entity one
    rows = [line for line in text.splitlines() if line.startswith("| ") and line[2].isdigit()]
    assert [r.split("|")[1].strip() for r in rows] == ["1", "2", "3"]
    assert "(first_entity)" in rows[2]  # the strongest baseline of seed 3 is the entity one (0.9), not the first


def test_bad_inputs_are_refused_with_a_reason(tmp_path):
    a = _bench(tmp_path, 5, (0, 0, 0, 0), (0.1, 0.2, 0.05, 0.15), (0.5, 0.5, 0.9), (-0.3, -0.3, -0.6))
    b = _bench(tmp_path, 5, (0, 0, 0, 0), (0.1, 0.2, 0.05, 0.15), (0.5, 0.5, 0.9), (-0.3, -0.3, -0.6), name="b.json")
    with pytest.raises(SystemExit, match="same seed twice"):
        seeds_report.main([a, b])
    d = json.load(open(a))
    del d["analysis"]["baselines"]["first_entity"]
    (tmp_path / "c.json").write_text(json.dumps(d))
    with pytest.raises(SystemExit, match="first_entity"):
        seeds_report.main([str(tmp_path / "c.json")])
    d["compare"] = None
    (tmp_path / "d.json").write_text(json.dumps(d))
    with pytest.raises(SystemExit, match="did the run finish"):
        seeds_report.main([str(tmp_path / "d.json")])
    (tmp_path / "e.json").write_text("[]")
    with pytest.raises(SystemExit, match="not a bench_train_local.json object"):
        seeds_report.main([str(tmp_path / "e.json")])
    (tmp_path / "f.json").write_text("{not json")
    with pytest.raises(SystemExit, match="f.json: not JSON"):
        seeds_report.main([str(tmp_path / "f.json")])


def test_rows_of_other_settings_or_malformed_numbers_are_refused(tmp_path):
    """One table is one setting over its seeds: a run of another preset or other --job_args (e.g. the former default
    beside the new one) is refused, not counted as a seed; a compare entry without its numbers, an unreadable file
    or an unwritable --md give one line, not a traceback."""
    a = _bench(tmp_path, 1, (0.2, 0.45, 0.05, 0.30), (0.3, 0.7, 0.2, 0.6), (0.5, 0.5, 0.6), (0.01, 0.01, 0.02))
    b = _bench(tmp_path, 2, (0.2, 0.45, 0.05, 0.30), (0.3, 0.7, 0.2, 0.6), (0.5, 0.5, 0.6), (0.01, 0.01, 0.02))
    d = json.load(open(b))
    d["preset"] = "f1_sentences"
    (tmp_path / "other.json").write_text(json.dumps(d))
    with pytest.raises(SystemExit, match="different settings"):
        seeds_report.main([a, str(tmp_path / "other.json")])
    d["preset"], d["job_args"] = "default", "--actor.adam.lr 1e-4"
    (tmp_path / "flags.json").write_text(json.dumps(d))
    with pytest.raises(SystemExit, match="different settings"):
        seeds_report.main([a, str(tmp_path / "flags.json")])
    d["job_args"] = ""
    d["compare"]["em"] = {"before": 0.1}
    (tmp_path / "partial.json").write_text(json.dumps(d))
    with pytest.raises(SystemExit, match="compare.em lacks"):
        seeds_report.main([str(tmp_path / "partial.json")])
    (tmp_path / "latin1.json").write_bytes(b'{"seed": "\xe9"}')
    with pytest.raises(SystemExit, match="latin1.json: not JSON"):
        seeds_report.main([str(tmp_path / "latin1.json")])
    with pytest.raises(SystemExit, match="cannot write --md"):
        seeds_report.main([a, "--md", str(tmp_path / "no" / "such" / "dir.md")])
