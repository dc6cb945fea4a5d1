"""Resolve every launcher through OpenRLHF's real parser and compare each setting with its reference.

A launcher is run as the tests and the dry run do (``DRY_RUN=argv`` prints the exact trainer argv, then what it
would configure the retriever with); the argv goes through :func:`openrlhf_search.cli.train.parse_args` (OpenRLHF's
own parser and post-parse validation plus ours), and every :class:`~openrlhf_search.parity.reference.Ref` that
applies is looked up in the result.

Statuses: ``match`` (equal; floats within 1e-12 relative), ``documented`` (differs, reason in
``reference.DOCUMENTED``), ``DIFFERS`` (differs with no documented reason: the parity test fails).
"""

import math
import os
import subprocess
import sys
from dataclasses import dataclass
from typing import Any, Dict, List, Optional, Tuple

from openrlhf_search.parity.reference import (BEHAVIOUR, LAUNCHERS, Launcher, Ref, documented_reason,
                                              references_for)

REPO_ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
SCRIPTS = os.path.join(REPO_ROOT, "examples", "scripts")
RETRIEVER_MARK = "__retriever__"


@dataclass
class Row:
    """One compared setting of one launcher under one setting name."""

    launcher: str
    setting_name: str  # "released" | "paper"
    setting: str
    reference: Any
    source: str
    note: str
    ours: Any
    status: str  # "match" | "documented" | "DIFFERS"
    reason: str = ""


def launcher_argv(script: str, setting: Optional[str] = None, env: Optional[Dict[str, str]] = None,
                  extra_args: Optional[List[str]] = None) -> Tuple[List[str], Dict[str, str]]:
    """Run ``examples/scripts/<script> [extra_args]`` with ``DRY_RUN=argv``: (trainer argv, retriever settings).

    Raises:
        RuntimeError: the script failed (its stderr in the message).
    """
    run_env = dict(os.environ)
    for key in ("RETRIEVER_URLS", "RETRIEVER_ENCODER", "RETRIEVER_INDEX_TYPE", "RETRIEVER_CORPUS", "SETTING",
                "ESTIMATOR", "MODEL", "BASE_MODEL"):
        run_env.pop(key, None)
    run_env.update(DRY_RUN="argv", PYTHON=run_env.get("PYTHON", sys.executable))
    if setting:
        run_env["SETTING"] = setting
    run_env.update(env or {})
    res = subprocess.run(["bash", os.path.join(SCRIPTS, script), *(extra_args or [])], env=run_env,
                         capture_output=True, timeout=120)
    if res.returncode != 0:
        raise RuntimeError(f"{script} (SETTING={setting}) failed: {res.stderr.decode()[-2000:]}")
    parts = [a.decode() for a in res.stdout.split(b"\0") if a]
    if RETRIEVER_MARK in parts:
        i = parts.index(RETRIEVER_MARK)
        argv, extra = parts[:i], parts[i + 1:]
    else:
        argv, extra = parts, []
    retriever = dict(x.split("=", 1) for x in extra if "=" in x)
    return argv, retriever


def lookup(setting: str, args, cfg, retriever: Dict[str, str]) -> Any:
    """Our resolved value of ``setting`` (see the reference module's doc for the name forms).

    Raises:
        KeyError: an unknown behaviour name or an argument path that does not exist.
    """
    if setting.startswith("behaviour."):
        return BEHAVIOUR[setting](args, cfg)
    if setting.startswith("retriever."):
        key = setting.split(".", 1)[1]
        value = retriever.get(key, "")
        if key == "corpus":
            return value or "required: RETRIEVER_CORPUS / RETRIEVER_URLS (no default)"
        return value
    node = args
    for part in setting.split("."):
        if not hasattr(node, part):
            raise KeyError(f"no resolved argument {setting!r}")
        node = getattr(node, part)
    return node


def same(a: Any, b: Any) -> bool:
    """Equality with a 1e-12 relative tolerance on numbers; tuples and lists compare element-wise."""
    if isinstance(a, (list, tuple)) and isinstance(b, (list, tuple)):
        return len(a) == len(b) and all(same(x, y) for x, y in zip(a, b))
    if isinstance(a, bool) or isinstance(b, bool):
        return a is b or a == b and type(a) is type(b)
    if isinstance(a, (int, float)) and isinstance(b, (int, float)):
        return math.isclose(float(a), float(b), rel_tol=1e-12, abs_tol=0.0)
    return a == b


def compare_launcher(launcher: Launcher, setting: str, env: Optional[Dict[str, str]] = None,
                     extra_args: Optional[List[str]] = None) -> List[Row]:
    """Resolve ``launcher`` under ``setting`` (plus ``extra_args`` appended to its flags, as a user would) and
    compare every applicable reference row."""
    from openrlhf_search.cli import train as cli

    argv, retriever = launcher_argv(launcher.script, setting, env, extra_args)
    args, cfg = cli.parse_args(argv)
    rows = []
    for ref in references_for(launcher, setting):
        ours = lookup(ref.setting, args, cfg, retriever)
        if same(ours, ref.value):
            status, reason = "match", ""
        else:
            reason = documented_reason(launcher.paper, ref.setting, launcher.tags) or ""
            status = "documented" if reason else "DIFFERS"
        rows.append(Row(launcher.script, setting, ref.setting, ref.value, ref.source, ref.note, ours, status,
                        reason))
    return rows


def compare_all(env: Optional[Dict[str, str]] = None) -> List[Row]:
    """Every launcher under every setting it accepts."""
    rows: List[Row] = []
    for name in sorted(LAUNCHERS):
        launcher = LAUNCHERS[name]
        for setting in launcher.settings:
            rows.extend(compare_launcher(launcher, setting, env))
    return rows


def undocumented(rows: List[Row]) -> List[Row]:
    return [r for r in rows if r.status == "DIFFERS"]


__all__ = ["Row", "Ref", "launcher_argv", "lookup", "same", "compare_launcher", "compare_all", "undocumented"]
