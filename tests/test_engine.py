"""HFEngine, the CPU twin of vLLM's generate: stop strings, stop tokens, budgets, sampling, log-probs.

A tiny random Qwen2 emits arbitrary tokens, so stop strings are picked from what the model itself produces with a
fixed seed: the same seed with a stop string must give exactly the prefix that ends on the token completing it.
"""

import asyncio
import copy

import pytest
import torch
from vllm import SamplingParams
from vllm.outputs import RequestOutput

from openrlhf_search.cpu.main_job.engine import EngineInputError, HFEngine

PROMPT = "Question: which river flows through the capital of France?\nAnswer:"


@pytest.fixture(scope="module")
def engine(qwen_tokenizer, tiny_policy):
    return HFEngine(tiny_policy, qwen_tokenizer, seed=0)


@pytest.fixture(scope="module")
def prompt_ids(qwen_tokenizer):
    return qwen_tokenizer(PROMPT, add_special_tokens=False).input_ids


def gen(engine, ids, **kw):
    return asyncio.run(engine.generate(ids, SamplingParams(**kw)))


def _pick_mid_token_stop(tokenizer, token_ids, text):
    """A stop string that ends strictly inside a multi-character token and first occurs there.

    Returns (stop, token_index, end_char, start_char)."""
    for m in range(3, len(token_ids) - 2):
        before = tokenizer.decode(token_ids[:m])
        upto = tokenizer.decode(token_ids[: m + 1])
        if not (text.startswith(upto) and upto.startswith(before)) or len(upto) - len(before) < 3:
            continue
        end = len(before) + 1  # one character into token m
        for k in (6, 5, 4):
            stop = text[end - k:end]
            if len(stop) == k and stop.strip() and text.find(stop) + k == end:
                return stop, m, end, end - k
    raise AssertionError("no usable stop string in the reference sample")


def test_returns_real_vllm_objects(engine, prompt_ids):
    out = gen(engine, prompt_ids, temperature=0, max_tokens=5)
    assert isinstance(out, RequestOutput)
    assert out.prompt_token_ids == prompt_ids
    o = out.outputs[0]
    assert len(o.token_ids) == 5 and o.finish_reason == "length" and o.stop_reason is None
    assert o.logprobs is None


@pytest.mark.parametrize("include", [True, False])
def test_stops_exactly_at_stop_string_inside_a_token(engine, qwen_tokenizer, prompt_ids, include):
    ref = gen(engine, prompt_ids, temperature=1.0, seed=11, max_tokens=40).outputs[0]
    assert ref.finish_reason == "length"
    stop, m, end, start = _pick_mid_token_stop(qwen_tokenizer, ref.token_ids, ref.text)

    out = gen(engine, prompt_ids, temperature=1.0, seed=11, max_tokens=40, stop=["<never-emitted>", stop],
              include_stop_str_in_output=include).outputs[0]
    # the token that completes the stop string is the last one sampled: nothing generated past it
    assert list(out.token_ids) == list(ref.token_ids[: m + 1])
    assert out.finish_reason == "stop" and out.stop_reason == stop
    assert out.text == (ref.text[:end] if include else ref.text[:start])
    assert engine.stats["stopped_by_string"] >= 1


def test_max_tokens_and_greedy_determinism(engine, qwen_tokenizer, tiny_policy, prompt_ids):
    a = gen(engine, prompt_ids, temperature=0, max_tokens=12).outputs[0]
    b = gen(engine, prompt_ids, temperature=0, max_tokens=12).outputs[0]
    assert list(a.token_ids) == list(b.token_ids) and len(a.token_ids) == 12
    assert a.finish_reason == "length"
    # the KV-cache loop agrees with HF's own greedy search
    with torch.no_grad():
        hf = tiny_policy.generate(torch.tensor([prompt_ids]), max_new_tokens=12, do_sample=False,
                                  eos_token_id=None, pad_token_id=qwen_tokenizer.pad_token_id)
    assert hf[0, len(prompt_ids):].tolist() == list(a.token_ids)
    assert a.text == qwen_tokenizer.decode(a.token_ids, skip_special_tokens=True)


def test_seeded_sampling_is_reproducible_and_differs_across_seeds(engine, prompt_ids):
    a = gen(engine, prompt_ids, temperature=1.0, seed=5, max_tokens=20).outputs[0].token_ids
    b = gen(engine, prompt_ids, temperature=1.0, seed=5, max_tokens=20).outputs[0].token_ids
    c = gen(engine, prompt_ids, temperature=1.0, seed=6, max_tokens=20).outputs[0].token_ids
    assert list(a) == list(b) and list(a) != list(c)


