"""Every training setting the papers' released scripts fix, its value in our units, and where it was read.

Sources (read with the project's code-search tools; the commits are the snapshots read):

* Search-R1 ``PeterGriffinJin/Search-R1@a14dc3a``: the paper's run is ``scripts/nq_hotpotqa/v0.2/train_{ppo,grpo}.sh``
  (``docs/experiment_log.md`` "v0.2 ... [paper]"), defaults from ``verl/trainer/config/ppo_trainer.yaml``, code
  paths in ``verl/workers/fsdp_workers.py``, ``verl/trainer/ppo/{ray_trainer,core_algos}.py``,
  ``verl/workers/actor/dp_actor.py``, ``search_r1/llm_agent/generation.py``.
* R1-Searcher ``RUCAIBox/R1-Searcher@631167c``: ``scripts/qwen_reinforce_plus_train.sh`` (the released Qwen run, a
  single run), ``scripts/llama_reinforce_plus_train_stage{1,2}.sh``; the vendored OpenRLHF's parser defaults
  (``OpenRLHF-RAG/openrlhf/cli/train_ppo_ray.py``) and its rollout loop, whose hard-coded sampling values override
  the scripts (``OpenRLHF-RAG/openrlhf/trainer/ppo_utils/experience_maker.py``); reward servers ``train/*.py``.

Each :class:`Ref` names the resolved setting of our launchers it is compared with: a dotted path into the
arguments ``openrlhf_search.cli.train.parse_args`` returns (``actor.adam.lr``, ``search.topk``), ``retriever.*`` for
the retriever a launcher configures, or ``behaviour.*`` for a fact of our code that no flag expresses (its value is
computed by :data:`BEHAVIOUR`). ``only`` restricts a row to launchers carrying all those tags
(:data:`LAUNCHERS`). Where ours differs on purpose or cannot follow, :data:`DOCUMENTED` holds the reason;
``openrlhf_search.parity.check`` fails on any other difference.

``paper`` settings: the papers' texts (Search-R1 arXiv 2503.09516, R1-Searcher arXiv 2503.05592 sec. 3, read from
quotations: we had no copy of the PDFs) agree with the released scripts on every Search-R1 value they state, so for
Search-R1 ``paper`` = ``released``. For R1-Searcher they disagree on the rewards, the Qwen recipe (paper: two stages;
released: one run on the stage-2 reward) and the Llama stage-1 estimator; :data:`PAPER_OVERRIDES` holds those rows.
"""

from dataclasses import dataclass
from typing import Any, Callable, Dict, FrozenSet, List, Optional, Tuple

SEARCHR1_REPO = "PeterGriffinJin/Search-R1@a14dc3a"
R1SEARCHER_REPO = "RUCAIBox/R1-Searcher@631167c"


@dataclass(frozen=True)
class Ref:
    """One reference value.

    Attributes:
        setting: what it is compared with (see module doc).
        value: the released value, in our units (floats compare with a 1e-12 relative tolerance).
        source: ``file:line[,line]`` in the paper's repository where the value was read.
        note: how the released value maps onto our setting (units, defaults, hard-coded overrides).
        only: tags a launcher must all carry for the row to apply; empty: every launcher of the paper.
    """

    setting: str
    value: Any
    source: str
    note: str = ""
    only: Tuple[str, ...] = ()

    def applies_to(self, tags: FrozenSet[str]) -> bool:
        return all(t in tags for t in self.only)


@dataclass(frozen=True)
class Launcher:
    """A launcher in ``examples/scripts`` and what it reproduces.

    Attributes:
        script: file name in ``examples/scripts``.
        paper: "searchr1" or "r1searcher".
        tags: selectors for :attr:`Ref.only` (algorithm, model, stage).
        default_setting: "released" or "paper": what the script runs without ``SETTING``.
        settings: the settings it accepts.
    """

    script: str
    paper: str
    tags: FrozenSet[str]
    default_setting: str
    settings: Tuple[str, ...] = ("released", "paper")


