"""The tree explains itself: every reference in code, tests and docs leads to something a reader has, the cluster
core does not depend on the modules that only a CPU machine needs, and the library never imports its demo.

Mutations caught: a comment citing a design file that is not in the repository or an issue tracker's numbers (the
scan of the real tree), a scanner that misses a hit or reports this file (the planted files), an import of a CPU-only
module from a cluster-core module at module level, inside a function, relative, as ``from package import module``,
through ``importlib.import_module``, or through another module of the package (the planted package and the tree);
an import of the demo package from the library in any of those forms (the planted tree).
"""

import ast
import os
import re
from typing import Dict, Iterator, List, Optional, Sequence, Tuple

import pytest

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

# ------------------------------------------------------------------------------ references a reader can follow
# A design-notes file that is not in the repository, and a tracker's numbering (the word and a number), which a user of
# the package does not have. Design notes live in docs/design.md; a comment says why in its own words.
UNFOLLOWABLE = re.compile(r"DESIGN\.md|(?i:issue) [0-9]")
SCANNED = ("openrlhf_search", "retriever", "cpu_demo", "examples", "benchmarks", "tests", "docs", "README.md")
SKIP_DIRS = {"__pycache__", ".pytest_cache", ".ruff_cache"}


def unfollowable_references(repo: str, roots: Sequence[str], skip: Sequence[str] = ()) -> List[str]:
    """``path:line: text`` of every match of :data:`UNFOLLOWABLE` in the text files under ``roots`` (relative to
    ``repo``; a root may be a file). Files in ``skip`` (absolute paths) and files that are not UTF-8 text are passed
    over."""
    skip = {os.path.abspath(p) for p in skip}
    hits = []
    for root in roots:
        top = os.path.join(repo, root)
        files = [top] if os.path.isfile(top) else [
            os.path.join(d, f) for d, subdirs, names in os.walk(top)
            if not subdirs.__setitem__(slice(None), sorted(s for s in subdirs if s not in SKIP_DIRS))
            for f in sorted(names)]
        for path in files:
            if os.path.abspath(path) in skip:
                continue
            try:
                with open(path, encoding="utf-8") as f:
                    lines = f.read().splitlines()
            except (UnicodeDecodeError, OSError):
                continue
            hits += [f"{os.path.relpath(path, repo)}:{n}: {line.strip()}"
                     for n, line in enumerate(lines, 1) if UNFOLLOWABLE.search(line)]
    return hits


def test_no_reference_leads_outside_the_repository():
    hits = unfollowable_references(REPO, SCANNED, skip=[__file__])
    assert not hits, ("references a reader cannot follow (point to docs/design.md and its section, to the released "
                      "file and line, or say why in words):\n" + "\n".join(hits))


def test_the_scanner_finds_planted_references_and_skips_what_it_is_told(tmp_path):
    (tmp_path / "pkg" / "sub").mkdir(parents=True)
    design, issue = "DESIGN" + ".md", "issue"  # spelled apart so that a grep of the tree finds nothing here either
    (tmp_path / "pkg" / "a.py").write_text(f"x = 1  # see {design} sec. 4\n")
    (tmp_path / "pkg" / "sub" / "b.py").write_text("ok\n\n# Issue 18 item 3: fixed\n")
    (tmp_path / "pkg" / "c.png").write_bytes(b"\x89PNG\xff\xfe " + issue.encode() + b" 7")
    (tmp_path / "pkg" / "d.md").write_text("its issues #54 and #57; docs/design.md, \"Masking rule\"\n")
    (tmp_path / "README.md").write_text(f"{issue} 9\n")
    hits = unfollowable_references(str(tmp_path), ["pkg", "README.md"], skip=[str(tmp_path / "README.md")])
    assert hits == [f"pkg/a.py:1: x = 1  # see {design} sec. 4", "pkg/sub/b.py:3: # Issue 18 item 3: fixed"]


