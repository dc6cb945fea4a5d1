"""End-to-end learning signal of the CPU main job (slow): RL with search must improve SmolLM2-135M-Instruct's
held-out answers on a fixed seed.

This is the only check that catches a silent sign, mask or advantage error through the whole pipeline (executor,
reward, masked advantages, masked loss, update) on a real pretrained model. It runs the main job (``--preset
default``, 27-34 minutes on the loaded 2-core machine in 2026-12, BM25 retrieval as in ``make demo``) and asserts that the held-out F1 after
RL is at least 0.10 (the issue's target) above the F1 before RL, with a paired bootstrap 95% interval that excludes
zero (measured with this seed, 2026-12-01: +0.128 [+0.088, +0.167] on 64 questions; seeds 7 and 1 in README's
per-seed table; the run's tokens depend only on its seeds, so the margin of 0.028 absorbs float rounding on another
CPU, not sampling luck), and that Cover-EM and valid searches did not fall. It does not yet check issue 17's EM
target (EM gain with its interval above zero), which no setting meets so far (docs/trials_em.md). A sign flip in the
advantages, a loss on the wrong tokens or a dropped update makes the F1 fall or stay put, and the test fail. The
benchmark ``benchmarks/bench_train_local.py`` reports the same figures against the target of +0.10.
"""

import json
import os
import subprocess
import sys

import pytest

from tests.conftest import REPO_ROOT

pytest.importorskip("gguf", reason="SmolLM2 is read from its GGUF file (scripts/setup_cpu_env.sh installs gguf)")


@pytest.mark.slow
def test_rl_improves_held_out_f1_of_smollm2(tmp_path):
    from openrlhf_search.data.default_dataset import build_default_dataset

    ds = build_default_dataset(str(tmp_path / "data"), seed=0)
    out = tmp_path / "run"
    cmd = [sys.executable, "-m", "openrlhf_search.cli.train_local", "--preset", "default",
           "--train_data", ds.train_path, "--eval_data", ds.eval_path, "--corpus", ds.corpus_path,
           "--retriever.encoder", "bm25", "--ckpt.output_dir", str(out), "--ckpt.no_load"]
    env = dict(os.environ, PYTHONPATH=REPO_ROOT, TOKENIZERS_PARALLELISM="false")
    res = subprocess.run(cmd, cwd=REPO_ROOT, env=env, capture_output=True, text=True, timeout=3600)
    assert res.returncode == 0, res.stdout[-2000:] + res.stderr[-3000:]
    assert "before RL vs after RL" in res.stdout
    cmp = json.loads((out / "eval_compare.json").read_text())
    f1 = cmp["f1"]
    assert f1["n"] >= 64
    assert f1["diff"] >= 0.10 and f1["low"] > 0, f"RL did not improve held-out F1 by 0.10: {f1}"
    before = json.loads((out / "eval_before.json").read_text())
    after = json.loads((out / "eval.json").read_text())
    assert before["questions"] == after["questions"]  # the same held-out questions, the same order
    # what RL changed: answers closer to the gold span (Cover-EM does not fall) and no loss of the search habit
    assert after["cover_em"] >= before["cover_em"] and after["valid_search_rate"] >= before["valid_search_rate"] - 0.05
    assert (out / "learning_curves.png").stat().st_size > 10_000