def _searchr1_launchers() -> Dict[str, Launcher]:
    out = {}
    for algo in ("ppo", "grpo"):
        for size in ("3b", "7b"):
            for variant in ("base", "instruct"):
                script = f"searchr1_{algo}_qwen2.5-{size}_{variant}.sh"
                out[script] = Launcher(script, "searchr1", frozenset({algo, size, variant}), "released")
    return out


LAUNCHERS: Dict[str, Launcher] = {
    **_searchr1_launchers(),
    "r1searcher_qwen7b_base_single.sh": Launcher(
        "r1searcher_qwen7b_base_single.sh", "r1searcher", frozenset({"qwen", "single"}), "released", ("released",)),
    "r1searcher_qwen7b_base_stage1.sh": Launcher(
        "r1searcher_qwen7b_base_stage1.sh", "r1searcher", frozenset({"qwen", "stage1"}), "paper", ("paper",)),
    "r1searcher_qwen7b_base_stage2.sh": Launcher(
        "r1searcher_qwen7b_base_stage2.sh", "r1searcher", frozenset({"qwen", "stage2"}), "paper", ("paper",)),
    "r1searcher_llama8b_instruct_stage1.sh": Launcher(
        "r1searcher_llama8b_instruct_stage1.sh", "r1searcher", frozenset({"llama", "stage1"}), "released"),
    "r1searcher_llama8b_instruct_stage2.sh": Launcher(
        "r1searcher_llama8b_instruct_stage2.sh", "r1searcher", frozenset({"llama", "stage2"}), "released"),
}

# ----------------------------------------------------------------------------------------------- Search-R1

_PPO = "scripts/nq_hotpotqa/v0.2/train_ppo.sh"
_GRPO = "scripts/nq_hotpotqa/v0.2/train_grpo.sh"
_YAML = "verl/trainer/config/ppo_trainer.yaml"
_FSDP = "verl/workers/fsdp_workers.py"
_RT = "verl/trainer/ppo/ray_trainer.py"
_CORE = "verl/trainer/ppo/core_algos.py"
_GEN = "search_r1/llm_agent/generation.py"

