"""Resolve a model name to a local folder before loading it, so that a hub model that cannot be had fails in one line.

Without this, ``SentenceTransformer("org/name")`` or ``from_pretrained("org/name")`` on a machine without network
retries every file request five times (huggingface_hub's ``http_backoff``): about 100 s and 77 log lines of retry
warnings before the real error. Order of checks: a local folder; the local Hugging Face cache
(``snapshot_download(local_files_only=True)``); then, unless ``HF_HUB_OFFLINE=1``, one metadata request to the hub
(``model_info``, no retries, short timeout) to tell "no network" and "no such model" apart before any download.
"""

from __future__ import annotations

import os

HUB_TIMEOUT_S = 10.0


def _hub_offline() -> bool:
    from huggingface_hub import constants

    return bool(constants.HF_HUB_OFFLINE) or os.environ.get("HF_HUB_OFFLINE", "").upper() in ("1", "ON", "YES", "TRUE")


def resolve_model_path(name: str, what: str = "model", timeout: float = HUB_TIMEOUT_S) -> str:
    """Local folder for ``name`` (a path, or a hub id already in the local HF cache), or ``name`` itself when the hub
    answers that the model exists (the caller's loader then downloads it).

    Args:
        name: a folder path or a hub id such as ``intfloat/e5-base-v2``.
        what: the kind of model, for the error message (``encoder``, ``policy``...).
        timeout: seconds for the single hub metadata request.
    Raises:
        ValueError: one line naming the model and what to do: not a folder and not cached while offline
            (``HF_HUB_OFFLINE=1`` or the hub unreachable), or no such model on the hub.
    """
    if os.path.isdir(name):
        return name
    if os.path.exists(name):
        raise ValueError(f"cannot load {what} {name!r}: a file, not a model folder")
    looks_like_path = name.startswith((".", "/", "~")) or name.count("/") > 1 or os.sep + os.sep in name
    if looks_like_path:
        raise ValueError(f"cannot load {what} {name!r}: no such folder (relative paths are resolved against "
                         f"{os.getcwd()})")
    from huggingface_hub import model_info, snapshot_download
    from huggingface_hub.errors import HFValidationError, RepositoryNotFoundError

    try:
        return snapshot_download(name, local_files_only=True)
    except HFValidationError as e:
        raise ValueError(f"cannot load {what} {name!r}: not a folder and not a valid hub id ({e})") from None
    except OSError:  # LocalEntryNotFoundError: not in the cache
        pass
    fetch_hint = (f"download it where there is network (`hf download {name}`, then copy "
                  f"~/.cache/huggingface/hub or set HF_HOME) or pass a local folder")
    if _hub_offline():
        raise ValueError(f"cannot load {what} {name!r}: not a local folder and not in the Hugging Face cache "
                         f"(HF_HUB_OFFLINE=1): {fetch_hint}")
    try:
        model_info(name, timeout=timeout)
    except RepositoryNotFoundError:
        raise ValueError(f"cannot load {what} {name!r}: no such model on the Hugging Face hub (or it is private/gated: "
                         f"run `hf auth login`), and not a local folder") from None
    except Exception as e:  # network errors (httpx.ConnectError, timeouts): no hub reachable
        raise ValueError(f"cannot load {what} {name!r}: not a local folder, not in the Hugging Face cache, and "
                         f"the hub is unreachable ({type(e).__name__}: {e}): {fetch_hint}") from None
    return name
