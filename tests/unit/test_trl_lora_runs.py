"""The TRL integration's LoRA runs (client/fastexp/integrations/trl/lora_runs.py) on a tiny Llama built in memory:
a peft ``LoraConfig`` read as the run it trains (or refused, naming what a run cannot express), the adapter's
tensors exactly as the service's own check (services/common/lora.py) wants them, and ``FastexpRollout(run_id=...)``
refusing a model without a LoRA adapter before it sends anything. The end-to-end path (two trainers, two runs, one
deployment) is tests/e2e/test_lora_runs_example.py."""

from __future__ import annotations

import re
from types import SimpleNamespace

import pytest
import torch

from fastexp.integrations.trl import FastexpRollout, adapter_tensors, lora_config, run_spec
from fastexp.runs import LoraSpec
from services.common.lora import AdapterConfig, check_adapter, expected_tensors, linear_modules
from services.common.weights import TensorSpec

peft = pytest.importorskip("peft")


def _tiny_llama():
    """A 2-layer Llama (hidden 16, q 16 -> 16, k and v 16 -> 8), random weights."""
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    return LlamaForCausalLM(LlamaConfig(vocab_size=64, hidden_size=16, intermediate_size=32, num_hidden_layers=2,
                                        num_attention_heads=2, num_key_value_heads=1, head_dim=8))


def test_a_lora_config_is_read_as_the_run_it_trains():
    spec = run_spec(peft.LoraConfig(r=8, lora_alpha=16, target_modules=["v_proj", "q_proj"]))
    assert spec == LoraSpec(rank=8, alpha=16.0, target_modules=("q_proj", "v_proj"))  # peft's set, sorted


@pytest.mark.parametrize(("fields", "named"), [
    ({"target_modules": "all-linear"}, "target_modules: "),
    ({"target_modules": r".*\.(q|v)_proj"}, "target_modules: "),  # a regex: not module names
    ({"use_rslora": True}, "use_rslora=True"),
    ({"use_dora": True}, "use_dora=True"),
    ({"bias": "lora_only"}, "bias='lora_only'"),
    ({"modules_to_save": ["lm_head"]}, "modules_to_save="),
    ({"layers_to_transform": [0]}, "layers_to_transform=[0]"),
    ({"rank_pattern": {"q_proj": 4}}, "rank_pattern="),
])
def test_a_lora_config_a_run_cannot_express_is_refused_naming_the_field(fields, named):
    with pytest.raises(ValueError, match=re.escape(named)):
        run_spec(peft.LoraConfig(**{"r": 4, "target_modules": ["q_proj"], **fields}))


def test_the_adapter_is_sent_as_the_service_checks_it():
    base = _tiny_llama()
    modules = linear_modules({name: TensorSpec(tuple(t.shape), "float32") for name, t in base.state_dict().items()})
    policy = peft.get_peft_model(base, peft.LoraConfig(r=4, lora_alpha=8, target_modules=["v_proj", "q_proj"]))
    spec = run_spec(lora_config(policy))
    config = AdapterConfig(spec.rank, spec.alpha, spec.target_modules)
    tensors = dict(adapter_tensors(policy))
    # 2 layers x (q, v) x (A, B), peft's names: base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight (4, 16)
    assert {name: tuple(t.shape) for name, t in tensors.items()} == expected_tensors(config, modules)
    assert len(tensors) == 8
    assert check_adapter("alice-lora", config, tensors, modules, max_rank=16) == {
        f"model.layers.{i}.self_attn.{p}": shape for i in range(2) for p, shape in (("q_proj", (16, 16)),
                                                                                    ("v_proj", (8, 16)))}


def test_a_run_id_needs_a_peft_lora_model():
    # TRL's trainer as the rollout sees it: its step, its accelerator (one process) and its model, here not peft's
    accelerator = SimpleNamespace(is_main_process=True, unwrap_model=lambda model: model, wait_for_everyone=lambda: None)
    trainer = SimpleNamespace(state=SimpleNamespace(global_step=0), accelerator=accelerator, model=_tiny_llama())
    with FastexpRollout("127.0.0.1:9", run_id="alice-lora") as rollout:  # nothing listens there: no call is made
        with pytest.raises(ValueError, match="run_id needs a peft LoRA model"):
            rollout(["What is 2 + 3?"] * 2, trainer)
    assert rollout.calls == []
    with pytest.raises(ValueError, match="run_id needs a peft LoRA model"):
        list(adapter_tensors(_tiny_llama()))
