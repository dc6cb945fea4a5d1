"""Cluster path without a GPU: the train CLI's parsing and class injection, the runtime env that carries the search
config into the rollout actors, the trainer and experience-maker subclasses, and the reward-stage switch through a
real Ray actor."""

import json
import os
from types import SimpleNamespace

import pytest
import torch

import openrlhf_search._cpu_compat  # noqa: F401
from openrlhf.trainer.ppo_utils.experience import Experience
from openrlhf.trainer.ppo_utils.experience_maker import RemoteExperienceMaker
from openrlhf.trainer.ppo_utils.kl_controller import FixedKLController

from openrlhf_search.cli import train as cli
from openrlhf_search.cli.train_args import DEFAULT_AGENT_PATH
from openrlhf_search.env.config import ENV_VAR, ConfigError, SearchConfig
from openrlhf_search.rl.experience_maker import SearchExperienceMaker, search_rollout_stats
from openrlhf_search.env.reward_schedule import RewardSchedule

BASE = ["--actor.model_name_or_path", "Qwen/Qwen2.5-7B", "--data.prompt_dataset", "train.jsonl",
        "--data.input_key", "question", "--data.label_key", "golden_answers"]


def _parse(*extra):
    return cli.parse_args(BASE + list(extra))


@pytest.fixture(scope="module")
def grpo_args():
    return _parse("--algo.advantage.estimator", "group_norm", "--rollout.n_samples_per_prompt", "4",
                  "--search.protocol", "searchr1", "--search.reward_scheme", "searchr1_em", "--search.topk", "5",
                  "--search.retriever_urls", "http://10.0.0.1:8000,http://10.0.0.2:8000")


def test_parse_uses_openrlhf_parser_and_defaults(grpo_args):
    args, cfg = grpo_args
    # OpenRLHF's own post-parse logic ran: agent path set -> remote_url "agent", critic dropped for group_norm
    assert args.train.agent_func_path == DEFAULT_AGENT_PATH and os.path.isfile(args.train.agent_func_path)
    assert args.reward.remote_url == ["agent"]
    assert args.critic.model_name_or_path is None
    assert args.actor.eps_clip_low_high == (0.2, 0.2)
    assert cfg.protocol == "searchr1" and cfg.topk == 5 and cfg.reward_scheme == "searchr1_em"
    assert cfg.retriever_urls == ["http://10.0.0.1:8000", "http://10.0.0.2:8000"]
    assert cfg.max_turns == SearchConfig().max_turns  # unset -> SearchConfig default
    assert args.search.topk == 5 and args.search.max_turns == cfg.max_turns  # resolved values on args


def test_bad_flags_are_rejected():
    with pytest.raises(SystemExit):
        _parse("--search.topk", "three")
    with pytest.raises(SystemExit):
        _parse("--algo.advantage.not_a_flag", "1")
    with pytest.raises(ConfigError, match="topk"):
        _parse("--search.topk", "0")
    with pytest.raises(ConfigError, match="protocol"):
        _parse("--search.protocol", "nope")
    with pytest.raises(ConfigError, match="reward scheme"):
        _parse("--search.reward_scheme", "nope")
    with pytest.raises(ConfigError, match="stage2_reward_scheme"):
        _parse("--search.stage2_start_step", "10")
    with pytest.raises(AssertionError, match="n_samples_per_prompt"):  # OpenRLHF's own check
        _parse("--algo.advantage.estimator", "group_norm", "--rollout.n_samples_per_prompt", "1")


def test_runtime_env_carries_config_to_the_agent_loaded_by_openrlhf(grpo_args, monkeypatch):
    """The executor OpenRLHF builds inside a vLLM actor (no arguments, from agent_func_path) sees our config."""
    from openrlhf.trainer.ray.vllm_engine import _load_agent_executor

    args, cfg = grpo_args
    env = cli.build_runtime_env(cfg)["env_vars"]
    assert json.loads(env[ENV_VAR]) == json.loads(cfg.to_json())
    assert cli.REPO_ROOT in env["PYTHONPATH"].split(os.pathsep)
    monkeypatch.setenv(ENV_VAR, env[ENV_VAR])
    executor = _load_agent_executor(args.train.agent_func_path)
    assert type(executor).__name__ == "SearchAgentExecutor"
    assert executor.config == cfg


