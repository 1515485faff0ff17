"""bf16-mixed (float32 weights, bfloat16 matmuls) and bf16-true (bfloat16 weights): the step's gradient stays
close to the float32 one, and a fused optimizer's gradients are clipped under bf16-mixed."""

from functools import partial

import lightning as L
import pytest
import torch

from lit_cancel import AdditionTask, SFTDataModule, SFTModule


def first_step(split_step, precision: str, dtype: str | None = None) -> dict:
    return split_step.train("GRPO", devices=1, strategy="auto", accumulate=1, steps=1, kl_coef=0.0, precision=precision, dtype=dtype)


def test_bf16_mixed_gradient_is_close_to_float32(split_step):
    full = first_step(split_step, "32-true")["gradient"]
    result = first_step(split_step, "bf16-mixed")
    mixed = result["gradient"]
    assert result["dtypes"] == {torch.float32}
    assert not torch.equal(mixed, full)  # the matmuls did run in bfloat16
    cosine = torch.nn.functional.cosine_similarity(mixed, full, dim=0)
    assert cosine > 0.99, cosine  # measured: 0.9994, norm ratio 1.023
    assert abs(mixed.norm() / full.norm() - 1) < 0.05


def test_bf16_true_keeps_bfloat16_weights_and_a_close_gradient(split_step):
    full = first_step(split_step, "32-true")["gradient"]
    result = first_step(split_step, "bf16-true", dtype="bfloat16")
    assert result["dtypes"] == {torch.bfloat16}
    cosine = torch.nn.functional.cosine_similarity(result["gradient"].float(), full, dim=0)
    assert cosine > 0.98, cosine  # measured: 0.9980


class UpdateNorm(L.Callback):
    """The norm of the first optimizer step's gradient before clipping, and of its change to the weights."""

    def on_before_optimizer_step(self, trainer, pl_module, optimizer):
        self.gradient_norm = float(torch.cat([p.grad.flatten() for p in pl_module.parameters() if p.grad is not None]).norm())

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
        self.before = torch.cat([p.detach().flatten().clone() for p in pl_module.parameters()])

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        self.norm = float((torch.cat([p.detach().flatten() for p in pl_module.parameters()]) - self.before).norm())


def test_a_fused_optimizer_s_gradients_are_clipped_under_bf16_mixed():
    """Lightning's mixed precision refuses to clip a fused optimizer's gradients (a float16 scaler leaves their
    unscaling to the optimizer); bf16 has no scaler, and the module clips them: plain SGD's step is lr x the clipped
    gradient, whose norm is the clip where the gradient's is larger."""
    lr, clip = 0.1, 1e-3
    module = SFTModule("embedded:tiny-adder", optimizer=partial(torch.optim.SGD, lr=lr, fused=True))
    data = SFTDataModule(AdditionTask(num_digits=3, train_size=16, val_size=4), batch_size=8)
    update = UpdateNorm()
    trainer = L.Trainer(max_steps=1, accelerator="cpu", precision="bf16-mixed", gradient_clip_val=clip, logger=False,
                        enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
                        limit_val_batches=0, callbacks=[update])
    trainer.fit(module, datamodule=data)
    assert update.gradient_norm > 10 * clip
    assert update.norm == pytest.approx(lr * clip, rel=1e-3)
