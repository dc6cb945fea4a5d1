"""Turn QA data into OpenRLHF prompt files for either protocol, with R1-Searcher's difficulty bucketing and mixing.

Inputs (any number, concatenated): FlashRAG rows (``id, question, golden_answers``; a local file, or a FlashRAG
name such as ``flashrag:nq`` loaded from ``RUC-NLPIR/FlashRAG_datasets`` when no local copy exists), R1-Searcher
jsonl (``question, answer``), Search-R1 parquet / jsonl (``prompt``, ``reward_model.ground_truth.target``), and
``nq_hotpotqa_train``: Search-R1's training set, the NQ + HotpotQA train merge its paper run trains on
(``scripts/nq_hotpotqa/data_process.sh:5-6``; :func:`load_searchr1_train_merge`), ~170k questions from the hub
(``searchr1_train:SRC1,SRC2`` merges other FlashRAG train splits the same way).

Output rows (jsonl), what ``--data.input_key prompt --data.label_key label`` read in OpenRLHF::

    {"prompt": <rendered prompt string>, "label": "[\\"gold 1\\", \\"gold 2\\"]", "datasource": "hotpotqa",
     "data_source": "hotpotqa", "id": "...", "question": "...", "difficulty": "medium" (when bucketed),
     "rendering": {"protocol": "searchr1", "template": "train", "chat_template": true,
                   "tokenizer": "Qwen/Qwen2.5-7B", "chat_template_sha256": "..."}}

The prompt is rendered by the protocol (``protocol.build_prompt``) character for character as the paper's released
code renders it for the POLICY's tokenizer (``--tokenizer``; chat rendering never falls back to another tokenizer),
so train with ``--data.apply_chat_template`` off; ``--engine_special_tokens`` (default for r1searcher) writes the
special tokens vLLM adds to a text prompt in front of it. ``rendering`` records how the prompt was made, which
``cli.train`` checks (:func:`check_prompt_file`); ``docs/ARCHITECTURE.md``, "Prompt rendering". ``label`` is the
JSON list of gold answers as a string (OpenRLHF passes labels as strings).

Examples::

    python -m openrlhf_search.cli.prepare_data --input "$DATA_DIR"/qa/r1searcher/stage_2.jsonl \\
        --protocol r1searcher --out data/stage2.jsonl --eval_out data/stage2_eval.jsonl --eval_size 200
    python -m openrlhf_search.cli.prepare_data --input "$DATA_DIR"/qa/r1searcher/stage_1.jsonl \\
        --protocol r1searcher --bucket --mix 0:2:1.5 --out data/stage1.jsonl
    python -m openrlhf_search.cli.prepare_data --input nq_hotpotqa_train \\
        --protocol searchr1 --tokenizer Qwen/Qwen2.5-7B --out data/searchr1_train_qwen2.5_base.jsonl
"""

import argparse
import hashlib
import json
import logging
import os
import random
import re
import sys
from collections import Counter
from typing import List, Optional

from openrlhf_search.env.config import FLAT_FLAG_NAMES, ConfigError, add_search_config_arguments
from openrlhf_search.evaluation.difficulty import bucket_of, count_correct, mix_buckets, parse_mix
from openrlhf_search.evaluation.loaders import DatasetError, QAExample, load_eval_dataset

logger = logging.getLogger("prepare_data")

