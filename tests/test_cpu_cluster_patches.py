"""The CPU cluster mode's patches (openrlhf_search/cpu/cluster_mode/runtime.py) without Ray: every patch point and
cited line still
exists in the installed OpenRLHF / DeepSpeed / vLLM (an upgrade fails here at once), the patches take effect in a
fresh process (no DeepSpeed JIT build, gloo all-reduce, torch AdamW, CPU devices), the gloo weight-sync group
broadcasts bf16 weights between two processes, the CPU settings, the weight comparison of the sync probe, and the
actor's training statistics leaving failed samples out, through OpenRLHF's real ``ppo_train``."""

import json
import multiprocessing
import os
import socket
import subprocess
import sys
from types import SimpleNamespace

import pytest
import torch

import openrlhf_search._cpu_compat  # noqa: F401
from openrlhf_search.cpu.cluster_mode import runtime as cpu_cluster
from openrlhf_search.cpu.cluster_mode import settings as cpu_settings
from cpu_demo.probe import compare_weights, vllm_view

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def test_every_patch_point_and_cited_line_exists():
    """Catches: an OpenRLHF / DeepSpeed / vLLM upgrade that renames a patched function or moves a cited line (the
    patch would silently stop covering the call)."""
    assert cpu_cluster.missing_patch_points() == []
    assert cpu_cluster.stale_line_refs() == []


def test_the_line_check_reports_a_moved_line(monkeypatch):
    """The checker itself fails on a line that no longer holds its text (mutation: a line number off by one)."""
    rel, line, text = cpu_cluster.LINE_REFS[1]
    monkeypatch.setattr(cpu_cluster, "LINE_REFS", ((rel, line + 1, text),))
    out = cpu_cluster.stale_line_refs()
    assert len(out) == 1 and f"{rel}:{line + 1}" in out[0]
    monkeypatch.setattr(cpu_cluster, "PATCH_POINTS", (("openrlhf.utils.distributed_util", "no_such_function"),))
    assert cpu_cluster.missing_patch_points() == ["openrlhf.utils.distributed_util:no_such_function"]


