"""The embedded default data set: a country-facts passage corpus and 1-/2-hop questions, built offline.

Two passages per country, written by this module from :mod:`countryinfo` facts:

- ``<code>-geo`` (title ``<name>``): region, capital, area, land borders;
- ``<code>-econ`` (title ``Economy of <name>``): currency, population, demonym, languages, dialling code, domain.

The capital never appears in an economy passage and the currency never in a geography passage, so a question that
links a capital to a currency needs two passages (multi-hop, as in HotpotQA-style training of R1-Searcher, arXiv
2503.05592 sec. 4.1). Question types:

- ``capital`` (1 hop): "What is the capital of X?"
- ``currency`` (1 hop): "Which currency is used in X?" (answer: ISO 4217 code, e.g. "EUR")
- ``currency_of_capital`` (2 hops): "What currency is used in the country whose capital is Z?"
- ``capital_of_neighbor`` (2+ hops): "What is the capital of the country that borders X and uses the currency Y?"
  (only when exactly one neighbour of X uses Y)

Rows are written in both R1-Searcher (``question, answer``) and FlashRAG (``id, question, golden_answers``) form,
plus ``hops``, ``type`` and ``supporting_ids`` (the passages a perfect searcher would read, in order; the last one
holds the answer).
Everything is deterministic given ``seed``. Run ``python -m cpu_demo.data.default_dataset --out DIR``.

Splits: ``split_questions`` holds out 20% of the questions (``eval.jsonl``, reported once, at the end); the CPU job
carves a validation split out of the training questions with :func:`validation_split` (never trained on, used for
every choice of setting). :func:`entity_vocabulary` lists every entity of each answer type (the trivial
"first entity of the asked type in the top passage" baseline, :mod:`openrlhf_search.evaluation.baselines`).
"""

import argparse
import json
import os
import random
from collections import Counter
from dataclasses import dataclass
from typing import Dict, List, Optional

from cpu_demo.data.countries import CountryFacts, load_country_facts

# the source folders no data is written into: the demo package (this file is cpu_demo/data/default_dataset.py)
# and the openrlhf_search package beside it
_DEMO_DIR = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
_SOURCE_DIRS = (_DEMO_DIR, os.path.join(os.path.dirname(_DEMO_DIR), "openrlhf_search"))

QUESTION_TYPES = ("capital", "currency", "currency_of_capital", "capital_of_neighbor")
# The entity type of each question type's answer (keys of :func:`entity_vocabulary`).
ANSWER_ENTITY_TYPE = {"capital": "capital", "currency": "currency", "currency_of_capital": "currency",
                      "capital_of_neighbor": "capital"}


def _join(names) -> str:
    names = list(names)
    if len(names) <= 1:
        return "".join(names)
    return ", ".join(names[:-1]) + " and " + names[-1]


def geo_passage(f: CountryFacts) -> Dict[str, str]:
    """The geography passage of one country (never mentions its currency). Returns a corpus row."""
    where = f"{f.subregion}, a part of {f.region}" if f.subregion and f.region else (f.region or "the world")
    sents = [f"{f.name} is a country in {where}.",
             f"The capital of {f.name} is {f.capital}, the seat of its government and one of its largest cities."]
    if f.area:
        sents.append(f"{f.name} covers an area of about {int(round(f.area)):,} square kilometres.")
    if f.borders:
        sents.append(f"{f.name} shares land borders with {_join(f.borders)}.")
    else:
        sents.append(f"{f.name} has no land border with another country.")
    sents.append(f"Maps of {f.region or 'the region'} show {f.name} with {f.capital} marked as its capital city.")
    text = " ".join(sents)
    return _row(f"{f.code}-geo", f.name, text)


def econ_passage(f: CountryFacts) -> Optional[Dict[str, str]]:
    """The economy-and-people passage of one country (never mentions its capital); None without a currency."""
    if not f.currencies:
        return None
    cur = f.currencies[0]
    sents = [f"The currency used in {f.name} is the {cur}; prices and wages in {f.name} are paid in {cur}."]
    if len(f.currencies) > 1:
        sents.append(f"Other currencies accepted in {f.name} include {_join(f.currencies[1:])}.")
    if f.population:
        people = f" The people of {f.name} are called {f.demonym}." if f.demonym else ""
        sents.append(f"{f.name} has a population of about {f.population:,} people.{people}")
    if f.languages:
        sents.append(f"Languages spoken in {f.name} have the ISO codes {_join(f.languages)}.")
    if f.calling_codes:
        sents.append(f"The international dialling code of {f.name} is +{f.calling_codes[0]}.")
    if f.tld:
        sents.append(f"Web sites in {f.name} use the internet domain {f.tld[0]}.")
    sents.append(f"Trade statistics of {f.name} are reported in {cur}.")
    return _row(f"{f.code}-econ", f"Economy of {f.name}", " ".join(sents))


