"""HF-transformers sampling behind vLLM's token-in/token-out ``generate``: ``cli.eval``'s default engine on CPU.

OpenRLHF's agent executors call ``await llm_engine.generate(prompt_token_ids, sampling_params,
multi_modal_data=None)`` on a ``RolloutRayActor`` and read ``result.outputs[0]`` (``token_ids``, ``text``,
``finish_reason``, ``logprobs``). ``HFEngine`` offers the same call on a CPU with an ordinary
``transformers`` causal LM, so the same executor code runs in ``cli.eval`` / ``cli.prepare_data`` on a machine
without vLLM's GPU build, and in tests.

What follows vLLM (v1 engine, 0.29) exactly:
- it takes a real ``vllm.SamplingParams`` and returns real ``vllm.outputs.RequestOutput`` /
  ``CompletionOutput`` objects with ``vllm.logprobs.Logprob`` entries;
- stop strings are checked on the incrementally decoded text after every sampled token with vLLM's own
  ``check_stop_strings``, so generation stops on the token that completes a stop string and never samples past it;
  the text is cut at the stop string (kept when ``include_stop_str_in_output``), the token ids are kept as sampled;
- EOS (tokenizer and generation config, unless ``ignore_eos``) and ``stop_token_ids`` end with
  ``finish_reason="stop"``; the stop token is left out of ``text`` unless ``include_stop_str_in_output``;
  ``stop_reason`` is the stop string, the stop token id, or None (EOS);
- ``max_tokens`` ends with ``finish_reason="length"``; ``min_tokens`` masks EOS / stop tokens and delays stop-string
  checks; ``temperature`` 0 is greedy; ``top_k`` / ``top_p`` filter;
- sampling is vLLM's exponential race (``vllm/v1/sample/ops/topk_topp_sampler.py: random_sample``: the token is
  ``argmax(probs / q)`` with ``q ~ Exp(1)`` per vocabulary entry), and a request with ``seed`` draws ``q`` from its
  own generator, seeded ``seed + index`` for its ``index``-th output as vLLM's parallel sampling does
  (``vllm/v1/engine/parallel_sampling.py: get_child_sampling_params``); requests without a seed share the engine's
  generator. A seeded request's tokens therefore do not depend on which other rows share its batch, on arrival order
  or on thread count: the race only flips when two candidates' scores are within float rounding of each other
  (about one token in a million), where an inverse-CDF draw flips whenever rounding moves the cumulative sum across
  the uniform draw (often, on a flat distribution);
- ``logprobs`` are the raw model log-probabilities (log-softmax of the logits before temperature / top-p, vLLM's
  default ``logprobs_mode="raw_logprobs"``) of the sampled token plus the top ``logprobs`` tokens, with ranks.

The engine never copies the model: a caller that changes the weights in place calls :meth:`HFEngine.reset_prefix_cache`.
It runs the model wherever the model's parameters are; sampling happens on the host.
Requests are served by one engine thread (started on demand, gone when idle) under a lock around the model, so
concurrent ``generate`` calls from many rollout tasks are safe and the event loop stays free for retrieval I/O
meanwhile. Decoding is
continuously batched, as in vLLM: requests waiting together are prefilled and decoded as one batch (left-padded, one
batched forward per token, up to ``max_batch_size`` rows), a request that arrives meanwhile joins the running batch at
the next token, and a finished row leaves it at once (its request is answered then). The n samples of a GRPO group
arrive together and share each forward pass; a trajectory back from the retriever does not wait for the rest of the
batch. Batched numerics differ from single-sequence ones by float rounding only, as in vLLM.

Prefix caching (vLLM's automatic prefix caching, ``enable_prefix_caching``): a multi-turn rollout sends the whole
context again at every turn (prompt + earlier turns + documents), and the samples of a group share their prompt. On a
CPU the prefill of that context is most of a turn's cost. The engine keeps the key/value states of every finished
sequence (prompt + sampled tokens), keyed by its token ids, and a new request prefills only the tokens after the
longest cached prefix of its prompt; identical prompts in one batch are prefilled once. The cache is dropped whenever
the model's weights change (any in-place update of a parameter, e.g. ``optimizer.step()``, is seen through the
tensors' version counters) and by :meth:`HFEngine.reset_prefix_cache` (vLLM's name), so a rollout never reads states
of older weights. It holds at most ``prefix_cache_mb`` MiB, least recently used first out.
"""

from collections import OrderedDict

import asyncio
import inspect
import itertools
import threading
from copy import deepcopy
from typing import List, Optional, Sequence

import torch
from vllm import SamplingParams
from vllm.logprobs import Logprob
from vllm.outputs import CompletionOutput, RequestOutput
from vllm.v1.engine.detokenizer import check_stop_strings

try:  # the cache class HF causal LMs return; models with another cache type get no prefix caching
    from transformers import DynamicCache
