"""Every command README.md shows is run here in a cheap form, so that a command that stops working fails the suite.

Commands are the lines of README's ```bash blocks (continuation lines joined, comments dropped) and the inline code
spans of its prose and tables that start with a program (``python``, ``bash``, ``make``, ...). ``rule_for`` gives
each its rule; a command without one fails ``test_every_readme_command_has_a_rule_and_the_not_run_list_is_current``,
and a command that cannot run cheaply (a download of gigabytes, a GPU install) must be named in ``NOT_RUN`` with the
reason, which the test checks is not stale. Nothing is skipped silently.

Cheap forms, in the order README gives the commands (later ones use what earlier ones wrote):

- ``make TARGET``: ``make -n TARGET`` (the target exists and expands);
- ``python -m M ARGS`` / ``python benchmarks/X.py ARGS``: ``--help`` exits 0 and names every ``--flag`` of ARGS;
  the cheap ones then run for real on substitutes for the downloads (``_substitutes``): ``prepare_data`` on the
  first rows of the shared samples with the local Qwen2.5 tokenizer, ``prepare_corpus`` on the 99-page KILT
  sample and a 3-article HotpotQA abstracts ``.tar.bz2`` built here, ``build_index`` on the 10-row wiki-18
  example with BM25 for e5 (no weights offline; ``retriever.download`` and adopting a released faiss index:
  ``--help`` only, they need the network, that index and the e5 weights), ``retriever.server`` started on a free
  port, ``cli.eval --rescore`` on the published trace (its output must hold the figures README quotes);
- ``curl`` against that server, as an HTTP POST of the same body;
- launchers: ``DRY_RUN=1`` as written (the policy's tokenizer in place of the hub model, ``ALLOW_SHORT=1`` because
  the sample is shorter than the LR warm-up); a launcher line without it (a real training run) under
  ``DRY_RUN=argv``, which resolves every flag and exits; ``eval.sh`` and ``benchmarks/gpu_smoke.sh`` under
  ``DRY_RUN=1``; a launcher's ``--help`` as written (it must print the environment table).

Relative ``data/`` and ``indexes/`` paths are moved into a temporary folder; port 8000 becomes a free port.
"""

import bz2
import io
import json
import os
import re
import shlex
import shutil
import socket
import subprocess
import sys
import tarfile
import time
import urllib.request

import pytest

from tests.conftest import shared_path

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
README = os.path.join(REPO, "README.md")
PROGRAMS = ("python", "bash", "make", "pip", "wget", "hf", "git", "gunzip", "cat", "curl", "source")
ENV_WORD = re.compile(r"^[A-Z_][A-Z0-9_]*=")

# Commands that cannot run cheaply, by their leading words: the reason is part of the record.
NOT_RUN = {
    "pip install -e .[gpu]": "installs CUDA packages (faiss-gpu) onto a GPU machine",
    "bash scripts/setup_gpu_env.sh": "installs and compiles the CUDA stack (GBs, nvcc); its refusal of a CPU "
                                     "environment is run in tests/test_doctor.py",
    "wget http://dl.fbaipublicfiles.com/KILT/kilt_knowledgesource.json": "35 GiB download; its format is run on "
                                                                         "the 99-page KILT sample",
    "wget https://nlp.stanford.edu/projects/hotpotqa/": "1.5 GB download; its format is run on a 3-article archive",
    "hf download": "multi-GB download from the hub (no network in CI)",
    "git clone": "network; R1-Searcher's question files are run from the shared samples",
    "source .venv/bin/activate": "changes the calling shell only; this test runs inside that environment",
}

# What stands in for a download or a hub name in a command (the command's own word -> a local file or name).
QWEN = None  # the local Qwen2.5 tokenizer folder, set by the fixture (tests/conftest.py's qwen_tokenizer)
TINY_MODEL = None  # a tiny model folder for eval.sh's dry run, set by the fixture (tests/conftest.py's tiny_model_dir)


ROWS = 24  # question files are cut to their first rows: the commands' formats are checked, not their sizes


def _head(src, dst, rows=ROWS):
    os.makedirs(os.path.dirname(dst), exist_ok=True)
    with open(src, encoding="utf-8") as f, open(dst, "w", encoding="utf-8") as out:
        for _, line in zip(range(rows), f):
            out.write(line)
    return dst


