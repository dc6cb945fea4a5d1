"""The retrieval benchmarks take their data by flag and refuse a missing file in one line saying what it is and where
the default comes from, instead of a traceback."""

import os
import subprocess
import sys

import pytest

from tests.conftest import REPO_ROOT


@pytest.mark.parametrize("script,flag", [("retrieval_quality.py", "--questions"), ("bench_retriever.py", "--corpus"),
                                         ("bench_executor.py", "--corpus")])
def test_a_missing_benchmark_input_is_one_line(script, flag, tmp_path):
    missing = str(tmp_path / "not_here.jsonl")
    res = subprocess.run([sys.executable, os.path.join(REPO_ROOT, "benchmarks", script), flag, missing],
                         capture_output=True, text=True, timeout=300, cwd=str(tmp_path))
    lines = [ln for ln in res.stderr.splitlines() if ln.strip() and "Warning" not in ln and "pynvml" not in ln]
    assert res.returncode != 0 and len(lines) == 1 and "Traceback" not in res.stderr, res.stderr[-2000:]
    assert lines[0].startswith(f"error: {flag} {missing} not found") and "../shared/data" in lines[0]
