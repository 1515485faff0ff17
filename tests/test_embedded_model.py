from pathlib import Path

from transformers import AutoModelForCausalLM, AutoTokenizer

from lit_cancel.hub import ASSETS, resolve_model_path
from lit_cancel.tokenizer import build_char_tokenizer


def test_embedded_model_loads_through_transformers_and_fits_the_size_budget():
    folder = resolve_model_path("embedded:tiny-adder")
    size = sum(f.stat().st_size for f in Path(folder).iterdir())
    assert size <= 10 * 2**20
    model = AutoModelForCausalLM.from_pretrained(folder)
    parameters = sum(p.numel() for p in model.parameters())
    assert 1_000_000 <= parameters <= 5_000_000
    assert model.config.model_type == "qwen2"


def test_embedded_tokenizer_is_the_character_tokenizer():
    shipped = AutoTokenizer.from_pretrained(ASSETS / "tiny-adder")
    built = build_char_tokenizer()
    assert shipped.get_vocab() == built.get_vocab()
    text = "047+385=7+5+0=12,4+8+1=13,0+3+1=4|432"
    assert shipped(text)["input_ids"] == built(text)["input_ids"] and len(shipped(text)["input_ids"]) == len(text)
    assert shipped.decode(shipped(text)["input_ids"]) == text
    assert shipped.eos_token == "<eos>" and shipped.pad_token == "<pad>"
