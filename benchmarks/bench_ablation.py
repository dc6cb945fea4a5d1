"""Ablations of the CPU main job in one table, each arm with the main arm's warm start:

- main: the preset as is (``main_job.train --preset default``: GRPO ``group_norm``, retrieved-token masking on, search
  on);
- (a) masking off (Search-R1, arXiv 2503.09516 sec. 5.3 / table 4): the same RL with loss, KL and advantages also on
  the retrieved passages (``--train.mask_retrieved_tokens false``);
- (b) no search at training time only (``--train.no_search``): the RL rollouts get empty documents, while the warm
  start and both evaluations search the real retriever as the main arm does, so the row measures what RL without
  retrieval teaches a searching model, evaluated with search;
- (c) PPO with a critic and GAE instead of GRPO (Search-R1's PPO-vs-GRPO panel (a)): ``--algo.advantage.estimator
  gae`` with Search-R1's released PPO settings, read from PeterGriffinJin/Search-R1 at a14dc3a4ffc6:
  gamma = lambda = 1.0 (``verl/trainer/config/ppo_trainer.yaml`` lines 153-154, unset in ``train_ppo.sh``); the KL a
  reward penalty (ppo_trainer.yaml line 36 ``use_kl_loss: False``, line 157 ``kl_penalty: kl`` = our k1; coefficient
  0.001, ``train_ppo.sh`` line 70, as the preset's); value clip 0.5 (ppo_trainer.yaml line 126 ``cliprange_value``);
  no critic warm-up (train_ppo.sh line 72). The critic's learning rate is ``--critic_lr`` (default: 10x the
  preset's actor lr, 1e-3 for ``default``, 2e-3 for ``f1_sentences``, the ratio of train_ppo.sh line 61
  ``critic.optim.lr=1e-5`` to line 43 ``actor.optim.lr=1e-6``), to be chosen on ``--split validation``. Not copied:
  Search-R1's PPO samples one trajectory per prompt (train_ppo.sh line 58 ``n_agent=1``) where its GRPO samples 5
  (train_grpo.sh line 62) from the same 512 prompts (line 34 of both), i.e. a fifth of GRPO's trajectories per step;
  here arm (c) keeps the main arm's 4 prompts x 4 trajectories per step, so the two differ only in the advantage
  estimator and the critic, on equal rollout compute (with 4 trajectories per step, 20 steps would hold 80 trajectories
  in all).

Every arm is ``main_job.train --preset P`` (``--preset``, default ``default``; docs/cpu_job.md's "Ablation" has a
table for each of ``default`` and ``f1_sentences``, the former default) with the same seed, data, warm start and
evaluated questions (``--split``, passed as ``--eval.split``: settings such as ``--critic_lr`` are chosen on
``validation``, docs/cpu_job.md
reports ``heldout``), against one retriever service started here. Each cell is a mean over the questions with its
bootstrap 95% interval; differences are paired over the same questions (after - before within an arm; arm - main
between arms). A line per arm checks the shared warm start: its before-RL greedy predictions (and whole
trajectories) against the main arm's. Reported as measured, whatever the outcome. About 4x the main job.

    PYTHONPATH=. .venv/bin/python benchmarks/bench_ablation.py --split validation [--arms main,c] [--critic_lr X]
    PYTHONPATH=. .venv/bin/python benchmarks/bench_ablation.py --split heldout [--reuse_main RUN_DIR] [--steps N]
Writes ``<out>/ablation.json`` (with the split, seed, steps, critic lr and each arm's command) and
``<out>/ablation.md``.
"""

import argparse
import dataclasses
import json
import os
import subprocess
import sys
import time
from typing import Dict, List, Optional, Sequence, Tuple

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO)

DEFAULT_CRITIC_LR = 2e-3  # build_arms' default (10x f1_sentences' actor lr); main() uses critic_lr_of(preset)
CRITIC_ACTOR_LR_RATIO = 10.0  # Search-R1's train_ppo.sh: critic 1e-5 (line 61) / actor 1e-6 (line 43)


def critic_lr_of(preset: str) -> float:
    """Arm (c)'s default critic lr: ``CRITIC_ACTOR_LR_RATIO`` x the preset's ``--actor.adam.lr`` (1e-4 -> 1e-3)."""
    from openrlhf_search.cpu.main_job.args import parse_args

    return CRITIC_ACTOR_LR_RATIO * parse_args(["--preset", preset]).actor.adam.lr