#: the search settings of the reference model's bucketing rollouts (``--bucket_model``), besides protocol and chat
BUCKET_SEARCH_FIELDS = ("retriever_urls", "max_turns", "max_new_tokens_per_turn")


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--input", action="append", required=True,
                   help="file (jsonl/json/parquet) or dataset name (flashrag:nq, bamboogle, ...); repeatable")
    p.add_argument("--split", default=None, help="split for FlashRAG hub datasets (default: test/dev as evaluated)")
    p.add_argument("--data_dir", default=None,
                   help="folder of local copies for dataset names (qa/flashrag/<name>.test.jsonl, qa/r1searcher/...); "
                        "default $OPENRLHF_SEARCH_DATA_DIR, else none: flashrag:<name> and bare FlashRAG names load "
                        "the published split from the hub")
    add_search_config_arguments(p, prefix="--", only=["protocol", "chat_template"], switches=True,
                                field_defaults=True, notes={
                                    "protocol": "; chat_tools* declare search as a tool of the policy's chat "
                                                "template (needs --tokenizer)",
                                    "chat_template": "; needs --tokenizer"})
    p.add_argument("--tokenizer", default=None,
                   help="the POLICY's tokenizer (path or hub name) for chat rendering; required for searchr1 unless "
                        "--no_chat_template (its released code renders every prompt with the policy's template)")
    p.add_argument("--template", default="train",
                   help="prompt variant: train (default) | eval (r1searcher: its released eval prompt)")
    eng = p.add_mutually_exclusive_group()
    eng.add_argument("--engine_special_tokens", dest="engine_special_tokens", action="store_true", default=None,
                     help="write in front of each prompt the special tokens vLLM adds to a text prompt (the policy "
                          "tokenizer's BOS for Llama-3; needs --tokenizer); default on for r1searcher, as released")
    eng.add_argument("--no_engine_special_tokens", dest="engine_special_tokens", action="store_false")
    p.add_argument("--out", required=True, help="training prompt file (jsonl)")
    p.add_argument("--eval_out", default=None, help="held-out eval prompt file (jsonl)")
    p.add_argument("--eval_size", type=int, default=0, help="questions held out into --eval_out")
    p.add_argument("--limit", type=int, default=None, help="read at most this many rows per input")
    p.add_argument("--shuffle", action="store_true", help="shuffle before the eval split / writing")
    p.add_argument("--dedup", action="store_true",
                   help="keep each repeated question once (the first copy) in the training rows; default: training "
                        "keeps the inputs' repeats (as the papers' data does) and says how many. The held-out eval "
                        "rows are distinct questions and none of them stays in training, either way")
    p.add_argument("--seed", type=int, default=0)
    b = p.add_argument_group("difficulty bucketing (R1-Searcher sec. 3.1)")
    b.add_argument("--bucket", action="store_true",
                   help="bucket questions by how many reference rollouts answer correctly")
    b.add_argument("--rollouts_field", default="pred_anses",
                   help="row field with precomputed rollout answers (R1-Searcher's stage_1.jsonl: pred_anses)")
    b.add_argument("--bucket_metric", default="cover_em", help="cover_em | em | f1>=T")
    b.add_argument("--hard_max_correct", type=int, default=1, help="<= this many correct rollouts: hard")
    b.add_argument("--easy_min_correct", type=int, default=-1,
                   help=">= this many correct rollouts: easy (-1: more than half)")
    b.add_argument("--mix", default=None, help="easy:medium:hard ratio, e.g. 0:2:1.5 (needs --bucket)")
    b.add_argument("--mix_total", type=int, default=0, help="rows after mixing (0: as many as the ratio allows)")
    g = p.add_argument_group("generate rollouts for bucketing with a reference model (when rows carry none)")
    g.add_argument("--bucket_model", default=None, help="model folder or hub name to sample the rollouts with (vLLM)")
    g.add_argument("--bucket_rollouts", type=int, default=10, help="N rollouts per question")
    add_search_config_arguments(g, prefix="--", only=BUCKET_SEARCH_FIELDS, names=FLAT_FLAG_NAMES,
                                field_defaults=True)
    g.add_argument("--temperature", type=float, default=1.0)
    return p


class RenderingError(ValueError):
    """A prompt file does not match the rendering a run asks for (the message names the file and the field)."""


def load_policy_tokenizer(path: str):
    """The policy's tokenizer (``AutoTokenizer.from_pretrained(path)``); never a stand-in.

    Raises:
        RenderingError: the path / name does not load (one line naming it).
    """
    from transformers import AutoTokenizer

    from openrlhf_search.launch.model_check import ModelCheckError, require_hub_files

    try:
        require_hub_files(path)  # one request, not a minute of retries, when the hub is out of reach
    except ModelCheckError as e:
        raise RenderingError(f"cannot load the policy tokenizer: {e}") from e
    try:
        return AutoTokenizer.from_pretrained(path)
    except (OSError, ValueError) as e:  # not there / not a tokenizer / offline hub name
        raise RenderingError(f"cannot load the policy tokenizer {path!r}: {str(e).splitlines()[0]}") from e


