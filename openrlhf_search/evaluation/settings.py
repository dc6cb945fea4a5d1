"""The papers' evaluation settings, by name: ``released`` (what the released eval code runs) and ``paper``.

``cli.eval --setting released|paper`` starts from one of these; any explicit flag (``--topk``, ``--max_turns``, ...)
overrides the value it names. Every value cites the released file and line it was read from (R1-Searcher at commit
631167c of RUCAIBox/R1-Searcher, Search-R1 at a14dc3a of PeterGriffinJin/Search-R1).

R1-Searcher (arXiv 2503.05592, sec. 4.1), ``released``:

- prompt: ``base_prompt_v0`` (``evaluation/eval_search_loacl.py:58-62``, chosen by ``evaluation/gen_search.sh:1``
  ``--prompt_type v0``, applied at ``eval_search_loacl.py:85-88``), plain text for base and instruct models alike
  (the string goes to ``LLM.generate`` at line 186: no chat template);
- top-k 5 (``eval_search_loacl.py:230``, sent as ``k`` at line 268);
- greedy: ``--temp 0.0`` (``gen_search.sh:1``); ``top_p`` 0.95 and 512 tokens per generation call
  (``eval_search_loacl.py:173``), stop at ``<|end_of_query|>`` / ``</answer>`` / EOS (line 172);
- at most 9 generation calls whose output counts (line 203: the 10th call's output is dropped as "many_retrieve");
- one retriever per dataset corpus (``--port`` per run, ``gen_search.sh:1``): HotpotQA on the HotpotQA abstracts,
  2Wiki / MuSiQue / Bamboogle on KILT 100-word passages (the corpus is the retriever's, named in the output table);
- judge: ``evaluation/metric_calc_gpt_as_judge.py`` (prompt lines 64-69, one user message line 90, gpt-4o-mini line
  91, ``max_tokens`` 1024 and the server's default temperature lines 31-38): ``judge.JUDGE_PROMPTS["r1searcher"]``;
- sets: ``data/eval_set/{hotpotqa_500,2wiki_500,musique_500,bamboogle}.jsonl``.

R1-Searcher ``paper``: the same, except the prompt is the training template (``datasets/prompts_dataset.py:24-31``;
the paper prints one prompt and no separate eval prompt) with the chat template for instruct models
(``prompts_dataset.py:10-20``), and 500 tokens per call (this project's turn budget; the paper states none).

Search-R1 (arXiv 2503.09516, sec. 4), ``released`` = ``paper`` (the released eval matches the paper's text):

- sets: the full test split of each FlashRAG dataset, dev where there is no test split
  (``scripts/data_process/qa_search_test_merge.py:61-69``, listed in ``scripts/nq_hotpotqa/data_process.sh:9``),
  every question (``scripts/nq_hotpotqa/evaluate.sh:17`` ``data.val_data_num=null``; a number would sample,
  ``verl/trainer/ppo/ray_trainer.py:403-407``);
- prompt: the training prompt ("?" appended, the policy's chat template), ``qa_search_test_merge.py:75-78``,
  ``verl/utils/dataset/rl_dataset.py:128-131``;
- top-k 3 (``evaluate.sh:65``), ``max_turns`` 4 searches (``evaluate.sh:63``) + the final answering call
  (``search_r1/llm_agent/generation.py:234, 278``) = 5 model turns, 500 tokens per call (``evaluate.sh:21``), 500
  tokens per observation (``evaluate.sh:23``), greedy (``ray_trainer.py:478`` ``do_sample: False``);
- metric: EM; no judge.
"""

from dataclasses import asdict, dataclass, field
from typing import Dict, Optional, Tuple

R1SEARCHER_COMMIT = "631167c"
SEARCHR1_COMMIT = "a14dc3a"


@dataclass(frozen=True)
class PaperEvalSetting:
    """One named evaluation setting of one paper.

    Attributes:
        paper: "r1searcher" or "searchr1" (= the protocol name).
        name: "released" or "paper".
        template: the protocol's prompt variant (``Protocol.build_prompt(template=...)``).
        chat: chat template on/off; None = the protocol's default for the policy's tokenizer.
        topk: passages per query.
        max_turns: model turns (generation calls) per question.
        max_new_tokens: tokens per generation call.
        temperature: 0 = greedy.
        top_p: nucleus sampling (irrelevant when greedy; recorded for parity).
        judge_prompt: ``judge.JUDGE_PROMPTS`` key, or None when the paper reports no judge metric.
        datasets: default eval sets (``loaders.load_eval_dataset`` names).
        sources: setting -> "file:line" it was read from.
    """

    paper: str
    name: str
    template: str
    chat: Optional[bool]
    topk: int
    max_turns: int
    max_new_tokens: int
    temperature: float
    top_p: float
    judge_prompt: Optional[str]
    datasets: Tuple[str, ...]
    sources: Dict[str, str] = field(default_factory=dict)

    def to_dict(self) -> dict:
        return asdict(self)


