"""Check that a policy named on the command line exists before a run starts, and say where it was checked.

A local folder must hold ``config.json``. A hub name (``org/name``) is looked up in the local Hugging Face cache, then
on the hub (``HfApi.model_info``); offline, a name found in neither is refused unless it is one of the launchers'
paper models. A misspelled ``Qwen/Qwen2.5-7B-Bsae`` otherwise passes a dry run and fails on the cluster.

``python -m openrlhf_search.launch.model_check NAME``: one line on stderr, exit 0 (found, or a paper model that could
not be checked) or 2 (refused).
"""

import os
import sys
from typing import Optional

#: the launchers' default policies: accepted without a check when neither the cache nor the hub can be asked
PAPER_MODELS = ("Qwen/Qwen2.5-3B", "Qwen/Qwen2.5-3B-Instruct", "Qwen/Qwen2.5-7B", "Qwen/Qwen2.5-7B-Instruct",
                "meta-llama/Llama-3.1-8B-Instruct", "Qwen/Qwen3-4B", "Qwen/Qwen3-8B")


class ModelCheckError(ValueError):
    """The model does not exist, or cannot be checked (one line saying which and what to do)."""


def _first_line(e: BaseException) -> str:
    return f"{type(e).__name__}: {(str(e).strip().splitlines() or [''])[0]}"


def check_model(name: str, timeout_s: float = 10.0, offline: Optional[bool] = None) -> str:
    """Where ``name`` was found, as one line ("local folder ...", "local Hugging Face cache", "the hub").

    Args:
        name: a local folder or a hub name ``org/name``.
        timeout_s: seconds for the hub request.
        offline: skip the hub (default: ``HF_HUB_OFFLINE``).
    Raises:
        ModelCheckError: a local path without ``config.json``; a hub name the hub does not know; a name neither in
            the cache nor checkable on the hub (offline) that is not a paper model.
    """
    if os.path.exists(name):
        if os.path.isfile(os.path.join(name, "config.json")):
            return f"model {name}: local folder (config.json found)"
        raise ModelCheckError(f"model {name}: a local path without config.json (not a Hugging Face model folder)")
    from huggingface_hub import HfApi, constants, try_to_load_from_cache
    from huggingface_hub.errors import GatedRepoError, HFValidationError, RepositoryNotFoundError

    try:
        cached = try_to_load_from_cache(name, "config.json")
    except HFValidationError as e:
        raise ModelCheckError(f"model {name!r}: neither a local path nor a valid hub name ({_first_line(e)})") from e
    if isinstance(cached, str):
        return f"model {name}: found in the local Hugging Face cache ({constants.HF_HUB_CACHE}); the hub not asked"
    offline = constants.HF_HUB_OFFLINE if offline is None else offline
    why = "HF_HUB_OFFLINE is set"
    if not offline:
        try:
            info = HfApi().model_info(name, timeout=timeout_s)
            return f"model {name}: found on the hub (revision {str(info.sha)[:12]})"
        except GatedRepoError:
            return f"model {name}: found on the hub (gated: the nodes need a token with access)"
        except RepositoryNotFoundError as e:
            raise ModelCheckError(f"model {name!r} does not exist on the hub (or is private to another account): "
                                  f"check the spelling; a local folder or the cache are used when the name is a "
                                  f"path") from e
        except Exception as e:  # no network, DNS, timeout, 5xx
            why = f"the hub could not be asked ({_first_line(e)})"
    if name in PAPER_MODELS:
        return f"model {name}: a launcher's paper model, not checked ({why}; not in the local cache)"
    raise ModelCheckError(f"model {name!r} is not a local folder, not in the Hugging Face cache "
                          f"({constants.HF_HUB_CACHE}), and {why}: a misspelled name would only fail on the "
                          f"cluster. Download it first (hf download {name}), give a local folder, or set "
                          f"MODEL_CHECK=0 to skip this check")


def require_hub_files(name: str, timeout_s: float = 10.0) -> None:
    """Fail at once when a hub name is neither in the local cache nor reachable: one ``model_info`` request instead
    of the hub client's retry loop (about 70 s per file offline before transformers gives up).

    Raises:
        ModelCheckError: not cached and HF_HUB_OFFLINE set, the hub unreachable, or no such repository.
    """
    if os.path.exists(name):
        return
    from huggingface_hub import HfApi, constants, try_to_load_from_cache
    from huggingface_hub.errors import GatedRepoError, HFValidationError, RepositoryNotFoundError

    try:
        if any(isinstance(try_to_load_from_cache(name, f), str) for f in ("tokenizer_config.json", "config.json")):
            return
    except HFValidationError as e:
        raise ModelCheckError(f"{name!r}: neither a local path nor a valid hub name ({_first_line(e)})") from e
    where = f"not a local path and not in the Hugging Face cache ({constants.HF_HUB_CACHE})"
    if constants.HF_HUB_OFFLINE:
        raise ModelCheckError(f"{name!r}: {where}, and HF_HUB_OFFLINE is set")
    try:
        HfApi().model_info(name, timeout=timeout_s)
    except GatedRepoError:
        return
    except RepositoryNotFoundError as e:
        raise ModelCheckError(f"{name!r}: {where}, and the hub has no such repository (check the spelling)") from e
    except Exception as e:  # no network, DNS, timeout
        raise ModelCheckError(f"{name!r}: {where}, and the hub could not be reached ({_first_line(e)}); download it "
                              f"first (hf download {name}) or give a local folder") from e


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if len(argv) != 1:
        print("usage: python -m openrlhf_search.launch.model_check MODEL", file=sys.stderr)
        return 2
    try:
        print(check_model(argv[0]), file=sys.stderr)
    except ModelCheckError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
