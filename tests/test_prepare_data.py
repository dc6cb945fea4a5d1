"""prepare_data on the real R1-Searcher / Search-R1 / FlashRAG files, for both protocols, read back through
OpenRLHF's own prompt preprocessing."""

import json
import subprocess
import sys

import pytest

import openrlhf_search._cpu_compat  # noqa: F401
from openrlhf.datasets.prompts_dataset import preprocess_data

from tests.conftest import REPO_ROOT, shared_path
from openrlhf_search.evaluation.difficulty import bucket_of, count_correct, mix_buckets, parse_mix
from openrlhf_search.env.protocol import get_protocol


def _prepare(*args):
    return subprocess.run([sys.executable, "-m", "openrlhf_search.cli.prepare_data", *args], cwd=REPO_ROOT,
                          capture_output=True, text=True, timeout=300)


def _qwen_tokenizer_path():
    """The tokenizer of the tests' policies (the offline Qwen tokenizer): what searchr1 prompts are rendered with."""
    from cpu_demo.offline_assets import qwen_tokenizer_path

    return qwen_tokenizer_path()


def _rows(path):
    return [json.loads(line) for line in open(path)]


def test_r1searcher_stage2_base_prompt(tmp_path):
    src = shared_path("qa", "r1searcher", "stage_2.jsonl")
    out, ev = tmp_path / "train.jsonl", tmp_path / "eval.jsonl"
    proc = _prepare("--input", src, "--protocol", "r1searcher", "--out", str(out), "--eval_out", str(ev),
                    "--eval_size", "100", "--shuffle", "--seed", "3")
    assert proc.returncode == 0, proc.stderr
    source = _rows(src)
    train, held = _rows(out), _rows(ev)
    assert len(train) + len(held) == len(source) and len(held) == 100
    assert not {r["id"] for r in train} & {r["id"] for r in held}
    by_q = {r["question"].strip(): r["answer"] for r in source}
    for row in train[:50] + held[:50]:
        # what OpenRLHF reads with --data.input_key prompt --data.label_key label (no chat template)
        prompt, label = preprocess_data(row, None, "prompt", "label", None)
        assert prompt.endswith(f"User:{row['question']}\nAssistant: <think>")
        assert "<|begin_of_query|>" in prompt
        assert json.loads(label) == [by_q[row["question"]].strip()]
        assert row["datasource"] == "stage_2"


def test_searchr1_rows_render_the_papers_exact_prompt(tmp_path, qwen_tokenizer):
    src = shared_path("qa", "searchr1", "nq_hotpotqa_train_sample.jsonl")
    out = tmp_path / "train.jsonl"
    proc = _prepare("--input", src, "--protocol", "searchr1", "--tokenizer", _qwen_tokenizer_path(), "--out", str(out))
    assert proc.returncode == 0, proc.stderr
    rows, source = _rows(out), _rows(src)
    assert len(rows) == len(source) == 512
    for row, srow in zip(rows[:64], source[:64]):
        # Search-R1's own training prompt (chat messages in the row) through the same chat template
        expected = qwen_tokenizer.apply_chat_template(srow["prompt"], tokenize=False, add_generation_prompt=True)
        assert row["prompt"] == expected
        assert json.loads(row["label"]) == list(srow["reward_model"]["ground_truth"]["target"])
        assert row["datasource"] == srow["data_source"] in ("nq", "hotpotqa")


def test_flashrag_local_file_both_protocols(tmp_path):
    for protocol, marker in (("r1searcher", "<|begin_of_query|>"), ("searchr1", "<search>")):
        out = tmp_path / f"{protocol}.jsonl"
        proc = _prepare("--input", "flashrag:bamboogle", "--data_dir", shared_path(), "--protocol", protocol,
                        "--tokenizer", _qwen_tokenizer_path(), "--out", str(out))
        assert proc.returncode == 0, proc.stderr
        rows = _rows(out)
        source = _rows(shared_path("qa", "flashrag", "bamboogle.test.jsonl"))
        assert len(rows) == 125
        assert [json.loads(r["label"]) for r in rows] == [[g.strip() for g in s["golden_answers"]] for s in source]
        assert all(marker in r["prompt"] and r["question"] in r["prompt"] for r in rows)
        p = get_protocol(protocol)
        assert p.extract_answer(rows[0]["prompt"].split(rows[0]["question"])[-1]) == ""


