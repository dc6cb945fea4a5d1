"""``python -m openrlhf_search.cpu.main_job.train``: the CPU main job (single process, real retriever service).

With no data flags it builds the embedded country-facts default (corpus + 1-/2-hop questions) under
``<output_dir>/data``. With no ``--search.retriever_urls`` it indexes ``--corpus`` (default: that corpus) and starts
``python -m retriever.server`` for the run, stopping it at the end. Examples::

    # the embedded default, MiniLM index, 10 RL steps after a 60-step scripted warm start
    python -m openrlhf_search.cpu.main_job.train --warmstart.sft_steps 60 --train.max_steps 10

    # real data: R1-Searcher stage-1 questions over HotpotQA paragraphs (BM25), a few steps
    python -m openrlhf_search.cpu.main_job.train --train_data ../shared/data/qa/r1searcher/stage_1.jsonl \\
        --corpus ../shared/data/wiki/hotpotqa_dev500_paragraphs.jsonl --retriever.encoder bm25 --train.max_steps 2

    # the same job on a GPU (policy, reference, critic, batches and the retriever's encoder): --train.device cuda
    python -m openrlhf_search.cpu.main_job.train --preset default --retriever.encoder bm25 --train.device cuda

    # against a retriever that is already running
    python -m openrlhf_search.cpu.main_job.train --search.retriever_urls http://127.0.0.1:8000 ...

Flags: ``--help`` (OpenRLHF names where they exist; see :mod:`openrlhf_search.cpu.main_job.args`).
Outputs in ``--ckpt.output_dir``: ``metrics.jsonl``, ``warmstart.jsonl``, ``checkpoints/``, ``final/`` (HF model),
``eval.json``. Exit code 0 on success, 1 on a training error, 2 on bad flags.
"""

import dataclasses
import json
import logging
import os
import random
import sys

import openrlhf_search._cpu_compat  # noqa: F401  (before any openrlhf import)

from openrlhf_search.cpu.main_job.args import parse_args

logger = logging.getLogger("train_local")


def _max_hops(rows, max_hops):
    """Rows whose ``hops`` field is at most ``max_hops`` (rows without the field are kept; None keeps all).

    Raises:
        QADataError: the filter leaves no row.
    """
    from openrlhf_search.cpu.data.qa import QADataError

    if max_hops is None:
        return rows
    kept = [r for r in rows if not isinstance(r.get("hops"), int) or r["hops"] <= max_hops]
    if not kept:
        raise QADataError(f"--data.max_hops {max_hops} leaves no question")
    return kept


