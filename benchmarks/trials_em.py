"""Trials that choose the CPU main job's settings for exact answers, on a VALIDATION split only.

Written before ``train_local`` had its own validation split (``--eval.split validation``, which
``bench_train_local.py --split validation`` uses and later trials used); this script carves another one from the
embedded default's training questions: the 1-hop training rows of ``default_dataset --seed 0`` minus 64 of them (seeded,
``--val_seed``) are the trial's training file, those 64 its evaluation file. The held-out file (``eval.jsonl``) is
never read.

    PYTHONPATH=. .venv/bin/python benchmarks/trials_em.py split
    PYTHONPATH=. .venv/bin/python benchmarks/trials_em.py run NAME -- --train.max_steps 20 ...   # train_local flags
    PYTHONPATH=. .venv/bin/python benchmarks/trials_em.py analyze NAME [NAME ...]

``run`` starts ``train_local --preset default`` (flags after ``--`` are appended, so they win) at ``nice -n 10`` with
the split's files and the embedded corpus, and records per question (prediction, queries, documents) in
``eval_before.json`` / ``eval.json`` under the key ``records`` (a wrapper of ``LocalSearchTrainer.evaluate``; the job is
otherwise unchanged). ``analyze`` prints, for each run: validation EM / F1 before and after RL with the paired
bootstrap 95% interval of the difference, the trivial baselines (``evaluation.baselines``) computed from the before-RL
records ((a) answers cut to their last word, (b) to the best fixed-length suffix, (c) the first entity of the asked
type in the top passage of the first search), the paired interval of F1 after RL minus each baseline, a
decomposition of the answers (retrieval miss: the gold span is not in any retrieved passage; reading failure:
retrieved but not in the answer; form: in the answer but not exact; exact), the job's wall time and the load average.
"""

import argparse
import json
import os
import random
import re
import subprocess
import sys
import time

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO)

ROOT = os.path.join(REPO, "runs", "em")
DATA = os.path.join(ROOT, "data")
SPLIT = os.path.join(ROOT, "split")
TRIALS = os.path.join(ROOT, "trials")


# ---------------------------------------------------------------------------------------------------- the split
def make_split(n_val: int = 64, val_seed: int = 17) -> dict:
    """Write ``split/train.jsonl`` (1-hop training rows minus the validation ones) and ``split/val.jsonl``."""
    from openrlhf_search.cpu.data.default_dataset import build_default_dataset

    ds = build_default_dataset(DATA, seed=0)
    rows = [json.loads(line) for line in open(ds.train_path) if line.strip()]
    one = [r for r in rows if r.get("hops") == 1]
    order = list(range(len(one)))
    random.Random(val_seed).shuffle(order)
    val_idx = set(order[:n_val])
    os.makedirs(SPLIT, exist_ok=True)
    for name, part in (("train", [r for i, r in enumerate(one) if i not in val_idx]),
                       ("val", [r for i, r in enumerate(one) if i in val_idx])):
        with open(os.path.join(SPLIT, f"{name}.jsonl"), "w") as fh:
            for r in part:
                fh.write(json.dumps(r) + "\n")
    info = {"n_train": len(one) - n_val, "n_val": n_val, "val_seed": val_seed, "corpus": ds.corpus_path}
    print(json.dumps(info))
    return info


# ---------------------------------------------------------------------------------------------------- the job
def _record(protocol, row: dict, out: dict) -> dict:
    text = out.get("response_text", "")
    return {"question": row["question"], "type": row.get("type"), "gold": row["golden_answers"],
            "supporting_ids": row.get("supporting_ids", []),
            "prediction": protocol.extract_answer(text), "queries": protocol.extract_queries(text),
            "documents": protocol.documents_blocks(text), "response": text,
            "retrieval_failed": out["extra_logs"].get("retrieval_failed", 0.0) > 0}


def _job(argv) -> int:
    """train_local.main with per-question records added to every evaluation."""
    from openrlhf_search.cpu.main_job import train as train_local
    from openrlhf_search.cpu.main_job.trainer import LocalSearchTrainer

    orig_rollout, orig_eval = LocalSearchTrainer.rollout, LocalSearchTrainer.evaluate

    def rollout(self, rows, n, *a, **kw):
        outs = orig_rollout(self, rows, n, *a, **kw)
        if kw.get("greedy"):
            self._em_last = (list(rows), outs)
        return outs

    def evaluate(self, rows=None, limit=None, desc="evaluation"):
        out = orig_eval(self, rows, limit, desc)
        last = getattr(self, "_em_last", None)
        if last is not None:
            out["records"] = [_record(self.protocol, r, o) for r, o in zip(*last)]
            self._em_last = None
        return out

    LocalSearchTrainer.rollout, LocalSearchTrainer.evaluate = rollout, evaluate
    return train_local.main(argv)


