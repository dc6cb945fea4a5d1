"""bench_ablation's arms and table: every arm's command parses with main_job.train's real parser and
does what its label says; the table's differences are paired and signed, rows keep their arm's label, and the
warm-start line says "no" when before-RL predictions differ. No model runs here."""

import json

import pytest

from benchmarks.bench_ablation import (ablation_table, arm_argv, build_arms, parse_arms, warm_start_check,
                                       warm_start_line)
from openrlhf_search.cpu.main_job.args import parse_args


def _args(name, split="validation", critic_lr=3e-3):
    arm = build_arms(critic_lr)[name]
    return parse_args(arm_argv(arm, "train.jsonl", "eval.jsonl", "http://127.0.0.1:9", "/tmp/run", split,
                               steps=3, seed=7))


def test_every_arm_parses_with_train_locals_parser_and_changes_only_its_setting():
    """Mutations caught: a typo'd flag (argparse exits), a flag that parses but means another thing (e.g. masking
    left on in (a), GRPO kept in (c)), the split or seed not reaching an arm."""
    main = _args("main")
    assert main.algo.advantage.estimator == "group_norm" and main.train.mask_retrieved_tokens
    assert not main.train.no_search and main.actor.model_name_or_path == "smollm2"  # the preset as is
    for name in ("main", "a", "b", "c"):
        a = _args(name)
        assert a.eval.split == "validation" and a.train.seed == 7 and a.train.max_steps == 3, name
        assert a.ckpt.load_enable is False and a.search_config.retriever_urls == ["http://127.0.0.1:9"]
        assert a.rollout.batch_size == main.rollout.batch_size  # the same rollouts per step in every arm
        assert a.rollout.n_samples_per_prompt == main.rollout.n_samples_per_prompt
        assert a.warmstart == main.warmstart  # one warm start for every arm
    assert _args("main", split="heldout").eval.split == "heldout"
    a = _args("a")
    assert not a.train.mask_retrieved_tokens and a.algo.advantage.estimator == "group_norm" and not a.train.no_search
    b = _args("b")
    assert b.train.no_search and b.train.mask_retrieved_tokens and b.algo.advantage.estimator == "group_norm"
    c = _args("c")
    assert c.algo.advantage.estimator == "gae" and c.critic.adam.lr == pytest.approx(3e-3)
    # Search-R1's PPO (train_ppo.sh / ppo_trainer.yaml): gamma = lambda = 1, KL a k1 reward penalty, value clip 0.5
    assert c.algo.advantage.gamma == 1.0 and c.algo.advantage.lambd == 1.0
    assert not c.algo.kl.use_loss and c.algo.kl.estimator == "k1" and c.algo.kl.init_coef == 0.001
    assert c.critic.value_clip == 0.5 and c.train.mask_retrieved_tokens and not c.train.no_search
    assert c.actor.adam.lr == main.actor.adam.lr
    assert parse_arms("c, main", build_arms()) == ["main", "c"]
    with pytest.raises(SystemExit):
        parse_arms("main,d", build_arms())


def _ev(questions, f1, em=None, preds=None, trajs=None):
    n = len(questions)
    em = em if em is not None else [0.0] * n
    preds = preds if preds is not None else [f"p{i}" for i in range(n)]
    trajs = trajs if trajs is not None else [f"t{i}" for i in range(n)]
    return {"n": n, "questions": list(questions),
            "per_question": {"f1": list(f1), "em": list(em), "answer_rate": [1.0] * n, "searches": [1.0] * n},
            "records": [{"question": q, "prediction": p, "trajectory": t} for q, p, t in zip(questions, preds, trajs)]}


QS = [f"q{i}" for i in range(8)]
MAIN_AFTER = [0.0, 0.8, 0.1, 0.9, 0.2, 0.7, 0.0, 0.9]


def _results():
    before = _ev(QS, [0.1] * 8)
    return {  # not in table order: rows must follow the arms, each with its own numbers
        "b": {"before": before, "after": _ev(QS, [0.0] * 8), "wall_s": 3.0, "peak_rss_mib": 30.0},
        "main": {"before": before, "after": _ev(QS, MAIN_AFTER, em=[0, 1, 0, 1, 0, 1, 0, 1]), "wall_s": None,
                 "peak_rss_mib": None, "run_dir": "runs/x"},
        "a": {"before": _ev(QS, [0.1] * 8, preds=["p0", "other"] + [f"p{i}" for i in range(2, 8)]),
              "after": _ev(QS, [f + 0.1 for f in MAIN_AFTER], em=[0, 1, 0, 1, 0, 1, 0, 0]),
              "wall_s": 2.0, "peak_rss_mib": 20.0},
    }


