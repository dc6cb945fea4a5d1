"""Cluster training entry point: OpenRLHF's ``train_ppo_ray`` parser and ``train()`` plus the search options.

    python -m openrlhf_search.cli.train [every OpenRLHF train_ppo_ray flag] [--search.* flags] [--dry_run]

OpenRLHF 0.11.2 builds its parser and validates the arguments inside ``if __name__ == "__main__":`` of
``openrlhf/cli/train_ppo_ray.py``. Nothing is copied (``cli/train_args.py``, which builds the parser): the module's
source is parsed with ``ast`` and the body of
that block is split at ``args = parser.parse_args()``; the statements before it are executed to obtain the parser,
``--search.*`` options and ``--dry_run`` are added, and the statements after it (``hierarchize`` and every
validation) run on the parsed arguments, except the final ``train(args)`` call, which this module makes itself
after:

* injecting our classes where ``train()`` looks them up: ``openrlhf.trainer.ppo_trainer.PPOTrainer`` <-
  ``SearchPPOTrainer``; ``train_ppo_ray.PolicyModelActor`` / ``CriticModelActor`` <- the masked-loss actors;
* starting Ray with a runtime environment whose ``env_vars`` hold ``OPENRLHF_SEARCH_CONFIG`` (the executors in the
  vLLM actors are built with no arguments and read it) and ``PYTHONPATH`` with this checkout (so every worker can
  import ``openrlhf_search``); inside ``ray job submit`` Ray merges it with the job's runtime env.

``--train.agent_func_path`` defaults to ``openrlhf_search/env/agent.py``. ``--dry_run`` parses and validates every flag
with OpenRLHF's real parser and :class:`SearchConfig`, prints the resolved configuration (OpenRLHF args, search
config, reward schedule, runtime env) as JSON and exits 0 without Ray or a GPU.

Search options: ``--search.<field>`` for every :class:`SearchConfig` field (or ``--search.config FILE``), the
reward schedule, the retriever check and ``--train.max_steps``; ``--help`` says each one's default and papers' value.
"""

import contextlib
import dataclasses
import json
import os
import sys
import types
from typing import Any, Dict, List, Optional, Tuple

import openrlhf_search._cpu_compat  # noqa: F401  (before any openrlhf import)
from openrlhf_search.cli.train_args import FP32, PACKAGE_DIR, build_parser, openrlhf_main
from openrlhf_search.launch.async_checks import check_async_args, gpu_layout
from openrlhf_search.env.config import ENV_VAR, ConfigError, SearchConfig, search_config_from_args
from openrlhf_search.env.length_penalty import check_overlong_args
from openrlhf_search.rl.off_policy import check_is_correction_sampling
from openrlhf_search.rl.schedules import resolved_schedule, validate_schedule_args

REPO_ROOT = os.path.dirname(PACKAGE_DIR)


def validate_search(args, cfg: SearchConfig) -> None:
    """Cross-checks that need the other modules: protocol and reward names, schedule, agent file, trainer mode."""
    from openrlhf_search.env.protocol import PROTOCOLS
    from openrlhf_search.env.reward_schedule import RewardSchedule, known_reward_schemes

    if cfg.protocol not in PROTOCOLS:
        raise ConfigError(f"--search.protocol {cfg.protocol!r} is not a registered protocol; "
                          f"known: {sorted(PROTOCOLS)}")
    try:
        RewardSchedule.from_args(args).validate(known_reward_schemes())
    except ValueError as e:
        raise ConfigError(str(e)) from e
    from openrlhf_search.env.protocol import get_protocol

    get_protocol(cfg.protocol).with_options(cfg.passage_format, cfg.query_cleaning)  # a typo fails here, not in vLLM
    if cfg.group_norm_zero_pad and (args.algo.advantage.estimator != "group_norm"
                                    or args.rollout.n_samples_per_prompt % 2):
        raise ConfigError("--search.group_norm_zero_pad needs --algo.advantage.estimator group_norm and an even "
                          f"--rollout.n_samples_per_prompt (got {args.algo.advantage.estimator}, "
                          f"{args.rollout.n_samples_per_prompt})")
    if args.ds.param_dtype == FP32 and not getattr(args, "cpu_cluster", False):
        raise ConfigError("--ds.param_dtype fp32 is the CPU cluster mode's (--cpu_cluster); GPU runs train in bf16 "
                          "or fp16")
    if args.actor.trainable_layers < 0:
        raise ConfigError(f"--actor.trainable_layers must be >= 0, got {args.actor.trainable_layers}")
    if args.actor.trainable_layers and args.ds.lora.rank > 0:
        raise ConfigError("--actor.trainable_layers and --ds.lora.rank both choose what trains: use one")
    if not (0.0 <= args.search.max_failed_fraction <= 1.0):
        raise ConfigError(f"--search.max_failed_fraction must be in [0, 1], got {args.search.max_failed_fraction}")
    if not os.path.isfile(args.train.agent_func_path):
        raise ConfigError(f"--train.agent_func_path {args.train.agent_func_path!r} is not a file")
    try:
        validate_schedule_args(args)
    except ValueError as e:
        raise ConfigError(str(e)) from e
    try:
        check_async_args(args)
        check_overlong_args(args)
        check_is_correction_sampling(args)
    except ValueError as e:
        raise ConfigError(str(e)) from e
    check_prompt_files(args, cfg)