def test_dry_run_prints_resolved_json(capsys, monkeypatch):
    monkeypatch.setenv("MEMORY_CHECK", "0")  # OpenRLHF's defaults: a 7B policy at ZeRO-2 on one GPU cannot fit
    rc = cli.main(BASE + ["--search.reward_scheme", "r1searcher_stage1", "--search.stage2_reward_scheme",
                          "r1searcher_stage2", "--search.stage2_start_step", "30", "--dry_run"])
    assert rc == 0
    out = json.loads(capsys.readouterr().out)
    assert out["reward_schedule"] == {"stage1_scheme": "r1searcher_stage1", "stage2_scheme": "r1searcher_stage2",
                                      "stage2_start_step": 30, "eval_scheme": None}
    assert out["openrlhf_args"]["train"]["agent_func_path"] == DEFAULT_AGENT_PATH
    assert json.loads(out["runtime_env"]["env_vars"][ENV_VAR])["reward_scheme"] == "r1searcher_stage1"
    assert cli.main(BASE + ["--search.max_failed_fraction", "2", "--dry_run"]) == 2


def test_run_injects_classes_and_starts_ray_with_runtime_env(grpo_args, monkeypatch):
    """run(): at the moment OpenRLHF's train() is called, its lookups resolve to our classes and Ray got our env."""
    import openrlhf.trainer.ppo_trainer as ppo_trainer
    import ray

    from openrlhf_search.rl.trainer import (SearchCriticModelActor, SearchPolicyModelActor, SearchPPOTrainer,
                                         _SearchPPOTrainer)

    args, cfg = grpo_args
    module = cli.openrlhf_main().module
    seen = {}

    def fake_train(a):
        from openrlhf.trainer.ppo_trainer import PPOTrainer  # exactly what train() does for the sync trainer

        seen.update(args=a, trainer=PPOTrainer, policy=module.PolicyModelActor, critic=module.CriticModelActor)

    saved = (ppo_trainer.PPOTrainer, module.PolicyModelActor, module.CriticModelActor)
    monkeypatch.setattr(module, "train", fake_train)
    monkeypatch.setattr(ray, "is_initialized", lambda: False)
    monkeypatch.setattr(ray, "init", lambda **kw: seen.update(ray_init=kw))
    # the retriever check runs after ray.init and before train()
    monkeypatch.setattr(cli, "check_retrievers_before_training",
                        lambda a, c: seen.update(checked=("ray_init" in seen and "args" not in seen, c)))
    monkeypatch.delenv(ENV_VAR, raising=False)
    try:
        cli.run(args, cfg)
    finally:
        ppo_trainer.PPOTrainer, module.PolicyModelActor, module.CriticModelActor = saved
    from openrlhf_search.rl.schedules import StepCapTrainerMixin

    assert seen["args"] is args
    assert seen["checked"] == (True, cfg)
    # the trainer train() builds: SearchPPOTrainer's class with the step cap in front
    assert seen["trainer"] is cli.scheduled_trainer_class()
    assert seen["trainer"].__ray_actor_class__.__mro__[1:3] == (StepCapTrainerMixin, _SearchPPOTrainer)
    assert seen["policy"] is SearchPolicyModelActor
    assert seen["critic"] is SearchCriticModelActor
    assert SearchPPOTrainer.__ray_actor_class__ is _SearchPPOTrainer
    assert issubclass(_SearchPPOTrainer, saved[0].__ray_actor_class__)
    env_vars = seen["ray_init"]["runtime_env"]["env_vars"]
    assert SearchConfig.from_json(env_vars[ENV_VAR]) == cfg
    assert os.environ[ENV_VAR] == cfg.to_json()