SEARCHR1: List[Ref] = [
    # optimiser and schedule
    Ref("actor.adam.lr", 1e-6, f"{_PPO}:40, {_GRPO}:42"),
    Ref("actor.lr_scheduler", "constant_with_warmup", f"{_YAML}:46, {_FSDP}:240",
        "warmup_style constant = get_constant_schedule_with_warmup; transformers' constant_with_warmup is the same"),
    Ref("actor.lr_warmup_ratio", 0.285, f"{_PPO}:43, {_GRPO}:43",
        "of total_training_steps; our horizon is --train.max_steps x updates per step (openrlhf_search.rl.schedules)"),
    Ref("actor.adam.betas", (0.9, 0.999), f"{_FSDP}:231", "AdamW default of the optim config"),
    Ref("actor.adam.weight_decay", 0.01, f"{_FSDP}:232"),
    Ref("actor.adam.eps", 1e-8, f"{_FSDP}:229", "torch.optim.AdamW default"),
    Ref("actor.max_norm", 1.0, f"{_YAML}:32", "grad_clip"),
    Ref("actor.eps_clip", 0.2, f"{_YAML}:34", "clip_ratio"),
    Ref("actor.entropy_coef", 0.001, f"{_YAML}:35, verl/workers/actor/dp_actor.py:261",
        "entropy_coeff, not overridden by either script"),
    Ref("actor.loss_agg_mode", "token-mean", f"{_CORE}:192", "masked_mean over every token of the micro-batch"),
    Ref("train.max_epochs", 1, f"{_YAML}:39", "ppo_epochs"),
    # batch geometry
    Ref("rollout.batch_size", 512, f"{_PPO}:31, {_GRPO}:31", "data.train_batch_size counts prompts"),
    Ref("train.batch_size", 256, f"{_PPO}:44, {_GRPO}:45, {_FSDP}:100",
        "ppo_mini_batch_size counts samples: it is multiplied by rollout.n (= 1; GRPO's group comes from n_agent, "
        "which is not applied there), so GRPO makes 512 x 5 / 256 = 10 updates per step, PPO 2"),
    Ref("rollout.n_samples_per_prompt", 1, f"{_PPO}:55", "n_agent", only=("ppo",)),
    Ref("rollout.n_samples_per_prompt", 5, f"{_GRPO}:59", "n_agent", only=("grpo",)),
    Ref("rollout.temperature", 1.0, f"{_PPO}:56, {_GRPO}:60"),
    Ref("rollout.top_p", 1.0, f"{_PPO}:57", only=("ppo",)),
    Ref("rollout.top_p", 0.95, f"{_YAML}:71", "train_grpo.sh does not set top_p: the yaml default applies",
        only=("grpo",)),
    # algorithm
    Ref("algo.advantage.estimator", "gae", f"{_PPO}:38", only=("ppo",)),
    Ref("algo.advantage.estimator", "group_norm", f"{_GRPO}:38, {_CORE}:111",
        "adv_estimator=grpo: (r - mean) / (std + eps) per group", only=("grpo",)),
    Ref("algo.advantage.gamma", 1.0, f"{_YAML}:153"),
    Ref("algo.advantage.lambd", 1.0, f"{_YAML}:154"),
    Ref("algo.kl.init_coef", 0.001, f"{_PPO}:68", "algorithm.kl_ctrl.kl_coef (fixed controller)", only=("ppo",)),
    Ref("algo.kl.init_coef", 0.001, f"{_GRPO}:56", "kl_loss_coef", only=("grpo",)),
    Ref("algo.kl.use_loss", False, f"{_YAML}:36, {_RT}:792",
        "PPO: KL is a penalty in the reward (apply_kl_penalty), not a loss", only=("ppo",)),
    Ref("algo.kl.use_loss", True, f"{_GRPO}:44", only=("grpo",)),
    Ref("algo.kl.estimator", "k1", f"{_YAML}:157, {_CORE}:253", "kl_penalty: kl = log pi - log pi_ref",
        only=("ppo",)),
    Ref("algo.kl.estimator", "k3", f"{_GRPO}:57, {_CORE}:264", "low_var_kl (k3, clamped to [-10, 10])",
        only=("grpo",)),
    Ref("behaviour.kl_clamp", "none", f"{_CORE}:253-254", "kl_penalty kl: logprob - ref_logprob, unclamped",
        only=("ppo",)),
    Ref("behaviour.kl_clamp", "[-10, 10]", f"{_CORE}:264-268", "low_var_kl clamped", only=("grpo",)),
    Ref("behaviour.grpo_group_key", "extra_info.index",
        f"{_RT}:744, scripts/data_process/qa_search_train_merge.py:86,93",
        "uid = the row's index within its source (with_indices per source): an NQ and a HotpotQA row with the same "
        "index in one batch form one group of 10", only=("grpo",)),
    # critic (PPO)
    Ref("critic.adam.lr", 1e-5, f"{_PPO}:59", only=("ppo",)),
    Ref("critic.lr_scheduler", "constant_with_warmup", f"{_YAML}:99, {_FSDP}:677", only=("ppo",)),
    Ref("critic.lr_warmup_ratio", 0.015, f"{_PPO}:61", only=("ppo",)),
    Ref("critic.adam.betas", (0.9, 0.999), f"{_FSDP}:667", only=("ppo",)),
    Ref("critic.adam.weight_decay", 0.01, f"{_FSDP}:668", only=("ppo",)),
    Ref("critic.value_clip", 0.5, f"{_YAML}:126", "cliprange_value", only=("ppo",)),
    Ref("critic.max_norm", 1.0, f"{_YAML}:125", only=("ppo",)),
    Ref("behaviour.critic_from_actor_model", True, f"{_PPO}:62", "critic.model.path=$BASE_MODEL", only=("ppo",)),
    # length of training
    Ref("train.max_steps", 1004, f"{_PPO}:82, {_GRPO}:73, {_RT}:673,843-845",
        "total_training_steps=1005, but global_steps starts at 1 (line 673) and the loop returns once it reaches "
        "1005 after a step (843-845): 1,004 training steps"),
    Ref("train.num_episodes", 15, f"{_PPO}:81, {_GRPO}:72", "total_epochs (an upper bound; the step cap ends first)"),
    # rollout / environment
    Ref("data.max_len", 4096, f"{_PPO}:33", "max_prompt_length: the whole rolling context"),
    Ref("search.max_new_tokens_per_turn", 500, f"{_PPO}:34", "max_response_length (per turn)"),
    Ref("search.max_obs_tokens", 500, f"{_PPO}:36", "max_obs_length"),
    Ref("search.obs_cut", "block", f"{_GEN}:80-89,391",
        "the whole block (newlines, tags, passages) tokenised as one string and cut to its first max_obs_length "
        "tokens: the closing tag goes first"),
    Ref("search.max_turns", 5, f"{_PPO}:85, {_GEN}:234,278",
        "max_turns=4 search turns, then one final rollout without search = 5 generation calls"),
    Ref("search.topk", 3, f"{_PPO}:87"),
    Ref("search.protocol", "searchr1", _GEN),
    Ref("search.reward_scheme", "searchr1_em", "verl/trainer/main_ppo.py:27", "qa_em.compute_score_em"),
    Ref("search.chat_template", True, "verl/utils/dataset/rl_dataset.py:128",
        "every prompt, base models included, goes through the tokenizer's chat template"),
    Ref("eval.steps", 100, f"{_PPO}:78", "test_freq"),
    Ref("eval.temperature", 0.0, f"{_RT}:478", "do_sample False"),
    Ref("ckpt.save_steps", 100, f"{_PPO}:77", "save_freq"),
    Ref("behaviour.eval_before_training", True, f"{_PPO}:73, {_RT}:665", "val_before_train=true"),
    Ref("behaviour.weight_decay_on_norms_and_biases", True, f"{_FSDP}:229", "AdamW over all parameters"),
    Ref("behaviour.lr_scheduler_steps_per", "training step", f"{_FSDP}:381",
        "actor_lr_scheduler.step() once per update_actor call"),
    # retriever
    Ref("retriever.encoder", "e5-base-v2", "retrieval_launch.sh:6"),
    Ref("retriever.index_type", "flat", "retrieval_launch.sh:3", "e5_Flat.index"),
    Ref("retriever.corpus", "wiki-18", "retrieval_launch.sh:4", "wiki-18.jsonl (training and evaluation)"),
]

