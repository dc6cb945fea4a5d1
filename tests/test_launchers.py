"""Every launcher in examples/scripts passes every flag through OpenRLHF's real parser (and our validation); the dry
run checks its inputs (one line per missing file) and prints the corpus, index and retriever URL; the retriever
step notices a dead child at once, uses a service already on the port only when it serves the expected index, and
checks every retriever URL before a job. Exact hyper-parameter values are tests/test_parity.py's job."""

import glob
import http.server
import json
import os
import shutil
import socket
import subprocess
import sys
import threading
import time

import pytest

from openrlhf_search.cli import train as cli
from openrlhf_search.cli.train_args import DEFAULT_AGENT_PATH
from openrlhf_search.parity.check import RETRIEVER_MARK

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SCRIPTS = os.path.join(REPO, "examples", "scripts")
TRAINING_SCRIPTS = sorted(os.path.basename(p) for p in glob.glob(os.path.join(SCRIPTS, "r1searcher_*.sh"))
                          + glob.glob(os.path.join(SCRIPTS, "searchr1_*.sh")))
SHARED = os.path.join(os.path.dirname(REPO), "shared", "data")
QA = os.path.join(SHARED, "qa", "r1searcher", "bamboogle.jsonl")
CORPUS = os.path.join(SHARED, "wiki", "hotpotqa_dev500_paragraphs.jsonl")
HAVE_SHARED = os.path.exists(QA) and os.path.exists(CORPUS)
needs_shared = pytest.mark.skipif(not HAVE_SHARED, reason="../shared/data not found")


def _env(**extra):
    env = dict(os.environ, PYTHON=sys.executable, OMP_NUM_THREADS="1", TOKENIZERS_PARALLELISM="false")
    for key in ("RETRIEVER_URLS", "RETRIEVER_CORPUS", "RETRIEVER_INDEX_DIR", "SETTING", "ESTIMATOR", "MODEL",
                "TRAIN_DATA", "EVAL_DATA", "STAGE1_CKPT", "ALLOW_SHORT"):
        env.pop(key, None)
    env.update(extra)
    return env


def _inputs(tmp_path, script=None, **extra):
    """Existing inputs for a dry run: data files, a corpus, a stage-1 checkpoint folder.

    With ``script``, the data files are prompt files as ``prepare_data`` writes them for that launcher (its protocol,
    chat setting and policy, read from its resolved flags), since ``cli.train`` refuses prompt files whose rendering
    record does not match the run."""
    ckpt = tmp_path / "stage1_ckpt"
    ckpt.mkdir(exist_ok=True)
    (ckpt / "config.json").write_text("{}")  # an HF model folder (stage 2 refuses a folder without one)
    env = dict(TRAIN_DATA=QA, EVAL_DATA=QA, RETRIEVER_CORPUS=CORPUS, STAGE1_CKPT=str(ckpt),
               OUTPUT_ROOT=str(tmp_path / "out"), ALLOW_SHORT="1")  # a few rows: shorter than Search-R1's warm-up
    env.update(extra)
    if script is not None:
        argv = _argv(script, **env)
        flag = lambda name: argv[argv.index(name) + 1]
        record = {"protocol": flag("--search.protocol"), "template": "train",
                  "chat_template": flag("--search.chat_template").lower() == "true",
                  "tokenizer": flag("--actor.model_name_or_path")}
        path = tmp_path / f"prompts_{script}.jsonl"
        with open(QA) as src, open(path, "w") as dst:
            for line in list(src)[:4]:
                row = json.loads(line)
                dst.write(json.dumps({"prompt": row["question"], "question": row["question"],
                                      "label": json.dumps([row["answer"]]), "rendering": record}) + "\n")
        env.update(TRAIN_DATA=str(path), EVAL_DATA=str(path))
    return env


def _argv(script, *args, **env):
    out = subprocess.run(["bash", os.path.join(SCRIPTS, script), *args], env=_env(DRY_RUN="argv", **env),
                         capture_output=True, check=True, timeout=60)
    parts = [a.decode() for a in out.stdout.split(b"\0") if a]
    return parts[: parts.index(RETRIEVER_MARK)] if RETRIEVER_MARK in parts else parts