def test_logprobs_match_full_forward_pass(engine, tiny_policy, prompt_ids):
    out = gen(engine, prompt_ids, temperature=1.0, seed=3, max_tokens=15, logprobs=2).outputs[0]
    toks = list(out.token_ids)
    assert len(out.logprobs) == len(toks)
    with torch.no_grad():
        logits = tiny_policy(torch.tensor([prompt_ids + toks])).logits[0].float()
    ref = torch.log_softmax(logits, dim=-1)[len(prompt_ids) - 1: -1]
    for i, (tok, entry) in enumerate(zip(toks, out.logprobs)):
        assert abs(entry[tok].logprob - ref[i, tok].item()) < 1e-4
        # rank within the same 1e-4 tolerance as the log-prob: the reference is another forward (no KV cache, all
        # positions), so tokens tied to ~1e-6 with the sampled one may order either way
        lp = ref[i, tok]
        assert int((ref[i] > lp + 1e-4).sum()) + 1 <= entry[tok].rank <= int((ref[i] > lp - 1e-4).sum()) + 1
        top2 = torch.topk(ref[i], 2).indices.tolist()
        assert set(top2) <= set(entry)
    assert abs(out.cumulative_logprob - sum(e[t].logprob for t, e in zip(toks, out.logprobs))) < 1e-3


def test_stop_token_ids_and_min_tokens(engine, prompt_ids):
    ref = list(gen(engine, prompt_ids, temperature=0, max_tokens=10).outputs[0].token_ids)
    stop_tok = ref[2]
    first = ref.index(stop_tok)
    out = gen(engine, prompt_ids, temperature=0, max_tokens=10, stop_token_ids=[stop_tok]).outputs[0]
    assert list(out.token_ids) == ref[: first + 1]
    assert out.finish_reason == "stop" and out.stop_reason == stop_tok
    # min_tokens masks the stop token until enough tokens exist
    out = gen(engine, prompt_ids, temperature=0, max_tokens=10, stop_token_ids=[stop_tok], min_tokens=5).outputs[0]
    assert len(out.token_ids) >= 5 and stop_tok not in list(out.token_ids)[:5]


def test_top_k_one_and_tiny_top_p_are_greedy(engine, prompt_ids):
    greedy = list(gen(engine, prompt_ids, temperature=0, max_tokens=8).outputs[0].token_ids)
    assert list(gen(engine, prompt_ids, temperature=1.0, top_k=1, max_tokens=8, seed=1).outputs[0].token_ids) == greedy
    assert list(gen(engine, prompt_ids, temperature=1.0, top_p=1e-6, max_tokens=8, seed=2).outputs[0].token_ids) \
        == greedy


def test_concurrent_requests_equal_sequential_ones(engine, prompt_ids):
    params = [SamplingParams(temperature=1.0, seed=s, max_tokens=10) for s in range(4)]
    seq = [list(gen(engine, prompt_ids, temperature=1.0, seed=s, max_tokens=10).outputs[0].token_ids)
           for s in range(4)]

    async def run():
        return await asyncio.gather(*(engine.generate(prompt_ids, p) for p in params))

    conc = [list(r.outputs[0].token_ids) for r in asyncio.run(run())]
    assert conc == seq
    assert all(p.max_tokens == 10 for p in params)  # caller's params untouched