# ------------------------------------------------------------------------------ the cluster core and the CPU backend
# What only a machine without GPUs needs lives in ``openrlhf_search/cpu/``, the CPU backend (the CPU cluster mode's
# patches, settings and private Ray). Everything else of the package and the retriever is the cluster core and must
# not reach it. The CLI entry points may, inside the function that runs the CPU mode a user asked for (``cli.train
# --cpu_cluster``, ``cli.sft --cpu``): an import there costs a GPU run nothing, and walking on from an entry point
# stops at those imports.
PACKAGE = "openrlhf_search"
CPU_ROOM = ("openrlhf_search.cpu",)
ENTRY_POINTS = "openrlhf_search.cli"
OWN_PACKAGES = ("openrlhf_search", "retriever")  # the library
# The demo beside the library (the CPU main job, its data, the CPU cluster mode's tiny assets, the tests' recording
# probe): it imports the library freely; the library never imports it (a library that needed its example would need
# the checkout).
DEMO = "cpu_demo"


def cluster_core(repo: str) -> List[str]:
    """The package's top-level modules and sub-packages outside the CPU room and the CLI, and the retriever."""
    top = os.path.join(repo, PACKAGE)
    return sorted(f"{PACKAGE}/{e}" for e in os.listdir(top)
                  if e not in ("cpu", "cli", "__pycache__") and (e.endswith(".py") or os.path.isdir(
                      os.path.join(top, e)))) + ["retriever"]


def _module_name(repo: str, path: str) -> str:
    name = os.path.relpath(path, repo)[:-len(".py")].replace(os.sep, ".")
    return name[:-len(".__init__")] if name.endswith(".__init__") else name


def imported_names(repo: str, path: str) -> Iterator[Tuple[str, int, bool]]:
    """(module or ``module.name``, line, inside a function) for every import in ``path``: ``import a.b``,
    ``from a import b`` (both ``a`` and ``a.b``: ``b`` may be a module), relative imports resolved against the
    file's package, and ``importlib.import_module("a.b")`` with a literal name."""
    with open(path, encoding="utf-8") as f:
        tree = ast.parse(f.read(), path)
    module = _module_name(repo, path)
    package = module if path.endswith("__init__.py") else module.rpartition(".")[0]
    in_function = {id(n) for fn in ast.walk(tree) if isinstance(fn, (ast.FunctionDef, ast.AsyncFunctionDef))
                   for n in ast.walk(fn) if n is not fn}
    for node in ast.walk(tree):
        nested = id(node) in in_function
        if isinstance(node, ast.Import):
            for alias in node.names:
                yield alias.name, node.lineno, nested
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                parts = package.split(".")
                base = parts[:len(parts) - node.level + 1]
                target = ".".join(base + ([node.module] if node.module else []))
            else:
                target = node.module
            yield target, node.lineno, nested
            for alias in node.names:
                yield f"{target}.{alias.name}", node.lineno, nested
        elif (isinstance(node, ast.Call) and node.args and isinstance(node.args[0], ast.Constant)
              and isinstance(node.args[0].value, str)
              and getattr(node.func, "attr", getattr(node.func, "id", None)) == "import_module"):
            yield node.args[0].value, node.lineno, nested


def _is_under(name: str, prefixes: Sequence[str]) -> bool:
    return any(name == p or name.startswith(p + ".") for p in prefixes)


def _source_of(repo: str, name: str) -> Optional[str]:
    base = os.path.join(repo, *name.split("."))
    for path in (base + ".py", os.path.join(base, "__init__.py")):
        if os.path.isfile(path):
            return path
    return None


def _python_files(repo: str, entries: Sequence[str]) -> List[str]:
    out = []
    for entry in entries:
        path = os.path.join(repo, entry)
        if os.path.isdir(path):
            out += sorted(os.path.join(d, f) for d, _, names in os.walk(path) for f in names if f.endswith(".py"))
        elif os.path.isfile(path):
            out.append(path)
        else:
            raise FileNotFoundError(f"{entry} is not in the tree")
    return out


