"""The papers' evaluation settings, by name: ``released`` (what the released eval code runs) and ``paper``.

``cli.eval --setting released|paper`` starts from one of these; any explicit flag (``--topk``, ``--max_turns``, ...)
overrides the value it names. Every value cites the released file and line it was read from (R1-Searcher at commit
631167c of RUCAIBox/R1-Searcher, Search-R1 at a14dc3a of PeterGriffinJin/Search-R1).

Each setting's ``sources`` names the released file:line of every value; what they add up to:

R1-Searcher (arXiv 2503.05592, sec. 4.1), ``released``: ``base_prompt_v0`` as plain text for every model (no chat
template), with the special tokens vLLM adds to a text prompt (``<|begin_of_text|>`` for Llama-3, nothing for Qwen;
``protocol.engine_prompt``); top-k 5; greedy, ``top_p`` 0.95, 512 tokens per call, at most 9 calls whose output
counts; no cap on a documents block nor on the trajectory but the model's context (``cli.eval --max_obs_tokens N
--max_length N`` cap them, and the table says so); queries cleaned as released; HotpotQA retrieved from the 2017
abstracts, the other sets from KILT 100-word passages (``cli.eval --retriever_url hotpotqa=URL1,default=URL2``);
the GPT-4o-mini judge (``judge.JUDGE_PROMPTS["r1searcher"]``); the sets of ``data/eval_set/``. The released loop
strips each generated turn and re-tokenises the whole text at the next call (``eval_search_loacl.py:235``); our
executor keeps the sampled tokens, so a turn that begins or ends with whitespace is kept as sampled. On the published
trace, whose turns are already stripped, the prompts are the same (``tests/test_traces.py``).

R1-Searcher ``paper``: the same, except the prompt is the training template in the only form the paper prints (the
base-model prompt, ``datasets/prompts_dataset.py:24-31``; ``docs/design.md``, "Protocols"),
as plain text for every model, instruct ones included (``--chat_template`` renders ``prompts_dataset.py:10-20``
instead), and 500 tokens per call (the paper states none).

Search-R1 (arXiv 2503.09516, sec. 4), ``released`` = ``paper``: every question of the full FlashRAG test split (dev
where there is none; a ``val_data_num`` would sample, ``verl/trainer/ppo/ray_trainer.py:403-407``); the training
prompt with the policy's chat template, tokenised without special tokens; top-k 3, 4 searches + the final answering
call = 5 model turns of 500 tokens, 500-token observation blocks cut as one string, a 4,096-token context, greedy;
EM, no judge.
"""

from dataclasses import asdict, dataclass, field
from typing import Any, Dict, Optional, Tuple

from openrlhf_search.env.config import SearchConfig

R1SEARCHER_COMMIT = "631167c"
SEARCHR1_COMMIT = "a14dc3a"


@dataclass(frozen=True)
class PaperEvalSetting:
    """One named evaluation setting of one paper.

    Attributes:
        paper: "r1searcher" or "searchr1" (= the protocol name).
        name: "released" or "paper".
        template: the protocol's prompt variant (``Protocol.build_prompt(template=...)``).
        search: the paper's search settings as overrides of :class:`~openrlhf_search.env.config.SearchConfig`
            (field -> value: chat_template, topk, max_turns, max_new_tokens_per_turn, max_obs_tokens, obs_cut,
            query_cleaning); a field it does not name keeps SearchConfig's default (:meth:`search_config`).
        temperature: 0 = greedy.
        top_p: nucleus sampling (irrelevant when greedy; recorded for parity).
        judge_prompt: ``judge.JUDGE_PROMPTS`` key, or None when the paper reports no judge metric.
        datasets: default eval sets (``loaders.load_eval_dataset`` names).
        max_length: tokens of prompt + trajectory; None: the model's context length.
        engine_special_tokens: write the special tokens the released engine adds to a text prompt in front of it
            (``protocol.engine_prompt``).
        passage_formats: dataset key -> ``SearchConfig.passage_format`` (key "default" for the others;
            :func:`for_dataset`).
        corpus: dataset key -> the corpus the released eval retrieves from for it (key "default"), for the table.
        sources: setting (a ``search`` field or an attribute) -> "file:line" it was read from.
    """

    paper: str
    name: str
    template: str
    search: Dict[str, Any]
    temperature: float
    top_p: float
    judge_prompt: Optional[str]
    datasets: Tuple[str, ...]
    max_length: Optional[int]
    engine_special_tokens: bool
    passage_formats: Dict[str, str] = field(default_factory=dict)
    corpus: Dict[str, str] = field(default_factory=dict)
    sources: Dict[str, str] = field(default_factory=dict)

    def search_config(self, **overrides) -> SearchConfig:
        """``SearchConfig`` of this setting: the paper's values over SearchConfig's defaults, then ``overrides``.
        Raises ConfigError on a bad value."""
        return SearchConfig(**{"protocol": self.paper, **self.search, **overrides})

    def to_dict(self) -> dict:
        return asdict(self)


