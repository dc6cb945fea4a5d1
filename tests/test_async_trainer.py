"""The async trainer's wiring and the step-time figures, without a cluster: the CLI injects our async classes where
OpenRLHF's ``train()`` and ``PPOTrainerAsync`` look them up, the classes compose as documented, the GPU split the dry
run prints, the retrieval figures of a generation window, and the instruments inside a rollout actor (a real Ray
actor shaped like OpenRLHF's ``RolloutRayActor``). The real async loop runs in tests/test_cpu_cluster_async.py."""

import asyncio
import math

import pytest

import openrlhf_search._cpu_compat  # noqa: F401
from openrlhf_search.rl import step_timing
from openrlhf_search.launch.async_checks import check_async_args, gpu_layout
from openrlhf_search.cli import train as cli
from openrlhf_search.env.config import ConfigError

BASE = ["--actor.model_name_or_path", "Qwen/Qwen2.5-3B", "--data.prompt_dataset", "train.jsonl",
        "--data.input_key", "question", "--data.label_key", "golden_answers",
        "--algo.advantage.estimator", "group_norm", "--rollout.n_samples_per_prompt", "4"]


def _parse(*extra):
    return cli.parse_args(BASE + list(extra))


# ------------------------------------------------------------------ CLI
def test_async_is_accepted_and_checked():
    args, _ = _parse("--train.async_enable", "--train.async_queue_size", "2", "--train.partial_rollout_enable")
    assert args.train.async_enable and args.train.async_queue_size == 2 and args.train.partial_rollout_enable
    args, _ = _parse("--train.async_enable", "--eval.before_training")  # run by the generator actor
    assert args.eval.before_training
    with pytest.raises(ConfigError, match="async_queue_size must be >= 1"):
        _parse("--train.async_enable", "--train.async_queue_size", "0")
    with pytest.raises(AssertionError, match="partial_rollout_enable requires"):  # OpenRLHF's own check
        _parse("--train.partial_rollout_enable")
    check_async_args(_parse("--eval.before_training")[0])  # sync: allowed


def _layout(*extra):
    return gpu_layout(_parse(*extra)[0])


def test_gpu_split_follows_openrlhf_placement():
    """Catches: vLLM counted inside the colocated group in async mode (OpenRLHF places it outside,
    train_ppo_ray.py:75), or a colocated reference counted twice."""
    gpus = ["--actor.num_gpus_per_node", "4", "--ref.num_gpus_per_node", "4", "--vllm.num_engines", "4",
            "--algo.kl.init_coef", "0.001"]
    sync = _layout(*gpus, "--train.colocate_all")
    assert sync["total_gpus"] == 4 and sync["groups"] == [{"roles": ["actor", "ref", "vllm"], "gpus": 4}]
    asyn = _layout(*gpus, "--train.colocate_all", "--train.async_enable")
    assert asyn["total_gpus"] == 8 and asyn["groups"][-1] == {"roles": ["vllm"], "gpus": 4}
    assert asyn["line"].startswith("async: actor/ref 4 + vllm 4 = 8 GPUs")
    split = _layout(*gpus, "--train.colocate_actor_ref", "--train.async_enable", "--vllm.tensor_parallel_size", "2")
    assert split["total_gpus"] == 12 and split["groups"][-1]["gpus"] == 8  # 4 engines x TP 2
    apart = _layout(*gpus)
    assert [g["roles"] for g in apart["groups"]] == [["actor"], ["ref"], ["vllm"]] and apart["total_gpus"] == 12


def test_dry_run_names_async_classes_and_split(capsys):
    import json

    assert cli.main(BASE + ["--train.async_enable", "--vllm.num_engines", "2", "--dry_run"]) == 0
    captured = capsys.readouterr()
    out = json.loads(captured.out)
    assert out["classes"]["trainer"] == "openrlhf_search.rl.async_trainer.SearchPPOTrainerAsync"
    assert out["gpu_split"]["mode"] == "async" and "[dry_run] GPU split: async:" in captured.err


