"""Scripted warm start: a few SFT steps on search trajectories of the protocol's shape.

A tiny random policy almost never writes a well-formed search call by itself, so RL would see no search at all.
Like the cold-start SFT of later search agents (and R1-Searcher's observation that stage 1 first has to teach the
format, arXiv 2503.05592 sec. 3.2), the default run first fits the policy to trajectories of the protocol's shape::

    prompt -> "<think>"-turn with a query -> documents block (real retriever) -> turn with the gold answer

and, for a multi-hop row under ``--warmstart.hop_searches chain``, a second search turn and documents block before the
answer turn (:func:`follow_up_query`: the asked attribute of the entity the first search found), as Search-R1's
multi-turn rollouts interleave search calls and retrieved blocks (arXiv 2503.09516 sec. 3.1), all
built token by token exactly as the executor builds rollouts (prompt, model turn, environment block and next model
turn tokenised separately and concatenated), with the loss on the model-turn (action) tokens only.

What goes into the answer block (``--warmstart.answers``): ``gold`` (the gold answer: the warm start then also
teaches the answers), ``self`` (the policy's own greedy reply to the question with the same retrieved passage in a
plain chat turn, :func:`self_answers`: the warm start teaches where to search and where the answer goes, no gold
answer is used, and how well the answer block is filled is left to RL), or ``none`` (the turn stops at the open tag).
"""

import asyncio
import re

from typing import Callable, List, Optional, Sequence

import torch
from tqdm.auto import tqdm

from openrlhf_search.cpu.main_job.experience import Trajectory, action_log_probs, collate, pad_trunk_states
from openrlhf_search.cpu.main_job.freeze import trunk_boundary, trunk_hidden
from openrlhf_search.cpu.main_job.optim import make_adamw
from openrlhf_search.types import Passage


# Function words dropped from scripted queries: a keyword query retrieves the same passages with fewer tokens for a
# tiny policy to copy (and fits one model turn even for long 2-hop questions).
_QUERY_STOPWORDS = frozenset({"what", "which", "who", "is", "are", "the", "of", "in", "a", "an", "that", "and", "by"})


def scripted_query(question: str) -> str:
    """The query a scripted trajectory issues: the question's keywords in order (function words and the final
    punctuation dropped), e.g. "What is the capital of France?" -> "capital France".

    Falls back to the whole question (without final punctuation) when nothing but function words is left.
    """
    q = question.strip().rstrip("?.! ").strip()
    kept = [w for w in q.split() if w.lower() not in _QUERY_STOPWORDS]
    return " ".join(kept) if kept else q


# Title prefixes of section passages: "Economy of Turkmenistan" is about Turkmenistan.
_SECTION_PREFIX = re.compile(r"^(?:Economy|Geography|History|Politics|Culture|Demographics|Government) of ", re.I)


def passage_entity(passage: Passage) -> str:
    """The entity a passage is about: its title without a section prefix ("Economy of Turkmenistan" ->
    "Turkmenistan"; a Wikipedia title is returned as is). Empty when the passage has no title."""
    return _SECTION_PREFIX.sub("", (passage.title or "").strip()).strip()


