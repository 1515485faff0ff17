"""The rows of benchmarks/performance/vs_trl.py at a real model's shape: its parameter count, and a tokenizer of its
vocabulary that reads and writes text as the character tokenizer does."""

import torch
from transformers import Qwen2ForCausalLM
from vs_trl import ROWS, row_config, row_tokenizer

from lit_cancel.tokenizer import build_char_tokenizer


def test_the_qwen05_rows_have_qwen2_5_0_5b_s_parameter_count():
    tokenizer = row_tokenizer(ROWS["qwen05-fp32"])
    with torch.device("meta"):
        model = Qwen2ForCausalLM(row_config(ROWS["qwen05-fp32"], tokenizer))
    assert sum(p.numel() for p in model.parameters()) == 494_032_768  # Qwen2.5-0.5B's, tied embedding counted once


def test_the_padded_tokenizer_encodes_text_as_the_character_tokenizer_and_decodes_its_unused_tokens_by_name():
    padded, characters = row_tokenizer(ROWS["qwen05-bf16"]), build_char_tokenizer()
    assert len(padded) == 151_936
    ids = characters("047+385=")["input_ids"]
    assert padded("047+385=")["input_ids"] == ids
    assert (padded.eos_token_id, padded.pad_token_id, padded.padding_side) == (characters.eos_token_id, characters.pad_token_id, "left")
    assert padded.decode([*ids, 151_935]) == "047+385=<unused151935>"
    assert row_tokenizer(ROWS["large"]).get_vocab() == characters.get_vocab()