# ---------------------------------------------------------------------------------------------- R1-Searcher

_Q = "scripts/qwen_reinforce_plus_train.sh"
_L1 = "scripts/llama_reinforce_plus_train_stage1.sh"
_L2 = "scripts/llama_reinforce_plus_train_stage2.sh"
_TP = "OpenRLHF-RAG/openrlhf/cli/train_ppo_ray.py"
_EM = "OpenRLHF-RAG/openrlhf/trainer/ppo_utils/experience_maker.py"
_PA = "OpenRLHF-RAG/openrlhf/trainer/ray/ppo_actor.py"
_PT = "OpenRLHF-RAG/openrlhf/trainer/ppo_trainer.py"
_RB = "OpenRLHF-RAG/openrlhf/trainer/ppo_utils/replay_buffer.py"


def _per_model(setting: str, q, l1, l2, line: int, note: str = "") -> List[Ref]:
    """One row per released script (Qwen single run + the paper's two Qwen stages share the Qwen script)."""
    return [Ref(setting, q, f"{_Q}:{line}", note, only=("qwen",)),
            Ref(setting, l1, f"{_L1}:{line}", note, only=("llama", "stage1")),
            Ref(setting, l2, f"{_L2}:{line}", note, only=("llama", "stage2"))]


R1SEARCHER: List[Ref] = [
    Ref("actor.adam.lr", 2e-6, f"{_Q}:27, {_L1}:27, {_L2}:27"),
    Ref("rollout.n_samples_per_prompt", 16, f"{_Q}:21, {_L1}:21, {_L2}:21"),
    Ref("train.num_episodes", 10000, f"{_Q}:22, {_L1}:22, {_L2}:22", "they stop the run by hand"),
    Ref("train.max_steps", None, _Q, "no step cap in the released code"),
    Ref("actor.lr_warmup_ratio", 0.0, f"{_Q}:23, {_L1}:23, {_L2}:23"),
    Ref("actor.lr_scheduler", "cosine_with_min_lr", f"{_PA}:236",
        "over 10,000 episodes: an effectively constant rate for any run length they used"),
    Ref("actor.min_lr_ratio", 0.1, f"{_PA}:240", "min_lr = 0.1 x lr"),
    *_per_model("train.batch_size", 256, 60, 260, 24, "samples per update"),
    *_per_model("rollout.batch_size", 64, 15, 65, 25, "prompts per step"),
    Ref("train.micro_batch_size", 1, f"{_Q}:56, {_L1}:56, {_L2}:57", "micro_train_batch_size"),
    Ref("rollout.micro_batch_size", 1, f"{_Q}:58, {_L1}:58, {_L2}:59",
        "micro_rollout_batch_size: samples per forward of the experience pass (logits of one 30k-token sample)"),
    *_per_model("algo.kl.init_coef", 0.0, 1e-4, 1e-4, 26),
    Ref("algo.kl.use_loss", False, f"{_TP}:366", "not set by the scripts: KL in the reward"),
    Ref("algo.kl.estimator", "k1", f"{_TP}:288", "use_kl_estimator_k3 not set"),
    Ref("algo.advantage.estimator", "reinforce_baseline", f"{_Q}:60", only=("qwen",)),
    Ref("algo.advantage.estimator", "group_norm", f"{_L1}:60", only=("llama", "stage1")),
    Ref("algo.advantage.estimator", "reinforce_baseline", f"{_L2}:61", only=("llama", "stage2")),
    Ref("train.max_epochs", 1, f"{_Q}:62, {_L1}:62, {_L2}:63"),
    Ref("data.max_samples", 100000, f"{_Q}:61, {_L1}:61, {_L2}:62"),
    Ref("rollout.temperature", 1.0, f"{_EM}:1105", "hard-coded in the rollout loop (TEMP=1.0 in the scripts)"),
    Ref("rollout.top_p", 0.95, f"{_EM}:1105", "hard-coded in the rollout loop; the scripts' --top_p is unused"),
    Ref("search.max_new_tokens_per_turn", 512, f"{_EM}:1105", "max_tokens per generation call, hard-coded"),
    Ref("search.max_turns", 9, f"{_EM}:1102,1127", "the call with t == 8 is the last: 8 retrievals + 1"),
    Ref("search.topk", 3, f"{_EM}:1189"),
    Ref("search.max_obs_tokens", None, f"{_EM}:1196-1207", "documents appended whole: no cap"),
    Ref("search.passage_format", "hotpotqa_abstracts", f"{_EM}:1200-1201, train/wiki_corpus_load.py:12-16,55-56",
        "the corpus line minus its id: the HotpotQA abstracts TSV, (1)Title: T Text:  abstract"),
    Ref("search.query_cleaning", "r1searcher_train", f"{_EM}:1143-1145",
        "double quotes removed, stripped, whitespace collapsed"),
    Ref("behaviour.stop_at_answer", False, f"{_EM}:1087,1105",
        "the only stop string is <|end_of_query|>; text after </answer> is scored by the format checks"),
    Ref("data.max_len", 30024, f"{_Q}:66-67", "prompt_max_len 1024 + generate_max_len 29000"),
    Ref("actor.adam.betas", (0.9, 0.95), f"{_TP}:297"),
    Ref("actor.adam.weight_decay", 0.0, f"{_TP}:265", "--l2"),
    Ref("actor.eps_clip", 0.2, f"{_TP}:267"),
    Ref("actor.max_norm", 1.0, f"{_TP}:264"),
    Ref("actor.entropy_coef", None, "OpenRLHF-RAG/openrlhf/models/loss.py:81", "no entropy term"),
    Ref("actor.loss_agg_mode", "seq-mean-token-mean", "OpenRLHF-RAG/openrlhf/models/loss.py:81",
        "masked_mean(loss, mask, dim=-1).mean(): per sequence, then over sequences"),
    Ref("behaviour.advantage_whitening", True, f"{_PT}:255-256, {_RB}:235-317",
        "replay_buffer.normalize('advantages') over action tokens for every estimator but group_norm",
        only=("qwen",)),
    Ref("behaviour.advantage_whitening", False, f"{_PT}:255-256", "group_norm is the one estimator not whitened",
        only=("llama", "stage1")),
    Ref("behaviour.advantage_whitening", True, f"{_PT}:255-256, {_RB}:235-317",
        "replay_buffer.normalize('advantages') over action tokens for every estimator but group_norm",
        only=("llama", "stage2")),
    Ref("search.group_norm_zero_pad", False, "train/reward_server_qwen_zero.py:268", "one score per sample",
        only=("qwen",)),
    Ref("search.group_norm_zero_pad", True,
        f"train/reward_server_llama_stage1.py:226, {_TP}:21-22, {_EM}:564-567,823, {_L1}:58",
        "[score, 0] per sample; the [N, 2] rewards reshaped to rows of 16 = 8 samples + 8 zeros; micro-rollout "
        "batch 1, so each sample gets its own normalised score", only=("llama", "stage1")),
    Ref("search.group_norm_zero_pad", False, "train/reward_server_llama_stage2.py:251", "one score per sample",
        only=("llama", "stage2")),
    Ref("behaviour.kl_clamp", "none", "OpenRLHF-RAG/openrlhf/models/utils.py:24-36",
        "log_probs - log_probs_base, unclamped"),
    Ref("ckpt.save_steps", 20, f"{_Q}:78", only=("qwen",)),
    Ref("ckpt.save_steps", 10, f"{_L1}:77", only=("llama", "stage1")),
    Ref("ckpt.save_steps", 20, f"{_L2}:78", only=("llama", "stage2")),
    Ref("search.chat_template", False, f"{_Q}:86", "--apply_chat_template is commented out", only=("qwen",)),
    Ref("search.chat_template", True, f"{_L1}:87", "--apply_chat_template", only=("llama", "stage1")),
    Ref("search.chat_template", True, f"{_L2}:86", "--apply_chat_template", only=("llama", "stage2")),
    Ref("search.protocol", "r1searcher", f"{_EM}:1087"),
    Ref("search.reward_scheme", "r1searcher_released_stage2", "train/reward_server_qwen_zero.py:183-250",
        "answer F1, 0 without an answer block, -2 on any format check", only=("qwen",)),
    Ref("search.reward_scheme", "r1searcher_released_llama_stage1", "train/reward_server_llama_stage1.py:155-198",
        "+-1 Cover-EM, +0.5 balanced retrieval tags (>= 1 retrieval), +0.5 think/answer format",
        only=("llama", "stage1")),
    Ref("search.reward_scheme", "r1searcher_released_llama_stage2", "train/reward_server_llama_stage2.py:182-227",
        "answer F1, -1 on a tag-count, think/answer or CJK format failure", only=("llama", "stage2")),
    Ref("eval.steps", None, _Q, "no evaluation during training"),
    Ref("retriever.encoder", "bge-large-en-v1.5", "train/wiki_corpus_load.py:47"),
    Ref("retriever.index_type", "flat", "wiki_corpus_index_bulid/build_corpus_index.py:38", "Flat, inner product"),
    Ref("retriever.corpus", "hotpotqa-2017-abstracts", "train/wiki_corpus_load.py:55-56",
        "training: enwiki-20171001 abstracts (HotpotQA's); eval of 2Wiki/MuSiQue/Bamboogle: KILT 100-word passages"),
]