def _substitutes(tmp):
    head = lambda *parts: _head(shared_path(*parts), os.path.join(tmp, "inputs", parts[-1]))
    return {
        "nq_hotpotqa_train": head("qa", "searchr1", "nq_hotpotqa_train_sample.jsonl"),
        "R1-Searcher/data/training_set/stage_2.jsonl": head("qa", "r1searcher", "stage_2.jsonl"),
        "R1-Searcher/data/eval_set/hotpotqa_500.jsonl": head("qa", "r1searcher", "hotpotqa_500.jsonl"),
        "kilt_knowledgesource.json": shared_path("wiki", "kilt_pages_sample99.jsonl"),
        "enwiki-20171001-pages-meta-current-withlinks-abstracts.tar.bz2": os.path.join(tmp, "abstracts.tar.bz2"),
        "R1-Searcher/data/eval_results/bamboogle_llama.jsonl": shared_path("traces",
                                                                           "r1searcher_bamboogle_llama.jsonl"),
        "Qwen/Qwen2.5-7B": QWEN,
        "e5-base-v2": "bm25",  # with --index_type flat -> bm25 below: no encoder weights offline
    }


# ------------------------------------------------------------------------------------------------ README parsing
def _join_continuations(lines):
    out, cur = [], ""
    for line in lines:
        if line.rstrip().endswith("\\"):
            cur += line.rstrip()[:-1] + " "
            continue
        out.append(cur + line)
        cur = ""
    if cur:
        out.append(cur)
    return out