def check_prompt_files(args, cfg: SearchConfig) -> None:
    """Prompts arrive pre-rendered (``prepare_data``), so ``--search.protocol`` / ``--search.chat_template`` are
    checked against each local prompt file's rendering record (the policy's chat template by its SHA-256, the first
    prompt re-rendered with the policy's tokenizer: :func:`prepare_data.check_prompt_file`) instead of being silently
    ignored. Raises ConfigError (one line) on a mismatch."""
    from openrlhf_search.cli.prepare_data import RenderingError, check_prompt_file

    paths = [p for p in str(getattr(args.data, "prompt_dataset", None) or "").split(",") if p]
    eval_path = getattr(getattr(args, "eval", None), "dataset", None)
    paths += [p for p in str(eval_path or "").split(",") if p]
    for path in paths:
        try:
            check_prompt_file(path, cfg.protocol, cfg.chat_template, args.actor.model_name_or_path)
        except RenderingError as e:
            raise ConfigError(str(e)) from e


def parse_args(argv: Optional[List[str]] = None) -> Tuple[Any, SearchConfig]:
    """Parse ``argv`` with OpenRLHF's parser + search options and run OpenRLHF's own validation.

    Returns:
        (nested args as ``train()`` expects them, with ``args.search`` holding resolved values, SearchConfig).

    Raises:
        SystemExit: argparse rejected a flag (exit code 2, message on stderr).
        ConfigError: a search option is invalid.
        AssertionError: OpenRLHF's own validation rejected the combination (its message).
    """
    from openrlhf_search.launch.layout import LayoutError, check_args, check_positive_sizes

    parser = build_parser()
    flat = parser.parse_args(argv)
    try:
        check_positive_sizes(flat)  # before OpenRLHF's asserts, whose messages do not name the flag
    except LayoutError as e:
        raise ConfigError(str(e)) from e
    if flat.cpu_cluster:  # before OpenRLHF's validation, which must see the CPU layout
        from openrlhf_search.cpu.cluster_mode.settings import apply_cpu_settings

        try:
            changes = apply_cpu_settings(flat)
        except ValueError as e:
            raise ConfigError(str(e)) from e
        for line in changes:
            print(f"[cpu_cluster] {line}", file=sys.stderr)
    args = openrlhf_main().validate(flat)
    cfg = search_config_from_args(args, base=SearchConfig.from_file(args.search.config) if args.search.config
                                  else None)
    for f in dataclasses.fields(SearchConfig):  # resolved values travel with the args (trainer, logs)
        setattr(args.search, f.name, getattr(cfg, f.name))
    validate_search(args, cfg)
    try:
        check_args(args)  # DeepSpeed's batch check and the rollout micro-batches over the actor ranks
    except LayoutError as e:
        raise ConfigError(str(e)) from e
    from openrlhf_search.env.context_length import context_error, model_context_length

    error = context_error(args.data.max_len, model_context_length(args.actor.model_name_or_path))
    if error:  # vLLM would refuse max_model_len = --data.max_len only once its engines start
        raise ConfigError(error)
    return args, cfg


