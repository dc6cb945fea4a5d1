"""``bash examples/scripts/<launcher>.sh --help`` (and ``-h``) exits 0, starts nothing and lists, grouped, every
environment variable the launcher reads, with the default that launcher resolves, then the command its extra
arguments go to. The variables a launcher reads are found here independently of the help printer: a regex for
``${VAR:-...}``, ``${VAR-...}``, ``${VAR:+...}`` and ``${VAR:?...}`` over the non-comment lines of the launcher and of
every script of the folder it sources or runs (a ``/name.sh`` in a code line), transitively, less the internal
variables ``env_help.sh`` marks (``LAUNCHER_INTERNAL_VARS``).

Mutations caught: a launcher that reads a new environment variable missing from the table in env_help.sh (or
listed with a "read by" that misses the file reading it); a --help that starts something (a python other than the
layout computation, a retriever, Ray, the trainer) or writes an output folder; a literal default changed in a
launcher but not in its help; a help whose MODEL / TRAIN_DATA / EVAL_DATA / SETTING is not what the launcher would
run with; rows printed outside their group or twice; a help that does not name the command extra arguments go to.
"""

import os
import re
import stat
import subprocess
import sys

import pytest

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SCRIPTS = os.path.join(REPO, "examples", "scripts")
HELP_FILE = "env_help.sh"  # the table and its printer: its default expressions name variables, it reads none
SOURCED = ("common.sh", "procs.sh", HELP_FILE)  # sourced by the launchers, never run by a user
LAUNCHERS = sorted(f for f in os.listdir(SCRIPTS) if f.endswith(".sh") and f not in SOURCED)
TRAINING = [f for f in LAUNCHERS if f.startswith(("searchr1_", "r1searcher_"))]
READ = re.compile(r"\$\{([A-Z_][A-Z0-9_]*)(:?[-+?=])([^}]*)\}")
REF = re.compile(r"/([A-Za-z0-9_.-]+\.sh)")
SAME_PROCESS = re.compile(r"(?:source|exec bash)\s+\"[^\n]*?/([A-Za-z0-9_.-]+\.sh)\"")
ROW = re.compile(r"^  ([A-Z_][A-Z0-9_]*)=(.*)$")


def _code(name):
    with open(os.path.join(SCRIPTS, name), encoding="utf-8") as f:
        return [line for line in f if not line.lstrip().startswith("#")]


def _closure(name, edge=REF):
    """``name`` and the scripts of the folder it runs or sources (``edge``), transitively, less the help file."""
    todo, seen = [name], []
    while todo:
        f = todo.pop()
        if f in seen or f == HELP_FILE or not os.path.isfile(os.path.join(SCRIPTS, f)):
            continue
        seen.append(f)
        todo += [m for line in _code(f) for m in edge.findall(line)]
    return seen


def _bash_table(expr):
    out = subprocess.run(["bash", "-c", f'source "{SCRIPTS}/{HELP_FILE}"; {expr}'], capture_output=True, text=True,
                         check=True, timeout=30)
    return out.stdout


INTERNAL = set(_bash_table('echo "$LAUNCHER_INTERNAL_VARS"').split())
TABLE = {line.split("|")[1] for line in _bash_table("launcher_env_table").splitlines()}


def _reads(name):
    """{variable: [literal defaults]} read by ``name``'s files (literals only from the files run in its process)."""
    reads = {}
    same = set(_closure(name, SAME_PROCESS))
    for f in _closure(name):
        for line in _code(f):
            for var, op, default in READ.findall(line):
                if var in INTERNAL:
                    continue
                lits = reads.setdefault(var, [])
                if f in same and op in ("-", ":-") and default and not re.search(r"[$\"'`]", default):
                    lits.append(default)
    return reads


@pytest.fixture
def clean_env(tmp_path):
    """No variable of the table or of any launcher set, PYTHON a wrapper that logs each start, outputs in tmp."""
    names = TABLE | {v for f in LAUNCHERS for v in _reads(f)}
    env = {k: v for k, v in os.environ.items() if k not in names}
    log = tmp_path / "python_calls.log"
    wrapper = tmp_path / "python"
    wrapper.write_text(f'#!/bin/sh\necho "$*" >> "{log}"\nexec "{sys.executable}" "$@"\n')
    wrapper.chmod(wrapper.stat().st_mode | stat.S_IEXEC)
    return env, str(wrapper), log


