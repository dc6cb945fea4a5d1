"""The step cap and LR-schedule sizing of openrlhf_search/rl/schedules.py, run inside OpenRLHF 0.11.2's real
``PPOTrainer.fit`` loop (only the trainer step, checkpointing and the sample generator are stubs), and the warm-up
that transformers' ``constant_with_warmup`` scheduler gives with the horizon we compute."""

import math
from types import SimpleNamespace

import pytest
import torch

import openrlhf_search._cpu_compat  # noqa: F401
from openrlhf.trainer.ppo_trainer import PPOTrainer

from openrlhf_search.cli import train as cli
from openrlhf_search.env.config import ConfigError
from openrlhf_search.rl.schedules import (StepCapTrainerMixin, resolved_schedule, scheduler_horizon, updates_per_step,
                                       warmup_updates, with_step_cap)


def _args(max_steps=3, num_episodes=50, rollout_bs=4, n=2, train_bs=4, epochs=1, save_steps=2.0):
    return SimpleNamespace(
        train=SimpleNamespace(max_steps=max_steps, num_episodes=num_episodes, batch_size=train_bs, max_epochs=epochs),
        rollout=SimpleNamespace(batch_size=rollout_bs, n_samples_per_prompt=n),
        algo=SimpleNamespace(dynamic_filtering_enable=False),
        eval=SimpleNamespace(steps=float("inf")),
        ckpt=SimpleNamespace(save_steps=save_steps, load_enable=False, path="/nonexistent"),
        logger=SimpleNamespace(logging_steps=1),
        actor=SimpleNamespace(lr_warmup_ratio=0.285, lr_scheduler="constant_with_warmup"),
        critic=SimpleNamespace(lr_warmup_ratio=0.015, lr_scheduler="constant_with_warmup"),
    )


class _Loader:
    def __len__(self):
        return 100

    def state_dict(self):
        return {"pos": 1}

    def load_state_dict(self, state):
        self.loaded = state


class _EndlessGenerator:
    """Always a batch, never exhausted: only the cap can end the loop."""

    def __init__(self):
        self.calls = 0

    def generate_samples(self, **kwargs):
        self.calls += 1
        if self.calls > 100:  # a missing cap would loop forever; fail instead
            raise RuntimeError("the step cap did not stop the loop")
        return [object()], None, 4, False


class _StubTrainer(PPOTrainer.__ray_actor_class__):
    """OpenRLHF's plain PPOTrainer whose heavy parts are stubs; ``fit`` is OpenRLHF's own."""

    resume_step = 0

    def __init__(self, args):  # no super().__init__: no models, tokenizer or Ray
        self.args = args
        self.strategy = SimpleNamespace(args=args)
        self.prompts_dataloader = _Loader()
        self.eval_dataloader = None
        self.samples_generator = _EndlessGenerator()
        self.generate_kwargs = {}
        self.wandb_logger = self.tensorboard_logger = None
        self.best_eval_metric_key, self.best_eval_metric_value, self._latest_eval_metric_value = "", None, None
        self.max_steps = 1000
        self.steps, self.saved = [], []

    def init_checkpoint_states(self):
        return {"episode": 0, "global_step": self.resume_step, "total_consumed_prompts": 0,
                "data_loader_state_dict": {"pos": 1} if self.resume_step else {}}

    def broadcast_to_vllm(self):
        pass

    def train_step(self, rollout_samples, global_step):
        self.steps.append(global_step)
        return {}, global_step + 1

    def save_logs_and_checkpoints(self, global_step, logs_dict=None, client_states=None):
        if global_step % self.args.ckpt.save_steps == 0:  # OpenRLHF's own condition
            self.saved.append(global_step)


class _Capped(StepCapTrainerMixin, _StubTrainer):
    def __init__(self, args):
        _StubTrainer.__init__(self, args)
        self._init_step_cap()


def test_cap_stops_openrlhfs_fit_loop_and_checkpoints_the_last_step():
    t = _Capped(_args(max_steps=3, save_steps=2.0))
    t.fit()
    assert t.steps == [0, 1, 2]  # exactly 3 steps although 50 episodes of endless data were allowed
    assert t.saved == [2, 3]  # the regular save at 2 and the forced one at the cap
    assert t.args.ckpt.save_steps == 2.0  # restored after the forced save
    assert t.samples_generator.calls == 3 and t.cap_reached


