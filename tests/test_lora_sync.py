"""The LoRA weight sync without Ray: OpenRLHF 0.11.2 would send the PEFT model's own parameter names, which vLLM's
``load_weights`` rejects ("There is no module or parameter named 'base_model'"); ``SearchActorPPOTrainer`` sends
every base-model parameter once, merged with the adapters, under the base model's names. Checked against PEFT's own
``merge_and_unload`` on a copy, through the trainer's transport (a recording engine and update group)."""

import copy
from types import SimpleNamespace

import pytest
import torch

import openrlhf_search._cpu_compat  # noqa: F401
from openrlhf_search.rl import trainer as trainer_module


def _lora_model(rank=8):
    from peft import LoraConfig, TaskType, get_peft_model
    from transformers import Qwen2Config, Qwen2ForCausalLM

    torch.manual_seed(0)
    cfg = Qwen2Config(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=False)
    base = Qwen2ForCausalLM(cfg)
    base_names = set(base.state_dict())
    # OpenRLHF's Actor: LoraConfig(task_type=CAUSAL_LM, r, alpha, target_modules="all-linear", bias="none")
    model = get_peft_model(base, LoraConfig(task_type=TaskType.CAUSAL_LM, r=rank, lora_alpha=16,
                                            target_modules="all-linear", bias="none"))
    with torch.no_grad():  # a trained adapter: B is zero at initialisation, so give it values
        for name, p in model.named_parameters():
            if "lora_B" in name:
                p.copy_(torch.randn_like(p) * 0.1)
    return model, base_names


class _Engine:
    def __init__(self, log):
        self.log = log
        self.update_weight = SimpleNamespace(remote=lambda name, dtype, shape, empty_cache: log.append(
            ("meta", name, dtype, tuple(shape), empty_cache)))
        self.reset_prefix_cache = SimpleNamespace(remote=lambda: log.append(("reset",)))


class _Group:
    def __init__(self, log):
        self.log = log

    def broadcast(self, tensor, src=0, stream=None):
        self.log.append(("tensor", tensor.detach().clone()))


def test_lora_sync_sends_merged_weights_under_the_base_models_names(monkeypatch):
    model, base_names = _lora_model()
    expected = copy.deepcopy(model).merge_and_unload().state_dict()
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    log = []
    monkeypatch.setattr(trainer_module.ray, "get", lambda refs: refs)
    t = object.__new__(trainer_module.SearchActorPPOTrainer)
    t.strategy = SimpleNamespace(args=SimpleNamespace(
        ds=SimpleNamespace(lora=SimpleNamespace(rank=8), zero_stage=2),
        vllm=SimpleNamespace(enable_prefix_caching=True, sync_with_ray=False),
        actor=SimpleNamespace(trainable_layers=0)))
    t.actor = SimpleNamespace(model=SimpleNamespace(module=model))
    t.vllm_engines = [_Engine(log)]
    t._model_update_group = _Group(log)
    t.use_cuda_ipc = False
    sent = t.broadcast_to_vllm()

    metas = [e for e in log if e[0] == "meta"]
    tensors = [e[1] for e in log if e[0] == "tensor"]
    names = [m[1] for m in metas]
    assert log[0] == ("reset",)  # the prefix cache is reset, as OpenRLHF's sync does
    assert sent == len(names) == len(tensors) == len(set(names))
    assert set(names) == base_names  # every base parameter, no PEFT name ("base_model", "lora_", "base_layer")
    assert not [n for n in names if "base_model" in n or "lora_" in n or "base_layer" in n]
    assert [m[4] for m in metas] == [False] * (len(metas) - 1) + [True]  # empty_cache on the last, as OpenRLHF
    for (_, name, dtype, shape, _), tensor in zip(metas, tensors):
        assert tuple(tensor.shape) == shape == tuple(expected[name].shape) and tensor.dtype == dtype
        torch.testing.assert_close(tensor, expected[name], rtol=0, atol=1e-6)
    q = "model.layers.0.self_attn.q_proj.weight"
    merged_q = tensors[names.index(q)]
    base_q = before["base_model.model." + q.replace(".weight", ".base_layer.weight")]
    assert (merged_q - base_q).abs().max() > 1e-3  # the adapter's delta is in what the engine gets
    after = {n: p.detach() for n, p in model.named_parameters()}
    assert all(torch.equal(before[n], after[n]) for n in before)  # trained weights stay unmerged


def test_without_lora_the_sync_is_openrlhfs(monkeypatch):
    called = []
    monkeypatch.setattr(trainer_module.empty_mask_safe_actor_trainer(), "broadcast_to_vllm",
                        lambda self: called.append("openrlhf"))
    t = object.__new__(trainer_module.SearchActorPPOTrainer)
    t.strategy = SimpleNamespace(args=SimpleNamespace(ds=SimpleNamespace(lora=SimpleNamespace(rank=0)),
                                                      actor=SimpleNamespace(trainable_layers=0)))
    t.broadcast_to_vllm()
    assert called == ["openrlhf"]


@pytest.mark.parametrize("name,expected", [
    ("base_model.model.model.layers.3.mlp.down_proj.base_layer.weight", "model.layers.3.mlp.down_proj.weight"),
    ("base_model.model.model.embed_tokens.weight", "model.embed_tokens.weight"),
    ("base_model.model.lm_head.weight", "lm_head.weight"),
])
def test_peft_names_map_to_the_base_models(name, expected):
    assert trainer_module._base_name(name) == expected
