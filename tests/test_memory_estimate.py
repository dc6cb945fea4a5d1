"""The per-GPU memory estimate against a small per-phase model written here from OpenRLHF 0.11.2's code (what each
phase holds on a GPU: ``ppo_trainer.ppo_train``'s sleep path, ``offload_deepspeed_states``' list, the experience
maker's sequential colocated forwards, vLLM's share at wake-up), for the launchers' layouts; its refusals name the
settings that fit; ``GPU_MEM_GB`` falls back to nvidia-smi, then 80; every launcher gets an estimate."""

import os
import shutil
import stat

import pytest

from openrlhf_search.cli import train as cli
from openrlhf_search.env.config import ConfigError
from openrlhf_search.launch.memory_estimate import (
    CUDA_CONTEXT_GB,
    GIB,
    KNOWN_CONFIGS,
    VLLM_ASLEEP_GB,
    estimate,
    gpu_memory_gb,
    model_shape,
    pinned_host_gb,
    retriever_gpu_cost,
)
from tests.test_launchers import TRAINING_SCRIPTS, _argv

PPO7 = "searchr1_ppo_qwen2.5-7b_base.sh"
QWEN_SINGLE = "r1searcher_qwen7b_base_single.sh"


def _reference(args, gpu):
    """GiB per phase on a training GPU, written from OpenRLHF's code for full fine-tuning at ZeRO-3 with gradient
    checkpointing (the launchers' setting), independently of the module's structure."""
    s = model_shape(args.actor.model_name_or_path)
    w = args.actor.num_nodes * args.actor.num_gpus_per_node
    p = s.params
    critic = bool(args.critic.model_name_or_path)
    ref = args.algo.kl.init_coef > 0
    sync_colocated = args.train.colocate_all and not args.train.async_enable
    bf16 = 2 * p / w / GIB  # a ZeRO-3 bf16 weight shard: never offloaded (lp_params is not in the offload list)
    rest = 14 * p / w / GIB  # bf16 grads + fp32 master + Adam moments: offloaded by --ds.enable_sleep
    models = 1 + critic
    stay = bf16 * (models + ref) + (0 if args.ds.enable_sleep else rest * models)
    ctx = CUDA_CONTEXT_GB * (1 + ref + critic + sync_colocated)
    t_train = args.train.micro_batch_size * args.data.max_len
    t_roll = args.rollout.micro_batch_size * args.data.max_len
    layer = lambda t: t * (6 * s.hidden + 4 * s.intermediate) * 2 / GIB
    kept = t_train * s.hidden * s.layers * 2 / GIB  # checkpointed layer inputs
    logits = t_train * s.vocab * (10 + (2 if args.actor.entropy_coef else 0)) / GIB  # measured on an H200
    actor_act = kept + max(logits, layer(t_train))
    critic_act = kept + layer(t_train) if critic else 0
    asleep = VLLM_ASLEEP_GB if sync_colocated else 0
    if args.ds.enable_sleep:
        fit = max(rest + actor_act, rest + critic_act if critic else 0)
    else:
        fit = actor_act + critic_act
    out = {"experience": asleep + stay + ctx + max(t_roll * s.vocab * 6 / GIB, layer(t_roll)),
           "training": asleep + stay + ctx + fit}
    if sync_colocated:
        out["generation"] = args.vllm.gpu_memory_utilization * gpu + stay + ctx
    return out


@pytest.mark.parametrize("script,env,gpu", [
    (PPO7, dict(GPUS_PER_NODE="4"), 80),  # colocated PPO at 1x4: sleep keeps only bf16 shards between fits
    (PPO7, dict(), 80),
    (PPO7, dict(ASYNC="1"), 141),  # async: both models' full states, actor and critic fit at once
    ("searchr1_grpo_qwen2.5-3b_base.sh", dict(), 80),
    (QWEN_SINGLE, dict(), 80),  # 30,024 tokens per micro-batch: logits and checkpointed activations dominate
    ("r1searcher_llama8b_instruct_stage1.sh", dict(), 80),  # a split layout: vLLM on GPUs of its own
    ("chat_tools_grpo_qwen3-8b.sh", dict(), 80),
])
def test_estimate_matches_the_per_phase_model(script, env, gpu):
    args, _ = cli.parse_args(_argv(script, **env))
    est = estimate(args, gpu)
    ref = _reference(args, gpu)
    assert set(est["phase_gb"]) - {"vllm_gpu"} == set(ref)
    for phase, gib in ref.items():
        assert est["phase_gb"][phase] == pytest.approx(gib, rel=0.01, abs=0.1), phase
    if args.train.colocate_all and not args.train.async_enable:
        assert est["vllm_gpu"] is None
    else:
        assert est["phase_gb"]["vllm_gpu"] == pytest.approx(args.vllm.gpu_memory_utilization * gpu, abs=0.1)