# The paper's text where it differs from the released code (R1-Searcher arXiv 2503.05592 sec. 3): rewards, the
# two-stage Qwen recipe, REINFORCE++ for both stages.
_PAPER = "arXiv 2503.05592 sec. 3"
PAPER_OVERRIDES: Dict[str, List[Ref]] = {
    "searchr1": [],
    "r1searcher": [
        Ref("search.reward_scheme", "r1searcher_stage1", _PAPER, "0.5 retrieval + 0.5 format", only=("stage1",)),
        Ref("search.reward_scheme", "r1searcher_stage2", _PAPER, "F1, -2 format", only=("stage2",)),
        Ref("algo.advantage.estimator", "reinforce_baseline", _PAPER, "REINFORCE++ with a group baseline",
            only=("llama", "stage1")),
        Ref("behaviour.advantage_whitening", True, _PAPER + " with the released trainer, which whitens every "
            "estimator but group_norm (OpenRLHF-RAG/openrlhf/trainer/ppo_trainer.py:255-256)",
            "REINFORCE++ advantages whitened", only=("llama", "stage1")),
        Ref("search.group_norm_zero_pad", False, _PAPER, "the paper's estimator is not group_norm",
            only=("llama", "stage1")),
    ],
}

REFERENCES: Dict[str, List[Ref]] = {"searchr1": SEARCHR1, "r1searcher": R1SEARCHER}