PATCH_CHECK = r'''
import json, os, sys
from openrlhf_search.cpu.cluster_mode import runtime as cpu_cluster
cpu_cluster.install()
import torch
out = {}
out["current_device"] = torch.cuda.current_device()
torch.cuda.set_device(0); torch.cuda.synchronize(); torch.cuda.empty_cache()
out["current_stream"] = torch.cuda.current_stream()
import openrlhf.utils.distributed_util as du
import openrlhf.trainer.ray.ppo_actor as pa
out["sync_group"] = [du.stateless_init_process_group.__name__, pa.stateless_init_process_group.__name__]
import openrlhf.models.utils as mu
logits = torch.randn(2, 5, 11)
labels = torch.randint(0, 11, (2, 5))
ref = torch.log_softmax(logits, -1).gather(-1, labels.unsqueeze(-1)).squeeze(-1)
out["log_probs_torch_path"] = bool(torch.allclose(mu.log_probs_from_logits(logits.clone(), labels), ref, atol=1e-5))
import torch.distributed as dist
os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=sys.argv[1], RANK="0", WORLD_SIZE="1", LOCAL_RANK="0")
import deepspeed
deepspeed.init_distributed(dist_backend="gloo")
import importlib
dct = importlib.import_module("deepspeed.comm.torch")  # `import deepspeed.comm.torch` yields its `torch` name
out["shm_op"] = repr(dct.build_shm_op())
import openrlhf.utils.deepspeed.deepspeed as ods
mesh = ods.init_device_mesh("cuda", (1, 1, 1), mesh_dim_names=("dp", "sp", "tp"))
out["mesh_device"] = mesh.device_type
from openrlhf_search.cli import train as cli
args, _ = cli.parse_args(["--actor.model_name_or_path", "Qwen/Qwen2.5-7B", "--data.prompt_dataset", "x.jsonl",
                          "--algo.advantage.estimator", "group_norm", "--rollout.n_samples_per_prompt", "2",
                          "--cpu_cluster"])
from openrlhf.utils import get_strategy
strategy = get_strategy(args)
config = strategy.get_ds_train_config(optim_dict={"type": "AdamW", "params": {"lr": 1e-3, "betas": [0.9, 0.95],
                                                   "eps": 1e-8, "weight_decay": 0.0}})
out["torch_adam"] = config["optimizer"]["params"].get("torch_adam")
model = torch.nn.Linear(4, 4)
engine, opt, _, _ = deepspeed.initialize(model=model, model_parameters=model.parameters(),
                                         config={"train_micro_batch_size_per_gpu": 1, "optimizer": config["optimizer"],
                                                 "zero_optimization": {"stage": 0}})
out["optimizer"] = type(opt).__name__ if not hasattr(opt, "optimizer") else type(opt.optimizer).__name__
from deepspeed.accelerator import get_accelerator
try:
    get_accelerator().create_op_builder("FusedAdamBuilder").jit_load()
    out["jit"] = "built"
except cpu_cluster.JitBuildRefused as e:
    out["jit"] = str(e)
from openrlhf.trainer.ppo_utils.replay_buffer import NaiveReplayBuffer
out["replay_device"] = str(NaiveReplayBuffer(2).target_device)
print("RESULT " + json.dumps(out, default=str))
'''


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_patches_take_effect_in_a_fresh_process(tmp_path):
    """After ``install()`` (what the Ray setup hook runs) in a new process: torch.cuda calls are CPU no-ops,
    OpenRLHF's device mesh is a CPU mesh, its log-probs take the torch path, DeepSpeed loads no shared-memory op
    and trains with torch's AdamW, a JIT build fails at once with the op's name, the replay buffer targets the CPU,
    and both weight-sync lookups are the gloo group. Catches the removal of any one patch."""
    env = dict(os.environ, PYTHONPATH=REPO, TORCH_EXTENSIONS_DIR=str(tmp_path / "ext"), OMP_NUM_THREADS="1")
    res = subprocess.run([sys.executable, "-c", PATCH_CHECK, str(_free_port())], env=env, capture_output=True,
                         text=True, timeout=300, cwd=str(tmp_path))
    line = [x for x in res.stdout.splitlines() if x.startswith("RESULT ")]
    assert res.returncode == 0 and line, res.stdout[-3000:] + res.stderr[-3000:]
    out = json.loads(line[0][len("RESULT "):])
    assert out["current_device"] == "cpu" and out["current_stream"] is None
    assert out["sync_group"] == ["gloo_stateless_init_process_group"] * 2
    assert out["log_probs_torch_path"] is True
    assert out["shm_op"] == "None"  # DeepSpeed would JIT-build deepspeed_shm_comm here otherwise
    assert out["mesh_device"] == "cpu"
    assert out["torch_adam"] is True
    assert out["optimizer"] == "AdamW"  # torch.optim.AdamW, not DeepSpeed's FusedAdam
    assert "fused_adam" in out["jit"] and "JIT-build" in out["jit"]
    assert out["replay_device"] == "cpu"
    assert not (tmp_path / "ext").exists()  # nothing was compiled


def test_a_jit_refusal_names_a_stale_build_lock_and_how_to_clear_it(tmp_path):
    lock = tmp_path / "py311_cpu" / "deepspeed_shm_comm" / "lock"
    lock.parent.mkdir(parents=True)
    lock.write_text("")
    assert cpu_cluster.stale_build_locks(str(tmp_path)) == [str(lock)]
    msg = cpu_cluster.jit_refusal_message("deepspeed_shm_comm", str(tmp_path))
    assert f"rm {lock}" in msg and "\n" not in msg
    assert "rm " not in cpu_cluster.jit_refusal_message("fused_adam", str(tmp_path))


def _sync_peer(rank, port, queue):
    from openrlhf_search.cpu.cluster_mode.runtime import gloo_stateless_init_process_group

    group = gloo_stateless_init_process_group("127.0.0.1", port, rank, 2)
    for dtype in (torch.bfloat16, torch.float32):
        t = torch.arange(12, dtype=dtype).reshape(3, 4) * 0.37 if rank == 0 else torch.empty(3, 4, dtype=dtype)
        group.broadcast(t, src=0, stream=None)
        queue.put((rank, str(dtype), t.float().tolist()))


def test_the_gloo_weight_sync_group_broadcasts_between_processes():
    """Patch 4 between two processes (trainer rank 0, an engine worker rank 1): bf16 and fp32 weights arrive
    bit-exact. Catches a broadcast from the wrong rank or a dtype gloo cannot carry."""
    ctx = multiprocessing.get_context("spawn")
    queue, port = ctx.Queue(), _free_port()
    procs = [ctx.Process(target=_sync_peer, args=(r, port, queue)) for r in (0, 1)]
    for p in procs:
        p.start()
    try:
        got = [queue.get(timeout=240) for _ in range(4)]
    finally:
        for p in procs:
            p.join(timeout=60)
            if p.is_alive():
                p.kill()
    by = {(r, d): v for r, d, v in got}
    for dtype in ("torch.bfloat16", "torch.float32"):
        assert by[(1, dtype)] == by[(0, dtype)]
        assert by[(1, dtype)][2][3] != 0