@dataclasses.dataclass(frozen=True)
class Arm:
    """One arm: its short name (``--arms``), the table label and the main_job.train flags added to the preset."""

    name: str
    label: str
    flags: Tuple[str, ...]


def build_arms(critic_lr: float = DEFAULT_CRITIC_LR) -> Dict[str, Arm]:
    """The arms in table order (main first); ``critic_lr`` is arm (c)'s ``--critic.adam.lr``."""
    return {a.name: a for a in (
        Arm("main", "main: the preset as is (default: GRPO, masking on, search on)", ()),
        Arm("a", "(a) masking off (retrieved tokens in the loss)", ("--train.mask_retrieved_tokens", "false")),
        Arm("b", "(b) no search at training time (evaluated with search)", ("--train.no_search",)),
        Arm("c", f"(c) PPO: critic + GAE instead of GRPO (critic lr {critic_lr:g})",
            ("--algo.advantage.estimator", "gae", "--algo.advantage.gamma", "1.0", "--algo.advantage.lambd", "1.0",
             "--algo.kl.estimator", "k1", "--critic.value_clip", "0.5", "--critic.adam.lr", repr(float(critic_lr)))),
    )}


def arm_argv(arm: Arm, train_path: str, eval_path: str, url: str, run_dir: str, split: str,
             steps: Optional[int] = None, seed: Optional[int] = None, preset: str = "default",
             extra: Sequence[str] = ()) -> List[str]:
    """The ``python -m openrlhf_search.cpu.main_job.train`` arguments of ``arm`` (the preset first, the arm's flags
    after it so that they win; ``extra``, given to every arm, last)."""
    argv = ["--preset", preset, "--train_data", train_path, "--eval_data", eval_path,
            "--search.retriever_urls", url, "--ckpt.output_dir", run_dir, "--ckpt.no_load",
            "--eval.split", split] + list(arm.flags)
    if steps is not None:
        argv += ["--train.max_steps", str(steps)]
    if seed is not None:
        argv += ["--train.seed", str(seed)]
    return argv + list(extra)


def run_arm(arm: Arm, argv: List[str], out: str) -> dict:
    """Run one arm as a child process (its log in ``<out>/arm_<name>.log``); its evaluations, wall time and peak
    RSS (MiB, of the trainer process).

    Raises:
        SystemExit: the arm exited with an error.
    """
    run_dir = argv[argv.index("--ckpt.output_dir") + 1]
    env = dict(os.environ, PYTHONPATH=REPO, TOKENIZERS_PARALLELISM="false", HF_HUB_OFFLINE="1",
               TRANSFORMERS_OFFLINE="1")
    t0 = time.perf_counter()
    print(f"== {arm.label}: {' '.join(arm.flags) or '(preset as is)'}", flush=True)
    with open(os.path.join(out, f"arm_{arm.name}.log"), "w") as log:
        proc = subprocess.Popen([sys.executable, "-m", "openrlhf_search.cpu.main_job.train"] + argv, cwd=REPO, env=env,
                                stdout=log, stderr=subprocess.STDOUT)
        _, status, usage = os.wait4(proc.pid, 0)
        rc = os.waitstatus_to_exitcode(status)
    if rc != 0:
        raise SystemExit(f"arm {arm.name!r} failed (exit {rc}); see {log.name}")
    wall = time.perf_counter() - t0
    print(f"   {wall:.0f} s, trainer peak RSS {usage.ru_maxrss / 1024:.0f} MiB", flush=True)
    return dict(load_run(run_dir), wall_s=wall, peak_rss_mib=usage.ru_maxrss / 1024)


def load_run(run_dir: str) -> dict:
    """A finished run's ``eval_before.json`` and ``eval.json``."""
    def load(name):
        with open(os.path.join(run_dir, name)) as fh:
            return json.load(fh)
    return {"before": load("eval_before.json"), "after": load("eval.json"), "run_dir": run_dir,
            "wall_s": None, "peak_rss_mib": None}


def run_steps(run_dir: str) -> Optional[int]:
    """RL steps a finished run trained: the last ``step`` of its ``metrics.jsonl``; None when it has no such file
    (nothing to compare)."""
    path = os.path.join(run_dir, "metrics.jsonl")
    if not os.path.isfile(path):
        return None
    last = None
    with open(path) as fh:
        for line in fh:
            if line.strip():
                last = json.loads(line).get("step", last)
    return last


