"""The multi-turn search rollout: an OpenRLHF agent executor (``--train.agent_func_path openrlhf_search/env/agent.py``).

One ``execute`` call is one trajectory (``docs/design.md``, "Data flow of one step"): generate until a search call or an
answer (the engine stops at the protocol's closing tags), retrieve, append the documents block, and go on, up to
``max_turns`` generation calls and ``max_length`` tokens in all. Token-in/token-out: the prompt is tokenised once, the
tokens the policy sampled are appended exactly as sampled (never re-tokenised from text), and every environment block is
tokenised on its own, so ``action_ranges`` are the exact spans of sampled tokens (the masking rule: ``docs/design.md``,
"Masking rule"; R1-Searcher arXiv 2503.05592 sec. 3.2 "retrieve-mask", Search-R1 arXiv 2503.09516 sec. 3.1 "loss masking
for retrieved tokens").

OpenRLHF builds the executor inside each vLLM Ray actor with no arguments (``_load_agent_executor`` requires a class
named ``AgentExecutor``), so the configuration comes from ``SearchConfig.from_env()`` (env var
``OPENRLHF_SEARCH_CONFIG``, set through the Ray runtime environment).

A sample whose retrieval fails past the client's retry budget is marked ``extra_logs["retrieval_failed"] = 1.0``
with reward 0.0 and ends there: it must be dropped by the experience maker, never trained on as if the search had
returned nothing.

A query the retriever refuses (``QueryRejected``: the server is up and found this one query bad) is the policy's own
doing: the sample is kept and trained on, the turn gets an empty documents block, and it is counted in
``extra_logs["rejected_queries"]`` (not in ``valid_searches``); marking it failed would hide a policy that writes
malformed queries from training.

``RetrievalStopped`` (a web retriever whose provider refused the API key, or whose account or run budget is spent) is
not absorbed: ``execute`` raises it, and the run stops with its one-line message.
"""

import asyncio
import logging
from copy import copy
from dataclasses import dataclass
from typing import Dict, List, Optional, Tuple

import openrlhf_search._cpu_compat  # noqa: F401  (before openrlhf)
from openrlhf.utils.agent import AgentExecutorBase

from openrlhf_search.env.config import ConfigError, SearchConfig
from openrlhf_search.env.metrics import parse_golds
from openrlhf_search.env.policy_versions import SEGMENTS_ATTR, merge_segments, shift_segments
from openrlhf_search.env.protocol import Protocol, get_protocol
from openrlhf_search.env.retrieval_client import (QueryRejected, RetrievalClient, RetrievalError, RetrievalStopped,
                                              start_retrieval_trace)
from openrlhf_search.env.types import Action

logger = logging.getLogger(__name__)

# Keys of ``extra_logs`` written by the executor itself (reward components are added next to them).
ROLLOUT_LOG_KEYS = ("turns", "turns_cut", "valid_searches", "queries", "answer_present", "truncated", "context_full",
                    "retrieval_failures", "retrieval_failed", "response_tokens", "obs_tokens", "invalid_actions",
                    "retrieval_failovers", "rejected_queries", "tool_calls", "invalid_tool_calls")


@dataclass(frozen=True)
class TurnReply:
    """The environment's reply to one policy turn.

    Attributes:
        env_ids: the token ids to append (a documents block, tool messages, an invalid-action message); None when
            the reply cannot fit in the context (the trajectory ends with ``context_full``).
        searches: how many searches it answers (counted in ``valid_searches`` once appended).
    """

    env_ids: Optional[List[int]]
    searches: int = 0


