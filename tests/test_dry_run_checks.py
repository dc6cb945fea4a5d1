"""Dry runs refuse what the run would refuse, in one line: a mistyped flag (with the nearest valid names, no usage
dump), a non-positive size, an interpreter whose torch has no CUDA for a GPU run, a layout Ray has no free GPUs for;
a per-GPU memory estimate that refuses what does not fit, naming what does; SUBMIT=1 needs no corpus on the
submitting host."""

import json
import os
import subprocess
import sys
import time

import pytest

from openrlhf_search.cli import train as cli
from openrlhf_search.cli.train_args import nearest_flags
from openrlhf_search.launch.layout import LayoutError, gpus_needed, wait_for_free_gpus
from openrlhf_search.launch.memory_estimate import (
    TORCH_PATH_ENTROPY_EXTRA_BYTES,
    TORCH_PATH_TRAIN_LOGITS_BYTES,
    checkpoint_volume,
    model_shape,
    params_from_config,
)
from tests.test_launchers import _argv, _common, _inputs, _run, needs_shared

LLAMA1 = "r1searcher_llama8b_instruct_stage1.sh"


def _lines(text):
    return [ln for ln in text.splitlines() if ln.strip() and "Warning" not in ln and "import pynvml" not in ln]


def test_a_mistyped_flag_gets_one_line_with_the_nearest_names(capsys):
    argv = _argv("searchr1_ppo_qwen2.5-3b_base.sh") + ["--train.batchsize", "8", "--search.top_k", "3"]
    with pytest.raises(SystemExit) as e:
        cli.main(argv)
    assert e.value.code == 2
    err = _lines(capsys.readouterr().err)
    assert len(err) == 1 and "usage:" not in err[0]
    assert "--train.batchsize (nearest: --train.batch_size" in err[0]
    assert "--search.top_k (nearest: --search.topk" in err[0]
    assert nearest_flags(cli.build_parser(), "--batch_size")[:2] == ["--rollout.batch_size", "--train.batch_size"]


@needs_shared
def test_launcher_dry_run_refuses_bad_values_in_one_line(tmp_path):
    env = _inputs(tmp_path, "searchr1_grpo_qwen2.5-3b_base.sh")
    for extra, expect in ((["--train.batch_size", "-8"], "--train.batch_size must be a positive number, got -8"),
                          (["--rollout.batch_size", "-4"], "--rollout.batch_size must be a positive number, got -4"),
                          (["--train.batchsiz", "8"], "nearest: --train.batch_size")):
        res = _run("searchr1_grpo_qwen2.5-3b_base.sh", *extra, DRY_RUN="1", timeout=120, **env)
        assert res.returncode == 2 and res.stdout == "", res.stderr[-2000:]
        errors = [ln for ln in res.stderr.splitlines() if ln.startswith("error:")]
        assert len(errors) == 1 and expect in errors[0], res.stderr[-2000:]
        assert "usage:" not in res.stderr


def test_parameter_count_from_config_matches_the_real_model(tiny_policy):
    model = tiny_policy[0] if isinstance(tiny_policy, tuple) else tiny_policy
    params, vocab = params_from_config(model.config.to_dict())
    assert params == sum(p.numel() for p in model.parameters())
    assert vocab == model.config.vocab_size


@needs_shared
def test_dry_run_prints_the_memory_line_and_refuses_what_does_not_fit(tmp_path):
    env = _inputs(tmp_path, LLAMA1, GPU_MEM_GB="141")
    res = _run(LLAMA1, DRY_RUN="1", timeout=180, **env)
    assert res.returncode == 0, res.stderr[-2000:]
    line = next(ln for ln in res.stderr.splitlines() if "memory per GPU (GiB): experience" in ln)
    assert "of 141;" in line and "per node (GPU_MEM_GB)" in line
    assert "[dry_run] checkpoints: 112 GB per save" in res.stderr  # 12 B x 8.03B (ZeRO-3) + the HF copy
    out = json.loads(res.stdout)["memory_estimate"]
    assert out["checkpoints"]["at_most_gb"] > 300 and out["gpu_mem_gb"] == 141
    res = _run(LLAMA1, DRY_RUN="1", timeout=180, **dict(env, GPU_MEM_GB="30"))
    errors = [ln for ln in res.stderr.splitlines() if ln.startswith("error:")]
    assert res.returncode == 2 and len(errors) == 1 and "of 30 GiB" in errors[0] and "MEMORY_CHECK=0" in errors[0]
    res = _run(LLAMA1, DRY_RUN="1", timeout=180, **dict(env, GPU_MEM_GB="30", MEMORY_CHECK="0"))
    assert res.returncode == 0 and any(ln.startswith("warning: estimated") for ln in res.stderr.splitlines())