def test_cpu_settings_turn_a_gpu_launcher_into_a_cpu_run():
    """A GPU layout (colocated, sleep mode, ZeRO-3, packing, 8 GPUs, NCCL) passes OpenRLHF's validation as one CPU
    actor per model with gloo and sdpa; the changes are reported one per line."""
    from openrlhf_search.cli import train as cli

    gpu = ["--actor.model_name_or_path", "Qwen/Qwen2.5-7B", "--data.prompt_dataset", "x.jsonl",
           "--algo.advantage.estimator", "group_norm", "--rollout.n_samples_per_prompt", "2",
           "--actor.num_gpus_per_node", "8", "--ref.num_gpus_per_node", "8", "--vllm.num_engines", "8",
           "--train.colocate_all", "--vllm.enable_sleep", "--ds.enable_sleep", "--ds.zero_stage", "3",
           "--ds.packing_samples", "--vllm.gpu_memory_utilization", "0.6"]
    flat = cli.build_parser().parse_args(gpu + ["--cpu_cluster"])
    changes = cpu_settings.apply_cpu_settings(flat)
    assert not any(c.startswith("--ds.zero_stage") for c in changes)  # ZeRO-3 runs as on GPUs
    assert any(c.startswith("--train.colocate_all True -> False") for c in changes)
    args, _ = cli.parse_args(gpu + ["--cpu_cluster"])
    assert args.cpu_cluster is True
    assert (args.actor.num_gpus_per_node, args.ref.num_gpus_per_node, args.vllm.num_engines) == (1, 1, 1)
    assert not args.train.colocate_all and not args.vllm.enable_sleep and not args.ds.enable_sleep
    assert not args.ds.packing_samples and args.ds.attn_implementation == "sdpa"
    assert args.vllm.sync_backend == "gloo" and args.ds.zero_stage == 3 and args.vllm.enforce_eager
    plain, _ = cli.parse_args(gpu)  # without the switch nothing changes
    assert plain.ds.zero_stage == 3 and plain.train.colocate_all
    # 2 to 4 ranks per model and engines are kept (the data-parallel path), and Ray gets a logical GPU for each
    two = [a if a != "8" else "2" for a in gpu] + ["--rollout.batch_size", "4", "--train.batch_size", "8"]
    args, _ = cli.parse_args(two + ["--cpu_cluster", "--algo.kl.init_coef", "0.01"])
    assert (args.actor.num_gpus_per_node, args.ref.num_gpus_per_node, args.vllm.num_engines) == (2, 2, 2)
    assert cpu_settings.logical_gpus(args) == 6  # 2 actor + 2 reference + 2 engines


def test_cpu_runtime_env_installs_the_setup_hook_and_keeps_the_jobs_values(monkeypatch):
    monkeypatch.setenv("OPENRLHF_SEARCH_PROBE_DIR", "/tmp/probe")
    monkeypatch.setenv("OPENRLHF_SEARCH_PROBE_MODULE", "tests.some_hook")
    monkeypatch.setenv("OPENRLHF_SEARCH_PROBE_UNSET", "")
    env = cpu_settings.cpu_runtime_env({"env_vars": {"OMP_NUM_THREADS": "2", "X": "1"}})
    assert env["worker_process_setup_hook"] == "openrlhf_search.cpu.cluster_mode.runtime.setup_worker"
    assert env["env_vars"]["OMP_NUM_THREADS"] == "2" and env["env_vars"]["X"] == "1"
    assert env["env_vars"]["OPENRLHF_SEARCH_CPU_CLUSTER"] == "1"
    assert env["env_vars"]["OPENRLHF_SEARCH_PROBE_DIR"] == "/tmp/probe"  # every probe variable reaches the workers
    assert env["env_vars"]["OPENRLHF_SEARCH_PROBE_MODULE"] == "tests.some_hook"
    assert "OPENRLHF_SEARCH_PROBE_UNSET" not in env["env_vars"]
    kwargs = cpu_settings.ray_init_kwargs({}, temp_dir="/tmp/x")
    assert kwargs["num_gpus"] >= 4 and kwargs["object_store_memory"] <= 512 * 1024 ** 2
    assert kwargs["_temp_dir"] == "/tmp/x" and kwargs["include_dashboard"] is False