class _Rollout:
    """One trajectory as ``execute`` builds it: the tokens so far and what its logs report."""

    def __init__(self, prompt_tokens: List[int], max_length: int, want_logprobs: bool, stop_ids: List[int]):
        self.tokens = prompt_tokens
        self.prompt_len = len(prompt_tokens)
        self.max_length = max_length
        self.stop_ids = stop_ids  # native tool calls: the ids that end an assistant message, end_of_turn's first
        self.log_probs: Optional[List[float]] = [0.0] * self.prompt_len if want_logprobs else None
        self.action_ranges: List[Tuple[int, int]] = []
        self.action_versions: List[Tuple[int, int]] = []  # (first token, policy version) segments, when recorded
        self.last_action: List[int] = []
        self.logs = dict.fromkeys(ROLLOUT_LOG_KEYS, 0.0)
        self.search_trace: List[dict] = []  # per search: the query and the ids of the passages returned
        self.truncated = False  # the policy's last turn was cut by a token budget (finish_reason "length")
        self.context_full = False  # an environment block did not fit (the policy itself stopped properly)
        self.failed = False  # a retrieval failed past the client's retries
        self.obs_tokens = 0

    @property
    def room(self) -> int:
        """Tokens left in the context."""
        return self.max_length - len(self.tokens)

    def add_action(self, request_output, remaining: int) -> bool:
        """Append the tokens one generation call sampled (at most ``remaining``); False when it sampled none."""
        output = request_output.outputs[0]
        action = [int(t) for t in output.token_ids][:remaining]
        self.logs["turns"] += 1
        if not action:
            return False
        start = len(self.tokens)
        self.tokens.extend(action)
        self.last_action = action
        self.action_ranges.append((start, len(self.tokens)))
        turn_versions = getattr(request_output, SEGMENTS_ATTR, None)  # set by the async trainer's instruments
        if turn_versions is not None:
            self.action_versions = merge_segments(self.action_versions
                                                  + shift_segments(turn_versions, start, len(action)))
        if self.log_probs is not None:
            entries = output.logprobs or []
            for i, tok in enumerate(action):
                entry = entries[i].get(tok) if i < len(entries) and entries[i] is not None else None
                self.log_probs.append(float(entry.logprob) if entry is not None else 0.0)
        self.truncated = output.finish_reason == "length"
        self.logs["turns_cut"] += float(self.truncated)  # this turn hit its token budget (per turn or the context)
        return True

    def add_observation(self, reply: TurnReply) -> bool:
        """Append the environment's reply; False (nothing appended) when it does not fit in the context."""
        if reply.env_ids is None or len(self.tokens) + len(reply.env_ids) > self.max_length:
            return False
        self.tokens.extend(reply.env_ids)
        self.obs_tokens += len(reply.env_ids)
        if self.log_probs is not None:
            self.log_probs.extend([0.0] * len(reply.env_ids))
        self.logs["valid_searches"] += reply.searches
        return True


