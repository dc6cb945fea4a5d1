"""The policy's tokenizer sent to the rollout actors once per process instead of once per prompt.

OpenRLHF 0.11.2's ``SamplesGenerator._dispatch_prompts_to_vllm`` passes ``hf_tokenizer=self.tokenizer`` with every
``generate_responses`` call. A Qwen2.5 tokenizer pickles to ~10 MB (about 0.35 s to pickle, 0.7 s to unpickle), so a
Search-R1 step of 512 prompts moved ~5 GB through Ray, and each call gave the rollout actor a new tokenizer object,
so the executor's token cache (keyed by ``id(tokenizer)``) never hit and grew for the whole run.

:class:`TokenizerHandle` puts the pickled tokenizer in Ray's object store once and pickles itself as ``(key,
ObjectRef)``, a few hundred bytes; unpickled in a rollout actor it returns the tokenizer from a per-process cache
(:func:`resolve_tokenizer`), so ``id(tokenizer)`` is stable, the executor's cache hits, and the executor receives a
real tokenizer. The key is the SHA-256 of the pickled tokenizer: equal tokenizers (training and eval) share one copy
per process, and a changed one is never served from a stale entry.
"""

import hashlib
import pickle
import threading
from typing import Any, Dict

_CACHE: Dict[str, Any] = {}
_LOCK = threading.Lock()
_LOADS = {"count": 0}


def resolve_tokenizer(key: str, ref) -> Any:
    """The tokenizer of ``key`` in this process: cached, or fetched with ``ray.get(ref)`` and unpickled (once).

    Called by pickle when a :class:`TokenizerHandle` is unpickled (inside Ray's argument deserialisation)."""
    tok = _CACHE.get(key)
    if tok is not None:
        return tok
    with _LOCK:
        tok = _CACHE.get(key)
        if tok is None:
            import ray

            # This runs while Ray deserialises a call's arguments, on an async rollout actor's event-loop thread:
            # the loop waits here once per process (~1 s for Qwen2.5's tokenizer; Ray logs "Using blocking
            # ray.get inside async actor" once). A fetch from a helper thread deadlocks inside deserialisation.
            tok = pickle.loads(ray.get(ref))
            _CACHE[key] = tok
            _LOADS["count"] += 1
    return tok


def tokenizer_loads() -> int:
    """How many tokenizers this process has fetched and unpickled through :func:`resolve_tokenizer`."""
    return _LOADS["count"]


class TokenizerHandle:
    """A tokenizer as a Ray call argument: pickles to ``(key, ObjectRef)``, unpickles to the tokenizer itself.

    Args:
        tokenizer: any picklable tokenizer (``transformers`` fast or slow). Needs an initialised Ray (``ray.put``).

    The creating process caches its own object under the key, so a handle unpickled there returns ``tokenizer``.
    The object store keeps one copy for as long as the handle lives (the samples generator keeps it for the run).
    """

    def __init__(self, tokenizer):
        import ray

        blob = pickle.dumps(tokenizer, protocol=pickle.HIGHEST_PROTOCOL)
        self.key = hashlib.sha256(blob).hexdigest()
        self.nbytes = len(blob)
        self.ref = ray.put(blob)
        self.tokenizer = tokenizer
        with _LOCK:
            _CACHE.setdefault(self.key, tokenizer)

    def __reduce__(self):
        return resolve_tokenizer, (self.key, self.ref)

    def __repr__(self) -> str:
        return f"TokenizerHandle(key={self.key[:12]}, {self.nbytes / 1e6:.1f} MB in the object store)"