def _run(script, *args, timeout=300, **env):
    return subprocess.run(["bash", os.path.join(SCRIPTS, script), *args], env=_env(**env), capture_output=True,
                          text=True, timeout=timeout)


def test_all_paper_configurations_have_a_launcher():
    from openrlhf_search.parity.reference import LAUNCHERS

    expected = {f"r1searcher_{m}_stage{s}.sh" for m in ("qwen7b_base", "llama8b_instruct") for s in (1, 2)}
    expected |= {"r1searcher_qwen7b_base_single.sh"}
    expected |= {f"searchr1_{a}_qwen2.5-{z}_{v}.sh" for a in ("ppo", "grpo") for z in ("3b", "7b")
                 for v in ("base", "instruct")}
    assert expected <= set(TRAINING_SCRIPTS)
    assert set(TRAINING_SCRIPTS) == set(LAUNCHERS)  # every launcher has reference rows


@pytest.mark.parametrize("script", TRAINING_SCRIPTS)
def test_launcher_flags_pass_openrlhf_parser(script):
    argv = _argv(script)
    args, cfg = cli.parse_args(argv)  # argparse exits on an unknown flag; OpenRLHF/our checks raise
    assert args.train.agent_func_path == DEFAULT_AGENT_PATH
    assert cfg.retriever_urls == ["http://127.0.0.1:8000"]
    # the layout fills the 8 GPUs: colocated (OpenRLHF asserts actor GPUs == vLLM engines x TP) or actor + engines
    engine_gpus = args.vllm.num_engines * args.vllm.tensor_parallel_size
    actor_gpus = args.actor.num_nodes * args.actor.num_gpus_per_node
    assert engine_gpus == actor_gpus == 8 if args.train.colocate_all else engine_gpus + actor_gpus == 8
    assert args.vllm.enable_prefix_caching  # every turn resubmits the whole trajectory
    if "stage2" in script:  # starts from the stage-1 checkpoint
        assert "stage1" in args.actor.model_name_or_path
    if script.startswith("searchr1"):
        assert args.actor.model_name_or_path.endswith("-Instruct") == ("instruct" in script)
        # one prompt file per variant: the chat renderings of base and instruct tokenizers differ
        variant = "instruct" if "instruct" in script else "base"
        assert args.data.prompt_dataset.endswith(f"searchr1_train_qwen2.5_{variant}.jsonl")


def test_environment_overrides_and_extra_flags():
    argv = _argv("searchr1_grpo_qwen2.5-3b_base.sh", "--search.topk", "5", RETRIEVER_URLS="http://h1:1,http://h2:2",
                 NNODES="2", GPUS_PER_NODE="4")
    args, cfg = cli.parse_args(argv)
    assert cfg.topk == 5  # extra flags come last and win
    assert cfg.retriever_urls == ["http://h1:1", "http://h2:2"]
    assert args.actor.num_nodes == 2 and args.actor.num_gpus_per_node == 4 and args.vllm.num_engines == 8
    argv = _argv("r1searcher_qwen7b_base_single.sh", ESTIMATOR="group_norm")
    assert cli.parse_args(argv)[0].algo.advantage.estimator == "group_norm"


def test_settings_select_the_source():
    """SETTING=paper swaps R1-Searcher's rewards and estimator; settings a launcher cannot run fail clearly."""
    released, _ = cli.parse_args(_argv("r1searcher_llama8b_instruct_stage1.sh"))
    paper, _ = cli.parse_args(_argv("r1searcher_llama8b_instruct_stage1.sh", SETTING="paper"))
    assert released.algo.advantage.estimator == "group_norm" and released.search.reward_scheme == \
        "r1searcher_released_llama_stage1"
    assert paper.algo.advantage.estimator == "reinforce_baseline" and paper.search.reward_scheme == "r1searcher_stage1"
    for script, setting, message in [("r1searcher_qwen7b_base_stage1.sh", "released", "single"),
                                     ("r1searcher_qwen7b_base_single.sh", "paper", "two stages"),
                                     ("searchr1_ppo_qwen2.5-3b_base.sh", "nope", "SETTING")]:
        res = _run(script, DRY_RUN="argv", SETTING=setting, timeout=60)
        assert res.returncode == 2 and message in res.stderr, (script, res.stderr)