def arm_steps(preset: str, steps: Optional[int], extra: Sequence[str]) -> int:
    """RL steps each arm run by this invocation trains: ``--steps``, else the preset's (with ``extra``'s flags)."""
    from openrlhf_search.cpu.main_job.args import parse_args
    argv = ["--preset", preset] + (["--train.max_steps", str(steps)] if steps is not None else []) + list(extra)
    return parse_args(argv).train.max_steps


def warm_start_check(main_before: dict, arm_before: dict) -> dict:
    """Whether an arm's before-RL evaluation is the main arm's (the same warm start, the same greedy answers).

    Args:
        main_before, arm_before: ``evaluate()`` results with ``questions`` and per-question ``records``.
    Returns:
        {"same": bool or None (no records to compare), "differ": predictions that differ, "trajectories_differ":
        whole greedy trajectories that differ (queries, passages read, answer), "n": questions compared}; questions
        in another order or another set count as all differing.
    """
    rm, ra = main_before.get("records") or [], arm_before.get("records") or []
    if not rm or not ra:
        return {"same": None, "differ": None, "trajectories_differ": None, "n": 0}
    n = max(len(rm), len(ra))
    if [r["question"] for r in rm] != [r["question"] for r in ra]:
        return {"same": False, "differ": n, "trajectories_differ": n, "n": n}
    differ = sum(x.get("prediction") != y.get("prediction") for x, y in zip(rm, ra))
    traj = sum(x.get("trajectory") != y.get("trajectory") for x, y in zip(rm, ra))
    return {"same": differ == 0 and traj == 0, "differ": differ, "trajectories_differ": traj, "n": n}


def warm_start_line(label: str, check: dict) -> str:
    """``<label>: same warm start: yes (0 of 64 predictions differ; 0 trajectories)``."""
    if check["same"] is None:
        return f"{label}: same warm start: unknown (no per-question records)"
    return (f"{label}: same warm start: {'yes' if check['same'] else 'no'} ({check['differ']} of {check['n']} "
            f"predictions differ; {check['trajectories_differ']} trajectories)")


COLUMNS = ("arm", "EM before RL", "EM after RL", "EM after - before", "F1 before RL", "F1 after RL",
           "F1 after - before", "EM after vs main", "F1 after vs main", "answer rate after", "searches/question after",
           "job time, peak RSS")


def ablation_table(results: Dict[str, dict], arms: Dict[str, Arm], main: str = "main",
                   seed: int = 0) -> Tuple[Dict[str, dict], List[str]]:
    """Rows and markdown lines of the ablation table, in the order of ``arms``.

    Args:
        results: {arm name: {"before", "after" (``evaluate()`` dicts with ``questions`` and ``per_question``:
            em, f1, answer_rate, searches), "wall_s", "peak_rss_mib" (None when reused), "run_dir"}}; must hold
            ``main``.
        arms: the arms (labels), e.g. :func:`build_arms`.
        seed: bootstrap seed of every interval.
    Returns:
        ({arm name: row of formatted cells and the warm-start check}, [header, separator, one line per arm, then a
        warm-start line per arm other than main]).
    Raises:
        ValueError: an arm evaluated on other questions than the main arm (no paired difference), or before and after
            of an arm on different questions.
    """
    from openrlhf_search.evaluation.compare import interval_str, mean_interval_str, paired_difference

    ref = results[main]
    lines = ["| " + " | ".join(COLUMNS) + " |", "|" + " --- |" * len(COLUMNS)]
    checks, rows = [], {}
    for name, arm in arms.items():
        if name not in results:
            continue
        r = results[name]
        if r["after"]["questions"] != ref["after"]["questions"]:
            raise ValueError(f"arm {name!r} was evaluated on other questions than the main arm")
        if r["before"]["questions"] != r["after"]["questions"]:
            raise ValueError(f"arm {name!r}: before and after RL on different questions")
        pb, pa, pm = r["before"]["per_question"], r["after"]["per_question"], ref["after"]["per_question"]
        vs = lambda m: "-" if name == main else interval_str(paired_difference(pm[m], pa[m], seed=seed))
        row = {"label": arm.label, "n": r["after"]["n"],
               "em_before": mean_interval_str(pb["em"], seed), "em_after": mean_interval_str(pa["em"], seed),
               "em_diff": interval_str(paired_difference(pb["em"], pa["em"], seed=seed)),
               "f1_before": mean_interval_str(pb["f1"], seed), "f1_after": mean_interval_str(pa["f1"], seed),
               "f1_diff": interval_str(paired_difference(pb["f1"], pa["f1"], seed=seed)),
               # paired_difference(main, arm) = arm - main: negative = the arm is worse than the main arm
               "em_after_vs_main": vs("em"), "f1_after_vs_main": vs("f1"),
               "answer_rate_after": mean_interval_str(pa["answer_rate"], seed),
               "searches_after": mean_interval_str(pa["searches"], seed),
               "wall_s": None if r.get("wall_s") is None else round(r["wall_s"]),
               "peak_rss_mib": None if r.get("peak_rss_mib") is None else round(r["peak_rss_mib"]),
               "run_dir": r.get("run_dir"), "flags": list(arm.flags),
               "warm_start": None if name == main else warm_start_check(ref["before"], r["before"])}
        rows[name] = row
        cost = (f"{row['wall_s']} s, {row['peak_rss_mib']} MiB" if row["wall_s"] is not None
                else f"reused: {row['run_dir']}")
        lines.append("| " + " | ".join([arm.label] + [row[k] for k in (
            "em_before", "em_after", "em_diff", "f1_before", "f1_after", "f1_diff", "em_after_vs_main",
            "f1_after_vs_main", "answer_rate_after", "searches_after")] + [cost]) + " |")
        if row["warm_start"] is not None:
            checks.append(warm_start_line(arm.label, row["warm_start"]))
    return rows, lines + [""] + checks