def chat_template_sha256(tokenizer) -> Optional[str]:
    """SHA-256 of the tokenizer's chat template text (None when it has none): which template rendered a file."""
    template = getattr(tokenizer, "chat_template", None) if tokenizer is not None else None
    if not template:
        return None
    if not isinstance(template, str):  # several named templates
        template = json.dumps(template, sort_keys=True)
    return hashlib.sha256(template.encode("utf-8")).hexdigest()


#: protocols whose released code hands text prompts to vLLM (which adds the tokenizer's special tokens)
ENGINE_SPECIAL_TOKENS_DEFAULT = {"r1searcher": True}


def resolve_engine_special_tokens(protocol_name: str, value: Optional[bool], tokenizer=None) -> bool:
    """``--engine_special_tokens`` resolved: the flag, else the protocol's released default
    (:data:`ENGINE_SPECIAL_TOKENS_DEFAULT`); never without a tokenizer (nothing can be known to add)."""
    if tokenizer is None:
        return False
    return ENGINE_SPECIAL_TOKENS_DEFAULT.get(protocol_name, False) if value is None else bool(value)


def rendering_record(protocol_name: str, chat: Optional[bool], tokenizer=None, template: str = "train",
                     engine_special_tokens: bool = False) -> dict:
    """How prompts are rendered: protocol, template, whether the chat template is applied, the tokenizer, whether
    the engine's special tokens are written in front (``protocol.engine_prompt``).

    Raises:
        ValueError: chat rendering without the policy's tokenizer, unknown protocol template.
    """
    from openrlhf_search.env.protocol import get_protocol

    protocol = get_protocol(protocol_name)
    protocol._check_template(template)
    use_chat = protocol.resolve_chat(chat, tokenizer)
    if use_chat and template == "eval" and protocol_name == "r1searcher":
        raise ValueError("protocol r1searcher: the released eval prompt (base_prompt_v0) is plain text for every "
                         "model; drop --chat_template")
    if use_chat:  # the policy's tokenizer with a chat template, or one line now (nothing is guessed)
        protocol._apply_chat(tokenizer, [{"role": "user", "content": "?"}])
    return {"protocol": protocol.name, "template": template, "chat_template": use_chat,
            "tokenizer": (getattr(tokenizer, "name_or_path", None) or None) if tokenizer is not None else None,
            "chat_template_sha256": chat_template_sha256(tokenizer) if use_chat else None,
            "engine_special_tokens": bool(engine_special_tokens and tokenizer is not None)}


def _first_row(path: str) -> Optional[dict]:
    with open(path, encoding="utf-8") as f:
        for line in f:
            if line.strip():
                try:
                    return json.loads(line)
                except json.JSONDecodeError as e:
                    raise RenderingError(f"{path}: first row is not valid JSON ({e})") from e
    return None


def prepare_command(out: str, protocol_name: str, tokenizer: Optional[str] = None, chat: Optional[bool] = None,
                    inputs=("QA_FILE",), template: str = "train") -> str:
    """The ``prepare_data`` command line that writes ``out`` as a run with these settings reads it: what the
    launchers print for a missing prompt file and :func:`check_prompt_file` for a refused one.

    Args:
        out: the prompt file to write.
        protocol_name: ``--search.protocol``.
        tokenizer: the policy's tokenizer (path or hub name); None: none given.
        chat: ``--search.chat_template`` (True / False written as the flag; None: the protocol's default).
        inputs: the ``--input`` values (files or names such as ``nq_hotpotqa_train``).
        template: the protocol's prompt variant (``--template``, written when not "train").
    """
    import shlex

    parts = ["python", "-m", "openrlhf_search.cli.prepare_data"]
    for name in inputs:
        parts += ["--input", name]
    parts += ["--protocol", protocol_name]
    if tokenizer:
        parts += ["--tokenizer", tokenizer]
    if chat is not None:
        parts.append("--chat_template" if chat else "--no_chat_template")
    if template != "train":
        parts += ["--template", template]
    parts += ["--out", out]
    return " ".join(shlex.quote(p) for p in parts)


