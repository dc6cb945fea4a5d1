"""Two-hop search on the CPU main job: does RL teach SmolLM2-135M-Instruct to search twice?

Search-R1 (arXiv 2503.09516, sec. 5.4 and fig. 2 (d)) reports the number of valid searches per trajectory rising
during training; R1-Searcher (arXiv 2503.05592) evaluates on multi-hop sets. Here the main job (``main_job.train
--preset default``, with which docs/cpu_job.md's two-hop figures were measured; ``--preset f1_sentences``, the
former default) trains on the embedded
default's 1- and 2-hop questions (``--data.max_hops 2``: ``capital``, ``currency``, ``currency_of_capital``,
``capital_of_neighbor``) with one more turn (``--search.max_turns 4``), and is evaluated before and after RL on held-out
2-hop questions only. Reported, with paired bootstrap 95% intervals over the same questions:

- 2-hop EM and F1 before vs after RL;
- valid searches per 2-hop question before vs after RL;
- the share of 2-hop questions whose second query names the bridge entity (the country the answer passage is about:
  the title of the row's last ``supporting_ids`` passage, without its ``Economy of`` prefix), from the per-question
  records (:mod:`openrlhf_search.evaluation.records`);
- the per-step valid search count of the training rollouts (Search-R1's panel (d)) in ``valid_searches.png``.

The warm start's 2-hop trajectories search more than once (``--hop_searches chain`` = ``--warmstart.hop_searches
chain``, :func:`openrlhf_search.cpu.main_job.warmstart.follow_up_query`): the keyword query, then, when its top passage
is
about the question's own anchor, the query without it (the other anchor), then the asked attribute of the entity
found ("currency Turkmenistan"), the answer read from the last passage; ``--hop_searches one`` scripts one search per
question, as for 1-hop rows (the "one" columns of docs/cpu_job.md's two-hop table: the policy searches once and
answers).

Targets: F1 gain with its interval above zero, searches per 2-hop question rising by at least 0.5, the
second query naming the bridge entity. Reported as measured whatever the outcome; the settings are the main job's,
not tuned for 2-hop (none was chosen on these held-out questions). At most ~30 minutes on 2 idle cores.

    PYTHONPATH=. .venv/bin/python benchmarks/bench_multihop.py [--steps N] [--seed S] [--eval_n N] [--hop_searches one]

Writes ``<out>/multihop.json`` (figures and per-question records), ``<out>/multihop.md`` and
``<out>/valid_searches.png``.
"""

import argparse
import json
import os
import subprocess
import sys
import time

from typing import Optional

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO)


def bridge_entity(row: dict, titles: dict) -> str:
    """The bridge entity of a 2-hop row of the embedded default: the country its answer passage is about.

    Args:
        row: a question row with ``supporting_ids`` (the passages a perfect searcher reads, the answer's last).
        titles: passage id -> title of the corpus.
    Raises:
        KeyError: the row has no supporting passages, or its last one is not in the corpus.
    """
    title = titles[row["supporting_ids"][-1]]
    return title[len("Economy of "):] if title.startswith("Economy of ") else title


def names_bridge(record: dict, bridge: str) -> bool:
    """Whether the second query of a per-question record names ``bridge`` (case-insensitive substring)."""
    queries = record.get("queries") or []
    return len(queries) >= 2 and bridge.lower() in queries[1].lower()


def follow_up_names_bridge(record: dict, bridge: str) -> bool:
    """Whether any query after the first names ``bridge``: a capital-of-neighbour chain may search for the question's
    other anchor second and name the bridge third (``warmstart.follow_up_query`` rule 2)."""
    return any(bridge.lower() in q.lower() for q in (record.get("queries") or [])[1:])


def summarise(before: dict, after: dict, bridges: dict) -> dict:
    """Paired before/after figures over the questions both evaluations scored.

    Args:
        before, after: ``eval_before.json`` / ``eval.json`` of ``main_job.train`` (each with ``records``).
        bridges: question -> bridge entity.
    Returns:
        {metric: {"before": mean, "after": mean, "diff": paired difference with interval}} for ``em``, ``f1``,
        ``valid_searches``, ``bridge_in_second_query``, ``bridge_in_follow_up``, ``answer_passage_retrieved`` (the
        second hop's passage, the last of ``supporting_ids``, returned by some search), and ``n``.
    Raises:
        SystemExit: the two evaluations scored different questions (the pairing would be wrong).
    """
    from openrlhf_search.evaluation.compare import paired_difference

    if before["questions"] != after["questions"]:
        raise SystemExit("before and after RL were evaluated on different questions")
    out = {"n": after["n"]}
    for k in ("em", "f1", "valid_searches"):
        b, a = before["per_question"][k], after["per_question"][k]
        out[k] = {"before": sum(b) / len(b), "after": sum(a) / len(a), "diff": paired_difference(b, a)}
    answer_passage = lambda r, _bridge: bool(r.get("answer_passage_retrieved"))  # (records.py)
    for key, fn in (("bridge_in_second_query", names_bridge), ("bridge_in_follow_up", follow_up_names_bridge),
                    ("answer_passage_retrieved", answer_passage)):
        b = [float(fn(r, bridges[r["question"]])) for r in before["records"]]
        a = [float(fn(r, bridges[r["question"]])) for r in after["records"]]
        out[key] = {"before": sum(b) / len(b), "after": sum(a) / len(a), "diff": paired_difference(b, a)}
    return out