def test_the_recording_hook_is_the_module_the_environment_names(tmp_path, monkeypatch):
    """The package names no test code: a run loads the hook module ``OPENRLHF_SEARCH_PROBE_MODULE`` names, calls what
    it defines and skips what it lacks; without the variable nothing is loaded; a name that cannot be imported is one
    clear error. The tests' own hook (cpu_demo.probe) defines every function the runtime calls. Mutations caught: the
    hook loaded or called without the variable, a missing hook function raising, a probe function renamed (its
    records would silently stop)."""
    monkeypatch.delenv(cpu_cluster.PROBE_MODULE_ENV, raising=False)
    assert cpu_cluster.probe_hook() is None
    cpu_cluster.call_probe("record_cache_reset", True)  # no hook: nothing happens
    (tmp_path / "planted_probe_hook.py").write_text("calls = []\ndef record_cache_reset(ok):\n    calls.append(ok)\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.delitem(sys.modules, "planted_probe_hook", raising=False)
    monkeypatch.setenv(cpu_cluster.PROBE_MODULE_ENV, "planted_probe_hook")
    cpu_cluster.call_probe("record_cache_reset", False)
    cpu_cluster.call_probe("install")  # a function the hook does not define is skipped
    assert cpu_cluster.probe_hook().calls == [False]
    monkeypatch.setenv(cpu_cluster.PROBE_MODULE_ENV, "no_such_probe_module")
    with pytest.raises(ImportError, match="OPENRLHF_SEARCH_PROBE_MODULE=no_such_probe_module cannot be imported"):
        cpu_cluster.call_probe("install")

    from cpu_demo import probe

    assert probe.probe_env("/tmp/p") == {cpu_cluster.PROBE_MODULE_ENV: "cpu_demo.probe",
                                         "OPENRLHF_SEARCH_PROBE_DIR": "/tmp/p"}
    for name in ("install", "wrap_rollout_actor", "record_cache_reset"):
        assert callable(getattr(probe, name, None)), name


def test_the_sync_probe_compares_fused_vllm_weights():
    """vLLM fuses q/k/v and gate/up and pads the vocabulary; the comparison maps the policy's HF parameters onto
    that layout. Catches a comparison that would pass with one changed element or a missing parameter."""
    g = torch.Generator().manual_seed(0)
    hf = {n: torch.randn(*s, generator=g) for n, s in [
        ("model.embed_tokens.weight", (10, 4)), ("model.layers.0.self_attn.q_proj.weight", (4, 4)),
        ("model.layers.0.self_attn.k_proj.weight", (2, 4)), ("model.layers.0.self_attn.v_proj.weight", (2, 4)),
        ("model.layers.0.mlp.gate_proj.weight", (6, 4)), ("model.layers.0.mlp.up_proj.weight", (6, 4)),
        ("model.norm.weight", (4,))]}
    engine = {k: v.clone() for k, v in vllm_view(hf).items()}
    engine["model.embed_tokens.weight"] = torch.cat([hf["model.embed_tokens.weight"], torch.zeros(6, 4)])
    assert engine["model.layers.0.self_attn.qkv_proj.weight"].shape == (8, 4)
    ok = compare_weights(hf, engine)
    assert ok["max_abs_diff"] == 0.0 and ok["n_compared"] == 4 and not ok["missing_in_engine"]
    engine["model.layers.0.self_attn.qkv_proj.weight"][5, 1] += 0.5  # one element of k_proj
    assert compare_weights(hf, engine)["per_param"]["model.layers.0.self_attn.qkv_proj.weight"] == 0.5
    del engine["model.norm.weight"]
    assert compare_weights(hf, engine)["missing_in_engine"] == ["model.norm.weight"]


# ------------------------------------------------------------------ failed samples out of training statistics
class _StubActor(torch.nn.Module):
    """Per-token log-probs from one parameter (what ppo_train and training_step need of the policy)."""

    def __init__(self):
        super().__init__()
        self.w = torch.nn.Parameter(torch.tensor(0.1))

    def forward(self, sequences, action_mask, attention_mask=None, return_output=False, **kwargs):
        logp = (sequences[:, 1:].float() * 0.01 * self.w) - 1.0
        return (logp, SimpleNamespace(entropy=None)) if return_output else logp


@pytest.fixture
def cpu_replay_buffer(monkeypatch):
    """The replay buffer as the CPU cluster's workers have it (patch 7 of openrlhf_search/cpu/cluster_mode/runtime.py:
    OpenRLHF
    builds ``cuda:{current_device()}``, which is ``cuda:cpu`` once ``current_device`` returns "cpu"); undone after
    the test."""
    import openrlhf.trainer.ppo_utils.replay_buffer as rb

    from openrlhf_search.cpu.cluster_mode import runtime as cpu_cluster

    monkeypatch.setattr(rb.NaiveReplayBuffer, "__init__", rb.NaiveReplayBuffer.__init__)
    monkeypatch.setattr(rb.NaiveReplayBuffer, "_openrlhf_search_cpu", False, raising=False)
    cpu_cluster._patch_replay_buffer(rb)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: "cpu")


