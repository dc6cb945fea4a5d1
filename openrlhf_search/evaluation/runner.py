"""Run the search agent over eval questions: every question (and sample) is one concurrent rollout task.

The rollout is the training executor itself (``openrlhf_search.env.agent.SearchAgentExecutor``), so eval measures the
same prompt, tags, stop strings, document rendering and turn budget the policy was trained with. Decoding is greedy by
default (both papers evaluate greedily). One question failing (engine error, retriever down past the retry budget)
yields a row with ``error`` set instead of ending the run.

One jsonl row per question and sample, with every :data:`ROW_FIELDS` key: the last ten are the per-question record
fields (:mod:`openrlhf_search.evaluation.records`), ``prompt`` the exact prompt text the policy was given (for parity
audits), ``stop_reason`` :func:`openrlhf_search.evaluation.records.stop_reason`'s verdict.
"""

import asyncio
import json
import logging
import time
from dataclasses import dataclass, field
from typing import Callable, List, Optional, Sequence

from openrlhf_search.env.config import SearchConfig
from openrlhf_search.evaluation.loaders import QAExample
from openrlhf_search.evaluation.records import question_record, stop_reason
from openrlhf_search.evaluation.summary import score_prediction

logger = logging.getLogger(__name__)

ROW_FIELDS = ("id", "data_source", "sample", "question", "golds", "prediction", "trajectory", "queries", "searches",
              "turns", "stop_reason", "em", "f1", "cover_em", "reward", "response_tokens", "retrieval_failed",
              "error", "prompt") + ("type", "hops", "answer_words", "retrieved_ids", "supporting_ids",
                                    "support_retrieved", "answer_passage_retrieved", "gold_in_retrieved",
                                    "gold_in_answer", "form")
RECORD_FIELDS = ROW_FIELDS[-10:]  # taken from openrlhf_search.evaluation.records.question_record


def _default_search() -> SearchConfig:
    return SearchConfig()


@dataclass
class EvalSettings:
    """What to evaluate and how: the search settings (one :class:`~openrlhf_search.env.config.SearchConfig`, the
    same object training runs with) and the evaluation's own.

    Attributes:
        search: protocol, retriever URLs, top-k, turns, tokens per turn, documents cap and cut, query cleaning,
            passage format, chat template, reward scheme...: every search setting, defaults from SearchConfig
            (``cli.eval`` starts from the paper's eval setting, ``evaluation.settings``).
        model: model folder or hub name (what :func:`run_eval_sync` builds the vLLM engine from).
        max_length: tokens of prompt + whole trajectory; None: the engine's context length (:func:`context_length`;
            R1-Searcher's released eval has no other limit).
        engine_special_tokens: prompts carry, as text, the special tokens the released engine added to its text
            prompts (``protocol.engine_prompt``: ``<|begin_of_text|>`` for Llama-3 in R1-Searcher's eval).
        temperature: 0 = greedy (the papers' eval).
        n_samples: rollouts per question (1 for eval; N for difficulty bucketing).
        template: the protocol's prompt variant ("train"; R1-Searcher also "eval", its released eval prompt).
        top_p: nucleus sampling of each turn (no effect when greedy).
        concurrency: rollouts in flight.
        seed: sampling / init seed.
        tokenizer: tokenizer path overriding the model's.
        gpu_memory_utilization, tensor_parallel_size: vLLM settings.
    """

    search: SearchConfig = field(default_factory=_default_search)
    model: str = ""
    max_length: Optional[int] = 4096
    temperature: float = 0.0
    n_samples: int = 1
    concurrency: int = 64
    seed: int = 0
    tokenizer: Optional[str] = None
    gpu_memory_utilization: float = 0.85
    tensor_parallel_size: int = 1
    template: str = "train"
    top_p: float = 1.0
    engine_special_tokens: bool = False

    @property
    def protocol(self) -> str:
        """``search.protocol``."""
        return self.search.protocol

    def check_template(self) -> None:
        """Raises ValueError when the protocol has no such prompt template, or asks for chat with one that is plain
        text by definition (R1-Searcher's eval prompt)."""
        from openrlhf_search.env.protocol import get_protocol

        protocol = get_protocol(self.protocol)
        protocol._check_template(self.template)
        if self.template == "eval" and self.search.chat_template and self.protocol == "r1searcher":
            raise ValueError("protocol r1searcher: the released eval prompt (base_prompt_v0) is plain text for every "
                             "model; drop --chat_template or use --template train")

    def resolved_chat(self, tokenizer) -> bool:
        """Whether prompts get the chat template with this (the policy's) tokenizer. Raises ValueError as
        ``Protocol.resolve_chat``."""
        from openrlhf_search.env.protocol import get_protocol

        return get_protocol(self.protocol).resolve_chat(self.search.chat_template, tokenizer)

    def render_prompt(self, question: str, tokenizer) -> str:
        """The prompt of one question, rendered with the policy's tokenizer (``Protocol.build_prompt``), with the
        engine's special tokens in front when ``engine_special_tokens`` (``protocol.engine_prompt``).

        Raises:
            ValueError: empty question, chat rendering without a tokenizer that has a chat template, bad template.
        """
        from openrlhf_search.env.protocol import engine_prompt, get_protocol

        prompt = get_protocol(self.protocol).build_prompt(question, tokenizer=tokenizer,
                                                          chat=self.search.chat_template, template=self.template)
        return engine_prompt(prompt, tokenizer) if self.engine_special_tokens else prompt

    def sampling_params(self, protocol):
        """vLLM ``SamplingParams`` of one turn: stop at the end-of-query / end-of-answer tags, keep the tag."""
        from vllm import SamplingParams

        return SamplingParams(temperature=self.temperature, top_p=self.top_p,
                              max_tokens=self.search.max_new_tokens_per_turn, stop=list(protocol.stop_strings),
                              include_stop_str_in_output=True, seed=self.seed if self.temperature > 0 else None)