def parse_arms(spec: str, arms: Dict[str, Arm]) -> List[str]:
    """``main,a,c`` -> ["main", "a", "c"] in table order.

    Raises:
        SystemExit: an unknown arm name.
    """
    names = [s.strip() for s in spec.split(",") if s.strip()]
    unknown = [s for s in names if s not in arms]
    if unknown or not names:
        raise SystemExit(f"--arms: unknown {unknown or spec!r}; known: {','.join(arms)}")
    return [n for n in arms if n in names]


def main(argv: Optional[Sequence[str]] = None) -> dict:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--split", default="heldout", choices=["validation", "heldout"],
                   help="the questions every arm is evaluated on (its --eval.split): validation for choices "
                        "(e.g. --critic_lr), heldout for the report")
    p.add_argument("--arms", default="main,a,b,c", help="comma-separated subset of main,a,b,c (default: all)")
    p.add_argument("--critic_lr", type=float, default=None,
                   help="arm (c)'s --critic.adam.lr (default: 10x the preset's actor lr, Search-R1's ratio)")
    p.add_argument("--steps", type=int, default=None, help="RL steps per arm (default: the preset's)")
    p.add_argument("--seed", type=int, default=None, help="--train.seed of every arm (default: the preset's)")
    p.add_argument("--encoder", default="bm25", choices=["minilm", "bm25"])
    p.add_argument("--out", default=os.path.join(REPO, "runs", "bench_ablation"))
    p.add_argument("--preset", default="default", choices=["default", "f1_sentences", "tiny"],
                   help="main_job.train preset of every arm (f1_sentences: the former default; tiny: a "
                        "pipeline smoke that cannot learn)")
    p.add_argument("--reuse_main", default=None, metavar="RUN_DIR",
                   help="take the main arm from a finished run of the same preset, seed, steps and split (e.g. the "
                        "train/ folder of benchmarks/bench_train_local.py) instead of running it again; its "
                        "evaluated questions must be this benchmark's, and the warm-start lines check the rest")
    p.add_argument("--reuse", action="append", default=[], metavar="ARM=RUN_DIR",
                   help="take any arm from a finished run folder (repeatable; e.g. arms run by earlier invocations "
                        "in parallel: --reuse a=runs/bench_ablation_a/arm_a); --reuse_main D is --reuse main=D")
    p.add_argument("--extra", nargs=argparse.REMAINDER, default=[], help="further main_job.train flags for every arm, "
                                                                         "last")
    a = p.parse_args(argv)
    if a.critic_lr is None:
        a.critic_lr = critic_lr_of(a.preset)
    arms = build_arms(a.critic_lr)
    chosen = parse_arms(a.arms, arms)
    reuse = {}
    for item in a.reuse + ([f"main={a.reuse_main}"] if a.reuse_main else []):
        name, sep, run_dir = item.partition("=")
        if not sep or name not in arms or not run_dir:
            raise SystemExit(f"--reuse {item!r}: expected ARM=RUN_DIR with ARM one of {','.join(arms)}")
        if name in reuse:
            raise SystemExit(f"--reuse: arm {name} given twice")
        reuse[name] = run_dir
    chosen = list(dict.fromkeys(list(chosen) + [n for n in arms if n in reuse]))  # reused arms are in the table
    if "main" not in chosen:
        raise SystemExit("the table compares every arm with the main arm: add main to --arms or give --reuse_main")
    for name, run_dir in reuse.items():  # before any data, index or retriever is built
        missing = [f for f in ("eval_before.json", "eval.json") if not os.path.isfile(os.path.join(run_dir, f))]
        if missing:
            raise SystemExit(f"reused arm {name} ({run_dir}): no {', '.join(missing)} (a finished main_job.train run "
                             "folder, e.g. runs/bench_train_local/train)")
    if reuse:  # a table of arms trained for different numbers of steps compares nothing (the default's changed)
        want = arm_steps(a.preset, a.steps, a.extra)
        for name, run_dir in reuse.items():
            got = run_steps(run_dir)
            if got is not None and got != want:
                raise SystemExit(f"reused arm {name} ({run_dir}) trained {got} RL steps, this table's arms {want}: "
                                 f"pass --steps {got} (or reuse runs of {want} steps)")

    from openrlhf_search.cpu.data.default_dataset import build_default_dataset
    from retriever.launch import ensure_index, start_server_process, stop_server_process

    os.makedirs(a.out, exist_ok=True)
    ds = build_default_dataset(os.path.join(a.out, "data"), seed=0)
    results, commands = {}, {}
    for name, run_dir in reuse.items():
        results[name] = load_run(run_dir)
        split = results[name]["after"].get("split", "heldout")
        if split != a.split:
            raise SystemExit(f"reused arm {name} ({run_dir}) was evaluated on {split}, this run on {a.split}")
        commands[name] = f"reused: {run_dir}"
        print(f"== {arms[name].label}: reused from {run_dir}", flush=True)
    t0 = time.perf_counter()
    to_run = [name for name in chosen if name not in results]
    if to_run:  # a table of reused arms only needs no retriever
        index_dir = ensure_index(ds.corpus_path, os.path.join(a.out, "index"), encoder=a.encoder)
        server, url = start_server_process(index_dir, log_path=os.path.join(a.out, "retriever.log"))
        try:
            for name in to_run:
                argv_arm = arm_argv(arms[name], ds.train_path, ds.eval_path, url, os.path.join(a.out, f"arm_{name}"),
                                    a.split, a.steps, a.seed, a.preset, a.extra)
                commands[name] = argv_arm
                results[name] = run_arm(arms[name], argv_arm, a.out)
        finally:
            stop_server_process(server)
    results = {name: results[name] for name in arms if name in results}  # the table's rows in arm order
    try:
        rows, lines = ablation_table(results, arms, seed=0)
    except ValueError as e:
        raise SystemExit(str(e))
    n = results["main"]["after"]["n"]
    split_name = {"heldout": "held-out", "validation": "validation"}[a.split]
    note = (f"{n} {split_name} questions, greedy; mean [bootstrap 95% interval]; differences paired over the same "
            f"questions (vs main: arm - main); total {time.perf_counter() - t0:.0f} s, load average at the end "
            f"{os.getloadavg()[0]:.1f}.")
    text = "\n".join(lines[:len(rows) + 2]) + "\n" + note + "\n" + "\n".join(lines[len(rows) + 2:])
    print(text)
    with open(os.path.join(a.out, "ablation.md"), "w") as fh:
        fh.write(text + "\n")
    out = {"split": a.split, "preset": a.preset, "extra": a.extra, "seed": a.seed, "steps": a.steps,
           "critic_lr": a.critic_lr, "encoder": a.encoder, "arms": rows, "commands": commands}
    with open(os.path.join(a.out, "ablation.json"), "w") as fh:
        json.dump(out, fh, indent=1)
    return out


if __name__ == "__main__":
    main()
