"""Search protocols: the tag set, prompt template, action parsing and document rendering of each paper.

A protocol is the only place that knows the strings a model writes to search or answer and the strings the
environment writes back; as pure text functions they serve the executor (``agent.py``), the rewards and the
evaluation alike. This module holds the interface (:class:`Protocol`) and the registry; the papers' protocols
(``"r1searcher"``: R1-Searcher, arXiv 2503.05592, ``<|begin_of_query|>`` tags; ``"searchr1"``: Search-R1, arXiv
2503.09516, ``<search>`` tags) live in ``paper_protocols.py``, native tool calls in ``chat_tools.py``. Another
protocol is a subclass setting the class attributes (overriding ``build_prompt`` / ``format_passages`` where its
strings differ), decorated with ``@register_protocol``.
"""

from __future__ import annotations

import re
from abc import ABC
from dataclasses import dataclass
from typing import Dict, List, Optional, Sequence, Tuple, Type

from openrlhf_search.env.config import ConfigError
from openrlhf_search.env.types import Action, Passage

__all__ = [
    "Protocol",
    "Segment",
    "PROTOCOLS",
    "register_protocol",
    "get_protocol",
    "engine_prompt",
]


@dataclass(frozen=True)
class Segment:
    """One piece of a response, as found by :meth:`Protocol.split_turns`.

    Attributes:
        kind: "model" (text the policy generated) or "environment" (a documents block or an environment message).
        text: the exact characters; the segments of a response concatenate back to it.
    """

    kind: str
    text: str


_PASSAGE_ESCAPES: Dict[Tuple[str, ...], "re.Pattern"] = {}


def _passage_escape_pattern(tags: Tuple[str, ...]) -> "re.Pattern":
    """One regex for the tags (longest first) and any ``<|name|>`` special-token string; cached per tag set."""
    pat = _PASSAGE_ESCAPES.get(tags)
    if pat is None:
        alts = [re.escape(t) for t in sorted({t for t in tags if t}, key=len, reverse=True)]
        pat = _PASSAGE_ESCAPES[tags] = re.compile("|".join(alts + [r"<\|[^<>|\s]{1,64}\|>"]))
    return pat


def _split_ws(s: str) -> Tuple[str, str, str]:
    """Split ``"\\n\\n<tag>\\n"`` into (leading whitespace, core, trailing whitespace)."""
    core = s.strip()
    if not core:
        return s, "", ""
    start = s.index(core)
    return s[:start], core, s[start + len(core):]