def test_trainer_builds_search_experience_maker(grpo_args, monkeypatch):
    """_SearchPPOTrainer.__init__ runs OpenRLHF's PPOTrainer.__init__ and swaps in SearchExperienceMaker."""
    import openrlhf.trainer.ppo_trainer as ppo_trainer

    from openrlhf_search.rl.trainer import _SearchPPOTrainer

    args, _ = grpo_args
    monkeypatch.setattr(ppo_trainer, "get_tokenizer", lambda *a, **k: "tokenizer")
    monkeypatch.setattr(ppo_trainer, "prepare_datasets", lambda strategy, tok: ([], None, 10))
    monkeypatch.setattr(ppo_trainer, "SamplesGenerator", lambda **kw: SimpleNamespace(**kw))
    strategy = SimpleNamespace(args=args)
    trainer = _SearchPPOTrainer("Qwen/Qwen2.5-7B", strategy, None, None, None, None, None, max_new_tokens=8)
    assert type(trainer.experience_maker) is SearchExperienceMaker
    assert trainer.experience_maker.kl_ctl is trainer.kl_ctl
    assert trainer.reward_schedule.stage1_scheme == "searchr1_em"
    assert trainer.apply_reward_scheme(0) == "searchr1_em"  # no engines: nothing to switch, no error


def test_reward_schedule_steps():
    s = RewardSchedule("r1searcher_stage1", "r1searcher_stage2", 3)
    assert [s.scheme_at(i) for i in range(5)] == ["r1searcher_stage1"] * 3 + ["r1searcher_stage2"] * 2
    assert RewardSchedule("a", None, -1).scheme_at(100) == "a"
    with pytest.raises(ValueError):
        RewardSchedule("a", None, 5)


def test_reward_switch_reaches_executor_inside_a_ray_actor(monkeypatch):
    """The stage switch through Ray's __ray_call__ on an async actor shaped like OpenRLHF's RolloutRayActor, whose
    executor is loaded the way OpenRLHF loads it."""
    import ray

    from openrlhf_search.env.rewards import compute_reward
    from openrlhf_search.rl.trainer import set_reward_scheme

    cfg = SearchConfig(reward_scheme="r1searcher_stage1")
    env = cli.build_runtime_env(cfg)

    @ray.remote(num_cpus=0)
    class FakeRolloutActor:
        async def __init__(self, agent_path):
            from openrlhf.trainer.ray.vllm_engine import _load_agent_executor

            self.executor = _load_agent_executor(agent_path)

        async def score(self, text, golds):
            c = self.executor.config
            r = compute_reward(c.reward_scheme, text, golds, self.executor.protocol)
            return c.reward_scheme, r.reward, json.loads(os.environ[ENV_VAR])["reward_scheme"]

    ray.init(num_cpus=1, include_dashboard=False, log_to_driver=False, runtime_env=env)
    try:
        actors = [FakeRolloutActor.remote(DEFAULT_AGENT_PATH) for _ in range(2)]
        # a well-formed trajectory with one retrieval and a wrong answer: stage 1 pays format + retrieval,
        # stage 2 pays F1 = 0
        text = (" I need to search.<|begin_of_query|> capital of France<|end_of_query|>\n\n<|begin_of_documents|>\n"
                "(1)Title: Paris Text: Paris is the capital of France.\n<|end_of_documents|>\n\n"
                "So it is Lyon. </think>\n\n<answer> Lyon </answer>")
        before = ray.get([a.score.remote(text, ["Paris"]) for a in actors])
        set_reward_scheme(actors, "r1searcher_stage2")
        after = ray.get([a.score.remote(text, ["Paris"]) for a in actors])
    finally:
        ray.shutdown()
    assert all(b[0] == "r1searcher_stage1" and b[2] == "r1searcher_stage1" for b in before)
    assert all(a[0] == "r1searcher_stage2" and a[2] == "r1searcher_stage2" for a in after)
    assert before[0][1] != after[0][1]


# ---------------------------------------------------------------- experience maker


def _maker(args, cls):
    return cls(None, None, None, None, FixedKLController(args.algo.kl.init_coef), SimpleNamespace(args=args), None)