def _row(pid: str, title: str, text: str) -> Dict[str, str]:
    # "contents" in the wiki-18 / FlashRAG form: quoted title, newline, text (``docs/design.md``,
    # "Retriever schemas").
    return {"id": pid, "title": title, "text": text, "contents": f'"{title}"\n{text}'}


def build_corpus(facts: List[CountryFacts]) -> List[Dict[str, str]]:
    """Corpus rows ``{"id","title","text","contents"}`` for all countries (geo then econ passage each)."""
    rows = []
    for f in facts:
        rows.append(geo_passage(f))
        econ = econ_passage(f)
        if econ is not None:
            rows.append(econ)
    return rows


def build_questions(facts: List[CountryFacts]) -> List[dict]:
    """All 1-hop and 2-hop questions with gold answers, in a fixed order (before shuffling).

    Returns rows with keys ``id, question, answer, golden_answers, hops, type, supporting_ids, anchors``
    (``anchors``: the strings of the question a passage must match to be found; used by tests).
    """
    by_name = {f.name: f for f in facts}
    capital_count = Counter(f.capital for f in facts)
    rows = []

    def add(qtype, question, answer, hops, support, anchors):
        rows.append({"id": f"{qtype}-{len(rows)}", "question": question, "answer": answer,
                     "golden_answers": [answer], "hops": hops, "type": qtype,
                     "supporting_ids": support, "anchors": anchors})

    for f in facts:
        add("capital", f"What is the capital of {f.name}?", f.capital, 1, [f"{f.code}-geo"], [f.name])
        if f.currencies:
            cur = f.currencies[0]
            add("currency", f"Which currency is used in {f.name}?", cur, 1, [f"{f.code}-econ"], [f.name])
            # not when the capital's name is in the country's: "Vatican City" / "Holy See (Vatican City State)"
            if capital_count[f.capital] == 1 and f.capital not in f.name:
                add("currency_of_capital", f"What currency is used in the country whose capital is {f.capital}?",
                    cur, 2, [f"{f.code}-geo", f"{f.code}-econ"], [f.capital])
        # The bridge entity is the unique neighbour of f that uses currency `cur`.
        neighbours = [by_name[b] for b in f.borders if b in by_name and by_name[b].currencies]
        cur_count = Counter(n.currencies[0] for n in neighbours)
        for n in neighbours:
            cur = n.currencies[0]
            if cur_count[cur] == 1 and (not f.currencies or f.currencies[0] != cur):
                add("capital_of_neighbor",
                    f"What is the capital of the country that borders {f.name} and uses the currency {cur}?",
                    n.capital, 2, [f"{f.code}-geo", f"{n.code}-econ", f"{n.code}-geo"], [f.name, cur])
    return rows


@dataclass
class DefaultDataset:
    """Paths and sizes of a built default data set.

    Attributes:
        out_dir: folder holding the files.
        corpus_path: passages jsonl ``{"id","title","text","contents"}``.
        train_path, eval_path: question jsonl (R1-Searcher + FlashRAG fields).
        n_passages, n_train, n_eval: row counts.
    """

    out_dir: str
    corpus_path: str
    train_path: str
    eval_path: str
    n_passages: int
    n_train: int
    n_eval: int


def split_questions(rows: List[dict], seed: int = 0, eval_fraction: float = 0.2,
                    max_train: Optional[int] = None, max_eval: Optional[int] = None):
    """Deterministic shuffle-and-split. Returns ``(train_rows, eval_rows)``.

    Raises:
        ValueError: ``eval_fraction`` outside (0, 1) or no rows.
    """
    if not 0.0 < eval_fraction < 1.0:
        raise ValueError(f"eval_fraction must be in (0, 1), got {eval_fraction}")
    if not rows:
        raise ValueError("no questions to split")
    rows = list(rows)
    random.Random(seed).shuffle(rows)
    n_eval = max(1, int(round(len(rows) * eval_fraction)))
    eval_rows, train_rows = rows[:n_eval], rows[n_eval:]
    if max_train is not None:
        train_rows = train_rows[:max_train]
    if max_eval is not None:
        eval_rows = eval_rows[:max_eval]
    return train_rows, eval_rows