def test_difficulty_bucketing_on_stage1(tmp_path):
    src = shared_path("qa", "r1searcher", "stage_1.jsonl")
    source = _rows(src)
    counts = {r["idx"]: count_correct(r["pred_anses"], [r["answer"]]) for r in source}
    expected = {str(k): bucket_of(c, 10) for k, c in counts.items()}
    out = tmp_path / "b.jsonl"
    proc = _prepare("--input", src, "--protocol", "r1searcher", "--bucket", "--out", str(out))
    assert proc.returncode == 0, proc.stderr
    rows = _rows(out)
    assert {r["id"]: r["difficulty"] for r in rows} == expected
    sizes = {b: sum(1 for v in expected.values() if v == b) for b in ("easy", "medium", "hard")}
    assert all(n > 0 for n in sizes.values()), sizes

    mixed = tmp_path / "m.jsonl"
    proc = _prepare("--input", src, "--protocol", "r1searcher", "--bucket", "--mix", "1:2:2", "--mix_total", "100",
                    "--out", str(mixed))
    assert proc.returncode == 0, proc.stderr
    got = [r["difficulty"] for r in _rows(mixed)]
    assert len(got) == 100 and got.count("easy") == 20 and got.count("medium") == 40 and got.count("hard") == 40

    proc = _prepare("--input", src, "--protocol", "r1searcher", "--bucket", "--mix", "1:0:0", "--mix_total", "200",
                    "--out", str(tmp_path / "x.jsonl"))
    assert proc.returncode == 2 and "bucket 'easy' has" in proc.stderr
    assert not (tmp_path / "x.jsonl").exists()


def test_bucketing_needs_rollouts_and_mix_helpers(tmp_path):
    proc = _prepare("--input", shared_path("qa", "r1searcher", "bamboogle.jsonl"), "--bucket", "--out",
                    str(tmp_path / "o.jsonl"))
    assert proc.returncode == 2 and "pred_anses" in proc.stderr
    assert bucket_of(0, 10) == "hard" and bucket_of(5, 10) == "medium" and bucket_of(6, 10) == "easy"
    with pytest.raises(ValueError):
        bucket_of(1, 10, hard_max=5, easy_min=3)
    assert parse_mix("0:2:2") == {"easy": 0.0, "medium": 0.5, "hard": 0.5}
    with pytest.raises(ValueError):
        parse_mix("1:2")
    with pytest.raises(ValueError, match="empty"):
        mix_buckets({"easy": [1], "medium": [], "hard": [2]}, parse_mix("1:1:1"))
    items, taken = mix_buckets({"easy": list(range(10)), "medium": list(range(10, 40)), "hard": []},
                               parse_mix("1:3:0"))
    assert taken == {"easy": 10, "medium": 30, "hard": 0} and sorted(items) == list(range(40))


def test_bad_input_is_a_clear_error(tmp_path):
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"question": "q1", "answer": "a"}\n{"question": "q2"}\n')
    proc = _prepare("--input", str(bad), "--out", str(tmp_path / "o.jsonl"))
    assert proc.returncode == 2 and "row 1" in proc.stderr and "no gold answer" in proc.stderr
    proc = _prepare("--input", "no_such_dataset_name", "--out", str(tmp_path / "o.jsonl"))
    assert proc.returncode == 2 and "unknown dataset" in proc.stderr


def test_bucketing_with_generated_rollouts(tmp_path, tiny_model_dir, scripted_engine, capsys, caplog):
    """No precomputed rollouts: N rollouts per question are sampled with a model through the real executor (here a
    scripted policy that answers "james madison" at once, right for the first question only), so the first question
    is easy and the other two hard (catches: generated answers not reaching the buckets, one rollout per question)."""
    from openrlhf_search.cli.prepare_data import main
    from openrlhf_search.env.protocol import get_protocol

    proto = get_protocol("r1searcher")
    built = scripted_engine("r1searcher", [f"{proto.answer_open} james madison {proto.answer_close}"])
    out = tmp_path / "g.jsonl"
    caplog.set_level("INFO")
    rc = main(["--input", shared_path("qa", "r1searcher", "bamboogle.jsonl"), "--limit", "3", "--bucket",
               "--bucket_model", tiny_model_dir, "--bucket_rollouts", "2", "--max_turns", "1", "--max_new_tokens",
               "16", "--retriever_url", "http://127.0.0.1:9", "--out", str(out)])
    err = capsys.readouterr().err
    assert rc == 0, err[-2000:]
    rows = _rows(out)
    assert len(rows) == 3 and [r["difficulty"] for r in rows] == ["easy", "hard", "hard"]
    assert "buckets: {'easy': 1, 'medium': 0, 'hard': 2}" in caplog.text + err
    assert len(built) == 1


