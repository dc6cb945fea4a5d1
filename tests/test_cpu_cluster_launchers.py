"""Every training launcher resolves its CPU cluster mode (``CPU_CLUSTER=1``) without starting anything: the
``--cpu_cluster`` switch, the tiny assets in place of the model and data, ``MAX_STEPS``, small batches after the
script's own flags and before the user's extra flags, and OpenRLHF's parser accepts the result. Running two of them
for real is tests/test_cpu_cluster_e2e.py::test_launcher_runs_two_steps_in_cpu_cluster_mode."""

import glob
import os
import subprocess
import sys

import pytest

from openrlhf_search.cli import train as cli
from openrlhf_search.parity.check import RETRIEVER_MARK

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SCRIPTS = os.path.join(REPO, "examples", "scripts")
LAUNCHERS = sorted(os.path.basename(p) for p in glob.glob(os.path.join(SCRIPTS, "r1searcher_*.sh"))
                   + glob.glob(os.path.join(SCRIPTS, "searchr1_*.sh")))


def _argv(script, *extra, **env):
    full = dict(os.environ, PYTHON=sys.executable, DRY_RUN="argv", CPU_CLUSTER="1", CPU_CLUSTER_CACHE="/cache/cc")
    for key in ("RETRIEVER_URLS", "RETRIEVER_CORPUS", "MODEL", "TRAIN_DATA", "EVAL_DATA", "STAGE1_CKPT",
                "RETRIEVER_PORT", "RETRIEVER_INDEX_DIR"):
        full.pop(key, None)
    full.update(env)
    out = subprocess.run(["bash", os.path.join(SCRIPTS, script), *extra], env=full, capture_output=True,
                         check=True, timeout=60)
    parts = [a.decode() for a in out.stdout.split(b"\0") if a]
    mark = parts.index(RETRIEVER_MARK)
    return parts[:mark], dict(p.split("=", 1) for p in parts[mark + 1:]), out.stderr.decode()


def _last(argv, flag):
    return argv[len(argv) - 1 - argv[::-1].index(flag) + 1]


@pytest.mark.parametrize("script", LAUNCHERS)
def test_every_launcher_resolves_its_cpu_cluster_settings(script):
    """Catches: a launcher that ignores CPU_CLUSTER (no --cpu_cluster, the 7B model, 512-prompt batches), a stage-2
    launcher still pointing at a stage-1 checkpoint, MAX_STEPS not reaching the trainer, a paper encoder for the
    retriever, a CPU layout without the GPU layouts' prefix caching (the cache reset after each sync never runs)."""
    argv, retriever, log = _argv(script, MAX_STEPS="3")
    assert "--cpu_cluster" in argv
    protocol = _last(argv, "--search.protocol")
    chat = _last(argv, "--search.chat_template")
    model = _last(argv, "--actor.model_name_or_path")
    assert model.startswith("/cache/cc/") and model.endswith("/model") and f"<{protocol}_{chat}>" in model
    assert _last(argv, "--data.prompt_dataset").startswith("/cache/cc/")
    assert _last(argv, "--train.max_steps") == "3"
    assert _last(argv, "--rollout.batch_size") == "2" and _last(argv, "--data.max_len") == "1024"
    n = int(_last(argv, "--rollout.n_samples_per_prompt"))
    assert _last(argv, "--train.batch_size") == str(2 * n)
    assert retriever["encoder"] == "bm25" and retriever["corpus"].startswith("/cache/cc/")
    assert "CPU cluster:" in log
    flat = cli.build_parser().parse_args(argv)  # every flag is one OpenRLHF's parser (plus ours) knows
    assert flat.cpu_cluster
    assert getattr(flat, "vllm.enable_prefix_caching", None) is True
    # ZeRO-3 and gradient checkpointing, as the GPU layouts (a CPU test never ran that combination before)
    assert getattr(flat, "ds.zero_stage") == 3 and getattr(flat, "actor.gradient_checkpointing_enable") is True
    args, _ = cli.parse_args(argv)  # the CPU settings keep them
    assert args.ds.zero_stage == 3 and args.actor.gradient_checkpointing_enable


def test_user_flags_still_win_over_the_cpu_cluster_sizes():
    argv, _, _ = _argv("searchr1_grpo_qwen2.5-3b_base.sh", "--rollout.batch_size", "3")
    assert _last(argv, "--rollout.batch_size") == "3"


def test_without_the_switch_the_launchers_are_unchanged():
    full = dict(os.environ, PYTHON=sys.executable, DRY_RUN="argv")
    full.pop("CPU_CLUSTER", None)
    out = subprocess.run(["bash", os.path.join(SCRIPTS, "searchr1_ppo_qwen2.5-7b_base.sh")], env=full,
                         capture_output=True, check=True, timeout=60)
    argv = [a.decode() for a in out.stdout.split(b"\0") if a]
    assert "--cpu_cluster" not in argv and _last(argv, "--rollout.batch_size") == "512"


def test_cpu_cluster_cannot_be_submitted_to_a_cluster(tmp_path):
    env = dict(os.environ, PYTHON=sys.executable, DRY_RUN="argv", CPU_CLUSTER="1", SUBMIT="1")
    res = subprocess.run(["bash", os.path.join(SCRIPTS, "searchr1_grpo_qwen2.5-3b_base.sh")], env=env,
                         capture_output=True, text=True, timeout=60)
    assert res.returncode == 2 and "cannot be combined with SUBMIT=1" in res.stderr


def test_the_cpu_ppo_launchers_layout_says_zero3_with_gradient_checkpointing():
    """What the dry run prints (``layout`` in its JSON) for CPU_CLUSTER=1 GPUS_PER_NODE=2 on the Search-R1 PPO
    launcher: 2 ranks per model and a critic, ZeRO-3, gradient checkpointing."""
    argv, _, _ = _argv("searchr1_ppo_qwen2.5-3b_base.sh", GPUS_PER_NODE="2")
    args, _ = cli.parse_args(argv)
    layout = cli.layout_summary(args)
    assert layout["zero_stage"] == 3 and layout["gradient_checkpointing"] is True
    assert layout["actor_ranks"] == layout["critic_ranks"] == 2 and layout["vllm_engines"] == 2