def validation_split(train_rows: List[dict], size: int, seed: int = 0):
    """Carve a validation split out of the training questions: ``size`` rows drawn without replacement by a
    generator seeded from ``seed`` (the data seed), disjoint from the held-out questions because it is taken from the
    training rows only. Both parts keep the input order. Returns ``(train_rows, validation_rows)``.

    Raises:
        ValueError: ``size`` negative, or leaving no training row.
    """
    if size < 0:
        raise ValueError(f"validation size must be >= 0, got {size}")
    if size and size >= len(train_rows):
        raise ValueError(f"a validation split of {size} leaves no training question (of {len(train_rows)})")
    picked = set(random.Random(f"validation-{seed}").sample(range(len(train_rows)), size))
    return ([r for i, r in enumerate(train_rows) if i not in picked],
            [r for i, r in enumerate(train_rows) if i in picked])


def entity_vocabulary(facts: Optional[List[CountryFacts]] = None) -> Dict[str, List[str]]:
    """Every entity of each type that answers a question: ``{"capital": [...], "currency": [...] (ISO 4217 codes,
    all listed), "country": [...]}``, each sorted and unique.

    Raises:
        CountryDataError: ``countryinfo`` unusable (when ``facts`` is None).
    """
    facts = load_country_facts() if facts is None else facts
    return {"capital": sorted({f.capital for f in facts if f.capital}),
            "currency": sorted({c for f in facts for c in f.currencies}),
            "country": sorted({f.name for f in facts})}


def _write_jsonl(path: str, rows: List[dict]) -> None:
    tmp = path + ".tmp"
    with open(tmp, "w", encoding="utf-8") as fh:
        for r in rows:
            fh.write(json.dumps(r, ensure_ascii=False) + "\n")
    os.replace(tmp, path)  # atomic: a killed build never leaves half a file behind


def build_default_dataset(out_dir: str, seed: int = 0, eval_fraction: float = 0.2,
                          max_train: Optional[int] = None, max_eval: Optional[int] = None) -> DefaultDataset:
    """Write ``corpus.jsonl``, ``train.jsonl``, ``eval.jsonl`` and ``manifest.json`` into ``out_dir``.

    Args:
        out_dir: a work folder (created). Must not lie inside the ``cpu_demo`` or ``openrlhf_search`` package.
        seed: shuffling seed; the same seed gives byte-identical files.
        eval_fraction: share of questions held out for evaluation.
        max_train, max_eval: optional caps on the number of rows written.
    Raises:
        ValueError: ``out_dir`` inside the package source, or a bad fraction.
        CountryDataError: ``countryinfo`` unusable.
    """
    out_dir = os.path.abspath(out_dir)
    if any(os.path.commonpath([out_dir, d]) == d for d in _SOURCE_DIRS):
        raise ValueError(f"refusing to write data into the package source tree: {out_dir}")
    facts = load_country_facts()
    corpus = build_corpus(facts)
    train, evalq = split_questions(build_questions(facts), seed, eval_fraction, max_train, max_eval)
    os.makedirs(out_dir, exist_ok=True)
    ds = DefaultDataset(out_dir, os.path.join(out_dir, "corpus.jsonl"), os.path.join(out_dir, "train.jsonl"),
                        os.path.join(out_dir, "eval.jsonl"), len(corpus), len(train), len(evalq))
    _write_jsonl(ds.corpus_path, corpus)
    _write_jsonl(ds.train_path, train)
    _write_jsonl(ds.eval_path, evalq)
    manifest = {"seed": seed, "eval_fraction": eval_fraction, "n_passages": len(corpus), "n_train": len(train),
                "n_eval": len(evalq), "source": "countryinfo", "hops": dict(Counter(r["hops"] for r in train))}
    with open(os.path.join(out_dir, "manifest.json"), "w") as fh:
        json.dump(manifest, fh, indent=1, sort_keys=True)
    return ds


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description="Build the embedded country-facts corpus and 1-/2-hop questions.")
    p.add_argument("--out", required=True, help="output folder (e.g. runs/default/data)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--eval_fraction", type=float, default=0.2)
    p.add_argument("--max_train", type=int, default=None)
    p.add_argument("--max_eval", type=int, default=None)
    a = p.parse_args(argv)
    ds = build_default_dataset(a.out, a.seed, a.eval_fraction, a.max_train, a.max_eval)
    print(json.dumps(ds.__dict__))


if __name__ == "__main__":
    main()
