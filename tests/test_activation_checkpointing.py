"""``activation_checkpointing: auto``: what a training pass keeps per mode, and the fastest mode that fits."""

import subprocess
import sys
from pathlib import Path

import lightning as L
import pytest
import torch
from conftest import checkpoints_blocks
from transformers import AutoModelForCausalLM, Qwen2Config

from lit_cancel import AdditionTask, RLModule, RolloutDataModule, SFTDataModule, SFTModule, activation_checkpointing
from lit_cancel.activation_checkpointing import (
    KeptPerToken,
    block_share,
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


@pytest.mark.parametrize("at_hand, parameter_bytes, held, chunk_tokens, expected", [
    # time in forwards with the blocks all of a forward: none 3, blocks 4, chunks 4, blocks+chunks 5
    (10**7, 0, 10**7, 100, False),  # none 3 x 10,400,000 against blocks 4 x 10,050,000
    (10**7, 0, 10**6, 100, "chunks"),  # none 4,200,000, blocks 4,200,000, chunks 4,180,000, both 5,095,000
    (10**7, 0, 0, 100, "blocks+chunks"),  # both 95,000 against chunks 180,000
    (600_000, 0, 10**7, 100, "chunks"),  # none would cost least, but its 400,000 exceed the 300,000 at hand
    (10**7, 1_600_000, 10**7, 100, "chunks"),  # 5,000,000 less 3 x 1,600,000 at hand: none does not fit
    (120_000, 10_000, 10**7, 100, "blocks+chunks"),  # 60,000 less 3 x 10,000 at hand: only both fits
    (95_000, 0, 0, None, "blocks"),  # no chunks: blocks is the leanest, though it does not fit
])
def test_of_the_modes_that_fit_the_one_with_least_time_times_peak_is_chosen(at_hand, parameter_bytes, held, chunk_tokens,
                                                                           expected):
    choice = choose_checkpointing(KEPT, 4, 10, 100, chunk_tokens, at_hand, parameter_bytes, held)
    assert choice.mode == expected
    assert ("none fits" in choice.reason) == (chunk_tokens is None)
    assert "a training pass of 10 rows of 100 tokens" in choice.reason


def test_a_mode_that_saves_a_quarter_of_the_time_is_taken_below_a_third_more_memory():
    """Without chunks, blocks keeps 40,000 + 100,000 (a block's activations of the whole pass while it is recomputed).
    With the blocks all of a forward, none costs 3 forwards and blocks 4: none wins while 3 (H + 400,000) <
    4 (H + 140,000), that is while H > 640,000, where its peak is 4/3 of blocks'."""
    assert choose_checkpointing(KEPT, 4, 10, 100, None, 10**9, 0, 630_000).mode == "blocks"
    assert choose_checkpointing(KEPT, 4, 10, 100, None, 10**9, 0, 650_000).mode is False
    # with a head that is half of a forward, blocks recomputes half a forward: 3.5 (H + 400,000) < 4 (H + 140,000)
    # while H > 1,680,000
    assert choose_checkpointing(KEPT, 4, 10, 100, None, 10**9, 0, 1_670_000, block_share=0.5).mode == "blocks"
    assert choose_checkpointing(KEPT, 4, 10, 100, None, 10**9, 0, 1_690_000, block_share=0.5).mode is False


def test_the_blocks_share_of_a_forward_counts_the_head_at_completion_tokens_only():
    """2 blocks of hidden 64, MLP 128, 4 heads with 2 key/value heads: 36,864 weights in each block's matrices; a row of
    10 tokens, 4 of them the completion's: 73,728 x 10 + 2 x 64 x 10^2 in the blocks, 99 x 64 x 4 in the head."""
    config = Qwen2Config(vocab_size=99, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                         num_key_value_heads=2)
    in_blocks = 73_728 * 10 + 2 * 64 * 10**2
    for tied in (True, False):
        config.tie_word_embeddings = tied
        model = AutoModelForCausalLM.from_config(config)
        assert block_share(model, 10, 4) == pytest.approx(in_blocks / (in_blocks + 99 * 64 * 4))


def test_auto_keeps_blocks_for_long_rows_of_a_24m_model_with_memory_to_spare():
    """A 24 M model (hidden 512, 8 blocks, MLP 1280), 64 rows of 264 tokens: no checkpointing keeps several times what
    blocks does and saves at most a quarter of the pass's time, so blocks is chosen though none fits."""
    config = Qwen2Config(vocab_size=99, hidden_size=512, intermediate_size=1280, num_hidden_layers=8, num_attention_heads=8,
                         num_key_value_heads=8, tie_word_embeddings=True)
    kept = kept_per_token(config)
    parameter_bytes = 4 * 24 * 10**6
    choice = choose_checkpointing(kept, 8, 64, 264, 1024, 64 * 2**30, parameter_bytes, 2**29,
                                  block_share(AutoModelForCausalLM.from_config(config), 264, 256))
    none, blocks = (training_pass_bytes(mode, kept, 8, 64, 264, 1024) for mode in (False, "blocks"))
    assert none > 4 * blocks and none < 0.5 * 64 * 2**30 - 3 * parameter_bytes
    assert choice.mode in ("blocks", "blocks+chunks")
    peak = 2**29 + 3 * parameter_bytes + training_pass_bytes(choice.mode, kept, 8, 64, 264, 1024)
    assert f"expected peak {peak / 2**30:.2f} GiB" in choice.reason
    # where the steps send each chunk back, chunks recompute nothing: as fast as none, for a chunk's activations
    sent_back = choose_checkpointing(kept, 8, 64, 264, 1024, 64 * 2**30, parameter_bytes, 2**29,
                                     block_share(AutoModelForCausalLM.from_config(config), 264, 256), chunks_sent_back=True)
    assert sent_back.mode == "chunks"
    assert training_pass_bytes("chunks", kept, 8, 64, 264, 1024) < 0.5 * none


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
    assert f"activation_checkpointing auto: {leanest} (expected peak " in caplog.text
    assert f"a training pass of 16 rows of {row_tokens} tokens" in caplog.text


def test_auto_keeps_everything_where_the_pass_is_small_next_to_what_the_process_holds(monkeypatch, caplog):
    """The tiny model's pass over 8 short rows keeps a few MiB, against the hundreds the process holds: recomputing
    would cost time and save next to nothing of the peak. Two steps a round: the second is off-policy, so the chunks
    are not sent back during the step and would be recomputed."""
    monkeypatch.setattr(activation_checkpointing, "memory_at_hand", lambda device: 64 * 2**30)
    module = RLModule("embedded:tiny-adder", max_new_tokens=24, activation_checkpointing="auto", max_tokens_per_chunk=64)
    data = RolloutDataModule(AdditionTask(num_digits=3, train_size=32, val_size=4), prompts_per_round=4, group_size=4,
                             mini_batches_per_round=2)
    trainer = L.Trainer(max_steps=1, accelerator="cpu", logger=False, enable_checkpointing=False, enable_progress_bar=False,
                        enable_model_summary=False, limit_val_batches=0)
    with caplog.at_level("INFO"):
        trainer.fit(module, datamodule=data)
    assert module.activation_checkpointing is False and not checkpoints_blocks(module.policy.model)
    assert not module.recompute_chunks
    assert "activation_checkpointing auto: none (expected peak " in caplog.text


def test_auto_takes_chunks_where_the_steps_send_them_back(monkeypatch, caplog):
    """On-policy GRPO in one process: each chunk's gradient goes back as its forward ends, so the chunk mode recomputes
    nothing and keeps one chunk's activations: as fast as keeping everything, for less memory."""
    monkeypatch.setattr(activation_checkpointing, "memory_at_hand", lambda device: 64 * 2**30)
    module = RLModule("embedded:tiny-adder", max_new_tokens=24, activation_checkpointing="auto", max_tokens_per_chunk=64)
    data = RolloutDataModule(AdditionTask(num_digits=3, train_size=32, val_size=4), prompts_per_round=4, group_size=4)
    trainer = L.Trainer(max_steps=1, accelerator="cpu", logger=False, enable_checkpointing=False, enable_progress_bar=False,
                        enable_model_summary=False, limit_val_batches=0)
    with caplog.at_level("INFO"):
        trainer.fit(module, datamodule=data)
    assert module.chunks_sent_back_in_fit()
    assert module.activation_checkpointing == "chunks" and not checkpoints_blocks(module.policy.model)
    assert "activation_checkpointing auto: chunks (expected peak " in caplog.text


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


def test_every_process_takes_process_0s_auto_choices(tmp_path):
    """Over two processes each measures its own answers; process 1's disagree with process 0's on purpose
    (tests/workers/auto_choices.py), and both train with process 0's."""
    script = Path(__file__).parent / "workers" / "auto_choices.py"
    subprocess.run([sys.executable, str(script), str(tmp_path / "choices")], check=True, capture_output=True, timeout=300)
    first, second = (torch.load(tmp_path / f"choices-rank{rank}.pt") for rank in (0, 1))
    [measured] = first["measured_on_rank0"]
    for seen in (first, second):
        assert seen["compile"] is False and seen["decoder_compiled"] is False  # process 1 measured true
        assert seen["activation_checkpointing"] == measured
        assert seen["blocks_checkpointed"] == (measured in ("blocks", "blocks+chunks"))
        assert seen["recompute_chunks"] == (measured in ("chunks", "blocks+chunks"))