def _stub_trainer(cls, experiences):
    from openrlhf.trainer.ppo_utils import NaiveReplayBuffer

    from openrlhf_search.rl.loss import MaskedPolicyLoss

    args = SimpleNamespace(
        train=SimpleNamespace(dynamic_batch_enable=False),
        ds=SimpleNamespace(tensor_parallel_size=1, packing_samples=False),
        algo=SimpleNamespace(kl=SimpleNamespace(use_loss=False, init_coef=0.0)),
        actor=SimpleNamespace(entropy_coef=None))
    strategy = SimpleNamespace(args=args, ring_attn_group=None, accumulated_gradient=2, is_rank_0=lambda: True,
                               all_reduce=lambda d, op="mean": dict(d), backward=lambda loss, m, o: loss.backward(),
                               optimizer_step=lambda *a, **k: None, get_grad_norm=lambda m: 0.0)
    t = object.__new__(cls)
    t.strategy, t.args, t.max_epochs, t.dataloader_pin_memory = strategy, args, 1, False
    t.actor, t.ema_model, t.actor_optim, t.aux_loss = _StubActor(), None, None, False
    t.actor_scheduler = SimpleNamespace(get_last_lr=lambda: [1e-3])
    t.actor_loss_fn = MaskedPolicyLoss()
    t.replay_buffer = NaiveReplayBuffer(2, 0, True, False, False)
    for exp in experiences:
        t.replay_buffer.append(exp)
    return t


def _experiences():
    from openrlhf.trainer.ppo_utils.experience import Experience

    rows = []
    g = torch.Generator().manual_seed(1)
    for failed in (0.0, 1.0, 0.0, 1.0):
        seq = torch.randint(1, 50, (1, 12), generator=g)
        mask = torch.zeros(1, 11, dtype=torch.bool)
        if not failed:
            mask[0, 4:9] = True
        total = 40.0 if failed else 12.0  # failed trajectories are long here: they must not move the means
        rows.append(Experience(
            sequences=seq, attention_mask=torch.ones_like(seq), action_mask=mask,
            action_log_probs=torch.full((1, 11), -1.0), base_action_log_probs=torch.full((1, 11), -1.0),
            advantages=mask.float() * 0.5, returns=mask.float(), rewards=torch.tensor([0.0 if failed else 1.0]),
            response_length=torch.tensor([float(mask.sum())]), total_length=torch.tensor([total]),
            index=[len(rows)], prompts=["p"], labels=["l"],
            info={"reward": torch.tensor([0.0 if failed else 0.8]), "retrieval_failed": torch.tensor([failed]),
                  "turns": torch.tensor([3.0 if failed else 2.0]), "return": torch.tensor([0.0 if failed else 0.8])}))
    return rows


def test_actor_training_statistics_leave_failed_samples_out(cpu_replay_buffer):
    """Through OpenRLHF's real ``ActorPPOTrainer.ppo_train`` + ``training_step``: the logged
    per-sample statistics (reward, return, turns, total length) are means over the two trained samples. OpenRLHF's
    own trainer class (the code before the fix) averages the failed ones in: that is asserted too, so the test
    fails on a revert."""
    import openrlhf.trainer.ray.ppo_actor as ppo_actor

    from openrlhf_search.rl.loss import empty_mask_safe_actor_trainer
    from openrlhf_search.rl.trainer import SearchActorPPOTrainer

    expect = {"reward": 0.8, "return": 0.8, "turns": 2.0, "total_length": 12.0, "response_length": 5.0}
    new = _stub_trainer(SearchActorPPOTrainer, _experiences()).ppo_train(0.0)
    for key, value in expect.items():
        assert new[key] == pytest.approx(value), (key, new)
    assert new["retrieval_failed"] == 0.0
    assert torch.isfinite(torch.tensor(new["policy_loss"]))
    old = _stub_trainer(empty_mask_safe_actor_trainer(), _experiences()).ppo_train(0.0)
    assert old["reward"] == pytest.approx(0.4) and old["total_length"] == pytest.approx(26.0)
    assert ppo_actor.ActorPPOTrainer is not None