def test_a_gpu_run_refuses_a_python_without_cuda(capsys, monkeypatch):
    import torch

    if torch.version.cuda:
        pytest.skip("this interpreter's torch has CUDA")
    args = _argv("searchr1_ppo_qwen2.5-3b_base.sh")
    monkeypatch.setenv("OPENRLHF_SEARCH_REQUIRE_CUDA", "1")
    assert cli.main(args) == 2
    err = _lines(capsys.readouterr().err)
    assert len(err) == 1 and sys.executable in err[0] and "PYTHON=" in err[0] and "without CUDA" in err[0]
    res = _common("check_gpu_python; echo PASSED", timeout=60)  # the launcher, before anything starts
    assert res.returncode == 2 and "PASSED" not in res.stdout
    assert sys.executable in res.stderr and "PYTHON=" in res.stderr and "CPU_CLUSTER=1" in res.stderr


@needs_shared
def test_submit_dry_run_needs_no_corpus_here(tmp_path):
    env = _inputs(tmp_path, "searchr1_grpo_qwen2.5-7b_base.sh")
    env.pop("RETRIEVER_CORPUS")
    res = _run("ray_job_submit.sh", "searchr1_grpo_qwen2.5-7b_base.sh", DRY_RUN="1", RAY_ADDRESS="http://head:8265",
               NNODES="2", timeout=180, **env)
    assert res.returncode == 0, res.stderr[-2000:]
    assert "no corpus" not in res.stderr and "each node serves its own retriever" in res.stderr
    assert '"OPENRLHF_SEARCH_REQUIRE_CUDA": "1"' in res.stderr  # the job's driver checks its interpreter


@pytest.fixture(scope="module")
def ray_with_4_gpus():
    import ray

    ray.init(num_cpus=2, num_gpus=4, include_dashboard=False, log_to_driver=False)
    try:
        yield ray
    finally:
        ray.shutdown()


def test_a_layout_ray_cannot_place_fails_within_the_wait(ray_with_4_gpus):
    ray = ray_with_4_gpus
    eight, _ = cli.parse_args(_argv("searchr1_grpo_qwen2.5-3b_base.sh"))
    four, _ = cli.parse_args(_argv("searchr1_grpo_qwen2.5-3b_base.sh", GPUS_PER_NODE="4"))
    assert gpus_needed(eight) == 8 and gpus_needed(four) == 4
    start = time.monotonic()
    with pytest.raises(LayoutError, match=r"places 8 GPUs .* Ray has 4 free of 4 after 2 s"):
        wait_for_free_gpus(eight, timeout_s=2, poll_s=0.5)
    assert time.monotonic() - start < 10
    wait_for_free_gpus(four, timeout_s=2)  # fits

    @ray.remote(num_gpus=2, num_cpus=0)
    class Replica:  # what a Ray Serve retriever replica with GPUs holds
        def ready(self):
            return True

    holder = Replica.remote()
    ray.get(holder.ready.remote())
    deadline = time.monotonic() + 30  # Ray's resource view follows the placement asynchronously (slower when loaded)
    while ray.available_resources().get("GPU", 0) > 2 and time.monotonic() < deadline:
        time.sleep(0.2)
    with pytest.raises(LayoutError, match=r"places 4 GPUs .* Ray has 2 free of 4"):
        wait_for_free_gpus(four, timeout_s=1, poll_s=0.5)
    ray.kill(holder)