except ImportError:  # pragma: no cover
    DynamicCache = None


class EngineInputError(ValueError):
    """A generate request the engine cannot serve (bad params, empty prompt, multimodal data); says which."""


class EngineShutdown(RuntimeError):
    """The engine was shut down (:meth:`HFEngine.shutdown`) before this request finished."""


def _common_prefix_len(a: str, b: str) -> int:
    n = min(len(a), len(b))
    i = 0
    while i < n and a[i] == b[i]:
        i += 1
    return i


class HFEngine:
    """vLLM-compatible ``generate`` over a Hugging Face causal LM on CPU.

    Args:
        model: a ``transformers`` causal LM (e.g. ``Qwen2ForCausalLM``); shared, never copied. Its forward must accept
            ``input_ids`` [1, T], ``past_key_values`` and ``use_cache`` and return ``logits`` [1, T, V].
        tokenizer: the matching tokenizer (decoding for stop strings and ``text``).
        seed: seed of the engine's sampling generator, used by requests whose ``sampling_params.seed`` is None.
        max_model_len: most tokens (prompt + output) per sequence; ``model.config.max_position_embeddings`` by default.
        max_batch_size: most sequences decoded together (1 = one request at a time, no padding). The model's
            forward must accept ``attention_mask`` and ``position_ids`` [B, L] when it is above 1.
        prefix_cache_mb: memory for cached key/value states of earlier sequences (MiB; 0 = no prefix caching). Used
            only when the model returns a ``transformers.DynamicCache``.

    Attributes:
        stats: counters ``requests``, ``generated_tokens``, ``stopped_by_string``, ``stopped_by_token``, ``length``,
            ``batches`` (busy periods: decoding from an idle engine until it is idle again), ``max_batch_rows``
            (most rows decoded together), ``joined_rows`` (rows that joined a running batch), ``prompt_tokens``
            (prompt tokens of all rows),
            ``prefill_tokens`` (those actually run through the model) and ``prefix_cache_hit_tokens`` (those read from
            the prefix cache).
    """

    def __init__(self, model, tokenizer, seed: int = 0, max_model_len: Optional[int] = None,
                 max_batch_size: int = 16, prefix_cache_mb: float = 1024):
        self.model = model
        self.tokenizer = tokenizer
        self.seed = seed
        self._generator = torch.Generator().manual_seed(seed)
        if max_batch_size < 1:
            raise ValueError(f"max_batch_size must be >= 1, got {max_batch_size}")
        self.max_batch_size = max_batch_size
        self._lock = threading.Lock()  # the model: one batch at a time
        self._queue_lock = threading.Lock()
        self._queue: List["_Request"] = []
        self._worker: Optional[threading.Thread] = None  # the engine thread, while there is work
        self._request_counter = itertools.count()
        self._unfinished = 0
        self._stopping = False  # set by shutdown(): the engine thread leaves at the next token
        self._was_training = False  # the model's mode when the engine thread took it (restored before the last answer)
        cfg = getattr(model, "config", None)
        self.max_model_len = max_model_len or getattr(cfg, "max_position_embeddings", None) or 32768
        self.vocab_size = getattr(cfg, "vocab_size", None) or len(tokenizer)
        # Only the last position's logits are read. HF causal LMs accept ``logits_to_keep``; at prefill on a 150k
        # vocabulary the full [B, L, V] logits cost ~30x the rest of the forward (0.48 s against 0.015 s for a
        # 300-token prompt on the tiny Qwen2 here). Models without the argument get their plain forward.
        forward = getattr(model, "forward", None)
        try:
            accepts = forward is not None and "logits_to_keep" in inspect.signature(forward).parameters
        except (TypeError, ValueError):
            accepts = False
        self._forward_kwargs = {"logits_to_keep": 1} if accepts else {}
        self.stats = {"requests": 0, "generated_tokens": 0, "stopped_by_string": 0, "stopped_by_token": 0,
                      "length": 0, "batches": 0, "max_batch_rows": 0, "prompt_tokens": 0, "prefill_tokens": 0,
                      "prefix_cache_hit_tokens": 0, "joined_rows": 0}
        if prefix_cache_mb < 0:
            raise ValueError(f"prefix_cache_mb must be >= 0, got {prefix_cache_mb}")
        self.prefix_cache_bytes = int(prefix_cache_mb * 2 ** 20)
        # token ids (tuple) -> _CacheEntry (per-layer keys / values), least recently used first
        self._prefix_cache: "OrderedDict[tuple, _CacheEntry]" = OrderedDict()
        self._prefix_cache_size = 0
        self._weights_version = None

    # ------------------------------------------------------------------ public API (vLLM / RolloutRayActor shape)
    async def generate(self, prompt_token_ids: Sequence[int], sampling_params: SamplingParams,
                       multi_modal_data=None) -> RequestOutput:
        """Sample continuations of ``prompt_token_ids``; same contract as ``RolloutRayActor.generate``.

        Args:
            prompt_token_ids: prompt token ids (list of int, length T >= 1).
            sampling_params: a ``vllm.SamplingParams`` (copied; the caller's object is never modified).
            multi_modal_data: must be None (text-only engine).
        Returns:
            ``vllm.outputs.RequestOutput`` with ``prompt_token_ids`` and ``outputs`` (``sampling_params.n`` items), each
            a ``CompletionOutput`` with ``token_ids``, ``text``, ``finish_reason`` ("stop" | "length"),
            ``stop_reason`` (str | int | None) and ``logprobs`` (list of {token_id: Logprob} per output token, or None).
        Raises:
            EngineInputError: empty prompt, token id outside the vocabulary, prompt not shorter than
                ``max_model_len``, multimodal data, or unsupported params (beam search, penalties).
        """
        prompt = self._check_request(prompt_token_ids, sampling_params, multi_modal_data)
        if self._stopping:
            raise EngineShutdown("HFEngine is shut down")
        params = deepcopy(sampling_params)
        request_id = str(next(self._request_counter))
        self._unfinished += 1
        loop = asyncio.get_running_loop()
        item = _Request(request_id, prompt, params, loop.create_future(), loop)
        with self._queue_lock:
            self._queue.append(item)
        try:
            await asyncio.sleep(0)  # let requests made in the same loop iteration join the queue first
            with self._queue_lock:
                if self._worker is None:  # the engine thread exits when idle; start it again
                    self._worker = threading.Thread(target=self._work, name="HFEngine", daemon=True)
                    self._worker.start()
            return await item.future  # answered as soon as its own rows finish
        finally:
            self._unfinished -= 1

    def reset_prefix_cache(self) -> bool:
        """Drop every cached key/value state (vLLM's ``LLM.reset_prefix_cache``); returns
        True. Call it after every change of the model's weights (an optimiser step, a load): the version-counter check
        misses fused optimisers. Waits for the batch being decoded, if any."""
        with self._lock:
            self._prefix_cache.clear()
            self._prefix_cache_size = 0
            self._weights_version = None
        return True

    def shutdown(self, timeout_s: float = 60.0) -> bool:
        """Stop the engine thread at its next token and join it; requests in flight or queued fail with
        :class:`EngineShutdown`, later ``generate`` calls too. Returns True when no engine thread is left (False:
        it was still inside a forward pass after ``timeout_s`` seconds)."""
        self._stopping = True
        with self._queue_lock:
            worker = self._worker
        if worker is not None and worker is not threading.current_thread():
            worker.join(timeout_s)
            if worker.is_alive():
                return False
        with self._queue_lock:  # requests queued after the thread left
            pending, self._queue = self._queue, []
        for item in pending:
            _deliver(item, _set_exception, EngineShutdown("HFEngine is shut down"))
        return True

    def get_num_unfinished_requests(self) -> int:
        """Requests waiting or running (``RolloutRayActor.get_num_unfinished_requests``)."""
        return self._unfinished

    # ------------------------------------------------------------------ checks
    def _check_request(self, prompt_token_ids, params, multi_modal_data) -> List[int]:
        if multi_modal_data:
            raise EngineInputError("HFEngine is text-only: multi_modal_data must be None")
        if not isinstance(params, SamplingParams):
            raise EngineInputError(f"sampling_params must be vllm.SamplingParams, got {type(params).__name__}")
        prompt = [int(t) for t in prompt_token_ids]
        if not prompt:
            raise EngineInputError("prompt_token_ids is empty")
        bad = [t for t in prompt if t < 0 or t >= self.vocab_size]
        if bad:
            raise EngineInputError(f"prompt token ids outside the vocabulary [0, {self.vocab_size}): {bad[:5]}")
        if len(prompt) >= self.max_model_len:
            raise EngineInputError(f"prompt has {len(prompt)} tokens, max_model_len is {self.max_model_len}")
        if params.presence_penalty or params.frequency_penalty or params.repetition_penalty != 1.0 or params.min_p:
            raise EngineInputError("HFEngine does not implement presence/frequency/repetition penalties or min_p")
        if params.max_tokens is not None and params.max_tokens < 1:
            raise EngineInputError(f"max_tokens must be >= 1, got {params.max_tokens}")
        return prompt

    def _stop_token_ids(self, params: SamplingParams):
        """(eos ids, extra stop ids): EOS from the tokenizer and generation config, unless ignore_eos."""
        eos = set()
        if not params.ignore_eos:
            if self.tokenizer.eos_token_id is not None:
                eos.add(int(self.tokenizer.eos_token_id))
            gen_eos = getattr(getattr(self.model, "generation_config", None), "eos_token_id", None)
            if gen_eos is not None:
                eos.update(int(t) for t in (gen_eos if isinstance(gen_eos, (list, tuple)) else [gen_eos]))
        return eos, set(int(t) for t in (params.stop_token_ids or []))

    # ------------------------------------------------------------------ sampling
    @staticmethod
    def _filter_logits(logits: torch.Tensor, params: SamplingParams) -> torch.Tensor:
        """Temperature, top-k and top-p (nucleus) filtering of logits [V] (float32); returns new logits [V]."""
        logits = logits / params.temperature
        top_k = params.top_k
        if top_k is not None and 0 < top_k < logits.numel():
            kth = torch.topk(logits, top_k).values[-1]
            logits = logits.masked_fill(logits < kth, float("-inf"))
        if params.top_p < 1.0:
            sorted_logits, order = torch.sort(logits, descending=True)
            cum = torch.softmax(sorted_logits, dim=-1).cumsum(dim=-1)
            # drop tokens once the mass before them already reaches top_p (always keeps the first)
            drop_sorted = (cum - torch.softmax(sorted_logits, dim=-1)) >= params.top_p
            drop = torch.zeros_like(drop_sorted).scatter(0, order, drop_sorted)
            logits = logits.masked_fill(drop, float("-inf"))
        return logits

    def _make_logprobs_entry(self, raw_logprobs: torch.Tensor, token: int, k: int) -> dict:
        lp = float(raw_logprobs[token])
        rank = int((raw_logprobs > raw_logprobs[token]).sum()) + 1
        entry = {token: Logprob(logprob=lp, rank=rank, decoded_token=self.tokenizer.decode([token]))}
        if k and k > 0:
            vals, idx = torch.topk(raw_logprobs, k)
            for r, (v, i) in enumerate(zip(vals.tolist(), idx.tolist()), start=1):
                if i not in entry:
                    entry[i] = Logprob(logprob=v, rank=r, decoded_token=self.tokenizer.decode([i]))
        return entry

    # ------------------------------------------------------------------ scheduling
    def _work(self):
        """The engine thread: serve until the queue is empty, then exit (a later request starts a new one, so an
        idle engine holds no thread and can be garbage-collected). Whatever escapes reaches every queued request."""
        while True:
            if self._stopping:
                with self._queue_lock:
                    pending, self._queue, self._worker = self._queue, [], None
                for item in pending:
                    _deliver(item, _set_exception, EngineShutdown("HFEngine is shut down"))
                return
            try:
                self._drain()
            except BaseException as e:  # e.g. model.eval() failing: nothing may be left waiting
                with self._queue_lock:
                    pending, self._queue, self._worker = self._queue, [], None
                for item in pending:
                    _deliver(item, _set_exception, e)
                return
            with self._queue_lock:  # under the lock generate() checks: no request is left without a thread
                if not self._queue:
                    self._worker = None
                    return

    def _drain(self):
        """Serve pending requests until the queue is empty, with continuous batching (as vLLM's scheduler does).

        Requests waiting together are prefilled and decoded as one batch. A request that arrives while a batch is
        decoding joins it at the next token (up to ``max_batch_size`` rows in flight), and each request is answered
        as soon as its own rows finish, not when the whole batch does. A multi-turn rollout whose turns end at
        different times, or whose retrieval calls return at different times, so keeps one batch full instead of
        queueing small batches behind the slowest row."""
        with self._lock:
            with self._queue_lock:
                if not self._queue:
                    return
            self._was_training = self.model.training
            try:
                self._run_continuous()
            finally:
                if self._was_training:
                    self.model.train()

    def _admit(self, free_rows: int) -> List["_Request"]:
        """Pop the queued requests whose rows fit in ``free_rows``; when nothing runs, at least the first one."""
        idle = free_rows >= self.max_batch_size
        batch, rows = [], 0
        with self._queue_lock:
            while self._queue and (rows + self._queue[0].params.n <= free_rows or (idle and not batch)):
                item = self._queue.pop(0)
                batch.append(item)
                rows += item.params.n
        return batch

    def _run_continuous(self):
        """Decode until no row runs and no request waits. A failure reaches every request in flight."""
        running: Optional[_Batch] = None
        inflight: "OrderedDict[str, tuple]" = OrderedDict()  # request id -> (request, its rows)
        try:
            with torch.no_grad():
                while True:
                    if self._stopping:  # shutdown(): leave at a token boundary; every waiter learns it below
                        raise EngineShutdown("HFEngine is shut down")
                    # a model whose cache cannot be re-batched (not a DynamicCache) finishes its batch first
                    rows_now = len(running.rows) if running is not None else 0
                    items = self._admit(self.max_batch_size - rows_now) \
                        if running is None or running.reshapable else []
                    if items:
                        self.model.eval()  # again after an idle moment gave the mode back (below)
                        new_rows = [_Row(self, item, i) for item in items for i in range(item.params.n)]
                        for item in items:
                            inflight[item.request_id] = (item, [r for r in new_rows if r.item is item])
                        started = self._start(new_rows)
                        if running is None:
                            running = started
                        else:
                            running = running.merge(started)
                            self.stats["joined_rows"] += len(new_rows)
                        self.stats["max_batch_rows"] = max(self.stats["max_batch_rows"], len(running.rows))
                    if running is None:
                        return
                    running.sample()
                    if any(r.done for r in running.rows):
                        for b, r in enumerate(running.rows):
                            if r.done:
                                self._store_row(running, b)
                        running = running.keep([b for b, r in enumerate(running.rows) if not r.done])
                        if running is None:
                            self.stats["batches"] += 1
                            with self._queue_lock:
                                idle = not self._queue
                            if idle and self._was_training:
                                # the caller may read model.training the moment it is answered: give the mode back
                                # first (a request arriving meanwhile is admitted above, which sets eval again)
                                self.model.train()
                        self._answer_finished(inflight)  # counters first: a caller may read them once answered
                        if running is None:
                            continue  # admit what arrived meanwhile, or return
                    self._feed(running)
        except StopIteration as e:  # a StopIteration crossing the thread boundary would hang the awaiting task
            err = RuntimeError(f"model raised StopIteration during generation: {e!r}")
            for item, _ in inflight.values():
                _deliver(item, _set_exception, err)
        except BaseException as e:  # every waiter learns the failure; nothing hangs
            for item, _ in inflight.values():
                _deliver(item, _set_exception, e)

    def _answer_finished(self, inflight: "OrderedDict[str, tuple]") -> None:
        """Deliver (and forget) every in-flight request whose rows are all done."""
        for request_id, (item, rows) in list(inflight.items()):
            if all(r.done for r in rows):
                del inflight[request_id]
                self.stats["requests"] += 1
                _deliver(item, _set_result, RequestOutput(
                    request_id=item.request_id, prompt=None, prompt_token_ids=list(item.prompt),
                    prompt_logprobs=None, outputs=[r.completion() for r in rows], finished=True))

    # ------------------------------------------------------------------ prefix cache
    def _check_weights_version(self):
        """Drop the prefix cache when any parameter was modified in place since the last batch."""
        version = sum(p._version for p in self.model.parameters())
        if version != self._weights_version:
            self._prefix_cache.clear()
            self._prefix_cache_size = 0
            self._weights_version = version

    def _lookup(self, prompt: tuple):
        """(usable cached length c, cache entry) of the longest cached prefix of ``prompt``; c < len(prompt), so at
        least the last prompt token is run (its logits start the sampling). (0, None) without a hit."""
        best_key, best = None, 0
        for key in self._prefix_cache:
            n = min(len(key), len(prompt) - 1)
            if n > best and key[:n] == prompt[:n]:
                best_key, best = key, n
        if best_key is None:
            return 0, None
        self._prefix_cache.move_to_end(best_key)
        return best, self._prefix_cache[best_key]

    def _store(self, key: tuple, entry: "_CacheEntry"):
        if entry.nbytes > self.prefix_cache_bytes:
            return
        old = self._prefix_cache.pop(key, None)
        if old is not None:
            self._prefix_cache_size -= old.nbytes
        self._prefix_cache[key] = entry
        self._prefix_cache_size += entry.nbytes
        while self._prefix_cache_size > self.prefix_cache_bytes:
            _, dropped = self._prefix_cache.popitem(last=False)
            self._prefix_cache_size -= dropped.nbytes

    def _prefill(self, prompts: List[tuple], device, pad: int):
        """Run the uncached tail of each distinct prompt; returns (output, attention [U, W], positions [U, 1]).

        Layout of row u (width W = C + S, C = longest cached prefix, S = longest tail): left padding, the c_u cached
        tokens (their states read from the cache), left padding, the s_u tail tokens. Padding is masked out of
        attention, and ``position_ids`` continue each row's own count, so a row computes exactly what it would alone
        (up to float rounding)."""
        hits = [self._lookup(p) for p in prompts] if self.prefix_cache_bytes else [(0, None)] * len(prompts)
        C = max(c for c, _ in hits)
        S = max(len(p) - c for p, (c, _) in zip(prompts, hits))
        U = len(prompts)
        ids = torch.full((U, S), pad, dtype=torch.long)
        attention = torch.zeros((U, C + S), dtype=torch.long)
        positions = torch.zeros((U, S), dtype=torch.long)
        for u, (p, (c, _)) in enumerate(zip(prompts, hits)):
            s_u = len(p) - c
            ids[u, S - s_u:] = torch.tensor(p[c:])
            attention[u, C - c: C] = 1
            attention[u, C + S - s_u:] = 1
            positions[u, S - s_u:] = torch.arange(c, c + s_u)
            self.stats["prefill_tokens"] += s_u
            self.stats["prefix_cache_hit_tokens"] += c
        past = None
        if C > 0:
            template = next(entry.layers for c, entry in hits if c > 0)
            data = []
            for layer, (k0, v0) in enumerate(template):
                keys = k0.new_zeros((U, k0.shape[0], C, k0.shape[2]))
                values = v0.new_zeros((U, v0.shape[0], C, v0.shape[2]))
                for u, (c, entry) in enumerate(hits):
                    if c:
                        keys[u, :, C - c:] = entry.layers[layer][0][:, :c]
                        values[u, :, C - c:] = entry.layers[layer][1][:, :c]
                data.append((keys.to(device), values.to(device)))
            past = DynamicCache(ddp_cache_data=data)
        out = self.model(input_ids=ids.to(device), attention_mask=attention.to(device),
                         position_ids=positions.to(device), past_key_values=past, use_cache=True,
                         **self._forward_kwargs)
        return out, attention.to(device), positions[:, -1:].to(device)

    def _store_row(self, batch: "_Batch", b: int) -> None:
        """Cache row ``b``'s states: prompt + sampled tokens except the last one (never fed to the model)."""
        if not batch.reshapable or not self.prefix_cache_bytes:
            return
        row = batch.rows[b]
        n = len(row.prompt) + len(row.token_ids) - 1
        layers, attention, _ = batch._padded()
        valid = attention[b].nonzero().squeeze(-1)[:n]  # the row's real positions in order (padding left out)
        per_layer = [(k[b].index_select(1, valid).detach().cpu(), v[b].index_select(1, valid).detach().cpu())
                     for k, v in layers]
        self._store(tuple(row.prompt) + tuple(row.token_ids[:-1]), _CacheEntry(per_layer))

    def _start(self, rows: List["_Row"]) -> "_Batch":
        """Prefill new rows (prefix-cached, a prompt shared by several rows run once); returns their batch, whose
        logits [B, V] give each row's first token.

        Shapes: input_ids / attention_mask / position_ids [U, W] at prefill (U distinct prompts, see
        :meth:`_prefill`)."""
        device = next(self.model.parameters()).device
        pad = self.tokenizer.pad_token_id if self.tokenizer.pad_token_id is not None else 0
        if self.prefix_cache_bytes:
            self._check_weights_version()
        distinct = list(OrderedDict.fromkeys(tuple(r.prompt) for r in rows))
        self.stats["prompt_tokens"] += sum(len(r.prompt) for r in rows)
        single = len(rows) == 1 and not (self.prefix_cache_bytes and self._lookup(distinct[0])[0])
        if single:  # no padding, nothing cached: exactly the single-sequence computation
            self.stats["prefill_tokens"] += len(rows[0].prompt)
            out = self.model(input_ids=torch.tensor([rows[0].prompt], device=device), use_cache=True,
                             **self._forward_kwargs)
            attention = positions = None
        else:
            out, attention, positions = self._prefill(distinct, device, pad)
            row_prompt = [distinct.index(tuple(r.prompt)) for r in rows]
            if len(distinct) < len(rows):  # rows sharing a prompt share its prefill
                index = torch.tensor(row_prompt, device=device)
                if DynamicCache is not None and isinstance(out.past_key_values, DynamicCache):
                    out.past_key_values = DynamicCache(ddp_cache_data=[
                        (layer.keys.index_select(0, index), layer.values.index_select(0, index))
                        for layer in out.past_key_values.layers])
                else:  # another cache type: prefill every row
                    out, attention, positions = self._prefill([tuple(r.prompt) for r in rows], device, pad)
                    index = None
                if index is not None:
                    out.logits = out.logits.index_select(0, index)
                    attention, positions = attention.index_select(0, index), positions.index_select(0, index)
        # The last position's logits [B, V] come to the host once per decode step: sampling, stop rules and logprobs
        # are per-row host work (host generator, decoded text), which on a GPU would otherwise cost a device sync
        # per row. On a CPU this is the same tensor (no copy).
        return _Batch(rows, out.past_key_values, attention, positions, out.logits[:, -1].float().cpu())

    def _feed(self, batch: "_Batch") -> None:
        """One batched forward of every row's last sampled token (a finished row, kept only when the cache cannot be
        re-batched, is fed the pad token); updates the batch's cache, mask, positions and logits.

        Shapes: input_ids [B, 1], attention_mask [B, L] (L grows by one), position_ids [B, 1]; logits [B, V]."""
        device = next(self.model.parameters()).device
        pad = self.tokenizer.pad_token_id if self.tokenizer.pad_token_id is not None else 0
        fed = [not r.done for r in batch.rows]
        step_ids = torch.tensor([r.token_ids[-1] if f else pad for r, f in zip(batch.rows, fed)],
                                device=device).unsqueeze(-1)
        if batch.attention is None:
            out = self.model(input_ids=step_ids, past_key_values=batch.past, use_cache=True)
        else:
            batch.attention = torch.cat([batch.attention, torch.ones_like(batch.attention[:, :1])], dim=-1)
            batch.positions = batch.positions + 1
            out = self.model(input_ids=step_ids, attention_mask=batch.attention, position_ids=batch.positions,
                             past_key_values=batch.past, use_cache=True)
        batch.past = out.past_key_values
        batch.logits = out.logits[:, -1].float().cpu()


