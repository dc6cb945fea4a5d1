"""Numeric checks of the GPU path on one GPU, without Ray: the numerics phase of ``benchmarks/gpu_smoke.sh``.

1. **packed vs padded log-probs**: OpenRLHF's ``Actor`` on the policy with flash-attn, once with
   ``packing_samples`` (``--ds.packing_samples``: ``unpad_and_slice_tensor`` and varlen attention) and once on the
   padded batch; the largest |difference| of the per-token log-probs must stay under ``--max_packed_diff``.
2. **vLLM vs trainer log-probs**: vLLM samples continuations with their log-probs; the trainer's log-probs of the same
   tokens (padded ``Actor``) are compared; the mean and largest gap are printed (what an off-policy correction sees).
3. **weight sync**: every trainer tensor, perturbed, goes to the engine the way a colocated run's
   ``broadcast_to_vllm`` sends it (``torch.multiprocessing.reductions.reduce_tensor`` -> OpenRLHF's
   ``WorkerWrap.update_weight_cuda_ipc`` in the vLLM worker); sampled tensors read back from the engine
   (``LLM.apply_model``) must equal the trainer's under vLLM's fused names (``probe.vllm_view``).

Prints one ``name: value`` line per figure and exits 1 when a check fails. ``--dry_run`` only imports what the checks
call (CPU: catches an import that moved) and prints the plan.

    python benchmarks/gpu_numerics.py --model PATH [--samples 8] [--max_packed_diff 0.05]
"""

import argparse
import os
import random
import sys
from typing import Dict, List, Sequence

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if ROOT not in sys.path:
    sys.path.insert(0, ROOT)


def imports():
    """The functions the checks call, imported (an import that moved between versions fails here, on CPU too)."""
    import openrlhf_search._cpu_compat  # noqa: F401  (a no-op on a GPU; lets the dry run import OpenRLHF on CPU)
    from openrlhf.models import Actor
    from openrlhf.trainer.ray.utils import get_physical_gpu_id
    from openrlhf.trainer.ray.vllm_worker_wrap import WorkerWrap
    from torch.multiprocessing.reductions import reduce_tensor

    from cpu_demo.probe import compare_weights, vllm_view

    return dict(Actor=Actor, get_physical_gpu_id=get_physical_gpu_id, WorkerWrap=WorkerWrap,
                reduce_tensor=reduce_tensor, compare_weights=compare_weights, vllm_view=vllm_view)


def sample_names(names: Sequence[str], k: int, seed: int = 0) -> List[str]:
    """``k`` parameter names, always including the embedding and the first fused projection, the rest at random."""
    names = sorted(names)
    must = [n for n in names if "embed_tokens" in n][:1] + [n for n in names if "qkv_proj" in n][:1]
    rest = [n for n in names if n not in must]
    random.Random(seed).shuffle(rest)
    return (must + rest)[:max(k, len(must))]


def _batch(vocab: int, lengths: Sequence[int], device, seed: int = 0):
    import torch

    g = torch.Generator().manual_seed(seed)
    width = max(lengths)
    seqs = torch.zeros(len(lengths), width, dtype=torch.long)
    mask = torch.zeros(len(lengths), width, dtype=torch.long)
    for i, n in enumerate(lengths):  # right padded, as OpenRLHF's concat_experiences pads
        seqs[i, :n] = torch.randint(10, vocab, (n,), generator=g)
        mask[i, :n] = 1
    return seqs.to(device), mask.to(device)


def packed_vs_padded(model: str, vocab: int) -> float:
    """Largest |packed - padded| action log-prob of OpenRLHF's Actor over a right-padded batch of 4."""
    import torch

    Actor = imports()["Actor"]
    seqs, mask = _batch(vocab, [37, 64, 12, 50], "cuda")
    action_mask = mask[:, 1:].bool()
    out = {}
    for packed in (False, True):
        actor = Actor(model, attn_implementation="flash_attention_2", param_dtype="bf16",
                      packing_samples=packed).cuda().eval()
        with torch.no_grad():
            out[packed] = actor(seqs, action_mask=action_mask, attention_mask=mask).float()
        del actor
        torch.cuda.empty_cache()
    return float(((out[True] - out[False]).abs() * action_mask).max())


