"""Every training launcher at 1 x 4, 1 x 8 and 2 x 8 GPUs: DeepSpeed's own batch check passes on the actor ranks the
launcher chose, the rollout micro-batches divide over them, every GPU is used; a layout or batch size that cannot
work is refused in one line that names the flag and the layouts that work (launcher and ``cli.train`` alike)."""

import os
import subprocess
from types import SimpleNamespace

import pytest

from openrlhf_search.cli import train as cli
from openrlhf_search.env.config import ConfigError
from openrlhf_search.launch.layout import LayoutError, batch_layout_problems, choose_layout, working_layouts
from tests.test_launchers import SCRIPTS, TRAINING_SCRIPTS, _argv, _env

LAYOUTS = [(1, 4), (1, 8), (2, 8)]


def _deepspeed_batch_check(train_batch, micro, world):
    """DeepSpeed 0.19's own code: gradient accumulation as ``_set_batch_related_parameters`` derives it from the
    train and micro batch OpenRLHF passes, then ``_batch_assertion``."""
    from deepspeed.runtime.config import DeepSpeedConfig

    cfg = SimpleNamespace(train_batch_size=train_batch, train_micro_batch_size_per_gpu=micro,
                          gradient_accumulation_steps=None, world_size=world)
    DeepSpeedConfig._set_batch_related_parameters(cfg)
    DeepSpeedConfig._batch_assertion(cfg)