def test_batched_requests_of_different_lengths_match_one_at_a_time(qwen_tokenizer, tiny_policy):
    """Left-padded batches: same greedy tokens, stop strings per row, log-probs equal to a full forward pass."""
    prompts = [qwen_tokenizer(t, add_special_tokens=False).input_ids for t in
               ["Hi", "Question: which river flows through Paris?", "A much longer prompt " * 8, "Name a city."]]
    single = HFEngine(tiny_policy, qwen_tokenizer, max_batch_size=1)
    batched = HFEngine(tiny_policy, qwen_tokenizer, max_batch_size=8)
    refs = [single_out.outputs[0] for single_out in
            [asyncio.run(single.generate(p, SamplingParams(temperature=0, max_tokens=12 + i, logprobs=1)))
             for i, p in enumerate(prompts)]]
    # a stop string for row 1 picked from its own greedy text: that row stops early, the others go on
    stop = refs[1].text[2:6]
    params = [SamplingParams(temperature=0, max_tokens=12 + i, logprobs=1, stop=[stop] if i == 1 else None)
              for i in range(len(prompts))]

    async def run():
        return await asyncio.gather(*(batched.generate(p, sp) for p, sp in zip(prompts, params)))

    outs = [r.outputs[0] for r in asyncio.run(run())]
    assert batched.stats["max_batch_rows"] == len(prompts) and batched.stats["batches"] == 1
    for i, (ref, out) in enumerate(zip(refs, outs)):
        if i == 1:
            assert out.finish_reason == "stop" and out.stop_reason == stop
            assert list(out.token_ids) == list(ref.token_ids[: len(out.token_ids)]) and len(out.token_ids) < 12
            assert out.text == ref.text[: ref.text.find(stop)]
        else:
            assert list(out.token_ids) == list(ref.token_ids) and out.finish_reason == "length"
        with torch.no_grad():
            logits = tiny_policy(torch.tensor([prompts[i] + list(out.token_ids)])).logits[0].float()
        lp = torch.log_softmax(logits, -1)[len(prompts[i]) - 1: -1]
        for j, (t, entry) in enumerate(zip(out.token_ids, out.logprobs)):
            assert abs(entry[t].logprob - lp[j, t].item()) < 1e-4


def test_shares_the_model_object_weight_updates_are_seen(qwen_tokenizer, prompt_ids):
    from cpu_demo.offline_assets import build_tiny_qwen2

    model = build_tiny_qwen2(qwen_tokenizer, seed=1)
    eng = HFEngine(model, qwen_tokenizer)
    assert eng.model is model
    before = list(gen(eng, prompt_ids, temperature=0, max_tokens=6).outputs[0].token_ids)
    saved = copy.deepcopy(model.model.norm.weight.data)
    with torch.no_grad():  # what an optimizer step does in place
        for p in model.parameters():
            p.add_(torch.randn_like(p) * 0.5)
    after = list(gen(eng, prompt_ids, temperature=0, max_tokens=6).outputs[0].token_ids)
    assert before != after
    assert not torch.equal(saved, model.model.norm.weight.data)


def test_training_mode_is_restored(qwen_tokenizer, prompt_ids):
    from cpu_demo.offline_assets import build_tiny_qwen2

    model = build_tiny_qwen2(qwen_tokenizer, seed=2).train()
    eng = HFEngine(model, qwen_tokenizer)
    gen(eng, prompt_ids, temperature=0, max_tokens=2)
    assert model.training  # restored before the last answer is delivered, not after (no wait for the thread)


def test_bad_requests_raise_clear_errors(engine, prompt_ids):
    with pytest.raises(EngineInputError, match="empty"):
        gen(engine, [], temperature=0, max_tokens=2)
    with pytest.raises(EngineInputError, match="vocabulary"):
        gen(engine, [10 ** 9], temperature=0, max_tokens=2)
    with pytest.raises(EngineInputError, match="multi_modal"):
        asyncio.run(engine.generate(prompt_ids, SamplingParams(max_tokens=2), multi_modal_data={"image": [1]}))
    with pytest.raises(EngineInputError, match="SamplingParams"):
        asyncio.run(engine.generate(prompt_ids, {"max_tokens": 2}))


def test_exponential_race_sampler_follows_the_distribution():
    """vLLM's exponential race (argmax probs / Exp(1)) draws each token with its probability; zero-probability tokens
    never. Mutation caught: a race over the wrong scores (e.g. probs * q) skews the frequencies."""
    from openrlhf_search.cpu.main_job.engine import _sample_from

    probs = torch.zeros(4_000)
    probs[[7, 1000, 3_999]] = torch.tensor([0.5, 0.3, 0.2])
    g = torch.Generator().manual_seed(0)
    draws = [_sample_from(probs, g) for _ in range(20_000)]
    assert set(draws) == {7, 1000, 3_999}  # zero-probability tokens are never drawn
    freq = {t: draws.count(t) / len(draws) for t in (7, 1000, 3_999)}
    assert abs(freq[7] - 0.5) < 0.02 and abs(freq[1000] - 0.3) < 0.02 and abs(freq[3_999] - 0.2) < 0.02