def protocol_reward_scheme(protocol: str) -> str:
    """The reward an eval logs for a protocol's rollouts: the paper's training reward (Search-R1's EM for searchr1 and
    the chat_tools protocols, R1-Searcher's stage 2 otherwise); ``cli.eval`` and ``cli.prepare_data`` pass it as
    ``SearchConfig.reward_scheme`` when none is given."""
    return "searchr1_em" if protocol == "searchr1" or protocol.startswith("chat_tools") else "r1searcher_stage2"


def context_length(engine, tokenizer=None) -> int:
    """The context length (tokens) an engine serves: ``max_model_len`` of the CPU engine, of vLLM's model config, or
    the tokenizer's ``model_max_length``. The trajectory budget when no ``max_length`` is given.

    Raises:
        ValueError: none of them is known (give ``--max_length``).
    """
    candidates = [getattr(engine, "max_model_len", None)]
    for owner in (getattr(engine, "llm", None), engine):
        cfg = getattr(owner, "model_config", None)
        candidates.append(getattr(cfg, "max_model_len", None))
    candidates.append(getattr(tokenizer, "model_max_length", None))
    for value in candidates:
        if isinstance(value, int) and not isinstance(value, bool) and 0 < value < 10 ** 8:
            return value
    raise ValueError("the engine's context length is unknown: give --max_length")


def _num(x, default=0.0) -> float:
    try:
        return float(x.item() if hasattr(x, "item") else x)
    except (TypeError, ValueError):
        return default


def build_row(example: QAExample, sample: int, out: Optional[dict], protocol, tokenizer, max_turns: int,
              error: Optional[str] = None, prompt: str = "") -> dict:
    """One output row from an executor result (``out``) or an error; every ``ROW_FIELDS`` key is present."""
    row = {"id": example.id, "data_source": example.data_source, "sample": sample, "question": example.question,
           "golds": list(example.golds), "prompt": prompt}
    source = {**example.extra, "id": example.id, "question": example.question, "golden_answers": list(example.golds)}
    if out is None:
        row.update({"prediction": "", "trajectory": "", "queries": [], "searches": 0, "turns": 0,
                    "stop_reason": "error", "reward": 0.0, "response_tokens": 0, "retrieval_failed": False,
                    "error": error or "unknown error"})
        row.update(score_prediction("", example.golds))
        record = question_record(source, {}, protocol, max_turns)
        row.update({k: record[k] for k in RECORD_FIELDS})
        return row
    text = out.get("response_text")
    if text is None:  # executor without response_text: decode everything after the prompt
        tokens = out.get("observation_tokens") or []
        ranges = out.get("action_ranges") or []
        start = ranges[0][0] if ranges else len(tokens)
        text = tokenizer.decode(tokens[start:], skip_special_tokens=False)
    logs = out.get("extra_logs") or {}
    prediction = protocol.extract_answer(text).strip()
    queries = protocol.extract_queries(text)
    row.update({"prediction": prediction, "trajectory": text, "queries": queries,
                "searches": int(_num(logs.get("valid_searches", len(queries)))),
                "turns": int(_num(logs.get("turns", len(out.get("action_ranges") or [])))),
                "stop_reason": stop_reason(out, prediction, max_turns),
                "reward": _num(out.get("reward", 0.0)),
                "response_tokens": int(_num(logs.get("response_tokens", 0))),
                "retrieval_failed": _num(logs.get("retrieval_failed", 0)) > 0, "error": None})
    row.update(score_prediction(prediction, example.golds))
    record = question_record(source, dict(out, response_text=text), protocol, max_turns)
    row.update({k: record[k] for k in RECORD_FIELDS})
    return row