@needs_shared
@pytest.mark.parametrize("script,form", [("r1searcher_llama8b_instruct_stage1.sh", "env"),
                                         ("searchr1_ppo_qwen2.5-7b_instruct.sh", "flag")])
def test_dry_run_end_to_end_starts_nothing(script, form, tmp_path):
    """The real script, DRY_RUN=1 or --dry_run: the CLI's JSON on stdout, the corpus / index / URL on stderr, no
    retriever started, exit 0."""
    env = _inputs(tmp_path, script)
    res = _run(script, "--dry_run", **env) if form == "flag" else _run(script, DRY_RUN="1", **env)
    assert res.returncode == 0, res.stderr[-3000:]
    out = json.loads(res.stdout)
    assert out["openrlhf_args"]["dry_run"] is True
    assert out["classes"]["trainer"] == "openrlhf_search.rl.trainer.SearchPPOTrainer"
    assert f"corpus: {CORPUS}" in res.stderr and "| index: " in res.stderr and "to_build" in res.stderr
    assert "retriever: http://127.0.0.1:8000" in res.stderr
    assert "would start" in res.stderr  # the retriever step was skipped, not run
    env_cfg = json.loads(out["runtime_env"]["env_vars"]["OPENRLHF_SEARCH_CONFIG"])
    assert env_cfg == out["search_config"]
    if script.startswith("searchr1"):
        sched = out["lr_schedule"]
        assert sched["max_steps"] == 1004 and sched["updates_per_step"] == 2
        assert sched["actor_warmup_updates"] == 573 and sched["critic_warmup_updates"] == 31


@needs_shared
@pytest.mark.parametrize("missing,expect", [
    ("TRAIN_DATA", "TRAIN_DATA {} does not exist"),
    ("EVAL_DATA", "EVAL_DATA {} does not exist"),
    ("STAGE1_CKPT", "stage-1 checkpoint {} does not exist"),
    ("MODEL", "model {} does not exist"),
    ("RETRIEVER_CORPUS", "corpus {} not found"),
])
def test_dry_run_fails_with_one_line_on_a_missing_input(missing, expect, tmp_path):
    gone = str(tmp_path / "no_such_thing")
    env = _inputs(tmp_path, **{missing: gone})
    script = "r1searcher_llama8b_instruct_stage2.sh" if missing != "MODEL" else "searchr1_grpo_qwen2.5-3b_base.sh"
    res = _run(script, DRY_RUN="1", timeout=60, **env)
    assert res.returncode == 2, res.stderr[-2000:]
    assert res.stdout == ""  # nothing parsed or printed
    lines = [x for x in res.stderr.splitlines() if x.strip()]
    assert len(lines) == 1 and expect.format(gone) in lines[0], res.stderr


def test_no_corpus_default_from_eval_data(tmp_path):
    """Neither a launcher nor start_retriever.sh falls back to a corpus of its own (the old default was HotpotQA dev
    paragraphs, which hold the gold paragraphs of the eval questions)."""
    env = _inputs(tmp_path, "searchr1_ppo_qwen2.5-3b_base.sh") if HAVE_SHARED else {}
    env.pop("RETRIEVER_CORPUS", None)
    res = _run("searchr1_ppo_qwen2.5-3b_base.sh", DRY_RUN="1", timeout=60, **env)
    assert res.returncode == 2 and "no corpus" in res.stderr and res.stdout == ""
    res = subprocess.run(["bash", os.path.join(SCRIPTS, "start_retriever.sh"), "--print_config"], env=_env(),
                         capture_output=True, text=True, timeout=30)
    assert res.returncode == 2 and "no corpus" in res.stderr
    for path in glob.glob(os.path.join(SCRIPTS, "*.sh")):
        assert "hotpotqa_dev500_paragraphs" not in open(path).read(), path