def cpu_only_imports(repo: str, core: Sequence[str], cpu_only: Sequence[str], own: Sequence[str] = OWN_PACKAGES,
                     entry_points: str = ENTRY_POINTS) -> List[str]:
    """Import chains from a ``core`` file to a ``cpu_only`` module, direct or through other modules of the ``own``
    packages, each as ``a.py -> b.py:line -> module``. In a module under ``entry_points`` only module-level imports
    of ``cpu_only`` count (a function there runs the CPU mode a user chose)."""
    found: Dict[str, None] = {}
    for start in _python_files(repo, core):
        stack, seen = [(start, [os.path.relpath(start, repo)])], {start}
        while stack:
            path, chain = stack.pop()
            entry = _is_under(_module_name(repo, path), (entry_points,))
            for name, line, nested in imported_names(repo, path):
                if not _is_under(name, own):
                    continue
                if _is_under(name, cpu_only):
                    if not (entry and nested):
                        found[" -> ".join(chain[:-1] + [f"{chain[-1]}:{line}", name])] = None
                    continue
                source = _source_of(repo, name)
                if source and source not in seen:
                    seen.add(source)
                    stack.append((source, chain + [os.path.relpath(source, repo)]))
    return list(found)


def test_the_cluster_core_imports_nothing_that_only_a_cpu_machine_needs():
    core = cluster_core(REPO)
    assert {"openrlhf_search/rl", "openrlhf_search/env", "openrlhf_search/launch", "openrlhf_search/evaluation",
            "retriever"} <= set(core), core
    chains = cpu_only_imports(REPO, core, CPU_ROOM)
    assert not chains, "cluster-core modules reach CPU-only modules:\n" + "\n".join(chains)


def test_the_cli_reaches_the_cpu_room_only_inside_functions():
    module_level = [f"{os.path.relpath(path, REPO)}:{line} {name}" for path in _python_files(REPO, [f"{PACKAGE}/cli"])
                    for name, line, nested in imported_names(REPO, path) if _is_under(name, CPU_ROOM) and not nested]
    assert not module_level, "a CLI module imports the CPU room at module level:\n" + "\n".join(module_level)
    assert cpu_only_imports(REPO, [f"{PACKAGE}/cli"], CPU_ROOM) == []


def test_the_import_check_sees_every_form_of_import(tmp_path):
    pkg = tmp_path / "openrlhf_search"
    (pkg / "cpu").mkdir(parents=True)
    (pkg / "cli").mkdir()
    for f in ("__init__.py", "cpu/__init__.py", "cpu/engine.py", "cli/__init__.py", "helper.py", "clean.py"):
        (pkg / f).write_text("")
    (pkg / "helper.py").write_text("def f():\n    from .cpu.engine import Engine\n")
    (pkg / "cli" / "run.py").write_text("def main():\n    from openrlhf_search.cpu import engine\n")
    (pkg / "cli" / "bad.py").write_text("from openrlhf_search.cpu import engine\n")
    cases = {
        "top.py": "import openrlhf_search.cpu.engine\n",
        "inner.py": "def f():\n    import os\n    from openrlhf_search.cpu import engine\n",
        "relative.py": "from .cpu import engine\n",
        "parent.py": "from openrlhf_search import cpu\n",
        "dynamic.py": "import importlib\nm = importlib.import_module('openrlhf_search.cpu.engine')\n",
        "through.py": "from openrlhf_search.helper import f\n",
        "via_cli.py": "from openrlhf_search.cli import bad\n",
    }
    for name, text in cases.items():
        (pkg / name).write_text(text)
        chains = cpu_only_imports(str(tmp_path), [f"openrlhf_search/{name}"], ["openrlhf_search.cpu"])
        assert chains, name
    assert cpu_only_imports(str(tmp_path), ["openrlhf_search/through.py"], ["openrlhf_search.cpu"]) == [
        "openrlhf_search/through.py -> openrlhf_search/helper.py:2 -> openrlhf_search.cpu.engine",
        "openrlhf_search/through.py -> openrlhf_search/helper.py:2 -> openrlhf_search.cpu.engine.Engine"]
    (pkg / "uses_cli.py").write_text("from openrlhf_search.cli import run\n")
    assert cpu_only_imports(str(tmp_path), ["openrlhf_search/clean.py", "openrlhf_search/uses_cli.py"],
                            ["openrlhf_search.cpu"]) == []  # an entry point's function-level import is allowed
    assert cluster_core(str(tmp_path)) == sorted(
        f"openrlhf_search/{n}" for n in ["__init__.py", "helper.py", "clean.py", "uses_cli.py", *cases]) + [
        "retriever"]
    with pytest.raises(FileNotFoundError, match="moved.py is not in the tree"):
        cpu_only_imports(str(tmp_path), ["openrlhf_search/moved.py"], ["openrlhf_search.cpu"])


