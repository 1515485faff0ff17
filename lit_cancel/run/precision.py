"""``trainer.precision: auto``: float32, or bfloat16 autocast where that is faster on this machine for this model.

On a GPU with bfloat16 (NVIDIA Ampere and later) it is ``bf16-mixed``, on other GPUs ``32-true``. On a CPU the
answer depends on the CPU and on the model's width: AMX multiplies bfloat16 several times faster than float32,
AVX-512 BF16 alone about as fast, and without either a bfloat16 product is computed in float32 at float32's speed
(:mod:`lit_cancel.float32_products`); small matrices pay
for the casts whatever the CPU. So on a CPU it is measured, once at start-up: the forward and backward pass of
a training pass and a few decoding steps of one block of the model's shape, in float32 and under bfloat16
autocast.
"""

import time
from dataclasses import dataclass
from typing import Literal

import lightning as L
import torch
from lightning.fabric.connector import _PRECISION_INPUT
from transformers import AutoConfig, AutoModelForCausalLM, PretrainedConfig

from lit_cancel.engines.decode_loop import greedy_decoding_seconds
from lit_cancel.float32_products import bf16_instructions, cpu_has_native_bf16, float32_products
from lit_cancel.host_memory import bound_kernel_cache
from lit_cancel.hub import cut_config, resolve_model_path

AUTO = "auto"
# bfloat16 autocast is chosen on a CPU when it runs the model's work at least this much faster than float32
MIN_CPU_SPEEDUP = 1.1


@dataclass(frozen=True)
class PrecisionChoice:
    """A Lightning precision and why it was chosen."""

    precision: str
    reason: str


def cpu_bf16_speedup(config: PretrainedConfig, repeats: int = 5) -> float:
    """Float32 time over bfloat16-autocast time, on this CPU, of a model of ``config``'s shape cut to one block, random
    weights: a training pass (forward and backward over 128 tokens) and 16 decoding steps of 16 rows from a cache.
    The fastest of ``repeats`` interleaved timings each, after one untimed pass. Both kinds of work count: a small model
    decodes slower under autocast (a cast per operation) even where its matrix products are faster. On a CPU without
    bfloat16 instructions the bfloat16 products are computed in float32, as the run would compute them
    (:mod:`lit_cancel.float32_products`)."""
    bound_kernel_cache()
    one_block = cut_config(config, 1)
    model = AutoModelForCausalLM.from_config(one_block)
    generator = torch.Generator().manual_seed(0)
    sequences = torch.randint(config.vocab_size, (1, 128), generator=generator)
    prompts = torch.randint(config.vocab_size, (16, 8), generator=generator)

    emulated = cpu_has_native_bf16() is False

    def seconds(bf16: bool) -> float:
        started = time.perf_counter()
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=bf16), float32_products(bf16 and emulated):
            model(input_ids=sequences).logits.float().logsumexp(-1).mean().backward()
            greedy_decoding_seconds(model, prompts, 16)
        return time.perf_counter() - started

    seconds(False), seconds(True)
    # interleaved, and the fastest of each: other work on the machine only ever adds time
    timings = [(seconds(False), seconds(True)) for _ in range(repeats)]
    return min(fp32 for fp32, _ in timings) / min(bf16 for _, bf16 in timings)


def auto_precision(model_path: str, accelerator: str = "auto") -> PrecisionChoice:
    """The precision ``auto`` stands for: for the model in ``model_path`` on the ``accelerator`` (Lightning's name) at hand."""
    if accelerator in ("auto", "gpu", "cuda") and torch.cuda.is_available():
        if torch.cuda.is_bf16_supported():
            return PrecisionChoice("bf16-mixed", f"{torch.cuda.get_device_name()} computes in bfloat16")
        return PrecisionChoice("32-true", f"{torch.cuda.get_device_name()} has no bfloat16 (16-mixed is the faster choice there)")
    config = AutoConfig.from_pretrained(resolve_model_path(model_path)).get_text_config(decoder=True)
    speedup = cpu_bf16_speedup(config)
    hardware = bf16_instructions()
    measured = (f"one block of this model ({config.hidden_size} wide, {config.vocab_size} tokens) trained and decoded under "
                f"bfloat16 autocast at {speedup:.2f}x float32's speed on this CPU ({hardware})")
    if speedup >= MIN_CPU_SPEEDUP:
        return PrecisionChoice("bf16-mixed", measured)
    return PrecisionChoice("32-true", f"{measured}, under the {MIN_CPU_SPEEDUP}x that bfloat16 needs to be chosen")


class Trainer(L.Trainer):
    """Lightning's ``Trainer``, whose ``precision`` also names ``"auto"`` for ``lit-cancel``'s command line, which replaces it
    with :func:`auto_precision`'s choice for the configured model before the trainer is built (and says which).

    In Python, pass the choice itself: ``Trainer(precision=auto_precision("embedded:tiny-adder").precision)``.
    """

    def __init__(self, *args, precision: _PRECISION_INPUT | Literal["auto"] | None = None, **kwargs):
        if precision == AUTO:
            raise ValueError(
                "precision 'auto' is chosen for a model: lit-cancel's command line does it from model.init_args.model_path; "
                "in Python pass lit_cancel.run.precision.auto_precision(model_path).precision"
            )
        super().__init__(*args, precision=precision, **kwargs)
