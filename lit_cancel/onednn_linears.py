"""Decoding's large float32 matrix products through oneDNN on a CPU.

A decoding step multiplies a few dozen rows (one token of each sequence) by every weight matrix. PyTorch sends a
float32 ``linear`` on a CPU to its BLAS (MKL in the PyPI wheels), which runs such skinny products far below the CPU's
peak on some machines: on a 2-core AMD EPYC (Zen 3), 32 rows by Qwen2.5-0.5B's matrices ran at 25–60 GFLOP/s
through MKL and at 67–74 through oneDNN's ``linear`` (``torch.ops.mkldnn._linear_pointwise``), against 115 for a
large square product (``benchmarks/performance/roofline.py``). For small matrices oneDNN's fixed cost per call is the
larger (tens of microseconds); from about a million weights the two were even or oneDNN ahead.

:func:`onednn_linears` routes, for the time of a ``with`` block, each float32 ``nn.Linear`` of a model on a CPU with at
least :data:`MIN_WEIGHTS` weights through oneDNN, where gradients are off, autocast is not on and nothing in the model
is compiled (a training pass keeps PyTorch's products, which autograd differentiates; a compiled decoder has its own).
The products are the same up to the order of their sums. The decode loop samples inside it.
"""

from collections.abc import Iterator
from contextlib import contextmanager
from functools import partial

import torch
from torch import Tensor, nn

# a matrix below this many weights keeps PyTorch's product (oneDNN's cost per call outweighs its speed there)
MIN_WEIGHTS = 2**20


def onednn_linear_available() -> bool:
    return torch.backends.mkldnn.is_available() and hasattr(torch.ops.mkldnn, "_linear_pointwise")


def _onednn_linear(layer: nn.Linear, inputs: Tensor) -> Tensor:
    return torch.ops.mkldnn._linear_pointwise(inputs, layer.weight, layer.bias, "none", [], "")


def routed(layer: nn.Module) -> bool:
    """Whether :func:`onednn_linears` sends ``layer`` through oneDNN."""
    return (
        type(layer) is nn.Linear and type(layer.weight) is nn.Parameter and layer.weight.device.type == "cpu"
        and layer.weight.dtype == torch.float32 and layer.weight.numel() >= MIN_WEIGHTS
    )


@contextmanager
def onednn_linears(model: nn.Module) -> Iterator[int]:
    """Within, ``model``'s large float32 ``nn.Linear`` layers on a CPU compute through oneDNN, when gradients are off
    and CPU autocast is not on; yields how many layers it routed (0 where it routes none)."""
    layers = []
    compiled = any(getattr(module, "_compiled_call_impl", None) is not None for module in model.modules())
    if onednn_linear_available() and not torch.is_grad_enabled() and not torch.is_autocast_enabled("cpu") and not compiled:
        layers = [layer for layer in model.modules() if routed(layer) and "forward" not in vars(layer)]
    for layer in layers:
        layer.forward = partial(_onednn_linear, layer)
    try:
        yield len(layers)
    finally:
        for layer in layers:
            del layer.forward
