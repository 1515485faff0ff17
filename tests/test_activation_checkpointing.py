"""``activation_checkpointing: auto``: what a training pass keeps per mode, and the fastest mode that fits."""

import lightning as L
import pytest
import torch
from conftest import checkpoints_blocks
from transformers import AutoModelForCausalLM, Qwen2Config

from lit_cancel import AdditionTask, RLModule, RolloutDataModule, SFTDataModule, SFTModule, activation_checkpointing
from lit_cancel.activation_checkpointing import (
    KeptPerToken,
    choose_checkpointing,
    kept_by,
    kept_per_token,
    training_pass_bytes,
)
from lit_cancel.logprobs import completion_logprobs


@pytest.mark.parametrize("mode, budget", [(False, None), ("blocks", None), ("chunks", 96), ("blocks+chunks", 96)])
def test_the_estimate_from_cut_models_matches_what_a_pass_of_the_whole_model_keeps(mode, budget):
    """Measured on one- and two-block cuts over one sequence; checked on the four-block model over 8 rows."""
    module = RLModule("embedded:tiny-adder", activation_checkpointing=mode, max_tokens_per_chunk=budget)
    config = module.policy.model.config
    kept = kept_per_token(config)
    ids = torch.randint(5, 30, (8, 48), generator=torch.Generator().manual_seed(0))
    mask = torch.ones_like(ids)
    estimate = training_pass_bytes(mode, kept, config.num_hidden_layers, 8, 48, budget)
    # the chunk's recomputation is not kept by autograd: the pass keeps the estimate less that
    recomputed = {False: 0, "blocks": kept.activations, "chunks": config.num_hidden_layers * kept.activations,
                  "blocks+chunks": config.num_hidden_layers * kept.block_input + kept.activations}[mode]
    measured = kept_by(module, lambda: module.completion_logprobs(module.policy, ids, mask, 16))
    measured += recomputed * (budget or ids.numel())
    assert measured == pytest.approx(estimate, rel=0.25)


def test_an_attention_matrix_that_is_kept_is_extrapolated_to_longer_rows():
    """Eager attention keeps each block's probabilities, 4 heads x 4 bytes per pair of tokens: measured on rows of 32 to
    128 tokens, checked on rows of 320, where the matrices are half of what a pass keeps."""
    config = Qwen2Config(vocab_size=99, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                         num_key_value_heads=2, attn_implementation="eager")
    kept = kept_per_token(config)
    assert kept.attention == 16
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config).train()
    ids = torch.randint(99, (2, 320))
    measured = kept_by(model, lambda: completion_logprobs(model, ids, torch.ones_like(ids), 160))
    assert measured == pytest.approx(training_pass_bytes(False, kept, 2, 2, 320, None), rel=0.1)
    assert 2 * 2 * 16 * 320**2 > 0.4 * measured


def test_each_checkpointing_mode_keeps_less_than_none_and_both_least():
    kept = kept_per_token(RLModule("embedded:tiny-adder").policy.model.config)
    assert kept.activations > 5 * kept.block_input > 0 and kept.final_state > 0
    none, blocks, chunks, both = (training_pass_bytes(mode, kept, 4, 16, 256, 256) for mode in activation_checkpointing.MODES)
    assert none > max(blocks, chunks) and both < min(blocks, chunks)


# per token: 100 bytes of a block's activations, 10 of its input, 5 of a final state; 4 blocks, 10 rows of 100 tokens
# in chunks of 100: none keeps 400,000, blocks 40,000 + 10,000, chunks 5,000 + 40,000, blocks+chunks 5,000 + 14,000
KEPT = KeptPerToken(activations=100, attention=0, block_input=10, final_state=5)