def _resolve_data(args):
    """(training rows, validation rows, held-out rows, corpus path) of the run.

    The validation split is carved from the training questions (after ``--data.max_hops``, before
    ``--data.max_samples``) by ``--data.seed``: ``--data.validation_size`` questions, at most a fifth of them.
    """
    from openrlhf_search.cpu.data.default_dataset import build_default_dataset, validation_split
    from openrlhf_search.cpu.data.qa import load_qa_jsonl

    out = args.ckpt.output_dir
    default = None
    if not args.data.prompt_dataset:  # the embedded default: corpus, train and eval questions
        default = build_default_dataset(os.path.join(out, "data"), seed=args.data.seed)
    train_path = args.data.prompt_dataset or default.train_path
    train = _max_hops(load_qa_jsonl(train_path), args.data.max_hops)
    size = min(args.data.validation_size, len(train) // 5)
    if size < args.data.validation_size:
        logger.info("validation split: %d questions (a fifth of %d training questions), not %d", size, len(train),
                    args.data.validation_size)
    train, validation = validation_split(train, size, seed=args.data.seed)
    train = train[: args.data.max_samples]
    eval_path = args.eval.dataset or (default.eval_path if not args.data.prompt_dataset else None)
    evalq = _max_hops(load_qa_jsonl(eval_path), args.data.max_hops)[: args.eval.max_samples] if eval_path else []
    corpus = args.corpus or (default.corpus_path if default else None)
    return train, validation, evalq, corpus


def make_warmstart(args):
    """The warm-start hook: scripted trajectories (real retrieval) + SFT, logged to ``warmstart.jsonl``."""
    from openrlhf_search.cpu.main_job.warmstart import (answer_blocks, follow_up_query, scripted_query,
                                                        scripted_trajectory, self_answers, sft_warmstart)

    def run(trainer):
        w = args.warmstart
        if w.sft_steps <= 0:
            return
        rng = random.Random(args.train.seed)
        rows = rng.sample(trainer.train_rows, min(w.num_examples, len(trainer.train_rows)))
        queries = [scripted_query(r["question"]) for r in rows]
        passages = trainer.loop.run_until_complete(trainer.client.search_batch(queries))
        # --warmstart.hop_searches chain: a multi-hop row searches again from what its searches found (at most
        # --search.max_turns - 1 searches in all, so that the answer turn still fits)
        follow_ups = [[] for _ in rows]
        open_rows = [i for i, r in enumerate(rows) if w.hop_searches == "chain" and int(r.get("hops", 1)) >= 2]
        for _ in range(max(0, args.search.max_turns - 2)):
            nxt = {i: follow_up_query(rows[i]["question"], [queries[i]] + [q for q, _ in follow_ups[i]],
                                      follow_ups[i][-1][1] if follow_ups[i] else passages[i]) for i in open_rows}
            open_rows = [i for i in open_rows if nxt[i] is not None]
            if not open_rows:
                break
            found = trainer.loop.run_until_complete(trainer.client.search_batch([nxt[i] for i in open_rows]))
            for i, ps in zip(open_rows, found):
                follow_ups[i].append((nxt[i], ps))
        chained = [i for i, f in enumerate(follow_ups) if f]
        # the passages the answer is read from: the last search's
        read = [f[-1][1] if f else p for f, p in zip(follow_ups, passages)]
        reasonings = [None] * len(rows)
        if w.answers == "gold":
            answers = [r["golden_answers"][0] for r in rows]
        elif w.answers == "self":
            questions = [r["question"] for r in rows]
            replies = self_answers(trainer.engine, trainer.tokenizer, questions, read, prompt=w.self_prompt)
            # the span drops the words of the question and of the follow-up queries (the bridge entity)
            asked = [" ".join([q] + [fq for fq, _ in f]) for q, f in zip(questions, follow_ups)]
            answers, reasonings = map(list, zip(*answer_blocks(replies, asked, w.self_form)))
        else:
            answers = [None] * len(rows)
        trajs = [scripted_trajectory(trainer.prompt_of(r), r["question"], a, p,
                                     trainer.protocol, trainer.tokenizer, trainer.cfg.max_obs_tokens, reasoning=t,
                                     follow_ups=f)
                 for r, a, p, t, f in zip(rows, answers, passages, reasonings, follow_ups)]
        path = os.path.join(trainer.out_dir, "warmstart.jsonl")
        with open(path, "w") as fh:
            for r, a, t, q, f in zip(rows, answers, reasonings, queries, follow_ups):  # what the turns were taught
                fh.write(json.dumps({"question": r["question"], "taught_answer": a, "taught_reasoning": t,
                                     "queries": [q] + [fq for fq, _ in f], "gold": r["golden_answers"]}) + "\n")
            def log(row):
                fh.write(json.dumps(row) + "\n")
            losses = sft_warmstart(trainer.actor, trajs, trainer.pad_id, w.sft_steps, w.lr, w.batch_size,
                                   seed=args.train.seed, log=log)
        trainer.actor.eval()
        logger.info("warm start: %d SFT steps on %d scripted trajectories (%d with more than one search), "
                    "loss %.3f -> %.3f", w.sft_steps, len(trajs), len(chained), losses[0], losses[-1])

    return run


def print_table(result: dict, metrics_path: str) -> None:
    """Print the training summary and the evaluation table to stdout."""
    rows = []
    if os.path.exists(metrics_path):
        rows = [json.loads(line) for line in open(metrics_path) if line.strip()]
    steps = [r for r in rows if "reward" in r]
    print("\n== training ==")
    print(f"{'step':>5} {'reward':>8} {'valid_searches':>15} {'answer_rate':>12} {'kl':>8} {'step_s':>7}")
    for r in steps:
        print(f"{r['step']:>5} {r['reward']:>8.3f} {r.get('valid_searches', 0):>15.2f} "
              f"{r.get('answer_rate', 0):>12.2f} {r.get('kl', 0):>8.4f} {r['time_step_s']:>7.1f}")
    ev = result.get("eval")
    cmp = result.get("compare")
    split = {"heldout": "held-out", "validation": "validation"}.get(result.get("split") or "heldout")
    if cmp:
        from openrlhf_search.evaluation.compare import format_analysis, format_comparison

        print()
        print(format_comparison(cmp, title=f"{split}, greedy: before RL vs after RL"))
        if result.get("analysis"):
            print()
            print(format_analysis(result["analysis"]))
    elif ev and ev.get("n"):
        print(f"\n== evaluation ({split}, greedy) ==")
        print(f"{'n':>4} {'EM':>6} {'F1':>6} {'Cover-EM':>9} {'answer_rate':>12} {'valid_searches':>15} "
              f"{'searches':>9}")
        print(f"{ev['n']:>4} {ev['em']:>6.3f} {ev['f1']:>6.3f} {ev['cover_em']:>9.3f} {ev['answer_rate']:>12.2f} "
              f"{ev.get('valid_search_rate', 0.0):>15.2f} {ev.get('searches', 0.0):>9.2f}")
    if ev and ev.get("n"):
        for ex in ev.get("examples", []):
            print(f"  Q: {ex['question']}  gold: {ex['gold']}  pred: {ex['prediction']!r}")


def main(argv=None) -> int:
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(levelname)s %(message)s")
    for noisy in ("httpx", "httpcore", "openrlhf_search.retrieval_client"):
        logging.getLogger(noisy).setLevel(logging.WARNING)
    args = parse_args(argv)
    # SIGTERM (a scheduler stopping the job) unwinds through `finally` (engine thread joined, retriever stopped) and
    # exits 143; a checkpoint being written is finished first (openrlhf_search/cpu/main_job/shutdown.py).
    from openrlhf_search.cpu.main_job import shutdown

    shutdown.install()
    from openrlhf_search.cpu.data.qa import QADataError
    from openrlhf_search.cpu.main_job.checkpoint import CheckpointError
    from openrlhf_search.cpu.main_job.trainer import LocalSearchTrainer, TrainingError
    from openrlhf_search.retrieval_client import RetrievalError

    os.makedirs(args.ckpt.output_dir, exist_ok=True)
    try:
        train, validation, evalq, corpus = _resolve_data(args)
    except QADataError as e:  # missing / malformed data file: one line, not a traceback
        print(f"error: {e}", file=sys.stderr)
        return 2
    server = None
    if args.search.retriever_urls is None:
        from retriever.index import RetrieverIndexError
        from retriever.launch import RetrieverStartError, ensure_index, start_server_process

        if corpus is None:
            print("error: give --corpus or --search.retriever_urls", file=sys.stderr)
            return 2
        # --train.device reaches the retriever too: its dense encoder (passages here, queries in the server) and,
        # on a CPU run, its faiss index stay off the GPU. BM25 has no encoder and ignores both.
        device = args.train.device
        server_args = ["--device", device] + (["--no_faiss_gpu"] if device == "cpu" else [])
        try:  # CorpusError is a ValueError; OSError: a missing corpus
            index_dir = ensure_index(corpus, os.path.join(args.ckpt.output_dir, "index"),
                                     encoder=args.retriever.encoder, device=device)
            server, url = start_server_process(index_dir, extra_args=server_args,
                                               log_path=os.path.join(args.ckpt.output_dir, "retriever.log"))
        except (RetrieverIndexError, RetrieverStartError, ValueError, OSError) as e:
            print(f"error: cannot start the retriever on --corpus {corpus}: {e}", file=sys.stderr)
            return 2
        args.search_config = dataclasses.replace(args.search_config, retriever_urls=[url])
        logger.info("retriever service started at %s (pid %d, index %s)", url, server.pid, index_dir)
    trainer = None
    try:
        trainer = LocalSearchTrainer(args, train, evalq, warmstart_fn=make_warmstart(args),
                                     validation_rows=validation)
        result = trainer.fit()
        print_table(result, trainer.metrics_path)
        print(json.dumps({"steps": result["steps"], "resumed_from": result["resumed_from"],
                          "output_dir": os.path.abspath(args.ckpt.output_dir)}))
        return 0
    except (TrainingError, RetrievalError, CheckpointError) as e:  # RetrievalError: the warm start found the
        # retriever down; CheckpointError: a checkpoint folder that `latest` names is missing or incomplete
        logger.error("training stopped: %s", e)
        return 1
    finally:
        if trainer is not None:
            trainer.close()
        if server is not None:
            from retriever.launch import stop_server_process

            stop_server_process(server)


def _run_cli() -> None:
    """``main()`` as a process: a signal's exit code (143 for SIGTERM) once the cleanup in ``main`` has run. After a
    signal the process ends with ``os._exit`` (output flushed first): the interpreter's teardown would otherwise run
    C++ destructors of libraries (torch's thread pools) that may still be in use by threads nobody owns, which is
    what aborted a SIGTERMed job with "terminate called without an active exception" (exit -6)."""
    from openrlhf_search.cpu.main_job import shutdown

    try:
        code = main()
    except SystemExit as e:
        code = e.code if isinstance(e.code, int) else 1
        if not shutdown.terminated():
            raise
    if shutdown.terminated():
        logging.shutdown()
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)
    sys.exit(code)


if __name__ == "__main__":
    _run_cli()
