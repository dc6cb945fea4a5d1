"""A CPU_CLUSTER=1 run ends by saying what a healthy result looks like, and a failed one says it failed."""

import os

import pytest

from tests.test_launchers import _common


@pytest.mark.parametrize("rc", [0, 3])
def test_cpu_cluster_run_says_what_healthy_looks_like(tmp_path, rc):
    stub = tmp_path / "python"
    stub.write_text(f"#!/bin/bash\nexit {rc}\n")  # stands in for cli.train (the run itself is tested elsewhere)
    os.chmod(stub, 0o755)
    run = tmp_path / "run"
    snippet = (f'PYTHON="{stub}"; RETRIEVER_URLS=http://127.0.0.1:9; RUN_DESC=searchr1_grpo; MAX_STEPS=2; '
               f'CPU_ARGS=(); ASYNC_ARGS=(); EXTRA_ARGS=(); '
               f'launch --ckpt.output_dir "{run}" --ckpt.path "{run}/ckpt"; echo "RC=$?"')
    res = _common(snippet, timeout=60, CPU_CLUSTER="1", OUTPUT_ROOT=str(tmp_path))
    if rc == 0:
        assert "RC=0" in res.stdout, res.stderr
        assert "healthy = this exit code 0 and 2 steps logged" in res.stderr and "reward of 0" in res.stderr
    else:
        assert res.returncode == 3 and "the run failed (exit 3)" in res.stderr  # set -e: the launcher exits 3
        assert "healthy" not in res.stderr