def follow_up_query(question: str, queries: Sequence[str], passages: Sequence[Passage]) -> Optional[str]:
    """The next query of a chained scripted trajectory for a multi-hop question (``--warmstart.hop_searches chain``),
    from what the searches so far returned, or None when the chain ends. Rules, in order:

    1. the last query named something the question does not (an attribute query of rule 3, below), or nothing usable
       came back (no passage, a passage without a title): the chain ends;
    2. the top passage is about an entity the question names (:func:`passage_entity`; "capital country borders
       Croatia uses currency BAM" retrieves "Croatia"): search again with the last query's other words, i.e. for the
       question's other anchor ("capital country borders uses currency BAM"), when words are left and the query is
       new;
    3. the top passage is about an entity the question does not name (the bridge): search for the asked attribute
       (the first keyword of :func:`scripted_query`) of it, e.g. "What currency is used in the country whose capital
       is Ashgabat?" with a top passage titled "Turkmenistan" -> "currency Turkmenistan"; its passage is the one the
       answer is read from.

    The bridge entity is read from what the searches returned, not from the row's gold supporting passages: when a
    search misses, the chain follows the wrong entity, as a searching policy would (the warm start teaches the
    multi-search protocol, Search-R1's "search as many times as you want", not the answers).

    Args:
        queries: the chain's queries so far (at least the first, :func:`scripted_query`).
        passages: what the last of them retrieved, best first.
    Raises:
        ValueError: ``queries`` is empty.
    """
    if not queries:
        raise ValueError("follow_up_query: no query yet (the chain starts with scripted_query(question))")
    asked_words = {_bare(w) for w in question.split()}
    if len(queries) > 1 and any(_bare(w) not in asked_words for w in queries[-1].split()):
        return None  # rule 1: the attribute query was the last search
    entity = passage_entity(passages[0]) if passages else ""
    if not entity:
        return None
    if entity.lower() in question.lower():  # rule 2: the question's own anchor; search for the other one
        dropped = {_bare(w) for w in entity.split()}
        rest = " ".join(w for w in queries[-1].split() if _bare(w) not in dropped)
        return rest if rest and rest not in queries else None
    return f"{scripted_query(question).split()[0]} {entity}"  # rule 3


def follow_up_turn(query: str, protocol, opened: bool) -> str:
    """A model turn that searches again (between two documents blocks of a chained scripted trajectory), in the
    protocol's tags; ``opened``: the prompt ends with an open reasoning tag (R1-Searcher's base prompt)."""
    p = protocol
    if opened:
        return f" I need to search again. {p.query_open} {query} {p.query_close}"
    return f"{p.think_open} I need to search again. {p.think_close}\n{p.query_open} {query} {p.query_close}"


def scripted_turns(prompt: str, question: str, answer: Optional[str], protocol,
                   reasoning: Optional[str] = None) -> tuple:
    """The two model turns of a scripted trajectory, in the protocol's tags.

    Args:
        answer: the answer written in the answer block; None to stop the second turn right after the answer's
            open tag (``--warmstart.answers none``: the warm start then teaches the protocol, not the answers, and what
            goes into the answer block is left to the model and to RL).
        reasoning: text of a reasoning block written before the answer block of the second turn
            (``--warmstart.self_form think_span``: the model's own sentence, then its answer span); None: none.
    Returns:
        (turn with the search call, turn with the answer); the environment's documents block goes between them.
    """
    p = protocol
    opened = prompt.rstrip().endswith(p.think_open)  # R1-Searcher's base prompt ends with "<think>"
    query = scripted_query(question)
    if opened:
        first = f" I need to search. {p.query_open} {query} {p.query_close}"
        second = f"I found it. {p.think_close}\n\n{p.answer_open} {answer} {p.answer_close}"
    else:
        first = f"{p.think_open} I need to search. {p.think_close}\n{p.query_open} {query} {p.query_close}"
        second = f"{p.think_open} I found it. {p.think_close}\n{p.answer_open} {answer} {p.answer_close}"
    if not opened:
        # The answer turn starts with its answer block: a fixed phrase just before the block ("<think> I found it.
        # </think>") is what a pretrained model then copied into it (SmolLM2 answered "I found it." after SFT). The
        # search turn's think block already satisfies the format rule (an answer after the last </think>).
        second = f"{p.answer_open} {answer} {p.answer_close}"
    if answer is None:  # the protocol only: the turn stops at the answer's open tag
        second = f"I found it. {p.think_close}\n\n{p.answer_open}" if opened else p.answer_open
    elif reasoning is not None:  # the reply's own sentence as the reasoning, its answer span in the answer block
        second = (f"{reasoning} {p.think_close}\n\n" if opened else f"{p.think_open} {reasoning} {p.think_close}\n") \
            + f"{p.answer_open} {answer} {p.answer_close}"
    return first, second


