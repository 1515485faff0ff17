"""Decoding's large float32 products through oneDNN: the same outputs as PyTorch's products, only where gradients are
off, autocast is not on and a layer is large, and the layers as they were after the block."""

import pytest
import torch
from transformers import Qwen2Config, Qwen2ForCausalLM

from lit_cancel import DecodeLoop, RLModule
from lit_cancel import onednn_linears as onednn
from lit_cancel.engines.base import SampleRequest
from lit_cancel.onednn_linears import MIN_WEIGHTS, onednn_linear_available, onednn_linears
from lit_cancel.tokenizer import build_char_tokenizer

pytestmark = pytest.mark.skipif(not onednn_linear_available(), reason="this torch has no oneDNN linear")


def wide_model() -> Qwen2ForCausalLM:
    """One block whose MLP matrices (256 x 4,096) reach MIN_WEIGHTS; attention's (256 x 256, 256 x 128) and the head's
    (99 x 256) do not."""
    config = Qwen2Config(vocab_size=99, hidden_size=256, intermediate_size=4096, num_hidden_layers=1, num_attention_heads=4,
                         num_key_value_heads=2, eos_token_id=1, pad_token_id=0)
    torch.manual_seed(0)
    return Qwen2ForCausalLM(config).eval()


def test_the_large_layers_give_pytorchs_outputs_through_onednn_and_are_restored_after():
    model = wide_model()
    assert 256 * 4096 >= MIN_WEIGHTS > 256 * 256
    ids = torch.randint(99, (3, 7), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        expected = model(ids).logits
        with onednn_linears(model) as routed:
            assert routed == 3  # gate, up and down
            assert "forward" in vars(model.model.layers[0].mlp.down_proj)
            assert "forward" not in vars(model.model.layers[0].self_attn.q_proj)
            got = model(ids).logits
    assert not any("forward" in vars(layer) for layer in model.modules())
    torch.testing.assert_close(got, expected, atol=1e-4, rtol=1e-4)


def test_the_products_are_onednns_within_the_block(monkeypatch):
    model, calls = wide_model(), []
    product = onednn._onednn_linear
    monkeypatch.setattr(onednn, "_onednn_linear", lambda layer, inputs: calls.append(layer) or product(layer, inputs))
    with torch.no_grad(), onednn_linears(model):
        model(torch.randint(99, (2, 5)))
    mlp = model.model.layers[0].mlp
    assert calls == [mlp.gate_proj, mlp.up_proj, mlp.down_proj]


def test_a_pass_with_gradients_under_autocast_or_in_bfloat16_keeps_pytorchs_products():
    model = wide_model()
    with onednn_linears(model) as routed:
        assert routed == 0
    with torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16), onednn_linears(model) as routed:
        assert routed == 0
    with torch.no_grad(), onednn_linears(wide_model().to(torch.bfloat16)) as routed:
        assert routed == 0


def test_the_layers_are_restored_when_the_block_raises():
    model = wide_model()
    with pytest.raises(RuntimeError, match="stop"), torch.no_grad(), onednn_linears(model):
        raise RuntimeError("stop")
    assert not any("forward" in vars(layer) for layer in model.modules())


def test_the_decode_loop_samples_through_onednn(tmp_path, monkeypatch):
    model = wide_model()
    model.save_pretrained(tmp_path)
    build_char_tokenizer().save_pretrained(tmp_path)
    module = RLModule(str(tmp_path), max_new_tokens=4).eval()
    calls = []
    product = onednn._onednn_linear
    monkeypatch.setattr(onednn, "_onednn_linear", lambda layer, inputs: calls.append(layer) or product(layer, inputs))
    prompts = module.tokenizer(["12+3="], return_tensors="pt")
    request = SampleRequest(prompts["input_ids"], prompts["attention_mask"], 2, module.sampling_options(), greedy=False)
    sampled = DecodeLoop().sample(module.policy_weights(), request)
    assert sampled.sequences.shape[0] == 2 and len(calls) >= 3