def _experiences(masks, rewards, values=None, failed=None, micro=2):
    """Experiences in micro-batches of ``micro`` samples, like split_rollout_samples makes them."""
    out = []
    for start in range(0, len(masks), micro):
        m = torch.stack(masks[start : start + micro])
        n = m.shape[0]
        info = {}
        if failed is not None:
            info["retrieval_failed"] = torch.tensor(failed[start : start + micro], dtype=torch.float)
        out.append(Experience(
            action_mask=m.clone(),
            rewards=torch.tensor(rewards[start : start + micro]),
            kl=torch.zeros(m.shape),
            values=(values[start : start + micro].clone() if values is not None else None),
            response_length=m.sum(-1).float(),
            index=list(range(start, start + n)),
            info=info,
        ))
    return out


def _contiguous_masks(lengths, width=8):
    masks = []
    for n in lengths:
        m = torch.zeros(width, dtype=torch.bool)
        m[:n] = True
        masks.append(m)
    return masks


@pytest.mark.parametrize("estimator,n", [("gae", 1), ("reinforce_baseline", 4), ("group_norm", 4), ("rloo", 4),
                                         ("reinforce", 1)])
def test_search_experience_maker_matches_openrlhf_without_environment_tokens(estimator, n):
    extra = ["--algo.advantage.estimator", estimator, "--rollout.n_samples_per_prompt", str(n)]
    if estimator == "gae":
        extra += ["--algo.advantage.gamma", "0.99", "--algo.advantage.lambd", "0.95"]
    args, _ = _parse(*extra)
    gen = torch.Generator().manual_seed(0)
    lengths = [3, 8, 5, 1, 6, 2, 7, 4]
    rewards = torch.rand(8, generator=gen).tolist()
    values = torch.randn(8, 8, generator=gen)
    ours = _maker(args, SearchExperienceMaker).compute_advantages_and_returns(
        _experiences(_contiguous_masks(lengths), rewards, values))
    theirs = _maker(args, RemoteExperienceMaker).compute_advantages_and_returns(
        _experiences(_contiguous_masks(lengths), rewards, values))
    for a, b in zip(ours, theirs):
        m = a.action_mask.bool()
        torch.testing.assert_close(a.advantages[m], b.advantages[m].float(), atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(a.returns[m], b.returns[m].float(), atol=1e-5, rtol=1e-5)
        assert (a.advantages[~m] == 0).all() and (a.returns[~m] == 0).all()


def test_failed_retrieval_is_left_out_of_training_and_baselines():
    args, _ = _parse("--algo.advantage.estimator", "reinforce_baseline", "--rollout.n_samples_per_prompt", "4")
    masks = _contiguous_masks([4, 4, 4, 4, 3, 3, 3, 3])
    rewards = [1.0, 0.0, 0.0, 0.0, 1.0, 1.0, 0.0, 0.0]
    failed = [0, 0, 1, 0, 0, 0, 0, 0]
    maker = _maker(args, SearchExperienceMaker)
    exps = _experiences(masks, rewards, failed=failed)
    # make_experience's post-processing (the forwards are the parent's; stubbed here to return the samples)
    RemoteExperienceMaker_make = RemoteExperienceMaker.make_experience
    try:
        RemoteExperienceMaker.make_experience = lambda self, samples: samples
        exps = maker.make_experience(exps)
    finally:
        RemoteExperienceMaker.make_experience = RemoteExperienceMaker_make
    assert exps[1].action_mask[0].sum() == 0 and exps[1].action_mask[1].sum() == 4
    exps = maker.compute_advantages_and_returns(exps)
    assert (exps[1].advantages[0] == 0).all() and (exps[1].returns[0] == 0).all()
    # group 1 baseline uses the 3 valid samples: mean 1/3 (the failed one's 0 reward would give 1/4)
    ret = torch.cat([e.returns[:, 0] for e in exps])
    torch.testing.assert_close(ret[[0, 1, 3]], torch.tensor([2 / 3, -1 / 3, -1 / 3]))
    stats = search_rollout_stats(exps)
    assert stats["search/retrieval_failed_rate"] == pytest.approx(1 / 8)
    assert stats["search/num_trained_samples"] == 7


def test_masked_gae_in_experience_maker_with_document_block():
    args, _ = _parse("--algo.advantage.estimator", "gae", "--algo.advantage.gamma", "0.9",
                     "--algo.advantage.lambd", "0.8", "--algo.kl.init_coef", "0")
    mask = torch.tensor([1, 1, 0, 0, 0, 1, 1], dtype=torch.bool)
    values = torch.tensor([[0.5, 0.4, 9.0, 9.0, 9.0, 0.3, 0.2]])
    exp = _experiences([mask], [1.0], values, micro=1)
    out = _maker(args, SearchExperienceMaker).compute_advantages_and_returns(exp)[0]
    # returns (unwhitened) are the hand-computed ones of tests/test_advantages.py
    torch.testing.assert_close(out.returns, torch.tensor([[0.5027904, 0.59832, 0, 0, 0, 0.756, 1.0]]))
    assert (out.advantages[0, 2:5] == 0).all()


def test_too_many_failures_stop_training():
    args, _ = _parse("--algo.advantage.estimator", "reinforce_baseline", "--rollout.n_samples_per_prompt", "2",
                     "--search.max_failed_fraction", "0.25")
    maker = _maker(args, SearchExperienceMaker)
    samples = _experiences(_contiguous_masks([2, 2, 2, 2]), [0.0] * 4, failed=[1, 1, 0, 0], micro=1)
    with pytest.raises(RuntimeError, match="retriever"):
        maker.make_experience_batch(samples)


def test_missing_info_keys_are_filled_before_concatenation():
    from openrlhf_search.rl.experience_maker import fill_missing_info

    a = Experience(sequences=torch.ones(1, 3, dtype=torch.long), info={"turns": torch.tensor([2.0])})
    b = Experience(sequences=torch.ones(1, 3, dtype=torch.long), info={"em": torch.tensor([1.0])})
    assert fill_missing_info([a, b]) == ["em", "turns"]
    merged = Experience.concat_experiences([a, b], 0)
    assert merged.info["turns"].tolist() == [2.0, 0.0] and merged.info["em"].tolist() == [0.0, 1.0]


def test_search_eval_metrics_per_datasource():
    from openrlhf_search.rl.trainer import search_eval_metrics

    loader = [(["nq", "hotpotqa"], ["p1", "p2"], ["a", "b"], [None, None])]
    samples = [
        Experience(prompts=["p1", "p1"], info={"em": torch.tensor([1.0, 0.0]), "turns": torch.tensor([2.0, 4.0]),
                                                "retrieval_failed": torch.tensor([0.0, 0.0])}),
        Experience(prompts=["p2", "p2"], info={"em": torch.tensor([1.0, 0.0]), "turns": torch.tensor([1.0, 1.0]),
                                                "retrieval_failed": torch.tensor([0.0, 1.0])}),
    ]
    logs = search_eval_metrics(loader, samples)
    assert logs["eval_nq_em"] == 0.5 and logs["eval_hotpotqa_em"] == 1.0
    assert logs["eval_em"] == pytest.approx(2 / 3) and logs["eval_turns"] == pytest.approx(7 / 3)
    assert logs["eval_retrieval_failed_rate"] == 0.25


def test_runtime_env_merges_with_a_ray_job_runtime_env(grpo_args, monkeypatch):
    """Under `ray job submit`, Ray refuses env var keys set by both the job and ray.init: ours must step aside."""
    from ray.runtime_env.runtime_env import _merge_runtime_env

    _, cfg = grpo_args
    job = {"working_dir": "/tmp/job", "env_vars": {"NCCL_DEBUG": "INFO", "PYTHONPATH": "/x"}}
    monkeypatch.setenv("RAY_JOB_CONFIG_JSON_ENV_VAR", json.dumps({"runtime_env": job}))
    ours = cli.build_runtime_env(cfg)
    merged = _merge_runtime_env(job, ours)
    assert merged is not None  # None = conflict, ray.init would raise
    assert merged["env_vars"]["NCCL_DEBUG"] == "INFO" and SearchConfig.from_json(merged["env_vars"][ENV_VAR]) == cfg
    job["env_vars"][ENV_VAR] = SearchConfig(topk=7).to_json()
    monkeypatch.setenv("RAY_JOB_CONFIG_JSON_ENV_VAR", json.dumps({"runtime_env": job}))
    with pytest.raises(ConfigError, match=ENV_VAR):
        cli.build_runtime_env(cfg)
