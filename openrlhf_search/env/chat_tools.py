"""Native tool calling: the ``chat_tools`` protocols, where search is a function the chat template declares.

Search is the function ``search(query)`` declared through the policy's ``apply_chat_template(tools=...)``; the model
answers with Hermes-style ``<tool_call>`` JSON (read one block at a time with ``json.loads``, as vLLM's ``hermes``
parser does) and ends its turn; the environment inserts exactly what the policy's template renders for the ``tool``
messages, then the next generation prompt (:meth:`ChatToolsProtocol.tool_turn_text`). ``chat_tools`` has thinking
on (Qwen3's ``enable_thinking=True``), ``chat_tools_nothink`` off. A turn without a tool call is the final message;
its last ``<answer>`` block outside ``<think>`` is scored by the usual rewards. A malformed call or one over
``SearchConfig.max_tool_calls_per_turn`` gets a ``tool`` message starting with ``INVALID_CALL_PREFIX`` and is counted
(``invalid_tool_calls``), never ending the run. ``docs/chat_tools.md`` describes a trajectory step by step and what
each case does to the reward.
"""

from __future__ import annotations

import functools
import json
import re
from dataclasses import dataclass, field
from typing import Any, Dict, List, Optional, Sequence, Tuple

from openrlhf_search.env.protocol import Protocol, Segment, register_protocol
from openrlhf_search.env.types import Action, Passage

__all__ = ["ChatToolsProtocol", "ChatToolsNoThinkProtocol", "ToolTurn", "SEARCH_TOOL", "INVALID_CALL_PREFIX"]

#: the function declared to the policy (OpenAI / Hugging Face tools schema)
SEARCH_TOOL: Dict[str, Any] = {
    "type": "function",
    "function": {
        "name": "search",
        "description": "Search Wikipedia. Returns the top passages for the query, each with its title.",
        "parameters": {
            "type": "object",
            "properties": {"query": {"type": "string", "description": "what to look up (keywords or a question)"}},
            "required": ["query"],
        },
    },
}

#: first words of the tool message the environment writes for a malformed call
INVALID_CALL_PREFIX = "Invalid tool call:"

_SYSTEM = (
    "Answer the given question. You can call the search tool to look up facts you are not sure of, as many times as "
    "you need. When you know the answer, give it inside <answer> and </answer>, without detailed illustrations. For "
    "example, <answer> Beijing </answer>."
)

_SENTINEL = "\u2063ORS_SENTINEL\u2063"

#: first words of the reason given to a call over ``SearchConfig.max_tool_calls_per_turn``
_OVER_CAP = "more than"
#: what :meth:`ChatToolsProtocol._call_blocks` gives for a block json.loads cannot read
_NOT_JSON = object()


# Tags a template wraps tool messages in (Qwen's); escaped inside passages like the protocol tags.
_TOOL_RESPONSE_TAG = re.compile(r"</?tool_response>")


@dataclass
class ToolTurn:
    """One assistant turn as parsed by :meth:`ChatToolsProtocol.parse_tool_turn`.

    Attributes:
        queries: one entry per tool call, in order: the query string of a well-formed ``search`` call, None for an
            invalid one.
        errors: one entry per tool call: "" when well-formed, else why not (the invalid-call message's reason).
        final: True when the turn holds no tool call (the final message).
    """

    queries: List[Optional[str]] = field(default_factory=list)
    errors: List[str] = field(default_factory=list)
    final: bool = False

    @property
    def n_invalid(self) -> int:
        return sum(1 for e in self.errors if e)


def _generation_eos_ids(name_or_path: str) -> Tuple[int, ...]:
    """``eos_token_id`` of the model's ``generation_config.json`` (an int or a list) read from the local folder or
    the Hugging Face cache, never the network; () when there is none."""
    if not name_or_path:
        return ()
    return _cached_generation_eos_ids(name_or_path)


@functools.lru_cache(maxsize=16)
def _cached_generation_eos_ids(name_or_path: str) -> Tuple[int, ...]:
    from transformers import GenerationConfig

    try:
        eos = GenerationConfig.from_pretrained(name_or_path, local_files_only=True).eos_token_id
    except (OSError, ValueError):  # no generation config (a tokenizer folder), not cached
        return ()
    if eos is None:
        return ()
    return tuple(int(t) for t in (eos if isinstance(eos, (list, tuple)) else [eos]))


