"""Scripted search trajectories for the warm start that precedes RL in the CPU main job.

Raw SmolLM2-135M-Instruct never writes a search call under the search prompt (reward 0 on every RL step), so the
job first fine-tunes it (``python -m openrlhf_search.cli.sft``: OpenRLHF's SFT trainer, loss on the policy's tokens
only) on trajectories of the protocol's shape, as the cold-start SFT of later search agents does::

    prompt -> model turn with a keyword query -> documents block (the real retriever's top passage)
           -> model turn: <think> the policy's own sentence </think> <answer> its answer span </answer>

No gold answer is read (:func:`self_answers`): the answer turn holds the policy's own greedy reply to the question and
the same passage in a plain chat turn ("The capital of Tonga is Nuku'alofa."), in a reasoning block, then the words of
that sentence that do not restate the question (:func:`answer_span`: "Nuku'alofa"). The warm start therefore teaches
where to search and where the answer goes; how exact the answer is, is left to RL.

Trajectories are tokenised piece by piece exactly as the executor builds a rollout (:func:`scripted_trajectory`:
the prompt, each model turn and each documents block, the latter from
:meth:`~openrlhf_search.env.agent.SearchAgentExecutor.observation_tokens` with the run's ``--search.max_obs_tokens``).
"""

import asyncio
import os
import re
from typing import List, Optional, Sequence, Tuple

from tqdm.auto import tqdm

from openrlhf_search.env.types import Passage

# Function words dropped from scripted queries: a keyword query retrieves the same passages with fewer tokens.
_QUERY_STOPWORDS = frozenset({"what", "which", "who", "is", "are", "the", "of", "in", "a", "an", "that", "and", "by"})
# Words a reply uses to restate a question around its answer ("The capital of X is Z."): dropped by answer_span.
_RESTATEMENT_WORDS = _QUERY_STOPWORDS | {"was", "were", "be", "called", "named", "its", "it", "this", "for", "to",
                                         "country", "city", "one", "you"}
# The plain chat turn of a self answer: the retrieved passage, the question and a request for the bare answer. No gold
# answer, no tags: what the model writes is its own answering style.
SELF_ANSWER_PROMPT = ("{passage}\n\nQuestion: {question}\n"
                      "Reply with just the answer (a name or code from the text), nothing else.")


def scripted_query(question: str) -> str:
    """The query a scripted trajectory issues: the question's keywords in order (function words and the final
    punctuation dropped), e.g. "What is the capital of France?" -> "capital France"; the whole question when only
    function words are left."""
    q = question.strip().rstrip("?.! ").strip()
    kept = [w for w in q.split() if w.lower() not in _QUERY_STOPWORDS]
    return " ".join(kept) if kept else q


def _bare(word: str) -> str:
    return re.sub(r"[^\w'-]", "", word).lower()


def answer_span(reply: str, question: str) -> str:
    """The words of ``reply`` that do not restate ``question``: ("The capital of Tonga is Nuku'alofa.", "What is the
    capital of Tonga?") -> "Nuku'alofa". A word is dropped when, lower-cased and without punctuation, it is a word of
    the question or a restating function word; kept words keep their spelling; the final punctuation goes. A reply
    made only of such words is returned unchanged (minus the final punctuation): an answer block is never empty."""
    asked = {_bare(w) for w in question.split()} | _RESTATEMENT_WORDS
    kept = [w for w in reply.strip().split() if _bare(w) and _bare(w) not in asked]
    out = " ".join(kept) if kept else reply.strip()
    return out.rstrip(".!?;:, ").lstrip(",;: ").strip() or reply.strip()


def first_sentence(text: str, max_chars: int = 120) -> str:
    """The first sentence (or line) of ``text``, cut to ``max_chars`` at a word boundary. A sentence ends at ".",
    "!" or "?" before a space, except after a short capitalised abbreviation ("St. Peter Port")."""
    text = text.strip().split("\n")[0].strip()
    for m in re.finditer(r"[.!?](?=\s)", text):
        word = text[: m.start()].rsplit(" ", 1)[-1]
        if not (word[:1].isupper() and len(word) <= 3):
            text = text[: m.end()]
            break
    if len(text) > max_chars:
        text = text[:max_chars].rsplit(" ", 1)[0]
    return text.strip()