@pytest.mark.parametrize("nnodes,gpus", LAYOUTS)
@pytest.mark.parametrize("script", TRAINING_SCRIPTS)
def test_every_launcher_fits_the_layout(script, nnodes, gpus):
    args, _ = cli.parse_args(_argv(script, NNODES=str(nnodes), GPUS_PER_NODE=str(gpus)))
    ranks = args.actor.num_nodes * args.actor.num_gpus_per_node
    _deepspeed_batch_check(args.train.batch_size, args.train.micro_batch_size, ranks)
    samples = args.rollout.batch_size * args.rollout.n_samples_per_prompt
    assert samples % args.rollout.micro_batch_size == 0
    assert (samples // args.rollout.micro_batch_size) % ranks == 0  # equal chunks for every rank
    assert samples % args.train.batch_size == 0  # whole updates per step
    engine_gpus = args.vllm.num_engines * args.vllm.tensor_parallel_size
    assert args.actor.num_nodes == nnodes
    if args.train.colocate_all:
        assert ranks == engine_gpus == nnodes * gpus and args.vllm.enable_sleep
    else:  # actor + reference on some GPUs of each node, the engines on the others
        assert args.train.colocate_actor_ref and not args.vllm.enable_sleep
        assert ranks + engine_gpus == nnodes * gpus and args.ref.num_gpus_per_node == args.actor.num_gpus_per_node
        assert args.algo.advantage.estimator != "gae"  # no critic without GPUs of its own
    assert args.vllm.enable_prefix_caching


def test_llama_defaults_train_on_every_gpu_of_8_and_keep_the_released_batches():
    """The released Llama batches (60 / 260 samples per update) do not fit 8 DeepSpeed ranks: the actor takes 6 / 5
    GPUs and vLLM the rest; the released layout (5 actor GPUs + one TP-2 engine) is reachable by variables."""
    for script, bs, actor in (("r1searcher_llama8b_instruct_stage1.sh", 60, 6),
                              ("r1searcher_llama8b_instruct_stage2.sh", 260, 5)):
        args, _ = cli.parse_args(_argv(script))
        assert args.train.batch_size == bs and args.actor.num_gpus_per_node == actor
        assert args.vllm.num_engines == 8 - actor and not args.train.colocate_all
        with pytest.raises(AssertionError):  # what the colocated 8-GPU layout met in DeepSpeed
            _deepspeed_batch_check(bs, 1, 8)
        released, _ = cli.parse_args(_argv(script, GPUS_PER_NODE="7", ACTOR_GPUS_PER_NODE="5", VLLM_TP="2"))
        assert (released.actor.num_gpus_per_node, released.vllm.num_engines,
                released.vllm.tensor_parallel_size) == (5, 1, 2)


def test_a_layout_that_cannot_work_is_refused_in_one_line():
    res = subprocess.run(["bash", os.path.join(SCRIPTS, "r1searcher_llama8b_instruct_stage1.sh")],
                         env=_env(DRY_RUN="argv", ACTOR_GPUS_PER_NODE="8"), capture_output=True, text=True,
                         timeout=60)
    assert res.returncode == 2
    lines = [ln for ln in res.stderr.splitlines() if ln.strip()]
    assert len(lines) == 1, res.stderr
    assert "--train.batch_size 60" in lines[0] and "8 actor ranks" in lines[0]
    assert "1x4" in lines[0] and "1x6" in lines[0] and "1x8," not in lines[0]  # the layouts that work, not 1x8


def test_cli_refuses_batch_sizes_that_do_not_fit_the_ranks():
    argv = _argv("searchr1_grpo_qwen2.5-3b_base.sh")
    with pytest.raises(ConfigError) as e:
        cli.parse_args(argv + ["--train.batch_size", "100"])
    msg = str(e.value)
    assert "\n" not in msg and "--train.batch_size 100" in msg and "actor layouts that work" in msg
    with pytest.raises(ConfigError, match=r"rollout micro-batches .* do not divide over 8 actor ranks"):
        # 40 prompts x 5 = 200 samples, one update of 200 = 1 x 25 x 8, but 20 micro-batches of 10 over 8 ranks
        cli.parse_args(argv + ["--rollout.batch_size", "40", "--train.batch_size", "200",
                               "--train.micro_batch_size", "1", "--rollout.micro_batch_size", "10"])


@pytest.mark.parametrize("flag", ["--train.batch_size", "--rollout.batch_size", "--rollout.micro_batch_size",
                                  "--data.max_len", "--search.topk"])
@pytest.mark.parametrize("value", ["-8", "0"])
def test_non_positive_sizes_name_their_flag(flag, value):
    with pytest.raises(ConfigError) as e:
        cli.parse_args(_argv("searchr1_ppo_qwen2.5-3b_base.sh") + [flag, value])
    assert str(e.value) == f"{flag} must be a positive number, got {value}"


def test_choose_layout_prefers_colocation_then_the_most_actor_gpus():
    assert choose_layout(1, 8, 1, 256, 2, 512, 8).colocated
    lay = choose_layout(1, 8, 2, 260, 1, 1040, 1)  # 5 actor GPUs leave 3: not TP-2 engines; 4 + 2 x TP 2
    assert (lay.actor_gpus_per_node, lay.vllm_engines) == (4, 2)
    with pytest.raises(LayoutError, match="critic"):  # a PPO critic cannot go without GPUs
        choose_layout(1, 8, 1, 60, 1, 240, 1, critic=True)
    assert not batch_layout_problems(6, 60, 1, 240, 1) and batch_layout_problems(8, 60, 1, 240, 1)
    assert (1, 6) in working_layouts(60, 1, 240, 1) and (1, 8) not in working_layouts(60, 1, 240, 1)


def test_serve_replicas_on_the_node_leave_their_gpus_out_of_the_layout():
    """RETRIEVER_MODE=serve with GPU replicas on one 8-GPU node (docs/cluster.md's Serve command): the replicas
    hold 4 GPUs of the same Ray, so training takes the other 4 (an 8-GPU placement would wait for GPUs Serve holds)."""
    env = dict(RETRIEVER_MODE="serve", RETRIEVER_REPLICAS="4", RETRIEVER_REPLICA_GPUS="1",
               RETRIEVER_SERVE_IP="10.0.0.9")
    args, cfg = cli.parse_args(_argv("searchr1_ppo_qwen2.5-7b_base.sh", **env))
    assert args.actor.num_gpus_per_node == 4 and args.vllm.num_engines == 4 and args.train.colocate_all
    assert cfg.retriever_urls == ["http://10.0.0.9:8000"]
    cpu_replicas, _ = cli.parse_args(_argv("searchr1_ppo_qwen2.5-7b_base.sh", **dict(env, RETRIEVER_REPLICA_GPUS="0")))
    assert cpu_replicas.actor.num_gpus_per_node == 8


@pytest.mark.parametrize("nnodes", [1, 2])
@pytest.mark.parametrize("script", TRAINING_SCRIPTS)
def test_async_every_launcher_resolves_with_vllm_on_its_own_gpus(script, nnodes):
    """ASYNC=1 at 1x8 and 2x8: a layout that OpenRLHF runs. vLLM never in the training placement group (no sleep
    mode, which async refuses), DeepSpeed's batch check passes on the chosen ranks, every GPU is used; a PPO critic
    shares the actor's GPUs (colocate_all, which under async colocates only the DeepSpeed models)."""
    from openrlhf_search.launch.async_checks import gpu_layout
    from openrlhf_search.launch.layout import gpus_needed
    from openrlhf_search.launch.memory_estimate import estimate

    args, _ = cli.parse_args(_argv(script, NNODES=str(nnodes), GPUS_PER_NODE="8", ASYNC="1"))
    assert args.train.async_enable and not args.vllm.enable_sleep
    a = args.actor.num_gpus_per_node
    assert 1 <= a < 8
    ranks = nnodes * a
    _deepspeed_batch_check(args.train.batch_size, args.train.micro_batch_size, ranks)
    assert not batch_layout_problems(ranks, args.train.batch_size, args.train.micro_batch_size,
                                     args.rollout.batch_size * args.rollout.n_samples_per_prompt,
                                     args.rollout.micro_batch_size)
    assert args.vllm.num_engines * args.vllm.tensor_parallel_size == nnodes * (8 - a)
    assert gpus_needed(args) == nnodes * 8 == gpu_layout(args)["total_gpus"]
    phases = estimate(args).get("phases")  # None for a stage-2 launcher whose stage-1 folder does not exist
    assert phases is None or ("generation" not in phases and phases["training"]["vllm"] == 0.0)  # engines apart
    if args.critic.model_name_or_path:
        assert args.train.colocate_all and args.critic.num_gpus_per_node == a
    else:
        assert args.train.colocate_actor_ref


def test_async_ppo_split_and_refusals_name_the_true_reason():
    ppo = (256, 4, 512, 8)  # batch sizes of Search-R1 PPO's shape: 4 actor GPUs of 8 fit
    lay = choose_layout(1, 8, 1, *ppo, critic=True, asynchronous=True)
    assert (lay.actor_gpus_per_node, lay.vllm_engines) == (4, 4) and "critic" in lay.describe()
    with pytest.raises(LayoutError) as e:  # the old refusal blamed VLLM_TP
        choose_layout(1, 8, 1, *ppo, actor_gpus_per_node=8, critic=True, asynchronous=True)
    msg = str(e.value)
    assert "ASYNC=1 keeps vLLM off the training GPUs" in msg and "VLLM_TP" not in msg.split(":")[0]
    assert "ACTOR_GPUS_PER_NODE=4 works here" in msg
    with pytest.raises(LayoutError, match=r"^VLLM_TP 4 does not divide the 6 GPUs per node left for vLLM.*"
                                          r"ACTOR_GPUS_PER_NODE=4 works here"):
        choose_layout(1, 8, 4, *ppo, actor_gpus_per_node=2, critic=True, asynchronous=True)
    with pytest.raises(LayoutError, match="at least 2 GPUs per node"):
        choose_layout(2, 1, 1, *ppo, asynchronous=True)
    # synchronous PPO in a split is refused for the critic, not for VLLM_TP
    with pytest.raises(LayoutError, match=r"^a synchronous PPO critic trains only in the colocated layout.*ASYNC=1"):
        choose_layout(1, 8, 1, 60, 1, 240, 1, actor_gpus_per_node=6, critic=True)
    with pytest.raises(LayoutError, match=r"^a synchronous PPO critic .* \(at 6 actor GPUs per node; at 8: "
                                          r"--train.batch_size 60"):
        choose_layout(1, 8, 1, 60, 1, 240, 1, critic=True)


def test_async_llama_picks_a_split_that_fits_itself():
    """Released Llama batches (60 / 260 samples per update): 8 ranks at 2x8 do not fit, so the split moves off
    half by itself (no ACTOR_GPUS_PER_NODE needed)."""
    lay = choose_layout(2, 8, 1, 60, 1, 240, 1, asynchronous=True)
    assert lay.actor_gpus_per_node in (3, 5) and not batch_layout_problems(2 * lay.actor_gpus_per_node, 60, 1, 240, 1)
    lay = choose_layout(2, 8, 1, 260, 1, 1040, 1, asynchronous=True)
    assert lay.actor_gpus_per_node == 5
    assert choose_layout(1, 8, 1, 60, 1, 240, 1, asynchronous=True).actor_gpus_per_node == 4
