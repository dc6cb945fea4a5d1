"""R1-Searcher's online Bamboogle evaluation against a web retriever (``retriever.server --web``) with a local Serper
stand-in (``tests/retriever/web_standins.py``; request / answer shapes of https://serper.dev's API playground):
the runner retrieves web passages, a refused key stops the evaluation, the ``NAME@web`` row is labelled with the
web retriever and set beside R1-Searcher's online figure, a web row routed to a local index is refused, and
``eval.sh`` with ``ONLINE=1`` adds the row and its route. Nothing reaches a real provider."""

import os
import subprocess
import sys

import pytest

from openrlhf_search.cli.eval import describe_retriever
from openrlhf_search.evaluation.loaders import load_eval_dataset
from openrlhf_search.evaluation.paper_reference import canonical_dataset, reference_numbers, split_tag
from openrlhf_search.evaluation.summary import format_table
from openrlhf_search.env.retrieval_client import RetrievalStopped
from tests.conftest import REPO_ROOT, shared_path
from tests.retriever.test_web_server import AppServer, web_index
from tests.retriever.web_standins import ProviderStandIn, no_real_provider  # noqa: F401 (autouse fixture)

EVAL_SH = os.path.join(REPO_ROOT, "examples", "scripts", "eval.sh")


@pytest.fixture
def serper():
    s = ProviderStandIn("serper")
    yield s
    s.close()


def test_runner_retrieves_web_passages_and_a_refused_key_stops_the_evaluation(serper, qwen_tokenizer):
    from openrlhf_search.env.config import SearchConfig
    from openrlhf_search.evaluation.runner import EvalSettings, run_eval_sync
    from openrlhf_search.env.protocol import get_protocol
    from tests.test_eval_e2e import ScriptedEngine

    examples = load_eval_dataset("bamboogle@web", data_dir=shared_path())[:4]
    engine = ScriptedEngine(qwen_tokenizer, get_protocol("r1searcher"))
    good = AppServer(web_index(serper, site="en.wikipedia.org"))
    try:
        settings = EvalSettings(search=SearchConfig(protocol="r1searcher", retriever_urls=[good.url], topk=3,
                                                    max_turns=3, max_new_tokens_per_turn=64),
                                model="scripted", max_length=4096, concurrency=4)
        rows = run_eval_sync(examples, settings, engine=engine, tokenizer=qwen_tokenizer)
    finally:
        good.close()
    for ex, r in zip(examples, rows):
        assert r["error"] is None and r["searches"] == 1 and r["stop_reason"] == "answer"
        assert r["prediction"] == f"{ex.question} site:en.wikipedia.org result 1"  # the web's first title
    assert len(serper.searches) == 4
    bad = AppServer(web_index(serper, key="sk-not-the-key"))
    try:
        settings = EvalSettings(search=SearchConfig(protocol="r1searcher", retriever_urls=[bad.url], topk=3,
                                                    max_turns=3, max_new_tokens_per_turn=64),
                                model="scripted", max_length=4096, concurrency=4)
        with pytest.raises(RetrievalStopped, match="serper refused the API key"):
            run_eval_sync(examples, settings, engine=engine, tokenizer=qwen_tokenizer)
    finally:
        bad.close()


def test_the_web_row_is_labelled_and_set_beside_the_online_figure(serper):
    index = web_index(serper, site="en.wikipedia.org")
    try:
        corpus, retriever = describe_retriever(index.info())
    finally:
        index.close()
    assert (corpus, retriever) == ("the web (site:en.wikipedia.org)", "serper web search (snippet)")
    assert describe_retriever({"corpus_path": "/d/kilt_100w.jsonl", "encoder": "bge", "index_type": "flat",
                               "count": 9}) == ("kilt_100w.jsonl", "bge (flat, 9 passages)")
    summaries = {"bamboogle": {"n": 125, "cover_em": 0.5, "corpus": "kilt_100w.jsonl", "retriever": "bge (flat)"},
                 "bamboogle@web": {"n": 125, "cover_em": 0.6, "corpus": corpus, "retriever": retriever}}
    table = format_table(summaries, {"model": "m", "topk": 5}, "r1searcher")
    lines = table.splitlines()
    web = lines.index("| bamboogle@web | ours | m | the web (site:en.wikipedia.org) | serper web search (snippet) | 5 "
                      "| 125 | – | – | 0.600 | – |")
    local = lines.index("| bamboogle | ours | m | kilt_100w.jsonl | bge (flat) | 5 | 125 | – | – | 0.500 | – |")
    assert local < web
    online = [ln for ln in lines[web + 1:] if ln.startswith("| bamboogle |")]
    assert online == ["| bamboogle | R1-Searcher online search | Qwen-2.5-7B-Base (R1-Searcher, RL from base), online "
                      "search | the web: Google via a Serper-style API, site:en.wikipedia.org | top-3 result pages, "
                      "one gpt-4o-mini summary per query (evaluation/eval_search_online.py) | 3 |  | – | – | 0.624 "
                      "| – |"]
    assert "0.624" not in "\n".join(lines[local:web])  # the local row keeps Table 1's numbers only
    assert [r.value for r in reference_numbers("bamboogle", "r1searcher") if r.metric == "cover_em"] == \
        [0.528, 0.504, 0.496]