def job_runtime_env() -> Dict[str, Any]:
    """The runtime env of the Ray job this driver runs in (``ray job submit``), {} outside a job."""
    text = os.environ.get("RAY_JOB_CONFIG_JSON_ENV_VAR")
    if not text:
        return {}
    try:
        return json.loads(text).get("runtime_env") or {}
    except (json.JSONDecodeError, AttributeError):
        return {}


def build_runtime_env(cfg: SearchConfig) -> Dict[str, Any]:
    """Ray runtime env for the job: OpenRLHF's default env vars, the search config and this checkout's path.

    Inside ``ray job submit`` Ray merges this with the job's runtime env and refuses any env var key set by both,
    so keys the job already sets are left out (the job's value applies).

    Raises:
        ConfigError: the job's runtime env sets ``OPENRLHF_SEARCH_CONFIG`` to something other than the flags say.
    """
    pythonpath = os.pathsep.join(p for p in [REPO_ROOT, os.environ.get("PYTHONPATH", "")] if p)
    env_vars = {
        # OpenRLHF's train() defaults, kept when it is not the one calling ray.init
        "TOKENIZERS_PARALLELISM": os.environ.get("TOKENIZERS_PARALLELISM", "true"),
        "NCCL_DEBUG": os.environ.get("NCCL_DEBUG", "WARN"),
        "RAY_ENABLE_ZERO_COPY_TORCH_TENSORS": os.environ.get("RAY_ENABLE_ZERO_COPY_TORCH_TENSORS", "1"),
        ENV_VAR: cfg.to_json(),
        "PYTHONPATH": pythonpath,
    }
    job_vars = job_runtime_env().get("env_vars") or {}
    if ENV_VAR in job_vars and SearchConfig.from_json(job_vars[ENV_VAR]) != cfg:
        raise ConfigError(f"the Ray job's runtime env sets {ENV_VAR} differently from the --search.* flags; "
                          "set the search config in one place")
    return {"env_vars": {k: v for k, v in env_vars.items() if k not in job_vars}}


def _to_jsonable(x):
    if isinstance(x, types.SimpleNamespace):
        return {k: _to_jsonable(v) for k, v in vars(x).items()}
    if isinstance(x, (list, tuple)):
        return [_to_jsonable(v) for v in x]
    if isinstance(x, float) and (x != x or x in (float("inf"), float("-inf"))):
        return str(x)
    return x


def layout_summary(args) -> Dict[str, Any]:
    """Ranks per model, engines and the even unit short batches are cut to (:mod:`openrlhf_search.rl.even_batches`)."""
    from openrlhf_search.rl.even_batches import unit_of

    out = {"actor_ranks": args.actor.num_nodes * args.actor.num_gpus_per_node,
           "ref_ranks": args.ref.num_nodes * args.ref.num_gpus_per_node,
           "critic_ranks": (args.critic.num_nodes * args.critic.num_gpus_per_node
                            if getattr(args.critic, "model_name_or_path", None) else 0),
           "vllm_engines": args.vllm.num_engines, "vllm_tensor_parallel_size": args.vllm.tensor_parallel_size,
           "zero_stage": args.ds.zero_stage,
           "gradient_checkpointing": bool(getattr(args.actor, "gradient_checkpointing_enable", False)),
           "short_batch_unit_samples": unit_of(args, args.rollout.n_samples_per_prompt)}
    if getattr(args, "cpu_cluster", False):
        from openrlhf_search.cpu.cluster_mode.settings import logical_gpus

        out["cpu_cluster_logical_gpus"] = logical_gpus(args)
    return out


