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

A query the retriever refuses (``QueryRejected``: the server answered, it found this one query bad) is the
policy's own doing, not an outage: the sample is kept and trained on, the turn gets an empty documents
block (the observation a blank query or a query without any matching passage gets, so the policy can search again
or answer), and it is counted in ``extra_logs["rejected_queries"]`` (not in ``valid_searches``). The client already
cuts a query to the server's advertised length and replaces characters UTF-8 cannot carry, so with our server a
rejection is rare; marking it ``retrieval_failed`` instead would hide a policy that writes malformed queries from
training, and at more than ``--search.max_failed_fraction`` of a batch stop the run.

``RetrievalStopped`` (a web retriever whose provider refused the API key, or whose account or run budget is spent) is
not absorbed: ``execute`` raises it, and the run stops with its one-line message.
"""

import asyncio
import logging
from copy import copy
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
        cfg, proto = self.config, self.protocol
        golds = parse_golds(label)  # fail before spending compute on a sample that cannot be scored

        tokens = self._encode(hf_tokenizer, prompt)
        if not tokens:
            raise ValueError("the prompt is empty")
        if len(tokens) >= max_length:  # as OpenRLHF's executors do: keep the end, leave one token to generate
            if max_length < 2:
                raise ValueError(f"max_length {max_length} leaves no room to generate")
            logger.warning("prompt has %d tokens, max_length is %d; keeping the last %d",
                           len(tokens), max_length, max_length - 1)
            tokens = tokens[-(max_length - 1):]
        prompt_len = len(tokens)
        native = bool(getattr(proto, "native_tools", False))  # search is a function of the chat template
        stop_ids = proto.stop_token_ids(hf_tokenizer) if native else []

        want_logprobs = sampling_params.logprobs is not None
        log_probs: Optional[List[float]] = [0.0] * prompt_len if want_logprobs else None
        action_ranges: List[Tuple[int, int]] = []
        action_versions: List[Tuple[int, int]] = []  # (first token, policy version) segments, when recorded
        logs = dict.fromkeys(ROLLOUT_LOG_KEYS, 0.0)
        trace = start_retrieval_trace()  # counts failovers of this sample's requests (RetrievalClient only)
        truncated = False  # the policy's last turn was cut by a token budget (finish_reason "length")
        context_full = False  # an environment block did not fit (the policy itself stopped properly)
        failed = False
        obs_tokens = 0
        search_trace: List[dict] = []  # per search: the query and the ids of the passages returned

        for turn in range(cfg.max_turns):
            remaining = max_length - len(tokens)
            if remaining <= 0:  # the last environment block filled the context exactly
                context_full = True
                break
            # A shallow copy is enough: only top-level fields are rebound here, and engines copy what they mutate
            # (RolloutRayActor.generate and the evaluation engines all deepcopy the params they are given).
            params = copy(sampling_params)
            if native:  # a turn is one assistant message: it ends at the end-of-turn token, kept in the output
                params.stop = []
                params.stop_token_ids = list(dict.fromkeys(list(params.stop_token_ids or []) + stop_ids))
                params._all_stop_token_ids = set(getattr(params, "_all_stop_token_ids", ()) or ()) | set(stop_ids)
            else:
                params.stop = list(proto.stop_strings) if cfg.stop_at_answer else [proto.query_close]
            params.include_stop_str_in_output = True
            params.output_text_buffer_length = 0  # derived field: no buffering when stop strings are kept
            params.max_tokens = min(cfg.max_new_tokens_per_turn, remaining)
            request_output = await llm_engine.generate(tokens, params, multi_modal_data=None)
            output = request_output.outputs[0]
            action = [int(t) for t in output.token_ids][:remaining]
            logs["turns"] += 1
            if not action:
                break
            start = len(tokens)
            tokens.extend(action)
            action_ranges.append((start, len(tokens)))
            turn_versions = getattr(request_output, SEGMENTS_ATTR, None)  # set by the async trainer's instruments
            if turn_versions is not None:
                action_versions = merge_segments(action_versions + shift_segments(turn_versions, start, len(action)))
            if want_logprobs:
                entries = output.logprobs or []
                for i, tok in enumerate(action):
                    entry = entries[i].get(tok) if i < len(entries) and entries[i] is not None else None
                    log_probs.append(float(entry.logprob) if entry is not None else 0.0)
            truncated = output.finish_reason == "length"
            logs["turns_cut"] += float(truncated)  # this turn hit its token budget (per turn or the context)

            searches = 0  # searches the environment block answers: valid once the block is appended
            if native:
                step = await self._tool_turn(action, stop_ids, turn, max_length - len(tokens), hf_tokenizer, logs,
                                             search_trace)
                if step is None:
                    break
                env_ids, searches, failed = step
                if failed:
                    break
            else:
                parsed = proto.parse_action(hf_tokenizer.decode(action, skip_special_tokens=False))
                if parsed.kind == "answer":
                    break
                query = proto.clean_query(parsed.content) if parsed.kind == "query" else ""
                if parsed.kind == "query" and not query:  # nothing left to search for: invalid, as released
                    parsed = Action("invalid", "query empty after cleaning")
                if parsed.kind == "query":
                    logs["queries"] += 1
                    if turn == cfg.max_turns - 1:
                        break  # no generation call left to read the documents
                    rejected = False
                    try:
                        passages = await self.client.search(query)
                    except RetrievalStopped:  # the retriever says the run must stop (a refused web API key, ...)
                        raise
                    except QueryRejected as e:  # the query is at fault, not the retriever: empty block, sample kept
                        rejected = True
                        passages = []
                        logs["rejected_queries"] += 1
                        logger.info("retriever refused a query of the policy; the turn gets an empty documents block "
                                    "(sample kept): %s", e)
                    except RetrievalError as e:
                        failed = True
                        logs["retrieval_failures"] += 1
                        SearchAgentExecutor.retrieval_failed_samples += 1
                        logger.warning("retrieval failed; sample marked retrieval_failed and left out of training "
                                       "(%d such samples so far in this process): %s",
                                       SearchAgentExecutor.retrieval_failed_samples, e)
                        break
                    search_trace.append({"query": parsed.content, "passage_ids": [p.id for p in passages]})
                    env_ids = self.observation_tokens(passages, hf_tokenizer)
                    searches = 0 if rejected else 1
                else:
                    logs["invalid_actions"] += 1
                    message = proto.invalid_action_message()
                    if message is None:
                        break  # R1-Searcher: an invalid turn ends the trajectory
                    if turn == cfg.max_turns - 1:
                        break  # no generation call left to read the message: it would only cost context
                    env_ids = self._encode_cached(hf_tokenizer, message)
            if env_ids is None or len(tokens) + len(env_ids) > max_length:
                # A partial block would teach the model a context it never sees in full. Not ``truncated``: the
                # policy stopped properly, so OpenRLHF's stop-properly penalty must not see it.
                context_full = True
                break
            tokens.extend(env_ids)
            obs_tokens += len(env_ids)
            if want_logprobs:
                log_probs.extend([0.0] * len(env_ids))
            logs["valid_searches"] += searches

        response_text = self._decode_response(hf_tokenizer, tokens[prompt_len:])
        result = self._reward(response_text, golds)
        reward = float(result.reward)
        score = float(result.score)
        if failed:
            reward = score = 0.0
        extra_logs = {k: float(v) for k, v in result.components.items()}
        logs.update(
            answer_present=float(bool(proto.extract_answers(response_text))),
            truncated=float(truncated),
            context_full=float(context_full),
            retrieval_failed=float(failed),
            response_tokens=float(sum(e - s for s, e in action_ranges)),
            obs_tokens=float(obs_tokens),
            retrieval_failovers=float(trace.failovers),
        )
        extra_logs.update(logs)
        return {
            "prompt": prompt,
            "label": label,
            "images": images,
            "mm_train_inputs": None,
            "reward": reward,
            "scores": score,
            "observation_tokens": tokens,
            "action_ranges": action_ranges,
            "rollout_log_probs": log_probs,
            "truncated": truncated,
            "extra_logs": extra_logs,
            "response_text": response_text,
            "search_trace": search_trace,
            "action_versions": action_versions or None,
        }

    async def _tool_turn(self, action: List[int], stop_ids: List[int], turn: int, room: int, tokenizer, logs: dict,
                         search_trace: List[dict]):
        """The environment's reply to one assistant message of a ``native_tools`` protocol (``chat_tools``).

        Every call of the message is answered by one ``tool`` message, in order: the passages of a well-formed
        ``search`` call (all of the message's queries are sent at once, so the client coalesces them), or the
        protocol's invalid-call message (a malformed call, or one past ``config.max_tool_calls_per_turn``, which is
        not searched). A message ended by another end-of-sequence id than ``end_of_turn``'s (Qwen3's
        ``<|endoftext|>``) is closed with the ``end_of_turn`` text first, so the context reads as the template
        renders it. Nothing is searched when the reply cannot fit in ``room`` tokens even with empty passages.

        Returns:
            None when the trajectory ends here (a final message, a message cut before an end-of-sequence token, or
            no generation call left to read the replies), else ``(env_ids, searches, failed)``: the tokens of the
            template's rendering of the tool messages and the next generation prompt, tokenised in one piece (None
            when they cannot fit: nothing was searched), the number of searches they answer (valid searches once
            appended), and whether a retrieval failed past the client's retries (the sample is then marked failed).
        """
        cfg, proto = self.config, self.protocol
        parsed = proto.parse_tool_turn(tokenizer.decode(action, skip_special_tokens=False),
                                       max_calls=cfg.max_tool_calls_per_turn)
        if parsed.final:
            return None
        n_calls = len(parsed.queries)
        logs["tool_calls"] += n_calls
        logs["invalid_tool_calls"] += parsed.n_invalid
        logs["invalid_actions"] += float(parsed.n_invalid > 0)
        queries = [q for q in parsed.queries if q is not None]
        logs["queries"] += len(queries)
        if action[-1] not in stop_ids or turn == cfg.max_turns - 1:
            return None  # cut before the end of the message, or no generation call left to read the replies
        # a message ended by another EOS id: the environment writes the end of the message the template renders
        close = "" if action[-1] == stop_ids[0] else proto.end_of_turn

        def render(contents: List[str]) -> List[int]:
            return self._encode(tokenizer, close + proto.tool_turn_text(contents, tokenizer))

        def reply(found: List[str]) -> List[str]:  # one content per call, in order
            it = iter(found)
            return [proto.invalid_call_message(e) if q is None else next(it)
                    for q, e in zip(parsed.queries, parsed.errors)]

        if len(render(reply([""] * len(queries)))) > room:
            return None, 0, False  # full context: not even empty passages fit, so nothing is searched (or paid)
        cleaned = [proto.clean_query(q) for q in queries]
        results = await asyncio.gather(*(self.client.search(q) for q in cleaned), return_exceptions=True)
        for r in results:
            if isinstance(r, RetrievalStopped):
                raise r
        for r in results:
            if isinstance(r, RetrievalError) and not isinstance(r, QueryRejected):
                logs["retrieval_failures"] += 1
                SearchAgentExecutor.retrieval_failed_samples += 1
                logger.warning("retrieval failed; sample marked retrieval_failed and left out of training "
                               "(%d such samples so far in this process): %s",
                               SearchAgentExecutor.retrieval_failed_samples, r)
                return [], 0, True
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
                search_trace.append({"query": q, "passage_ids": [p.id for p in passages]})
            found.append(self._cap_content(proto.render_documents(passages), tokenizer))
        return render(reply(found)), searches, False

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