# The plain chat turn of a self answer: the retrieved passage, the question, and the same "short answer" request as the
# protocol's instruction. No gold answer, no tags: what the model writes is its own answering style.
SELF_ANSWER_TEMPLATE = "{passage}\n\nQuestion: {question}\nAnswer in a few words."
# Requests a self answer can end with (``--warmstart.self_prompt``): "few_words" (the template above, the default) or
# "bare" (only the name or code as the text writes it). SmolLM2-135M-Instruct answers both with a sentence, but the
# sentence holds the answer more often after "bare" (docs/trials_em.md).
SELF_ANSWER_PROMPTS = {
    "few_words": SELF_ANSWER_TEMPLATE,
    "bare": "{passage}\n\nQuestion: {question}\n"
            "Reply with just the answer (a name or code from the text), nothing else.",
}
# What of a self answer the scripted answer turn holds (``--warmstart.self_form``, :func:`answer_blocks`): "sentence"
# (its first sentence in the answer block, the default), "span" (that sentence without the words it repeats from the
# question, :func:`answer_span`), or "think_span" (the sentence in a reasoning block, then the span in the answer
# block).
SELF_ANSWER_FORMS = ("sentence", "span", "think_span")

# Words a reply uses to restate a question around its answer ("The capital of X is Z."): dropped by answer_span.
_RESTATEMENT_WORDS = _QUERY_STOPWORDS | {"was", "were", "be", "called", "named", "its", "it", "this", "for", "to",
                                         "country", "city", "one", "you"}


def _bare(word: str) -> str:
    return re.sub(r"[^\w'-]", "", word).lower()


def answer_span(reply: str, question: str) -> str:
    """The words of ``reply`` that do not restate ``question``: the reply's own answer phrase, without gold or
    passage, e.g. ("The capital of Tonga is Nuku'alofa.", "What is the capital of Tonga?") -> "Nuku'alofa" and
    ("Asmara is the capital of Eritrea.", same kind of question) -> "Asmara".

    A word is dropped when, lower-cased and without punctuation, it is a word of the question or a restating function
    word (articles, copulas, "of", "in", ...); the kept words stay in order with their own spelling, commas and
    parentheses, and the final punctuation is removed. A reply made only of such words is returned unchanged (minus the
    final punctuation), so that an answer block is never empty.
    """
    asked = {_bare(w) for w in question.split()} | _RESTATEMENT_WORDS
    words = reply.strip().split()
    kept = [w for w in words if _bare(w) and _bare(w) not in asked]
    out = " ".join(kept) if kept else reply.strip()
    return out.rstrip(".!?;:, ").lstrip(",;: ").strip() or reply.strip()


def first_sentence(text: str, max_chars: int = 120) -> str:
    """The first sentence (or line) of ``text``, stripped and cut to ``max_chars`` at a word boundary: what a self
    answer keeps, so that the answer block closes within one model turn.

    A sentence ends at ".", "!" or "?" followed by a space, except after a short capitalised abbreviation ("St. Peter
    Port", "Mt. Everest"), e.g. "The capital is St. Peter Port. It is small." -> "The capital is St. Peter Port."
    """
    text = text.strip().split("\n")[0].strip()
    for m in re.finditer(r"[.!?](?=\s)", text):
        word = text[: m.start()].rsplit(" ", 1)[-1]
        if not (word[:1].isupper() and len(word) <= 3):
            text = text[: m.end()]
            break
    if len(text) > max_chars:
        text = text[:max_chars].rsplit(" ", 1)[0]
    return text.strip()


def answer_blocks(replies: Sequence[str], questions: Sequence[str], form: str = "sentence") -> List[tuple]:
    """(answer, reasoning) of each scripted answer turn, from the policy's own replies (:func:`self_answers`).

    ``form`` (``--warmstart.self_form``): "sentence" -> (reply, None); "span" -> (:func:`answer_span`, None);
    "think_span" -> (answer span, reply): the reply goes into a reasoning block before the answer block, so that the
    answer is the end of a sentence the model just wrote. No gold answer is read.

    Raises:
        ValueError: an unknown ``form``, or ``replies`` and ``questions`` differ in length.
    """
    if form not in SELF_ANSWER_FORMS:
        raise ValueError(f"self answers: unknown form {form!r}; known: {list(SELF_ANSWER_FORMS)}")
    if len(replies) != len(questions):
        raise ValueError(f"self answers: {len(replies)} replies but {len(questions)} questions")
    if form == "sentence":
        return [(r, None) for r in replies]
    spans = [answer_span(r, q) for r, q in zip(replies, questions)]
    return [(s, r if form == "think_span" else None) for s, r in zip(spans, replies)]


