"""Short rollout batches are cut to whole micro-batches on every data-parallel rank
(openrlhf_search/rl/even_batches.py),
through OpenRLHF 0.11.2's own ``SamplesGenerator.generate_samples`` and ``RayActorGroup.async_run_method_batch``
chunking rule, with a prompt loader of 2 x batch + a remainder."""

import math

import pytest
import torch

import openrlhf_search._cpu_compat  # noqa: F401
from openrlhf.trainer.ppo_utils.experience import Experience
from openrlhf.trainer.ppo_utils.samples_generator import SamplesGenerator

from openrlhf_search.rl.even_batches import data_parallel_ranks, even_share, even_unit, tail_prompts_dropped
from tests.test_cluster_wiring import _parse
from tests.test_rl_core import _generator


def _chunks(n_items: int, ranks: int):
    """Items per rank as ``async_run_method_batch`` deals them (launcher.py:346-356: ceil chunks)."""
    size = math.ceil(n_items / ranks)
    return [max(0, min((r + 1) * size, n_items) - r * size) for r in range(ranks)]


def _sample(prompt: int, k: int) -> Experience:
    e = Experience(sequences=torch.tensor([[prompt, k]]), attention_mask=torch.ones(1, 2, dtype=torch.long),
                   action_mask=torch.ones(1, 1, dtype=torch.bool))
    e.prompts = [f"p{prompt}"]
    return e


def _run_epoch(monkeypatch, args, rows: int):
    """Every batch ``generate_samples`` returns over a loader of ``rows`` prompts (n samples each)."""
    n, bs = args.rollout.n_samples_per_prompt, args.rollout.batch_size
    loader = [list(range(i, min(i + bs, rows))) for i in range(0, rows, bs)]

    def fake_generate(self, dataloader_iter, num_prompts, dynamic_filtering, **kw):
        try:
            prompts = next(dataloader_iter)
        except StopIteration:
            return [], 0, True
        return [_sample(p, k) for p in prompts for k in range(n)], len(prompts), False

    monkeypatch.setattr(SamplesGenerator, "_generate_vllm", fake_generate)
    gen = _generator(args)
    gen.prompts_dataloader = loader
    gen._rollout_timer = None
    batches = []
    while True:
        samples, _, _, exhausted = gen.generate_samples(n_samples_per_prompt=n)
        if samples:
            batches.append(samples)
        if exhausted:
            return gen, batches


@pytest.mark.parametrize("ranks, n, micro, train_bs, tail", [(2, 4, 2, 8, 3), (8, 5, 1, 40, 3), (8, 1, 1, 8, 3),
                                                               (2, 2, 2, 8, 5), (2, 5, 2, 20, 6)])
def test_every_batch_fills_whole_micro_batches_and_train_batches(monkeypatch, ranks, n, micro, train_bs, tail):
    """A loader of 2 full batches (8 prompts) + a tail that does not divide over the ranks. Mutation caught: the tail
    passed through (a rank would get fewer or no micro-batches, or an update with no optimiser step), or prompt
    groups split."""
    args, _ = _parse("--algo.advantage.estimator", "group_norm" if n > 1 else "reinforce",
                     "--rollout.n_samples_per_prompt", str(n),
                     "--rollout.batch_size", "8", "--rollout.micro_batch_size", str(micro),
                     "--actor.num_gpus_per_node", str(ranks), "--ref.num_gpus_per_node", str(ranks),
                     "--train.batch_size", str(train_bs), "--train.micro_batch_size", "1")
    gen, batches = _run_epoch(monkeypatch, args, rows=2 * 8 + tail)
    unit = even_unit(micro, [ranks], n, train_bs)
    assert [len(b) for b in batches[:2]] == [8 * n, 8 * n]  # full batches are never cut
    for b in batches:
        micro_batches = math.ceil(len(b) / micro)
        assert len(b) % micro == 0 and len(set(_chunks(micro_batches, ranks))) == 1, (len(b), ranks)
        assert len(b) % train_bs == 0  # whole optimiser steps on every rank
        groups = [int(e.sequences[0, 0]) for e in b]
        assert all(groups.count(p) == n for p in set(groups))  # whole prompt groups only
    dropped = getattr(gen, "dropped_samples", 0)
    assert sum(len(b) for b in batches) + dropped == (2 * 8 + tail) * n
    assert dropped == (tail * n) % unit and dropped > 0


def test_the_old_dealing_leaves_ranks_idle():
    """The failure the cut prevents (Search-R1, 169,615 rows, 512 prompts, 8 ranks): PPO's tail of 143 samples in
    micro-batches of 8 are dealt 3,3,3,3,3,3,0,0; GRPO's 715 samples (n = 5) in micro-batches of 8 give 90
    micro-batches dealt 12 x 7 + 6."""
    assert 169_615 % 512 == 143
    assert _chunks(math.ceil(143 / 8), 8) == [3, 3, 3, 3, 3, 3, 0, 0]
    assert _chunks(math.ceil(715 / 8), 8) == [12] * 7 + [6]
    # with the cut: the whole tail of 143 prompts is dropped, both ways, since it holds no whole train batch of 256
    # (DeepSpeed would step the optimiser only after 256 / (2 x 8) = 16 micro-steps per rank)
    assert even_share(list(range(143)), even_unit(8, [8], 1, 256))[1] == 143
    assert even_share(list(range(715)), even_unit(8, [8], 5, 256))[1] == 715
    assert tail_prompts_dropped(169_615, 512, 1, even_unit(8, [8], 1, 256)) == 143
    assert tail_prompts_dropped(169_615, 512, 5, even_unit(8, [8], 5, 256)) == 143
    # R1-Searcher (64 prompts x 16 samples, micro-batches of 1, train batch 256): tails are cut to 16-prompt units
    assert even_unit(1, [8], 16, 256) == 256 and tail_prompts_dropped(64 * 10 + 37, 64, 16, 256) == 37 % 16


def test_ranks_come_from_the_layout():
    args, _ = _parse("--actor.num_gpus_per_node", "4", "--actor.num_nodes", "2", "--ref.num_gpus_per_node", "4",
                     "--ref.num_nodes", "2", "--critic.num_gpus_per_node", "2", "--critic.num_nodes", "2",
                     "--rollout.micro_batch_size", "2")
    assert data_parallel_ranks(args) == ([8, 8, 4] if args.critic.model_name_or_path else [8, 8])
    assert even_unit(2, [8, 8], 5) == 80 and even_unit(2, [8, 4], 1) == 16 and even_unit(2, [8], 5, 128) == 640
