"""Outcome rewards of R1-Searcher and Search-R1, the format checks they rely on, and a registry (pure functions).

Every scheme has the signature ``scheme(response_text, golds, protocol, **kw) -> RewardResult`` where
``response_text`` is everything after the prompt (model turns and environment blocks, as decoded) and ``golds`` the
gold answers. ``RewardResult.components`` always carries the answer metrics (``em``, ``f1``, ``cover_em``), the
format verdict (``format_ok``), ``answer_present``, ``valid_searches`` and ``score`` (the answer correctness in
[0, 1] that OpenRLHF's dynamic filtering reads), so that one logging path serves every scheme.

Schemes (``REWARD_SCHEMES``):

====================================  ===============================================================================
``r1searcher_stage1``                 arXiv 2503.05592 sec. 3.2 (stage 1): 0.5 retrieval + 0.5 format, no answer term
``r1searcher_stage2``                 arXiv 2503.05592 sec. 3.2 (stage 2): F1 + (0 | -2 format penalty)
``r1searcher_released_stage1``        released ``train/reward_server_llama_stage1.py``: +-1 Cover-EM + 0.5 + 0.5
``r1searcher_released_stage2``        released ``train/reward_server_qwen_zero.py``: F1 + (0 | -2)
``r1searcher_released_llama_stage1``  the same server as ``r1searcher_released_stage1`` (end of this file)
``r1searcher_released_llama_stage2``  released ``train/reward_server_llama_stage2.py``: F1 + (0 | -1)
``searchr1_em``                       arXiv 2503.09516 sec. 3.4 eq. (4): EM of the extracted answer
``searchr1_format``                   arXiv 2505.15117 sec. 3 (format reward): EM + structure + retrieval terms
====================================  ===============================================================================
"""

from __future__ import annotations

import inspect
import re
from dataclasses import dataclass, field
from typing import Callable, Dict, List, Sequence, Tuple

from openrlhf_search.env.metrics import (
    cover_em,
    exact_match,
    f1_score,
    normalize_answer,
    parse_golds,
    r1searcher_normalize,
)
from openrlhf_search.env.paper_protocols import R1SearcherProtocol
from openrlhf_search.env.protocol import Protocol, get_protocol

__all__ = [
    "RewardResult",
    "REWARD_SCHEMES",
    "register_reward_scheme",
    "compute_reward",
    "check_format",
    "searchr1_valid_sequence",
    "strip_end_of_turn",
    "END_OF_TURN_MARKERS",
    "gold_in_documents",
    "GOLD_MATCHES",
]

# End-of-sequence strings a decoded response may end with (Qwen, Llama-3, Llama-2/Mistral). Not role leakage.
END_OF_TURN_MARKERS: Tuple[str, ...] = ("<|im_end|>", "<|endoftext|>", "<|eot_id|>", "<|end_of_text|>", "</s>")

_CJK = re.compile(r"[\u4e00-\u9fff]")


@dataclass
class RewardResult:
    """A scalar reward and the pieces it was made of.

    Attributes:
        reward: the scalar reward of the trajectory (one float per sample; OpenRLHF places it on the last token).
        components: named floats for logging: em, f1, cover_em, format_ok (1.0/0.0), answer_present,
            valid_searches (count), score (answer correctness in [0, 1]) and scheme-specific terms.
        format_reason: why the format check failed ("" when it passed); for logs, not a float.
    """

    reward: float
    components: Dict[str, float] = field(default_factory=dict)
    format_reason: str = ""

    @property
    def score(self) -> float:
        """Answer correctness in [0, 1] (dynamic-filtering score); falls back to the reward."""
        return float(self.components.get("score", self.reward))


def strip_end_of_turn(text: str, markers: Sequence[str] = END_OF_TURN_MARKERS) -> str:
    """Remove end-of-sequence / padding strings (and whitespace) from the end of a decoded response."""
    changed = True
    text = text.rstrip()
    while changed:
        changed = False
        for m in markers:
            if m and text.endswith(m):
                text = text[: -len(m)].rstrip()
                changed = True
    return text


# -------------------------------------------------------------------------------------------------- format checks
def _tag_sequence_ok(text: str, open_tag: str, close_tag: str, start_open: bool = False) -> Tuple[bool, bool]:
    """Whether open/close tags strictly alternate; returns (alternates, ends_closed)."""
    is_open = start_open
    pattern = re.compile(f"({re.escape(open_tag)}|{re.escape(close_tag)})")
    for m in pattern.finditer(text):
        if m.group(0) == open_tag:
            if is_open:
                return False, False
            is_open = True
        else:
            if not is_open:
                return False, False
            is_open = False
    return True, not is_open