def test_run_injects_the_async_trainer(monkeypatch):
    """At the moment train() runs, its async import resolves to ours, and our PPOTrainerAsync builds our actors."""
    import openrlhf.trainer.ppo_trainer_async as ppo_async
    import ray

    from openrlhf_search.rl.async_trainer import (SearchGenerateSamplesActor, SearchPPOTrainerAsync,
                                               SearchTrainingActor, _SearchPPOTrainerAsync)

    args, cfg = _parse("--train.async_enable")
    module = cli.openrlhf_main().module
    seen = {}

    def fake_train(a):
        from openrlhf.trainer.ppo_trainer_async import PPOTrainerAsync as PPOTrainer  # train_ppo_ray.py:146

        seen["trainer"] = PPOTrainer

    saved = cli.inject_classes()
    try:
        monkeypatch.setattr(module, "train", fake_train)
        monkeypatch.setattr(ray, "is_initialized", lambda: True)
        monkeypatch.setattr(cli, "check_retrievers_before_training", lambda a, c: None)
        cli.run(args, cfg)
    finally:
        import openrlhf.trainer.ppo_trainer as ppo_trainer

        ppo_trainer.PPOTrainer = saved["PPOTrainer"]
        module.PolicyModelActor, module.CriticModelActor = saved["PolicyModelActor"], saved["CriticModelActor"]
        ppo_async.PPOTrainerAsync = saved["PPOTrainerAsync"]
    assert seen["trainer"] is SearchPPOTrainerAsync
    assert issubclass(_SearchPPOTrainerAsync, saved["PPOTrainerAsync"].__ray_actor_class__)

    # our constructor rebinds the module globals OpenRLHF's constructor reads, then calls it
    built = {}
    monkeypatch.setattr(ppo_async.PPOTrainerAsync.__ray_actor_class__, "__init__",
                        lambda self, *a, **k: built.update(gen=ppo_async.GenerateSamplesActor,
                                                           train=ppo_async.TrainingActor))
    original = (ppo_async.GenerateSamplesActor, ppo_async.TrainingActor)
    try:
        _SearchPPOTrainerAsync("model", None, None, None, None, None, None)
    finally:
        ppo_async.GenerateSamplesActor, ppo_async.TrainingActor = original
    assert built == {"gen": SearchGenerateSamplesActor, "train": SearchTrainingActor}


def test_training_actor_composition():
    """Our TrainingActor: OpenRLHF's fit / broadcast (lock, pause-resume) wrap the version recorder; the step cap and
    the time split wrap OpenRLHF's train_step."""
    import openrlhf.trainer.ppo_trainer_async as ppo_async
    from openrlhf.trainer.ppo_trainer import BasePPOTrainer

    from openrlhf_search.rl.async_trainer import _PolicyVersionBroadcast, _SearchTrainingActor
    from openrlhf_search.rl.schedules import StepCapTrainerMixin

    mro = _SearchTrainingActor.__mro__
    training = ppo_async.TrainingActor.__ray_actor_class__
    assert mro.index(step_timing.StepTimingMixin) < mro.index(StepCapTrainerMixin) < mro.index(training)
    assert mro.index(training) < mro.index(_PolicyVersionBroadcast) < mro.index(BasePPOTrainer)
    # OpenRLHF's loop, not a copy: only the step cap's wrapper (which calls it) comes before it
    before = mro[:mro.index(training)]
    assert [c for c in before if "fit" in vars(c)] == [StepCapTrainerMixin] and "fit" in vars(training)


# ------------------------------------------------------------------ figures
def test_quantile_and_union():
    assert step_timing.quantile([1.0, 2.0, 3.0, 4.0], 0.5) == 2.5
    assert step_timing.quantile([5.0], 0.99) == 5.0 and math.isnan(step_timing.quantile([], 0.5))
    # overlapping spans count once; spans are clipped to the window
    assert step_timing.union_seconds([(0, 2), (1, 3), (5, 6), (9, 12)], (0, 10)) == pytest.approx(5.0)
    assert step_timing.union_seconds([], (0, 10)) == 0.0