def self_answers(engine, tokenizer, questions: Sequence[str], passages: Sequence[Sequence[Passage]],
                 max_tokens: int = 24, progress: bool = True, prompt: str = "few_words") -> List[str]:
    """The policy's own greedy answers, one per question, given the passages the scripted query retrieved.

    Each prompt is one user turn of the tokenizer's chat template with ``SELF_ANSWER_PROMPTS[prompt]`` (passage
    texts joined by blank lines); decoding is greedy with ``max_tokens`` new tokens; the reply is cut to its first
    sentence (:func:`first_sentence`). No gold answer is read. An empty reply becomes "unknown" so that every answer
    block has content. :func:`answer_blocks` turns the replies into what the answer turns hold.

    Args:
        engine: an :class:`~openrlhf_search.cpu.main_job.engine.HFEngine` over the policy (vLLM ``generate`` contract).
        questions, passages: one list of passages per question (same length).
        prompt: a key of :data:`SELF_ANSWER_PROMPTS`.
    Returns:
        answers, one string per question.
    Raises:
        ValueError: ``questions`` and ``passages`` differ in length, or an unknown ``prompt``.
    """
    from vllm import SamplingParams

    if len(questions) != len(passages):
        raise ValueError(f"self_answers: {len(questions)} questions but {len(passages)} passage lists")
    if prompt not in SELF_ANSWER_PROMPTS:
        raise ValueError(f"self_answers: unknown prompt {prompt!r}; known: {sorted(SELF_ANSWER_PROMPTS)}")
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens)
    prompts = []
    for q, ps in zip(questions, passages):
        user = SELF_ANSWER_PROMPTS[prompt].format(passage="\n\n".join(p.text for p in ps), question=q)
        text = tokenizer.apply_chat_template([{"role": "user", "content": user}], tokenize=False,
                                             add_generation_prompt=True)
        prompts.append(tokenizer(text, add_special_tokens=False)["input_ids"])
    bar = tqdm(total=len(prompts), desc="warm start: self answers", unit="q", disable=not progress)

    async def one(ids):
        out = await engine.generate(ids, params)
        bar.update(1)
        return first_sentence(out.outputs[0].text) or "unknown"

    async def run_all():
        return await asyncio.gather(*(one(ids) for ids in prompts))

    try:
        return list(asyncio.new_event_loop().run_until_complete(run_all()))
    finally:
        bar.close()


def scripted_trajectory(prompt: str, question: str, answer: Optional[str], passages: Sequence[Passage], protocol,
                        tokenizer, max_obs_tokens: Optional[int] = None,
                        reasoning: Optional[str] = None,
                        follow_ups: Sequence[tuple] = ()) -> Trajectory:
    """Tokenise one scripted trajectory; ``action_ranges`` cover the model turns (2, or 2 + ``len(follow_ups)``).

    Args:
        prompt: the rendered prompt (``protocol.build_prompt``).
        passages: what the retriever returned for :func:`scripted_query`.
        max_obs_tokens: cap on each documents block's tokens (closing tag kept), as the executor does.
        reasoning: a reasoning block before the answer (:func:`scripted_turns`).
        follow_ups: ``(query, passages)`` of each further search, in order, between the first documents block and
            the answer turn (:func:`follow_up_query`, :func:`follow_up_turn`): a chained multi-hop trajectory.
    Returns:
        a :class:`Trajectory`: prompt + search turn + documents + (search turn + documents) * len(follow_ups) +
        answer turn, the environment's tokens outside ``action_ranges``.
    """
    first, last = scripted_turns(prompt, question, answer, protocol, reasoning=reasoning)
    opened = prompt.rstrip().endswith(protocol.think_open)
    enc = lambda s: tokenizer(s, add_special_tokens=False)["input_ids"]

    def docs_ids(ps):
        ids = enc(protocol.render_documents(list(ps)))
        if max_obs_tokens is not None and len(ids) > max_obs_tokens:
            close = enc(protocol.doc_close)
            ids = ids[: max(0, max_obs_tokens - len(close))] + close
        return ids

    tokens = enc(prompt)
    ranges = []
    turns = [(first, passages)] + [(follow_up_turn(q, protocol, opened), ps) for q, ps in follow_ups]
    for text, ps in turns:
        a = enc(text)
        ranges.append((len(tokens), len(tokens) + len(a)))
        tokens = tokens + a + docs_ids(ps)
    a = enc(last)
    ranges.append((len(tokens), len(tokens) + len(a)))
    return Trajectory(tokens=tokens + a, action_ranges=ranges, reward=0.0, group=0)


