"""``retriever/`` is a standalone service: it must not import the trainer package ``openrlhf_search``
(the ``minilm`` encoder preset once imported ``cpu_demo.offline_assets``)."""

import ast
import json
import os
import subprocess
import sys

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
RETRIEVER = os.path.join(REPO, "retriever")


def _imported_modules(path: str) -> set[str]:
    tree = ast.parse(open(path, encoding="utf-8").read(), filename=path)
    names = set()
    for node in ast.walk(tree):  # every import, module level or inside a function
        if isinstance(node, ast.Import):
            names.update(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            names.add(node.module)
    return names


def test_no_retriever_module_imports_the_trainer_package():
    offenders, seen = {}, []
    for folder, _dirs, files in os.walk(RETRIEVER):  # subpackages too (retriever/web)
        for name in sorted(files):
            if name.endswith(".py"):
                path = os.path.join(folder, name)
                seen.append(os.path.relpath(path, RETRIEVER))
                bad = sorted(m for m in _imported_modules(path)
                             if m == "openrlhf_search" or m.startswith("openrlhf_search."))
                if bad:
                    offenders[os.path.relpath(path, RETRIEVER)] = bad
    assert offenders == {}
    assert os.path.join("web", "backend.py") in seen


SCRIPT = r"""
import json, sys
sys.modules["openrlhf_search"] = None  # any import of it now raises ImportError
import importlib, pkgutil, retriever
for m in pkgutil.walk_packages(retriever.__path__, "retriever."):  # subpackages too (retriever.web)
    importlib.import_module(m.name)
from retriever.encoders import resolve_encoder
from retriever.index import build_index, load_index
from retriever.server import create_app
spec = resolve_encoder("minilm")  # the offline model path, once read from openrlhf_search
corpus, out = sys.argv[1], sys.argv[2]
build_index(corpus, out, encoder="bm25")
index = load_index(out)
create_app(index)
loaded = sorted(k for k, v in sys.modules.items() if k.startswith("openrlhf_search") and v is not None)
print(json.dumps({"minilm": spec.model, "hits": [h["id"] for h in index.search(["Italy"], 3)[0]], "loaded": loaded}))
"""


def test_retriever_runs_with_the_trainer_package_unimportable(tmp_path):
    corpus = tmp_path / "c.jsonl"
    corpus.write_text(json.dumps({"id": "7", "title": "Rome", "text": "Rome is in Italy."}) + "\n"
                      + json.dumps({"id": "8", "title": "Paris", "text": "Paris is in France."}) + "\n")
    env = {**os.environ, "PYTHONPATH": REPO}
    proc = subprocess.run([sys.executable, "-c", SCRIPT, str(corpus), str(tmp_path / "idx")], env=env,
                          capture_output=True, text=True, timeout=240, cwd=str(tmp_path))
    assert proc.returncode == 0, proc.stderr[-3000:]
    out = json.loads(proc.stdout.strip().splitlines()[-1])
    assert out["hits"] == ["7"]
    assert os.path.isdir(out["minilm"]) and out["minilm"].endswith("model")
    assert out["loaded"] == []
