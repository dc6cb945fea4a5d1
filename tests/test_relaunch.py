"""A relaunch resumes or refuses, never silently starts over (openrlhf_search/launch/relaunch.py).

OpenRLHF 0.11.2's ``save_ckpt`` (run here for real: its rotation deletes the evicted tag before DeepSpeed writes the
new one) is killed midway by a DeepSpeed engine stand-in whose save dies after creating the new tag's folder, before
any model state or ``latest`` is written. The relaunch, through the launchers' ``resume_args`` and the trainer CLI,
then resumes from the previous checkpoint when the rotation kept it, and otherwise refuses in one line naming the
folder. A launch whose checkpoints cannot fit on the disk is refused too."""

import os
from types import SimpleNamespace

import pytest

import openrlhf.utils.deepspeed.deepspeed as ods
from openrlhf_search.launch import memory_estimate, relaunch
from openrlhf_search.rl.trainer import check_checkpoint_loaded
from tests.test_fresh_run_checkpoints import _Engine, _Strategy
from tests.test_launchers import _common


class _KilledSave(_Engine):
    """DeepSpeed's save dying midway (disk full, a preempted node): the tag folder exists, nothing is in it."""

    def save_checkpoint(self, save_dir, tag=None, client_state=None, save_latest=True):
        os.makedirs(os.path.join(save_dir, tag), exist_ok=True)
        raise OSError(28, "No space left on device")


@pytest.fixture(autouse=True)
def no_barrier(monkeypatch):
    monkeypatch.setattr(ods, "torch_dist_barrier_and_cuda_sync", lambda: None)


def _save(state_dir, step, max_num, engine=_Engine):
    ods.DeepspeedStrategy.save_ckpt(_Strategy(), engine(), str(state_dir), tag=f"global_step{step}", max_num=max_num)


def _relaunch(run):
    snippet = f'resume_args --ckpt.output_dir "{run}" --ckpt.path "{run}/ckpt"; echo "ARGS=${{RESUME_ARGS[*]:-}}"'
    return _common(snippet, timeout=60)


def _one_error_line(stderr):
    lines = [line for line in stderr.splitlines() if line.strip()]
    assert len(lines) == 1, stderr
    return lines[0]


def test_a_save_killed_after_the_rotation_deleted_the_only_checkpoint_is_refused(tmp_path):
    run = tmp_path / "run"
    actor = run / "ckpt" / "_actor"
    _save(actor, 1, max_num=1)
    with pytest.raises(OSError):
        _save(actor, 2, max_num=1, engine=_KilledSave)
    # what OpenRLHF left: latest names the tag its rotation deleted, and the new tag is empty
    assert (actor / "latest").read_text() == "global_step1" and not (actor / "global_step1").exists()
    res = _relaunch(run)
    assert res.returncode == 2 and "ARGS=" not in res.stdout
    line = _one_error_line(res.stderr)
    assert str(actor) in line and "global_step1" in line and "FRESH=1" in line
    # the trainer itself refuses the same folder when launched by hand with --ckpt.load_enable
    args = SimpleNamespace(ckpt=SimpleNamespace(load_enable=True, path=str(run / "ckpt")))
    assert relaunch.load_problem(args) == line.split("error: ", 1)[1]


def test_a_save_killed_with_an_older_checkpoint_kept_resumes_from_it(tmp_path):
    run = tmp_path / "run"
    actor = run / "ckpt" / "_actor"
    _save(actor, 1, max_num=2)
    with pytest.raises(OSError):
        _save(actor, 2, max_num=2, engine=_KilledSave)
    res = _relaunch(run)
    assert res.returncode == 0 and "ARGS=--ckpt.load_enable" in res.stdout
    assert "resuming from" in res.stderr and "(global_step1)" in res.stderr
    assert relaunch.resume_tag(str(run / "ckpt")) == "global_step1"


def test_states_without_latest_are_refused(tmp_path):
    run = tmp_path / "run"
    (run / "ckpt" / "_actor" / "global_step3").mkdir(parents=True)
    res = _relaunch(run)
    assert res.returncode == 2 and "ARGS=" not in res.stdout
    line = _one_error_line(res.stderr)
    assert str(run / "ckpt" / "_actor") in line and "no 'latest'" in line and "global_step3" in line