def inputs_of_file(path: str) -> List[str]:
    """The ``--input`` values that wrote a prompt file, from its rows' ``source`` (a file path, or
    ``hub:<repo>/<config>/<split>``): the train splits of NQ and HotpotQA are ``nq_hotpotqa_train`` (Search-R1's
    merge), a hub eval split is its FlashRAG name; ``["QA_FILE"]`` when the rows do not say."""
    sources: List[str] = []
    with open(path, encoding="utf-8") as f:
        for line in f:
            try:
                source = json.loads(line).get("source") if line.strip() else None
            except (json.JSONDecodeError, AttributeError):
                source = None
            if source and source not in sources:
                sources.append(source)
    hub = {s.split("/")[-2]: s.split("/")[-1] for s in sources if s.startswith("hub:")}
    names = [s for s in sources if not s.startswith("hub:")]
    if hub and set(hub) == set(SEARCHR1_TRAIN_SOURCES) and set(hub.values()) == {"train"}:
        names.append(SEARCHR1_TRAIN_MERGE)
    elif hub and set(hub.values()) == {"train"}:
        names.append("searchr1_train:" + ",".join(hub))
    else:
        names += list(hub)
    return names or ["QA_FILE"]


def regenerate_command(path: str, protocol_name: str, chat: Optional[bool], policy: Optional[str],
                       record=None, out: Optional[str] = None) -> str:
    """The :func:`prepare_command` that rewrites a refused prompt file ``path`` (in place, or to ``out``) so that
    :func:`check_prompt_file` with the same arguments accepts it: the run's protocol, chat choice (the file's when the
    run leaves it open) and policy tokenizer, the file's inputs and prompt variant (R1-Searcher's plain-text eval
    variant only when the run renders no chat template)."""
    record = record if isinstance(record, dict) else {}
    use_chat = chat if chat is not None else record.get("chat_template")
    template = record.get("template") or "train"
    if use_chat and template == "eval" and protocol_name == "r1searcher":
        template = "train"  # the released eval prompt is plain text only
    return prepare_command(out or path, protocol_name, policy, use_chat, inputs_of_file(path), template)


def _per_policy(path: str, policy: str) -> str:
    """``data/x.jsonl`` -> ``data/x.<policy's last name part>.jsonl``: a second file beside a refused one."""
    name = re.sub(r"[^A-Za-z0-9._-]+", "_", os.path.basename(os.path.normpath(policy)))
    return f"{os.path.splitext(path)[0]}.{name}.jsonl"