def vllm_gap(llm, model: str, vocab: int, n: int = 4, tokens: int = 32) -> Dict[str, float]:
    """Mean and largest |vLLM - trainer| log-prob of the tokens vLLM sampled (temperature 1)."""
    import torch
    from vllm import SamplingParams, TokensPrompt

    Actor = imports()["Actor"]
    prompts, _ = _batch(vocab, [16] * n, "cpu", seed=1)
    params = SamplingParams(max_tokens=tokens, temperature=1.0, logprobs=0, seed=0)
    outs = llm.generate([TokensPrompt(prompt_token_ids=p.tolist()) for p in prompts], params)
    actor = Actor(model, attn_implementation="flash_attention_2", param_dtype="bf16").cuda().eval()
    gaps = []
    for p, o in zip(prompts, outs):
        gen = list(o.outputs[0].token_ids)
        engine_lp = [o.outputs[0].logprobs[i][t].logprob for i, t in enumerate(gen)]
        seq = torch.tensor([p.tolist() + gen], device="cuda")
        action_mask = torch.ones(1, len(gen), dtype=torch.bool, device="cuda")
        with torch.no_grad():
            lp = actor(seq, action_mask=action_mask, attention_mask=torch.ones_like(seq))[0].float().cpu()
        gaps += [abs(a - b) for a, b in zip(engine_lp, lp.tolist())]
    del actor
    torch.cuda.empty_cache()
    return {"mean": sum(gaps) / len(gaps), "max": max(gaps), "tokens": float(len(gaps))}


def weight_sync(llm, model: str, samples: int) -> Dict[str, float]:
    """Send every perturbed trainer tensor over CUDA IPC into the engine; compare ``samples`` read back."""
    import torch
    from transformers import AutoModelForCausalLM

    fns = imports()
    hf = AutoModelForCausalLM.from_pretrained(model, torch_dtype=torch.bfloat16).cuda()
    g = torch.Generator(device="cuda").manual_seed(0)
    sent = {}
    for name, p in hf.named_parameters():
        weight = (p.data + 0.01 * torch.randn(p.shape, generator=g, device="cuda", dtype=p.dtype)).contiguous()
        handles = {fns["get_physical_gpu_id"](): fns["reduce_tensor"](weight)}
        llm.collective_rpc("update_weight_cuda_ipc", args=(name, weight.dtype, weight.shape, handles, False))
        sent[name] = weight.cpu()
        del weight
    view = fns["vllm_view"](sent)
    names = sample_names(view, samples)

    def read(model_module, wanted=tuple(names)):
        params = dict(model_module.named_parameters())
        return {n: params[n].detach().cpu() for n in wanted if n in params}

    engine = llm.apply_model(read)[0]
    cmp = fns["compare_weights"](sent, engine)
    compared = [n for n in names if n in engine]
    worst = max((cmp["per_param"].get(n, float("inf")) for n in compared), default=float("inf"))
    return {"compared": float(len(compared)), "max_abs_diff": worst}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", required=True, help="HF folder of the policy (the smoke's tiny policy)")
    p.add_argument("--samples", type=int, default=8, help="engine tensors compared after the sync")
    p.add_argument("--max_packed_diff", type=float, default=0.05, help="largest packed-vs-padded log-prob gap")
    p.add_argument("--gpu_memory_utilization", type=float, default=0.3)
    p.add_argument("--dry_run", action="store_true", help="import what the checks call and print the plan")
    a = p.parse_args(argv)
    imports()
    if a.dry_run:
        print(f"plan: packed vs padded log-probs (<= {a.max_packed_diff}), vLLM vs trainer gap (printed), weight "
              f"sync over CUDA IPC ({a.samples} sampled tensors equal) on {a.model}")
        return 0
    os.environ.setdefault("VLLM_ALLOW_INSECURE_SERIALIZATION", "1")  # dtype, IPC handles and apply_model's callable
    from transformers import AutoConfig
    from vllm import LLM

    vocab = AutoConfig.from_pretrained(a.model).vocab_size
    failed = []
    diff = packed_vs_padded(a.model, vocab)
    print(f"packed_vs_padded_max_abs: {diff:.4g}")
    if not diff <= a.max_packed_diff:
        failed.append(f"packed vs padded log-probs differ by {diff:.4g} > {a.max_packed_diff}")
    llm = LLM(model=a.model, dtype="bfloat16", enforce_eager=True, gpu_memory_utilization=a.gpu_memory_utilization,
              max_model_len=1024, worker_extension_cls="openrlhf.trainer.ray.vllm_worker_wrap.WorkerWrap", seed=0)
    gap = vllm_gap(llm, a.model, vocab)
    print(f"vllm_vs_trainer_logprob_gap: mean {gap['mean']:.4g}, max {gap['max']:.4g} over {gap['tokens']:.0f} tokens")
    if gap["mean"] != gap["mean"]:
        failed.append("vLLM vs trainer log-prob gap is NaN")
    sync = weight_sync(llm, a.model, a.samples)
    print(f"weight_sync: {sync['compared']:.0f} sampled engine tensors, max |engine - trainer| "
          f"{sync['max_abs_diff']:.4g}")
    if sync["compared"] < min(a.samples, 2) or sync["max_abs_diff"] != 0.0:
        failed.append(f"engine weights differ from the trainer's after the sync ({sync})")
    for line in failed:
        print(f"FAILED: {line}", file=sys.stderr)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