@needs_shared
def test_dry_run_with_given_urls_names_and_probes_them(tmp_path):
    a, b = _FakeHealth("aaaaaaaaaaaaaaaa"), _FakeHealth("aaaaaaaaaaaaaaaa")
    try:
        env = _inputs(tmp_path, "r1searcher_qwen7b_base_single.sh", RETRIEVER_URLS=f"{a.url},{b.url}")
        env.pop("RETRIEVER_CORPUS")
        res = _run("r1searcher_qwen7b_base_single.sh", DRY_RUN="1", **env)
        assert res.returncode == 0, res.stderr[-2000:]
        assert f"corpus: served by {a.url},{b.url}" in res.stderr
        assert json.loads(res.stdout)["search_config"]["retriever_urls"] == [a.url, b.url]
        # a dead URL fails the dry run (the real run would), in one line naming it, before the trainer's parser
        dead = f"http://127.0.0.1:{_free_port()}"
        env["RETRIEVER_URLS"] = f"{a.url},{dead}"
        res = _run("r1searcher_qwen7b_base_single.sh", DRY_RUN="1", **env)
        assert res.returncode == 1 and res.stdout == ""
        errors = [ln for ln in res.stderr.splitlines() if "did not answer" in ln]
        assert len(errors) == 1 and "/health did not answer" in errors[0] and "does not start" in errors[0]
    finally:
        a.close()
        b.close()


@needs_shared
def test_ray_job_submit_dry_run_prints_submission(tmp_path):
    res = _run("ray_job_submit.sh", "searchr1_grpo_qwen2.5-7b_base.sh", DRY_RUN="1", RAY_ADDRESS="http://head:8265",
               NNODES="2", **_inputs(tmp_path, "searchr1_grpo_qwen2.5-7b_base.sh"))
    assert res.returncode == 0, res.stderr[-3000:]
    # the project's own Python runs Ray's CLI and the job's driver
    assert f"{sys.executable} -m ray.scripts.scripts job submit --address http://head:8265 --working-dir" in res.stderr
    assert f"-- {sys.executable} -m openrlhf_search.cli.train" in res.stderr
    out = json.loads(res.stdout)
    assert out["openrlhf_args"]["actor"]["num_nodes"] == 2
    # one retriever per node: every node's actors use their local retriever
    assert out["search_config"]["retriever_urls"] == ["http://127.0.0.1:8000"]


def test_bad_invocations_fail_clearly():
    res = _run("searchr1.sh", "ppo", "qwen9b", "base", DRY_RUN="1")
    assert res.returncode != 0 and "unknown model size" in res.stderr
    res = _run("r1searcher.sh", DRY_RUN="1")
    assert res.returncode != 0 and "usage" in res.stderr
    argv = _argv("r1searcher_qwen7b_base_single.sh", "--search.reward_scheme", "nope")
    with pytest.raises(Exception, match="reward scheme"):
        cli.parse_args(argv)


def test_cluster_node_setup_dry_run():
    res = subprocess.run(["bash", os.path.join(SCRIPTS, "cluster_node_setup.sh"), "--corpus", "/x/wiki.jsonl"],
                         capture_output=True, text=True, env=_env(DRY_RUN="1", HEAD_ADDRESS="10.0.0.1:6379",
                                                                  RETRIEVER_ENCODER="e5-base-v2"),
                         timeout=30)
    assert res.returncode == 0, res.stderr
    lines = res.stdout.splitlines()
    assert "start_retriever.sh" in lines[0] and "--corpus /x/wiki.jsonl" in lines[0]
    assert lines[1] == f"+ {sys.executable} -m ray.scripts.scripts start --address 10.0.0.1:6379"


