"""fp32 vs bf16 training of the CPU main job's policy on this CPU: the measurement behind the job's
``--precision auto`` (bf16 where the CPU has AVX512-BF16 or AMX, fp32 elsewhere).

    python benchmarks/bench_precision_cpu.py [--batch 4] [--tokens 256] [--repeats 2] [--threads 2]

One forward and one forward + backward of SmolLM2-135M-Instruct with only its top 4 decoder layers trainable (the
main job's setting), on a batch of the RL update's shape, in float32 and in bfloat16, in this one run. Prints the
CPU's bf16 support (AVX512-BF16 / AMX: without them torch emulates bf16 matmuls), each time (the median of
``--repeats``), the bf16 / fp32 ratios and the peak RSS. Memory: about 3 GiB.
"""

import argparse
import json
import resource
import statistics
import time

import torch


def cpu_flags() -> dict:
    from cpu_demo.run import cpu_flags as flags_of_this_cpu

    flags = flags_of_this_cpu()
    return {f: f in flags for f in ("avx2", "avx512f", "avx512_bf16", "amx_bf16")}


def measure(dtype, batch: int, tokens: int, repeats: int, layers: int = 4) -> dict:
    from transformers import AutoModelForCausalLM

    from cpu_demo.offline_assets import smollm2_checkpoint
    from openrlhf_search.rl.freeze import freeze_lower_layers

    model = AutoModelForCausalLM.from_pretrained(smollm2_checkpoint(), dtype=dtype, attn_implementation="sdpa")
    freeze_lower_layers(model, layers)
    x = torch.randint(0, model.config.vocab_size, (batch, tokens), generator=torch.Generator().manual_seed(0))
    fwd, fwd_bwd = [], []
    for _ in range(repeats):
        t = time.perf_counter()
        with torch.no_grad():
            model(x)
        fwd.append(time.perf_counter() - t)
        t = time.perf_counter()
        model(x).logits.float().log_softmax(-1)[..., 0].mean().backward()
        fwd_bwd.append(time.perf_counter() - t)
        model.zero_grad(set_to_none=True)
    return {"forward_s": statistics.median(fwd), "forward_backward_s": statistics.median(fwd_bwd)}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--batch", type=int, default=4)
    p.add_argument("--tokens", type=int, default=256)
    p.add_argument("--repeats", type=int, default=2)
    p.add_argument("--threads", type=int, default=2)
    a = p.parse_args(argv)
    torch.set_num_threads(a.threads)
    out = {"cpu": cpu_flags(), "batch": a.batch, "tokens": a.tokens, "threads": a.threads}
    for name, dtype in (("fp32", torch.float32), ("bf16", torch.bfloat16)):
        out[name] = measure(dtype, a.batch, a.tokens, a.repeats)
        print(f"{name}: {json.dumps(out[name])}", flush=True)
    out["bf16_over_fp32"] = {k: out["bf16"][k] / out["fp32"][k] for k in out["fp32"]}
    out["peak_rss_gib"] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2 ** 20
    print(json.dumps(out, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
