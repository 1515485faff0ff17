"""``merged_weights``: LoRA adapters merged as peft merges them, and a sharded (FSDP2) model gathered one weight at a time."""

import importlib.util
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from conftest import save_tiny_model
from transformers import Qwen2Config, Qwen2ForCausalLM

from lit_cancel.engines.vllm_common import merged_weights

SCRIPT = Path(__file__).parents[1] / "workers" / "sharded_weights.py"


@pytest.fixture(scope="module")
def sharded_weights():
    spec = importlib.util.spec_from_file_location("lit_cancel_tests_sharded_weights", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.fixture(scope="module")
def model_folder(tmp_path_factory):
    return save_tiny_model(tmp_path_factory.mktemp("tiny"))


def peft_merged(sharded_weights, folder: str) -> dict[str, torch.Tensor]:
    """peft's own merge of the LoRA model the script builds, unsharded; checked to differ from the base weights."""
    model = sharded_weights.lora_model(folder)
    base = model.get_base_model().model.layers[0].self_attn.q_proj.base_layer.weight.detach().clone()
    merged = model.merge_and_unload().state_dict()
    assert not torch.allclose(merged["model.layers.0.self_attn.q_proj.weight"], base, atol=1e-2)  # the adapters count
    return merged


@pytest.mark.parametrize("tied", [True, False])
def test_a_tied_output_embedding_is_the_input_embedding_yielded_again_right_after_it(tied):
    config = Qwen2Config(vocab_size=40, hidden_size=16, intermediate_size=32, num_hidden_layers=1, num_attention_heads=2,
                         num_key_value_heads=1, tie_word_embeddings=tied)
    model = Qwen2ForCausalLM(config)
    weights = list(merged_weights(model, torch.bfloat16))
    names = [name for name, _ in weights]
    assert sorted(names) == sorted(model.state_dict())
    embedding, head = weights[names.index("model.embed_tokens.weight")][1], weights[names.index("lm_head.weight")][1]
    assert torch.equal(head, model.lm_head.weight.to(torch.bfloat16))
    # tied, the embedding is cast (under FSDP2: gathered) once, and vLLM gets it under both names
    assert (head is embedding) == tied
    assert (names.index("lm_head.weight") == names.index("model.embed_tokens.weight") + 1) == tied


def test_an_unsharded_lora_model_yields_peft_merged_weights(sharded_weights, model_folder):
    expected = peft_merged(sharded_weights, model_folder)
    weights = dict(merged_weights(sharded_weights.lora_model(model_folder), torch.bfloat16))
    assert weights.keys() == expected.keys()
    for name, tensor in expected.items():
        assert weights[name].dtype == torch.bfloat16
        assert torch.allclose(weights[name].float(), tensor, rtol=1e-2, atol=1e-2), name


@pytest.mark.slow
def test_a_lora_model_sharded_over_two_processes_yields_peft_merged_weights_gathered_one_at_a_time(
    sharded_weights, model_folder, tmp_path
):
    subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2", str(SCRIPT), model_folder,
         str(tmp_path / "out")],
        check=True, capture_output=True, timeout=300,
    )
    expected = peft_merged(sharded_weights, model_folder)
    for rank in (0, 1):
        pushes = torch.load(tmp_path / f"out.{rank}")
        float32, bfloat16 = pushes["torch.float32"], pushes["torch.bfloat16"]
        assert float32["weights"].keys() == bfloat16["weights"].keys() == expected.keys()
        for name, tensor in expected.items():
            assert torch.allclose(float32["weights"][name], tensor, rtol=1e-5, atol=1e-6), (rank, name)
            # cast on the shards, then gathered: the values of the gathered float32 weight cast to bfloat16
            assert torch.equal(bfloat16["weights"][name], float32["weights"][name].to(torch.bfloat16)), (rank, name)
        for push, dtype in [(float32, torch.float32), (bfloat16, torch.bfloat16)]:
            # one gather per weight in the engine's dtype, the tied embeddings' one gather under both names, each once
            # the weight before it was dropped
            assert push["gathered_dtypes"] == [dtype] * (len(expected) - 1)
            assert push["alive_at_gather"] == [0] * (len(expected) - 1)