def test_colocated_ppo_7b_at_1x4_does_not_count_the_offloaded_critic_while_the_actor_trains():
    args, _ = cli.parse_args(_argv(PPO7, GPUS_PER_NODE="4"))
    est = estimate(args, 80)
    assert 50 < est["phase_gb"]["training"] < 66 and est["error"] is None  # not 88: the critic is offloaded
    gen = est["phases"]["generation"]
    shard = 2 * 7.62e9 / 4 / GIB
    assert gen["deepspeed_states"] == pytest.approx(3 * shard, abs=0.2)  # actor, critic, reference bf16 shards
    assert gen["vllm"] == pytest.approx(0.6 * 80)


def test_async_ppo_7b_at_1x8_on_80gb_is_refused_naming_what_fits():
    args, _ = cli.parse_args(_argv(PPO7, ASYNC="1"))
    est = estimate(args, 80)
    assert est["peak_gb"] > 80 and est["error"]
    assert "--ds.enable_sleep" in est["error"] and "--ds.adam_offload" in est["fixes"][1]
    assert "MEMORY_CHECK=0" in est["error"]
    assert estimate(args, 141)["error"] is None  # an H200 holds it
    with pytest.raises(ConfigError, match="fits with --ds.enable_sleep"):
        os.environ.pop("MEMORY_CHECK", None)
        os.environ["GPU_MEM_GB"] = "80"
        try:
            cli.memory_estimate(args)
        finally:
            os.environ.pop("GPU_MEM_GB")


def test_r1searcher_qwen_released_fits_80gb_and_the_logits_are_the_gpu_path():
    args, _ = cli.parse_args(_argv(QWEN_SINGLE))
    est = estimate(args, 80)
    assert 60 < est["peak_gb"] < 72 and est["error"] is None and est["peak_phase"] == "training"
    # a micro-batch of 1 at 30,024 tokens: the Triton cross-entropy path's 10 B (12 with entropy), not the CPU 16
    per_token = 10 + (2 if args.actor.entropy_coef else 0)
    act = est["phases"]["training"]["activations"]
    assert act == pytest.approx((30024 * 152064 * per_token + 30024 * 3584 * 28 * 2) / GIB, abs=0.2)


def test_every_launcher_gets_an_estimate(monkeypatch):
    for script in TRAINING_SCRIPTS + ["chat_tools_grpo_qwen3-4b.sh", "chat_tools_grpo_qwen3-8b.sh"]:
        if "stage2" in script:  # the stage-1 folder does not exist: the launcher exports its base model
            monkeypatch.setenv("MEMORY_MODEL", "Qwen/Qwen2.5-7B" if "qwen" in script else "meta-llama/Llama-3.1-8B")
        args, _ = cli.parse_args(_argv(script))
        est = estimate(args, 80)
        assert "phase_gb" in est and est["error"] is None, (script, est)
        monkeypatch.delenv("MEMORY_MODEL", raising=False)


def test_known_configs_give_the_published_sizes():
    sizes = {name: model_shape(name).params / 1e9 for name in KNOWN_CONFIGS}
    assert sizes["qwen2.5-3b"] == pytest.approx(3.09, abs=0.01)
    assert sizes["qwen2.5-7b"] == pytest.approx(7.62, abs=0.01)
    assert sizes["llama-3.1-8b"] == pytest.approx(8.03, abs=0.01)
    assert sizes["qwen3-4b"] == pytest.approx(4.02, abs=0.01)
    assert sizes["qwen3-8b"] == pytest.approx(8.19, abs=0.01)
    assert model_shape("Qwen/Qwen3-8B").layers == 36 and model_shape("nobody/unknown") is None


def test_pinned_host_memory_of_colocated_ppo_7b():
    args, _ = cli.parse_args(_argv(PPO7))
    # 14 B x 2 trained models offloaded by DeepSpeed sleep + 8 sleeping engines' bf16 weights
    assert pinned_host_gb(args, model_shape("qwen2.5-7b")) == pytest.approx((14 * 2 + 2 * 8) * 7.62, rel=0.01)
    asyn, _ = cli.parse_args(_argv(PPO7, ASYNC="1"))
    assert pinned_host_gb(asyn, model_shape("qwen2.5-7b")) == 0.0


def test_gpu_memory_from_env_then_nvidia_smi_then_80(monkeypatch, tmp_path):
    monkeypatch.setenv("GPU_MEM_GB", "141")
    assert gpu_memory_gb() == (141.0, "GPU_MEM_GB")
    monkeypatch.setenv("GPU_MEM_GB", "lots")
    with pytest.raises(ValueError, match="GPU_MEM_GB must be a positive number"):
        gpu_memory_gb()
    monkeypatch.delenv("GPU_MEM_GB")
    smi = tmp_path / "nvidia-smi"
    smi.write_text("#!/bin/sh\necho 143771\necho 143771\n")
    smi.chmod(smi.stat().st_mode | stat.S_IEXEC)
    monkeypatch.setenv("PATH", f"{tmp_path}:{os.environ['PATH']}")
    assert gpu_memory_gb() == (round(143771 / 1024, 1), "nvidia-smi")
    monkeypatch.setenv("PATH", "/nonexistent")
    assert gpu_memory_gb()[0] == 80.0


