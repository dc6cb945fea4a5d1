"""The numbers the two papers report, with the setup that produced each one.

A reproduced number is only comparable with a reference number when corpus, retriever, top-k, model and eval set
match, so every reference row carries them and the summary table prints them beside ours.

Sources (each setup is a :class:`PaperSetup` below): R1-Searcher (arXiv 2503.05592) Table 1, Cover-EM (ACC_R) and
GPT-4o-mini judge accuracy (ACC_L); Search-R1 (arXiv 2503.09516) Table 2, EM; and R1-Searcher's online search (its
README, lines 98 and 104-105, figure ``assets/bamboogle_online.jpg``): Bamboogle with Google searched online,
Cover-EM (the figure's local bars equal Table 1's ACC_R: 52.8, 50.4). The released
``evaluation/eval_search_online.py`` sends each query with ``site:en.wikipedia.org`` to a Serper-style API (lines
200-244, 406), reads the top-3 result pages (line 410) and puts one gpt-4o-mini summary of the first useful page into
the documents block (lines 110-130, 416-428); our rows for it are named ``bamboogle@web`` (:func:`split_tag`).
"""

import os
import re
from dataclasses import asdict, dataclass
from typing import Dict, List, Optional, Tuple


@dataclass(frozen=True)
class PaperSetup:
    """What produced a reference number.

    Attributes:
        paper: "R1-Searcher" or "Search-R1" (with arXiv id).
        corpus: retrieval corpus.
        retriever: encoder or sparse method.
        topk: passages per query at evaluation.
        eval_set: which questions (split, size).
        judge: judge model behind ACC_L, None when the paper reports no judge metric.
    """

    paper: str
    corpus: str
    retriever: str
    topk: int
    eval_set: str
    judge: Optional[str] = None


R1SEARCHER_SETUP = PaperSetup(
    paper="R1-Searcher (arXiv 2503.05592, Tab. 1)",
    corpus="KILT Wikipedia 2019, 100-word passages",
    retriever="bge-large-en-v1.5 (dense)",
    topk=5,
    eval_set="dev, 500 questions (Bamboogle: all 125)",
    judge="gpt-4o-mini",
)

SEARCHR1_SETUP = PaperSetup(
    paper="Search-R1 (arXiv 2503.09516, Tab. 2)",
    corpus="Wikipedia 2018 (wiki-18, DPR 100-word passages)",
    retriever="e5-base-v2 (dense)",
    topk=3,
    eval_set="test (NQ, TQA, PopQA, Bamboogle) / dev (HotpotQA, 2Wiki, MuSiQue), full sets",
)

R1SEARCHER_ONLINE_SETUP = PaperSetup(
    paper="R1-Searcher online search (README figure bamboogle_online)",
    corpus="the web: Google via a Serper-style API, site:en.wikipedia.org",
    retriever="top-3 result pages, one gpt-4o-mini summary per query (evaluation/eval_search_online.py)",
    topk=3,
    eval_set="Bamboogle, all 125",
)

#: canonical dataset keys used in the tables below
DATASETS = ("nq", "triviaqa", "popqa", "hotpotqa", "2wiki", "musique", "bamboogle")

_ALIASES = {
    "nq": "nq", "natural_questions": "nq",
    "triviaqa": "triviaqa", "tqa": "triviaqa",
    "popqa": "popqa",
    "hotpotqa": "hotpotqa", "hotpotqa_500": "hotpotqa",
    "2wiki": "2wiki", "2wikimultihopqa": "2wiki", "2wiki_500": "2wiki",
    "musique": "musique", "musique_500": "musique",
    "bamboogle": "bamboogle",
}

# R1-Searcher Table 1: (Cover-EM ACC_R, judge ACC_L)
R1SEARCHER_TABLE: Dict[str, Dict[str, tuple]] = {
    "Qwen-2.5-7B-Base (R1-Searcher, RL from base)": {
        "hotpotqa": (0.654, 0.750), "2wiki": (0.636, 0.650), "bamboogle": (0.528, 0.544), "musique": (0.282, 0.314)},
    "Llama-3.1-8B-Instruct (R1-Searcher)": {
        "hotpotqa": (0.648, 0.746), "2wiki": (0.594, 0.628), "bamboogle": (0.504, 0.544), "musique": (0.254, 0.282)},
    "ReARTeR (GPT-4o-mini), best baseline": {
        "hotpotqa": (0.468, 0.506), "2wiki": (0.554, 0.534), "bamboogle": (0.496, 0.544), "musique": (0.296, 0.302)},
}

# R1-Searcher's online-search figure: Cover-EM (ACC_R) with web search
R1SEARCHER_ONLINE_TABLE: Dict[str, Dict[str, float]] = {
    "Qwen-2.5-7B-Base (R1-Searcher, RL from base), online search": {"bamboogle": 0.624},
}