def test_a_micro_batch_of_failed_samples_only_carries_no_weight(monkeypatch, cpu_replay_buffer):
    """Every sample of a micro-batch failed (micro-batch size 2, both failed): its statistics have ~0 weight, the
    means are those of the other micro-batch, nothing divides by zero."""
    from openrlhf_search.rl.trainer import SearchActorPPOTrainer

    rows = _experiences()
    rows = [rows[1], rows[3], rows[0], rows[2]]  # failed, failed | trained, trained
    trainer = _stub_trainer(SearchActorPPOTrainer, rows)
    monkeypatch.setattr(trainer.args.ds, "tensor_parallel_size", 2)  # no shuffling: keep the micro-batches
    status = trainer.ppo_train(0.0)
    assert status["reward"] == pytest.approx(0.8, rel=1e-5) and status["turns"] == pytest.approx(2.0, rel=1e-5)


def test_cpu_cluster_refuses_to_run_inside_a_ray_job(monkeypatch):
    """The patches reach Ray's workers only through the setup hook of the Ray the driver starts: inside a Ray job
    (or an already initialised Ray) the run is refused with one line instead of crashing in the workers."""
    from openrlhf_search.cli import train as cli
    from openrlhf_search.env.config import ConfigError

    args, cfg = cli.parse_args(["--actor.model_name_or_path", "Qwen/Qwen2.5-7B", "--data.prompt_dataset", "x.jsonl",
                                "--algo.advantage.estimator", "group_norm", "--rollout.n_samples_per_prompt", "2",
                                "--cpu_cluster"])
    monkeypatch.setenv("RAY_JOB_CONFIG_JSON_ENV_VAR", "{}")
    monkeypatch.delenv("OPENRLHF_SEARCH_CONFIG", raising=False)  # run() sets it: restored afterwards
    with pytest.raises(ConfigError, match="cannot run inside a Ray job"):
        cli.run(args, cfg)


def test_every_deepspeed_config_of_the_cpu_mode_gathers_zero3_parameters_sequentially():
    """DeepSpeed's coalesced ZeRO-3 gather races on gloo (runtime.py ZERO3_CPU_SETTINGS): the patched strategy's
    train and eval configs (the ones transformers' ZeRO-3 loader and deepspeed.initialize read) ask for the
    sequential gather, and DeepSpeed's own config model reads the key."""
    from types import SimpleNamespace

    import openrlhf.utils.deepspeed.deepspeed as ds_module
    from deepspeed.runtime.zero.config import DeepSpeedZeroConfig

    strategy_cls = ds_module.DeepspeedStrategy
    saved = (strategy_cls.get_ds_train_config, strategy_cls.get_ds_eval_config, ds_module.init_device_mesh,
             getattr(ds_module, "_openrlhf_search_cpu", False))
    try:
        ds_module._openrlhf_search_cpu = False
        cpu_cluster._patch_openrlhf_deepspeed(ds_module)
        args = SimpleNamespace(ds=SimpleNamespace(zero_stage=3, param_dtype="bf16", adam_offload=False,
                                                  zpg=1, grad_accum_dtype=None, overlap_comm=False,
                                                  deepcompile=False))
        strategy = object.__new__(strategy_cls)
        strategy.__dict__.update(args=args, stage=3, adam_offload=False, zpg=1, param_dtype="fp32",
                                 use_ds_universal_ckpt=False, use_dynamic_batch=False,
                                 train_batch_size=8, micro_train_batch_size=2, max_norm=1.0, world_size=2,
                                 grad_accum_dtype=None, overlap_comm=False, deepcompile=False,
                                 ds_tensor_parallel_size=1, ring_attn_size=1, accumulated_gradient=2)
        for config in (strategy.get_ds_train_config(), strategy.get_ds_eval_config(offload=False)):
            zero = config["zero_optimization"]
            assert zero["allgather_sequential"] is True and zero["stage"] == 3
            assert DeepSpeedZeroConfig(**zero).allgather_sequential is True
    finally:
        (strategy_cls.get_ds_train_config, strategy_cls.get_ds_eval_config, ds_module.init_device_mesh,
         ds_module._openrlhf_search_cpu) = saved