def references_for(launcher: Launcher, setting: str) -> List[Ref]:
    """The rows that apply to ``launcher`` under ``setting`` ("released" or "paper"); a paper row replaces the
    released rows of the same setting name that apply."""
    rows = [r for r in REFERENCES[launcher.paper] if r.applies_to(launcher.tags)]
    if setting == "paper":
        overrides = [r for r in PAPER_OVERRIDES[launcher.paper] if r.applies_to(launcher.tags)]
        names = {r.setting for r in overrides}
        rows = [r for r in rows if r.setting not in names] + overrides
    elif setting != "released":
        raise ValueError(f"setting must be 'released' or 'paper', got {setting!r}")
    return rows


# --------------------------------------------------------------------------------- our side of behaviour rows


def _uses_whitening(args, cfg) -> bool:
    # OpenRLHF 0.11.2 experience_maker.compute_advantages_and_returns whitens these estimators over the batch
    return args.algo.advantage.estimator in ("gae", "reinforce", "reinforce_baseline")


BEHAVIOUR: Dict[str, Callable[[Any, Any], Any]] = {
    "behaviour.critic_from_actor_model": lambda a, c: a.critic.model_name_or_path == a.actor.model_name_or_path,
    # OpenRLHF's fit evaluates after steps only; --eval.before_training (openrlhf_search.rl.schedules) adds step 0
    "behaviour.eval_before_training": lambda a, c: bool(getattr(a.eval, "before_training", False)),
    # OpenRLHF's get_optimizer_grouped_parameters exempts biases and norm weights from weight decay
    "behaviour.weight_decay_on_norms_and_biases": lambda a, c: False,
    # the DeepSpeed engine steps the scheduler at every optimizer step
    "behaviour.lr_scheduler_steps_per": lambda a, c: "optimizer update",
    "behaviour.advantage_whitening": _uses_whitening,
    # OpenRLHF 0.11.2 models/utils.py compute_approx_kl: value.clamp(min=-10, max=10) for every estimator
    "behaviour.kl_clamp": lambda a, c: "[-10, 10]",
    # OpenRLHF groups the n_samples_per_prompt samples of one prompt (experience_maker; ours keeps that)
    "behaviour.grpo_group_key": lambda a, c: "prompt",
    # the executor stops a turn at </answer> unless --search.stop_at_answer false
    "behaviour.stop_at_answer": lambda a, c: c.stop_at_answer,
}