def check_format(response_text: str, protocol, answer_max_words: int = 10) -> Tuple[bool, str]:
    """R1-Searcher's format rule (arXiv 2503.05592 sec. 3.2 "Format Reward"), any protocol; ``docs/design.md``,
    "Rewards".

    The format is correct when all of these hold (checked in this order; the first failure is the reason):

    1. no role marker (``protocol.role_markers``) in the text the model generated (not in retrieved documents);
    2. no invalid action (an environment message such as Search-R1's "My previous action is invalid");
    3. exactly one answer block, non-empty, with no protocol tag inside, at most ``answer_max_words`` words, and
       nothing but whitespace after it;
    4. query tags strictly alternate open/close and every query is non-empty;
    5. every documents block directly follows a query, one per query (the model wrote none itself);
    6. one reasoning block per reasoning phase, the answer after the last one (else a repeated ``</think> <think>
       again </think>`` would pass, the hole of huggingface/open-r1 #359): when the prompt opens the block
       (``protocol.prompt_opens_think``, R1-Searcher) the model writes no ``<think>`` and exactly one ``</think>``, as
       the released reward servers require (``reward_server_qwen_zero.py`` l. 219-224, ``reward_server_llama_stage2.py``
       l. 211-219, ``reward_server_llama_stage1.py`` l. 192-198); otherwise think tags alternate, at least one
       ``</think>``, and a block opens only at the start or after a documents block (Search-R1's ``is_valid_sequence``
       grammar, :func:`searchr1_valid_sequence`).

    Unlike the released servers, which only count tags, this rule also checks the order and looks for role markers
    in the model's own text only; it has no CJK rule. ``tests/test_released_rewards.py`` tabulates each structural
    case under every scheme.

    Args:
        response_text: everything after the prompt.
        protocol: a :class:`Protocol` or a registered name.
        answer_max_words: the answer-length cap (10 in R1-Searcher).

    Returns:
        (ok, reason): reason is "" when ok, otherwise a short description of the first failed rule.
    """
    proto = get_protocol(protocol)
    if getattr(proto, "native_tools", False):  # tool calls of the chat template: the protocol's own rule
        return proto.check_format(response_text, answer_max_words=answer_max_words)
    text = strip_end_of_turn(response_text or "")
    segments = proto.split_turns(text)
    model = "".join(s.text for s in segments if s.kind == "model")

    for marker in proto.role_markers:
        if marker in model:
            return False, f"role leakage: {marker!r}"
    doc_tag = proto.doc_open_tag
    if any(s.kind == "environment" and doc_tag not in s.text for s in segments):
        return False, "invalid action in trajectory"

    error, a_open, a_close = proto.answer_block(model)
    if error:
        return False, error
    answer = model[a_open + len(proto.answer_open):a_close]
    for tag in proto.all_tags:
        if tag and tag in answer:
            return False, f"tag inside the answer: {tag!r}"
    words = answer.split()
    if not words:
        return False, "empty answer"
    if len(words) > answer_max_words:
        return False, f"answer has {len(words)} words (> {answer_max_words})"
    if model[a_close + len(proto.answer_close):].strip():
        return False, "text after the answer"

    alternates, closed = _tag_sequence_ok(model, proto.query_open, proto.query_close)
    if not alternates or not closed:
        return False, "unbalanced query tags"
    n_queries = model.count(proto.query_open)
    if n_queries != len(proto.extract_queries(text)):
        return False, "empty query"
    for marker in (proto.doc_open_tag, proto.doc_close_tag):
        if marker in model:
            return False, f"documents tag written by the model: {marker!r}"
    n_docs = 0
    for i, seg in enumerate(segments):
        if seg.kind == "environment":
            n_docs += 1
            prev = segments[i - 1].text if i > 0 else ""
            if not prev.rstrip().endswith(proto.query_close):
                return False, "documents block not preceded by a query"
    if n_docs != n_queries:
        return False, f"{n_queries} queries but {n_docs} documents blocks"

    n_think_open, n_think_close = model.count(proto.think_open), model.count(proto.think_close)
    if proto.prompt_opens_think:
        if n_think_open:
            return False, f"{proto.think_open} written by the model: the prompt opened the one reasoning block"
        if n_think_close != 1:
            return False, ("reasoning block not closed" if n_think_close == 0
                           else f"{n_think_close} {proto.think_close} tags: expected one reasoning block")
    else:
        alternates, closed = _tag_sequence_ok(model, proto.think_open, proto.think_close)
        if not alternates:
            return False, "unbalanced think tags"
        if not closed:
            return False, "reasoning block not closed"
        if not n_think_close:
            return False, "no reasoning block"
        # a reasoning block opens at the start of a model segment (the response, or right after a documents block)
        for seg in segments:
            if seg.kind == "model" and seg.text.count(proto.think_open) > 1:
                return False, "repeated reasoning block without a retrieval in between"
            if seg.kind == "model" and proto.think_open in seg.text:
                before = seg.text[:seg.text.find(proto.think_open)]
                if proto.think_close in before or proto.answer_open in before:
                    return False, "repeated reasoning block without a retrieval in between"
    last_think_close = model.rfind(proto.think_close)
    if a_open < last_think_close:
        return False, "answer before the end of reasoning"
    return True, ""


