"""``--train.device cuda`` computes what the CPU computes (GPU only; skipped on a machine without CUDA).

``benchmarks/gpu_smoke.sh`` (and ``benchmarks/lent_gpu_machine/gpu_smoke_lent.sh``) run this file before the timed job.
The same tiny policy, the same trajectories and settings go through the warm start, experience (log-probs, reference,
KL, critic values, advantages) and two optimiser epochs once on the CPU and once on the GPU: every tensor must be on the
GPU there, and the numbers must agree to float rounding. Greedy decoding by the engine must give the same tokens on
both.
``OPENRLHF_SEARCH_TEST_DEVICE=cpu`` runs the file CPU against CPU, to check the test itself on a machine without a GPU.
"""

import asyncio
import copy
import os

import pytest
import torch

from openrlhf_search.cpu.main_job.experience import Trajectory
from openrlhf_search.cpu.main_job.freeze import freeze_lower_layers
from openrlhf_search.cpu.main_job.offline_assets import build_tiny_qwen2
from openrlhf_search.cpu.main_job.rl_step import RLSettings, RLUpdater
from openrlhf_search.cpu.main_job.warmstart import sft_warmstart

DEVICE = os.environ.get("OPENRLHF_SEARCH_TEST_DEVICE", "cuda")
pytestmark = pytest.mark.skipif(DEVICE == "cuda" and not torch.cuda.is_available(), reason="needs a CUDA device")


def _trajs():
    # two prompt groups of two samples, right-padded lengths, an environment block between the model's two turns
    return [Trajectory(tokens=list(range(100, 100 + n)), action_ranges=[(5, 9), (12, n)], reward=r, group=i // 2)
            for i, (n, r) in enumerate(((20, 1.0), (16, 0.0), (18, 0.5), (14, 0.0)))]


def _pair(tok):
    model = build_tiny_qwen2(tok, hidden_size=32, num_layers=2, num_heads=2, seed=3)
    freeze_lower_layers(model, 1)  # the frozen-trunk cache path
    gpu = copy.deepcopy(model).to(DEVICE)
    return model, gpu


def _tensors(obj, prefix=""):
    if isinstance(obj, torch.Tensor):
        yield prefix, obj
    elif isinstance(obj, dict):
        for k, v in obj.items():
            yield from _tensors(v, f"{prefix}.{k}")
    elif hasattr(obj, "__dataclass_fields__"):
        for k in obj.__dataclass_fields__:
            yield from _tensors(getattr(obj, k), f"{prefix}.{k}")


@pytest.mark.parametrize("estimator", ["gae", "group_norm"])
def test_experience_and_update_match_the_cpu(qwen_tokenizer, estimator):
    torch.backends.cuda.matmul.allow_tf32 = False  # float32 on both sides
    torch.backends.cudnn.allow_tf32 = False
    cpu, gpu = _pair(qwen_tokenizer)
    s = RLSettings(estimator=estimator, n_samples_per_prompt=2, gamma=0.9, lambd=0.95, max_epochs=2,
                   micro_batch_size=3, kl_use_loss=estimator == "group_norm")
    rewards = torch.tensor([t.reward for t in _trajs()])
    valid = torch.ones(4, dtype=torch.bool)
    out = []
    for name, model in (("cpu", cpu), (DEVICE, gpu)):
        upd = RLUpdater(model, s, pad_id=0)
        assert all(p.device.type == name for p in upd.ref.parameters())
        if upd.critic is not None:
            assert all(p.device.type == name for p in upd.critic.parameters())
        exp = upd.make_experience(_trajs(), upd.shape_rewards(rewards, valid))
        for key, t in _tensors(exp):
            assert t.device.type == name, (name, key, t.device)
        stats = upd.update(exp)
        out.append((exp, stats, [p.detach().cpu() for p in model.parameters()]))
    (e_cpu, s_cpu, p_cpu), (e_gpu, s_gpu, p_gpu) = out
    for key in ("old_logp", "ref_logp", "kl", "advantages", "returns") + (("values",) if estimator == "gae" else ()):
        assert torch.allclose(e_cpu[key], e_gpu[key].cpu(), atol=1e-4, rtol=1e-4), key
    assert s_cpu["grad_norm"] > 0 and s_cpu["nan_skipped"] == 0  # a real update, not two no-ops
    for key in ("policy_loss", "grad_norm", "entropy", "value_loss", "kl_loss"):
        assert s_gpu[key] == pytest.approx(s_cpu[key], rel=1e-3, abs=1e-5), key
    for a, b in zip(p_cpu, p_gpu):
        assert torch.allclose(a, b, atol=1e-5)


def test_warm_start_matches_the_cpu(qwen_tokenizer):
    torch.backends.cuda.matmul.allow_tf32 = False
    cpu, gpu = _pair(qwen_tokenizer)
    trajs = _trajs()
    l_cpu = sft_warmstart(cpu, trajs, 0, steps=3, lr=1e-3, batch_size=2, seed=0, progress=False)
    l_gpu = sft_warmstart(gpu, trajs, 0, steps=3, lr=1e-3, batch_size=2, seed=0, progress=False)
    assert l_gpu == pytest.approx(l_cpu, rel=1e-4)


def test_engine_greedy_tokens_match_the_cpu(qwen_tokenizer):
    from vllm import SamplingParams

    from openrlhf_search.cpu.main_job.engine import HFEngine

    cpu, gpu = _pair(qwen_tokenizer)
    ids = qwen_tokenizer("Question: what is the capital of France?\nAnswer:", add_special_tokens=False).input_ids
    params = SamplingParams(temperature=0.0, max_tokens=12, logprobs=0)

    async def both(model):
        engine = HFEngine(model, qwen_tokenizer, seed=0, max_batch_size=4)
        outs = await asyncio.gather(*[engine.generate(ids[: len(ids) - k], params) for k in range(3)])
        return [o.outputs[0] for o in outs]

    for a, b in zip(asyncio.run(both(cpu)), asyncio.run(both(gpu))):
        assert list(a.token_ids) == list(b.token_ids)
        assert [next(iter(x.values())).logprob for x in a.logprobs] == pytest.approx(
            [next(iter(x.values())).logprob for x in b.logprobs], abs=1e-4)