def check_prompt_file(path: str, protocol_name: str, chat: Optional[bool], policy: Optional[str] = None) -> \
        Optional[dict]:
    """Check that a prepared prompt file is what a training run with these settings would render.

    Prompts reach the trainer pre-rendered, so ``--search.chat_template`` cannot change them: this check makes the
    flag a validation of the file instead of a silent no-op. On the first row: the ``rendering`` record names the
    same protocol and (when ``chat`` is not None) the same chat-template choice; the policy's tokenizer has the chat
    template the file records (its SHA-256: one file serves every size of a family that shares a template) and
    re-renders the row's question to the same prompt. A hub name the file itself names is not loaded; another that
    cannot be loaded is refused (the templates cannot be compared).

    Args:
        path: the prompt file (jsonl, as this module writes it); anything that is not a local ``.jsonl`` file (a hub
            dataset, a parquet or json file from elsewhere) is not checked.
        protocol_name: ``--search.protocol``.
        chat: ``--search.chat_template`` (None = auto: whatever the file records, checked by re-rendering).
        policy: ``--actor.model_name_or_path``.
    Returns:
        the file's rendering record, or None when ``path`` was not checked.
    Raises:
        RenderingError: one line naming the file and what differs, and how to regenerate it.
    """
    if not path or not os.path.isfile(path) or not path.endswith(".jsonl"):
        return None
    row = _first_row(path)
    if row is None:
        raise RenderingError(f"{path}: no rows")
    record = row.get("rendering")
    fix = "regenerate it with " + regenerate_command(path, protocol_name, chat, policy, record)
    if not isinstance(record, dict) or "prompt" not in row or "question" not in row:
        raise RenderingError(f"{path}: rows carry no 'rendering' record (not written by this prepare_data), so "
                             f"their prompts cannot be checked against --search.*; {fix}")
    if record.get("protocol") != protocol_name:
        raise RenderingError(f"{path}: prompts rendered for protocol {record.get('protocol')!r}, the run uses "
                             f"{protocol_name!r}; {fix}")
    if chat is not None and bool(record.get("chat_template")) != chat:
        raise RenderingError(f"{path}: prompts rendered with chat_template={bool(record.get('chat_template'))}, "
                             f"--search.chat_template is {chat}; the flag cannot re-render pre-rendered prompts, "
                             f"{fix}")
    recorded = record.get("tokenizer")
    if not policy or (not os.path.isdir(policy) and (not record.get("chat_template") or recorded in (None, policy))):
        return record  # a hub name the file was rendered with, or a plain-text file: nothing to compare
    from openrlhf_search.env.protocol import engine_prompt, get_protocol

    try:
        tokenizer = load_policy_tokenizer(policy)
    except RenderingError as e:
        if os.path.isdir(policy):
            raise
        raise RenderingError(f"{path}: prompts rendered with the chat template of {recorded!r}, the policy is "
                             f"{policy!r}, whose tokenizer cannot be loaded to compare the templates ({e}); "
                             f"{fix}") from e
    want, have = record.get("chat_template_sha256"), chat_template_sha256(tokenizer)
    if record.get("chat_template") and want and have != want:
        raise RenderingError(f"{path}: prompts rendered with the chat template of {recorded!r} (sha256 "
                             f"{want[:12]}), the policy {policy!r} has another template (sha256 "
                             f"{(have or 'none')[:12]}): this file serves the launchers of its own template; "
                             "write one for this policy (then give it as TRAIN_DATA / EVAL_DATA) with "
                             + regenerate_command(path, protocol_name, chat, policy, record,
                                                  out=_per_policy(path, policy)))
    try:
        expected = get_protocol(protocol_name).build_prompt(
            row["question"], tokenizer=tokenizer, chat=bool(record.get("chat_template")),
            template=record.get("template", "train"))
        if resolve_engine_special_tokens(protocol_name, record.get("engine_special_tokens"), tokenizer):
            expected = engine_prompt(expected, tokenizer)
    except ValueError as e:
        raise RenderingError(f"{path}: cannot re-render with the policy tokenizer {policy}: {e}") from e
    if expected != row["prompt"]:
        at = next((i for i, (a, b) in enumerate(zip(expected, row["prompt"])) if a != b),
                  min(len(expected), len(row["prompt"])))
        raise RenderingError(f"{path}: the first prompt differs from the policy tokenizer's rendering at "
                             f"character {at} ({row['prompt'][at:at + 30]!r} vs {expected[at:at + 30]!r}); {fix}")
    return record