def searchr1_valid_sequence(response_text: str, protocol="searchr1") -> Tuple[bool, str]:
    """Search-R1's structure check ``is_valid_sequence`` (arXiv 2505.15117 sec. 3; ``qa_em_format.py``).

    The response must be, with only whitespace outside tags:
    ``<think>..</think>`` then any number of ``<search>..</search><information>..</information><think>..</think>``
    then ``<answer>..</answer>``. Tag names come from ``protocol`` (think / query / documents / answer), so the
    rule also applies to other tag sets (a prompt that opens ``<think>`` starts inside the reasoning block). An
    invalid-action message in the trajectory makes it invalid.

    Returns:
        (valid, reason).
    """
    proto = get_protocol(protocol)
    if getattr(proto, "native_tools", False):  # the tool-call format rule is the sequence rule of these protocols
        return proto.check_format(response_text)
    text = strip_end_of_turn(response_text or "")
    doc_tag = proto.doc_open_tag
    if any(s.kind == "environment" and doc_tag not in s.text for s in proto.split_turns(text)):
        return False, "invalid action in trajectory"
    t_o, t_c, q_o, q_c = proto.think_open, proto.think_close, proto.query_open, proto.query_close
    d_o, d_c, a_o, a_c = proto.doc_open_tag, proto.doc_close_tag, proto.answer_open, proto.answer_close
    opened = 1 if proto.prompt_opens_think else 0  # R1-Searcher's prompt ends with <think>
    for o, c in ((t_o, t_c), (q_o, q_c), (d_o, d_c), (a_o, a_c)):
        if text.count(o) + (opened if o == t_o else 0) != text.count(c):
            return False, f"mismatch in {o} tags"
    transitions = {
        (t_o, "start"): "in_think", (t_o, "information"): "in_think", (t_c, "in_think"): "after_think",
        (q_o, "after_think"): "in_search", (q_c, "in_search"): "after_search",
        (d_o, "after_search"): "in_information", (d_c, "in_information"): "information",
        (a_o, "after_think"): "in_answer", (a_c, "in_answer"): "end",
    }
    state = "in_think" if opened else "start"
    tags = sorted({t_o, t_c, q_o, q_c, d_o, d_c, a_o, a_c}, key=len, reverse=True)
    parts = re.split("(" + "|".join(re.escape(t) for t in tags) + ")", text)
    for part in parts:
        if not part.strip():
            continue
        if part in tags:
            nxt = transitions.get((part, state))
            if nxt is None:
                return False, f"unexpected {part} in state {state}"
            state = nxt
        elif state not in ("in_think", "in_search", "in_information", "in_answer"):
            return False, f"unexpected text between tags in state {state}"
    if state != "end":
        return False, "incomplete sequence"
    return True, ""


# ---------------------------------------------------------------------------------------------------- helpers
def _answer_metrics(answer: str, golds: List[str]) -> Dict[str, float]:
    return {
        "em": exact_match(answer, golds),
        "f1": f1_score(answer, golds),
        "cover_em": cover_em(answer, golds),
    }


# list separators: ";", "/", "|", a newline, " or ", and a comma not inside a digit group ("1,000" is one number)
_LIST_SEPARATOR = re.compile(r";|/|\||\n|\s+or\s+|,(?!\d{3}\b)|(?<!\d),", re.IGNORECASE)


def answer_candidates(answer: str) -> int:
    """How many candidates an answer names: its non-empty pieces between list separators (``,`` outside digit
    groups, ``;``, ``/``, ``|``, a newline, `` or ``). "Paris" -> 1, "Paris, Lyon or Nice" -> 3, "1,000" -> 1,
    "" -> 0. A title with a comma ("Washington, D.C.") counts 2: the rate this feeds is a warning sign, not a reward.
    """
    return sum(1 for piece in _LIST_SEPARATOR.split(answer or "") if piece and piece.strip(" .,;:-*"))