@needs_shared
def _prepared_inputs(tmp_path, script, tokenizer_dir):
    """Inputs for a launcher's dry run with a local policy: a folder holding the offline Llama-3.1-shaped tokenizer
    (no paper tokenizer ships here) as MODEL and STAGE1_CKPT, and prompt files that the product's prepare_data CLI
    rendered with that tokenizer for the launcher's protocol and chat setting; the dry run re-renders the first
    prompt with the policy's tokenizer and refuses a file that differs."""
    policy = tmp_path / "policy"
    shutil.copytree(tokenizer_dir, policy)
    (policy / "config.json").write_text("{}")  # an HF model folder (stage 2 refuses a folder without one)
    env = _inputs(tmp_path, MODEL=str(policy), STAGE1_CKPT=str(policy))
    argv = _argv(script, **env)
    flag = lambda name: argv[argv.index(name) + 1]
    assert flag("--actor.model_name_or_path") == str(policy)
    prompts = tmp_path / "prompts.jsonl"
    chat = "--chat_template" if flag("--search.chat_template").lower() == "true" else "--no_chat_template"
    subprocess.run([sys.executable, "-m", "openrlhf_search.cli.prepare_data", "--input", QA, "--limit", "4",
                    "--protocol", flag("--search.protocol"), "--tokenizer", str(policy), chat, "--out", str(prompts)],
                   cwd=REPO, env=_env(), check=True, capture_output=True, timeout=120)
    env.update(TRAIN_DATA=str(prompts), EVAL_DATA=str(prompts))
    return env


@pytest.mark.slow
@needs_shared
@pytest.mark.parametrize("script", TRAINING_SCRIPTS)
def test_every_launcher_dry_run_subprocess(script, tmp_path, llama3_tokenizer_dir):
    res = _run(script, DRY_RUN="1", **_prepared_inputs(tmp_path, script, llama3_tokenizer_dir))
    assert res.returncode == 0, res.stderr[-3000:]
    assert json.loads(res.stdout)["openrlhf_args"]["train"]["agent_func_path"] == DEFAULT_AGENT_PATH
    assert f"corpus: {CORPUS}" in res.stderr


# ------------------------------------------------------------------ retriever step of common.sh (DRY_RUN=0)