class _Batch:
    """Rows decoding together: their key/value cache (``past``, per layer [B, H_kv, L, D]), ``attention`` mask [B, L]
    (None for one unpadded row), last ``positions`` [B, 1] and last ``logits`` [B, V] (host)."""

    def __init__(self, rows, past, attention, positions, logits):
        self.rows, self.past, self.attention, self.positions = rows, past, attention, positions
        self.logits = logits

    @property
    def reshapable(self) -> bool:
        """Rows can join and leave (the cache is a DynamicCache whose tensors can be re-batched)."""
        return DynamicCache is not None and isinstance(self.past, DynamicCache)

    def sample(self) -> None:
        """Each running row samples its next token from its logits and applies its stop rules."""
        raw_logprobs = torch.log_softmax(self.logits, dim=-1)  # [B, V], once for the batch
        for b, row in enumerate(self.rows):
            if not row.done:
                row.step(self.logits[b], raw_logprobs[b])

    def _layers(self):
        return [(layer.keys, layer.values) for layer in self.past.layers]

    def _padded(self):
        """(layers, attention [B, L], positions [B, 1]); a single unpadded row gets an all-ones mask."""
        layers = self._layers()
        if self.attention is not None:
            return layers, self.attention, self.positions
        length = layers[0][0].shape[2]
        device = layers[0][0].device
        return (layers, torch.ones((1, length), dtype=torch.long, device=device),
                torch.full((1, 1), length - 1, dtype=torch.long, device=device))

    def merge(self, other: "_Batch") -> "_Batch":
        """This batch and ``other`` as one: both left-padded to the longer cache; padding is masked out and each row
        keeps its own positions, so every row computes what it would alone (up to float rounding)."""
        (la, aa, pa), (lb, ab, pb) = self._padded(), other._padded()
        width = max(aa.shape[1], ab.shape[1])

        def left_pad(t, by):  # [B, H, L, D] -> [B, H, L + by, D]
            return torch.nn.functional.pad(t, (0, 0, by, 0)) if by else t

        da, db = width - aa.shape[1], width - ab.shape[1]
        layers = [(torch.cat([left_pad(ka, da), left_pad(kb, db)]), torch.cat([left_pad(va, da), left_pad(vb, db)]))
                  for (ka, va), (kb, vb) in zip(la, lb)]
        attention = torch.cat([torch.nn.functional.pad(aa, (da, 0)), torch.nn.functional.pad(ab, (db, 0))])
        return _Batch(self.rows + other.rows, DynamicCache(ddp_cache_data=layers), attention,
                      torch.cat([pa, pb]), torch.cat([self.logits, other.logits]))

    def keep(self, index: List[int]) -> Optional["_Batch"]:
        """The batch of rows ``index`` only (None when empty), its cache cut to the columns they use. A cache that
        cannot be re-batched keeps every row (finished ones are fed padding) until all are done."""
        if not index:
            return None
        if len(index) == len(self.rows) or not self.reshapable:
            return self
        layers, attention, positions = self._padded()
        idx = torch.tensor(index, device=attention.device)
        attention = attention.index_select(0, idx)
        first = int(attention.any(0).nonzero()[0])  # leading columns that are padding in every kept row
        layers = [(k.index_select(0, idx)[:, :, first:], v.index_select(0, idx)[:, :, first:]) for k, v in layers]
        return _Batch([self.rows[b] for b in index], DynamicCache(ddp_cache_data=layers), attention[:, first:],
                      positions.index_select(0, idx), self.logits.index_select(0, idx.cpu()))