# ------------------------------------------------------------------------------ rooms and the way imports run
# The package's folders by role, each allowed to import only the rooms below it (besides itself, the package's
# ``__init__`` and the retriever where listed). Any import counts, at module level or inside a function.
ROOM_IMPORTS = {
    "_cpu_compat": set(),
    "env": {"_cpu_compat"},                                   # the search environment: executor, protocols, rewards
    "rl": {"env", "_cpu_compat"},                             # OpenRLHF's trainer subclasses
    "launch": {"env", "rl", "_cpu_compat", "retriever"},      # pre-flight checks (they read the trainer's rules)
    "evaluation": {"env", "retriever"},
    "cli": {"env", "rl", "launch", "evaluation", "cpu", "_cpu_compat", "retriever"},
    "parity": {"cli", "env", "rl", "launch", "evaluation", "_cpu_compat"},
    "cpu": {"cli", "env", "rl", "launch", "evaluation", "_cpu_compat", "retriever"},
    "retriever": set(),
    DEMO: {"__init__", "_cpu_compat", "env", "rl", "launch", "evaluation", "cli", "parity", "cpu", "retriever"},
}


def _room(module: str) -> str:
    parts = module.split(".")
    if parts[0] != PACKAGE:
        return parts[0]
    return "__init__" if len(parts) == 1 else parts[1]


def _own_edges(repo: str) -> Iterator[Tuple[str, str, int, bool]]:
    """(importing module, imported module, line, inside a function) between two modules of the own packages and the
    demo."""
    tree = OWN_PACKAGES + (DEMO,)
    for path in _python_files(repo, [p for p in tree if os.path.isdir(os.path.join(repo, p))]):
        module = _module_name(repo, path)
        for name, line, nested in imported_names(repo, path):
            source = _is_under(name, tree) and _source_of(repo, name)
            if source:
                target = _module_name(repo, source)
                if target != module:
                    yield module, target, line, nested


def upward_imports(repo: str, rooms: Dict[str, set] = ROOM_IMPORTS) -> List[str]:
    """``module:line -> module`` for every import from a room into one it may not import (:data:`ROOM_IMPORTS`);
    a room missing from ``rooms`` is an error too (a new folder says where it stands)."""
    bad = []
    for module, target, line, _ in _own_edges(repo):
        src, dst = _room(module), _room(target)
        if src == dst or dst == "__init__":
            continue
        if src not in rooms or dst not in rooms[src]:
            bad.append(f"{module}:{line} -> {target}")
    return bad


def import_cycles(repo: str) -> List[List[str]]:
    """Sets of modules that import each other at module level (strongly connected components, Tarjan), sorted."""
    graph: Dict[str, set] = {}
    for module, target, _, nested in _own_edges(repo):
        if not nested:
            graph.setdefault(module, set()).add(target)
    index: Dict[str, int] = {}
    low: Dict[str, int] = {}
    stack: List[str] = []
    cycles = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        for w in graph.get(v, ()):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                cycles.append(sorted(component))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return sorted(cycles)


def test_each_room_imports_only_the_rooms_below_it():
    top = os.path.join(REPO, PACKAGE)
    rooms = {e[:-3] if e.endswith(".py") else e for e in os.listdir(top)
             if e != "__pycache__" and (e.endswith(".py") or os.path.isdir(os.path.join(top, e)))} - {"__init__"}
    assert rooms <= set(ROOM_IMPORTS), f"a room the direction rule does not know: {rooms - set(ROOM_IMPORTS)}"
    bad = upward_imports(REPO)
    assert not bad, "imports against the rooms' direction (see ROOM_IMPORTS):\n" + "\n".join(bad)


def test_no_modules_import_each_other():
    cycles = import_cycles(REPO)
    assert not cycles, "import circles:\n" + "\n".join(" <-> ".join(c) for c in cycles)