def _help(script, flag, env, *args):
    return subprocess.run(["bash", os.path.join(SCRIPTS, script), *args, flag], env=env, capture_output=True,
                          text=True, timeout=60)


def _rows(stdout):
    """{variable: (group, value shown, the whole row)} of a help, and the groups in printed order. A row is
    "  VAR=value" padded to 36 characters and the meaning, or, for a longer value, the meaning on the next line."""
    rows, groups, group = {}, [], None
    lines = stdout.splitlines() + [""]
    lines = lines[next(i for i, line in enumerate(lines) if line.startswith("Environment of ")):]  # not the usage
    for i, line in enumerate(lines[:-1]):
        nxt = lines[i + 1]
        if line and not line.startswith(" ") and ROW.match(nxt):
            group = line
            groups.append(group)
        m = ROW.match(line)
        if m:
            assert m.group(1) not in rows, f"{m.group(1)} printed twice"
            if nxt.startswith(" " * 39):  # the meaning on its own line
                rows[m.group(1)] = (group, m.group(2), line + nxt)
            else:
                rows[m.group(1)] = (group, line[2:38].split("=", 1)[1].rstrip(), line)
    return rows, groups


@pytest.mark.parametrize("script", LAUNCHERS)
def test_help_lists_every_variable_the_launcher_reads_and_starts_nothing(script, clean_env, tmp_path):
    env, python, log = clean_env
    out_dirs = {k: str(tmp_path / k.lower()) for k in ("OUTPUT_ROOT", "RUN_DIR", "OUT_DIR")}
    env = dict(env, PYTHON=python, **out_dirs)
    reads = _reads(script)
    table_groups = list(dict.fromkeys(line.split("|")[0]
                                      for line in _bash_table("launcher_env_table").splitlines()))
    for flag in ("--help", "-h"):
        res = _help(script, flag, env)
        assert res.returncode == 0, res.stderr
        rows, groups = _rows(res.stdout)
        missing = sorted(set(reads) - set(rows))
        assert not missing, f"{script} --help lacks {missing} (add them to {HELP_FILE}'s table)"
        assert groups == [g for g in table_groups if g in groups], groups  # grouped, in the table's order
        assert all(group for group, _, _ in rows.values())
        for var, literals in reads.items():
            shown = rows[var][2]
            for lit in literals if not rows[var][1].endswith(" (set)") else ():  # the caller's value is shown
                assert re.search(rf"(?<![\w.]){re.escape(lit)}(?!\w|\.\d)", shown), \
                    f"{script}: {var} defaults to {lit!r} in the code, the help shows {shown!r}"
        last = res.stdout.strip().splitlines()[-1]
        assert last.startswith("Other arguments are passed to ") and "--help lists them" in last, last
        if script in TRAINING:
            assert "python -m openrlhf_search.cli.train " in last, last
    calls = log.read_text().splitlines() if log.exists() else []
    assert all(c.startswith("-m openrlhf_search.launch.layout ") for c in calls), calls  # nothing else ran
    assert not any(os.path.exists(d) for d in out_dirs.values())


def _argv(script, env):
    out = subprocess.run(["bash", os.path.join(SCRIPTS, script)], env=dict(env, DRY_RUN="argv"), capture_output=True,
                         check=True, timeout=60)
    argv = [a.decode() for a in out.stdout.split(b"\0") if a]
    return {argv[i]: argv[i + 1] for i in range(len(argv) - 1) if argv[i].startswith("--")}, argv


@pytest.mark.parametrize("script", TRAINING)
def test_help_shows_the_defaults_the_launcher_runs_with(script, clean_env):
    env, python, _ = clean_env
    env = dict(env, PYTHON=sys.executable)
    rows, _ = _rows(_help(script, "--help", env).stdout)
    flags, argv = _argv(script, env)
    assert rows["MODEL"][1] == flags["--actor.model_name_or_path"]
    assert rows["TRAIN_DATA"][1] == flags["--data.prompt_dataset"]
    assert rows["EVAL_DATA"][1] == flags["--eval.dataset"]
    assert rows["SETTING"][1] == next(a for a in argv if a.startswith("setting=")).split("=", 1)[1]
    assert rows["RETRIEVER_ENCODER"][1] == next(a for a in argv if a.startswith("encoder=")).split("=", 1)[1]
    # a value the caller set is shown as theirs
    rows, _ = _rows(_help(script, "--help", dict(env, NNODES="2")).stdout)
    assert rows["NNODES"][1] == "2 (set)"