class _CacheEntry:
    """One cached sequence: per-layer (keys [H_kv, n, D], values [H_kv, n, D]) in host memory."""

    __slots__ = ("layers", "nbytes")

    def __init__(self, layers: list):
        self.layers = layers
        self.nbytes = sum(k.numel() * k.element_size() + v.numel() * v.element_size() for k, v in layers)


def _sample_from(probs: torch.Tensor, generator: torch.Generator) -> int:
    """One draw from the categorical ``probs`` [V] (float32, zeros allowed) by vLLM's exponential race
    (``vllm/v1/sample/ops/topk_topp_sampler.py: random_sample``): ``argmax(probs / q)`` with ``q ~ Exp(1)``, i.i.d.
    per entry, drawn from ``generator``; ``P(token = i) = probs[i] / sum(probs)`` exactly (the first of independent
    exponential clocks with rates ``probs``). ``q`` is ``-log(u)``, ``u ~ U[0, 1)`` (the same law as
    ``Tensor.exponential_``, whose CPU kernel is 4x slower). A draw only flips under a perturbation of ``probs`` when
    the two best scores are within that perturbation, so float rounding from batching or thread count almost never
    changes a seeded request's tokens. A zero-probability entry is never drawn."""
    u = torch.rand(probs.shape, generator=generator, dtype=torch.float32)
    scores = probs.detach().cpu().float() / -torch.log(u)  # u == 0 -> q = inf -> score 0: never that entry
    return int(torch.argmax(scores))