class Protocol(ABC):
    """Tag set, prompt and parsing rules of one search-agent paper (pure text functions, no state).

    Class attributes (set by every subclass):
        name: registry key ("r1searcher", "searchr1").
        query_open, query_close: the search-call tags; ``query_close`` is an engine stop string.
        answer_open, answer_close: the answer tags; ``answer_close`` is an engine stop string.
        think_open, think_close: the reasoning tags (used by the format checker).
        doc_open, doc_close: the whole strings the environment writes before and after the passages, newlines
            included, so that ``render_documents`` reproduces the paper's rollouts character for character.
        default_chat: whether the paper applied the tokenizer's chat template by default.
        prompt_opens_think: True when the prompt already ends with ``think_open`` (R1-Searcher), so the response
            starts inside a reasoning block.
        role_markers: strings whose presence in a response means the model wrote another speaker's turn
            (role leakage, a format error in R1-Searcher's reward).
    """

    name: str = ""
    query_open: str = ""
    query_close: str = ""
    answer_open: str = "<answer>"
    answer_close: str = "</answer>"
    think_open: str = "<think>"
    think_close: str = "</think>"
    doc_open: str = ""
    doc_close: str = ""
    default_chat: bool = False
    prompt_opens_think: bool = False
    role_markers: Tuple[str, ...] = ("<|im_start|>", "<|start_header_id|>", "User:", "Assistant:")
    #: passage renderings :meth:`format_passage` knows (``SearchConfig.passage_format``); the first is the default
    passage_formats: Tuple[str, ...] = ()
    #: query cleanings :meth:`clean_query` knows (``SearchConfig.query_cleaning``) besides "" (none)
    query_cleanings: Tuple[str, ...] = ()
    #: this instance's choices ("" = the defaults); set through :meth:`with_options`
    passage_format: str = ""
    query_cleaning: str = ""

    def with_options(self, passage_format: str = "", query_cleaning: str = "") -> "Protocol":
        """A copy of this protocol that writes passages as ``passage_format`` and cleans queries as
        ``query_cleaning`` ("" keeps the defaults).

        Raises:
            ConfigError: a name this protocol does not know (the message lists the known ones).
        """
        import copy as _copy

        if passage_format and passage_format not in self.passage_formats:
            raise ConfigError(f"protocol {self.name}: unknown passage_format {passage_format!r}; known: "
                              f"{list(self.passage_formats) or 'none (one fixed rendering)'}")
        if query_cleaning and query_cleaning not in self.query_cleanings:
            raise ConfigError(f"protocol {self.name}: unknown query_cleaning {query_cleaning!r}; known: "
                              f"{list(self.query_cleanings) or 'none'}")
        out = _copy.copy(self)
        out.passage_format, out.query_cleaning = passage_format, query_cleaning
        return out

    def clean_query(self, query: str) -> str:
        """The query as sent to the retriever (``query_cleaning``; default: unchanged). May return ""."""
        return query

    # ------------------------------------------------------------------ tags
    @property
    def stop_strings(self) -> Tuple[str, ...]:
        """Engine stop strings: (query_close, answer_close). Generation stops right after an action is complete."""
        return (self.query_close, self.answer_close)

    @property
    def doc_open_tag(self) -> str:
        """The bare opening documents tag, without the surrounding newlines."""
        return _split_ws(self.doc_open)[1]

    @property
    def doc_close_tag(self) -> str:
        """The bare closing documents tag, without the surrounding newlines."""
        return _split_ws(self.doc_close)[1]

    @property
    def all_tags(self) -> Tuple[str, ...]:
        """Every tag of the protocol (think, query, documents, answer), for format checks."""
        return (self.think_open, self.think_close, self.query_open, self.query_close, self.doc_open_tag,
                self.doc_close_tag, self.answer_open, self.answer_close)

    def answer_block(self, text: str) -> Tuple[Optional[str], int, int]:
        """``(error, open, close)``: the positions of the open and close tags of the one answer block in ``text``, or
        the format rule it breaks (none, several or misordered tags) with ``-1, -1``."""
        n_open, n_close = text.count(self.answer_open), text.count(self.answer_close)
        if n_open == 0 and n_close == 0:
            return "no answer block", -1, -1
        if n_open != 1 or n_close != 1:
            return f"expected one answer block, found {n_open} open / {n_close} close tags", -1, -1
        a_open, a_close = text.find(self.answer_open), text.find(self.answer_close)
        if a_close < a_open:
            return "answer close tag before open tag", -1, -1
        return None, a_open, a_close

    # ---------------------------------------------------------------- prompt
    def instructions(self) -> str:
        """The task instructions (system message in chat form). Subclasses override."""
        raise NotImplementedError

    def build_prompt(self, question: str, tokenizer=None, chat: Optional[bool] = False,
                     template: str = "train") -> str:
        """Render the prompt for one question, character for character as the paper's released code does.

        Args:
            question: the question text (see :meth:`normalize_question`: stripped; Search-R1 appends "?").
            tokenizer: the POLICY's Hugging Face tokenizer; its chat template renders chat prompts (system turn
                included: Qwen2.5's template adds "You are a helpful assistant." when the messages have none).
                Never a stand-in: another model's template renders other system turns.
            chat: True: wrap with ``tokenizer.apply_chat_template`` (error without a tokenizer that has one);
                False: the plain-text prompt; None: the paper's default (:meth:`resolve_chat`).
            template: prompt variant, one of ``self.prompt_templates`` ("train" for every protocol; R1-Searcher
                also has "eval", the prompt of its released eval script).

        Returns:
            The prompt string; the model's response continues it directly.

        Raises:
            ValueError: empty question, unknown template, or chat rendering without the policy's tokenizer (one
                line saying so).
        """
        raise NotImplementedError

    #: prompt variants :meth:`build_prompt` knows ("train": the training prompt)
    prompt_templates: Tuple[str, ...] = ("train",)

    def normalize_question(self, question: str) -> str:
        """The question as the paper's data pipeline writes it into the prompt (here: stripped).

        Raises:
            ValueError: not a string, or only whitespace.
        """
        return self._check_question(question)

    def resolve_chat(self, chat: Optional[bool], tokenizer=None) -> bool:
        """Whether :meth:`build_prompt` applies the chat template, ``chat=None`` meaning the paper's default.

        Default: ``default_chat`` (R1-Searcher: False, its base-model prompt). Protocols whose released code applies
        the policy's chat template whenever the tokenizer has one (Search-R1) override this.

        Raises:
            ValueError: ``chat`` is not None/True/False.
        """
        if chat is None:
            return self.default_chat
        if not isinstance(chat, bool):
            raise ValueError(f"protocol: chat must be True, False or None, got {chat!r}")
        return chat

    def _check_template(self, template: str) -> str:
        if template not in self.prompt_templates:
            raise ValueError(f"protocol {self.name}: unknown prompt template {template!r}; "
                             f"known: {list(self.prompt_templates)}")
        return template

    @staticmethod
    def _check_question(question: str) -> str:
        if not isinstance(question, str) or not question.strip():
            raise ValueError(f"protocol: question must be a non-empty string, got {question!r}")
        return question.strip()

    @staticmethod
    def _apply_chat(tokenizer, messages: List[dict]) -> str:
        if tokenizer is None:
            raise ValueError("protocol: chat rendering needs the policy's tokenizer (none given; another model's "
                             "chat template would render other system turns, so none is guessed)")
        if not getattr(tokenizer, "chat_template", None):
            name = getattr(tokenizer, "name_or_path", "") or type(tokenizer).__name__
            raise ValueError(f"protocol: chat rendering needs a chat template, and tokenizer {name!r} has none "
                             f"(render the plain-text prompt instead: chat=False / --no_chat_template)")
        return tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)

    # ------------------------------------------------------------- documents
    def format_passage(self, index: int, passage: Passage) -> str:
        """One passage line; ``index`` starts at 1. Subclasses override."""
        raise NotImplementedError

    def format_passages(self, passages: Sequence[Passage]) -> str:
        """The body between ``doc_open`` and ``doc_close`` for a list of passages (may be empty)."""
        raise NotImplementedError

    def render_documents(self, passages: Sequence[Passage]) -> str:
        """The whole documents block the environment appends after a query: doc_open + body + doc_close."""
        return self.doc_open + self.format_passages(passages) + self.doc_close

    def escape_passage_text(self, text: str) -> str:
        """``text`` with every protocol tag (:attr:`all_tags`), ``<``-marker of :attr:`role_markers` and special-token
        string of the ``<|name|>`` form (``<|im_end|>``, ``<|eot_id|>``, R1-Searcher's tags) written with ``&lt;`` /
        ``&gt;``, so that a retrieved passage can neither close the documents block, nor carry an answer, query or
        reasoning block the reward would read as the model's, nor become a special token in the policy's context.
        Other text (``a < b``) is unchanged. The released loops insert passages raw (docs/parity.md)."""
        pattern = _passage_escape_pattern(self.all_tags + tuple(m for m in self.role_markers if m.startswith("<")))
        return pattern.sub(lambda m: m.group(0).replace("<", "&lt;").replace(">", "&gt;"), text)

    def escape_passages(self, passages: Sequence[Passage]) -> List[Passage]:
        """The passages with :meth:`escape_passage_text` applied to title and text (the others unchanged);
        what ``format_passages`` writes."""
        out = []
        for p in passages:
            title, text = self.escape_passage_text(p.title), self.escape_passage_text(p.text)
            out.append(p if (title, text) == (p.title, p.text) else
                       Passage(id=p.id, title=title, text=text, score=p.score))
        return out

    def invalid_action_message(self) -> Optional[str]:
        """Environment text appended after an invalid action; None means the trajectory ends there."""
        return None

    # --------------------------------------------------------------- parsing
    def _block_pattern(self, open_tag: str, close_tag: str) -> "re.Pattern":
        # The last opening tag before a closing tag: unclosed or repeated opening tags earlier are ignored.
        o, c = re.escape(open_tag), re.escape(close_tag)
        return re.compile(f"{o}((?:(?!{o}).)*?){c}", re.DOTALL)

    def _env_pattern(self) -> "re.Pattern":
        parts = []
        lead, core, trail = _split_ws(self.doc_open)
        clead, ccore, ctrail = _split_ws(self.doc_close)
        if core and ccore:
            # Exact surrounding newlines when present; an unclosed block (truncated rollout) runs to the end.
            parts.append(f"(?:{re.escape(lead)})?{re.escape(core)}(?:{re.escape(trail)})?.*?"
                         f"(?:{re.escape(ccore)}(?:{re.escape(ctrail)})?|\\Z)")
        msg = self.invalid_action_message()
        if msg:
            # Its surrounding newlines optional: a response ending on the message loses the last one to rstrip
            # (strip_end_of_turn), and the message's own "<answer> and </answer>" must never read as the model's.
            mlead, mcore, mtrail = _split_ws(msg)
            parts.append(f"(?:{re.escape(mlead)})?{re.escape(mcore)}(?:{re.escape(mtrail)})?")
        return re.compile("|".join(parts), re.DOTALL)

    def split_turns(self, response_text: str) -> List[Segment]:
        """Split a response into model text and environment blocks (documents, environment messages).

        The segments concatenate back to ``response_text`` exactly. Used to parse traces and to keep tags that
        appear inside retrieved passages out of the model's actions.
        """
        segments: List[Segment] = []
        pos = 0
        for m in self._env_pattern().finditer(response_text):
            if m.end() == m.start():
                continue
            if m.start() > pos:
                segments.append(Segment("model", response_text[pos:m.start()]))
            segments.append(Segment("environment", m.group(0)))
            pos = m.end()
        if pos < len(response_text):
            segments.append(Segment("model", response_text[pos:]))
        return segments

    def model_text(self, response_text: str) -> str:
        """The response with every environment block removed (what the policy generated)."""
        return "".join(s.text for s in self.split_turns(response_text) if s.kind == "model")

    def parse_action(self, turn_text: str) -> Action:
        """Parse one model turn (the text generated since the last observation).

        Rule (the engine stops at the first of ``stop_strings``, so the first completed block decides):
        - ``query`` when the first closing tag is ``query_close`` and a ``query_open`` precedes it; the content
          between the last such opening tag and the closing tag, stripped, is the query. An empty query is invalid.
        - ``answer`` when the turn holds a closed answer block; content is that of the last closed answer block.
        - ``invalid`` otherwise, with a short reason in ``content`` (for logs).

        Args:
            turn_text: the decoded text of the turn (any length, any characters).

        Returns:
            An :class:`~openrlhf_search.env.types.Action`.
        """
        if not isinstance(turn_text, str):
            return Action("invalid", f"turn is not text: {type(turn_text).__name__}")
        q_close = turn_text.find(self.query_close)
        a_close = turn_text.find(self.answer_close)
        if q_close >= 0 and (a_close < 0 or q_close < a_close):
            head = turn_text[:q_close]
            q_open = head.rfind(self.query_open)
            if q_open < 0:
                # A stray closing tag: an answer block after it still counts, else the turn is invalid.
                if self._has_closed_answer(turn_text):
                    return Action("answer", self.extract_answer(turn_text))
                return Action("invalid", f"{self.query_close} without {self.query_open}")
            query = head[q_open + len(self.query_open):].strip()
            if not query:
                return Action("invalid", "empty query")
            return Action("query", query)
        if self._has_closed_answer(turn_text):
            return Action("answer", self.extract_answer(turn_text))
        if self.query_open in turn_text:
            return Action("invalid", f"unclosed {self.query_open}")
        if self.answer_open in turn_text:
            return Action("invalid", f"unclosed {self.answer_open}")
        if self.answer_close in turn_text:
            return Action("invalid", f"{self.answer_close} without {self.answer_open}")
        return Action("invalid", "no search call and no answer")

    def _has_closed_answer(self, text: str) -> bool:
        return self._block_pattern(self.answer_open, self.answer_close).search(text) is not None

    def extract_answer(self, response_text: str) -> str:
        """Content of the LAST closed answer block the model generated, stripped; "" if there is none.

        ``response_text`` must be the response only (not the prompt, whose example ``<answer> Beijing </answer>``
        would otherwise count). Answer tags inside retrieved documents are ignored.
        """
        if not response_text:
            return ""
        blocks = self._block_pattern(self.answer_open, self.answer_close).findall(self.model_text(response_text))
        return blocks[-1].strip() if blocks else ""

    def extract_answers(self, response_text: str) -> List[str]:
        """Contents of every closed answer block the model generated, in order."""
        return [b.strip() for b in
                self._block_pattern(self.answer_open, self.answer_close).findall(self.model_text(response_text))]

    def extract_queries(self, response_text: str) -> List[str]:
        """Every non-empty, well-formed query the model issued, in order (environment blocks excluded)."""
        pattern = self._block_pattern(self.query_open, self.query_close)
        out = []
        for seg in self.split_turns(response_text):
            if seg.kind == "model":
                out.extend(q.strip() for q in pattern.findall(seg.text) if q.strip())
        return out

    def documents_blocks(self, response_text: str) -> List[str]:
        """The documents blocks found in a response (environment messages excluded)."""
        core = self.doc_open_tag
        return [s.text for s in self.split_turns(response_text) if s.kind == "environment" and core in s.text]