def _base_components(response_text: str, golds: List[str], proto: Protocol, answer_max_words: int):
    """Components every scheme logs. ``answer_list`` is 1.0 when the answer names more than one candidate
    (:func:`answer_candidates`; logged as ``rollout/answer_list_rate``): Cover-EM, and the released stage-1 reward
    built on it, give a list holding the gold the same score as the bare gold. ``cover_em_capped`` is Cover-EM under
    the paper schemes' format rule: 0 for an answer longer than ``answer_max_words`` words (what the paper
    schemes score with; the released schemes keep plain Cover-EM)."""
    text = strip_end_of_turn(response_text or "")
    answer = proto.extract_answer(text)
    ok, reason = check_format(text, proto, answer_max_words=answer_max_words)
    comps = _answer_metrics(answer, golds)
    comps.update(
        format_ok=float(ok),
        answer_present=float(bool(proto.extract_answers(text))),
        valid_searches=float(_valid_retrievals(text, proto)),
        answer_list=float(answer_candidates(answer) > 1),
        cover_em_capped=comps["cover_em"] if len(answer.split()) <= answer_max_words else 0.0,
    )
    return text, answer, ok, reason, comps


def _valid_retrievals(text: str, proto: Protocol) -> int:
    """Well-formed retrievals: a non-empty query block immediately answered by a documents block (native tool calls:
    the tool responses appended with passages; an invalid-call reply, a call over the per-message cap or a call the
    context had no room for answers none)."""
    if getattr(proto, "native_tools", False):
        return len(proto.documents_blocks(text))
    segments = proto.split_turns(text)
    pattern = re.compile(re.escape(proto.query_open) + r"((?:(?!" + re.escape(proto.query_open) + r").)*?)"
                         + re.escape(proto.query_close) + r"\s*$", re.DOTALL)
    count = 0
    for i, seg in enumerate(segments[:-1]):
        nxt = segments[i + 1]
        if seg.kind == "model" and nxt.kind == "environment" and proto.doc_open_tag in nxt.text:
            m = pattern.search(seg.text)
            if m and m.group(1).strip():
                count += 1
    return count


# ---------------------------------------------------------------------------------------------------- schemes
def r1searcher_stage1(response_text: str, golds: List[str], protocol, answer_max_words: int = 10,
                      retrieval_reward: float = 0.5, format_reward: float = 0.5) -> RewardResult:
    """R1-Searcher stage 1 (arXiv 2503.05592 sec. 3.2, "Retrieve Reward" and "Format Reward", stage 1).

    ``R = R_retrieval + R_format``: ``R_retrieval`` = 0.5 when at least one well-formed retrieval happened
    (a non-empty query answered by a documents block), else 0; ``R_format`` = 0.5 when :func:`check_format`
    passes, else 0. No answer reward in this stage. Range [0, 1]. ``score`` (the answer correctness dynamic filtering
    reads) is Cover-EM under the same format rule: 0 for an answer longer than ``answer_max_words`` words, so a
    list of candidates holding the gold does not count as correct.
    """
    proto = get_protocol(protocol)
    _, _, ok, reason, comps = _base_components(response_text, golds, proto, answer_max_words)
    r_ret = retrieval_reward if comps["valid_searches"] >= 1 else 0.0
    r_fmt = format_reward if ok else 0.0
    comps.update(retrieval_reward=r_ret, format_reward=r_fmt, score=comps["cover_em_capped"])
    return RewardResult(r_ret + r_fmt, comps, reason)


def r1searcher_stage2(response_text: str, golds: List[str], protocol, answer_max_words: int = 10,
                      format_penalty: float = -2.0) -> RewardResult:
    """R1-Searcher stage 2 (arXiv 2503.05592 sec. 3.2, "Answer Reward" and "Format Reward", stage 2).

    ``R = R_format + R_answer``: ``R_answer`` = token F1 (SQuAD normalisation, yes/no rule) of the last answer
    block against the gold answers (0 without an answer); ``R_format`` = 0 when :func:`check_format` passes,
    else -2. Range [-2, 1].
    """
    proto = get_protocol(protocol)
    _, _, ok, reason, comps = _base_components(response_text, golds, proto, answer_max_words)
    r_fmt = 0.0 if ok else format_penalty
    comps.update(answer_reward=comps["f1"], format_reward=r_fmt, score=comps["f1"])
    return RewardResult(comps["f1"] + r_fmt, comps, reason)