def sft_warmstart(model, trajectories: List[Trajectory], pad_id: int, steps: int, lr: float, batch_size: int,
                  seed: int = 0, log: Optional[Callable[[dict], None]] = None, progress: bool = True) -> List[float]:
    """Fit ``model`` to ``trajectories`` with AdamW for ``steps`` steps (negative log-likelihood on action tokens),
    the learning rate decaying linearly from ``lr`` to ``lr / 10``.

    Args:
        model: the policy (trained in place).
        trajectories: from :func:`scripted_trajectory`.
        steps, lr, batch_size: optimiser settings; batches cycle over a seeded permutation.
        log: called with {"sft_step", "sft_loss"} after each step.
        progress: show a tqdm bar with the ETA and the current loss (stderr).
    Returns:
        the loss of every step (nats per action token).
    Raises:
        ValueError: no trajectories, or a non-finite loss (the warm start would poison RL).
    """
    if not trajectories:
        raise ValueError("warm start: no trajectories")
    device = next(model.parameters()).device  # batches and cached trunk states live with the model
    # With a frozen trunk (--actor.trainable_layers K) its hidden states are computed once per trajectory, and every
    # SFT step then runs only the top K layers: many more steps for the same CPU time.
    trunks = None
    if trunk_boundary(model) > 0:
        trunks = []
        bar = tqdm(total=len(trajectories), desc="warm start: frozen-trunk states", unit="traj",
                   disable=not progress)
        for i in range(0, len(trajectories), 8):
            part = trajectories[i: i + 8]
            b = collate(part, pad_id, device=device)
            h = trunk_hidden(model, b.input_ids, b.attention_mask)
            trunks += [h[j, : len(t.tokens)] for j, t in enumerate(part)]
            bar.update(len(part))
        bar.close()
    params = [p for p in model.parameters() if p.requires_grad]  # --actor.trainable_layers may freeze the rest
    opt = make_adamw(params, lr=lr, weight_decay=0.0)
    # Linear decay to 10% of lr: the last steps consolidate instead of bouncing at the peak rate.
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda i: 1.0 - 0.9 * min(i, steps) / max(steps, 1))
    gen = torch.Generator().manual_seed(seed)
    order = torch.randperm(len(trajectories), generator=gen).tolist()
    model.train()
    losses, cursor = [], 0
    bar = tqdm(range(steps), desc="warm start (SFT)", unit="step", disable=not progress)
    for step in bar:
        picked = []
        for _ in range(min(batch_size, len(trajectories))):
            if cursor >= len(order):
                order, cursor = torch.randperm(len(trajectories), generator=gen).tolist(), 0
            picked.append(order[cursor])
            cursor += 1
        batch = collate([trajectories[i] for i in picked], pad_id, device=device)
        trunk = None
        if trunks is not None:
            trunk = pad_trunk_states([trunks[i] for i in picked], batch.input_ids.shape[1], device=device)
        lp, _ = action_log_probs(model, batch, trunk=trunk)
        loss = -(lp * batch.action_mask).sum() / batch.action_mask.sum().clamp(min=1)
        if not torch.isfinite(loss):
            raise ValueError(f"warm start: non-finite loss at step {step}")
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(params, 1.0)
        opt.step()
        sched.step()
        losses.append(float(loss.detach()))
        bar.set_postfix(loss=f"{losses[-1]:.3f}")
        if log is not None:
            log({"sft_step": step + 1, "sft_loss": losses[-1]})
    model.eval()
    return losses