def test_cap_ends_fit_at_once_with_one_step_line_per_step(caplog):
    """Mutation caught: the cap reported as an exhausted loader again (fit then opened one more episode, and one
    more progress bar, per remaining episode: 47 more asks here), or the step line dropped."""
    import logging

    t = _Capped(_args(max_steps=3, save_steps=float("inf")))
    asks, wrapped = [], t.samples_generator.generate_samples
    t.samples_generator.generate_samples = lambda **kw: (asks.append(1), wrapped(**kw))[1]
    from openrlhf_search.rl.schedules import logger

    logger.addHandler(caplog.handler)  # OpenRLHF's loggers do not propagate to the root logger caplog reads
    try:
        with caplog.at_level(logging.INFO, logger="openrlhf_search.rl.schedules"):
            t.fit()
    finally:
        logger.removeHandler(caplog.handler)
    assert len(asks) == 4  # three steps, then the ask that ends fit
    assert [r.getMessage().split(":")[0] for r in caplog.records if r.getMessage().startswith("step ")] == [
        "step 1 of 3", "step 2 of 3", "step 3 of 3"]


def test_without_cap_nothing_changes():
    t = _Capped(_args(max_steps=None, num_episodes=1))
    original = t.samples_generator.generate_samples
    assert t.get_max_steps() == 1000  # OpenRLHF's own horizon
    assert t.samples_generator.generate_samples == original  # not wrapped


def test_resumed_run_counts_the_steps_already_made():
    t = _Capped(_args(max_steps=3, save_steps=float("inf")))
    t.resume_step = 2
    t.fit()
    assert t.steps == [2] and t.saved == []  # saving is off: no forced save either


def test_horizon_is_cap_times_updates_and_data_shortfall_warns():
    t = _Capped(_args(max_steps=3, rollout_bs=4, n=2, train_bs=4, epochs=2))
    assert updates_per_step(t.args) == 4  # 8 samples / 4 per update, 2 epochs
    assert t.get_max_steps() == 12
    horizon, warning = scheduler_horizon(t.args, data_updates=5)
    assert horizon == 12 and "raise --train.num_episodes" in warning
    assert scheduler_horizon(_args(max_steps=None), 77) == (77, None)
    with pytest.raises(ValueError, match="smaller than"):
        updates_per_step(_args(rollout_bs=1, n=1, train_bs=4))


@pytest.mark.parametrize("algo,updates", [("ppo", 2), ("grpo", 10)])
def test_searchr1_warmup_covers_28_5_percent_then_the_rate_is_constant(algo, updates):
    """Search-R1 v0.2: 1,004 steps (total_training_steps=1005, its loop returns after step 1,004), warm-up 0.285
    (verl: int(0.285 x 1005) = 286 steps). Ours, in updates, with transformers' constant_with_warmup as OpenRLHF's
    DeepSpeed strategy builds it."""
    from transformers.trainer import get_scheduler

    from openrlhf_search.parity.check import launcher_argv

    args, _ = cli.parse_args(launcher_argv(f"searchr1_{algo}_qwen2.5-3b_base.sh")[0])
    assert updates_per_step(args) == updates
    horizon, _ = scheduler_horizon(args, data_updates=10**9)
    assert horizon == 1004 * updates
    warm = warmup_updates(args, horizon)
    assert warm == math.ceil(0.285 * 1004 * updates)
    assert 286 <= warm / updates <= 287
    opt = torch.optim.AdamW([torch.nn.Parameter(torch.zeros(1))], lr=1e-6)
    sched = get_scheduler(args.actor.lr_scheduler, opt, num_warmup_steps=warm, num_training_steps=horizon)
    lrs = []
    for _ in range(horizon):
        lrs.append(opt.param_groups[0]["lr"])
        opt.step()
        sched.step()
    assert lrs[0] == 0.0 and lrs[warm - 1] < 1e-6
    assert all(lr == pytest.approx(1e-6) for lr in lrs[warm:])  # constant to the end, no decay
    summary = resolved_schedule(args)
    assert summary["horizon_updates"] == horizon and summary["actor_warmup_updates"] == warm


def test_bad_cap_is_refused_by_the_cli():
    base = ["--actor.model_name_or_path", "Qwen/Qwen2.5-7B", "--data.prompt_dataset", "x.jsonl"]
    with pytest.raises(ConfigError, match="max_steps"):
        cli.parse_args(base + ["--train.max_steps", "0"])
    args, _ = cli.parse_args(base + ["--train.max_steps", "7"])
    assert args.train.max_steps == 7


def test_eval_before_training_runs_once_at_step_0_and_not_on_resume():
    for resume, expected in [(0, [0]), (2, [])]:
        args = _args(max_steps=3)
        args.eval = SimpleNamespace(steps=float("inf"), before_training=True, temperature=0.0, n_samples_per_prompt=1)
        t = _Capped(args)
        t.eval_dataloader = ["batch"]
        t.resume_step = resume
        seen = []
        t.evaluate = lambda step, **kw: seen.append((step, kw["temperature"], kw["n_samples_per_prompt"]))
        t.fit()
        assert [s for s, _, _ in seen] == expected
        assert all(temp == 0.0 and n == 1 for _, temp, n in seen)


def test_with_step_cap_puts_the_mixin_first():
    cls = with_step_cap(_StubTrainer)
    assert cls.__mro__[1] is StepCapTrainerMixin and cls.__mro__[2] is _StubTrainer