def _released_format_punishment(solution: str, proto: Protocol, answer_max_words: int) -> Tuple[bool, str]:
    """The format checks of R1-Searcher's released Qwen reward server (``train/reward_server_qwen_zero.py``
    l. 198-246), on the R1-Searcher tag set, verbatim in effect.

    ``solution`` is the response as their server sees it (documents included). Returns (punished, reason).
    """
    d_o, d_c = proto.doc_open_tag, proto.doc_close_tag
    counts = _released_doc_counts(solution, proto)
    if len(set(counts)) != 1:
        return True, f"query/documents tag counts differ: {counts}"
    # Their role check counts the word anywhere in the solution, retrieved documents included.
    if solution.count("Assistant") or solution.count("assistant"):
        return True, "role leakage: 'assistant'"
    if not (solution.count(proto.think_open) == 0 and solution.count(proto.think_close) == 1):
        return True, "think tags: expected no <think> and one </think>"
    if not (solution.count(proto.answer_open) == solution.count(proto.answer_close) == 1):
        return True, "expected one answer block"
    answer_text = solution.split(proto.answer_open)[-1].split(proto.answer_close)[0].strip()
    if "begin_of_query" in answer_text or "begin_of_documents" in answer_text:
        return True, "tag inside the answer"
    if len(answer_text.split()) > answer_max_words:
        return True, f"answer longer than {answer_max_words} words"
    outside_docs = re.sub(re.escape(d_o) + ".*?" + re.escape(d_c), "", solution, flags=re.DOTALL)
    if _CJK.search(outside_docs):
        return True, "Chinese characters outside documents"
    return False, ""


# The prompt tail at which each released server cuts the scored query (``get_qa``): the solution is what follows its
# LAST occurrence, so a response that writes the tail itself (a new assistant turn) is scored from there on.
_QWEN_SOLUTION_MARKER = "\nAssistant: <think>"  # reward_server_qwen_zero.py l. 150-154
_LLAMA_SOLUTION_MARKER = "<|eot_id|><|start_header_id|>assistant<|end_header_id|>\n\n<think>"  # llama_stage1.py
# l. 122-125, llama_stage2.py l. 149-152


def _released_solution(response_text: str, marker: str) -> str:
    """The ``solution`` a released R1-Searcher reward server scores for ``response_text`` (the text after a prompt
    that ends with ``marker``): ``(prompt + response).split(marker)[-1].strip()``. Trailing end-of-sequence strings
    are removed first (their ``strip_sequence``; the one eos they append back changes no tag count)."""
    return strip_end_of_turn(response_text or "").split(marker)[-1].strip()


def _released_answer(solution: str, proto: Protocol) -> Tuple[bool, str]:
    finished = proto.answer_open in solution and proto.answer_close in solution
    # Their extractor: text after the last <answer>, up to the next </answer>.
    pred = solution.split(proto.answer_open)[-1].split(proto.answer_close)[0].strip()
    return finished, pred


def _require_r1_tags(proto: Protocol, scheme: str) -> None:
    if not isinstance(proto, R1SearcherProtocol):
        raise ValueError(f"reward scheme {scheme!r} reproduces R1-Searcher's released code and needs the "
                         f"r1searcher protocol (got {proto.name!r})")


def r1searcher_released_stage2(response_text: str, golds: List[str], protocol, answer_max_words: int = 10,
                               format_penalty: float = -2.0) -> RewardResult:
    """R1-Searcher's released Qwen stage-2 reward, for parity: ``train/reward_server_qwen_zero.py``
    (RUCAIBox/R1-Searcher, ``MathRuleProxy.get_reward``, lines 163-268).

    Reproduced exactly: the scored solution is the response after the last ``"\nAssistant: <think>"`` (the prompt's
    tail; l. 150-154, :func:`_released_solution`); the answer is the text after the last ``<answer>`` up to the next
    ``</answer>`` (l. 109-110);
    the answer reward is token F1 under R1-Searcher's normalisation ("True"/"False" -> yes/no, ``_`` and punctuation
    replaced by spaces), max over golds, and 0 when ``<answer>`` or ``</answer>`` is missing (l. 183-196); then
    ``format_penalty`` (-2, l. 249-250) when any of these holds: the counts of ``<|begin_of_documents|>\\n``,
    ``<|end_of_documents|>\\n\\n``, query open/close, documents open/close and ``<|begin_of_documents|>\\n(1)``
    are not all equal (l. 198-210); "Assistant"/"assistant" appears anywhere, documents included (l. 212-217); not
    exactly zero ``<think>`` and one ``</think>`` (l. 219-224); not exactly one answer block (l. 226-231); a
    query/documents tag inside the answer (l. 233-237); an answer longer than 10 words (l. 239-241); a CJK
    character outside documents (l. 243-246). Differences from the paper's stage 2 (``r1searcher_stage2``):
    normalisation, the strict think count, and the role check over documents. Range [-2, 1].
    """
    proto = get_protocol(protocol)
    _require_r1_tags(proto, "r1searcher_released_stage2")
    solution = _released_solution(response_text, _QWEN_SOLUTION_MARKER)
    finished, pred = _released_answer(solution, proto)
    f1 = f1_score(pred, golds, normalizer=r1searcher_normalize) if finished else 0.0
    punished, reason = _released_format_punishment(solution, proto, answer_max_words)
    _, _, ok, _, comps = _base_components(response_text, golds, proto, answer_max_words)
    comps.update(released_f1=f1, released_format_ok=float(not punished), format_reward=format_penalty if punished
                 else 0.0, score=f1)
    return RewardResult(f1 + (format_penalty if punished else 0.0), comps, reason)