def test_flashrag_name_without_local_copy_goes_to_the_hub(tmp_path, monkeypatch):
    """A FlashRAG name missing locally is loaded with datasets.load_dataset(RUC-NLPIR/FlashRAG_datasets, name, split);
    offline that fails with one clear error naming the dataset, split and hub repo."""
    from openrlhf_search.evaluation import loaders

    calls = []
    real = loaders.load_flashrag_hub

    def spy(name, split, limit=None):
        calls.append((name, split))
        return real(name, split, limit)

    monkeypatch.setattr(loaders, "load_flashrag_hub", spy)
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("HF_DATASETS_OFFLINE", "1")
    monkeypatch.setenv("HF_HOME", str(tmp_path / "hf"))
    with pytest.raises(loaders.DatasetError, match="RUC-NLPIR/FlashRAG_datasets") as err:
        loaders.load_eval_dataset("musique", data_dir=str(tmp_path))
    assert calls == [("musique", "dev")]  # Search-R1 evaluates MuSiQue on its dev split
    assert "'musique'" in str(err.value) and "'dev'" in str(err.value)


def test_searchr1_parquet_rows(tmp_path):
    """Search-R1 ships parquet (nested messages and numpy arrays of targets); same prompts as from jsonl."""
    import pandas as pd

    src = shared_path("qa", "searchr1", "test_sample.jsonl")
    rows = _rows(src)
    pq = tmp_path / "test.parquet"
    # Search-R1's own parquet rows carry no question / golden_answers columns: both come from prompt / reward_model
    pd.DataFrame(rows).drop(columns=["question", "golden_answers"]).to_parquet(pq)
    out_pq, out_js = tmp_path / "a.jsonl", tmp_path / "b.jsonl"
    for inp, out in ((str(pq), out_pq), (src, out_js)):
        proc = _prepare("--input", inp, "--protocol", "searchr1", "--tokenizer", _qwen_tokenizer_path(), "--out",
                        str(out))
        assert proc.returncode == 0, proc.stderr
    a, b = _rows(out_pq), _rows(out_js)
    assert len(a) == len(b) == 112
    assert [r["prompt"] for r in a] == [r["prompt"] for r in b]
    assert [r["label"] for r in a] == [r["label"] for r in b]
    assert [r["question"] for r in a] == [r["question"].strip() for r in rows]
    assert {r["datasource"] for r in a} == {"nq", "triviaqa", "popqa", "hotpotqa", "2wikimultihopqa", "musique",
                                            "bamboogle"}


def test_searchr1_train_merge_needs_the_hub_and_says_so(monkeypatch):
    """Offline (no hub, no cache) the merge fails with one line naming the source, before anything is written."""
    import datasets

    from openrlhf_search.cli import prepare_data
    from openrlhf_search.evaluation.loaders import DatasetError

    def offline(repo, name, **kw):
        raise ConnectionError("offline")

    monkeypatch.setattr(datasets, "load_dataset", offline)
    with pytest.raises(DatasetError, match="FlashRAG 'nq' train split could not be loaded") as e:
        prepare_data.load_searchr1_train_merge()
    assert "Search-R1's own train.parquet" in str(e.value) and len(str(e.value).splitlines()) == 1  # the way out
    assert prepare_data.main(["--input", "searchr1_train:hotpotqa", "--protocol", "searchr1", "--no_chat_template",
                              "--out", "/nonexistent/never.jsonl"]) == 2


def test_engine_special_tokens_are_recorded_and_need_a_tokenizer(tmp_path, capsys):
    from openrlhf_search.cli import prepare_data

    src = shared_path("qa", "r1searcher", "bamboogle.jsonl")
    out = tmp_path / "p.jsonl"
    # the offline Qwen tokenizer adds no special tokens: recorded, prompt unchanged
    assert prepare_data.main(["--input", src, "--limit", "2", "--protocol", "r1searcher", "--tokenizer",
                              _qwen_tokenizer_path(), "--out", str(out)]) == 0
    row = _rows(out)[0]
    assert row["rendering"]["engine_special_tokens"] is True
    assert row["prompt"] == get_protocol("r1searcher").build_prompt(row["question"])
    assert prepare_data.main(["--input", src, "--protocol", "r1searcher", "--engine_special_tokens",
                              "--out", str(out)]) == 2
    assert "needs the policy's --tokenizer" in capsys.readouterr().err


