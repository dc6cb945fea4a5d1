"""benchmarks/validation_of_run.sh: a finished held-out run's policies evaluated on the validation split.

The script must resume the run's *final* checkpoint (linked, never copied or modified), give main_job.train the run's
before-RL *validation* pass as the "before" (so the table is warm start vs RL on the same validation questions), and
ask for ``--eval.split validation`` with the run's seed and data. A stand-in python records the arguments instead of
training, so this runs in a second. Catches: the held-out eval_before.json used as "before" (a cross-split table),
the source run's checkpoint folder written to, the seed or the split not passed, a half-finished run accepted.
"""

import json
import os
import subprocess
import sys

from tests.conftest import REPO_ROOT

SCRIPT = os.path.join(REPO_ROOT, "benchmarks", "validation_of_run.sh")


def _fake_python(tmp_path):
    """A stand-in interpreter: the script's JSON reads run for real, the main_job.train call is recorded."""
    record, fake = tmp_path / "argv.json", tmp_path / "python"
    fake.write_text(f"#!{sys.executable}\nimport json, os, sys\n"
                    f"if sys.argv[1] in ('-', '-c'):\n"
                    f"    os.execv({sys.executable!r}, [{sys.executable!r}] + sys.argv[1:])\n"
                    f"json.dump(sys.argv[1:], open({str(record)!r}, 'w'))\n")
    fake.chmod(0o755)
    return fake, record


def _finished_run(root):
    (root / "train" / "checkpoints" / "global_step20").mkdir(parents=True)
    (root / "train" / "checkpoints" / "ref").mkdir()
    (root / "train" / "checkpoints" / "latest").write_text("global_step20")
    (root / "train" / "eval_before.json").write_text(json.dumps({"split": "heldout", "em": 0.4}))
    (root / "train" / "eval_before_validation.json").write_text(json.dumps({"split": "validation", "em": 0.45}))
    (root / "train" / "metrics.jsonl").write_text("{}\n")
    (root / "train" / "warmstart.jsonl").write_text("{}\n")
    (root / "bench_train_local.json").write_text(json.dumps(
        {"seed": 7, "preset": "default", "job_args": "--search.topk 2 --actor.adam.lr 1e-4"}))
    (root / "data").mkdir()
    for name in ("train", "eval", "corpus"):
        (root / "data" / f"{name}.jsonl").write_text("{}\n")


def test_resumes_the_final_checkpoint_with_the_validation_before_pass(tmp_path):
    src, out = tmp_path / "run", tmp_path / "val"
    _finished_run(src)
    fake, record = _fake_python(tmp_path)
    res = subprocess.run(["bash", SCRIPT, str(src), "7", str(out), "--train.max_steps", "20"],
                         env=dict(os.environ, PYTHON=str(fake)), capture_output=True, text=True)
    assert res.returncode == 0, res.stderr
    argv = json.loads(record.read_text())
    assert argv[:2] == ["-m", "openrlhf_search.cpu.main_job.train"] and argv[argv.index("--preset") + 1] == "default"
    assert argv[argv.index("--eval.split") + 1] == "validation" and argv[argv.index("--train.seed") + 1] == "7"
    assert argv[argv.index("--ckpt.output_dir") + 1] == str(out / "train") and "--ckpt.no_load" not in argv
    assert argv[argv.index("--train_data") + 1] == str(src / "data" / "train.jsonl")
    assert argv[-6:] == ["--search.topk", "2", "--actor.adam.lr", "1e-4", "--train.max_steps", "20"]  # the run's
    # own job_args (from its JSON), then the caller's flags, last
    assert json.loads((out / "train" / "eval_before.json").read_text())["split"] == "validation"
    ckpt = out / "train" / "checkpoints"
    assert os.path.islink(ckpt / "global_step20") and os.path.realpath(ckpt / "ref") == str(
        (src / "train" / "checkpoints" / "ref").resolve())
    assert (ckpt / "latest").read_text().strip() == "global_step20"
    summary = json.loads((out / "bench_train_local.json").read_text())  # for seeds_report.py
    assert summary["seed"] == 7 and summary["split"] == "validation" and summary["source_run"] == str(src)
    assert summary["preset"] == "default" and summary["job_args"] == "--search.topk 2 --actor.adam.lr 1e-4"
    # the source run is left as it was
    assert json.loads((src / "train" / "eval_before.json").read_text())["split"] == "heldout"


def test_a_run_without_its_validation_pass_or_checkpoint_is_refused(tmp_path):
    src = tmp_path / "run"
    _finished_run(src)
    os.remove(src / "train" / "eval_before_validation.json")  # e.g. a run with --eval.baselines false
    res = subprocess.run(["bash", SCRIPT, str(src), "1", str(tmp_path / "val")], capture_output=True, text=True)
    assert res.returncode == 2 and "eval_before_validation.json missing" in res.stderr
    assert not (tmp_path / "val").exists()
    res = subprocess.run(["bash", SCRIPT, str(src)], capture_output=True, text=True)
    assert res.returncode == 2 and "usage" in res.stderr