def _free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class _FakeHealth:
    """A tiny HTTP server answering /health with a given fingerprint (stands for a service left on a port)."""

    def __init__(self, fingerprint, port=None):
        body = json.dumps({"status": "ok", "fingerprint": fingerprint, "encoder": "bm25", "index_type": "bm25",
                           "count": 1, "corpus_path": "/elsewhere/other.jsonl"}).encode()

        class Handler(http.server.BaseHTTPRequestHandler):
            def do_GET(self):
                self.send_response(200 if self.path == "/health" else 404)
                self.send_header("Content-Type", "application/json")
                self.end_headers()
                self.wfile.write(body)

            def log_message(self, *a):
                pass

        self.server = http.server.ThreadingHTTPServer(("127.0.0.1", port or 0), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"
        self.port = self.server.server_address[1]
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    def close(self):
        self.server.shutdown()
        self.server.server_close()


def _common(snippet, timeout=300, **env):
    script = f'source "{SCRIPTS}/common.sh"; {snippet}'
    return subprocess.run(["bash", "-c", script], capture_output=True, text=True, timeout=timeout,
                          env=_env(DRY_RUN="0", **env))


@pytest.fixture(scope="module")
def built_index(tmp_path_factory):
    """A BM25 index of 200 real passages (what a previous start_retriever.sh run leaves behind)."""
    if not HAVE_SHARED:
        pytest.skip("../shared/data not found")
    d = tmp_path_factory.mktemp("idx") / "bm25"
    subprocess.run([sys.executable, "-m", "retriever.build_index", "--corpus", CORPUS, "--index_dir", str(d),
                    "--encoder", "bm25", "--index_type", "bm25", "--limit", "200"], check=True, cwd=REPO,
                   capture_output=True, timeout=300, env=_env())
    return str(d)


def test_retriever_wait_notices_a_dead_child_at_once(tmp_path):
    """A retriever that dies (here: an index type build_index refuses at once) ends the wait with its log tail,
    instead of polling /health for RETRIEVER_WAIT_S (an hour: the subprocess timeout would fire first)."""
    corpus = tmp_path / "c.jsonl"
    corpus.write_text(json.dumps({"id": "1", "title": "T", "text": "some text"}) + "\n")
    res = _common("start_retrievers; echo STARTED", timeout=300, RETRIEVER_PORT=str(_free_port()),
                  RETRIEVER_CORPUS=str(corpus), RETRIEVER_ENCODER="bm25", RETRIEVER_INDEX_TYPE="bogus",
                  RETRIEVER_INDEX_DIR=str(tmp_path / "idx"), OUTPUT_ROOT=str(tmp_path), RETRIEVER_WAIT_S="3600")
    assert res.returncode == 1 and "STARTED" not in res.stdout
    assert "exited (code" in res.stderr and "before answering" in res.stderr


def test_a_service_on_the_port_is_used_only_when_it_serves_the_expected_index(tmp_path, built_index):
    from openrlhf_search.launch.retriever_check import expected_fingerprint

    want = expected_fingerprint(built_index)
    other = _FakeHealth("0123456789abcdef")
    try:
        res = _common("start_retrievers; echo STARTED", timeout=60, RETRIEVER_PORT=str(other.port),
                      RETRIEVER_INDEX_DIR=built_index, OUTPUT_ROOT=str(tmp_path))
        assert res.returncode == 2 and "STARTED" not in res.stdout
        assert f"already serves index 0123456789abcdef, not {built_index} ({want})" in res.stderr
        # an index that is not built yet cannot be compared: refuse too
        corpus = tmp_path / "c.jsonl"
        corpus.write_text(json.dumps({"id": "1", "title": "T", "text": "x"}) + "\n")
        res = _common("start_retrievers", timeout=60, RETRIEVER_PORT=str(other.port), RETRIEVER_CORPUS=str(corpus),
                      RETRIEVER_INDEX_DIR=str(tmp_path / "new_idx"), OUTPUT_ROOT=str(tmp_path))
        assert res.returncode == 2 and "not built yet" in res.stderr
    finally:
        other.close()
    same = _FakeHealth(want)
    try:
        res = _common('start_retrievers; echo "URL=$RETRIEVER_URLS PID=${RETRIEVER_PID:-none}"', timeout=60,
                      RETRIEVER_PORT=str(same.port), RETRIEVER_INDEX_DIR=built_index, OUTPUT_ROOT=str(tmp_path))
        assert res.returncode == 0, res.stderr
        assert f"URL={same.url} PID=none" in res.stdout  # reused, nothing started
        assert "using the retriever already serving" in res.stderr
    finally:
        same.close()


def test_given_urls_are_checked_before_the_job(tmp_path):
    a, b = _FakeHealth("aaaaaaaaaaaaaaaa"), _FakeHealth("bbbbbbbbbbbbbbbb")
    try:
        res = _common("start_retrievers; echo CHECKED", timeout=60, RETRIEVER_URLS=f"{a.url},{b.url}")
        assert res.returncode == 1 and "CHECKED" not in res.stdout
        assert "retrievers disagree" in res.stderr and "the job does not start" in res.stderr
        res = _common("start_retrievers; echo CHECKED", timeout=60, RETRIEVER_URLS=f"{a.url},{a.url}")
        assert res.returncode == 0 and "CHECKED" in res.stdout, res.stderr
        dead = f"http://127.0.0.1:{_free_port()}"
        res = _common("start_retrievers; echo CHECKED", timeout=60, RETRIEVER_URLS=f"{a.url},{dead}")
        assert res.returncode == 1 and f"retriever {dead}: /health did not answer" in res.stderr
    finally:
        a.close()
        b.close()


@needs_shared
def test_launcher_starts_the_real_retriever_and_waits_for_it(tmp_path):
    """common.sh's retriever step with DRY_RUN=0: start_retriever.sh builds a BM25 index on real passages, the
    launcher waits for /health, checks the index it serves, the service answers, and the retriever stops when the
    launcher exits."""
    port = _free_port()
    probe = ("import json, sys, urllib.request; req = urllib.request.Request(sys.argv[1] + '/retrieve', "
             "data=json.dumps({'queries': ['Scott Derrickson nationality'], 'topk': 3}).encode(), "
             "headers={'Content-Type': 'application/json'}); "
             "print(len(json.load(urllib.request.urlopen(req, timeout=30))['result'][0]))")
    res = _common(f'start_retrievers; echo "PID=$RETRIEVER_PID"; "$PYTHON" -c "{probe}" "$RETRIEVER_URLS"',
                  RETRIEVER_PORT=str(port), RETRIEVER_CORPUS=CORPUS, RETRIEVER_ENCODER="bm25", RETRIEVER_LIMIT="300",
                  RETRIEVER_INDEX_DIR=str(tmp_path / "index"), OUTPUT_ROOT=str(tmp_path))
    assert res.returncode == 0, res.stderr[-3000:] + open(tmp_path / f"retriever_{port}.log").read()[-2000:]
    assert "retrievers healthy and serving one index" in res.stderr
    lines = res.stdout.split()
    assert 1 <= int(lines[-1]) <= 3  # passages for the query (BM25 returns only matching ones)
    pid = int(next(x for x in lines if x.startswith("PID="))[4:])
    for _ in range(50):  # the EXIT trap killed it
        if not os.path.exists(f"/proc/{pid}") or open(f"/proc/{pid}/stat").read().split()[2] == "Z":
            break
        time.sleep(0.1)
    else:
        os.kill(pid, 15)
        pytest.fail("retriever still running after the launcher exited")


def test_relative_paths_are_the_callers(tmp_path):
    """A launcher run from another folder resolves relative TRAIN_DATA / EVAL_DATA / OUTPUT_ROOT / RETRIEVER_CORPUS
    and a MODEL folder against that folder, not the repo root it cd's to; a hub MODEL name is left alone."""
    (tmp_path / "mymodel").mkdir()
    env = _env(DRY_RUN="argv", TRAIN_DATA="d/train.jsonl", EVAL_DATA="../e.jsonl", OUTPUT_ROOT="out",
               RETRIEVER_CORPUS="data/x.jsonl", MODEL="./mymodel")
    script = os.path.join(SCRIPTS, "searchr1_ppo_qwen2.5-3b_base.sh")

    def run(env):
        out = subprocess.run(["bash", script], env=env, cwd=tmp_path, capture_output=True, check=True, timeout=60)
        return [a.decode() for a in out.stdout.split(b"\0")]

    parts = run(env)
    flag = lambda name: parts[parts.index(name) + 1]
    assert flag("--data.prompt_dataset") == f"{tmp_path}/d/train.jsonl"
    assert flag("--eval.dataset") == f"{tmp_path}/../e.jsonl"
    assert flag("--actor.model_name_or_path") == f"{tmp_path}/mymodel"
    assert flag("--ckpt.output_dir").startswith(f"{tmp_path}/out/")
    assert f"corpus={tmp_path}/data/x.jsonl" in parts
    parts = run(dict(env, MODEL="Qwen/Qwen2.5-3B", TRAIN_DATA="/abs/t.jsonl"))
    assert flag("--actor.model_name_or_path") == "Qwen/Qwen2.5-3B" and flag("--data.prompt_dataset") == "/abs/t.jsonl"


def test_start_retriever_relative_paths_are_the_callers(tmp_path):
    (tmp_path / "data").mkdir()
    (tmp_path / "data" / "x.jsonl").write_text('{"id": "1", "contents": "a"}\n')
    res = subprocess.run(["bash", os.path.join(SCRIPTS, "start_retriever.sh"), "--print_config", "--index_dir", "idx",
                          "--encoder", "e5-base-v2"], env=_env(RETRIEVER_CORPUS="data/x.jsonl"), cwd=tmp_path,
                         capture_output=True, text=True, timeout=30)
    assert res.returncode == 0, res.stderr
    config = dict(line.split("=", 1) for line in res.stdout.splitlines())
    assert config["corpus"] == f"{tmp_path}/data/x.jsonl" and config["index_dir"] == f"{tmp_path}/idx"
    assert config["encoder"] == "e5-base-v2"  # a preset name, not a path
    res = subprocess.run(["bash", os.path.join(SCRIPTS, "start_retriever.sh"), "--print_config", "--corpus",
                          "no.jsonl"], env=_env(), cwd=tmp_path, capture_output=True, text=True, timeout=30)
    assert res.returncode == 2 and f"corpus {tmp_path}/no.jsonl not found" in res.stderr