def test_retrieval_stats_of_a_window():
    spans = [(10.0, 10.1, True), (10.05, 10.25, True), (11.0, 11.5, False)]
    before = [{"retries": 2, "failovers": 1, "requests": 10}, {"retries": 0, "failovers": 0, "requests": 0}]
    after = [{"retries": 3, "failovers": 1, "requests": 14}, {"retries": 0, "failovers": 2, "requests": 3}]
    s = step_timing.retrieval_stats(spans, (10.0, 12.0), before, after)
    assert s["retrieval/searches"] == 3 and s["retrieval/failed_searches"] == 1
    assert s["retrieval/latency_p50_ms"] == pytest.approx(200.0)
    assert s["retrieval/latency_p99_ms"] == pytest.approx(200 + 0.98 * 300)
    assert s["retrieval/qps"] == pytest.approx(1.5)
    assert (s["retrieval/retries"], s["retrieval/failovers"], s["retrieval/attempts"]) == (1, 2, 7)
    assert s["step_time/search_in_flight_s"] == pytest.approx(0.75)
    assert s["step_time/search_in_flight_frac"] == pytest.approx(0.375)


def test_split_line_reads_the_logged_keys():
    status = {"timing/generation": 12.0, "timing/make_experience": 2.0, "timing/ppo_train": 5.0,
              "timing/broadcast": 0.5, "timing/step_total": 20.0, "retrieval/searches": 38.0,
              "step_time/search_in_flight_s": 4.1, "retrieval/latency_p50_ms": 110.0,
              "retrieval/latency_p99_ms": 260.0, "retrieval/qps": 3.2, "retrieval/retries": 1.0,
              "retrieval/failovers": 0.0, "async/trainer_wait_s": 0.0, "async/engine_wait_s": 3.0,
              "async/staleness_mean": 1.0}
    line = step_timing.split_line(7, status)
    assert line == ("step 7 time split: generation 12.0 s (search in flight 4.1 s, 38 searches, p50 110 ms, p99 "
                    "260 ms, 3.2 qps, 1 retries, 0 failovers) | experience 2.0 s | update 5.0 s | weight sync 0.5 s | "
                    "trainer waited 0.0 s, engines waited 3.0 s, staleness 1.00 | step 20.0 s")
    assert "trainer waited" not in step_timing.split_line(1, {k: v for k, v in status.items()
                                                               if not k.startswith("async/")})


def test_instruments_inside_a_rollout_actor():
    """Through Ray's __ray_call__ on an async actor with an ``executor`` whose client searches (as OpenRLHF's
    RolloutRayActor holds our SearchAgentExecutor): searches are timed, policy versions recorded per trajectory,
    and draining empties the record."""
    import ray

    @ray.remote
    class FakeRollout:
        async def __init__(self):
            class Client:
                stats = {"retries": 0, "failovers": 0, "requests": 0}

                async def search(self, query):
                    self.stats["requests"] += 1
                    await asyncio.sleep(0.05)
                    return [query]

            class Executor:
                client = Client()

                async def execute(self, prompt=None, **kwargs):
                    await self.client.search(prompt)
                    await asyncio.sleep(0.2)  # the trainer syncs meanwhile
                    return {"extra_logs": {}}

            self.executor = Executor()

        async def rollout(self, prompt):
            return await self.executor.execute(prompt=prompt)

    started = not ray.is_initialized()
    if started:
        ray.init(num_cpus=1, include_dashboard=False, log_to_driver=False)
    try:
        actor = FakeRollout.remote()
        timer = step_timing.RolloutTimer([actor], record_versions=True)
        timer.start()
        ref = actor.rollout.remote("q1")
        import time

        time.sleep(0.1)
        ray.get(actor.__ray_call__.remote(step_timing.set_policy_version, 3))
        out = ray.get(ref)
        stats = timer.finish()
        assert out["extra_logs"] == {"policy_version_start": 0.0, "policy_version_end": 3.0}
        assert stats["retrieval/searches"] == 1 and stats["retrieval/attempts"] == 1
        assert 40 <= stats["retrieval/latency_p50_ms"] < 1000
        timer.start()  # a new window: nothing left over
        assert timer.finish()["retrieval/searches"] == 0
    finally:
        if started:
            ray.shutdown()