_R1 = "RUCAIBox/R1-Searcher@" + R1SEARCHER_COMMIT + " "
_SR = "PeterGriffinJin/Search-R1@" + SEARCHR1_COMMIT + " "
_R1_SETS = ("hotpotqa_500", "2wiki_500", "musique_500", "bamboogle")
_SR_SETS = ("nq", "triviaqa", "popqa", "hotpotqa", "2wikimultihopqa", "musique", "bamboogle")

_R1_RELEASED_SOURCES = {
    "template": _R1 + "evaluation/eval_search_loacl.py:58-62,85-88 (base_prompt_v0); evaluation/gen_search.sh:1 "
                      "(--prompt_type v0)",
    "chat_template": _R1 + "evaluation/eval_search_loacl.py:186 (plain string to LLM.generate: no chat template)",
    "topk": _R1 + "evaluation/eval_search_loacl.py:230,268",
    "max_turns": _R1 + "evaluation/eval_search_loacl.py:179,203 (the 10th call's output is dropped)",
    "max_new_tokens_per_turn": _R1 + "evaluation/eval_search_loacl.py:173",
    "temperature": _R1 + "evaluation/gen_search.sh:1 (--temp 0.0)",
    "top_p": _R1 + "evaluation/eval_search_loacl.py:173",
    "judge_prompt": _R1 + "evaluation/metric_calc_gpt_as_judge.py:31-38,64-69,90-91",
    "datasets": _R1 + "data/eval_set/",
    "max_obs_tokens": _R1 + "evaluation/eval_search_loacl.py:275-285 (every retrieved passage appended whole)",
    "max_length": _R1 + "evaluation/eval_search_loacl.py:149 (LLM(model=...): the model's own context length)",
    "engine_special_tokens": _R1 + "evaluation/eval_search_loacl.py:186 (a string to LLM.generate, which tokenises "
                                   "it with add_special_tokens=True: vllm/renderers/base.py:353)",
    "query_cleaning": _R1 + "evaluation/eval_search_loacl.py:227-228",
    "passage_format": _R1 + "evaluation/eval_search_loacl.py:277-279 (the corpus line minus its id); "
                            "train/wiki_corpus_load.py:55-56 (hotpotqa: the abstracts TSV), 61-62 (kilt); "
                            "wiki_corpus_index_bulid/split_kilt_to_100.py:47 (the KILT line)",
    "corpus": _R1 + "evaluation/gen_search.sh:1 (--port: one retriever per corpus); train/wiki_corpus_load.py:55-62",
}
_SR_SOURCES = {
    "template": _SR + "scripts/data_process/qa_search_test_merge.py:32-36,75-78",
    "chat_template": _SR + "verl/utils/dataset/rl_dataset.py:128-131",
    "topk": _SR + "scripts/nq_hotpotqa/evaluate.sh:65",
    "max_turns": _SR + "scripts/nq_hotpotqa/evaluate.sh:63; search_r1/llm_agent/generation.py:234,278",
    "max_new_tokens_per_turn": _SR + "scripts/nq_hotpotqa/evaluate.sh:21",
    "temperature": _SR + "verl/trainer/ppo/ray_trainer.py:478 (do_sample False)",
    "top_p": _SR + "verl/trainer/ppo/ray_trainer.py:478 (greedy)",
    "judge_prompt": "none: Search-R1 reports EM",
    "datasets": _SR + "scripts/data_process/qa_search_test_merge.py:61-69; scripts/nq_hotpotqa/data_process.sh:9; "
                      "scripts/nq_hotpotqa/evaluate.sh:17 (val_data_num=null: every question)",
    "max_obs_tokens": _SR + "scripts/nq_hotpotqa/evaluate.sh:23",
    "max_length": _SR + "scripts/nq_hotpotqa/evaluate.sh:20 (max_prompt_length: the rolling context)",
    "obs_cut": _SR + "search_r1/llm_agent/generation.py:80-89 (the block of line 391 tokenised, then cut)",
    "engine_special_tokens": _SR + "verl/utils/torch_functional.py:236 (add_special_tokens=False)",
    "query_cleaning": _SR + "search_r1/llm_agent/generation.py:425 (stripped only)",
    "corpus": _SR + "retrieval_launch.sh:4 (wiki-18 for every set)",
}