def readme_commands(text=None):
    """README's commands as (words, source) in reading order; ``source`` is "block" or "inline"."""
    text = open(README, encoding="utf-8").read() if text is None else text
    commands, prose = [], []
    parts = re.split(r"^```[^\n]*\n(.*?)^```\n", text, flags=re.S | re.M)
    fences = re.findall(r"^```([^\n]*)\n", text, flags=re.M)[::2]
    for i, part in enumerate(parts):
        if i % 2 == 0:
            prose.append(part)
            for span in re.findall(r"(?<!`)`([^`\n]+)`(?!`)", part):
                words = _words(span)
                if words and _program(words) in PROGRAMS and span.startswith(words[0]):
                    commands.append((words, "inline"))
            continue
        if fences[i // 2].strip() != "bash":
            continue
        for line in _join_continuations(part.splitlines()):
            words = _words(line)
            if words:
                commands.append((words, "block"))
    return commands


def _words(line):
    try:
        return shlex.split(line, comments=True)
    except ValueError:
        return []


def _split_env(words):
    env, i = {}, 0
    while i < len(words) and ENV_WORD.match(words[i]):
        key, value = words[i].split("=", 1)
        env[key] = value
        i += 1
    return env, words[i:]


def _program(words):
    return (_split_env(words)[1] or [""])[0]


def _flags(args):
    return sorted({a.split("=", 1)[0] for a in args if a.startswith("--")})


# ------------------------------------------------------------------------------------------------ running
def _free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Runner:
    """Runs README's commands in order in a temporary workspace; ``failures`` collects what went wrong."""

    def __init__(self, tmp):
        self.tmp = tmp
        self.port = _free_port()
        self.subs = _substitutes(tmp)
        self.help_cache = {}
        self.server = None
        self.failures = []
        self.outputs = {}
        self.env = {k: v for k, v in os.environ.items()
                    if not k.startswith(("RETRIEVER_", "TRAIN_DATA", "EVAL_DATA", "STAGE1_CKPT", "SETTING", "MODEL",
                                         "HOTPOTQA_", "KILT_", "DRY_RUN", "CPU_CLUSTER", "ALLOW_SHORT"))}
        # dataset names (`flashrag:nq`) resolve in a data folder holding the first rows of the shared samples
        shared = os.path.join(tmp, "shared")
        _head(shared_path("qa", "flashrag", "nq.test.jsonl"), os.path.join(shared, "qa", "flashrag", "nq.test.jsonl"))
        self.env.update(PYTHON=sys.executable, OMP_NUM_THREADS="1", TOKENIZERS_PARALLELISM="false",
                        OPENRLHF_SEARCH_DATA_DIR=shared,
                        HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1", OUTPUT_ROOT=os.path.join(tmp, "checkpoints"),
                        PYTHONPATH=REPO + os.pathsep + os.environ.get("PYTHONPATH", ""))
        os.makedirs(os.path.join(tmp, "data"), exist_ok=True)
        # what `retriever.download` writes (its own tests run it on a local copy; here it gets --help: network)
        shutil.copy(shared_path("wiki", "wiki18_example10.jsonl"), os.path.join(tmp, "data", "wiki-18.jsonl"))
        _write_abstracts_archive(self.subs["enwiki-20171001-pages-meta-current-withlinks-abstracts.tar.bz2"])

    # --- word rewriting
    def local(self, word):
        """A README word as it runs here: a substitute, a path moved into the workspace, the free port."""
        if word in self.subs:
            return self.subs[word]
        if word.startswith(("data/", "indexes/")):
            return os.path.join(self.tmp, word)
        return word.replace("127.0.0.1:8000", f"127.0.0.1:{self.port}").replace("localhost:8000",
                                                                               f"127.0.0.1:{self.port}")

    def rewrite(self, words):
        out = [self.local(w) for w in words]
        for i, w in enumerate(out[:-1]):
            if w == "--port" and out[i + 1] == "8000":
                out[i + 1] = str(self.port)
        if "--index_type" in out and "bm25" in out:  # e5 replaced by BM25: its index type follows
            out[out.index("--index_type") + 1] = "bm25"
        return out

    def fail(self, line, why):
        self.failures.append(f"{line}\n    -> {why}")

    def run(self, line, argv, env=None, cwd=None, timeout=300):
        res = subprocess.run(argv, cwd=cwd or self.tmp, env=dict(self.env, **(env or {})), capture_output=True,
                             text=True, timeout=timeout)
        self.outputs[line] = res.stdout + res.stderr
        if res.returncode != 0:
            self.fail(line, f"exit {res.returncode}: {(res.stderr or res.stdout).strip().splitlines()[-3:]}")
        return res

    # --- rules
    def help_check(self, line, target, args):
        """``target --help`` exits 0 and names every --flag of the command."""
        if target not in self.help_cache:
            res = subprocess.run([sys.executable, *target, "--help"], cwd=REPO, env=self.env, capture_output=True,
                                 text=True, timeout=300)
            self.help_cache[target] = (res.returncode, res.stdout + res.stderr)
        rc, text = self.help_cache[target]
        if rc != 0:
            return self.fail(line, f"--help exited {rc}: {text.strip().splitlines()[-3:]}")
        missing = [f for f in _flags(args) if f not in text]
        if missing:
            self.fail(line, f"--help does not name {missing}")

    def python(self, line, env, words):
        if words[1] == "-m":
            target, args = ("-m", words[2]), words[3:]
        else:
            target, args = (words[1],), words[2:]
        self.help_check(line, target, args)
        module = target[-1]
        real = self.rewrite(args)
        if module == "openrlhf_search.cli.prepare_data":
            self.run(line, [sys.executable, "-m", module, *real])
        elif module == "retriever.prepare_corpus":
            res = self.run(line, [sys.executable, "-m", module, *real])
            if res.returncode == 0 and not os.path.getsize(real[real.index("--output") + 1]):
                self.fail(line, "wrote no passage")
        elif module == "retriever.build_index" and "--faiss_index" not in args:  # adoption needs the released
            self.run(line, [sys.executable, "-m", module, *real])                  # index and e5: --help only
        elif module == "retriever.server":
            self.start_server(line, real)
        elif module == "openrlhf_search.cli.eval" and "--rescore" in args:
            res = self.run(line, [sys.executable, "-m", module, *real])
            for figure in ("0.504", "0.544", "0.440", "0.568"):  # README's rescoring table
                if figure not in res.stdout:
                    self.fail(line, f"the output lacks README's figure {figure}")

    def start_server(self, line, args):
        log = open(os.path.join(self.tmp, "server.log"), "w")
        self.server = subprocess.Popen([sys.executable, "-m", "retriever.server", *args], cwd=self.tmp, env=self.env,
                                       stdout=log, stderr=subprocess.STDOUT)
        deadline = time.time() + 120
        while time.time() < deadline:
            if self.server.poll() is not None:
                return self.fail(line, f"the server exited {self.server.returncode}")
            try:
                urllib.request.urlopen(f"http://127.0.0.1:{self.port}/health", timeout=2)
                return
            except OSError:
                time.sleep(0.5)
        self.fail(line, "the server did not answer /health within 120 s")

    def curl(self, line, env, words):
        url = next(self.local(w) for w in words if "localhost:" in w or "127.0.0.1:" in w)
        url = url if url.startswith("http") else "http://" + url
        body = words[words.index("-d") + 1].encode()
        if self.server is None:
            return self.fail(line, "no retriever.server command came before it in README")
        req = urllib.request.Request(url, data=body, headers={"Content-Type": "application/json"})
        try:
            answer = json.loads(urllib.request.urlopen(req, timeout=30).read())
        except OSError as e:
            return self.fail(line, f"request failed: {e}")
        if not (answer.get("result") or answer.get("answers")):
            self.fail(line, f"no passages in the answer: {str(answer)[:200]}")

    def bash(self, line, env, words):
        script = words[1]
        env = {k: self.local(v) for k, v in env.items()}
        if os.path.basename(script) == "eval.sh":
            env.setdefault("DRY_RUN", "1")  # prints the retrievers it would start and the cli.eval command
            # its dry run checks the model and loads every set first: a tiny model folder for the checkpoint, the shared
            # samples for R1-Searcher's files and (offline) the local copy of FlashRAG's NQ for the hub sets
            env["DATA_DIR"] = shared_path()
            if words[3:4] == ["searchr1"]:
                env.setdefault("DATASETS", "flashrag:nq")
            res = self.run(line, ["bash", script, TINY_MODEL, *self.rewrite(words[3:])], env=env, cwd=REPO)
            if res.returncode == 0 and "openrlhf_search.cli.eval" not in res.stdout:
                self.fail(line, "the dry run printed no cli.eval command")
            return
        if script == "benchmarks/gpu_smoke.sh":  # needs a GPU: its dry run checks the script, inputs and commands
            env.update(DRY_RUN="1", OUT_DIR=os.path.join(self.tmp, "gpu_smoke"))
            res = self.run(line, ["bash", script, *words[2:]], env=env, cwd=REPO)
            if res.returncode == 0 and "DRY RUN passed" not in res.stdout + res.stderr:
                self.fail(line, "the dry run did not pass")
            return
        if "--help" in words[2:] or "-h" in words[2:]:  # the launcher's environment, grouped; it starts nothing
            res = self.run(line, ["bash", script, *words[2:]], env=env, cwd=REPO)
            if res.returncode == 0 and "Environment of " not in res.stdout:
                self.fail(line, "--help printed no environment table")
            return
        env.update(MODEL=QWEN, ALLOW_SHORT="1", DATA_DIR=os.path.join(self.tmp, "data"))
        if "CPU_CLUSTER" not in env:
            env.setdefault("DRY_RUN", "argv")  # a training run: resolve every flag and stop
        elif "DRY_RUN" not in env:
            env.update(DRY_RUN="argv", CPU_CLUSTER_CACHE=os.path.join(self.tmp, "cpu_cluster"))  # assets not built
        res = self.run(line, ["bash", script, *self.rewrite(words[2:])], env=env, cwd=REPO)
        if res.returncode == 0 and env["DRY_RUN"] == "argv":
            argv = [a for a in res.stdout.split("\0") if a]
            if "--actor.model_name_or_path" not in argv:
                self.fail(line, "DRY_RUN=argv printed no trainer flags")
            if env.get("CPU_CLUSTER") == "1" and "--cpu_cluster" not in argv:
                self.fail(line, "CPU_CLUSTER=1 did not reach the trainer")

    def make(self, line, env, words):
        self.run(line, ["make", "-n", *words[1:]], cwd=REPO)

    def close(self):
        if self.server is not None and self.server.poll() is None:
            self.server.terminate()
            try:
                self.server.wait(timeout=30)
            except subprocess.TimeoutExpired:
                self.server.kill()


def _write_abstracts_archive(path):
    """A 3-article HotpotQA abstracts dump in the download's layout: a .tar.bz2 of bz2 JSON-lines files."""
    rows = [{"id": str(i), "title": t, "text": [s, " More."]} for i, (t, s) in enumerate(
        [("Hamlet", "Hamlet is a tragedy by William Shakespeare."), ("Oslo", "Oslo is the capital of Norway."),
         ("Euro", "The euro is the currency of the eurozone.")])]
    data = bz2.compress("".join(json.dumps(r) + "\n" for r in rows).encode())
    with tarfile.open(path, "w:bz2") as tar:
        info = tarfile.TarInfo("enwiki-20171001-pages-meta-current-withlinks-abstracts/AA/wiki_00.bz2")
        info.size = len(data)
        tar.addfile(info, io.BytesIO(data))


def rule_for(words):
    """The name of the rule that runs ``words``, or None."""
    joined = " ".join(words)
    for prefix in NOT_RUN:
        if joined.startswith(prefix):
            return "not_run"
    program = _program(words)
    rest = _split_env(words)[1]
    if program == "python" and len(rest) >= 2 and (rest[1] == "-m" or rest[1].startswith("benchmarks/")):
        return "python"
    if program == "bash" and len(rest) >= 2 and (rest[1].startswith("examples/scripts/")
                                                  or rest[1] == "benchmarks/gpu_smoke.sh"):
        return "bash"
    if program in ("make", "curl"):
        return program
    return None


# ------------------------------------------------------------------------------------------------ tests
def test_the_parser_finds_block_lines_continuations_and_inline_commands():
    text = ("Run `make demo` or `SETTING=paper`.\n\n```bash\nA=1 python -m x --f 1 \\\n    --g 2   # note\n```\n"
            "```python\nprint(1)\n```\n| `python benchmarks/b.py --n 3` | x |\n")
    got = [(w, s) for w, s in readme_commands(text)]
    assert got == [(["make", "demo"], "inline"), (["A=1", "python", "-m", "x", "--f", "1", "--g", "2"], "block"),
                   (["python", "benchmarks/b.py", "--n", "3"], "inline")]


def test_every_readme_command_has_a_rule_and_the_not_run_list_is_current():
    commands = readme_commands()
    assert len(commands) >= 20, commands  # README's blocks were parsed at all
    unruled = [" ".join(w) for w, _ in commands if rule_for(w) is None]
    assert not unruled, f"README commands with no cheap form here (add a rule, or NOT_RUN with a reason): {unruled}"
    joined = [" ".join(w) for w, _ in commands]
    stale = [p for p in NOT_RUN if not any(j.startswith(p) for j in joined)]
    assert not stale, f"NOT_RUN entries README no longer shows: {stale}"


def test_a_renamed_flag_a_missing_script_and_a_missing_target_are_failures(tmp_path, qwen_tokenizer):
    """The rules report what a stale README line would hit (mutations: a flag renamed in the CLI, a launcher
    renamed, a Makefile target removed)."""
    global QWEN
    QWEN = qwen_tokenizer.name_or_path
    r = Runner(str(tmp_path))
    r.python("a", {}, [sys.executable, "-m", "retriever.prepare_corpus", "--input", "x", "--index_kind", "flat"])
    r.bash("b", {"DRY_RUN": "1"}, ["bash", "examples/scripts/no_such_launcher.sh"])
    r.make("c", {}, ["make", "no-such-target"])
    assert [f.split("\n")[0] for f in r.failures] == ["a", "a", "b", "c"], r.failures
    assert "--index_kind" in r.failures[0]


@pytest.fixture
def runner(tmp_path, qwen_tokenizer, tiny_model_dir):
    global QWEN, TINY_MODEL
    QWEN, TINY_MODEL = qwen_tokenizer.name_or_path, tiny_model_dir
    r = Runner(str(tmp_path))
    yield r
    r.close()


def test_readme_commands_run(runner):
    """Each command of README, in order, in its cheap form; all failures are reported together."""
    ran = 0
    for words, _ in readme_commands():
        rule = rule_for(words)
        if rule in (None, "not_run"):
            continue
        env, rest = _split_env(words)
        line = " ".join(words)
        if rule == "python":
            rest = [sys.executable if i == 0 else w for i, w in enumerate(rest)]
            runner.python(line, env, rest)
        else:
            getattr(runner, rule)(line, env, rest)
        ran += 1
    assert ran >= 15
    assert not runner.failures, "README commands that failed:\n" + "\n".join(runner.failures)