class SearchAgentExecutor(AgentExecutorBase):
    """Search-agent rollout with OpenRLHF's executor contract.

    Args:
        config: the search environment; ``SearchConfig.from_env()`` when None (how OpenRLHF builds it).
        retrieval_client: anything with ``async search(query) -> list[Passage]``; a ``RetrievalClient`` built from
            the config when None. Shared by every concurrent ``execute`` call, which is what lets it coalesce
            queries of concurrent samples into one HTTP request.
        protocol: a ``Protocol`` instance overriding ``config.protocol`` (tests, third protocols).

    Class attributes:
        retrieval_failed_samples: running count of samples marked failed in this process (logged with each failure).
    """

    retrieval_failed_samples = 0

    def __init__(self, config: Optional[SearchConfig] = None, retrieval_client=None,
                 protocol: Optional[Protocol] = None):
        self.config = config if config is not None else SearchConfig.from_env()
        from openrlhf_search.env.rewards import REWARD_SCHEMES

        if self.config.reward_scheme not in REWARD_SCHEMES:  # fail when the vLLM actor starts, not at the 1st reward
            raise ConfigError(f"search config: unknown reward_scheme {self.config.reward_scheme!r}; "
                              f"known: {sorted(REWARD_SCHEMES)}")
        self.protocol = protocol if protocol is not None else get_protocol(self.config.protocol)
        if self.config.passage_format or self.config.query_cleaning:  # ConfigError on a name the protocol lacks
            self.protocol = self.protocol.with_options(self.config.passage_format, self.config.query_cleaning)
        self.client = retrieval_client if retrieval_client is not None else RetrievalClient.from_config(self.config)
        self._token_cache: Dict[Tuple[int, str], List[int]] = {}

    # ------------------------------------------------------------------ tokenisation helpers
    @staticmethod
    def _encode(tokenizer, text: str) -> List[int]:
        # Fast tokenizers: call the Rust backend directly (transformers' __call__ ends in the same
        # ``encode_batch``; its Python wrapping is ~25% of the executor's own time per turn).
        # The backend keeps padding/truncation state from earlier padded calls (a trainer's batch): then go the
        # long way, which resets it.
        backend = getattr(tokenizer, "backend_tokenizer", None) if getattr(tokenizer, "is_fast", False) else None
        if backend is not None and backend.padding is None and backend.truncation is None:
            return backend.encode(text, add_special_tokens=False).ids
        return list(tokenizer(text, add_special_tokens=False)["input_ids"])

    @staticmethod
    def _encode_passages(tokenizer, text: str) -> List[int]:
        """Token ids of retrieved text with the tokenizer's special-token strings split into ordinary tokens: a
        passage holding ``<|im_end|>`` or ``</s>`` must not put a real special token into the policy's context (the
        protocol already escapes its own tags and ``<|name|>`` strings; this covers any other tokenizer's)."""
        backend = getattr(tokenizer, "backend_tokenizer", None) if getattr(tokenizer, "is_fast", False) else None
        prev = getattr(backend, "encode_special_tokens", None)
        try:
            if prev is not None and backend.padding is None and backend.truncation is None:
                backend.encode_special_tokens = True
                return backend.encode(text, add_special_tokens=False).ids
            return list(tokenizer(text, add_special_tokens=False, split_special_tokens=True)["input_ids"])
        finally:
            if prev is not None:  # restored: transformers' split_special_tokens=True leaves it set
                backend.encode_special_tokens = prev

    def _encode_cached(self, tokenizer, text: str) -> List[int]:
        key = (id(tokenizer), text)
        ids = self._token_cache.get(key)
        if ids is None:
            ids = self._token_cache[key] = self._encode(tokenizer, text)
        return ids

    def observation_tokens(self, passages, tokenizer) -> List[int]:
        """Token ids of one documents block, at most ``config.max_obs_tokens`` long (no cap when it is None).

        ``obs_cut`` "body": ``doc_open``, the passages body and ``doc_close`` are tokenised separately; only the body
        is cut (at a token boundary that does not split a character), so the closing tag is always kept; when the
        tags alone exceed the cap the body is empty. "block": the whole block is tokenised as one string and its
        first ``max_obs_tokens`` tokens are kept, closing tag or not (Search-R1's released cut). Returns list[int].
        """
        cap = self.config.max_obs_tokens
        if self.config.obs_cut == "block":
            block = self.protocol.render_documents(passages)
            # one string, as released; special-token strings split unless the tags themselves are special tokens
            tags = self.protocol.doc_open + self.protocol.doc_close
            tags_special = self._encode_cached(tokenizer, tags) != self._encode_passages(tokenizer, tags)
            ids = self._encode(tokenizer, block) if tags_special else self._encode_passages(tokenizer, block)
            return ids if cap is None else ids[:cap]
        open_ids = self._encode_cached(tokenizer, self.protocol.doc_open)
        close_ids = self._encode_cached(tokenizer, self.protocol.doc_close)
        body_ids = self._encode_passages(tokenizer, self.protocol.format_passages(passages))
        if cap is None:
            return open_ids + body_ids + close_ids
        room = max(0, cap - len(open_ids) - len(close_ids))
        if len(body_ids) > room:
            body_ids = body_ids[:room]
            # do not end on half a UTF-8 character (the model would read a replacement char)
            while body_ids and tokenizer.decode(body_ids[-1:]).endswith("\ufffd") and \
                    tokenizer.decode(body_ids).endswith("\ufffd"):
                body_ids = body_ids[:-1]
        return open_ids + body_ids + close_ids

    def _decode_response(self, tokenizer, ids: List[int]) -> str:
        # Special tokens stay visible (role leakage is a format error), the final EOS is not part of the answer text.
        if ids and ids[-1] == tokenizer.eos_token_id:
            ids = ids[:-1]
        return tokenizer.decode(ids, skip_special_tokens=False)

    # ------------------------------------------------------------------ the rollout
    async def execute(self, prompt, label, sampling_params, max_length: int, hf_tokenizer, llm_engine, images=None):
        """Roll out one trajectory and score it.

        Args:
            prompt: the rendered prompt text (``protocol.build_prompt``).
            label: gold answer(s): a string, a JSON list string, a list, or ``{"target": [...]}``.
            sampling_params: ``vllm.SamplingParams`` of the run (temperature, top_p, logprobs...); per turn a copy
                gets ``stop = protocol.stop_strings`` (only the end-of-query tag with ``config.stop_at_answer``
                false; native tool calls: no stop strings and ``stop_token_ids`` += ``protocol.stop_token_ids``, every
                EOS id of the model), ``include_stop_str_in_output=True`` and
                ``max_tokens = min(max_new_tokens_per_turn, max_length - tokens so far)``.
            max_length: total token budget (prompt + every action and observation).
            hf_tokenizer: the policy's tokenizer.
            llm_engine: anything with ``async generate(prompt_token_ids, sampling_params, multi_modal_data=None)``
                returning a vLLM ``RequestOutput`` (``RolloutRayActor``, ``VLLMInProcessEngine``).
            images: unsupported (text-only search agent); must be None.
        Returns:
            OpenRLHF's executor dict: ``prompt``, ``label``, ``images``, ``mm_train_inputs`` (None),
            ``observation_tokens`` (list[int], length L <= max_length), ``action_ranges`` (list of (start, end)
            token spans the policy sampled), ``rollout_log_probs`` (list[float] of length L: sampled log-probs on
            action tokens, 0.0 elsewhere; None when ``sampling_params.logprobs`` is None), ``reward`` and ``scores``
            (floats), ``truncated`` (bool: the last generation call ended on a token budget, finish_reason
            "length"; a documents block that did not fit is ``extra_logs["context_full"]`` instead), ``extra_logs``
            (dict of floats, keys ``ROLLOUT_LOG_KEYS`` + reward components), plus ``response_text`` (decoded text
            after the prompt) and ``search_trace`` (one ``{"query", "passage_ids"}`` per search that returned, in
            turn order: the ids of the passages the documents block was made of; per-question evaluation records) and
            ``action_versions``: ``[(first_token_index, policy_version)]`` segments over ``observation_tokens``
            giving the policy version that sampled each action token (a segment runs to the next one's first index),
            when the engine tags its outputs (async training: :mod:`openrlhf_search.env.policy_versions`), else None.
        Raises:
            ValueError: images given, unreadable label, or a prompt that leaves no room to generate.
        """
        if images:
            raise ValueError("SearchAgentExecutor is text-only: images are not supported")
        golds = parse_golds(label)  # fail before spending compute on a sample that cannot be scored
        native = bool(getattr(self.protocol, "native_tools", False))  # search is a function of the chat template
        rollout = _Rollout(self._prompt_tokens(hf_tokenizer, prompt, max_length), max_length,
                           want_logprobs=sampling_params.logprobs is not None,
                           stop_ids=self.protocol.stop_token_ids(hf_tokenizer) if native else [])
        trace = start_retrieval_trace()  # counts failovers of this sample's requests (RetrievalClient only)
        handle_turn = self._tool_turn if native else self._tag_turn

        for turn in range(self.config.max_turns):
            remaining = rollout.room
            if remaining <= 0:  # the last environment block filled the context exactly
                rollout.context_full = True
                break
            params = self._turn_params(sampling_params, remaining, rollout.stop_ids, native)
            request_output = await llm_engine.generate(rollout.tokens, params, multi_modal_data=None)
            if not rollout.add_action(request_output, remaining):
                break
            reply = await handle_turn(rollout, turn, hf_tokenizer)
            if reply is None:
                break
            if not rollout.add_observation(reply):
                # A partial block would teach the model a context it never sees in full. Not ``truncated``: the
                # policy stopped properly, so OpenRLHF's stop-properly penalty must not see it.
                rollout.context_full = True
                break
        return self._result(rollout, prompt, label, images, golds, hf_tokenizer, trace)

    def _prompt_tokens(self, tokenizer, prompt: str, max_length: int) -> List[int]:
        """The prompt's token ids, cut to its last ``max_length - 1`` tokens when it leaves no room to generate."""
        tokens = self._encode(tokenizer, prompt)
        if not tokens:
            raise ValueError("the prompt is empty")
        if len(tokens) >= max_length:  # as OpenRLHF's executors do: keep the end, leave one token to generate
            if max_length < 2:
                raise ValueError(f"max_length {max_length} leaves no room to generate")
            logger.warning("prompt has %d tokens, max_length is %d; keeping the last %d",
                           len(tokens), max_length, max_length - 1)
            tokens = tokens[-(max_length - 1):]
        return tokens

    def _turn_params(self, sampling_params, remaining: int, stop_ids: List[int], native: bool):
        """The run's sampling params for one generation call: the protocol's stops, at most ``remaining`` tokens."""
        # A shallow copy is enough: only top-level fields are rebound here, and engines copy what they mutate
        # (RolloutRayActor.generate and the evaluation engines all deepcopy the params they are given).
        params = copy(sampling_params)
        if native:  # a turn is one assistant message: it ends at the end-of-turn token, kept in the output
            params.stop = []
            params.stop_token_ids = list(dict.fromkeys(list(params.stop_token_ids or []) + stop_ids))
            params._all_stop_token_ids = set(getattr(params, "_all_stop_token_ids", ()) or ()) | set(stop_ids)
        else:
            proto = self.protocol
            params.stop = list(proto.stop_strings) if self.config.stop_at_answer else [proto.query_close]
        params.include_stop_str_in_output = True
        params.output_text_buffer_length = 0  # derived field: no buffering when stop strings are kept
        params.max_tokens = min(self.config.max_new_tokens_per_turn, remaining)
        return params

    def _retrieval_failed(self, rollout: _Rollout, error: Exception) -> None:
        """Mark the sample failed (left out of training) after a retrieval failed past the client's retries."""
        rollout.failed = True
        rollout.logs["retrieval_failures"] += 1
        SearchAgentExecutor.retrieval_failed_samples += 1
        logger.warning("retrieval failed; sample marked retrieval_failed and left out of training "
                       "(%d such samples so far in this process): %s",
                       SearchAgentExecutor.retrieval_failed_samples, error)

    async def _tag_turn(self, rollout: _Rollout, turn: int, tokenizer) -> Optional[TurnReply]:
        """The environment's reply to one turn of a tag protocol (``searchr1``, ``r1searcher``).

        A search call is answered by the documents block of its passages (an empty block when the retriever refuses
        the query), an invalid turn by the protocol's invalid-action message. Returns None when the trajectory ends
        here: an answer, a failed retrieval (``rollout.failed``), a protocol that ends on an invalid turn, or no
        generation call left to read the reply.
        """
        cfg, proto, logs = self.config, self.protocol, rollout.logs
        parsed = proto.parse_action(tokenizer.decode(rollout.last_action, skip_special_tokens=False))
        if parsed.kind == "answer":
            return None
        query = proto.clean_query(parsed.content) if parsed.kind == "query" else ""
        if parsed.kind == "query" and not query:  # nothing left to search for: invalid, as released
            parsed = Action("invalid", "query empty after cleaning")
        last_turn = turn == cfg.max_turns - 1
        if parsed.kind != "query":
            logs["invalid_actions"] += 1
            message = proto.invalid_action_message()
            if message is None or last_turn:  # R1-Searcher ends on an invalid turn; a last message costs context
                return None
            return TurnReply(self._encode_cached(tokenizer, message))
        logs["queries"] += 1
        if last_turn:
            return None  # no generation call left to read the documents
        try:
            passages = await self.client.search(query)
        except RetrievalStopped:  # the retriever says the run must stop (a refused web API key, ...)
            raise
        except QueryRejected as e:  # the query is at fault, not the retriever: empty block, sample kept
            logs["rejected_queries"] += 1
            logger.info("retriever refused a query of the policy; the turn gets an empty documents block "
                        "(sample kept): %s", e)
            rollout.search_trace.append({"query": parsed.content, "passage_ids": []})
            return TurnReply(self.observation_tokens([], tokenizer), searches=0)
        except RetrievalError as e:
            self._retrieval_failed(rollout, e)
            return None
        rollout.search_trace.append({"query": parsed.content, "passage_ids": [p.id for p in passages]})
        return TurnReply(self.observation_tokens(passages, tokenizer), searches=1)

    async def _tool_turn(self, rollout: _Rollout, turn: int, tokenizer) -> Optional[TurnReply]:
        """The environment's reply to one assistant message of a ``native_tools`` protocol (``chat_tools``).

        Every call of the message is answered by one ``tool`` message, in order: the passages of a well-formed
        ``search`` call (all of the message's queries are sent at once, so the client coalesces them), or the
        protocol's invalid-call message (a malformed call, or one past ``config.max_tool_calls_per_turn``, which is
        not searched). A message ended by another end-of-sequence id than ``end_of_turn``'s (Qwen3's
        ``<|endoftext|>``) is closed with the ``end_of_turn`` text first, so the context reads as the template
        renders it. Nothing is searched when the reply cannot fit in the context even with empty passages.

        Returns:
            None when the trajectory ends here (a final message, a message cut before an end-of-sequence token, no
            generation call left to read the replies, or a retrieval failed past the client's retries:
            ``rollout.failed``), else the template's rendering of the tool messages and the next generation prompt,
            tokenised in one piece (``env_ids`` None when they cannot fit: nothing was searched), with the number of
            searches they answer.
        """
        cfg, proto, logs = self.config, self.protocol, rollout.logs
        action, stop_ids = rollout.last_action, rollout.stop_ids
        parsed = proto.parse_tool_turn(tokenizer.decode(action, skip_special_tokens=False),
                                       max_calls=cfg.max_tool_calls_per_turn)
        if parsed.final:
            return None
        logs["tool_calls"] += len(parsed.queries)
        logs["invalid_tool_calls"] += parsed.n_invalid
        logs["invalid_actions"] += float(parsed.n_invalid > 0)
        queries = [q for q in parsed.queries if q is not None]
        logs["queries"] += len(queries)
        if action[-1] not in stop_ids or turn == cfg.max_turns - 1:
            return None  # cut before the end of the message, or no generation call left to read the replies
        # a message ended by another EOS id: the environment writes the end of the message the template renders
        close = "" if action[-1] == stop_ids[0] else proto.end_of_turn

        def render(found: List[str]) -> List[int]:  # one content per well-formed call, in order
            it = iter(found)
            contents = [proto.invalid_call_message(e) if q is None else next(it)
                        for q, e in zip(parsed.queries, parsed.errors)]
            return self._encode(tokenizer, close + proto.tool_turn_text(contents, tokenizer))

        if len(render([""] * len(queries))) > rollout.room:
            return TurnReply(None)  # full context: not even empty passages fit, so nothing is searched (or paid)
        cleaned = [proto.clean_query(q) for q in queries]
        results = await asyncio.gather(*(self.client.search(q) for q in cleaned), return_exceptions=True)
        for r in results:
            if isinstance(r, RetrievalStopped):
                raise r
        for r in results:
            if isinstance(r, RetrievalError) and not isinstance(r, QueryRejected):
                self._retrieval_failed(rollout, r)
                return None
            if isinstance(r, BaseException) and not isinstance(r, QueryRejected):
                raise r
        found: List[str] = []
        searches = 0
        for q, passages in zip(queries, results):
            if isinstance(passages, QueryRejected):
                logs["rejected_queries"] += 1
                passages = []
            else:
                searches += 1
                rollout.search_trace.append({"query": q, "passage_ids": [p.id for p in passages]})
            found.append(self._cap_content(proto.render_documents(passages), tokenizer))
        return TurnReply(render(found), searches)

    def _result(self, rollout: _Rollout, prompt, label, images, golds: List[str], tokenizer, trace) -> dict:
        """OpenRLHF's executor dict for a finished trajectory (see :meth:`execute`), scored."""
        response_text = self._decode_response(tokenizer, rollout.tokens[rollout.prompt_len:])
        result = self._reward(response_text, golds)
        reward, score = (0.0, 0.0) if rollout.failed else (float(result.reward), float(result.score))
        extra_logs = {k: float(v) for k, v in result.components.items()}
        extra_logs.update(rollout.logs)
        extra_logs.update(
            answer_present=float(bool(self.protocol.extract_answers(response_text))),
            truncated=float(rollout.truncated),
            context_full=float(rollout.context_full),
            retrieval_failed=float(rollout.failed),
            response_tokens=float(sum(e - s for s, e in rollout.action_ranges)),
            obs_tokens=float(rollout.obs_tokens),
            retrieval_failovers=float(trace.failovers),
        )
        return {
            "prompt": prompt,
            "label": label,
            "images": images,
            "mm_train_inputs": None,
            "reward": reward,
            "scores": score,
            "observation_tokens": rollout.tokens,
            "action_ranges": self._trained_ranges(rollout),
            "rollout_log_probs": rollout.log_probs,
            "truncated": rollout.truncated,
            "extra_logs": extra_logs,
            "response_text": response_text,
            "search_trace": rollout.search_trace,
            "action_versions": rollout.action_versions or None,
        }

    def _trained_ranges(self, rollout: _Rollout) -> List[Tuple[int, int]]:
        """The spans the loss covers: the sampled ones, or with ``mask_retrieved`` false the whole response."""
        if self.config.mask_retrieved or len(rollout.tokens) <= rollout.prompt_len:
            return rollout.action_ranges
        return [(rollout.prompt_len, len(rollout.tokens))]

    def _cap_content(self, content: str, tokenizer) -> str:
        """One tool message's content cut to ``max_obs_tokens`` tokens (at a token boundary, whole characters)."""
        cap = self.config.max_obs_tokens
        if cap is None:
            return content
        ids = self._encode(tokenizer, content)
        if len(ids) <= cap:
            return content
        return tokenizer.decode(ids[:cap], skip_special_tokens=False).rstrip("\ufffd")

    def _reward(self, response_text: str, golds: List[str]):
        from openrlhf_search.env.rewards import compute_reward

        return compute_reward(self.config.reward_scheme, response_text, golds, self.protocol,
                              answer_max_words=self.config.answer_max_words)


# The name OpenRLHF's ``_load_agent_executor`` looks up (it calls it with no arguments).
AgentExecutor = SearchAgentExecutor