def scripted_turns(prompt: str, question: str, answer: str, reasoning: str, protocol) -> Tuple[str, str]:
    """The two model turns of a scripted trajectory in the protocol's tags: (search turn, answer turn); the
    documents block goes between them. ``reasoning`` is the sentence written in the answer turn's reasoning block.
    A prompt that already opens the reasoning block (R1-Searcher's base prompt) is continued, not reopened."""
    p = protocol
    query = scripted_query(question)
    if prompt.rstrip().endswith(p.think_open):
        return (f" I need to search. {p.query_open} {query} {p.query_close}",
                f"{reasoning} {p.think_close}\n\n{p.answer_open} {answer} {p.answer_close}")
    return (f"{p.think_open} I need to search. {p.think_close}\n{p.query_open} {query} {p.query_close}",
            f"{p.think_open} {reasoning} {p.think_close}\n{p.answer_open} {answer} {p.answer_close}")


def self_answers(engine, tokenizer, questions: Sequence[str], passages: Sequence[Sequence[Passage]],
                 max_tokens: int = 24, progress: bool = True) -> List[str]:
    """The policy's own greedy replies, one per question, given the passages its scripted query retrieved: one user
    turn of the tokenizer's chat template with :data:`SELF_ANSWER_PROMPT`, cut to the first sentence; an empty reply
    becomes "unknown".

    Args:
        engine: anything with vLLM's ``async generate(prompt_token_ids, sampling_params)`` (the CPU job passes
            :class:`~openrlhf_search.evaluation.engines.VLLMInProcessEngine`).
    Raises:
        ValueError: ``questions`` and ``passages`` differ in length.
    """
    from vllm import SamplingParams

    if len(questions) != len(passages):
        raise ValueError(f"self_answers: {len(questions)} questions but {len(passages)} passage lists")
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens)
    prompts = []
    for q, ps in zip(questions, passages):
        user = SELF_ANSWER_PROMPT.format(passage="\n\n".join(p.text for p in ps), question=q)
        text = tokenizer.apply_chat_template([{"role": "user", "content": user}], tokenize=False,
                                             add_generation_prompt=True)
        prompts.append(tokenizer(text, add_special_tokens=False)["input_ids"])
    bar = tqdm(total=len(prompts), desc="warm start: the policy's own answers", unit="q", disable=not progress)

    async def one(ids):
        out = await engine.generate(ids, params)
        bar.update(1)
        return first_sentence(out.outputs[0].text) or "unknown"

    async def run_all():
        return await asyncio.gather(*(one(ids) for ids in prompts))

    try:
        return list(asyncio.run(run_all()))
    finally:
        bar.close()


def scripted_trajectory(prompt: str, turns: Sequence[Tuple[str, Optional[Sequence[Passage]]]], executor,
                        tokenizer) -> dict:
    """One trajectory tokenised as the executor builds rollouts: the prompt, then per turn the model's text and,
    when it searched, the documents block (``executor.observation_tokens``, the run's cap and cut).

    Args:
        turns: ``(model text, passages or None)`` in order; None: no documents block after that turn.
    Returns:
        ``{"input_ids", "action_ranges"}`` (:mod:`openrlhf_search.rl.sft`'s row): spans of the model turns.
    """
    tokens = executor._encode(tokenizer, prompt)
    ranges = []
    for text, passages in turns:
        ids = executor._encode(tokenizer, text)
        ranges.append([len(tokens), len(tokens) + len(ids)])
        tokens = tokens + ids
        if passages is not None:
            tokens = tokens + executor.observation_tokens(list(passages), tokenizer)
    return {"input_ids": tokens, "action_ranges": ranges}