# Search-R1 Table 2: EM
SEARCHR1_TABLE: Dict[str, Dict[str, float]] = {
    "Qwen2.5-7B base, PPO (Search-R1)": {
        "nq": 0.480, "triviaqa": 0.638, "popqa": 0.457, "hotpotqa": 0.433, "2wiki": 0.382, "musique": 0.196,
        "bamboogle": 0.432, "avg": 0.431},
    "Qwen2.5-7B instruct, PPO (Search-R1)": {
        "nq": 0.393, "triviaqa": 0.610, "popqa": 0.397, "hotpotqa": 0.370, "2wiki": 0.414, "musique": 0.146,
        "bamboogle": 0.368, "avg": 0.385},
    "Qwen2.5-3B base, PPO (Search-R1)": {
        "nq": 0.406, "triviaqa": 0.587, "popqa": 0.435, "hotpotqa": 0.284, "2wiki": 0.273, "musique": 0.049,
        "bamboogle": 0.088, "avg": 0.303},
    "Qwen2.5-3B instruct, PPO (Search-R1)": {
        "nq": 0.341, "triviaqa": 0.545, "popqa": 0.378, "hotpotqa": 0.324, "2wiki": 0.319, "musique": 0.103,
        "bamboogle": 0.264, "avg": 0.325},
    "Qwen2.5-7B base, GRPO (Search-R1)": {
        "nq": 0.395, "triviaqa": 0.560, "popqa": 0.388, "hotpotqa": 0.326, "2wiki": 0.297, "musique": 0.125,
        "bamboogle": 0.360, "avg": 0.350},
    "RAG baseline, Qwen2.5-7B": {
        "nq": 0.349, "triviaqa": 0.585, "popqa": 0.392, "hotpotqa": 0.299, "2wiki": 0.235, "musique": 0.058,
        "bamboogle": 0.208, "avg": 0.304},
}


@dataclass(frozen=True)
class ReferenceNumber:
    """One number of a paper table, with its setup.

    Attributes:
        model: row label of the paper table.
        dataset: canonical dataset key (``DATASETS``).
        metric: "cover_em", "judge_acc" or "em" (fractions in [0, 1]).
        value: the reported figure.
        setup: ``PaperSetup`` that produced it.
    """

    model: str
    dataset: str
    metric: str
    value: float
    setup: PaperSetup

    def to_dict(self) -> dict:
        d = asdict(self)
        d["setup"] = asdict(self.setup)
        return d


def split_tag(name: str) -> Tuple[str, str]:
    """``"bamboogle@web"`` -> ``("bamboogle", "web")``: a set evaluated again against another retriever, its rows
    labelled with the tag (``cli.eval --retriever_url bamboogle@web=URL``); ``(name, "")`` for a name without a tag
    (an existing file is never split)."""
    base, sep, tag = name.rpartition("@")
    if sep and base and re.fullmatch(r"[A-Za-z0-9_-]+", tag) and not os.path.exists(name):
        return base, tag
    return name, ""


def canonical_dataset(name: str) -> Optional[str]:
    """Map a dataset name or file stem (``2wikimultihopqa``, ``hotpotqa_500``, ``flashrag:nq``, ``bamboogle@web``)
    to a key of ``DATASETS``; None when the papers report nothing for it."""
    if not name:
        return None
    key = split_tag(name)[0].lower().rsplit("/", 1)[-1].split(":")[-1].strip()
    for suffix in (".jsonl", ".json", ".parquet", ".test", ".dev"):
        if key.endswith(suffix):
            key = key[: -len(suffix)]
    key = key.replace("-", "_")
    if key in _ALIASES:
        return _ALIASES[key]
    head = key.split("_")[0].split(".")[0]
    return _ALIASES.get(head)


def reference_numbers(dataset: str, paper: Optional[str] = None) -> List[ReferenceNumber]:
    """Every reported number for ``dataset`` (any alias), optionally for one paper ("r1searcher" / "searchr1").
    A name tagged ``@web`` gets the papers' online-search numbers only.

    Returns an empty list for datasets neither paper reports.
    """
    key = canonical_dataset(dataset)
    if key is None:
        return []
    out: List[ReferenceNumber] = []
    if split_tag(dataset)[1] == "web":
        if paper in (None, "r1searcher"):
            out += [ReferenceNumber(model, key, "cover_em", row[key], R1SEARCHER_ONLINE_SETUP)
                    for model, row in R1SEARCHER_ONLINE_TABLE.items() if key in row]
        return out
    if paper in (None, "r1searcher"):
        for model, row in R1SEARCHER_TABLE.items():
            if key in row:
                acc_r, acc_l = row[key]
                out.append(ReferenceNumber(model, key, "cover_em", acc_r, R1SEARCHER_SETUP))
                out.append(ReferenceNumber(model, key, "judge_acc", acc_l, R1SEARCHER_SETUP))
    if paper in (None, "searchr1"):
        for model, row in SEARCHR1_TABLE.items():
            if key in row:
                out.append(ReferenceNumber(model, key, "em", row[key], SEARCHR1_SETUP))
    return out