def render_rows(examples: List[QAExample], protocol_name: str, chat: Optional[bool], tokenizer=None,
                difficulty: Optional[dict] = None, template: str = "train",
                engine_special_tokens: bool = False) -> List[dict]:
    """Prompt rows for OpenRLHF (see module docstring).

    Args:
        examples: questions with gold answers.
        protocol_name: registered protocol name.
        chat: chat template on/off; None = the protocol's default (``Protocol.resolve_chat``: r1searcher off,
            searchr1 on exactly when the policy's tokenizer has a template).
        tokenizer: the policy's tokenizer; required for chat rendering.
        difficulty: id -> bucket name, added as ``difficulty``.
        template: the protocol's prompt variant ("train"; r1searcher also "eval").
        engine_special_tokens: write the engine's special tokens in front (``protocol.engine_prompt``; needs the
            tokenizer).
    Raises:
        ValueError: chat rendering without the policy's tokenizer (or with one that has no template), bad template.
    """
    from openrlhf_search.env.protocol import engine_prompt, get_protocol

    protocol = get_protocol(protocol_name)
    record = rendering_record(protocol_name, chat, tokenizer, template, engine_special_tokens)
    use_chat = record["chat_template"]
    rows = []
    for ex in examples:
        prompt = protocol.build_prompt(ex.question, tokenizer=tokenizer, chat=use_chat, template=template)
        if record["engine_special_tokens"]:
            prompt = engine_prompt(prompt, tokenizer)
        row = {"prompt": prompt, "label": json.dumps(ex.golds, ensure_ascii=False), "datasource": ex.data_source,
               "data_source": ex.data_source, "id": ex.id, "question": ex.question, "rendering": record}
        if getattr(ex, "source", ""):
            row["source"] = ex.source  # the file path or hub split the question was read from
        if difficulty is not None and ex.id in difficulty:
            row["difficulty"] = difficulty[ex.id]
        rows.append(row)
    return rows


#: Search-R1's training set: the sources of ``scripts/nq_hotpotqa/data_process.sh:5`` (``DATA=nq,hotpotqa``)
SEARCHR1_TRAIN_MERGE = "nq_hotpotqa_train"
SEARCHR1_TRAIN_SOURCES = ("nq", "hotpotqa")


def load_searchr1_train_merge(sources=SEARCHR1_TRAIN_SOURCES, limit: Optional[int] = None) -> List[QAExample]:
    """Search-R1's training data as its released ``scripts/data_process/qa_search_train_merge.py`` builds it: for each
    source, ``datasets.load_dataset("RUC-NLPIR/FlashRAG_datasets", source)["train"]`` (lines 55-59), every row in
    order with its index within that source (``with_indices``, lines 62-93; ``extra_info.index``), sources
    concatenated in the given order (line 99). The question is stripped and completed with "?" by the protocol
    (lines 65-67 = ``SearchR1Protocol.normalize_question``) when rendered. Needs the hub (or a warm HF cache).

    Args:
        sources: FlashRAG config names, in merge order.
        limit: first ``limit`` rows of each source.
    Returns:
        examples with id ``<source>_<index>``, ``data_source`` and ``extra["extra_info"] = {"split", "index"}``.
    Raises:
        DatasetError: the hub is unreachable, a source has no train split, or a row lacks question / answers.
    """
    from openrlhf_search.evaluation.loaders import FLASHRAG_HUB_REPO, example_from_row

    out: List[QAExample] = []
    for source in sources:
        try:
            import datasets

            split = datasets.load_dataset(FLASHRAG_HUB_REPO, source)["train"]
        except Exception as e:  # offline, unknown config, no train split: one clear line
            first = (str(e).strip().splitlines() or [""])[0]
            raise DatasetError(f"Search-R1 training merge: FlashRAG {source!r} train split could not be loaded from "
                               f"the hub {FLASHRAG_HUB_REPO} ({type(e).__name__}: {first}); run this command once "
                               f"where the hub is reachable (the datasets cache, ~/.cache/huggingface, then serves "
                               f"it offline), or give Search-R1's own train.parquet (its "
                               f"scripts/nq_hotpotqa/data_process.sh writes it) as --input") from e
        n = len(split) if limit is None else min(limit, len(split))
        for idx in range(n):
            row = dict(split[idx])
            ex = example_from_row(row, idx, source)
            ex.id, ex.data_source = f"{source}_{idx}", source
            ex.extra["extra_info"] = {"split": "train", "index": idx}
            ex.source = f"hub:{FLASHRAG_HUB_REPO}/{source}/train"
            out.append(ex)
        logger.info("Search-R1 merge: %d rows of %s train", n, source)
    return out


