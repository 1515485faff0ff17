"""``compile: auto``: the decoder is compiled where the run's steps save more than compiling costs."""

import lightning as L
import pytest
from lightning.pytorch.callbacks import Callback
from transformers import AutoModelForCausalLM, Qwen2Config

from lit_cancel import AdditionTask, RLModule, RolloutDataModule, compile_choice
from lit_cancel.compile_choice import (
    MIN_DISPATCH_SHARE,
    SAVED_SHARE,
    SECONDS_PER_BLOCK,
    Overhead,
    choose_compile,
    narrow_config,
)


def test_the_saving_and_the_cost_are_the_rules_products():
    overhead = Overhead(decode_step=0.002, dispatch_share=0.9)
    saving = SAVED_SHARE * 0.002 * 64  # a step of 64 decoding steps
    cost = SECONDS_PER_BLOCK * 3 * 2
    pays_after = cost / saving
    short = choose_compile(overhead, int(pays_after * 0.9), 64, blocks=3, kinds=2)
    long = choose_compile(overhead, int(pays_after * 1.1) + 1, 64, blocks=3, kinds=2)
    assert not short.compile and long.compile
    assert f"~{saving * 1e3:.0f} ms saved a step" in long.reason and f"~{cost:.0f} s of compiling 3 blocks" in long.reason


def test_where_arithmetic_dominates_a_decoding_step_no_run_is_long_enough():
    overhead = Overhead(decode_step=0.002, dispatch_share=MIN_DISPATCH_SHARE * 0.9)
    choice = choose_compile(overhead, 10**9, 64, blocks=3, kinds=2)
    assert not choice.compile and f"{MIN_DISPATCH_SHARE * 0.9:.0%} of a decoding step of one block" in choice.reason
    assert choose_compile(Overhead(0.002, MIN_DISPATCH_SHARE), 10**9, 64, blocks=3, kinds=2).compile


def test_the_narrow_model_keeps_the_blocks_and_their_operations():
    config = Qwen2Config(hidden_size=896, intermediate_size=4864, num_hidden_layers=3, num_attention_heads=14,
                         num_key_value_heads=2, vocab_size=32_000, eos_token_id=31_999)
    narrow = narrow_config(config)
    assert (narrow.num_hidden_layers, narrow.num_attention_heads, narrow.num_key_value_heads) == (3, 14, 2)
    assert (narrow.hidden_size, narrow.head_dim, narrow.vocab_size) == (112, 8, 256)
    wide, small = AutoModelForCausalLM.from_config(config), AutoModelForCausalLM.from_config(narrow)
    assert [type(m).__name__ for m in small.modules()] == [type(m).__name__ for m in wide.modules()]
    assert sum(p.numel() for p in small.parameters()) < sum(p.numel() for p in wide.parameters()) / 200


class StopBeforeTraining(Callback):
    def on_fit_start(self, trainer, pl_module):
        trainer.should_stop = True


@pytest.mark.parametrize("max_steps, compiled", [(1, False), (10**7, True)])
def test_auto_is_chosen_when_fitting_starts_and_stated(max_steps, compiled, caplog, monkeypatch):
    monkeypatch.setattr(compile_choice, "MIN_DISPATCH_SHARE", 0.0)  # the tiny model's measured share, whatever the load
    module = RLModule("embedded:tiny-adder", max_new_tokens=16, compile="auto")
    data = RolloutDataModule(AdditionTask(num_digits=3, train_size=32, val_size=4), prompts_per_round=4, group_size=4)
    trainer = L.Trainer(max_steps=max_steps, accelerator="cpu", logger=False, enable_checkpointing=False,
                        enable_progress_bar=False, enable_model_summary=False, limit_val_batches=0,
                        callbacks=[StopBeforeTraining()])
    with caplog.at_level("INFO"):
        trainer.fit(module, datamodule=data)
    decoder = module.policy.model.get_decoder()
    assert module.compile is compiled
    assert (getattr(decoder, "_compiled_call_impl", None) is not None) is compiled
    assert f"compile auto: {str(compiled).lower()} ({max_steps} steps x ~" in caplog.text
    assert "of compiling 4 blocks for 2 kinds of pass" in caplog.text


def test_a_validation_before_fitting_runs_eager_and_leaves_the_choice_to_the_fit(caplog, monkeypatch):
    monkeypatch.setattr(compile_choice, "MIN_DISPATCH_SHARE", 1.1)  # no share reaches it: the fit's choice is eager
    module = RLModule("embedded:tiny-adder", max_new_tokens=8, compile="auto", val_samples=1)
    data = RolloutDataModule(AdditionTask(num_digits=3, train_size=8, val_size=2), prompts_per_round=2, group_size=2)
    # as lit-cancel fit validates before fitting (its trainer's default: no inference mode)
    trainer = L.Trainer(max_steps=10**7, accelerator="cpu", logger=False, enable_checkpointing=False, enable_progress_bar=False,
                        enable_model_summary=False, callbacks=[StopBeforeTraining()], inference_mode=False)
    with caplog.at_level("INFO"):
        trainer.validate(module, datamodule=data)
        assert module.compile == "auto" and "compile auto" not in caplog.text
        assert getattr(module.policy.model.get_decoder(), "_compiled_call_impl", None) is None
        trainer.fit(module, datamodule=data)
    assert module.compile is False and "compile auto: false (the framework's time around the arithmetic is " in caplog.text


def test_a_compile_setting_outside_its_values_is_refused():
    with pytest.raises(ValueError, match="compile must be true, false or 'auto', got 'yes'"):
        RLModule("embedded:tiny-adder", compile="yes")