def test_dataset_tags():
    assert split_tag("bamboogle@web") == ("bamboogle", "web") and split_tag("bamboogle") == ("bamboogle", "")
    assert split_tag("a@b c") == ("a@b c", "") and canonical_dataset("bamboogle@web") == "bamboogle"
    assert [e.question for e in load_eval_dataset("bamboogle@web", data_dir=shared_path())] == \
        [e.question for e in load_eval_dataset("bamboogle", data_dir=shared_path())]


def test_a_web_row_routed_to_a_local_index_is_refused(hotpotqa_bm25_index, tiny_model_dir, capsys):
    from openrlhf_search.cli.eval import main
    from retriever.launch import start_server_process, stop_server_process

    proc, url = start_server_process(hotpotqa_bm25_index)
    try:
        rc = main(["--model", tiny_model_dir, "--protocol", "r1searcher", "--datasets", "bamboogle", "bamboogle@web",
                   "--data_dir", shared_path(), "--limit", "1", "--retriever_url", url])
    finally:
        stop_server_process(proc)
    assert rc == 2
    assert capsys.readouterr().err.strip().splitlines()[-1] == (
        f"error: bamboogle@web: its retriever {url} is not a web retriever (give --retriever_url bamboogle@web=URL "
        "of python -m retriever.server --web PROVIDER)")


def test_eval_sh_online_adds_the_web_row_and_its_route(tiny_model_dir):
    env = {k: v for k, v in os.environ.items() if not k.endswith(("_RETRIEVER_URL", "_CORPUS")) and k != "ONLINE"}
    env.update(PYTHON=sys.executable, DRY_RUN="1", ONLINE="1", KILT_RETRIEVER_URL="http://10.0.0.2:8002",
               DATA_DIR=shared_path(),  # the dry run loads R1-Searcher's four sets before anything starts
               HOTPOTQA_RETRIEVER_URL="http://10.0.0.1:8001")
    res = subprocess.run(["bash", EVAL_SH, tiny_model_dir, "r1searcher"], capture_output=True, text=True, timeout=60,
                         env=env)
    assert res.returncode == 0, res.stderr
    assert "--datasets hotpotqa_500 2wiki_500 musique_500 bamboogle bamboogle@web" in res.stdout
    assert ("--retriever_url hotpotqa=http://10.0.0.1:8001\\,default=http://10.0.0.2:8002\\,"
            "bamboogle@web=http://127.0.0.1:8003") in res.stdout
    assert "would start" in res.stderr and "-m retriever.server --web serper --port 8003 --web_site en.wikipedia.org" \
        in res.stderr and "--web_max_queries 2000" in res.stderr
    given = subprocess.run(["bash", EVAL_SH, tiny_model_dir, "r1searcher"], capture_output=True, text=True, timeout=60,
                           env=dict(env, WEB_RETRIEVER_URL="http://10.0.0.3:9000", WEB_PROVIDER="serpapi"))
    assert given.returncode == 0 and "bamboogle@web=http://10.0.0.3:9000" in given.stdout
    assert "retriever.server --web" not in given.stderr
    other = subprocess.run(["bash", EVAL_SH, tiny_model_dir, "searchr1"], capture_output=True, text=True, timeout=60,
                           env=env)
    assert other.returncode == 2 and "use it with r1searcher" in other.stderr