def test_api_keys_the_caller_set_are_never_printed(clean_env):
    """--help shows the caller's value of every variable, except secrets (mutation: printing SERPER_API_KEY)."""
    env, _, _ = clean_env
    secrets = {"SERPER_API_KEY": "sk-serper-secret-1", "OPENAI_API_KEY": "sk-openai-secret-2"}
    res = _help("eval.sh", "--help", dict(env, PYTHON=sys.executable, **secrets))
    assert res.returncode == 0, res.stderr
    assert not any(v in res.stdout + res.stderr for v in secrets.values())
    rows, _ = _rows(res.stdout)
    assert rows["SERPER_API_KEY"][1] == rows["OPENAI_API_KEY"][1] == "(set, hidden)"
    assert rows["SERPAPI_API_KEY"][1] == "none" and rows["ONLINE"][1] == "0"


def test_trainer_variables_are_in_the_help(clean_env):
    """GPU_MEM_GB and PLACEMENT_WAIT_S are read by cli.train's python, RETRIEVER_GPU_GB by both; the regex over the
    shell files cannot see the first two, so the table names them (read by common.sh's launch)."""
    env, _, _ = clean_env
    res = _help("searchr1_ppo_qwen2.5-7b_base.sh", "--help", dict(env, PYTHON=sys.executable))
    rows, _ = _rows(res.stdout)
    for name, default in (("ACTOR_GPUS_PER_NODE", "auto (here 8)"), ("GPU_MEM_GB", "nvidia-smi, else 80"),
                          ("RETRIEVER_GPU_GB", "estimated"), ("PLACEMENT_WAIT_S", "60")):
        assert rows[name][1] == default, (name, rows[name])
    assert "Resolved: policy Qwen/Qwen2.5-7B; 512 prompts x 1 samples per step, updates of 256 samples" in res.stdout


def test_ray_job_submit_help_passes_to_the_script_with_submit_set(clean_env):
    env, _, _ = clean_env
    env = dict(env, PYTHON=sys.executable)
    alone = _help("ray_job_submit.sh", "--help", env)
    assert alone.returncode == 0 and "ray_job_submit.sh SCRIPT --help" in alone.stdout
    res = _help("ray_job_submit.sh", "--help", env, "searchr1_grpo_qwen2.5-3b_base.sh")
    assert res.returncode == 0, res.stderr
    assert _rows(res.stdout)[0]["SUBMIT"][1] == "1 (set)"


def test_a_help_flag_after_double_dash_belongs_to_the_next_program(clean_env):
    """``cluster_node_setup.sh -- --help`` hands --help on to the retriever server (mutation: help_init scanning past
    --, which would print the node script's help instead of its commands)."""
    env, _, _ = clean_env
    res = subprocess.run(["bash", os.path.join(SCRIPTS, "cluster_node_setup.sh"), "--", "--help"],
                         env=dict(env, PYTHON=sys.executable, DRY_RUN="1", HEAD="1", RETRIEVER_ENCODER="bm25"),
                         capture_output=True, text=True,
                         timeout=60)
    assert res.returncode == 0 and "Environment of" not in res.stdout, res.stdout + res.stderr
    assert "start_retriever.sh --port 8000 -- --help &" in res.stdout, res.stdout


def test_the_regex_and_the_closure_see_what_a_new_read_would_add(tmp_path, monkeypatch):
    """The checks above are only as good as the scan: a planted read in a file the launcher runs is found, a read in
    a comment or an internal variable is not."""
    monkeypatch.setattr(sys.modules[__name__], "SCRIPTS", str(tmp_path))
    (tmp_path / "a.sh").write_text('source "$(dirname "$0")/b.sh"\n# ${IN_COMMENT:-x}\nX="${LAYOUT_DESC:-}"\n')
    (tmp_path / "b.sh").write_text('bash "$HERE/c.sh"\nY="${NEW_KNOB:-3}"\n')
    (tmp_path / "c.sh").write_text('Z="${CHILD_KNOB-7}"; [[ -n "${FLAG:-}" ]]; W="${REQ:?say}"\n')
    assert _reads("a.sh") == {"NEW_KNOB": ["3"], "CHILD_KNOB": [], "FLAG": [], "REQ": []}


def test_every_script_parses():
    for name in LAUNCHERS + list(SOURCED):
        assert subprocess.run(["bash", "-n", os.path.join(SCRIPTS, name)]).returncode == 0, name
