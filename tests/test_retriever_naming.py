"""The node setup names its encoder (no silent BM25), and the launchers' retriever check names what the retrievers
serve and warns when it is not the paper's setting."""

import os
import subprocess
import sys

from openrlhf_search.launch.retriever_check import serving_line
from tests.test_launchers import SCRIPTS, _common, _env
from tests.test_proxy_env import _Retriever, _serve

HEALTH = {"fingerprint": "abc", "encoder": "bm25", "index_type": "bm25", "count": 300, "corpus_path": "/d/wiki.jsonl"}


def test_cluster_node_setup_refuses_an_unnamed_encoder():
    cmd = ["bash", os.path.join(SCRIPTS, "cluster_node_setup.sh"), "--corpus", "/x/wiki.jsonl"]
    res = subprocess.run(cmd, capture_output=True, text=True, env=_env(DRY_RUN="1", HEAD="1"), timeout=60)
    assert res.returncode == 2 and res.stdout == "" and "RETRIEVER_ENCODER=e5-base-v2" in res.stderr
    assert len(res.stderr.strip().splitlines()) == 1
    res = subprocess.run(cmd + ["--encoder", "e5-base-v2"], capture_output=True, text=True,
                         env=_env(DRY_RUN="1", HEAD="1", PYTHON=sys.executable), timeout=60)
    assert res.returncode == 0 and "--encoder e5-base-v2" in res.stdout, res.stderr


def test_serving_line_names_the_index_and_warns_off_the_paper_setting():
    lines = serving_line(HEALTH, "e5-base-v2", "flat")
    assert lines[0].startswith("serving: bm25 bm25 index over 300 passages of /d/wiki.jsonl")
    assert len(lines) == 2 and "encoder bm25 (paper: e5-base-v2)" in lines[1] and "index type bm25" in lines[1]
    same = dict(HEALTH, encoder="intfloat/e5-base-v2", index_type="flat")
    assert len(serving_line(same, "e5-base-v2", "flat")) == 1
    assert len(serving_line(HEALTH)) == 1  # no paper setting to compare with (SETTING=paper, eval)


class _Bm25(_Retriever):
    def do_GET(self):
        self._send(200, HEALTH)


def test_launcher_check_logs_the_index_and_the_warning():
    server, url = _serve(_Bm25)
    try:
        snippet = "check_retriever_urls; echo CHECKED"
        res = _common(snippet, timeout=60, RETRIEVER_URLS=url, PAPER_RETRIEVER_ENCODER="e5-base-v2",
                      PAPER_RETRIEVER_INDEX_TYPE="flat", SETTING="released")
        assert res.returncode == 0 and "CHECKED" in res.stdout, res.stderr
        assert "serving: bm25 bm25 index over 300 passages of /d/wiki.jsonl" in res.stderr
        assert "warning: the retrievers differ from the paper setting" in res.stderr
        res = _common(snippet, timeout=60, RETRIEVER_URLS=url, PAPER_RETRIEVER_ENCODER="e5-base-v2", SETTING="paper")
        assert "serving: bm25" in res.stderr and "warning" not in res.stderr
    finally:
        server.shutdown()
