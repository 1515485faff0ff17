"""bf16-mixed (float32 weights, bfloat16 matmuls) and bf16-true (bfloat16 weights): the step's gradient stays
close to the float32 one."""

import lightning as L
import torch
from split_step import FixedRollouts, SaveGradient

from lit_cancel import PRESETS, AdditionTask, RolloutDataModule


def one_step(precision: str, dtype: str | None = None) -> tuple[torch.Tensor, FixedRollouts]:
    module = FixedRollouts("embedded:tiny-adder", objective=PRESETS["grpo"](), dtype=dtype)
    data = RolloutDataModule(AdditionTask(num_digits=3, train_size=64, val_size=4), prompts_per_round=8, group_size=4)
    saver = SaveGradient()
    trainer = L.Trainer(
        max_steps=1, accelerator="cpu", devices=1, precision=precision, logger=False, enable_checkpointing=False,
        enable_progress_bar=False, enable_model_summary=False, limit_val_batches=0, callbacks=[saver],
    )
    trainer.fit(module, datamodule=data)
    return saver.gradient, module


def test_bf16_mixed_gradient_is_close_to_float32():
    full, _ = one_step("32-true")
    mixed, module = one_step("bf16-mixed")
    assert all(p.dtype == torch.float32 for p in module.parameters())
    assert not torch.equal(mixed, full)  # the matmuls did run in bfloat16
    cosine = torch.nn.functional.cosine_similarity(mixed, full, dim=0)
    assert cosine > 0.99, cosine  # measured: 0.9994, norm ratio 1.023
    assert abs(mixed.norm() / full.norm() - 1) < 0.05


def test_bf16_true_keeps_bfloat16_weights_and_a_close_gradient():
    full, _ = one_step("32-true")
    half, module = one_step("bf16-true", dtype="bfloat16")
    assert all(p.dtype == torch.bfloat16 for p in module.parameters())
    cosine = torch.nn.functional.cosine_similarity(half.float(), full, dim=0)
    assert cosine > 0.98, cosine  # measured: 0.9980
