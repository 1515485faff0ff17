"""bfloat16 matrix products computed in float32, on CPUs without bfloat16 instructions.

A CPU without AVX-512 BF16 or AMX has no bfloat16 multiply: oneDNN, which torch calls for bfloat16 matrix products
on a CPU, emulates one in several times the time of a float32 product of the same shape. A bfloat16 kernel multiplies
exactly and sums in float32, so the float32 product of the same bfloat16 values, rounded to bfloat16, is its result
up to the order of the sums, in float32's time. :class:`Float32Products` computes every bfloat16 ``mm``, ``addmm``,
``bmm`` and ``baddbmm`` on a CPU so. It sits below autograd: what the backward pass keeps stays bfloat16, and the
backward pass's own products, run inside it too, are computed the same way. Attention's fused kernels are left as
they are.

:class:`~lit_cancel.PolicyModule` uses it under a ``bf16`` precision on such a CPU (not with ``compile``, whose
kernels are its own) and says so when fitting starts.
"""

import platform
import re
from contextlib import AbstractContextManager, nullcontext
from pathlib import Path

import torch
from torch.utils._python_dispatch import TorchDispatchMode

_aten = torch.ops.aten
PRODUCTS = frozenset({_aten.mm.default, _aten.addmm.default, _aten.bmm.default, _aten.baddbmm.default})


def cpu_flags() -> set[str] | None:
    """The CPU's flags from /proc/cpuinfo; None where there is no such file or line."""
    try:
        found = re.search(r"^flags\s*:(.*)$", Path("/proc/cpuinfo").read_text(), re.M)
    except OSError:
        return None
    return None if found is None else set(found[1].split())


def cpu_identity(cpuinfo: str | None = None) -> dict:
    """``cpu``, the CPU's model name, and ``cpu_model``, its family, model and stepping numbers (``"family 25 model 1
    stepping 1"``), from ``/proc/cpuinfo`` (``cpuinfo``, its text): a virtual machine's model name may be only the
    vendor's line ("AMD EPYC"), the numbers name the generation."""
    if cpuinfo is None:
        cpuinfo = Path("/proc/cpuinfo").read_text() if Path("/proc/cpuinfo").exists() else ""
    fields: dict[str, str] = {}
    for line in cpuinfo.splitlines():
        key, _, value = line.partition(":")
        fields.setdefault(key.strip(), value.strip())
    numbers = " ".join(f"{name.removeprefix('cpu ')} {fields[name]}" for name in ("cpu family", "model", "stepping") if name in fields)
    return {"cpu": fields.get("model name", platform.processor()), "cpu_model": numbers}


def cpu_has_native_bf16() -> bool | None:
    """Whether the CPU multiplies bfloat16 in hardware (x86 AVX-512 BF16 or AMX, from /proc/cpuinfo); None where unknown."""
    flags = cpu_flags()
    return None if flags is None else bool({"avx512_bf16", "amx_bf16"} & flags)


def bf16_instructions() -> str:
    """The CPU's bfloat16 instructions in words: ``AMX``, ``AVX-512 BF16 without AMX`` or ``no bfloat16 instructions``."""
    flags = cpu_flags() or set()
    return "AMX" if "amx_bf16" in flags else "AVX-512 BF16 without AMX" if "avx512_bf16" in flags else "no bfloat16 instructions"


class Float32Products(TorchDispatchMode):
    """Inside it, a matrix product whose operands are all bfloat16 on a CPU is computed in float32 and rounded to
    bfloat16; every other operation runs as it would.

    Example::

        with torch.autocast("cpu", dtype=torch.bfloat16), Float32Products():
            loss = model(input_ids).logits.float().logsumexp(-1).mean()
        with Float32Products():
            loss.backward()
    """

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func in PRODUCTS and all(
            arg.dtype == torch.bfloat16 and arg.device.type == "cpu" for arg in args if isinstance(arg, torch.Tensor)
        ):
            widened = [arg.float() if isinstance(arg, torch.Tensor) else arg for arg in args]
            return func(*widened, **kwargs).to(torch.bfloat16)
        return func(*args, **kwargs)


def float32_products(enabled: bool) -> AbstractContextManager:
    """:class:`Float32Products` where ``enabled``, else a context that does nothing."""
    return Float32Products() if enabled else nullcontext()


def emulates_bf16(precision: str, on_cpu: bool) -> bool:
    """Whether a run in Lightning ``precision`` has its bfloat16 emulated: a ``bf16`` precision on a CPU known to lack
    bfloat16 instructions."""
    return precision.startswith("bf16") and on_cpu and cpu_has_native_bf16() is False


def wants_float32_products(precision: str, device: torch.device, compiled: bool) -> bool:
    """Whether a run in Lightning ``precision`` on ``device`` should compute its bfloat16 products in float32: where its
    bfloat16 is emulated (:func:`emulates_bf16`), the model not compiled."""
    return not compiled and emulates_bf16(precision, device.type == "cpu")