_R1 = "RUCAIBox/R1-Searcher@" + R1SEARCHER_COMMIT + " "
_SR = "PeterGriffinJin/Search-R1@" + SEARCHR1_COMMIT + " "
_R1_SETS = ("hotpotqa_500", "2wiki_500", "musique_500", "bamboogle")
_SR_SETS = ("nq", "triviaqa", "popqa", "hotpotqa", "2wikimultihopqa", "musique", "bamboogle")

_R1_RELEASED_SOURCES = {
    "template": _R1 + "evaluation/eval_search_loacl.py:58-62,85-88 (base_prompt_v0); evaluation/gen_search.sh:1 "
                      "(--prompt_type v0)",
    "chat": _R1 + "evaluation/eval_search_loacl.py:186 (plain string to LLM.generate: no chat template)",
    "topk": _R1 + "evaluation/eval_search_loacl.py:230,268",
    "max_turns": _R1 + "evaluation/eval_search_loacl.py:179,203 (the 10th call's output is dropped)",
    "max_new_tokens": _R1 + "evaluation/eval_search_loacl.py:173",
    "temperature": _R1 + "evaluation/gen_search.sh:1 (--temp 0.0)",
    "top_p": _R1 + "evaluation/eval_search_loacl.py:173",
    "judge_prompt": _R1 + "evaluation/metric_calc_gpt_as_judge.py:31-38,64-69,90-91",
    "datasets": _R1 + "data/eval_set/",
}
_SR_SOURCES = {
    "template": _SR + "scripts/data_process/qa_search_test_merge.py:32-36,75-78",
    "chat": _SR + "verl/utils/dataset/rl_dataset.py:128-131",
    "topk": _SR + "scripts/nq_hotpotqa/evaluate.sh:65",
    "max_turns": _SR + "scripts/nq_hotpotqa/evaluate.sh:63; search_r1/llm_agent/generation.py:234,278",
    "max_new_tokens": _SR + "scripts/nq_hotpotqa/evaluate.sh:21",
    "temperature": _SR + "verl/trainer/ppo/ray_trainer.py:478 (do_sample False)",
    "top_p": _SR + "verl/trainer/ppo/ray_trainer.py:478 (greedy)",
    "judge_prompt": "none: Search-R1 reports EM",
    "datasets": _SR + "scripts/data_process/qa_search_test_merge.py:61-69; scripts/nq_hotpotqa/data_process.sh:9; "
                      "scripts/nq_hotpotqa/evaluate.sh:17 (val_data_num=null: every question)",
}

SETTINGS: Dict[Tuple[str, str], PaperEvalSetting] = {
    ("r1searcher", "released"): PaperEvalSetting(
        "r1searcher", "released", template="eval", chat=False, topk=5, max_turns=9, max_new_tokens=512,
        temperature=0.0, top_p=0.95, judge_prompt="r1searcher", datasets=_R1_SETS, sources=_R1_RELEASED_SOURCES),
    ("r1searcher", "paper"): PaperEvalSetting(
        "r1searcher", "paper", template="train", chat=None, topk=5, max_turns=9, max_new_tokens=500,
        temperature=0.0, top_p=1.0, judge_prompt="r1searcher", datasets=_R1_SETS,
        sources=dict(_R1_RELEASED_SOURCES,
                     template=_R1 + "OpenRLHF-RAG/openrlhf/datasets/prompts_dataset.py:24-31 (the paper's prompt)",
                     chat=_R1 + "OpenRLHF-RAG/openrlhf/datasets/prompts_dataset.py:10-20 (instruct models)",
                     max_new_tokens="this project's turn budget (the paper states none)")),
    ("searchr1", "released"): PaperEvalSetting(
        "searchr1", "released", template="train", chat=None, topk=3, max_turns=5, max_new_tokens=500,
        temperature=0.0, top_p=1.0, judge_prompt=None, datasets=_SR_SETS, sources=_SR_SOURCES),
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