def _released_doc_counts(solution: str, proto: Protocol) -> List[int]:
    """The seven tag counts R1-Searcher's reward servers compare (``count_1`` .. ``count_7``)."""
    d_o, d_c = proto.doc_open_tag, proto.doc_close_tag
    return [solution.count(d_o + "\n"), solution.count(d_c + "\n\n"), solution.count(proto.query_open),
            solution.count(proto.query_close), solution.count(d_o), solution.count(d_c),
            solution.count(d_o + "\n(1)")]


def _released_think_answer_ok(solution: str, proto: Protocol) -> bool:
    """No ``<think>`` (the prompt opened it), exactly one ``</think>``, one ``<answer>`` and one ``</answer>``."""
    return (solution.count(proto.think_open) == 0 and solution.count(proto.think_close) == 1
            and solution.count(proto.answer_open) == 1 and solution.count(proto.answer_close) == 1)


def r1searcher_released_llama_stage2(response_text: str, golds: List[str], protocol,
                                     answer_max_words: int = 10) -> RewardResult:
    """R1-Searcher's released Llama stage-2 reward, for parity: ``train/reward_server_llama_stage2.py``
    (RUCAIBox/R1-Searcher, ``MathRuleProxy.get_reward``, lines 162-251).

    ``R = F1 - 1 if punished else F1`` over the solution after the last Llama-3 assistant header + ``<think>``
    (l. 149-152, :func:`_released_solution`): F1 of the last answer block under R1-Searcher's normalisation (l. 62-88,
    183-185), 0 without ``<answer>``/``</answer>`` (l. 191-193); punished (-1, l. 226-227) when the seven
    documents/query tag counts are not all equal (l. 197-208, zero retrievals allowed), when the think/answer tag
    counts are not 0 ``<think>``, 1 ``</think>``, 1 ``<answer>``, 1 ``</answer>`` (l. 211-219), or when a CJK
    character appears outside documents (l. 221-224). Unlike the Qwen file (``r1searcher_released_stage2``) there is
    no role check, no tag-in-answer check and no answer-length cap; ``answer_max_words`` is accepted and unused.
    Range [-1, 1].
    """
    proto = get_protocol(protocol)
    _require_r1_tags(proto, "r1searcher_released_llama_stage2")
    solution = _released_solution(response_text, _LLAMA_SOLUTION_MARKER)
    finished, pred = _released_answer(solution, proto)
    f1 = f1_score(pred, golds, normalizer=r1searcher_normalize) if finished else 0.0
    reason = ""
    counts = _released_doc_counts(solution, proto)
    if len(set(counts)) != 1:
        reason = f"query/documents tag counts differ: {counts}"
    elif not _released_think_answer_ok(solution, proto):
        reason = "think/answer tag counts: expected 0 <think>, 1 </think>, 1 <answer>, 1 </answer>"
    else:
        outside_docs = re.sub(re.escape(proto.doc_open_tag) + ".*?" + re.escape(proto.doc_close_tag), "", solution,
                              flags=re.DOTALL)
        if _CJK.search(outside_docs):
            reason = "Chinese characters outside documents"
    punished = bool(reason)
    _, _, _, _, comps = _base_components(response_text, golds, proto, answer_max_words)
    comps.update(released_f1=f1, released_format_ok=float(not punished), format_reward=-1.0 if punished else 0.0,
                 score=f1)
    return RewardResult(f1 - (1.0 if punished else 0.0), comps, reason)