def resolved_config(args, cfg: SearchConfig) -> Dict[str, Any]:
    """Everything a run is defined by, as JSON-able data (printed by --dry_run)."""
    from openrlhf_search.env.reward_schedule import RewardSchedule

    return {
        "openrlhf_args": _to_jsonable(args),
        "search_config": dataclasses.asdict(cfg),
        "reward_schedule": dataclasses.asdict(RewardSchedule.from_args(args)),
        "lr_schedule": resolved_schedule(args),
        "layout": layout_summary(args),
        "runtime_env": build_runtime_env(cfg),
        "gpu_split": gpu_layout(args),
        "classes": {"trainer": "openrlhf_search.rl.trainer.SearchPPOTrainer",
                    "experience_maker": "openrlhf_search.rl.experience_maker.SearchExperienceMaker",
                    "policy_loss": "openrlhf_search.rl.loss.MaskedPolicyLoss",
                    **({"trainer": "openrlhf_search.rl.async_trainer.SearchPPOTrainerAsync",
                        "generator_actor": "openrlhf_search.rl.async_trainer.SearchGenerateSamplesActor",
                        "training_actor": "openrlhf_search.rl.async_trainer.SearchTrainingActor"}
                       if args.train.async_enable else {})},
    }


def inject_classes() -> Dict[str, Any]:
    """Put our classes where OpenRLHF's ``train()`` looks them up; returns what was replaced (for restoring)."""
    import openrlhf.trainer.ppo_trainer as ppo_trainer
    import openrlhf.trainer.ppo_trainer_async as ppo_trainer_async

    from openrlhf_search.rl.async_trainer import SearchPPOTrainerAsync
    from openrlhf_search.rl.trainer import SearchCriticModelActor, SearchPolicyModelActor

    module = openrlhf_main().module
    saved = {"PPOTrainer": ppo_trainer.PPOTrainer, "PolicyModelActor": module.PolicyModelActor,
             "CriticModelActor": module.CriticModelActor, "PPOTrainerAsync": ppo_trainer_async.PPOTrainerAsync}
    ppo_trainer.PPOTrainer = scheduled_trainer_class()
    ppo_trainer_async.PPOTrainerAsync = SearchPPOTrainerAsync  # train_ppo_ray.py:146 imports it at call time
    module.PolicyModelActor = SearchPolicyModelActor
    module.CriticModelActor = SearchCriticModelActor
    return saved


def share_reference_trunk(args) -> bool:
    """With top-layer training, compute the reference log-probs in the policy actors over their frozen trunk
    (:mod:`openrlhf_search.rl.shared_reference`) instead of starting a reference model; prints which. Returns True
    when the reference lives in the policy actors."""
    from openrlhf_search.rl import shared_reference
    from openrlhf_search.rl.trainer import SearchPolicyModelActor

    if args.algo.kl.init_coef <= 0:
        return False
    why = shared_reference.enabled(args)
    if why is not None:
        print(f"[reference] a reference model of its own ({why})", file=sys.stderr)
        return False
    module = openrlhf_main().module
    shared_reference.install(module, SearchPolicyModelActor, module.ReferenceModelActor)
    print(f"[reference] computed in the policy actors: the initial top {args.actor.trainable_layers} layers over the "
          "policy's frozen trunk, no reference model started", file=sys.stderr)
    return True


_SCHEDULED_TRAINER = None


def scheduled_trainer_class():
    """``SearchPPOTrainer`` with the step cap of :mod:`openrlhf_search.rl.schedules` (a Ray actor class, built once).

    ``openrlhf_search.rl.trainer`` stays as it is: the cap is a mixin composed here."""
    global _SCHEDULED_TRAINER
    if _SCHEDULED_TRAINER is None:
        import ray

        from openrlhf_search.rl.schedules import with_step_cap
        from openrlhf_search.rl.trainer import _SearchPPOTrainer

        _SCHEDULED_TRAINER = ray.remote(with_step_cap(_SearchPPOTrainer))
    return _SCHEDULED_TRAINER


def check_retrievers_before_training(args, cfg: SearchConfig) -> Optional[str]:
    """Every GPU node reaches every retriever URL and all serve one index; returns its fingerprint.

    Skipped (None) with ``--search.check_retrievers false``. Raises ``RetrieverCheckError`` (one line)."""
    if args.search.check_retrievers is False:
        return None
    from openrlhf_search.launch.retriever_check import check_on_ray_nodes

    fingerprint = check_on_ray_nodes(cfg.retriever_urls, args.search.retriever_fingerprint)
    check_web_budget(args, cfg)
    return fingerprint