def test_a_seeded_request_samples_the_same_tokens_whatever_shares_its_batch(qwen_tokenizer, tiny_policy, prompt_ids):
    """vLLM gives a request with a seed its own generator (seed + index for its index-th output): its tokens must not
    depend on which requests share its batch or when they arrive (here: four unseeded requests drawing from the
    engine's shared generator, the seeded one joining the running batch at different moments), and ``n=2`` gives
    outputs seeded ``seed`` and ``seed + 1`` (vLLM's child requests). Mutation caught: a seeded row drawing from the
    shared generator (its tokens then depend on the others and on the engine's seed)."""
    others = [qwen_tokenizer(t, add_special_tokens=False).input_ids for t in
              ["Hi", "A much longer prompt about rivers and cities " * 6, "Name a city.", "Why?"]]
    sp = SamplingParams(temperature=1.0, seed=11, max_tokens=24)
    alone = list(gen(HFEngine(tiny_policy, qwen_tokenizer, max_batch_size=1), prompt_ids,
                     temperature=1.0, seed=11, max_tokens=24).outputs[0].token_ids)

    async def crowded(first):
        eng = HFEngine(tiny_policy, qwen_tokenizer, max_batch_size=8, seed=first)
        noise = [SamplingParams(temperature=1.0, max_tokens=10 + 7 * i) for i in range(len(others))]
        calls = [eng.generate(p, q) for p, q in zip(others, noise)]

        async def late():  # joins the running batch after a few tokens
            await asyncio.sleep(0.05 * first)
            return await eng.generate(prompt_ids, sp)

        outs = await asyncio.gather(*calls, late())
        return list(outs[-1].outputs[0].token_ids)

    for first in (0, 1, 3):
        assert asyncio.run(crowded(first)) == alone
    two = gen(HFEngine(tiny_policy, qwen_tokenizer), prompt_ids, temperature=1.0, seed=11, max_tokens=24, n=2)
    assert list(two.outputs[0].token_ids) == alone  # index 0 -> seed 11, index 1 -> seed 12 (vLLM's child seeds)
    assert list(two.outputs[1].token_ids) == list(gen(HFEngine(tiny_policy, qwen_tokenizer), prompt_ids,
                                                      temperature=1.0, seed=12, max_tokens=24).outputs[0].token_ids)


def test_shutdown_joins_the_engine_thread_and_fails_every_waiter(qwen_tokenizer, tiny_policy, prompt_ids):
    """shutdown() mid-generation: the engine thread leaves at the next token and is joined, every request in flight
    gets EngineShutdown (none hangs), later requests too. Mutation caught: a shutdown that does not stop the decode
    loop (the join times out, the thread is still inside a forward pass when the process exits)."""
    import threading
    import time

    from openrlhf_search.cpu.main_job.engine import EngineShutdown

    eng = HFEngine(tiny_policy, qwen_tokenizer, max_batch_size=4)
    results = {}

    def client():
        async def run():
            calls = [eng.generate(prompt_ids, SamplingParams(temperature=0, max_tokens=4000, ignore_eos=True))
                     for _ in range(3)]
            return await asyncio.gather(*calls, return_exceptions=True)

        results["out"] = asyncio.run(run())

    th = threading.Thread(target=client)
    th.start()
    deadline = time.time() + 60
    while eng._worker is None and time.time() < deadline:
        time.sleep(0.01)
    time.sleep(0.3)  # decoding now
    worker = eng._worker
    assert worker is not None and worker.is_alive()
    t0 = time.perf_counter()
    assert eng.shutdown(timeout_s=30)
    assert time.perf_counter() - t0 < 10 and not worker.is_alive()
    th.join(30)
    assert not th.is_alive() and all(isinstance(r, EngineShutdown) for r in results["out"])
    with pytest.raises(EngineShutdown):
        gen(eng, prompt_ids, temperature=0, max_tokens=2)


class _BrokenLM(torch.nn.Module):
    def __init__(self, exc, vocab):
        super().__init__()
        self._p = torch.nn.Parameter(torch.zeros(1))
        self.exc = exc
        self.config = type("C", (), {"vocab_size": vocab, "max_position_embeddings": 4096})()

    def forward(self, *args, **kwargs):
        raise self.exc


@pytest.mark.parametrize("exc, expected", [(ValueError("boom"), ValueError), (StopIteration(), RuntimeError)])
def test_model_errors_reach_every_waiter_and_nothing_hangs(qwen_tokenizer, prompt_ids, exc, expected):
    eng = HFEngine(_BrokenLM(exc, len(qwen_tokenizer)), qwen_tokenizer, max_batch_size=4)

    async def run():
        calls = [eng.generate(prompt_ids, SamplingParams(max_tokens=3)) for _ in range(3)]
        return await asyncio.wait_for(asyncio.gather(*calls, return_exceptions=True), timeout=30)

    results = asyncio.run(run())
    assert all(isinstance(r, expected) for r in results)
    assert eng.get_num_unfinished_requests() == 0