PROTOCOLS: Dict[str, Type[Protocol]] = {}


def register_protocol(cls: Type[Protocol]) -> Type[Protocol]:
    """Add a protocol class to ``PROTOCOLS`` under ``cls.name`` (usable as a class decorator).

    Raises:
        TypeError: ``cls`` is not a Protocol subclass.
        ValueError: missing name or tags, or the name is taken by another class.
    """
    if not (isinstance(cls, type) and issubclass(cls, Protocol)):
        raise TypeError(f"register_protocol: {cls!r} is not a Protocol subclass")
    for attr in ("name", "query_open", "query_close", "answer_open", "answer_close", "doc_open", "doc_close"):
        if not getattr(cls, attr, ""):
            raise ValueError(f"register_protocol: {cls.__name__}.{attr} must be a non-empty string")
    existing = PROTOCOLS.get(cls.name)
    if existing is not None and existing is not cls and existing.__qualname__ != cls.__qualname__:
        raise ValueError(f"register_protocol: name {cls.name!r} already used by {existing.__name__}")
    PROTOCOLS[cls.name] = cls
    return cls


def get_protocol(name) -> Protocol:
    """An instance of the protocol registered as ``name`` (a Protocol instance is returned unchanged).

    Raises:
        ConfigError: unknown name (the message lists the known ones).
    """
    if isinstance(name, Protocol):
        return name
    cls = PROTOCOLS.get(name)
    if cls is None:
        raise ConfigError(f"unknown protocol {name!r}; registered: {sorted(PROTOCOLS)}")
    return cls()