def test_the_direction_and_cycle_checks_catch_planted_faults(tmp_path):
    pkg = tmp_path / PACKAGE
    for d in ("env", "rl"):
        (pkg / d).mkdir(parents=True)
        (pkg / d / "__init__.py").write_text("")
    (pkg / "__init__.py").write_text("")
    (tmp_path / "retriever").mkdir()
    (tmp_path / "retriever" / "__init__.py").write_text("")
    (pkg / "rl" / "trainer.py").write_text("from openrlhf_search.env import agent\n")
    (pkg / "env" / "agent.py").write_text("import os\n")
    assert upward_imports(str(tmp_path)) == [] and import_cycles(str(tmp_path)) == []
    (pkg / "env" / "agent.py").write_text("def f():\n    from ..rl import trainer\n")  # upward, inside a function
    assert upward_imports(str(tmp_path)) == ["openrlhf_search.env.agent:2 -> openrlhf_search.rl",
                                             "openrlhf_search.env.agent:2 -> openrlhf_search.rl.trainer"]
    assert import_cycles(str(tmp_path)) == []  # a function-level import is no module-level circle
    (pkg / "env" / "rewards.py").write_text("from openrlhf_search.env.protocol import P\n")
    (pkg / "env" / "protocol.py").write_text("P = 1\nfrom openrlhf_search.env import rewards\n")
    assert import_cycles(str(tmp_path)) == [["openrlhf_search.env.protocol", "openrlhf_search.env.rewards"]]
    (tmp_path / "retriever" / "server.py").write_text("import openrlhf_search.env.agent\n")
    assert "retriever.server:1 -> openrlhf_search.env.agent" in upward_imports(str(tmp_path))


# ------------------------------------------------------------------------------ the library and its demo
def demo_imports(repo: str, library: Sequence[str] = OWN_PACKAGES, demo: str = DEMO,
                 borrowers: Sequence[str] = ()) -> List[str]:
    """``path:line name`` of every import of the ``demo`` package in the ``library`` packages (module level, inside a
    function, ``importlib.import_module``), except in the modules named in ``borrowers``."""
    hits = []
    for path in _python_files(repo, library):
        if _module_name(repo, path) in borrowers:
            continue
        hits += [f"{os.path.relpath(path, repo)}:{line} {name}" for name, line, _ in imported_names(repo, path)
                 if _is_under(name, (demo,))]
    return hits


def test_the_library_never_imports_its_demo():
    hits = demo_imports(REPO)
    assert not hits, f"the library imports the demo ({DEMO}/):\n" + "\n".join(hits)
    assert os.path.isfile(os.path.join(REPO, DEMO, "__init__.py"))


def test_the_demo_check_catches_planted_imports(tmp_path):
    pkg, demo = tmp_path / PACKAGE, tmp_path / DEMO
    for d in (pkg / "env", tmp_path / "retriever", demo):
        d.mkdir(parents=True)
        (d / "__init__.py").write_text("")
    (pkg / "__init__.py").write_text("")
    (demo / "run.py").write_text("import openrlhf_search.env.agent\nfrom retriever import server\n")
    (pkg / "env" / "agent.py").write_text("import cpu_demo_notes\nfrom cpu_demos import x\n")  # other names
    (tmp_path / "retriever" / "server.py").write_text("import os\n")
    assert demo_imports(str(tmp_path)) == [] and upward_imports(str(tmp_path)) == []  # the demo may import anything
    cases = {
        "env/top.py": "import cpu_demo.run\n",
        "env/inner.py": "def f():\n    from cpu_demo import probe\n",
        "env/dynamic.py": "import importlib\nm = importlib.import_module('cpu_demo.tiny_assets')\n",
    }
    for rel, text in cases.items():
        (pkg / rel).write_text(text)
    (tmp_path / "retriever" / "server.py").write_text("from cpu_demo.data import qa\n")
    assert demo_imports(str(tmp_path)) == [
        "openrlhf_search/env/dynamic.py:2 cpu_demo.tiny_assets", "openrlhf_search/env/inner.py:2 cpu_demo",
        "openrlhf_search/env/inner.py:2 cpu_demo.probe", "openrlhf_search/env/top.py:1 cpu_demo.run",
        "retriever/server.py:1 cpu_demo.data", "retriever/server.py:1 cpu_demo.data.qa"]
    assert "openrlhf_search.env.top:1 -> cpu_demo.run" in upward_imports(str(tmp_path))
    assert demo_imports(str(tmp_path), borrowers=["openrlhf_search.env.inner", "retriever.server"]) == [
        "openrlhf_search/env/dynamic.py:2 cpu_demo.tiny_assets", "openrlhf_search/env/top.py:1 cpu_demo.run"]