def r1searcher_released_stage1(response_text: str, golds: List[str], protocol,
                               answer_max_words: int = 10) -> RewardResult:
    """R1-Searcher's released stage-1 reward, for parity: ``train/reward_server_llama_stage1.py``
    (RUCAIBox/R1-Searcher, ``MathRuleProxy.get_reward``, lines 135-227). Not the paper's stage-1 rule
    (``r1searcher_stage1``, which has no answer term).

    ``R = A + D + T`` over the solution after the last Llama-3 assistant header + ``<think>`` (l. 122-125,
    :func:`_released_solution`), with
    - ``A`` = +1 when ``<answer>`` and ``</answer>`` are present and the last answer block covers a gold answer
      (Cover-EM, ``cover_exact_match_score_1``, R1-Searcher normalisation; l. 49-55, 156-158), else -1 (also -1
      without ``<answer>``/``</answer>``; l. 164-173);
    - ``D`` = +0.5 when the counts of ``<|begin_of_documents|>\\n``, ``<|end_of_documents|>\\n\\n``,
      ``<|begin_of_query|>``, ``<|end_of_query|>``, ``<|begin_of_documents|>``, ``<|end_of_documents|>`` and
      ``<|begin_of_documents|>\\n(1)`` are all equal and at least 1, i.e. at least one retrieval and every query
      answered by a documents block (l. 175-190);
    - ``T`` = +0.5 when there is no ``<think>`` (the prompt opened it), exactly one ``</think>``, one ``<answer>``
      and one ``</answer>`` (l. 192-198).
    No role, CJK or answer-length check. Examples (one search + answer): correct 2.0, wrong 0.0; no search and
    correct 1.5; search and no answer -0.5. Range [-1, 2]. ``answer_max_words`` is accepted and unused (the
    executor passes it to every scheme).
    """
    proto = get_protocol(protocol)
    _require_r1_tags(proto, "r1searcher_released_stage1")
    solution = _released_solution(response_text, _LLAMA_SOLUTION_MARKER)
    finished, pred = _released_answer(solution, proto)
    covered = finished and cover_em(pred, golds) > 0
    answer_term = 1.0 if covered else -1.0
    counts = _released_doc_counts(solution, proto)
    docs_ok = len(set(counts)) == 1 and counts[0] >= 1
    think_ok = _released_think_answer_ok(solution, proto)
    r_ret = 0.5 if docs_ok else 0.0
    r_fmt = 0.5 if think_ok else 0.0
    reason = "" if docs_ok and think_ok else (
        f"query/documents tag counts not all equal and >= 1: {counts}" if not docs_ok
        else "think/answer tag counts: expected 0 <think>, 1 </think>, 1 <answer>, 1 </answer>")
    _, _, _, _, comps = _base_components(response_text, golds, proto, answer_max_words)
    comps.update(answer_reward=answer_term, retrieval_reward=r_ret, format_reward=r_fmt,
                 released_format_ok=float(docs_ok and think_ok), score=float(covered))
    return RewardResult(answer_term + r_ret + r_fmt, comps, reason)


def searchr1_em(response_text: str, golds: List[str], protocol, answer_max_words: int = 10) -> RewardResult:
    """Search-R1 outcome reward (arXiv 2503.09516 sec. 3.4, eq. 4): ``r = EM(a_pred, a_gold)``, 1 or 0.

    ``a_pred`` is the last answer block of the response (their ``extract_solution`` skips the prompt's example);
    EM uses SQuAD normalisation, max over gold answers. ``answer_max_words`` is accepted and unused.
    """
    proto = get_protocol(protocol)
    _, _, _, reason, comps = _base_components(response_text, golds, proto, answer_max_words)
    comps.update(score=comps["em"])
    return RewardResult(comps["em"], comps, reason)


#: how :func:`gold_in_documents` matches a gold answer in a documents block: "token" (default) on whole normalised
#: tokens; "substring" as Search-R1's released ``qa_em_format.is_retrieval_correct`` (``"1"`` found in ``"1990"``)
GOLD_MATCHES = ("token", "substring")


def gold_in_documents(text: str, golds: List[str], protocol, match: str = "token") -> bool:
    """Whether a normalised gold answer occurs in a documents block of ``text`` (SQuAD normalisation).

    ``match`` "token": as a run of whole tokens ("US" is not in "USSR", "no" not in "not", "1" not in "1990");
    "substring": as any substring, Search-R1's released rule (kept for parity: rescoring their runs).

    Raises:
        ValueError: ``match`` not in :data:`GOLD_MATCHES`.
    """
    if match not in GOLD_MATCHES:
        raise ValueError(f"gold_match must be one of {list(GOLD_MATCHES)}, got {match!r}")
    proto = get_protocol(protocol)
    norm_golds = [g for g in (normalize_answer(x) for x in golds) if g]
    for block in proto.documents_blocks(text):
        inner = block.strip()
        inner = inner.replace(proto.doc_open_tag, "", 1)
        if inner.endswith(proto.doc_close_tag):
            inner = inner[: -len(proto.doc_close_tag)]
        norm = normalize_answer(inner)
        if match == "substring":
            if any(g in norm for g in norm_golds):
                return True
        elif any(f" {g} " in f" {norm} " for g in norm_golds):  # normalize_answer leaves single spaces
            return True
    return False


