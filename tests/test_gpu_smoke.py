"""``benchmarks/gpu_smoke.sh`` (the first 10 minutes of a GPU machine), checked on a CPU: the script parses
(``bash -n``); its dry run checks that the phase caps fit 10 minutes with none reaching 5, cli.eval's flags with
cli.eval's own parser, that ``benchmarks/gpu_numerics.py`` imports what it calls, prints the launcher, resume, LoRA and
evaluation commands and writes nothing; bad settings are one-line usage errors; without the GPU stack the real run
stops before it empties anything; it names no path outside the project."""

import os
import re
import subprocess
import sys

import torch

from tests.conftest import REPO_ROOT

GPU_SMOKE = os.path.join(REPO_ROOT, "benchmarks", "gpu_smoke.sh")


def test_gpu_smoke_script_parses_and_its_dry_run_checks_the_commands(tmp_path):
    assert subprocess.run(["bash", "-n", GPU_SMOKE]).returncode == 0
    env = dict(os.environ, PYTHON=sys.executable, LIMIT="7", OUT_DIR=str(tmp_path / "out"))
    res = subprocess.run(["bash", GPU_SMOKE, "--dry-run"], cwd=str(tmp_path), env=env, capture_output=True, text=True,
                         timeout=300)
    assert res.returncode == 0, res.stdout[-2000:] + res.stderr[-2000:]
    assert "ok: cli.eval, 7 questions, protocol searchr1" in res.stdout  # cli.eval's own parser
    assert "ok: numerics plan: packed vs padded log-probs" in res.stdout  # gpu_numerics' imports resolve
    caps = {m.group(1): int(m.group(2)) for m in re.finditer(r"cap (\w+): (\d+)s", res.stdout)}
    assert set(caps) == {"env", "assets", "imports", "numerics", "launcher", "resume", "lora"}
    assert sum(caps.values()) <= 600 and max(caps.values()) < 300  # 10 minutes; a hang fails in under 5
    assert f"caps add up to {sum(caps.values())}s" in res.stdout
    runs = {m.group(1): m.group(2) for m in re.finditer(r"^== would run \((\w+)\): (.*)$", res.stdout, re.M)}
    assert "GPUS_PER_NODE=1 bash examples/scripts/searchr1.sh grpo" in runs["launcher"]
    assert "--train.max_steps 1" in runs["launcher"] and "--ckpt.save_steps 1" in runs["launcher"]
    assert runs["resume"].endswith("--train.max_steps 2")  # the last value wins: a relaunch to step 2
    assert "--ds.lora.rank 8" in runs["lora"]
    assert "cli.doctor" in runs["imports"] or "flash_attn" in runs["imports"]
    assert "-m openrlhf_search.cli.eval" in runs["eval"] and "--backend" not in runs["eval"]
    assert "--limit 7" in runs["eval"]
    over = subprocess.run(["bash", GPU_SMOKE, "--dry-run"], env=dict(env, CAP_LAUNCHER="400"), capture_output=True,
                          text=True, timeout=300)
    assert over.returncode == 2 and "CAP_LAUNCHER 400s" in over.stderr
    assert not (tmp_path / "out").exists()  # a dry run writes nothing
    for bad_env, says in (({"PHASES": "launcher gpu"}, "unknown phase 'gpu'"), ({"LIMIT": "0"}, "LIMIT must be"),
                          ({"OUT_DIR": REPO_ROOT}, "would be emptied"), ({"CAP_LORA": "x"}, "CAP_LORA must be")):
        bad = subprocess.run(["bash", GPU_SMOKE, "--dry-run"], env=dict(env, **bad_env), capture_output=True, text=True)
        assert bad.returncode == 2 and says in bad.stderr, (bad_env, bad.stderr)
    assert subprocess.run(["bash", GPU_SMOKE, "--nope"], env=env, capture_output=True).returncode == 2
    if not torch.cuda.is_available():  # the real run stops at once on a machine without the GPU stack
        res = subprocess.run(["bash", GPU_SMOKE], cwd=str(tmp_path), env=env, capture_output=True, text=True,
                             timeout=300)
        assert res.returncode == 2 and "lacks the GPU stack" in res.stderr, res.stdout[-1000:] + res.stderr[-1000:]
        assert not (tmp_path / "out").exists()


def test_the_smoke_script_names_no_path_outside_the_project():
    """A user's machine has no /tmp layout or tool folder of ours: every default lives under the checkout."""
    with open(GPU_SMOKE, encoding="utf-8") as f:
        assert not re.search(r"(?<![\w.])/(tmp|work|home)/", f.read())