def _deliver(item, setter, value):
    try:
        item.loop.call_soon_threadsafe(setter, item.future, value)
    except RuntimeError:  # the caller's event loop is closed (cancelled run): nobody is waiting any more
        pass


def _set_result(future, value):
    if not future.done():
        future.set_result(value)


def _set_exception(future, exc):
    if not future.done():
        future.set_exception(exc)


class _Request:
    __slots__ = ("request_id", "prompt", "params", "future", "loop")

    def __init__(self, request_id, prompt, params, future, loop):
        self.request_id, self.prompt, self.params, self.future, self.loop = request_id, prompt, params, future, loop


class _Row:
    """One sequence being sampled: vLLM's per-token rules (stop tokens, stop strings, budgets, min_tokens)."""

    def __init__(self, engine: HFEngine, item: _Request, index: int):
        params = item.params
        self.engine, self.item, self.index, self.params = engine, item, index, params
        self.prompt = item.prompt
        self.eos_ids, extra = engine._stop_token_ids(params)
        self.stop_ids = self.eos_ids | extra
        self.stops = [params.stop] if isinstance(params.stop, str) else list(params.stop or [])
        budget = engine.max_model_len - len(self.prompt)
        self.max_tokens = budget if params.max_tokens is None else min(params.max_tokens, budget)
        self.min_tokens = params.min_tokens or 0
        self.want_logprobs = params.logprobs is not None
        self.generator = engine._generator
        if params.seed is not None:
            self.generator = torch.Generator().manual_seed(int(params.seed) + index)
        self.token_ids: List[int] = []
        self.logprobs: Optional[list] = [] if self.want_logprobs else None
        self.cumulative = 0.0
        self.text = ""
        self.finish_reason, self.stop_reason = "length", None
        self.done = self.max_tokens <= 0

    def step(self, logits: torch.Tensor, raw_logprobs: torch.Tensor):
        """Sample one token from ``logits`` [V] (float32; ``raw_logprobs`` = their log-softmax) and apply the stop
        rules; sets ``done``."""
        params, engine, tok = self.params, self.engine, self.engine.tokenizer
        sample_logits = logits
        if len(self.token_ids) < self.min_tokens and self.stop_ids:
            sample_logits = logits.clone()
            sample_logits[list(self.stop_ids)] = float("-inf")
        if params.temperature < 1e-5:
            token = int(torch.argmax(sample_logits))
        else:
            token = _sample_from(torch.softmax(engine._filter_logits(sample_logits, params), dim=-1), self.generator)
        self.token_ids.append(token)
        if self.want_logprobs:
            self.logprobs.append(engine._make_logprobs_entry(raw_logprobs, token, params.logprobs))
            self.cumulative += float(raw_logprobs[token])

        if token in self.stop_ids:  # stop token: kept in token_ids, left out of text unless asked for
            self.finish_reason = "stop"
            self.stop_reason = None if token in self.eos_ids else token
            shown = self.token_ids if params.include_stop_str_in_output else self.token_ids[:-1]
            self.text = tok.decode(shown, skip_special_tokens=params.skip_special_tokens)
            engine.stats["stopped_by_token"] += 1
            self.done = True
            return
        new_text = tok.decode(self.token_ids, skip_special_tokens=params.skip_special_tokens)
        new_chars = len(new_text) - _common_prefix_len(self.text, new_text)
        self.text = new_text
        if self.stops and len(self.token_ids) > self.min_tokens:
            hit = check_stop_strings(self.text, new_chars, self.stops, params.include_stop_str_in_output)
            if hit is not None:
                stop_str, truncate_to = hit
                if truncate_to != -1:
                    self.text = self.text[:truncate_to]
                self.finish_reason, self.stop_reason = "stop", stop_str
                engine.stats["stopped_by_string"] += 1
                self.done = True
                return
        if len(self.token_ids) >= self.max_tokens:
            self.done = True

    def completion(self) -> CompletionOutput:
        if self.finish_reason == "length":
            self.engine.stats["length"] += 1
        self.engine.stats["generated_tokens"] += len(self.token_ids)
        return CompletionOutput(index=self.index, text=self.text, token_ids=self.token_ids,
                                cumulative_logprob=self.cumulative if self.want_logprobs else None,
                                logprobs=self.logprobs, finish_reason=self.finish_reason,
                                stop_reason=self.stop_reason)