def searchr1_format(response_text: str, golds: List[str], protocol, answer_max_words: int = 10,
                    structure_format_score: float = 0.2, final_format_score: float = 0.1,
                    retrieval_score: float = 0.0, score: float = 1.0, gold_match: str = "token") -> RewardResult:
    """Search-R1 format-aware reward (arXiv 2505.15117 sec. 3, "reward design"; ``qa_em_format.compute_score_em``).

    With ``valid`` = :func:`searchr1_valid_sequence` and ``hit`` = a normalised gold answer occurs in a retrieved
    block (only checked when valid; :func:`gold_in_documents` with ``gold_match``: "token" by default, whole
    tokens; "substring" is the released rule, under which "US" is retrieved inside "USSR"):

    - EM and valid: ``score`` (1); EM and not valid: ``score - λf``;
    - wrong (or no answer) and valid: ``λf`` (+ ``λr`` when ``hit``);
    - wrong with an answer and not valid: ``final_format_score``; no answer and not valid: 0.

    Their scripts use λf = 0.2 (``structure_format_score``), final 0.1, λr = 0 (``retrieval_score``).
    """
    proto = get_protocol(protocol)
    text, answer, _, reason, comps = _base_components(response_text, golds, proto, answer_max_words)
    valid, vreason = searchr1_valid_sequence(text, proto)
    if gold_match not in GOLD_MATCHES:  # checked before the sequence: an unknown name fails on every sample
        raise ValueError(f"gold_match must be one of {list(GOLD_MATCHES)}, got {gold_match!r}")
    hit = valid and gold_in_documents(text, golds, proto, match=gold_match)
    has_answer = bool(proto.extract_answers(text))
    if has_answer and comps["em"] > 0:
        reward = score if valid else score - structure_format_score
    elif valid:
        reward = structure_format_score + (retrieval_score if hit else 0.0)
    elif has_answer:
        reward = final_format_score
    else:
        reward = 0.0
    comps.update(valid_sequence=float(valid), gold_in_information=float(hit), score=comps["em"])
    return RewardResult(reward, comps, vreason or reason)


RewardFn = Callable[..., RewardResult]
REWARD_SCHEMES: Dict[str, RewardFn] = {
    "r1searcher_stage1": r1searcher_stage1,
    "r1searcher_stage2": r1searcher_stage2,
    "r1searcher_released_stage1": r1searcher_released_stage1,
    "r1searcher_released_stage2": r1searcher_released_stage2,
    "r1searcher_released_llama_stage2": r1searcher_released_llama_stage2,
    "searchr1_em": searchr1_em,
    "searchr1_format": searchr1_format,
}


def register_reward_scheme(name: str, fn: RewardFn) -> RewardFn:
    """Add a scheme ``fn(response_text, golds, protocol, **kw) -> RewardResult`` under ``name``."""
    if not callable(fn):
        raise TypeError(f"register_reward_scheme: {fn!r} is not callable")
    REWARD_SCHEMES[name] = fn
    return fn


def compute_reward(scheme: str, response_text: str, golds, protocol, **kw) -> RewardResult:
    """Score one trajectory with a named scheme.

    Args:
        scheme: a key of ``REWARD_SCHEMES``.
        response_text: everything after the prompt (model turns and environment blocks, as decoded).
        golds: gold answers in any form :func:`~openrlhf_search.env.metrics.parse_golds` reads.
        protocol: a :class:`Protocol` or a registered protocol name.
        **kw: scheme options (``answer_max_words``, ``format_penalty``, ``structure_format_score``, ...).

    Raises:
        ValueError: unknown scheme, or unreadable gold answers.
        TypeError: an option the scheme does not take (the message lists the ones it does).
    """
    fn = REWARD_SCHEMES.get(scheme)
    if fn is None:
        raise ValueError(f"unknown reward scheme {scheme!r}; known: {sorted(REWARD_SCHEMES)}")
    params = inspect.signature(fn).parameters
    unknown = [k for k in kw if k not in params]
    if unknown and not any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params.values()):
        options = [n for n in params if n not in ("response_text", "golds", "protocol")]
        raise TypeError(f"reward scheme {scheme!r} does not take {unknown}; options: {options}")
    if response_text is None:
        response_text = ""
    if not isinstance(response_text, str):
        raise TypeError(f"response_text must be a string, got {type(response_text).__name__}")
    return fn(response_text, parse_golds(golds), get_protocol(protocol), **kw)


# ------------------------------------------------------------------ R1-Searcher's released Llama reward servers
# Read from RUCAIBox/R1-Searcher@631167c train/reward_server_llama_stage{1,2}.py (``MathRuleProxy.get_reward``);
# the launchers r1searcher_llama8b_instruct_stage{1,2}.sh use them under SETTING=released (docs/parity.md).


# The released Llama stage-1 server is the one ``r1searcher_released_stage1`` reproduces; the Llama launchers name it
# after its file.
r1searcher_released_llama_stage1 = r1searcher_released_stage1
register_reward_scheme("r1searcher_released_llama_stage1", r1searcher_released_llama_stage1)