@register_protocol
class ChatToolsProtocol(Protocol):
    """Search as a function of the chat template's tool calling (Qwen3 / ChatML with Hermes-style ``<tool_call>``).

    Class attributes (besides :class:`Protocol`'s):
        native_tools: True; the executor asks :meth:`parse_tool_turn` and :meth:`tool_turn_text` instead of
            :meth:`Protocol.parse_action` and the documents block.
        enable_thinking: passed to the template (Qwen3's switch); False adds an empty think block after every
            generation prompt.
        end_of_turn: the token text that ends an assistant message (the engine's stop token; the model's other
            end-of-sequence tokens end a message too, :meth:`stop_token_ids`).
        turn_open: the text that opens any role's turn; an ``end_of_turn`` followed by it and another role than
            the assistant is the environment's text, up to and including ``assistant_header``.
        tools: the declared functions; ``tools[0]``'s name is the search function.
    """

    name = "chat_tools"
    native_tools = True
    enable_thinking = True
    query_open = "<tool_call>"
    query_close = "</tool_call>"
    doc_open = "<tool_response>"
    doc_close = "</tool_response>"
    default_chat = True
    end_of_turn = "<|im_end|>"
    turn_open = "<|im_start|>"
    assistant_header = "<|im_start|>assistant\n"
    empty_think = "<think>\n\n</think>\n\n"
    role_markers = ("<|im_start|>", "<|start_header_id|>", "<tool_response>", "</tool_response>")
    tools: Tuple[Dict[str, Any], ...] = (SEARCH_TOOL,)
    system_prompt = _SYSTEM

    @property
    def function_name(self) -> str:
        return self.tools[0]["function"]["name"]

    # ------------------------------------------------------------------ stops
    @property
    def stop_strings(self) -> Tuple[str, ...]:
        """No stop strings: a turn ends at the end-of-turn token (:meth:`stop_token_ids`)."""
        return ()

    def stop_token_ids(self, tokenizer) -> List[int]:
        """The ids that end an assistant message (the engine stops there, the token is kept in the output):
        ``end_of_turn``'s first, then the tokenizer's EOS and every ``eos_token_id`` of the model's generation config
        (read from ``tokenizer.name_or_path``, local files only). vLLM stops on all of them (Qwen3's generation
        config lists ``<|im_end|>`` and ``<|endoftext|>``), so a message ended by any of them is a finished message.

        Raises:
            ValueError: the tokenizer has no single token for ``end_of_turn``.
        """
        ids = tokenizer.convert_tokens_to_ids([self.end_of_turn])
        if not ids or ids[0] is None or ids[0] == getattr(tokenizer, "unk_token_id", -1):
            raise ValueError(f"protocol {self.name}: the tokenizer has no {self.end_of_turn!r} token")
        out = [int(ids[0])]
        if getattr(tokenizer, "eos_token_id", None) is not None:
            out.append(int(tokenizer.eos_token_id))
        out += _generation_eos_ids(getattr(tokenizer, "name_or_path", "") or "")
        return list(dict.fromkeys(out))

    # ------------------------------------------------------------------ prompt
    def instructions(self) -> str:
        return self.system_prompt

    def resolve_chat(self, chat: Optional[bool], tokenizer=None) -> bool:
        """Always the chat template (the tools live in it).

        Raises:
            ValueError: ``chat=False``.
        """
        if chat is False:
            raise ValueError(f"protocol {self.name}: the tools are declared by the chat template; a plain-text prompt "
                             "has none (drop --no_chat_template)")
        return True

    def _render(self, tokenizer, messages: List[dict], add_generation_prompt: bool) -> str:
        if tokenizer is None:
            raise ValueError(f"protocol {self.name}: rendering needs the policy's tokenizer (its template declares "
                             "the tools)")
        if not getattr(tokenizer, "chat_template", None):
            raise ValueError(f"protocol {self.name}: tokenizer {getattr(tokenizer, 'name_or_path', '')!r} has no "
                             "chat template")
        return tokenizer.apply_chat_template(messages, tools=list(self.tools), tokenize=False,
                                             add_generation_prompt=add_generation_prompt,
                                             enable_thinking=self.enable_thinking)

    def messages(self, question: str) -> List[dict]:
        """The conversation of the prompt: system instructions and the question."""
        return [{"role": "system", "content": self.system_prompt},
                {"role": "user", "content": self.normalize_question(question)}]

    def build_prompt(self, question: str, tokenizer=None, chat: Optional[bool] = None,
                     template: str = "train") -> str:
        """The system instructions and the question rendered by the policy's template with ``tools`` declared, and the
        generation prompt (with ``enable_thinking``).

        Raises:
            ValueError: no tokenizer / chat template, ``chat=False``, a template that does not write the declared
                function into the prompt (it does not support tools), empty question.
        """
        self._check_template(template)
        self.resolve_chat(chat, tokenizer)
        text = self._render(tokenizer, self.messages(question), add_generation_prompt=True)
        if f'"{self.function_name}"' not in text:
            raise ValueError(f"protocol {self.name}: the chat template of {getattr(tokenizer, 'name_or_path', '')!r} "
                             f"does not declare tools (the {self.function_name!r} signature is not in the prompt)")
        return text

    # ------------------------------------------------------------------ environment text
    def tool_turn_text(self, contents: Sequence[str], tokenizer) -> str:
        """What the environment appends after the policy's end-of-turn token: the ``tool`` messages ``contents`` as
        the policy's template renders them after an assistant message, and the next generation prompt.

        Found by rendering ``[user, assistant(<sentinel>), tool...]`` with ``add_generation_prompt`` and keeping what
        follows the sentinel and the end-of-turn text, so it is the template's own rendering (Qwen3:
        ``\\n<|im_start|>user\\n<tool_response>\\nC\\n</tool_response><|im_end|>\\n<|im_start|>assistant\\n``).

        Raises:
            ValueError: empty ``contents``, or the template does not end the assistant message with ``end_of_turn``.
        """
        if not contents:
            raise ValueError("tool_turn_text: no tool message to render")
        messages = [{"role": "user", "content": "q"}, {"role": "assistant", "content": _SENTINEL}]
        messages += [{"role": "tool", "content": c} for c in contents]
        text = self._render(tokenizer, messages, add_generation_prompt=True)
        tail = text[text.rindex(_SENTINEL) + len(_SENTINEL):]
        if not tail.startswith(self.end_of_turn):
            raise ValueError(f"protocol {self.name}: the template does not end an assistant message with "
                             f"{self.end_of_turn!r}; set end_of_turn for this template")
        return tail[len(self.end_of_turn):]

    def format_passage(self, index: int, passage: Passage) -> str:
        """``Doc i(Title: T) text``, one passage per line (Search-R1's passage line)."""
        title = passage.title.strip()
        text = " ".join(passage.text.split("\n")).strip()
        return f"Doc {index}(Title: {title}) {text}" if title else f"Doc {index} {text}"

    def escape_passage_text(self, text: str) -> str:
        """The base escaping plus the template's tool-response tags: a passage cannot close its tool message."""
        text = super().escape_passage_text(text)
        return _TOOL_RESPONSE_TAG.sub(lambda m: m.group(0).replace("<", "&lt;").replace(">", "&gt;"), text)

    def format_passages(self, passages: Sequence[Passage]) -> str:
        """The content of one tool message: the passages (escaped), one per line ("No results." when empty)."""
        if not passages:
            return "No results."
        return "\n".join(self.format_passage(i + 1, p) for i, p in enumerate(self.escape_passages(passages)))

    def render_documents(self, passages: Sequence[Passage]) -> str:
        """The content of the ``tool`` message (the template adds its own wrapping)."""
        return self.format_passages(passages)

    def invalid_call_message(self, reason: str) -> str:
        """Content of the ``tool`` message answering a malformed call, or a call over the per-message cap (the
        reasons of :meth:`parse_tool_turn`)."""
        if reason.startswith(_OVER_CAP):
            return f"{INVALID_CALL_PREFIX} {reason}."
        return (f"{INVALID_CALL_PREFIX} {reason}. Call the function as "
                f'{{"name": "{self.function_name}", "arguments": {{"query": "..."}}}}.')

    # ------------------------------------------------------------------ parsing
    def _body(self, turn_text: str) -> str:
        """The turn's own text outside its reasoning, without end-of-sequence text: what follows the last closed
        ``<think>`` block, up to a ``<think>`` left open (a draft: a turn cut by its token budget, or a block never
        closed), which never holds a call or an answer."""
        from openrlhf_search.env.rewards import strip_end_of_turn

        text = strip_end_of_turn(turn_text)
        if self.think_close in text:
            text = text[text.rindex(self.think_close) + len(self.think_close):]
        if self.think_open in text:
            text = text[:text.index(self.think_open)]
        return text

    def _call_blocks(self, body: str) -> List[Any]:
        """Each ``<tool_call>`` block of ``body``, in order, as ``json.loads`` reads it (``_NOT_JSON`` when it does
        not). A block ends at the first closing tag before which its content is valid JSON, so a closing tag inside
        a JSON string does not cut it; the last block may run to the end of the message without a closing tag (as
        vLLM's ``hermes`` parser reads it). A block that is not JSON ends at its first closing tag or at the next
        opening tag, whichever comes first, so the calls after it are still read."""
        open_tag, close_tag = self.query_open, self.query_close
        out: List[Any] = []
        pos = body.find(open_tag)
        while pos >= 0:
            start = pos + len(open_tag)
            closes = [start + m.start() for m in re.finditer(re.escape(close_tag), body[start:])]
            end, value = None, _NOT_JSON
            for cut in closes + [len(body)]:
                try:
                    value = json.loads(body[start:cut])
                except (ValueError, RecursionError):
                    continue
                end = cut
                break
            if end is None:
                following = body.find(open_tag, start)
                end = min(closes[0] if closes else len(body), following if following >= 0 else len(body))
            out.append(value)
            pos = body.find(open_tag, end)
        return out

    def parse_tool_turn(self, turn_text: str, max_calls: Optional[int] = None) -> ToolTurn:
        """The tool calls of one assistant turn (decoded with special tokens), one ``<tool_call>`` block at a time
        (:meth:`_call_blocks`): a block that is not a JSON object with ``name`` and ``arguments``, names another
        function, or has no non-empty string ``query`` is one invalid call, and the other calls of the turn are
        kept. Calls inside the reasoning block or a draft (:meth:`_body`) do not count. With ``max_calls``, the
        calls after the first ``max_calls`` are invalid too (nothing is searched for them)."""
        body = self._body(turn_text)
        if self.query_open not in body:
            return ToolTurn(final=True)
        out = ToolTurn()
        for i, value in enumerate(self._call_blocks(body)):
            if max_calls is not None and i >= max_calls:
                query, error = None, f"{_OVER_CAP} {max_calls} calls in one message; this call was not run"
            else:
                query, error = self._check_call(value)
            out.queries.append(query)
            out.errors.append(error)
        return out

    def _check_call(self, call: Any) -> Tuple[Optional[str], str]:
        """(query, "") for a well-formed ``search`` call, else (None, why not). The arguments must be a JSON object
        (a string holding JSON is not one, as for vLLM's parsers)."""
        if not isinstance(call, dict) or "name" not in call or "arguments" not in call:
            return None, "the tool call is not valid JSON with \"name\" and \"arguments\""
        name, args = call["name"], call["arguments"]
        if name != self.function_name:
            return None, f"unknown function {name!r} (the only function is {self.function_name!r})"
        if not isinstance(args, dict):
            return None, "arguments must be a JSON object"
        query = args.get("query")
        if not isinstance(query, str) or not query.strip():
            return None, "missing argument \"query\" (a non-empty string)"
        return query.strip(), ""

    def parse_action(self, turn_text: str) -> Action:
        """The turn as one :class:`Action`: "query" (the first well-formed call's query) when every call is valid,
        "invalid" when one is not, "answer" for a final message (content: :meth:`extract_answer` of it)."""
        turn = self.parse_tool_turn(turn_text)
        if turn.final:
            return Action("answer", self.extract_answer(turn_text))
        if turn.n_invalid:
            return Action("invalid", next(e for e in turn.errors if e))
        return Action("query", turn.queries[0])

    def _env_pattern(self) -> "re.Pattern":
        eot, opn, head = re.escape(self.end_of_turn), re.escape(self.turn_open), re.escape(self.assistant_header)
        if not self.enable_thinking:  # the template's empty think block after each generation prompt
            head += re.escape(self.empty_think)
        return re.compile(f"{eot}\\s*{opn}(?!assistant).*?(?:{head}|\\Z)", re.DOTALL)

    def split_turns(self, response_text: str) -> List[Segment]:
        """Model text and environment text; an environment segment runs from the end-of-turn text of the assistant
        message before it to the next generation prompt (empty think block included), so every model segment but the
        last ends with its tool calls."""
        return super().split_turns(response_text)

    def model_turns(self, response_text: str) -> List[str]:
        """The assistant messages of a response, in order (the environment's text removed)."""
        return [s.text for s in self.split_turns(response_text) if s.kind == "model"]

    def final_message(self, response_text: str) -> str:
        """The last assistant message, or "" when the last one made tool calls (no final message)."""
        turns = self.model_turns(response_text or "")
        if not turns:
            return ""
        last = turns[-1]
        return "" if self.query_open in self._body(last) else last

    def extract_answer(self, response_text: str) -> str:
        """The last ``<answer>`` block of the final message, outside its reasoning block, stripped ("" if none)."""
        blocks = self.extract_answers(response_text)
        return blocks[-1] if blocks else ""

    def extract_answers(self, response_text: str) -> List[str]:
        """The closed ``<answer>`` blocks of the final message, outside its reasoning block."""
        body = self._body(self.final_message(response_text))
        return [b.strip() for b in self._block_pattern(self.answer_open, self.answer_close).findall(body)]

    def extract_queries(self, response_text: str) -> List[str]:
        """Every well-formed search query of the response, in order."""
        out: List[str] = []
        for turn in self.model_turns(response_text or ""):
            out.extend(q for q in self.parse_tool_turn(turn).queries if q)
        return out

    def documents_blocks(self, response_text: str) -> List[str]:
        """The tool responses of the response that hold passages (invalid-call responses excluded)."""
        pattern = self._block_pattern(self.doc_open, self.doc_close)
        out = []
        for s in self.split_turns(response_text or ""):
            if s.kind == "environment":
                out.extend(self.doc_open + b + self.doc_close for b in pattern.findall(s.text)
                           if not b.strip().startswith(INVALID_CALL_PREFIX))
        return out

    def check_format(self, response_text: str, answer_max_words: int = 10) -> Tuple[bool, str]:
        """The format rule adapted to tool calls (``rewards.check_format`` delegates here).

        Correct when: no role marker or tool-response tag in the policy's own text; no invalid call in the
        trajectory; every assistant message but the last makes at least one call and the last makes none; with
        thinking on, every message opens with one closed ``<think>`` block (with thinking off the policy writes no
        think tag); the final message has exactly one non-empty ``<answer>`` block of at most ``answer_max_words``
        words after its reasoning, with nothing after it.

        Returns:
            (ok, reason): reason "" when ok, else the first failed rule.
        """
        from openrlhf_search.env.rewards import strip_end_of_turn

        text = strip_end_of_turn(response_text or "")
        segments = self.split_turns(text)
        turns = [s.text for s in segments if s.kind == "model"]
        if not turns:
            return False, "no answer block"
        for t in turns:
            for marker in self.role_markers:
                if marker in t:
                    return False, f"role leakage: {marker!r}"
        for s in segments:
            if s.kind == "environment" and INVALID_CALL_PREFIX in s.text:
                return False, "invalid tool call in trajectory"
        for i, t in enumerate(turns):
            n_open, n_close = t.count(self.think_open), t.count(self.think_close)
            if self.enable_thinking:
                if n_open != 1 or n_close != 1 or not t.lstrip().startswith(self.think_open):
                    return False, "each message must open with one closed reasoning block"
            elif n_open or n_close:
                return False, "think tag written with thinking off"
            calls = self.query_open in self._body(t)
            if i < len(turns) - 1 and not calls:
                return False, "message without a tool call before the final message"
            if i == len(turns) - 1 and calls:
                return False, "no final message (the last message makes tool calls)"
        body = self._body(turns[-1])
        error, a_open, a_close = self.answer_block(body)
        if error:
            return False, error
        words = body[a_open + len(self.answer_open):a_close].split()
        if not words:
            return False, "empty answer"
        if len(words) > answer_max_words:
            return False, f"answer has {len(words)} words (> {answer_max_words})"
        if body[a_close + len(self.answer_close):].strip():
            return False, "text after the answer"
        return True, ""


@register_protocol
class ChatToolsNoThinkProtocol(ChatToolsProtocol):
    """``chat_tools`` with ``enable_thinking=False``: the template writes an empty think block after every generation
    prompt (the first and those after tool responses), and the policy writes no reasoning."""

    name = "chat_tools_nothink"
    enable_thinking = False