def test_a_relaunch_resumes_or_refuses_a_used_folder(tmp_path):
    run = tmp_path / "run"
    snippet = f'resume_args --ckpt.output_dir "{run}" --ckpt.path "{run}/ckpt"; echo "ARGS=${{RESUME_ARGS[*]:-}}"'
    res = _common(snippet, timeout=60)  # nothing there: a fresh start
    assert res.returncode == 0 and "ARGS=\n" in res.stdout + "\n"
    (run / "tensorboard").mkdir(parents=True)  # used, but nothing to resume from
    res = _common(snippet, timeout=60)
    assert res.returncode == 2 and "ARGS=" not in res.stdout
    assert len(_lines(res.stderr)) == 1 and "FRESH=1" in res.stderr and str(run) in res.stderr
    (run / "ckpt" / "_actor" / "global_step40").mkdir(parents=True)
    (run / "ckpt" / "_actor" / "global_step40" / "mp_rank_00_model_states.pt").write_text("x")
    (run / "ckpt" / "_actor" / "latest").write_text("global_step40")
    res = _common(snippet, timeout=60)
    assert res.returncode == 0 and "ARGS=--ckpt.load_enable" in res.stdout and "global_step40" in res.stderr
    res = _common(snippet, timeout=60, FRESH="1")
    assert res.returncode == 0 and "ARGS=\n" in res.stdout + "\n"
    assert not run.exists() and len(list(tmp_path.glob("run.old-*"))) == 1  # moved aside, never deleted


def test_stage2_takes_the_newest_hf_copy_of_stage1(tmp_path):
    stage1 = tmp_path / "stage1"
    for step in (3, 10, 20):  # numeric order: 20 is the newest, not "3"
        (stage1 / "ckpt" / f"global_step{step}_hf").mkdir(parents=True)
        (stage1 / "ckpt" / f"global_step{step}_hf" / "config.json").write_text("{}")
    (stage1 / "ckpt" / "global_step30").mkdir()  # DeepSpeed states only: not a model
    data = tmp_path / "train.jsonl"
    data.write_text("{}\n")
    snippet = 'TRAIN_DATA_FILE="$D"; MODEL="$S"; STAGE1_FROM="$S"; check_inputs; echo "MODEL=$MODEL"'
    res = _common(snippet, timeout=60, D=str(data), S=str(stage1))
    assert res.returncode == 0, res.stderr
    assert f"MODEL={stage1}/ckpt/global_step20_hf" in res.stdout
    empty = tmp_path / "empty"
    empty.mkdir()
    res = _common(snippet, timeout=60, D=str(data), S=str(empty))
    assert res.returncode == 2 and len(_lines(res.stderr)) == 1 and "global_step*_hf" in res.stderr


def test_cluster_node_setup_refuses_a_cpu_torch_before_starting_anything():
    import torch

    if torch.version.cuda:
        pytest.skip("this interpreter's torch has CUDA")
    script = os.path.join(os.path.dirname(__file__), "..", "examples", "scripts", "cluster_node_setup.sh")
    env = dict(os.environ, PYTHON=sys.executable, HEAD="1", DRY_RUN="0")
    res = subprocess.run(["bash", script, "--corpus", "/x/wiki.jsonl"], env=env, capture_output=True, text=True,
                         timeout=60)
    assert res.returncode == 2 and res.stdout == ""
    assert len(_lines(res.stderr)) == 1 and sys.executable in res.stderr and "PYTHON=" in res.stderr


def test_hf_copies_are_bounded_like_the_deepspeed_states(tmp_path):
    from openrlhf_search.rl.trainer import prune_hf_copies

    for step in (5, 10, 40, 20, 30):
        (tmp_path / f"global_step{step}_hf").mkdir()
    for step in (10, 30):
        (tmp_path / f"best_global_step{step}_hf").mkdir()
    (tmp_path / "_actor").mkdir()  # DeepSpeed's own folder: not touched
    removed = prune_hf_copies(str(tmp_path), 2)
    assert sorted(os.path.basename(p) for p in removed) == ["global_step10_hf", "global_step20_hf",
                                                             "global_step5_hf"]
    assert sorted(os.listdir(tmp_path)) == ["_actor", "best_global_step10_hf", "best_global_step30_hf",
                                            "global_step30_hf", "global_step40_hf"]
    assert prune_hf_copies(str(tmp_path), 1) == [str(tmp_path / "global_step30_hf"),
                                                 str(tmp_path / "best_global_step10_hf")]