def reuse_warmstart(name: str, source: str) -> list:
    """Screening shortcut: start trial ``name`` from the warm-started policy of trial ``source`` (its reference
    checkpoint, with the tokenizer of its final model) and its before-RL evaluation, so that only RL and the after-RL
    evaluation run. Returns the train_local flags that do it. Valid only when the trial changes RL settings, not the
    warm start, the retrieval or the instruction."""
    import shutil

    src, out = os.path.join(TRIALS, source), os.path.join(TRIALS, name)
    model = os.path.join(out, "warm_started_policy")
    if not os.path.isdir(model):
        shutil.copytree(os.path.join(src, "checkpoints", "ref"), model)
        for f in os.listdir(os.path.join(src, "final")):
            if f.startswith(("tokenizer", "special_tokens", "chat_template", "vocab", "merges")):
                shutil.copy(os.path.join(src, "final", f), model)
    for f in ("eval_before.json", "warmstart.jsonl"):
        shutil.copy(os.path.join(src, f), os.path.join(out, f))
    return ["--actor.model_name_or_path", model, "--warmstart.sft_steps", "0", "--eval.no_before"]


def run_trial(name: str, flags, resume: bool = False, warmstart_from: str = "") -> dict:
    """Run one trial into ``trials/NAME`` (a fresh run, or with ``resume`` the continuation of a stopped one from its
    last checkpoint: the job's own resume); returns its summary (wall time of all parts, load)."""
    out = os.path.join(TRIALS, name)
    if os.path.exists(os.path.join(out, "eval.json")):
        raise SystemExit(f"{out} already holds a finished trial; pick another name")
    os.makedirs(out, exist_ok=True)
    if warmstart_from:
        flags = reuse_warmstart(name, warmstart_from) + list(flags)
    argv = ["--preset", "default", "--train_data", os.path.join(SPLIT, "train.jsonl"),
            "--eval_data", os.path.join(SPLIT, "val.jsonl"), "--corpus", os.path.join(DATA, "corpus.jsonl"),
            "--retriever.encoder", "bm25", "--ckpt.output_dir", out] + ([] if resume else ["--ckpt.no_load"]) \
        + list(flags)
    earlier = [json.load(open(os.path.join(out, f))) for f in sorted(os.listdir(out)) if f.startswith("trial_part")]
    env = dict(os.environ, PYTHONPATH=REPO, OMP_NUM_THREADS="2", TOKENIZERS_PARALLELISM="false",
               HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1")
    load0, t0 = os.getloadavg(), time.time()
    with open(os.path.join(out, "job.log"), "a" if resume else "w") as log:
        rc = subprocess.call(["nice", "-n", "10", sys.executable, os.path.abspath(__file__), "_job", "--"] + argv,
                             cwd=REPO, env=env, stdout=log, stderr=subprocess.STDOUT)
    summary = {"name": name, "flags": list(flags), "warmstart_from": warmstart_from, "rc": rc,
               "wall_s": time.time() - t0,
               "load_start": load0[0], "load_end": os.getloadavg()[0], "started": time.strftime(
                   "%Y-%m-%d %H:%M", time.localtime(t0))}
    if earlier:  # a resumed trial: its time is that of every part
        summary["parts"] = earlier + [dict(summary)]
        summary["wall_s"] = sum(p["wall_s"] for p in summary["parts"])
    with open(os.path.join(out, "trial.json"), "w") as fh:
        json.dump(summary, fh, indent=1)
    return summary


# ---------------------------------------------------------------------------------------------------- analysis
def entity_lists() -> dict:
    """{question type: entity strings of that type}: every capital, every currency code of the dataset."""
    from openrlhf_search.cpu.data.countries import load_country_facts

    facts = load_country_facts()
    return {"capital": sorted({f.capital for f in facts}, key=len, reverse=True),
            "currency": sorted({c for f in facts for c in f.currencies}, key=len, reverse=True)}


def first_entity(text: str, entities) -> str:
    """The entity that starts first in ``text`` (whole words, case-sensitive; the longest at a tie), or ""."""
    best = None
    for e in entities:
        m = re.search(r"(?<!\w)" + re.escape(e) + r"(?!\w)", text)
        if m and (best is None or m.start() < best[0]):
            best = (m.start(), e)
    return best[1] if best else ""


def top_passage(record: dict) -> str:
    """Text of the first passage of the first documents block ("" when the model did not search)."""
    if not record["documents"]:
        return ""
    block = record["documents"][0]
    m = re.search(r"Doc 1\(Title: [^)]*\)\s*(.*?)(?:\nDoc 2\(|</information>|$)", block, re.DOTALL)
    return m.group(1) if m else ""


def suffix(pred: str, k: int) -> str:
    return " ".join(pred.replace("\n", " ").split()[-k:]) if pred else ""


def _retrieved_text(record: dict) -> str:
    return " ".join(record["documents"])


def classify(record: dict) -> str:
    """exact | form (gold in the answer, not exact) | reading (gold retrieved, not in the answer) | retrieval."""
    from openrlhf_search.metrics import cover_em, exact_match, normalize_answer

    pred, golds = record["prediction"], record["gold"]
    if exact_match(pred, golds):
        return "exact"
    if cover_em(pred, golds):
        return "form"
    text = normalize_answer(_retrieved_text(record))
    if any(normalize_answer(g) and normalize_answer(g) in text for g in golds):
        return "reading"
    return "retrieval"


def analyze(name: str) -> dict:
    from openrlhf_search.evaluation.compare import bootstrap_mean_ci, paired_difference
    from openrlhf_search.metrics import exact_match, f1_score

    out = os.path.join(TRIALS, name)
    before = json.load(open(os.path.join(out, "eval_before.json")))
    # a trial stopped before its end (T0, T2 in docs/trials_em.md) has no eval.json: its before-RL half is analysed,
    # with the after-RL records standing in as the before-RL ones so that every paired figure below stays defined
    finished = os.path.exists(os.path.join(out, "eval.json"))
    after = json.load(open(os.path.join(out, "eval.json"))) if finished else before
    rb, ra = before["records"], after["records"]
    # the QA loader keeps no supporting_ids: take them (and the type) from the split's file
    val = {r["question"]: r for r in (json.loads(x) for x in open(os.path.join(SPLIT, "val.jsonl")) if x.strip())}
    for r in rb + ra:
        r["supporting_ids"] = val.get(r["question"], {}).get("supporting_ids", [])
    if [r["question"] for r in rb] != [r["question"] for r in ra]:
        raise SystemExit(f"{name}: before and after records differ in questions")
    rb = [r for r, s in zip(rb, ra) if not r["retrieval_failed"] and not s["retrieval_failed"]]
    ra = [r for r in ra if r["question"] in {x["question"] for x in rb}]
    golds = [r["gold"] for r in rb]
    score = lambda preds, fn: [fn(p, g) for p, g in zip(preds, golds)]
    em_b, em_a = score([r["prediction"] for r in rb], exact_match), score([r["prediction"] for r in ra], exact_match)
    f1_b, f1_a = score([r["prediction"] for r in rb], f1_score), score([r["prediction"] for r in ra], f1_score)
    ents = entity_lists()
    base = {"a_last_word": score([suffix(r["prediction"], 1) for r in rb], f1_score)}
    best_k = max(range(1, 8), key=lambda k: sum(score([suffix(r["prediction"], k) for r in rb], f1_score)))
    base[f"b_suffix_{best_k}"] = score([suffix(r["prediction"], best_k) for r in rb], f1_score)
    base["c_top_entity"] = score([first_entity(top_passage(r), ents.get(r["type"], [])) for r in rb], f1_score)
    if finished:
        base["c_top_entity_after"] = score([first_entity(top_passage(r), ents.get(r["type"], [])) for r in ra],
                                           f1_score)
    res = {"name": name, "finished": finished, "n": len(rb),
           "em": paired_difference(em_b, em_a), "f1": paired_difference(f1_b, f1_a),
           "em_after_ci": bootstrap_mean_ci(em_a), "f1_after_ci": bootstrap_mean_ci(f1_a),
           "baselines": {k: {"f1": sum(v) / len(v), "after_minus": paired_difference(v, f1_a)}
                         for k, v in base.items()},
           "decomposition": {}, "by_type": {}}
    for tag, recs in (("before", rb), ("after", ra))[:2 if finished else 1]:
        cats = [classify(r) for r in recs]
        res["decomposition"][tag] = {c: cats.count(c) for c in ("exact", "form", "reading", "retrieval")}
        res["decomposition"][tag]["searched"] = sum(1 for r in recs if r["documents"])
        res["decomposition"][tag]["words"] = sum(len(r["prediction"].split()) for r in recs) / len(recs)
    for t in sorted({r["type"] for r in rb}):
        idx = [i for i, r in enumerate(rb) if r["type"] == t]
        res["by_type"][t] = {"n": len(idx), "em_before": sum(em_b[i] for i in idx) / len(idx),
                             "em_after": sum(em_a[i] for i in idx) / len(idx),
                             "f1_before": sum(f1_b[i] for i in idx) / len(idx),
                             "f1_after": sum(f1_a[i] for i in idx) / len(idx)}
    parts = sorted(f for f in os.listdir(out) if f.startswith("trial_part"))  # a crashed run's record, if no other
    trial = os.path.join(out, "trial.json") if os.path.exists(os.path.join(out, "trial.json")) else \
        os.path.join(out, parts[-1]) if parts else ""
    res["trial"] = json.load(open(trial)) if trial else {}
    metrics = os.path.join(out, "metrics.jsonl")
    if os.path.exists(metrics):
        steps = [json.loads(x) for x in open(metrics) if x.strip()]
        steps = [s for s in steps if "time_step_s" in s]
        res["steps"] = len(steps)
        res["reward_scheme"] = sorted({s.get("reward_scheme") for s in steps if s.get("reward_scheme")})
        res["step_s"] = sum(s["time_step_s"] for s in steps) / max(1, len(steps))
        res["reward_first_last"] = (steps[0].get("reward"), steps[-1].get("reward")) if steps else None
    with open(os.path.join(out, "analysis.json"), "w") as fh:
        json.dump(res, fh, indent=1)
    return res


def _ci(d) -> str:
    return f"{d['diff']:+.3f} [{d['low']:+.3f}, {d['high']:+.3f}]"


def print_analysis(res: dict) -> None:
    t = res.get("trial", {})
    print(f"== {res['name']} (validation n={res['n']}; {res.get('steps')} steps, {res.get('step_s', 0):.1f} s/step; "
          f"job {t.get('wall_s', 0):.0f} s, load {t.get('load_start', 0):.1f} -> {t.get('load_end', 0):.1f})")
    if not res.get("finished", True):  # stopped: before-RL figures and the baselines only
        print(f"  stopped before its end (no eval.json): before RL only; EM {res['em']['before']:.3f}, "
              f"F1 {res['f1']['before']:.3f}")
        for k, v in res["baselines"].items():
            print(f"  baseline {k:<20} F1 {v['f1']:.3f}")
    else:
        print(f"  EM {res['em']['before']:.3f} -> {res['em']['after']:.3f}  {_ci(res['em'])}")
        print(f"  F1 {res['f1']['before']:.3f} -> {res['f1']['after']:.3f}  {_ci(res['f1'])}")
        for k, v in res["baselines"].items():
            print(f"  baseline {k:<20} F1 {v['f1']:.3f}; after RL minus it {_ci(v['after_minus'])}")
    for tag, d in res["decomposition"].items():
        print(f"  {tag:<6} " + ", ".join(f"{k} {v:.2f}" if isinstance(v, float) else f"{k} {v}" for k, v in d.items()))
    for ty, d in res["by_type"].items():
        if res.get("finished", True):
            print(f"  {ty:<9} n={d['n']} EM {d['em_before']:.3f} -> {d['em_after']:.3f}, "
                  f"F1 {d['f1_before']:.3f} -> {d['f1_after']:.3f}")
        else:
            print(f"  {ty:<9} n={d['n']} EM {d['em_before']:.3f}, F1 {d['f1_before']:.3f} (before RL)")


def main(argv=None):
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv and argv[0] == "_job":
        rest = argv[1:]
        if rest and rest[0] == "--":
            rest = rest[1:]
        return _job(rest)
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = p.add_subparsers(dest="cmd", required=True)
    s = sub.add_parser("split")
    s.add_argument("--n_val", type=int, default=64)
    s.add_argument("--val_seed", type=int, default=17)
    r = sub.add_parser("run")
    r.add_argument("name")
    r.add_argument("--resume", action="store_true", help="continue a stopped trial from its last checkpoint")
    r.add_argument("--warmstart_from", default="", help="reuse this trial's warm-started policy and before-RL "
                                                         "evaluation (screening of RL settings only)")
    r.add_argument("flags", nargs=argparse.REMAINDER, help="train_local flags after --")
    a_ = sub.add_parser("analyze")
    a_.add_argument("names", nargs="+")
    a = p.parse_args(argv)
    if a.cmd == "split":
        make_split(a.n_val, a.val_seed)
    elif a.cmd == "run":
        flags = a.flags[1:] if a.flags and a.flags[0] == "--" else a.flags
        summary = run_trial(a.name, flags, resume=a.resume, warmstart_from=a.warmstart_from)
        print(json.dumps(summary))
        if summary["rc"] == 0:
            print_analysis(analyze(a.name))
        return summary["rc"]
    else:
        for n in a.names:
            print_analysis(analyze(n))
    return 0


if __name__ == "__main__":
    sys.exit(main())