def check_web_budget(args, cfg: SearchConfig) -> Optional[str]:
    """Against a web retriever: print how many searches the run may make per step next to its budget and rate;
    refuse (ConfigError, one line) a run the budget cannot carry through its planned steps while the server stops
    at its budget, unless ``--search.web_budget_check false``. Returns the line (None for an index, or when the
    driver cannot read the retriever's ``/health``)."""
    from openrlhf_search.launch.retriever_check import RetrieverCheckError, fetch_health, web_preflight

    try:
        health = fetch_health(cfg.retriever_urls[0])
    except RetrieverCheckError:
        return None  # a per-node loopback URL the driver cannot reach: the node checks above passed
    found = web_preflight(health, args.rollout.batch_size, args.rollout.n_samples_per_prompt, cfg.max_turns,
                          getattr(args.train, "max_steps", None))
    if found is None:
        return None
    line, fits = found
    print(line, file=sys.stderr)
    if not fits and args.search.web_budget_check:
        raise ConfigError(f"{line}: the run would stop at the web budget; raise the server's --web_max_queries / "
                          "--web_max_usd, lower --train.max_steps, or pass --search.web_budget_check false to start "
                          "anyway")
    return line


def run(args, cfg: SearchConfig) -> None:
    """Start Ray with the search runtime env (unless already started), check the retrievers on every node, inject
    our classes, call OpenRLHF's train.

    With ``--cpu_cluster`` the CPU patches are installed here and in every Ray worker
    (:mod:`openrlhf_search.cpu.cluster_mode.runtime`), and a private local Ray is started and shut down at the end."""
    import ray

    os.environ[ENV_VAR] = cfg.to_json()  # the driver-side trainer code reads it too
    cpu = bool(getattr(args, "cpu_cluster", False))
    if cpu:
        from openrlhf_search.cpu.cluster_mode import runtime as cpu_cluster
        from openrlhf_search.cpu.cluster_mode import settings as cpu_settings
        from openrlhf_search.cpu.cluster_mode.private_ray import PrivateRay

        if ray.is_initialized() or os.environ.get("RAY_JOB_CONFIG_JSON_ENV_VAR"):
            # the patches reach Ray's workers only through the setup hook of a Ray this driver starts
            raise ConfigError("--cpu_cluster starts its own local Ray; it cannot run inside a Ray job or cluster")

        cpu_cluster.install(driver=True)  # before train_ppo_ray (and vllm_engine) is imported
        if args.ds.param_dtype == FP32:  # the engines load the checkpoint as the trainer holds it (patch 10)
            os.environ[cpu_settings.ENGINE_DTYPE_ENV] = "float32"
    inject_classes()
    share_reference_trunk(args)
    started = False
    private = None
    if not ray.is_initialized():
        if cpu:
            private = PrivateRay()
            print(f"[cpu_cluster] private Ray folder {private.temp_dir} (removed at exit)", file=sys.stderr)
            print(f"[cpu_cluster] {cpu_settings.EXPECTED_ON_CPU}", file=sys.stderr)
            ray.init(**cpu_settings.ray_init_kwargs(build_runtime_env(cfg), temp_dir=private.temp_dir,
                                                   num_gpus=cpu_settings.logical_gpus(args)))
            # after ray.init, whose core worker installs its own SIGTERM handler (it logs and dies): a launcher or
            # scheduler stopping the run must not leave the private Ray, its folder or vLLM's shared memory behind
            _terminate_on_sigterm(private)
        else:
            ray.init(runtime_env=build_runtime_env(cfg))
        started = True
    try:
        if not cpu:  # a layout Ray cannot place fails here, not in train()'s ray.get(pg.ready()) forever
            from openrlhf_search.launch.layout import LayoutError, wait_for_free_gpus

            try:
                wait_for_free_gpus(args, float(os.environ.get("PLACEMENT_WAIT_S") or 60))
            except LayoutError as e:
                raise ConfigError(str(e)) from e
        check_retrievers_before_training(args, cfg)
        openrlhf_main().module.train(args)
    except BaseException as e:
        if private is not None:  # the worker's own exception is only in its log, which cleanup removes
            e.worker_failure = private.failure(keep_log_in=getattr(args.ckpt, "output_dir", None))
        raise
    finally:
        if cpu and started:
            ray.shutdown()
        if private is not None:
            private.cleanup()