async def run_eval(examples: Sequence[QAExample], settings: EvalSettings, engine, tokenizer,
                   on_row: Optional[Callable[[dict], None]] = None, executor=None) -> List[dict]:
    """Roll out every (question, sample) concurrently and return rows in input order.

    Args:
        examples: questions.
        settings: ``EvalSettings``.
        engine: object with ``async generate(prompt_token_ids, sampling_params, multi_modal_data=None)``.
        tokenizer: HF tokenizer of the model.
        on_row: called with each row as soon as it is done (streaming to disk, progress).
        executor: a ready ``SearchAgentExecutor``; built from ``settings`` when None (and its retrieval client
            closed at the end).
    Returns:
        rows (``ROW_FIELDS``), ``len(examples) * settings.n_samples`` of them.
    Raises:
        RetrievalStopped: a web retriever said no question can be served (refused API key, budget spent).
    """
    from openrlhf_search.env.agent import SearchAgentExecutor
    from openrlhf_search.env.protocol import get_protocol
    from openrlhf_search.env.retrieval_client import RetrievalClient, RetrievalStopped

    cfg = settings.search
    protocol = get_protocol(cfg.protocol)
    client = None
    if executor is None:
        client = RetrievalClient.from_config(cfg)
        executor = SearchAgentExecutor(cfg, retrieval_client=client)
    params = settings.sampling_params(protocol)
    max_length = settings.max_length or context_length(engine, tokenizer)
    sem = asyncio.Semaphore(settings.concurrency)
    jobs = [(ex, s) for ex in examples for s in range(settings.n_samples)]
    # rendered up front: a rendering error (no policy tokenizer for a chat prompt) is raised once, before any rollout
    prompts = {id(ex): settings.render_prompt(ex.question, tokenizer) for ex in examples}

    async def one(ex: QAExample, s: int) -> dict:
        prompt = prompts[id(ex)]
        async with sem:
            try:
                out = await executor.execute(prompt=prompt, label=json.dumps(ex.golds), sampling_params=params.clone()
                                             if hasattr(params, "clone") else params,
                                             max_length=max_length, hf_tokenizer=tokenizer,
                                             llm_engine=engine)
                row = build_row(ex, s, out, protocol, tokenizer, cfg.max_turns, prompt=prompt)
            except RetrievalStopped:  # the web retriever cannot serve any question (refused key, budget spent)
                raise
            except Exception as e:  # one bad rollout must not end a multi-hour eval; the row says what happened
                logger.exception("rollout failed for question %s", ex.id)
                row = build_row(ex, s, None, protocol, tokenizer, cfg.max_turns, error=f"{type(e).__name__}: {e}",
                                prompt=prompt)
        if on_row is not None:
            on_row(row)
        return row

    t0 = time.time()
    try:
        rows = await asyncio.gather(*(one(ex, s) for ex, s in jobs))
    finally:
        if client is not None:
            await client.aclose()
    logger.info("%d rollouts in %.1f s", len(rows), time.time() - t0)
    return list(rows)


def run_eval_sync(examples: Sequence[QAExample], settings: EvalSettings, engine=None, tokenizer=None,
                  on_row: Optional[Callable[[dict], None]] = None) -> List[dict]:
    """``run_eval`` in a fresh event loop, building the vLLM engine from ``settings`` when not given (and shutting
    that one down afterwards)."""
    if engine is not None:
        return asyncio.run(run_eval(examples, settings, engine, tokenizer, on_row=on_row))
    from openrlhf_search.evaluation.engines import build_engine

    engine, tokenizer, _ = build_engine(settings.model, settings.tokenizer, settings.seed,
                                        settings.max_length, settings.tensor_parallel_size,
                                        settings.gpu_memory_utilization)
    try:
        return asyncio.run(run_eval(examples, settings, engine, tokenizer, on_row=on_row))
    finally:
        shutdown = getattr(engine, "shutdown", None)
        if callable(shutdown):
            shutdown()