# ------------------------------------------------------------------------------------ documented differences

# (paper, setting, tag or None) -> reason. A tag restricts the reason to launchers carrying it.
DOCUMENTED: Dict[Tuple[str, str, Optional[str]], str] = {
    ("searchr1", "behaviour.weight_decay_on_norms_and_biases", None):
        "OpenRLHF groups parameters and exempts biases and norm weights from weight decay; changing it means "
        "copying its optimiser setup (wd 0.01 at lr 1e-6 moves a weight by 1e-8 per step)",
    ("searchr1", "behaviour.lr_scheduler_steps_per", None):
        "DeepSpeed steps the scheduler per update; the warm-up covers the same fraction of training "
        "(ceil(0.285 x 1004 x updates) updates = 286.5 steps for PPO's 2 updates a step, 286.2 for GRPO's 10, vs "
        "verl's int(0.285 x 1005) = 286), the rate rises within a step during warm-up and is constant afterwards "
        "in both",
    ("searchr1", "behaviour.kl_clamp", None):
        "OpenRLHF 0.11.2's compute_approx_kl clamps every estimator to [-10, 10] (models/utils.py); unclamping k1 "
        "means replacing that function (copying OpenRLHF). A clamp acts only where one token's log-ratio between "
        "policy and reference passes 10 (a probability ratio of e^10 = 22,026), and at KL coefficient 0.001 each unit "
        "of log-ratio beyond 10 is 0.001 of reward on that token",
    ("searchr1", "behaviour.grpo_group_key", None):
        "OpenRLHF groups each prompt's own samples. The released key collides only when an NQ and a HotpotQA row "
        "with the same per-source index share a batch: 512 prompts drawn from the 169,615 rows (79,168 NQ, 90,447 "
        "HotpotQA) hold about 79,168 x (512 / 169,615)^2 = 0.72 such pairs a step, 1.4 of the 512 groups (0.28%) "
        "normalised as one group of 10; reproducing it would group by data index in the experience maker",
    ("searchr1", "search.chat_template", None):
        "the cluster trainer receives prompts already rendered by prepare_data (render them with the policy's "
        "tokenizer, base included); the flag drives prepare_data and eval",
    ("searchr1", "retriever.corpus", None):
        "the corpus is not shipped: the launcher requires RETRIEVER_CORPUS (wiki-18 for parity) or RETRIEVER_URLS "
        "and prints what it will serve; no default is taken from eval data",
    ("r1searcher", "retriever.corpus", None):
        "the corpus is not shipped: the launcher requires RETRIEVER_CORPUS (HotpotQA 2017 abstracts for training "
        "parity) or RETRIEVER_URLS and prints what it will serve",
    ("r1searcher", "behaviour.kl_clamp", None):
        "OpenRLHF 0.11.2's compute_approx_kl clamps k1 to [-10, 10] (models/utils.py); unclamping it means replacing "
        "that function (copying OpenRLHF). A clamp acts only where one token's log-ratio passes 10 (a probability "
        "ratio of e^10 = 22,026); the Qwen run has KL coefficient 0, the Llama runs 1e-4",
    ("r1searcher", "eval.steps", None):
        "ours evaluates on the eval file every 20 steps (a monitoring addition; it does not change training)",
}


def documented_reason(paper: str, setting: str, tags: FrozenSet[str]) -> Optional[str]:
    """The documented reason for a difference on ``setting`` for a launcher with ``tags``, or None."""
    for (p, s, tag), reason in DOCUMENTED.items():
        if p == paper and s == setting and (tag is None or tag in tags):
            return reason
    return None
