"""bf16-mixed (float32 weights, bfloat16 matmuls) and bf16-true (bfloat16 weights): the step's gradient stays
close to the float32 one."""

import torch


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