def load_input(name: str, data_dir: Optional[str] = None, split: Optional[str] = None,
               limit: Optional[int] = None) -> List[QAExample]:
    """One ``--input``: the Search-R1 training merge (``nq_hotpotqa_train``, ``searchr1_train:SRC1,SRC2``) or anything
    ``loaders.load_eval_dataset`` reads. Raises DatasetError."""
    if name == SEARCHR1_TRAIN_MERGE and not os.path.isfile(name):
        return load_searchr1_train_merge(SEARCHR1_TRAIN_SOURCES, limit)
    if name.startswith("searchr1_train:") and not os.path.isfile(name):
        return load_searchr1_train_merge(tuple(x for x in name.split(":", 1)[1].split(",") if x), limit)
    return load_eval_dataset(name, data_dir=data_dir, split=split, limit=limit)


def question_key(question: str) -> str:
    """What makes two questions the same: SQuAD normalisation (case, punctuation, articles, whitespace), so
    "Who wrote Hamlet?" and "who wrote hamlet" are one question."""
    from openrlhf_search.env.metrics import normalize_answer

    return normalize_answer(question)


def dedup_questions(examples: List[QAExample]) -> "tuple[List[QAExample], int]":
    """The examples with each question (:func:`question_key`) kept once, the first copy, in order; and how many
    were dropped. Duplicates would otherwise reach both sides of the eval split (R1-Searcher's stage-1 and stage-2
    files share questions)."""
    seen, out = set(), []
    for ex in examples:
        key = question_key(ex.question)
        if key not in seen:
            seen.add(key)
            out.append(ex)
    return out, len(examples) - len(out)


def split_eval(examples: List[QAExample], eval_size: int) -> "tuple[List[QAExample], List[QAExample], int]":
    """(held out, training, removed): the first ``eval_size`` distinct questions (:func:`question_key`) in order are
    held out; training is every other row except the copies of a held-out question (``removed`` counts them), so no
    eval question is trained on, however often the inputs repeat it."""
    held, keys, rest = [], set(), []
    for ex in examples:
        key = question_key(ex.question)
        if len(held) < eval_size and key not in keys:
            held.append(ex)
            keys.add(key)
        else:
            rest.append(ex)
    train = [ex for ex in rest if question_key(ex.question) not in keys]
    return held, train, len(rest) - len(train)


def _write_jsonl(path: str, rows: List[dict]) -> None:
    os.makedirs(os.path.dirname(os.path.abspath(path)) or ".", exist_ok=True)
    tmp = path + ".tmp"
    with open(tmp, "w", encoding="utf-8") as f:
        for r in rows:
            f.write(json.dumps(r, ensure_ascii=False) + "\n")
    os.replace(tmp, path)  # never leave a half-written prompt file behind


def _generated_rollouts(examples: List[QAExample], args) -> dict:
    """id -> N rollout answers sampled with a reference model and the real executor (needs a retriever)."""
    from openrlhf_search.env.config import search_config_from_args
    from openrlhf_search.evaluation.runner import EvalSettings, protocol_reward_scheme, run_eval_sync

    search = search_config_from_args(args, prefix="--", names=FLAT_FLAG_NAMES,
                                     only=("protocol", "chat_template") + BUCKET_SEARCH_FIELDS,
                                     reward_scheme=protocol_reward_scheme(args.protocol))
    settings = EvalSettings(search=search, model=args.bucket_model, temperature=args.temperature,
                            n_samples=args.bucket_rollouts, seed=args.seed)
    rows = run_eval_sync(examples, settings)
    out: dict = {}
    for r in rows:
        out.setdefault(r["id"], []).append(r["prediction"])
    return out