# ------------------------------------------------------------------------- one prompt file per chat template
def _hub_cache_tokenizer(cache, name, template=None):
    """``name`` as the Hugging Face cache holds a downloaded repository (``models--org--name/snapshots/REV``, the
    ``refs/main`` pointer): the offline Qwen tokenizer's files and a ``config.json``, its chat template replaced by
    ``template`` if given. The hub client's own layout, so hub names resolve offline without the network."""
    import os
    import shutil

    repo = cache / ("models--" + name.replace("/", "--"))
    snapshot = repo / "snapshots" / "0123456789abcdef0123456789abcdef01234567"
    shutil.copytree(_qwen_tokenizer_path(), snapshot)
    (snapshot / "config.json").write_text(json.dumps({"model_type": "qwen2"}))  # AutoTokenizer reads it from a hub
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text(snapshot.name)
    if template is not None:
        cfg_path = os.path.join(snapshot, "tokenizer_config.json")
        cfg = json.load(open(cfg_path))
        cfg["chat_template"] = template
        json.dump(cfg, open(cfg_path, "w"))


@pytest.mark.parametrize("protocol, rendered_with, policy", [
    ("chat_tools", "Qwen/Qwen3-8B", "Qwen/Qwen3-4B"), ("searchr1", "Qwen/Qwen2.5-7B", "Qwen/Qwen2.5-3B")])
def test_a_prompt_file_serves_every_size_whose_chat_template_is_the_same(tmp_path, monkeypatch, protocol,
                                                                         rendered_with, policy):
    """Two sizes of one family with byte-identical templates (their tokenizers differ only in name) share a prompt
    file, matched by the recorded template hash, whichever size rendered it; a policy whose template differs is
    refused in one line that says so. Mutation caught: comparing the tokenizers' hub names (the file of the other
    size refused), or not comparing templates at all (the changed template accepted)."""
    from huggingface_hub import constants

    from openrlhf_search.cli import prepare_data
    from openrlhf_search.cli.prepare_data import RenderingError, check_prompt_file

    cache = tmp_path / "hub"
    _hub_cache_tokenizer(cache, rendered_with)
    _hub_cache_tokenizer(cache, policy)
    qwen_template = json.load(open(f"{_qwen_tokenizer_path()}/tokenizer_config.json"))["chat_template"]
    assert "<|im_start|>system" in qwen_template  # the same tokenizer, one space of its template changed:
    _hub_cache_tokenizer(cache, "example/other-template",
                         qwen_template.replace("<|im_start|>system", "<|im_start|>system ", 1))
    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(cache))  # read at call time by huggingface_hub/transformers

    out = tmp_path / "prompts.jsonl"
    assert prepare_data.main(["--input", shared_path("qa", "flashrag", "bamboogle.test.jsonl"), "--limit", "3",
                              "--protocol", protocol, "--tokenizer", rendered_with, "--out", str(out)]) == 0
    record = _rows(out)[0]["rendering"]
    assert record["tokenizer"] == rendered_with and record["chat_template_sha256"]
    assert check_prompt_file(str(out), protocol, None, policy) == record
    assert check_prompt_file(str(out), protocol, None, rendered_with) == record
    with pytest.raises(RenderingError) as refused:
        check_prompt_file(str(out), protocol, None, "example/other-template")
    line = str(refused.value)
    assert "\n" not in line and f"chat template of {rendered_with!r}" in line and "has another template" in line
    assert "--tokenizer example/other-template" in line  # a second file, not the one the other launchers read:
    assert f"--out {tmp_path / 'prompts.other-template.jsonl'}" in line and f"--out {out} " not in line
    # a policy whose tokenizer is nowhere to be read: the templates cannot be compared, refused in one line
    with pytest.raises(RenderingError, match="cannot be loaded to compare the templates"):
        check_prompt_file(str(out), protocol, None, "example/not-downloaded")