def test_the_retriever_counts_where_it_sits():
    cost = retriever_gpu_cost(21e6, 768, 8)  # wiki-18 e5 Flat over 8 GPUs: shard 3.8 + temp + context
    assert cost == pytest.approx(21e6 * 768 * 2 / 8 / GIB + 1.5 + CUDA_CONTEXT_GB, abs=0.01) and 5.5 < cost < 6.2
    split, _ = cli.parse_args(_argv("r1searcher_llama8b_instruct_stage1.sh"))
    on_training = estimate(split, 80, cost, retriever_on_training=True)
    on_vllm = estimate(split, 80, cost, retriever_on_training=False)
    assert on_training["phase_gb"]["training"] == pytest.approx(on_vllm["phase_gb"]["training"] + cost, abs=0.1)
    assert on_vllm["phase_gb"]["vllm_gpu"] == pytest.approx(on_training["phase_gb"]["vllm_gpu"] + cost, abs=0.1)


def test_a_launch_whose_checkpoints_cannot_fit_the_disk_is_refused(tmp_path, monkeypatch):
    from openrlhf_search.launch import memory_estimate
    from openrlhf_search.launch.memory_estimate import checkpoint_volume, disk_problem

    args, _ = cli.parse_args(_argv(PPO7) + ["--ckpt.path", str(tmp_path / "run" / "ckpt"),
                                             "--ckpt.output_dir", str(tmp_path / "run")])
    volume = checkpoint_volume(args)  # ~838 GB
    free = 500e9
    monkeypatch.setattr(memory_estimate.shutil, "disk_usage", lambda path: shutil._ntuple_diskusage(0, 0, free))
    line = disk_problem(args, volume)  # the folders do not exist yet: the nearest existing parent is asked
    assert line.startswith(f"{tmp_path / 'run' / 'ckpt'}: its disk ({tmp_path}) has 500 GB free, the run writes up "
                           "to 838 GB")
    assert "--ckpt.max_num (3)" in line and "DISK_CHECK=0" in line
    with pytest.raises(ConfigError, match="GB of checkpoints"):
        cli.check_disk(args)
    monkeypatch.setenv("DISK_CHECK", "0")
    cli.check_disk(args)  # a warning only
    assert disk_problem(args, dict(volume, at_most_gb=400)) is None
    (tmp_path / "run").mkdir()
    (tmp_path / "run" / "old.bin").write_bytes(b"x" * 100_000)  # a resumed run's checkpoints are rotated, not added
    assert disk_problem(args, dict(volume, at_most_gb=(free + 50_000) / 1e9)) is None
    assert disk_problem(args, dict(volume, at_most_gb=(free + 150_000) / 1e9)) is not None


def test_a_split_that_does_not_fit_names_a_split_that_does():
    """R1-Searcher Llama stage 1 at 2 x 8 with VLLM_TP=2 and 2 actor GPUs per node: its ZeRO-3 states and
    30,024-token step do not fit 64 GB, and another split the batch sizes allow (more training GPUs) is named."""
    args, _ = cli.parse_args(_argv("r1searcher_llama8b_instruct_stage1.sh", NNODES="2", VLLM_TP="2",
                                   ACTOR_GPUS_PER_NODE="2"))
    assert args.actor.num_gpus_per_node == 2 and args.vllm.num_engines == 6
    est = estimate(args, 64)
    assert est["error"] and any(f.startswith("ACTOR_GPUS_PER_NODE=") for f in est["fixes"]), est["fixes"]
    a = int(next(f for f in est["fixes"] if f.startswith("ACTOR_GPUS_PER_NODE=")).split("=")[1])
    assert a > 2 and (8 - a) % 2 == 0


def test_a_reference_computed_in_the_policy_actor_costs_no_weights_or_process():
    """With top-layer training under ZeRO-2 the policy actor computes the reference log-probs over its frozen trunk
    (``openrlhf_search.rl.shared_reference``): no reference model starts, so the estimate drops its bf16 weights (the
    whole 7.6B model under ZeRO-2) and its CUDA context; every layer trained keeps them. Catches an estimate that
    counts a model the run never starts, which would refuse layouts that fit."""
    base = _argv(PPO7, GPUS_PER_NODE="4") + ["--ds.zero_stage", "2"]
    full, _ = cli.parse_args(base)
    top, _ = cli.parse_args(base + ["--actor.trainable_layers", "4"])
    gen_full, gen_top = estimate(full, 80)["phases"]["generation"], estimate(top, 80)["phases"]["generation"]
    assert gen_full["deepspeed_states"] - gen_top["deepspeed_states"] == pytest.approx(2 * 7.62e9 / GIB, abs=0.2)
    assert gen_full["cuda_contexts"] - gen_top["cuda_contexts"] == pytest.approx(CUDA_CONTEXT_GB)