def test_a_wrong_seed_an_occupied_out_or_no_load_is_refused(tmp_path):
    src = tmp_path / "run"
    _finished_run(src)
    fake, record = _fake_python(tmp_path)
    env = dict(os.environ, PYTHON=str(fake))
    res = subprocess.run(["bash", SCRIPT, str(src), "1", str(tmp_path / "a")], env=env, capture_output=True, text=True)
    assert res.returncode == 2 and "not the run's" in res.stderr  # the JSON says seed 7
    res = subprocess.run(["bash", SCRIPT, str(src), "x", str(tmp_path / "a")], env=env, capture_output=True, text=True)
    assert res.returncode == 2 and "integer" in res.stderr
    occupied = tmp_path / "b" / "train" / "checkpoints" / "global_step5"
    occupied.mkdir(parents=True)  # a real checkpoint would be resumed instead of the run's
    res = subprocess.run(["bash", SCRIPT, str(src), "7", str(tmp_path / "b")], env=env, capture_output=True, text=True)
    assert res.returncode == 2 and "already holds a checkpoint" in res.stderr
    res = subprocess.run(["bash", SCRIPT, str(src), "7", str(src)], env=env, capture_output=True, text=True)
    assert res.returncode == 2 and "must not be RUN" in res.stderr
    res = subprocess.run(["bash", SCRIPT, str(src), "7", str(tmp_path / "c"), "--ckpt.no_load"], env=env,
                         capture_output=True, text=True)
    assert res.returncode == 2 and "no_load" in res.stderr
    assert not record.exists()  # main_job.train was never called
    assert not os.path.islink(src / "train" / "checkpoints" / "global_step20" / "global_step20")


def test_heldout_direction_needs_a_heldout_before_pass_of_the_same_warm_start(tmp_path):
    """SPLIT=heldout evaluates a validation run's final policy on the held-out questions; its "before" must be a
    held-out evaluation (BEFORE): none, or one of the validation split, is refused."""
    src = tmp_path / "run"
    _finished_run(src)
    fake, record = _fake_python(tmp_path)
    env = dict(os.environ, PYTHON=str(fake), SPLIT="heldout")
    res = subprocess.run(["bash", SCRIPT, str(src), "7", str(tmp_path / "a")], env=env, capture_output=True, text=True)
    assert res.returncode == 2 and "needs BEFORE" in res.stderr
    wrong = src / "train" / "eval_before_validation.json"
    res = subprocess.run(["bash", SCRIPT, str(src), "7", str(tmp_path / "a")], env=dict(env, BEFORE=str(wrong)),
                         capture_output=True, text=True)
    assert res.returncode == 2 and "holds the validation split" in res.stderr and not record.exists()
    right = src / "train" / "eval_before.json"  # split heldout
    res = subprocess.run(["bash", SCRIPT, str(src), "7", str(tmp_path / "b")], env=dict(env, BEFORE=str(right)),
                         capture_output=True, text=True)
    assert res.returncode == 0, res.stderr
    argv = json.loads(record.read_text())
    assert argv[argv.index("--eval.split") + 1] == "heldout"
    assert json.loads((tmp_path / "b" / "train" / "eval_before.json").read_text())["split"] == "heldout"
    assert not (tmp_path / "b" / "train" / "eval_before_validation.json").exists()  # RUN's before pass is held-out
    (src / "train" / "eval_before.json").write_text(json.dumps({"split": "validation", "em": 0.45}))  # a validation run
    res = subprocess.run(["bash", SCRIPT, str(src), "7", str(tmp_path / "c")],
                         env=dict(env, BEFORE=str(wrong).replace("eval_before_validation", "held")),
                         capture_output=True, text=True)
    assert res.returncode == 2  # BEFORE missing
    held = tmp_path / "held.json"
    held.write_text(json.dumps({"split": "heldout", "em": 0.4}))
    res = subprocess.run(["bash", SCRIPT, str(src), "7", str(tmp_path / "c")], env=dict(env, BEFORE=str(held)),
                         capture_output=True, text=True)
    assert res.returncode == 0, res.stderr
    # the validation run's own before pass becomes the suffix baseline's validation records
    assert json.loads((tmp_path / "c" / "train" / "eval_before_validation.json").read_text())["split"] == "validation"


def test_a_run_of_fewer_steps_than_the_preset_is_evaluated_not_trained_on(tmp_path):
    """The default went from 20 to 30 RL steps (trial T7 of docs/trials_em.md): resuming a 20-step run under today's
    preset would train 10 more steps before evaluating. The script passes the checkpoint's own step count. Mutations
    caught: no --train.max_steps (the preset's 30 wins), the count taken from elsewhere than the checkpoint named by
    latest."""
    src, out = tmp_path / "run", tmp_path / "val"
    _finished_run(src)
    fake, record = _fake_python(tmp_path)
    res = subprocess.run(["bash", SCRIPT, str(src), "7", str(out)], env=dict(os.environ, PYTHON=str(fake)),
                         capture_output=True, text=True)
    assert res.returncode == 0, res.stderr
    argv = json.loads(record.read_text())
    assert argv[argv.index("--train.max_steps") + 1] == "20"
    from openrlhf_search.cpu.main_job.args import parse_args
    assert parse_args(argv[2:]).train.max_steps == 20  # what main_job.train parses, the preset's 30 overridden
    (src / "train" / "checkpoints" / "final").mkdir()  # latest naming a folder without a step count
    (src / "train" / "checkpoints" / "latest").write_text("final")
    res = subprocess.run(["bash", SCRIPT, str(src), "7", str(tmp_path / "v2")], env=dict(os.environ, PYTHON=str(fake)),
                         capture_output=True, text=True)
    assert res.returncode == 2 and "not global_stepN" in res.stderr