def _broadcast_with_stubs(actor):
    """Runs inside the test actor: OpenRLHF's TrainingActor.broadcast_to_vllm with stub models (no engines)."""
    from types import SimpleNamespace

    import openrlhf.trainer.ppo_trainer_async as ppo_async

    calls = []
    actor.vllm_lock = ppo_async.VLLMLock.remote()
    actor._partial_rollout = False
    actor.vllm_engines = None
    actor.args = SimpleNamespace(vllm=SimpleNamespace(enable_sleep=False))
    actor.actor_model_group = SimpleNamespace(async_run_method=lambda method_name: calls.append(method_name) or [])
    actor.broadcast_to_vllm()
    return calls


def test_training_actor_weight_sync_runs_inside_ray():
    """Ray wraps an actor's methods on its top class and pickles the wrappers by value; an inherited OpenRLHF method
    that calls zero-argument super() then fails in the worker ("obj must be an instance or subtype of type"), which
    is what the first async run on the CPU cluster hit at its first weight sync. Catches: removing the override."""
    import ray

    from openrlhf_search.rl.async_trainer import _SearchTrainingActor

    class Bare(_SearchTrainingActor):
        def __init__(self):
            pass

    started = not ray.is_initialized()
    if started:
        ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False,
                 runtime_env={"env_vars": {"PYTHONPATH": cli.REPO_ROOT}})
    try:
        actor = ray.remote(Bare).remote()
        assert ray.get(actor.__ray_call__.remote(_broadcast_with_stubs)) == ["broadcast_to_vllm"]
    finally:
        if started:
            ray.shutdown()


# ------------------------------------------------------------------ step cap
def test_async_generator_stops_at_the_step_cap_without_spinning_over_episodes(monkeypatch):
    """--train.max_steps 1 --train.num_episodes 1000: OpenRLHF's real generator loop (GenerateSamplesActor.fit) with
    our cap produces one batch, then ends: one progress bar, not one per remaining episode; the queue ends in
    "done" exactly once; the trainer's slot is taken twice (the batch, then the capped call) and no more."""
    from types import SimpleNamespace

    import openrlhf.trainer.ppo_trainer_async as ppo_async

    from openrlhf_search.rl.async_trainer import _SearchGenerateSamplesActor

    bars = []

    class Bar:
        def __init__(self, *a, **k):
            bars.append(self)

        def update(self, n):
            pass

        def close(self):
            pass

    class Slots:
        gets = 0

        def get(self, block=True):
            Slots.gets += 1
            if Slots.gets > 50:
                raise RuntimeError("generator spins over episodes")
            return 0

        def put(self, step, block=True):
            pass

        def pop_waited(self):
            return 0.0

    queue = []
    lock = SimpleNamespace(acquire=SimpleNamespace(remote=lambda: None), release=SimpleNamespace(remote=lambda: None),
                           waited=0.0)
    monkeypatch.setattr(ppo_async, "tqdm", Bar)
    monkeypatch.setattr(ppo_async, "ray", SimpleNamespace(get=lambda x: x))
    gen = object.__new__(_SearchGenerateSamplesActor)
    calls = []

    def generate(**kwargs):
        calls.append(kwargs)
        return [SimpleNamespace()], 1.0, 2, False

    gen.__dict__.update(
        args=SimpleNamespace(train=SimpleNamespace(num_episodes=1000, max_steps=1),
                             eval=SimpleNamespace(before_training=False, steps=-1)),
        rollout_slots=Slots(),
        rollout_queue=SimpleNamespace(put=lambda item, block=True: queue.append(item)), vllm_lock=lock,
        _partial_rollout=False, eval_dataloader=None, _eval_just_done=False, _last_eval_step=-1, generate_kwargs={},
        samples_generator=None, step_cap=1, start_step=0, produced=0, _generate=generate,
        apply_reward_scheme=lambda step: "f1")
    gen.prompts_dataloader = type("Loader", (), {"__len__": lambda self: 4, "state_dict": lambda self: {}})()
    gen.samples_generator = SimpleNamespace(generate_samples=gen._generate_samples)
    gen.fit(0, 0)
    assert len(calls) == 1 and gen.produced == 1
    assert len(bars) == 1 and Slots.gets == 2
    assert queue[-1] == "done" and queue.count("done") == 1 and len(queue) == 2