def test_last_position_logits_shortcut_is_exact(tiny_policy, qwen_tokenizer):
    """The engine's prefill shortcut (``logits_to_keep=1``: logits of the last position only) changes no token and
    no log-prob against the full-logits forward."""
    import asyncio

    from vllm import SamplingParams

    from openrlhf_search.cpu.main_job.engine import HFEngine

    ids = qwen_tokenizer("Who was president of the United States in the year that Citibank was founded? " * 8)[
        "input_ids"]
    for sp in (SamplingParams(temperature=0, max_tokens=10, logprobs=1),
               SamplingParams(temperature=1.0, max_tokens=10, seed=3, logprobs=1)):
        full = HFEngine(tiny_policy, qwen_tokenizer)
        full._forward_kwargs = {}
        short = HFEngine(tiny_policy, qwen_tokenizer)
        assert short._forward_kwargs == {"logits_to_keep": 1}
        a = asyncio.run(full.generate(ids, sp)).outputs[0]
        b = asyncio.run(short.generate(ids, sp)).outputs[0]
        assert list(a.token_ids) == list(b.token_ids) and len(a.token_ids) == 10
        for x, y, t in zip(a.logprobs, b.logprobs, a.token_ids):
            assert x[t].logprob == pytest.approx(y[t].logprob, abs=1e-5)


def _logprob_list(out):
    return [entry[t].logprob for t, entry in zip(out.token_ids, out.logprobs)]


def test_prefix_cache_second_turn_equals_uncached_and_skips_the_cached_prefix(qwen_tokenizer, tiny_policy,
                                                                              prompt_ids):
    """A second turn (first turn's prompt + sampled tokens + an observation) prefills only the new tokens and
    gives the same greedy tokens and log-probs as an engine without prefix caching (single rows and batches)."""
    obs = qwen_tokenizer("\n<information> Paris is on the Seine. </information>\n", add_special_tokens=False).input_ids
    other = qwen_tokenizer("Name a river in Europe.", add_special_tokens=False).input_ids
    for batch in (1, 8):
        cached = HFEngine(tiny_policy, qwen_tokenizer, max_batch_size=batch)
        plain = HFEngine(tiny_policy, qwen_tokenizer, max_batch_size=batch, prefix_cache_mb=0)
        sp = SamplingParams(temperature=0, max_tokens=7, logprobs=0)

        async def turns(eng):
            first = await asyncio.gather(eng.generate(prompt_ids, sp), eng.generate(other, sp))
            second_prompts = [p + list(f.outputs[0].token_ids) + obs for p, f in zip((prompt_ids, other), first)]
            return first, await asyncio.gather(*(eng.generate(p, sp) for p in second_prompts))

        (f_c, s_c), (f_p, s_p) = asyncio.run(turns(cached)), asyncio.run(turns(plain))
        for a, b in zip(f_c + s_c, f_p + s_p):
            assert list(a.outputs[0].token_ids) == list(b.outputs[0].token_ids)
            assert _logprob_list(a.outputs[0]) == pytest.approx(_logprob_list(b.outputs[0]), abs=1e-4)
        # turn 2 read the first turn's states: prompt + 6 of its 7 sampled tokens (the last one was never fed)
        first_lens = len(prompt_ids) + len(other)
        assert cached.stats["prefix_cache_hit_tokens"] == len(prompt_ids) + len(other) + 2 * 6
        assert cached.stats["prefill_tokens"] == first_lens + 2 * (1 + len(obs))
        assert plain.stats["prefix_cache_hit_tokens"] == 0
        assert plain.stats["prefill_tokens"] == plain.stats["prompt_tokens"]


def test_prefix_cache_prefills_a_shared_prompt_once(qwen_tokenizer, tiny_policy, prompt_ids):
    """The samples of a group (same prompt, separate requests, seeded) share one prefill and sample what an
    engine serving them one by one without a prefix cache samples."""
    cached = HFEngine(tiny_policy, qwen_tokenizer, max_batch_size=8)
    plain = HFEngine(tiny_policy, qwen_tokenizer, max_batch_size=1, prefix_cache_mb=0)

    async def group(eng):
        return await asyncio.gather(*(eng.generate(prompt_ids, SamplingParams(temperature=1.0, max_tokens=6,
                                                                              seed=s, logprobs=0))
                                      for s in range(4)))

    a, b = asyncio.run(group(cached)), asyncio.run(group(plain))
    for x, y in zip(a, b):
        assert list(x.outputs[0].token_ids) == list(y.outputs[0].token_ids)
        assert _logprob_list(x.outputs[0]) == pytest.approx(_logprob_list(y.outputs[0]), abs=1e-4)
    assert cached.stats["prefill_tokens"] == len(prompt_ids)
    assert plain.stats["prefill_tokens"] == 4 * len(prompt_ids)