def plot_valid_searches(metrics_path: str, png_path: str) -> list:
    """Per-step mean valid searches of the training rollouts (from ``metrics.jsonl``) as a PNG; returns the curve."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = [json.loads(line) for line in open(metrics_path) if line.strip()]
    curve = [(r["step"], r["valid_searches"]) for r in rows if "valid_searches" in r and "step" in r]
    fig, ax = plt.subplots(figsize=(4.5, 3))
    ax.plot([s for s, _ in curve], [v for _, v in curve], marker="o")
    ax.set_xlabel("RL step")
    ax.set_ylabel("valid searches per trajectory")
    ax.set_title("training rollouts, 1- and 2-hop questions")
    fig.tight_layout()
    fig.savefig(png_path, dpi=120)
    plt.close(fig)
    return curve


def main(argv=None) -> dict:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--steps", type=int, default=None, help="RL steps (default: the preset's)")
    p.add_argument("--seed", type=int, default=None, help="--train.seed (default: the preset's)")
    p.add_argument("--max_turns", type=int, default=4, help="--search.max_turns (two searches and an answer fit in 3)")
    p.add_argument("--eval_n", type=int, default=64, help="held-out 2-hop questions evaluated")
    p.add_argument("--encoder", default="bm25", choices=["minilm", "bm25"])
    p.add_argument("--preset", default="default", choices=["default", "f1_sentences", "tiny"],
                   help="main_job.train preset (f1_sentences: the former default; tiny: a pipeline "
                        "smoke, cannot learn)")
    p.add_argument("--hop_searches", default="chain", choices=["one", "chain"],
                   help="--warmstart.hop_searches: 'chain' (default: the warm start's 2-hop trajectories search a "
                        "second time, for the entity the first search found) or 'one' (one search per question, as "
                        "for 1-hop rows: the 'one' columns of docs/cpu_job.md's two-hop table)")
    p.add_argument("--out", default=os.path.join(REPO, "runs", "bench_multihop"))
    p.add_argument("--resume", action="store_true",
                   help="continue <out>/train from its last checkpoint (a run stopped by a fault; the trainer refuses "
                        "a checkpoint of other settings); the job time is then the resumed part's")
    p.add_argument("--summarise_only", action="store_true",
                   help="no training: re-read <out>/train of an earlier run and write its table again")
    p.add_argument("--extra", nargs=argparse.REMAINDER, default=[], help="further main_job.train flags, last")
    a = p.parse_args(argv)

    from openrlhf_search.cpu.data.default_dataset import build_default_dataset
    from retriever.launch import ensure_index, start_server_process, stop_server_process

    os.makedirs(a.out, exist_ok=True)
    ds = build_default_dataset(os.path.join(a.out, "data"), seed=0)
    titles = {r["id"]: r["title"] for r in map(json.loads, open(ds.corpus_path))}
    two_hop = [r for r in map(json.loads, open(ds.eval_path)) if r["hops"] == 2][: a.eval_n]
    if not two_hop:
        raise SystemExit(f"no 2-hop question in {ds.eval_path}")
    bridges = {r["question"]: bridge_entity(r, titles) for r in two_hop}
    eval_path = os.path.join(a.out, "data", "eval_2hop.jsonl")
    with open(eval_path, "w") as fh:
        fh.writelines(json.dumps(r) + "\n" for r in two_hop)
    run_dir = os.path.join(a.out, "train")
    if a.summarise_only:
        return summarise_run(a, run_dir, bridges, len(two_hop))
    index_dir = ensure_index(ds.corpus_path, os.path.join(a.out, "index"), encoder=a.encoder)
    server, url = start_server_process(index_dir, log_path=os.path.join(a.out, "retriever.log"))
    cmd = [sys.executable, "-m", "openrlhf_search.cpu.main_job.train", "--preset", a.preset,
           "--train_data", ds.train_path, "--eval_data", eval_path, "--search.retriever_urls", url,
           "--data.max_hops", "2", "--search.max_turns", str(a.max_turns), "--eval.max_samples", str(len(two_hop)),
           "--warmstart.hop_searches", a.hop_searches, "--ckpt.output_dir", run_dir]
    if not a.resume:
        cmd += ["--ckpt.no_load"]
    if a.steps is not None:
        cmd += ["--train.max_steps", str(a.steps)]
    if a.seed is not None:
        cmd += ["--train.seed", str(a.seed)]
    cmd += a.extra
    env = dict(os.environ, PYTHONPATH=REPO, TOKENIZERS_PARALLELISM="false", HF_HUB_OFFLINE="1",
               TRANSFORMERS_OFFLINE="1")
    print("== " + " ".join(cmd[1:]), flush=True)
    t0 = time.perf_counter()
    try:
        rc = subprocess.call(cmd, cwd=REPO, env=env)  # its own progress bars show on this terminal
    finally:
        stop_server_process(server)
    wall = time.perf_counter() - t0
    if rc != 0:
        raise SystemExit(f"main_job.train failed (exit {rc}); see {run_dir}")
    return summarise_run(a, run_dir, bridges, len(two_hop), wall=wall, cmd=cmd)


def _flag(cmd: Optional[list], name: str, default):
    """The value of flag ``name`` in a main_job.train command line (its last occurrence), else ``default``."""
    cmd = cmd or []
    idx = [i for i, c in enumerate(cmd[:-1]) if c == name]
    return cmd[idx[-1] + 1] if idx else default


def summarise_run(a, run_dir: str, bridges: dict, n_asked: int, wall: Optional[float] = None,
                  cmd: Optional[list] = None) -> dict:
    """Read a finished run's before/after evaluations, write ``multihop.md`` / ``multihop.json`` / the PNG, print the
    table. With ``--summarise_only`` (``wall`` None) the job time and command are those of the folder's earlier
    ``multihop.json``.

    Raises:
        SystemExit: the run folder has no before/after evaluation, or they scored different questions.
    """
    from openrlhf_search.evaluation.compare import interval_str

    if wall is None:
        prev_path = os.path.join(a.out, "multihop.json")
        prev = json.load(open(prev_path)) if os.path.exists(prev_path) else {}
        wall, cmd = prev.get("wall_s", float("nan")), prev.get("cmd")
    for f in ("eval_before.json", "eval.json"):
        if not os.path.exists(os.path.join(run_dir, f)):
            raise SystemExit(f"{run_dir} has no {f}: run the benchmark without --summarise_only first")
    load = lambda f: json.load(open(os.path.join(run_dir, f)))
    before, after = load("eval_before.json"), load("eval.json")
    s = summarise(before, after, bridges)
    curve = plot_valid_searches(os.path.join(run_dir, "metrics.jsonl"), os.path.join(a.out, "valid_searches.png"))
    names = {"em": "2-hop EM", "f1": "2-hop F1", "valid_searches": "valid searches per 2-hop question",
             "bridge_in_second_query": "second query names the bridge entity",
             "bridge_in_follow_up": "a query after the first names the bridge entity",
             "answer_passage_retrieved": "the answer's (second-hop) passage retrieved"}
    lines = ["| held-out 2-hop, greedy | before RL | after RL | after - before [95% interval] |",
             "| --- | --- | --- | --- |"]
    lines += [f"| {names[k]} | {s[k]['before']:.3f} | {s[k]['after']:.3f} | {interval_str(s[k]['diff'])} |"
              for k in names]
    verdict = (f"targets: F1 gain interval above zero: {'yes' if s['f1']['diff']['low'] > 0 else 'no'}; "
               f"valid searches +0.5: {'yes' if s['valid_searches']['diff']['diff'] >= 0.5 else 'no'}")
    note = (f"\n{s['n']} held-out 2-hop questions (of {n_asked}); trained on 1- and 2-hop questions, "
            f"--search.max_turns {_flag(cmd, '--search.max_turns', a.max_turns)}, --warmstart.hop_searches "
            f"{_flag(cmd, '--warmstart.hop_searches', 'one')}, --reward.support_bonus "
            f"{_flag(cmd, '--reward.support_bonus', '0')}; job {wall:.0f} s, load average at the end "
            f"{os.getloadavg()[0]:.1f}.\n"
            + verdict)
    table = "\n".join(lines) + note
    print(table, flush=True)
    with open(os.path.join(a.out, "multihop.md"), "w") as fh:
        fh.write(table + "\n")
    result = {"summary": s, "curve": curve, "wall_s": wall, "cmd": cmd, "bridges": bridges,
              "records_before": before["records"], "records_after": after["records"]}
    with open(os.path.join(a.out, "multihop.json"), "w") as fh:
        json.dump(result, fh, indent=1)
    return result


if __name__ == "__main__":
    main()