def main(argv: Optional[List[str]] = None) -> int:
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")
    args = build_parser().parse_args(argv)
    if args.mix and not args.bucket:
        print("error: --mix needs --bucket", file=sys.stderr)
        return 2
    tokenizer = None
    try:
        if args.tokenizer:
            tokenizer = load_policy_tokenizer(args.tokenizer)
        if args.engine_special_tokens and tokenizer is None:
            raise ValueError("--engine_special_tokens needs the policy's --tokenizer (its special tokens)")
        engine_tokens = resolve_engine_special_tokens(args.protocol, args.engine_special_tokens, tokenizer)
        # refuse before reading or sampling anything
        rendering_record(args.protocol, args.chat_template, tokenizer, args.template, engine_tokens)
    except (ValueError, ConfigError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    try:
        examples: List[QAExample] = []
        for name in args.input:
            examples.extend(load_input(name, data_dir=args.data_dir, split=args.split, limit=args.limit))
    except DatasetError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    for source, n in Counter(ex.source for ex in examples).items():
        logger.info("read %d questions from %s", n, source or "(unknown source)")
    if args.dedup:
        examples, dropped = dedup_questions(examples)
        logger.info("--dedup: dropped %d repeated questions (the first copy of each kept)", dropped)
    ids = Counter(ex.id for ex in examples)
    if any(c > 1 for c in ids.values()):  # ids must be unique for bucketing and for joining results later
        for i, ex in enumerate(examples):
            ex.id = f"{ex.data_source}_{i}_{ex.id}"
    rng = random.Random(args.seed)
    if args.shuffle:
        rng.shuffle(examples)

    difficulty = None
    if args.bucket:
        if args.bucket_model:
            rollouts = _generated_rollouts(examples, args)
        else:
            missing = [ex.id for ex in examples if args.rollouts_field not in ex.extra]
            if missing:
                print(f"error: {len(missing)} rows have no {args.rollouts_field!r} field (first: {missing[0]}); "
                      f"pass --bucket_model to sample rollouts", file=sys.stderr)
                return 2
            rollouts = {ex.id: list(ex.extra[args.rollouts_field]) for ex in examples}
        difficulty = {}
        by_bucket: dict = {"easy": [], "medium": [], "hard": []}
        for ex in examples:
            answers = rollouts.get(ex.id, [])
            c = count_correct(answers, ex.golds, args.bucket_metric)
            difficulty[ex.id] = bucket_of(c, len(answers), args.hard_max_correct, args.easy_min_correct)
            by_bucket[difficulty[ex.id]].append(ex)
        logger.info("buckets: %s", {b: len(v) for b, v in by_bucket.items()})
        if args.mix:
            try:
                examples, taken = mix_buckets(by_bucket, parse_mix(args.mix), args.mix_total, args.seed)
            except ValueError as e:
                print(f"error: {e}", file=sys.stderr)
                return 2
            logger.info("mixed %s: %s", args.mix, taken)

    eval_rows: List[dict] = []
    if args.eval_size:
        if not args.eval_out:
            print("error: --eval_size needs --eval_out", file=sys.stderr)
            return 2
        if args.eval_size >= len(examples):
            print(f"error: --eval_size {args.eval_size} leaves no training rows ({len(examples)} in all)",
                  file=sys.stderr)
            return 2
        held_out, examples, removed = split_eval(examples, args.eval_size)
        if len(held_out) < args.eval_size or not examples:
            print(f"error: --eval_size {args.eval_size} leaves no training rows ({len(held_out)} distinct questions "
                  f"held out, {len(examples)} rows left for training once their repeats are removed)",
                  file=sys.stderr)
            return 2
        if removed:
            logger.warning("removed %d rows that repeat a held-out eval question (same question after "
                           "normalisation) from training", removed)
        eval_rows = render_rows(held_out, args.protocol, args.chat_template, tokenizer, difficulty, args.template,
                                engine_tokens)
    repeats = len(examples) - len({question_key(ex.question) for ex in examples})
    if repeats:
        logger.warning("%d training rows repeat a question of an earlier row (kept, as the inputs have them; --dedup "
                       "keeps one copy)", repeats)
    train_rows = render_rows(examples, args.protocol, args.chat_template, tokenizer, difficulty, args.template,
                             engine_tokens)
    _write_jsonl(args.out, train_rows)
    logger.info("wrote %d training prompts to %s", len(train_rows), args.out)
    if args.eval_out:
        if not eval_rows:
            eval_rows = render_rows(examples, args.protocol, args.chat_template, tokenizer, difficulty, args.template,
                                    engine_tokens)
        _write_jsonl(args.eval_out, eval_rows)
        logger.info("wrote %d eval prompts to %s", len(eval_rows), args.eval_out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
