"""``cli.sft``: OpenRLHF's SFT trainer on tokenised search trajectories, the documents blocks out of the loss.

Mutations caught: a loss mask shifted by one against OpenRLHF's convention (the trainer reads ``loss_mask[:, :-1]``
against the next token's log-prob), documents tokens in the loss, spans that overlap or leave the sequence accepted,
the dataset class not injected (OpenRLHF's own SFTDataset would fail on these rows), frozen layers that move."""

import json
import os
import subprocess
import sys
from types import SimpleNamespace

import pytest
import torch

from openrlhf_search.rl.sft import TrajectoryFormatError, TrajectorySFTDataset, check_trajectory, loss_mask
from tests.conftest import REPO_ROOT


def test_loss_mask_follows_openrlhfs_convention(smollm2_tokenizer):
    """A trajectory with one action span at the end is OpenRLHF's prompt + response row: the masks must be equal."""
    from openrlhf.datasets import SFTDataset

    prompt, response = "Question: capital of France?\n", " Paris is the capital."
    p_ids = smollm2_tokenizer(prompt, add_special_tokens=False)["input_ids"]
    ids = smollm2_tokenizer(prompt + response, add_special_tokens=False)["input_ids"]
    ours = loss_mask(len(ids), [(len(p_ids), len(ids))])
    theirs = SFTDataset.get_loss_mask(SimpleNamespace(pretrain_mode=False, multiturn=False, prompt_ids_lens=[
        len(p_ids)]), torch.tensor([ids]), 0)
    theirs[0, -1] = 1  # OpenRLHF's rows end with an EOS it appends and trains (-1 excludes it); ours has none
    ours_shifted = ours[0, :-1]  # what SFTTrainer reads
    assert torch.equal(ours[0, :-1], theirs[0, :-1]) and ours_shifted.sum() == len(ids) - len(p_ids)


def test_documents_tokens_are_not_trained():
    ids = list(range(100, 120))
    spans = [(5, 8), (14, 20)]  # a search turn, a documents block [8, 14), the answer turn
    mask = loss_mask(len(ids), spans)[0]
    trained_next = {t + 1 for t in range(len(ids)) if mask[t]}  # mask[t] trains the prediction of token t + 1
    assert trained_next == set(range(5, 8)) | set(range(14, 20))
    for bad in ([], [(0, 3)], [(5, 8), (7, 9)], [(5, 21)], [(6, 6)]):
        with pytest.raises(TrajectoryFormatError):
            check_trajectory(ids, bad)
    assert check_trajectory(ids, [[14, 20], [5, 8]]) == [(5, 8), (14, 20)]


def test_dataset_cuts_long_rows_and_names_bad_ones():
    strategy = SimpleNamespace(args=None)
    rows = [{"input_ids": list(range(30)), "action_ranges": [[5, 10], [20, 30]]},
            {"input_ids": list(range(30)), "action_ranges": [[25, 30]]}]
    ds = TrajectorySFTDataset(rows, SimpleNamespace(pad_token_id=0), 16, strategy)
    assert len(ds) == 1  # the second row has no policy token within 16 tokens
    ids, att, mask = ds[0]
    assert ids.shape == (1, 16) and att.sum() == 16 and mask[0].nonzero().flatten().tolist() == [4, 5, 6, 7, 8]
    with pytest.raises(TrajectoryFormatError, match="row 0: needs 'input_ids'"):
        TrajectorySFTDataset([{"prompt": "x"}], None, 16, strategy)


def test_cli_sft_trains_the_top_layers_on_cpu(tmp_path, smollm2_tokenizer):
    """OpenRLHF's train_sft with the injected dataset and freezing: the loss falls, only the top layer and the final
    norm change, the HF model is written. A bad data file is refused in one line before anything loads."""
    from transformers import LlamaConfig, LlamaForCausalLM

    tok = smollm2_tokenizer
    cfg = LlamaConfig(vocab_size=len(tok), hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                      num_attention_heads=2, num_key_value_heads=2, tie_word_embeddings=True,
                      pad_token_id=tok.pad_token_id, eos_token_id=tok.eos_token_id)
    torch.manual_seed(0)
    model_dir = tmp_path / "model"
    LlamaForCausalLM(cfg).save_pretrained(model_dir)
    tok.save_pretrained(model_dir)
    data = tmp_path / "traj.jsonl"
    with open(data, "w") as f:
        for i in range(8):
            q = tok(f"question {i} <search> q{i} </search>", add_special_tokens=False)["input_ids"]
            d = tok("<information> some passage </information>", add_special_tokens=False)["input_ids"]
            a = tok(f"<answer> A{i % 2} </answer>", add_special_tokens=False)["input_ids"]
            f.write(json.dumps({"input_ids": q + d + a, "action_ranges": [[2, len(q)], [len(q) + len(d),
                                                                                        len(q) + len(d) + len(a)]]})
                    + "\n")
    out = tmp_path / "out"
    argv = [sys.executable, "-m", "openrlhf_search.cli.sft", "--cpu", "--data.dataset", str(data),
            "--model.model_name_or_path", str(model_dir), "--ckpt.output_dir", str(out), "--train.batch_size", "4",
            "--train.micro_batch_size", "2", "--train.max_epochs", "3", "--data.max_len", "64", "--adam.lr", "3e-3",
            "--ds.param_dtype", "fp32", "--model.trainable_layers", "1", "--ds.zero_stage", "2",
            "--lr_scheduler", "constant", "--lr_warmup_ratio", "0"]
    env = {**os.environ, "PYTHONPATH": REPO_ROOT, "OMP_NUM_THREADS": "1"}
    res = subprocess.run(argv, cwd=REPO_ROOT, env=env, capture_output=True, text=True, timeout=600)
    assert res.returncode == 0, res.stderr[-3000:]
    losses = [float(x.split("gpt_loss=")[1].split(",")[0]) for x in res.stderr.replace("\r", "\n").splitlines()
              if "gpt_loss=" in x]
    assert losses and losses[-1] < losses[0]
    from safetensors.torch import load_file

    before, after = load_file(model_dir / "model.safetensors"), load_file(out / "model.safetensors")
    changed = {n for n in before if not torch.equal(before[n], after[n])}
    assert changed and all(n.startswith(("model.layers.1.", "model.norm.")) for n in changed), sorted(changed)
    assert "[freeze] top 1 layers" in res.stderr

    (tmp_path / "bad.jsonl").write_text('{"input_ids": [1, 2, 3], "action_ranges": [[0, 2]]}\n')
    bad = subprocess.run(argv[:5] + [str(tmp_path / "bad.jsonl")] + argv[6:], cwd=REPO_ROOT, env=env,
                         capture_output=True, text=True, timeout=300)
    assert bad.returncode == 2 and "span [0, 2)" in bad.stderr.strip().splitlines()[-1]


def test_tiny_assets_warm_start_failure_names_its_log(tmp_path):
    """The CPU cluster mode's tiny policy is warm started by cli.sft in a subprocess: when that run fails, the error
    names the log holding cli.sft's own message (the mutation: a failed run ignored, or a log nobody can find)."""
    from cpu_demo.tiny_assets import warm_start_sft

    missing = tmp_path / "no_trajectories.jsonl"
    with pytest.raises(RuntimeError, match=r"cli\.sft\) failed \(exit 2\); its log: .*warmstart_sft\.log") as err:
        warm_start_sft(str(tmp_path / "model"), str(missing), str(tmp_path / "out"), str(tmp_path))
    log = str(err.value).split("its log: ")[1]
    assert f"--data.dataset {missing}: no such file" in open(log, encoding="utf-8").read()