_LOGITS_PEAK = r"""
import os, sys, threading, torch
import openrlhf_search._cpu_compat  # noqa: F401
sys.modules["flash_attn.ops.triton.cross_entropy"] = None  # the torch path, as the CPU cluster mode
from openrlhf.models.utils import compute_entropy, log_probs_from_logits
T, V, ent = int(sys.argv[1]), int(sys.argv[2]), sys.argv[3] == "1"
hidden = torch.randn(T, 64, dtype=torch.bfloat16, requires_grad=True)
head = torch.randn(V, 64, dtype=torch.bfloat16, requires_grad=True)
labels = torch.randint(0, V, (1, T))
page = os.sysconf("SC_PAGE_SIZE")
def rss():
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * page
def step(h, lab):  # Actor.forward's logits path: bf16 logits -> float32 -> log-probs (+ entropy) -> backward
    logits = (h @ head.t()).unsqueeze(0).to(torch.float32)
    loss = -log_probs_from_logits(logits, lab).mean()
    if ent:
        loss = loss - 0.001 * compute_entropy(logits).mean()
    loss.backward()
step(hidden[:8].detach().requires_grad_(), labels[:, :8])
head.grad = None
base = rss()  # resident now (not the high-water mark, which the imports may have set)
peak, done = [base], []
def poll():
    while not done:
        peak[0] = max(peak[0], rss())
watcher = threading.Thread(target=poll)
watcher.start()
step(hidden, labels)
done.append(1)
watcher.join()
print((peak[0] - base) / (T * V))
"""


@pytest.mark.parametrize("entropy", [False, True])
def test_training_logits_bytes_match_a_measured_peak(entropy):
    """The estimate's bytes per token x vocabulary of a training micro-batch against the peak resident memory of
    OpenRLHF's own log-prob (and entropy) functions, forward + backward, on a long micro-batch (2,048 tokens x a
    32,768 vocabulary: 0.25 GiB per float32 copy; the bytes of this path do not depend on the device), read from
    /proc/self/statm by a thread polling during the step."""
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    res = subprocess.run([sys.executable, "-c", _LOGITS_PEAK, "2048", "32768", "1" if entropy else "0"],
                         capture_output=True, text=True, timeout=300, env=env)
    assert res.returncode == 0, res.stderr[-2000:]
    measured = float(res.stdout.strip().splitlines()[-1])
    expected = TORCH_PATH_TRAIN_LOGITS_BYTES + (TORCH_PATH_ENTROPY_EXTRA_BYTES if entropy else 0.0)
    assert 0.85 * expected <= measured <= 1.15 * expected, (measured, expected)
    assert measured > 6 * 2  # twice what the forward-only estimate counted: the backward is what sizes the run


def test_checkpoint_volume_per_save_and_at_most():
    ppo, _ = cli.parse_args(_argv("searchr1_ppo_qwen2.5-7b_base.sh"))
    vol = checkpoint_volume(ppo)
    params = model_shape("Qwen/Qwen2.5-7B").params  # 7.62e9 from the built-in config
    assert params == pytest.approx(7.62e9, rel=1e-3) and vol["trained_models"] == 2  # actor and critic
    hf = 2 * params / 1e9 if ppo.ckpt.save_hf else 0.0
    assert ppo.ds.zero_stage == 3  # master + moments, 12 B: measured 12.07 on the CPU mode's tiny model
    assert vol["per_checkpoint_gb"] == pytest.approx(12 * params * 2 / 1e9 + hf, abs=0.1)
    assert vol["at_most_gb"] > ppo.ckpt.max_num * vol["per_checkpoint_gb"] > 550  # ~0.84 TB with best + final
    grpo, _ = cli.parse_args(_argv("searchr1_grpo_qwen2.5-7b_base.sh", ) + ["--ckpt.max_num", "1"])
    one = checkpoint_volume(grpo)
    assert one["trained_models"] == 1 and one["at_most_gb"] < vol["at_most_gb"] / 2
    assert "per save" in one["line"] and "--ckpt.max_num 1" in one["line"]