@pytest.mark.parametrize("at_hand, parameter_bytes, chunk_tokens, expected", [
    (1_000_000, 0, 100, False),
    (120_000, 0, 100, "blocks"),  # 60,000 for the pass
    (95_000, 0, 100, "chunks"),  # 47,500
    (40_000, 0, 100, "blocks+chunks"),  # 20,000
    (120_000, 10_000, 100, "blocks+chunks"),  # 60,000 less 3 x 10,000
    (95_000, 0, None, "blocks"),  # no chunks: blocks is the leanest, though it does not fit
])
def test_the_fastest_mode_within_half_the_memory_at_hand_is_chosen(at_hand, parameter_bytes, chunk_tokens, expected):
    choice = choose_checkpointing(KEPT, 4, 10, 100, chunk_tokens, at_hand, parameter_bytes)
    assert choice.mode == expected
    assert ("none fits" in choice.reason) == (chunk_tokens is None)
    assert "10 rows of 100 tokens" in choice.reason


def test_auto_is_chosen_when_fitting_starts_and_stated(monkeypatch, caplog):
    """With little memory at hand the leanest mode is chosen, the model set up for it, and the choice logged."""
    monkeypatch.setattr(activation_checkpointing, "memory_at_hand", lambda device: 2**20)
    module = RLModule("embedded:tiny-adder", max_new_tokens=24, activation_checkpointing="auto", max_tokens_per_chunk=64)
    assert module.activation_checkpointing == "auto" and not checkpoints_blocks(module.policy.model)
    data = RolloutDataModule(AdditionTask(num_digits=3, train_size=32, val_size=4), prompts_per_round=4, group_size=4)
    trainer = L.Trainer(max_steps=1, accelerator="cpu", logger=False, enable_checkpointing=False, enable_progress_bar=False,
                        enable_model_summary=False, limit_val_batches=0)
    with caplog.at_level("INFO"):
        trainer.fit(module, datamodule=data)
    kept = kept_per_token(module.policy.model.config)
    row_tokens = max(len(ids) for ids in module.tokenizer([r["prompt"] for r in data.task.train_records()])["input_ids"]) + 24
    leanest = min(activation_checkpointing.MODES, key=lambda mode: training_pass_bytes(mode, kept, 4, 16, row_tokens, 64))
    assert module.activation_checkpointing == leanest
    assert checkpoints_blocks(module.policy.model) == (leanest in ("blocks", "blocks+chunks"))
    assert module.recompute_chunks == (leanest in ("chunks", "blocks+chunks"))
    assert f"activation_checkpointing auto: {leanest} (a training pass of 16 rows of {row_tokens} tokens" in caplog.text


def test_auto_without_memory_facts_uses_blocks(monkeypatch):
    monkeypatch.setattr(activation_checkpointing, "memory_at_hand", lambda device: None)
    module = RLModule("embedded:tiny-adder", max_new_tokens=16, activation_checkpointing="auto")
    data = RolloutDataModule(AdditionTask(num_digits=3, train_size=32, val_size=4), prompts_per_round=4, group_size=4)
    trainer = L.Trainer(max_steps=1, accelerator="cpu", logger=False, enable_checkpointing=False, enable_progress_bar=False,
                        enable_model_summary=False, limit_val_batches=0)
    trainer.fit(module, datamodule=data)
    assert module.activation_checkpointing == "blocks" and checkpoints_blocks(module.policy.model)


def test_auto_is_refused_with_a_datamodule_that_cannot_tell_its_micro_batch():
    module = SFTModule("embedded:tiny-adder", max_new_tokens=8, activation_checkpointing="auto")
    data = SFTDataModule(AdditionTask(num_digits=3, train_size=32, val_size=4), batch_size=4)
    trainer = L.Trainer(max_steps=1, accelerator="cpu", logger=False, enable_checkpointing=False, enable_progress_bar=False,
                        enable_model_summary=False, limit_val_batches=0)
    with pytest.raises(ValueError, match="auto sizes the micro-batch from a RolloutDataModule's round, and SFTDataModule has none"):
        trainer.fit(module, datamodule=data)