#: R1-Searcher's released eval: HotpotQA against the abstracts, every other set against KILT (gen_search.sh --port)
_R1_PASSAGE_FORMAT = {"hotpotqa": "hotpotqa_abstracts", "default": "kilt"}
_R1_CORPUS = {"hotpotqa": "HotpotQA 2017 abstracts", "default": "KILT 2019 100-word passages"}
_R1_SEARCH = dict(chat_template=False, topk=5, max_turns=9, max_obs_tokens=None, query_cleaning="r1searcher_eval")
_R1_COMMON = dict(temperature=0.0, judge_prompt="r1searcher", datasets=_R1_SETS, max_length=None,
                  engine_special_tokens=True, passage_formats=_R1_PASSAGE_FORMAT, corpus=_R1_CORPUS)

SETTINGS: Dict[Tuple[str, str], PaperEvalSetting] = {
    ("r1searcher", "released"): PaperEvalSetting(
        "r1searcher", "released", template="eval", search=dict(_R1_SEARCH, max_new_tokens_per_turn=512),
        top_p=0.95, sources=_R1_RELEASED_SOURCES, **_R1_COMMON),
    ("r1searcher", "paper"): PaperEvalSetting(
        "r1searcher", "paper", template="train", search=dict(_R1_SEARCH, max_new_tokens_per_turn=500), top_p=1.0,
        sources=dict(_R1_RELEASED_SOURCES,
                     template=_R1 + "OpenRLHF-RAG/openrlhf/datasets/prompts_dataset.py:24-31 (the base-model "
                                    "prompt, the one template the paper prints)",
                     chat_template="plain text for every model: the paper prints the base-model prompt only; "
                                   "--chat_template gives prompts_dataset.py:10-20",
                     max_new_tokens_per_turn="this project's turn budget (the paper states none)"),
        **_R1_COMMON),
    ("searchr1", "released"): PaperEvalSetting(
        "searchr1", "released", template="train",
        search=dict(chat_template=None, topk=3, max_turns=5, max_new_tokens_per_turn=500, max_obs_tokens=500,
                    obs_cut="block", query_cleaning=""),
        temperature=0.0, top_p=1.0, judge_prompt=None, datasets=_SR_SETS, max_length=4096,
        engine_special_tokens=False, corpus={"default": "wiki-18"}, sources=_SR_SOURCES),
}
SETTINGS[("searchr1", "paper")] = PaperEvalSetting(**dict(SETTINGS[("searchr1", "released")].to_dict(),
                                                          name="paper"))


def eval_setting(protocol: str, name: str = "released") -> PaperEvalSetting:
    """The named setting of a paper's evaluation.

    Raises:
        ValueError: no such paper / setting (the message lists the known ones).
    """
    try:
        return SETTINGS[(protocol, name)]
    except KeyError:
        raise ValueError(f"no eval setting {name!r} for protocol {protocol!r}; known: "
                         f"{sorted(f'{p}:{n}' for p, n in SETTINGS)}") from None


def dataset_key(name: str, keys) -> str:
    """The key of a per-dataset table (``passage_formats``, ``corpus``, ``cli.eval --retriever_url``) that applies to
    dataset ``name``: the name itself, else its canonical paper name (``hotpotqa_500`` -> ``hotpotqa``,
    ``paper_reference.canonical_dataset``), else "default". Returns "" when none is in ``keys``."""
    from openrlhf_search.evaluation.paper_reference import canonical_dataset

    keys = set(keys)
    for key in (name, canonical_dataset(name), "default"):
        if key and key in keys:
            return key
    return ""


def for_dataset(table: Dict[str, str], name: str, default: str = "") -> str:
    """``table[dataset_key(name, table)]``, or ``default`` when no key applies."""
    key = dataset_key(name, table)
    return table[key] if key else default
