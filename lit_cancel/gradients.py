"""How a step's gradients are made, dropped and clipped: :class:`StepGradients`, the base of lit_cancel's modules."""

import lightning as L
from lightning.pytorch.plugins.precision import MixedPrecision, Precision
from lightning.pytorch.utilities import GradClipAlgorithmType
from torch import Tensor
from typing_extensions import override

from lit_cancel.float32_products import float32_products


def scales_gradients(trainer: L.Trainer) -> bool:
    """Whether ``trainer``'s precision has a gradient scaler (float16's): the gradients stay scaled until the optimizer
    step unscales them."""
    return getattr(trainer.precision_plugin, "scaler", None) is not None


class StepGradients(L.LightningModule):
    """A LightningModule of a ``policy`` (:class:`~lit_cancel.sharding.ModelRoot`) whose backward pass runs in the
    forward pass's products (:mod:`lit_cancel.float32_products`), whose gradients are dropped after each optimizer step,
    and clipped under bfloat16 mixed precision whatever the optimizer.

    Lightning zeroes the gradients after ``training_step`` and before its backward (``Closure.closure`` in
    ``lightning/pytorch/loops/optimization/automatic.py``), so a training step that sends gradients back itself
    (:func:`lit_cancel.logprobs.backward_by_chunk`) would lose them; dropped after the optimizer step instead, they are
    zero before every first micro-batch as before, and freed while the next round samples.

    Lightning's mixed precision refuses to clip the gradients of an optimizer that unscales them itself (a fused
    AdamW): with a float16 gradient scaler they would be clipped still scaled. bfloat16 has no scaler, so its
    gradients are the true ones when they are clipped, and they are.
    """

    @override
    def backward(self, loss: Tensor, *args, **kwargs) -> None:
        with float32_products(self.policy.float32_products):
            super().backward(loss, *args, **kwargs)

    @override
    def optimizer_step(self, epoch: int, batch_idx: int, optimizer, optimizer_closure=None) -> None:
        super().optimizer_step(epoch, batch_idx, optimizer, optimizer_closure)
        optimizer.zero_grad()

    @override
    def optimizer_zero_grad(self, epoch: int, batch_idx: int, optimizer) -> None:
        """Nothing: the gradients were dropped after the last optimizer step."""

    @override
    def configure_gradient_clipping(self, optimizer, gradient_clip_val=None, gradient_clip_algorithm=None) -> None:
        plugin = self.trainer.precision_plugin
        if gradient_clip_val and isinstance(plugin, MixedPrecision) and not scales_gradients(self.trainer):
            Precision.clip_gradients(plugin, optimizer, gradient_clip_val, GradClipAlgorithmType(gradient_clip_algorithm or "norm"))
        else:
            super().configure_gradient_clipping(optimizer, gradient_clip_val, gradient_clip_algorithm)