def _terminate_on_sigterm(private) -> None:
    import signal
    import threading

    if threading.current_thread() is threading.main_thread():
        signal.signal(signal.SIGTERM, lambda signum, frame: private.terminate(128 + signum))


def main(argv: Optional[List[str]] = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    stdout = sys.stdout
    # Library import chatter (DeepSpeed binds its log handler to stdout at import) goes to stderr, so that
    # --dry_run's stdout is exactly one JSON document.
    with contextlib.redirect_stdout(sys.stderr):
        try:
            args, cfg = parse_args(argv)
        except (ConfigError, AssertionError) as e:
            print(f"error: {e}", file=sys.stderr)
            return 2
        resolved = resolved_config(args, cfg) if args.dry_run else None
        if resolved is not None and not getattr(args, "cpu_cluster", False):
            try:
                resolved["memory_estimate"] = memory_estimate(args)
            except ConfigError as e:
                print(f"error: {e}", file=sys.stderr)
                return 2
    if resolved is not None:
        print(f"[dry_run] GPU split: {resolved['gpu_split']['line']}", file=sys.stderr)
        print(f"[dry_run] {turn_budget_line(cfg)}", file=sys.stderr)
        print(json.dumps(resolved, indent=2, sort_keys=True, default=str), file=stdout)
        return 0
    from openrlhf_search.launch.retriever_check import RetrieverCheckError

    from openrlhf_search.launch.relaunch import load_problem

    problem = cuda_python_problem(args) or load_problem(args)
    if problem:
        print(f"error: {problem}", file=sys.stderr)
        return 2
    try:
        if not getattr(args, "cpu_cluster", False):
            memory_estimate(args, dry_run=False)  # a run that cannot fit the GPU stops here, not at its first OOM
        check_disk(args)  # nor one whose checkpoints cannot fit the disk, at its fourth save
        run(args, cfg)
    except ConfigError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    except RetrieverCheckError as e:
        print(f"error: {e} (the job does not start)", file=sys.stderr)
        return 1
    except Exception as e:  # only the run-stopping errors of the search environment are caught
        cause = stop_reason(e)
        worker = getattr(e, "worker_failure", None)
        if cause is None and worker is None:
            raise
        if cause is None:  # CPU cluster mode: the traceback as usual, then the worker's own error last
            import traceback

            traceback.print_exc()
        print(f"error: {cause or worker} (training stopped)", file=sys.stderr)
        return 1
    return 0


def turn_budget_line(cfg: SearchConfig) -> str:
    """The per-turn token budget a rollout runs under, naming whether the policy thinks inside it (a protocol whose
    chat template has ``enable_thinking`` on: the reasoning and the tool call or answer share the budget)."""
    from openrlhf_search.env.protocol import get_protocol

    thinking = bool(getattr(get_protocol(cfg.protocol), "enable_thinking", False))
    line = (f"turn budget: {cfg.max_new_tokens_per_turn} new tokens per turn (--search.max_new_tokens_per_turn), "
            f"{cfg.max_turns} turns, protocol {cfg.protocol}")
    if thinking:
        line += (": thinking on, the reasoning and the tool call or answer share each turn's budget; a turn that "
                 "ends on it earns nothing, and the step log warns when most turns do (search/turn_cut_rate)")
    return line


def cuda_python_problem(args) -> Optional[str]:
    """With ``OPENRLHF_SEARCH_REQUIRE_CUDA=1`` (set by the launchers for GPU runs and submitted jobs), the line
    that refuses an interpreter whose torch has no CUDA build; None when fine, not required or ``--cpu_cluster``."""
    if os.environ.get("OPENRLHF_SEARCH_REQUIRE_CUDA") != "1" or getattr(args, "cpu_cluster", False):
        return None
    import torch

    if torch.version.cuda:
        return None
    return (f"{sys.executable} has torch {torch.__version__} without CUDA (the CPU stack of make setup?): run the "
            "job with the GPU environment's interpreter (PYTHON=... / JOB_PYTHON=... for the launchers), or "
            "CPU_CLUSTER=1 to try the launcher on CPU")


def memory_estimate(args, dry_run: bool = True) -> Dict[str, Any]:
    """:func:`openrlhf_search.launch.memory_estimate.estimate` against the GPU's memory (``GPU_MEM_GB``, else what
    ``nvidia-smi`` reports, else 80) with the retriever the launcher placed (``RETRIEVER_GPU_GB`` per GPU it sits
    on; ``RETRIEVER_ON_VLLM_GPUS=1``: the vLLM GPUs of a split layout, else the training GPUs). Prints the summary
    line and a warning (stderr); adds ``checkpoints``
    (:func:`~openrlhf_search.launch.memory_estimate.checkpoint_volume`) in a dry run. Raises :class:`ConfigError`
    (one line naming the settings that fit) when the estimate exceeds the GPU, unless ``MEMORY_CHECK=0``."""
    from openrlhf_search.launch.memory_estimate import checkpoint_volume, estimate, gpu_memory_gb, summary_line

    try:
        gpu_gb, source = gpu_memory_gb()
        retriever = float(os.environ.get("RETRIEVER_GPU_GB") or 0.0)
    except ValueError as e:
        raise ConfigError(str(e).replace("could not convert string to float", "RETRIEVER_GPU_GB")) from None
    on_vllm = os.environ.get("RETRIEVER_ON_VLLM_GPUS") == "1"
    est = estimate(args, gpu_gb, retriever, retriever_on_training=not on_vllm)
    tag = "[dry_run]" if dry_run else "[memory]"
    if "unknown_model" in est:
        print(f"{tag} memory: no estimate (size of {est['unknown_model']} unknown: a local folder with a "
              "config.json, a known hub name, or MEMORY_MODEL naming one)", file=sys.stderr)
        return est
    est["gpu_mem_source"] = source
    print(f"{tag} {summary_line(est)} ({source})", file=sys.stderr)
    if est["error"]:
        if os.environ.get("MEMORY_CHECK") != "0":
            raise ConfigError(est["error"])
        print(f"warning: {est['error']}", file=sys.stderr)
    elif est["warning"]:
        print(f"warning: {est['warning']}", file=sys.stderr)
    if dry_run:
        disk = checkpoint_volume(args)
        if "line" in disk:
            est["checkpoints"] = disk
            print(f"{tag} {disk['line']}", file=sys.stderr)
    return est


def check_disk(args) -> None:
    """Refuse (:class:`ConfigError`, one line) a launch whose checkpoints cannot fit the disk of ``--ckpt.path``
    (:func:`~openrlhf_search.launch.memory_estimate.disk_problem`), unless ``DISK_CHECK=0``."""
    from openrlhf_search.launch.memory_estimate import checkpoint_volume, disk_problem

    problem = disk_problem(args, checkpoint_volume(args))
    if problem and os.environ.get("DISK_CHECK") != "0":
        raise ConfigError(problem)
    if problem:
        print(f"warning: {problem}", file=sys.stderr)


def stop_reason(error: BaseException) -> Optional[str]:
    """The one-line message of a search-environment error that stops a run (``RetrievalFailureLimit`` raised in
    the trainer actor, ``RetrievalStopped`` raised by a rollout's executor when a web retriever can no longer serve;
    re-raised by ``ray.get`` as a ``RayTaskError``, one per actor hop), None for anything else."""
    from openrlhf_search.rl.experience_maker import RetrievalFailureLimit
    from openrlhf_search.env.retrieval_client import RetrievalStopped

    stopping = (RetrievalFailureLimit, RetrievalStopped)
    seen = set()
    while error is not None and id(error) not in seen:
        seen.add(id(error))
        if isinstance(error, stopping):
            cause = getattr(error, "cause", None)  # a RayTaskError instance of the cause class: use the cause
            if isinstance(cause, stopping):
                error = cause
                continue
            return str(error).strip().splitlines()[-1]
        error = getattr(error, "cause", None) or error.__cause__
    return None


if __name__ == "__main__":
    sys.exit(main())