def build_trajectories(rows: Sequence[dict], model: str, cfg, max_length: int, seed: int = 0,
                       dtype: str = "float32") -> Tuple[List[dict], List[dict]]:
    """The warm start's trajectories for ``rows`` (QA rows: ``question``, ``golden_answers``): scripted queries
    against the retriever, the policy's own answers on vLLM-CPU (``dtype``), tokenised as rollouts of ``cfg`` (a
    SearchConfig: protocol, retriever, top-k, documents cap).

    Returns:
        (trajectory rows for :mod:`openrlhf_search.rl.sft`, one record per row of what its turns were taught:
        question, query, passage ids, taught reasoning and answer, gold, for the run's folder).
    Raises:
        RetrievalError: the retriever is down past the client's retries.
    """
    from cpu_demo.evaluate import load_engine
    from openrlhf_search.env.agent import SearchAgentExecutor
    from openrlhf_search.env.protocol import get_protocol
    from openrlhf_search.env.retrieval_client import RetrievalClient

    protocol = get_protocol(cfg.protocol)
    queries = [scripted_query(r["question"]) for r in rows]

    async def search_all():
        client = RetrievalClient.from_config(cfg)
        try:
            return await client.search_batch(queries, topk=cfg.topk)
        finally:
            await client.aclose()

    passages = asyncio.run(search_all())
    engine, tokenizer = load_engine(model, max_length, seed, dtype)
    try:
        replies = self_answers(engine, tokenizer, [r["question"] for r in rows], passages)
    finally:
        engine.shutdown()
    executor = SearchAgentExecutor(cfg, retrieval_client=object())  # tokenisation only: no search is made
    trajectories, taught = [], []
    for row, query, found, reply in zip(rows, queries, passages, replies):
        prompt = protocol.build_prompt(row["question"], tokenizer=tokenizer, chat=True)
        span = answer_span(reply, row["question"])
        search_turn, answer_turn = scripted_turns(prompt, row["question"], span, reply, protocol)
        trajectories.append(scripted_trajectory(prompt, [(search_turn, found), (answer_turn, None)], executor,
                                                tokenizer))
        taught.append({"question": row["question"], "query": query, "passage_ids": [p.id for p in found],
                       "taught_reasoning": reply, "taught_answer": span, "gold": row["golden_answers"]})
    return trajectories, taught


def main(argv=None) -> int:
    import argparse
    import json
    import random
    import sys

    from cpu_demo.data.qa import load_qa_jsonl
    from openrlhf_search.rl.sft import write_trajectories

    p = argparse.ArgumentParser(prog="python -m cpu_demo.warmstart",
                                description="Write the warm start's scripted trajectories (cli.sft's input).")
    p.add_argument("--model", required=True, help="the policy before the warm start (HF folder)")
    p.add_argument("--questions", required=True, help="training QA jsonl")
    p.add_argument("--search_config", required=True, help="JSON file of SearchConfig fields (protocol, retriever)")
    p.add_argument("--num_examples", type=int, default=48, help="questions drawn from --questions")
    p.add_argument("--seed", type=int, default=42, help="which questions are drawn")
    p.add_argument("--max_length", type=int, default=512)
    p.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"], help="vLLM dtype of the policy")
    p.add_argument("--out", required=True, help="trajectories jsonl")
    p.add_argument("--taught", required=True, help="jsonl: what each trajectory taught")
    a = p.parse_args(argv)
    rows = load_qa_jsonl(a.questions)
    rows = random.Random(a.seed).sample(rows, min(a.num_examples, len(rows)))
    from openrlhf_search.env.config import SearchConfig

    trajectories, taught = build_trajectories(rows, a.model, SearchConfig.from_file(a.search_config), a.max_length,
                                              seed=a.seed, dtype=a.dtype)
    n = write_trajectories(a.out + ".tmp", trajectories)
    os.replace(a.out + ".tmp", a.out)
    with open(a.taught, "w", encoding="utf-8") as f:
        for t in taught:
            f.write(json.dumps(t, ensure_ascii=False) + "\n")
    print(f"[warm start] {n} trajectories -> {a.out}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    import sys

    sys.exit(main())