def test_table_differences_are_paired_and_signed_and_rows_keep_their_label():
    """Mutations caught: an unpaired difference (resampling the two arms independently: a wide interval where every
    question moved by +0.1), main - arm instead of arm - main, a row under another arm's label."""
    arms = build_arms()
    rows, lines = ablation_table(_results(), arms, seed=0)
    assert list(rows) == ["main", "a", "b"]
    assert rows["a"]["f1_after_vs_main"] == "+0.100 [+0.100, +0.100]"  # paired: every question +0.1
    assert rows["b"]["f1_after_vs_main"].startswith("-0.450")  # b is worse than main: negative
    assert rows["a"]["em_after_vs_main"].startswith("-0.125")  # one exact answer fewer of 8
    assert rows["main"]["f1_after_vs_main"] == "-" and rows["main"]["em_diff"].startswith("+0.500")
    assert rows["a"]["f1_diff"].startswith("+0.450")  # after 0.550 - before 0.100, within the arm
    by_label = {line.split(" | ")[0][2:]: line for line in lines if line.startswith("| (") or
                line.startswith("| main")}
    assert rows["a"]["f1_after"] in by_label[arms["a"].label] and "+0.100 [+0.100, +0.100]" in by_label[arms["a"].label]
    assert "+0.100 [+0.100, +0.100]" not in by_label[arms["b"].label]
    assert by_label[arms["b"].label].endswith("| 3 s, 30 MiB |")
    assert by_label[arms["main"].label].endswith("| reused: runs/x |")
    with pytest.raises(ValueError):  # other questions than main: no paired difference
        res = _results()
        res["b"]["after"] = _ev(list(reversed(QS)), [0.0] * 8)
        ablation_table(res, arms)


def test_warm_start_line_says_no_when_before_rl_predictions_differ():
    """Mutations caught: a check that compares scores instead of predictions (a's differing prediction scores the
    same), one that always says yes, a trajectory that differs with the same answer going unnoticed."""
    arms = build_arms()
    rows, lines = ablation_table(_results(), arms, seed=0)
    assert f"{arms['a'].label}: same warm start: no (1 of 8 predictions differ; 0 trajectories)" in lines
    assert f"{arms['b'].label}: same warm start: yes (0 of 8 predictions differ; 0 trajectories)" in lines
    assert not any(line.startswith(arms["main"].label + ": same") for line in lines)
    main = _ev(QS, [0.1] * 8)
    other_passage = _ev(QS, [0.1] * 8, trajs=["t0", "t1 other passage"] + [f"t{i}" for i in range(2, 8)])
    check = warm_start_check(main, other_passage)
    assert check == {"same": False, "differ": 0, "trajectories_differ": 1, "n": 8}
    assert warm_start_line("x", check).startswith("x: same warm start: no (0 of 8")
    assert warm_start_check(main, _ev(list(reversed(QS)), [0.1] * 8))["same"] is False
    assert warm_start_line("x", warm_start_check(main, {"records": []})).endswith("unknown (no per-question records)")


def test_a_reused_main_run_without_its_evaluations_is_refused_before_anything_is_built(tmp_path):
    from benchmarks import bench_ablation
    out = tmp_path / "out"
    with pytest.raises(SystemExit, match="no eval_before.json, eval.json"):
        bench_ablation.main(["--arms", "a", "--reuse_main", str(tmp_path / "missing"), "--out", str(out)])
    assert not out.exists()  # no data, index or retriever was built for a run that cannot report


def test_reuse_takes_any_arm_and_refuses_a_malformed_or_doubled_one(tmp_path):
    from benchmarks import bench_ablation
    for bad, msg in ((["--reuse", "z=/x"], "expected ARM=RUN_DIR"), (["--reuse", "a"], "expected ARM=RUN_DIR"),
                     (["--reuse", "a=/x", "--reuse", "a=/y"], "given twice"),
                     (["--arms", "a", "--reuse", "a=" + str(tmp_path)], "add main to --arms")):
        with pytest.raises(SystemExit, match=msg):
            bench_ablation.main(bad + ["--out", str(tmp_path / "out")])
    assert not (tmp_path / "out").exists()


def test_critic_lr_default_follows_the_presets_actor_lr():
    """Arm (c)'s critic lr defaults to Search-R1's 10x critic/actor ratio of the preset's actor lr (it was a fixed 2e-3,
    10x the former default's 2e-4, and stayed 2e-3 when the default's actor lr became 1e-4)."""
    from benchmarks.bench_ablation import critic_lr_of

    assert critic_lr_of("default") == pytest.approx(10 * parse_args(["--preset", "default"]).actor.adam.lr)
    assert critic_lr_of("default") == pytest.approx(1e-3)
    assert critic_lr_of("f1_sentences") == pytest.approx(2e-3)


def test_a_reused_run_of_another_step_count_is_refused_before_anything_is_built(tmp_path):
    """The default's steps changed (20 -> 30, trial T7 of docs/trials_em.md): an arm reused from a 20-step run beside
    arms of 30 steps would put unlike runs in one table. Mutations caught: no check, a check on the count of lines
    instead of the last step, a check that ignores --steps."""
    from benchmarks import bench_ablation
    run = tmp_path / "run20"
    run.mkdir()
    for name in ("eval_before.json", "eval.json"):
        (run / name).write_text("{}")
    (run / "metrics.jsonl").write_text("".join(json.dumps({"step": i}) + "\n" for i in (1, 2, 3, 20)))
    assert bench_ablation.run_steps(str(run)) == 20 and bench_ablation.run_steps(str(tmp_path)) is None
    assert bench_ablation.arm_steps("default", None, []) == 30  # the preset's
    assert bench_ablation.arm_steps("default", 20, []) == 20
    assert bench_ablation.arm_steps("default", None, ["--train.max_steps", "7"]) == 7
    out = tmp_path / "out"
    with pytest.raises(SystemExit, match="trained 20 RL steps, this table's arms 30: pass --steps 20"):
        bench_ablation.main(["--arms", "a", "--reuse_main", str(run), "--out", str(out)])
    assert not out.exists()
