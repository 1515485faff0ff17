"""Which LoRA adapters go to vLLM alone, how one version is written, and which versions stay loaded (no vLLM needed)."""

import json

import pytest
import torch
from peft import LoraConfig, PeftModel, get_peft_model
from safetensors.torch import load_file

from lit_cancel.engines.adapters import adapter_refusal, vllm_max_lora_rank, write_adapter
from lit_cancel.hub import load_causal_lm

ALL_LINEAR = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


def adapted(**options):
    return get_peft_model(load_causal_lm("embedded:tiny-adder"), LoraConfig(**{"r": 4, "target_modules": ["q_proj"], **options}))


@pytest.mark.parametrize("options, refusal", [
    ({"target_modules": ALL_LINEAR, "rank_pattern": {"q_proj": 16}}, None),
    ({"use_dora": True}, "vLLM does not load adapters with use_dora=True"),
    ({"modules_to_save": ["lm_head"]}, "vLLM does not load adapters with modules_to_save="),
    ({"bias": "lora_only"}, "vLLM does not load adapters with bias='lora_only'"),
    ({"target_modules": ["q_proj", "embed_tokens"]}, "vLLM does not take an adapter on model.embed_tokens"),
    ({"target_modules": ["lm_head"]}, "vLLM does not take an adapter on lm_head"),
    ({"r": 600}, "vLLM takes adapters of rank 512 at most, these have rank 600"),
])
def test_adapters_vllm_cannot_load_are_named_with_the_feature_that_stops_them(options, refusal):
    reason = adapter_refusal(adapted(**options))
    assert reason == refusal if refusal is None else reason.startswith(refusal)


@pytest.mark.parametrize("rank, pattern, expected", [(1, {}, 1), (2, {}, 8), (16, {}, 16), (17, {}, 32), (8, {"v_proj": 100}, 128)])
def test_vllm_is_started_with_the_smallest_max_lora_rank_it_accepts_that_holds_every_adapter(rank, pattern, expected):
    assert vllm_max_lora_rank(LoraConfig(r=rank, rank_pattern=pattern)) == expected


def test_an_adapter_is_written_as_peft_saves_it_and_loads_back_into_the_same_model(tmp_path):
    model = adapted(target_modules=ALL_LINEAR)
    generator = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for name, parameter in model.named_parameters():
            if "lora_" in name:
                parameter.copy_(torch.randn(parameter.shape, generator=generator))
    size = write_adapter(model, str(tmp_path / "v1"), torch.bfloat16)
    tensors = load_file(tmp_path / "v1" / "adapter_model.safetensors")
    adapters = {name: p for name, p in model.named_parameters() if "lora_" in name}
    assert size == sum(p.numel() * 2 for p in adapters.values())  # bfloat16: 2 bytes each
    assert sorted(tensors) == sorted(name.replace(".default", "") for name in adapters)
    assert all(t.dtype == torch.bfloat16 for t in tensors.values())
    config = json.loads((tmp_path / "v1" / "adapter_config.json").read_text())
    assert config["r"] == 4 and sorted(config["target_modules"]) == sorted(ALL_LINEAR)
    assert not (tmp_path / "v1.partial").exists()
    loaded = PeftModel.from_pretrained(load_causal_lm("embedded:tiny-adder"), tmp_path / "v1")
    for name, parameter in loaded.named_parameters():
        if "lora_" in name:
            assert torch.equal(parameter, adapters[name].to(torch.bfloat16).to(parameter.dtype))