# ------------------------------------------------------------------------------ the linter
def test_make_test_runs_the_linter_before_pytest():
    """``make test`` lints first (ruff, settings in pyproject.toml) and the setup script installs the pinned ruff."""
    with open(os.path.join(REPO, "Makefile"), encoding="utf-8") as f:
        make = f.read()
    recipe = re.search(r"^test:.*\n((?:\t.*\n)+)", make, flags=re.M).group(1).splitlines()
    assert "ruff check ." in recipe[0] and "pytest" in recipe[-1], recipe
    with open(os.path.join(REPO, "pyproject.toml"), encoding="utf-8") as f:
        pyproject = f.read()
    assert "[tool.ruff]" in pyproject and "line-length = 120" in pyproject
    with open(os.path.join(REPO, "scripts", "setup_cpu_env.sh"), encoding="utf-8") as f:
        setup = f.read()
    pinned = re.search(r"ruff==([0-9.]+)", setup).group(1)
    assert f'md.version("ruff") == "{pinned}"' in setup  # a venv without that ruff is completed, not kept


# ------------------------------------------------------------------ the pinned stack and CI
def test_protobuf_is_pinned_below_7_where_the_stack_is_installed():
    """Ray 2.55's Serve controller reads FieldDescriptor.label, which protobuf 7 removed: setup.py and the CPU setup
    script install protobuf<7, the script's completeness check refuses a venv holding protobuf 7, and this venv
    holds one below 7 (the slow Serve tests start a Serve application on it)."""
    import importlib.metadata as md

    with open(os.path.join(REPO, "setup.py"), encoding="utf-8") as f:
        assert '"protobuf>=6.33.5,<7"' in f.read()
    with open(os.path.join(REPO, "scripts", "setup_cpu_env.sh"), encoding="utf-8") as f:
        setup = f.read()
    assert setup.count('"protobuf>=6.33.5,<7"') == 2  # the Ray step and the later step that could pull it up again
    assert 'int(md.version("protobuf").split(".")[0]) < 7' in setup
    assert int(md.version("protobuf").split(".")[0]) < 7


@pytest.mark.parametrize("fast,slow", [(0, 0), (2, 0), (0, 2), (0, 5)])
def test_ci_runs_both_test_commands_and_fails_when_either_fails(tmp_path, fast, slow):
    """.ci/run runs ``make test`` and then ``make test-guard`` (the second also after the first failed) and exits
    non-zero when either exits non-zero (5: pytest collected nothing)."""
    import subprocess

    calls = tmp_path / "calls"
    fake = tmp_path / "make"
    fake.write_text(f'#!/bin/sh\necho "$1" >> {calls}\n[ "$1" = test ] && exit {fast}\nexit {slow}\n')
    fake.chmod(0o755)
    env = dict(os.environ, PATH=f"{tmp_path}{os.pathsep}{os.environ['PATH']}")
    res = subprocess.run(["bash", os.path.join(REPO, ".ci", "run")], env=env, capture_output=True, text=True,
                         timeout=60)
    assert calls.read_text().split() == ["test", "test-guard"]
    assert (res.returncode == 0) == (fast == slow == 0), res.stdout


def test_the_ci_guard_names_slow_tests_that_exist():
    """Every node of the Makefile's GUARD list (what CI runs after ``make test``) is a collected slow test: a renamed
    or deleted test would otherwise drop out of CI silently (pytest reports a missing node id as an error, but an
    unmarked test would run as a fast one and the slow one never)."""
    import re
    import shlex
    import subprocess
    import sys

    with open(os.path.join(REPO, "Makefile"), encoding="utf-8") as f:
        text = f.read()
    block = re.search(r"^GUARD := \\\n((?:  .*\n)+)", text, re.M).group(1)
    nodes = shlex.split(block.replace("\\\n", " "))
    assert len(nodes) >= 8
    res = subprocess.run([sys.executable, "-m", "pytest", "-q", "-m", "slow", "--collect-only", *nodes], cwd=REPO,
                         capture_output=True, text=True, timeout=300)
    assert res.returncode == 0, res.stdout[-2000:] + res.stderr[-2000:]
    collected = [line for line in res.stdout.splitlines() if "::" in line]
    for node in nodes:
        assert any(line.startswith(node) for line in collected), node