def test_a_critic_behind_the_actor_is_refused(tmp_path):
    ckpt = tmp_path / "ckpt"
    _save(ckpt / "_actor", 1, max_num=3)
    _save(ckpt / "_critic", 1, max_num=3)
    _save(ckpt / "_actor", 2, max_num=3)  # the critic's save of step 2 never happened
    with pytest.raises(relaunch.ResumeError, match="_critic/latest is global_step1"):
        relaunch.resume_tag(str(ckpt))
    _save(ckpt / "_critic", 2, max_num=3)
    assert relaunch.resume_tag(str(ckpt)) == "global_step2"


def test_a_ppo_resume_without_critic_states_is_refused(tmp_path):
    ckpt = tmp_path / "ckpt"
    _save(ckpt / "_actor", 1, max_num=3)
    args = SimpleNamespace(ckpt=SimpleNamespace(load_enable=True, path=str(ckpt)),
                           critic=SimpleNamespace(model_name_or_path="Qwen/Qwen2.5-7B"))
    problem = relaunch.load_problem(args)
    assert problem and str(ckpt / "_critic") in problem and "global_step1" in problem
    args.critic.model_name_or_path = None  # GRPO: no critic to resume
    assert relaunch.load_problem(args) is None


def test_load_enable_with_nothing_to_load_is_refused(tmp_path):
    args = SimpleNamespace(ckpt=SimpleNamespace(load_enable=True, path=str(tmp_path / "ckpt")))
    problem = relaunch.load_problem(args)
    assert problem and str(tmp_path / "ckpt" / "_actor") in problem and "nothing to resume" in problem
    args.ckpt.load_enable = False
    assert relaunch.load_problem(args) is None
    assert relaunch.resume_tag(str(tmp_path / "ckpt")) is None


def test_the_policy_actor_refuses_a_load_that_loaded_nothing(tmp_path):
    """OpenRLHF's actor warns and keeps ``checkpoint_states == {}`` when DeepSpeed loads nothing; the search actor
    (``_SearchPolicyModelActor.init_model_from_pretrained``) raises instead of training from step 0."""
    args = SimpleNamespace(ckpt=SimpleNamespace(load_enable=True, path=str(tmp_path)))
    with pytest.raises(RuntimeError, match="refusing to train from step 0"):
        check_checkpoint_loaded(args, {})
    check_checkpoint_loaded(args, {"global_step": 1, "episode": 0})
    args.ckpt.load_enable = False
    check_checkpoint_loaded(args, {})


def test_the_cli_refuses_before_starting_ray(tmp_path, monkeypatch, capsys):
    from openrlhf_search.cli import train

    started = []
    monkeypatch.setattr(train, "run", lambda args, cfg: started.append(args))
    base = ["--actor.model_name_or_path", "Qwen/Qwen2.5-7B", "--data.prompt_dataset", "x.jsonl",
            "--algo.advantage.estimator", "group_norm", "--rollout.n_samples_per_prompt", "2",
            "--ckpt.path", str(tmp_path / "ckpt"), "--ckpt.save_steps", "10", "--ckpt.max_num", "2"]
    assert train.main(base + ["--ckpt.load_enable"]) == 2
    errors = [line for line in capsys.readouterr().err.splitlines() if line.startswith("error:")]
    assert len(errors) == 1 and "nothing to resume" in errors[0] and not started

    # the disk check: the 7B policy's checkpoints against a file system with 1 GB free, then with plenty
    monkeypatch.setattr(memory_estimate.shutil, "disk_usage", lambda path: SimpleNamespace(free=10**9))
    assert train.main(base) == 2
    errors = [line for line in capsys.readouterr().err.splitlines() if line.startswith("error:")]
    assert len(errors) == 1 and str(tmp_path / "ckpt") in errors[0] and "1 GB free" in errors[0] and not started
    assert "--ckpt.max_num" in errors[0]
    monkeypatch.setattr(memory_estimate.shutil, "disk_usage", lambda path: SimpleNamespace(free=10**13))
    assert train.main(base) == 0 and len(started) == 1
