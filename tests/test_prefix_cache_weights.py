"""After every weight change the CPU engine must not reuse key/value states of the old weights.

For every optimiser the project builds (the RL actor's AdamW with and without the fused kernel, the critic's beside
it under ``gae``, the warm start's), through the trainer's own code path: generate (the prefix cache now holds the
prompt's states), change the weights the way the job does (a warm start, an RL step), generate a continuation of
the cached prompt again. It must equal what a fresh engine without a prefix cache gives for the same weights.

Mutation caught: the trainer not telling the engine that its weights changed (``weights_changed`` /
``reset_prefix_cache`` removed after the update or the warm start). The fused AdamW writes the weights without
bumping their version counters, so the engine's own check misses it and the second generation reads stale states
(before the fix: the fused cases failed, the non-fused ones passed).
"""

import asyncio

import pytest
import torch
from vllm import SamplingParams

from openrlhf_search.cpu.data.qa import load_qa_jsonl
from openrlhf_search.cpu.main_job import optim
from openrlhf_search.cpu.main_job.args import parse_args

FAST = ["--actor.model_name_or_path", "tiny", "--search.max_new_tokens_per_turn", "8", "--search.max_turns", "2",
        "--search.topk", "1", "--search.max_obs_tokens", "60", "--data.max_len", "300", "--rollout.batch_size", "1",
        "--rollout.n_samples_per_prompt", "2", "--actor.tiny.hidden_size", "32", "--actor.tiny.num_layers", "1",
        "--actor.tiny.num_heads", "2", "--eval.disable", "--train.max_steps", "1", "--actor.adam.lr", "1e-2",
        "--warmstart.lr", "1e-2", "--warmstart.num_examples", "2", "--warmstart.batch_size", "2"]


class _VariedRewards:
    """Executor stand-in for the RL step: trajectories from the prompt with rewards 0, 1, 0, 1, ... (a random tiny
    policy earns equal rewards, hence zero advantages and no weight change at all)."""

    def __init__(self):
        self.calls = 0

    async def execute(self, prompt, label, sampling_params, max_length, hf_tokenizer, llm_engine, images=None):
        i, self.calls = self.calls, self.calls + 1
        toks = hf_tokenizer(prompt, add_special_tokens=False)["input_ids"][:20] + [100, 200, 300]
        return {"observation_tokens": toks, "action_ranges": [(len(toks) - 3, len(toks))], "reward": float(i % 2),
                "response_text": "x", "extra_logs": {"turns": 1.0, "valid_searches": 0.0, "answer_present": 0.0}}


def _lp(out):
    o = out.outputs[0]
    return list(o.token_ids), [e[t].logprob for t, e in zip(o.token_ids, o.logprobs)]


def _generate(engine, ids):
    return asyncio.run(engine.generate(ids, SamplingParams(temperature=0, max_tokens=6, logprobs=0)))


@pytest.mark.parametrize("path, fused", [("rl_actor", True), ("rl_actor", False), ("rl_actor_and_critic", True),
                                         ("warm_start", True), ("warm_start", False)])
def test_generation_after_a_weight_change_equals_a_fresh_engines(tmp_path, default_bm25_url, default_data,
                                                                 monkeypatch, path, fused):
    from openrlhf_search.cpu.main_job.train import make_warmstart
    from openrlhf_search.cpu.main_job.engine import HFEngine
    from openrlhf_search.cpu.main_job.trainer import LocalSearchTrainer

    monkeypatch.setattr(optim, "FUSED", fused)
    extra = ["--algo.advantage.estimator", "gae" if path == "rl_actor_and_critic" else "reinforce_baseline"]
    extra += ["--warmstart.sft_steps", "2" if path == "warm_start" else "0"]
    args = parse_args(FAST + extra + ["--search.retriever_urls", default_bm25_url,
                                      "--ckpt.output_dir", str(tmp_path / "run"), "--ckpt.no_load"])
    t = LocalSearchTrainer(args, load_qa_jsonl(default_data.train_path, limit=20), [],
                           warmstart_fn=make_warmstart(args))
    try:
        prompt = t.tokenizer(t.prompt_of(t.train_rows[0]), add_special_tokens=False)["input_ids"]
        if path != "warm_start":
            t.setup()
        first = _generate(t.engine, prompt)  # its states are cached now
        assert t.engine._prefix_cache
        weights = [p.detach().clone() for p in t.actor.parameters()]
        if path == "warm_start":
            t.setup()  # the scripted SFT warm start, with its own AdamW
            opts = []
        else:
            t.executor = _VariedRewards()
            t.train_step()  # update (actor AdamW, and the critic's under gae), then the trainer tells the engine
            opts = list(t.updater.optimizers().values())
            assert len(opts) == (2 if path == "rl_actor_and_critic" else 1)
        for opt in opts:  # the test covers the optimiser it names
            assert bool(opt.defaults.get("fused")) == fused
        assert any(not torch.equal(a, b) for a, b in zip(weights, t.actor.parameters())), "no weight changed"
        again = prompt + list(first.outputs[0].token_ids)
        got = _generate(t.engine, again)
        fresh = _generate(HFEngine(t.actor, t.tokenizer, prefix_cache_mb=0), again)
        tokens, lps = _lp(got)
        fresh_tokens, fresh_lps = _lp(fresh)
        assert tokens == fresh_tokens
        assert lps == pytest.approx(fresh_lps, abs=1e-5), "the engine read key/value states of the old weights"
    finally:
        t.close()


def test_make_adamw_builds_the_fused_kernel_that_leaves_version_counters_alone(monkeypatch):
    """Why the trainer cannot rely on the engine's version check: measured on this torch build."""
    p = torch.nn.Parameter(torch.ones(4))
    opt = optim.make_adamw([p], lr=0.1)
    p.grad = torch.ones(4)
    v = p._version
    opt.step()
    assert opt.defaults.get("fused") and p._version == v and not torch.equal(p.data, torch.ones(4))
    monkeypatch.setattr(optim, "FUSED", False)
    opt = optim.make_adamw([p], lr=0.1)
    p.grad = torch.ones(4)
    v = p._version
    opt.step()
    assert not opt.defaults.get("fused") and p._version > v