def test_prefix_cache_is_dropped_when_weights_change(qwen_tokenizer, prompt_ids):
    """After an optimizer step the cached states are stale: the next turn must equal a fresh engine's."""
    from cpu_demo.offline_assets import build_tiny_qwen2

    model = build_tiny_qwen2(qwen_tokenizer, seed=3)
    eng = HFEngine(model, qwen_tokenizer)
    sp = SamplingParams(temperature=0, max_tokens=5, logprobs=0)
    first = gen(eng, prompt_ids, temperature=0, max_tokens=5).outputs[0]
    opt = torch.optim.AdamW(model.parameters(), lr=0.05)
    model(torch.tensor([prompt_ids])).logits.sum().backward()
    opt.step()  # in place, like the trainer's update
    second = prompt_ids + list(first.token_ids) + prompt_ids[:3]
    got = asyncio.run(eng.generate(second, sp)).outputs[0]
    fresh = asyncio.run(HFEngine(model, qwen_tokenizer, prefix_cache_mb=0).generate(second, sp)).outputs[0]
    assert eng.stats["prefix_cache_hit_tokens"] == 0
    assert list(got.token_ids) == list(fresh.token_ids)
    assert _logprob_list(got) == pytest.approx(_logprob_list(fresh), abs=1e-5)
    # reset_prefix_cache (vLLM's name) empties it too
    asyncio.run(eng.generate(second, sp))
    assert eng._prefix_cache and eng.reset_prefix_cache() and not eng._prefix_cache


def test_continuous_batching_rows_join_and_leave_a_running_batch(qwen_tokenizer):
    """A short request is answered while a long one still decodes; requests sent meanwhile join the running batch
    (one busy period, no second batch). Every row's log-probs equal a full forward pass over its own tokens, the
    short rows sample what they sample alone (the cache, mask and positions are re-batched consistently)."""
    from cpu_demo.offline_assets import build_tiny_qwen2

    model = build_tiny_qwen2(qwen_tokenizer, seed=5, num_layers=3)
    eng = HFEngine(model, qwen_tokenizer, max_batch_size=8)
    alone = HFEngine(model, qwen_tokenizer, max_batch_size=1, prefix_cache_mb=0)
    enc = lambda t: qwen_tokenizer(t, add_special_tokens=False).input_ids
    long_p, short_p = enc("A long story about rivers " * 3), enc("Name a city.")
    late_ps = [enc("Question: which river flows through Paris?"), enc("Hi")]
    greedy = lambda n: SamplingParams(temperature=0, max_tokens=n, logprobs=0, ignore_eos=True)

    async def scenario():
        long = asyncio.ensure_future(eng.generate(long_p, greedy(300)))
        short = await eng.generate(short_p, greedy(3))
        long_running_after_short = not long.done()
        late = await asyncio.gather(*(eng.generate(p, greedy(4 + i)) for i, p in enumerate(late_ps)))
        overlapped = long_running_after_short and not long.done()
        return await long, short, late, overlapped

    long_out, short_out, late_outs, overlapped = asyncio.run(scenario())
    assert overlapped, "the short and late requests were not answered while the long one decoded"
    assert eng.stats["joined_rows"] == 2 and eng.stats["batches"] == 1 and eng.stats["max_batch_rows"] == 3
    outs = [(long_p, long_out), (short_p, short_out)] + list(zip(late_ps, late_outs))
    for i, (p, res) in enumerate(outs):
        out = res.outputs[0]
        assert len(out.token_ids) == [300, 3, 4, 5][i]
        if i:  # short sequences: the same greedy tokens as alone (a 300-token path may flip on rounding)
            ref = asyncio.run(alone.generate(p, greedy(len(out.token_ids)))).outputs[0]
            assert list(out.token_ids) == list(ref.token_ids)
        tokens = p + list(out.token_ids)
        with torch.no_grad():
            lp = torch.log_softmax(model(torch.tensor([tokens])).logits[0].float(), -1)[len(p) - 1: -1]
        assert _logprob_list(out) == pytest.approx([lp[j, t].item() for j, t in enumerate(out.token_ids)], abs=1e-4)