def engine_prompt(prompt: str, tokenizer) -> str:
    """``prompt`` with the special tokens an inference engine adds when it tokenises a text prompt itself, written in
    front as text, so that a tokenisation without special tokens (our executors, ``add_special_tokens=False``) gives
    the token ids the engine would have used.

    vLLM's ``LLM.generate(str)`` tokenises with ``add_special_tokens=True`` (``vllm/renderers/base.py:353`` of the
    installed vllm 0.29: ``default_cmpl_tok_params``; the HF tokenizer default, as in the vLLM R1-Searcher ran):
    Llama-3's tokenizer then puts ``<|begin_of_text|>`` in front, also when the text already starts with it (a
    chat-rendered Llama-3.1 prompt, whose template writes ``bos_token``, gets two); Qwen's adds nothing. R1-Searcher
    gives vLLM strings in training (``experience_maker.py:1107``) and eval (``eval_search_loacl.py:186``).

    Args:
        prompt: the rendered prompt text.
        tokenizer: the policy's tokenizer; None: ``prompt`` unchanged (no engine tokens can be known).
    Returns:
        ``prefix + prompt`` (``prefix`` "" when the tokenizer adds nothing).
    Raises:
        ValueError: the tokenizer adds tokens after the text (not expressible as a prefix), or the prefix does not
            tokenise back to the same ids.
    """
    if tokenizer is None:
        return prompt
    plain = list(tokenizer(prompt, add_special_tokens=False)["input_ids"])
    full = list(tokenizer(prompt, add_special_tokens=True)["input_ids"])
    if full == plain:
        return prompt
    k = len(full) - len(plain)
    if k <= 0 or full[k:] != plain:
        raise ValueError("protocol: the tokenizer adds special tokens after the prompt text; an engine prompt cannot "
                         "be written as a prefix")
    out = tokenizer.decode(full[:k], skip_special_tokens=False) + prompt
    if list(tokenizer(out, add_special_tokens=False)["input_ids"]) != full:
        raise ValueError(f"protocol: the engine's special tokens {full[:k]} do not tokenise back from their text")
    return out
