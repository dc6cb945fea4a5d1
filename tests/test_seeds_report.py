"""benchmarks/seeds_report.py: one row per training seed of the CPU main job and its targets checked seed by seed.

Mutations caught: a target read from the point estimate where the interval decides (a gain of +0.05 with its interval
touching zero counted as met); the 0.60 bar applied as > instead of >=; a seed silently dropped or counted twice;
runs of two settings or a run without its comparison accepted as rows.
"""

import json

import pytest

from benchmarks import seeds_report


def _c(before, after, low, high):
    return {"before": before, "after": after, "diff": after - before, "low": low, "high": high, "n": 64}


def _run(tmp_path, seed, em, last_word_em, name=None, lr=1e-4, split="heldout"):
    folder = tmp_path / (name or f"seed{seed}")
    folder.mkdir()
    tag = "" if split == "heldout" else f"_{split}"
    base = {"last_word": {"label": "last word", "em": [last_word_em, 0, 1], "f1": [last_word_em, 0, 1],
                          "after_minus": {"em": _c(last_word_em, em[1], -0.1, 0.2)}},
            "first_entity": {"label": "entity", "em": [0.98, 0.9, 1.0], "f1": [0.98, 0.9, 1.0],
                             "after_minus": {"em": _c(0.98, em[1], -0.5, -0.3)}}}
    (folder / f"eval_compare{tag}.json").write_text(json.dumps(
        {"em": _c(*em), "f1": _c(0.5, 0.6, 0.0, 0.2), "cover_em": _c(0.5, 0.6, 0.0, 0.2)}))
    (folder / f"eval_analysis{tag}.json").write_text(json.dumps({"baselines": base}))
    (folder / f"job{tag}.json").write_text(json.dumps(
        {"settings": {"seed": seed, "lr": lr, "steps": 30, "out": str(folder), "split": split}, "wall_s": 1500.0,
         "load_average_start": [0.1, 0.2, 0.3], "peak_pss_gib": 9.5}))
    return str(folder)


def test_targets_and_every_seed_kept(tmp_path):
    ok = _run(tmp_path, 1, (0.4, 0.62, 0.1, 0.3), 0.5)
    touching = _run(tmp_path, 2, (0.5, 0.60, 0.0, 0.2), 0.55)  # exactly 0.60 meets the bar; low = 0 is not above
    below = _run(tmp_path, 3, (0.3, 0.55, 0.1, 0.4), 0.58)
    text = seeds_report.main([ok, touching, below])
    assert "target em_after_ge_0.60: met on 2 of 3 seeds [1, 2]" in text
    assert "target em_gain_interval_above_0: met on 2 of 3 seeds [1, 3]" in text
    assert "target em_after_above_last_word: met on 2 of 3 seeds [1, 2]" in text
    rows = [line for line in text.splitlines() if line.startswith("| ") and line[2].isdigit()]
    assert [r.split("|")[1].strip() for r in rows] == ["1", "2", "3"]
    assert "1500 s" in rows[0] and "9.5 GiB" in rows[0] and "0.500 / 0.980" in rows[0]


def test_bad_inputs_are_refused_with_a_reason(tmp_path):
    a = _run(tmp_path, 5, (0.4, 0.6, 0.1, 0.3), 0.5)
    b = _run(tmp_path, 5, (0.4, 0.6, 0.1, 0.3), 0.5, name="again")
    with pytest.raises(SystemExit, match="same seed twice"):
        seeds_report.main([a, b])
    c = _run(tmp_path, 6, (0.4, 0.6, 0.1, 0.3), 0.5, lr=2e-4)
    with pytest.raises(SystemExit, match="different settings"):
        seeds_report.main([a, c])
    with pytest.raises(SystemExit, match="missing"):
        seeds_report.main([a, "--split", "validation"])
    v = _run(tmp_path, 8, (0.4, 0.6, 0.1, 0.3), 0.5, split="validation")
    assert "validation questions" in seeds_report.main([v, "--split", "validation"])
    (tmp_path / "seed5" / "eval_compare.json").write_text('{"em": {"before": 0.1}}')
    with pytest.raises(SystemExit, match="no before / after"):
        seeds_report.main([a])
