"""How close each phase of a lit_cancel training step comes to this CPU's limits: a roofline per phase.

    python benchmarks/performance/roofline.py [--rows long-large-fp32,qwen05-fp32] [--steps 2] [--warmup 1] [--threads 2]

The machine's limits are measured first, in the same run and with the same threads: the GEMM peak (square
``torch.mm`` products, float32 and bfloat16, of 2,048 or the first size from 256 up whose product takes a tenth of a
second, the median of 7) and the memory bandwidth (a STREAM-like triad,
``a = b + 2c`` over float32 arrays of 256 MiB, counting 12 bytes an element). Then each row of
``benchmarks/performance/vs_trl.py`` trains for ``--warmup + --steps`` steps with its parts timed
(``profile_step.py``), and each phase's median time is set against the least time its work could take here:

* decoding (the tokens after each prompt's first, sampled from the prefill): every step reads each weight once, whatever
  the number of rows (they share it), and each live row's key/value cache; it computes 2 FLOPs per weight per live row
  plus attention. Its bound is the larger of those bytes over the bandwidth and those FLOPs over the GEMM peak, step
  by step;
* prefill (each prompt once, before its group's rows copy its cache), old/reference log-probs and the training pass
  (forward and backward): FLOPs over the GEMM peak. A forward costs 2 FLOPs per weight of the blocks per token, 2 per
  weight of the head per completion token (the only positions whose logits are computed) and causal attention,
  ``2 x hidden x L^2`` per block for a row of ``L`` tokens; backward twice the forward. The work a checkpointing mode
  recomputes is not counted: the share is of useful FLOPs (a model-FLOPs utilisation);
* the optimizer step: bytes over the bandwidth. Clipping reads the gradients twice and writes them once, AdamW reads
  the weights, gradients and both moments and writes the weights and moments: 10 float32 words a trained parameter.

Completions count to their EOS; a row's live steps end there, though a fixed-shape batch may compute more. A
``bf16`` row on a CPU without bfloat16 instructions computes its products in float32 (lit_cancel does so itself):
its bound is the float32 peak, its weights are read as float32.
"""

import argparse
import logging
import statistics
import tempfile
from dataclasses import dataclass
from functools import partial

import torch
import transformers
from profile_step import RoundShape, profile  # benchmarks/performance/ is on the path when run as a script
from timing import median_ms
from vs_trl import ROWS

from lit_cancel.float32_products import cpu_identity, wants_float32_products

GEMM_SIZE, TRIAD_ELEMENTS = 2048, 2**26
# float32 words the optimizer step reads or writes per trained parameter: clipping (norm, scale) 3, AdamW 7
OPTIMIZER_WORDS = 10


@dataclass(frozen=True)
class Limits:
    float32_flops: float
    bfloat16_flops: float
    bandwidth: float  # bytes per second


@dataclass(frozen=True)
class Work:
    """What a phase computes and moves, and the least time it takes within ``limits``."""

    flops: float
    bytes: float
    bound_s: float
    binds: str  # "compute" or "memory"


@dataclass(frozen=True)
class Shape:
    """What a forward of a model reads and computes per token: weights of its blocks' matrices, of its head,
    and the attention widths."""

    block_weights: int
    head_weights: int
    blocks: int
    hidden: int
    kv_width: int
    trained: int

    @classmethod
    def of(cls, model: torch.nn.Module) -> "Shape":
        config = model.config
        head_dim = config.hidden_size // config.num_attention_heads
        return cls(
            block_weights=sum(p.numel() for p in model.model.layers.parameters() if p.dim() == 2),
            head_weights=model.get_output_embeddings().weight.numel(),
            blocks=config.num_hidden_layers,
            hidden=config.hidden_size,
            kv_width=config.num_key_value_heads * head_dim,
            trained=sum(p.numel() for p in model.parameters() if p.requires_grad),
        )

    def forward_flops(self, tokens: int, completion_tokens: int) -> float:
        """One row's forward: ``tokens`` attended, the head at ``completion_tokens`` positions."""
        return 2 * self.block_weights * tokens + 2 * self.head_weights * completion_tokens + 2 * self.blocks * self.hidden * tokens**2


def measure_limits() -> Limits:
    def gemm(dtype: torch.dtype) -> float:
        size = 256
        while True:  # grows until a product takes a tenth of a second (an emulated bfloat16 product is slow)
            a, b = torch.randn(size, size, dtype=dtype), torch.randn(size, size, dtype=dtype)
            product = partial(torch.mm, out=torch.empty_like(a))
            if median_ms(product, (a, b), 1) >= 100 or size == GEMM_SIZE:
                return 2 * size**3 / (median_ms(product, (a, b), 7) / 1e3)
            size *= 2

    a, b, c = (torch.rand(TRIAD_ELEMENTS) for _ in range(3))
    triad_ms = median_ms(partial(torch.add, alpha=2.0, out=a), (b, c), 7)
    return Limits(gemm(torch.float32), gemm(torch.bfloat16), 12 * TRIAD_ELEMENTS / (triad_ms / 1e3))


def bound(flops: float, moved: float, flops_per_s: float, bandwidth: float) -> Work:
    compute, memory = flops / flops_per_s, moved / bandwidth
    return Work(flops, moved, max(compute, memory), "compute" if compute >= memory else "memory")


def decoding(shape: Shape, round_: RoundShape, word: int, flops_per_s: float, bandwidth: float) -> Work:
    """Decode steps 1 .. longest - 1 (token 1 comes from the prefill), each over the rows whose completion is longer."""
    flops = moved = seconds = 0.0
    weight_bytes = (shape.block_weights + shape.head_weights) * word
    for step in range(1, max(round_.completion_tokens)):
        contexts = [p + step for p, c in zip(round_.prompt_tokens, round_.completion_tokens) if c > step]
        step_flops = sum(2 * (shape.block_weights + shape.head_weights) + 4 * shape.blocks * shape.hidden * n for n in contexts)
        step_bytes = weight_bytes + sum(2 * shape.blocks * shape.kv_width * n * word for n in contexts)
        flops, moved = flops + step_flops, moved + step_bytes
        seconds += max(step_flops / flops_per_s, step_bytes / bandwidth)
    return Work(flops, moved, seconds, "compute" if flops / flops_per_s >= moved / bandwidth else "memory")


def forward_flops(shape: Shape, round_: RoundShape) -> float:
    return sum(shape.forward_flops(p + c, c) for p, c in zip(round_.prompt_tokens, round_.completion_tokens))


def prefill_flops(shape: Shape, round_: RoundShape) -> float:
    group = len(round_.prompt_tokens) // round_.prompts
    return sum(shape.forward_flops(p, 1) for p in round_.prompt_tokens[::group])


def phases(steps: list[dict[str, float]], rounds: list[RoundShape], shape: Shape, limits: Limits, bf16: bool,
           logprob_passes: int) -> list[tuple[str, float, Work | None]]:
    """``(phase, median seconds, work)`` of each timed part of profiled ``steps`` (:func:`profile_step.profile`) whose
    rounds had ``rounds``' shapes; work None where no bound is modelled. ``logprob_passes``: the forwards a round's
    old and reference log-probs take (0 to 2)."""
    narrow = bf16 and not wants_float32_products("bf16-mixed", torch.device("cpu"), False)
    flops_per_s, word = (limits.bfloat16_flops, 2) if narrow else (limits.float32_flops, 4)

    def median(part: str) -> float:
        return statistics.median(step.get(part, 0.0) for step in steps)

    def median_work(work) -> Work:
        works = sorted((work(round_) for round_ in rounds), key=lambda w: w.bound_s)
        return works[(len(works) - 1) // 2]

    def compute(flops: float) -> Work:
        return bound(flops, 0.0, flops_per_s, limits.bandwidth)

    table = [
        ("prefill", median("prefill"), median_work(lambda r: compute(prefill_flops(shape, r)))),
        ("decode", median("decode"), median_work(lambda r: decoding(shape, r, word, flops_per_s, limits.bandwidth))),
        ("old/ref log-probs", median("old/ref log-probs"),
         median_work(lambda r: compute(logprob_passes * forward_flops(shape, r))) if logprob_passes else None),
        ("training forward + backward", median("training forward") + median("backward"),
         median_work(lambda r: compute(3 * forward_flops(shape, r)))),
        ("optimizer", median("optimizer"), bound(0.0, OPTIMIZER_WORDS * 4 * shape.trained, flops_per_s, limits.bandwidth)),
    ]
    others = ("reward", "advantages", "other")
    table.append(("rest (" + ", ".join(others) + ")", sum(median(part) for part in others), None))
    return table


def quantity(value: float, unit: str) -> str:
    for scale, prefix in ((1e12, "T"), (1e9, "G"), (1e6, "M")):
        if value >= scale:
            return f"{value / scale:,.1f} {prefix}{unit}"
    return f"{value:,.0f} {unit}"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rows", default="long-large-fp32,qwen05-fp32", help=f"comma-separated, of {', '.join(ROWS)}")
    parser.add_argument("--steps", type=int, default=2, help="timed steps (median)")
    parser.add_argument("--warmup", type=int, default=1, help="steps not timed")
    parser.add_argument("--threads", type=int, default=2, help="torch threads, for the limits and the steps")
    args = parser.parse_args()
    names = args.rows.split(",")
    unknown = [name for name in names if name not in ROWS]
    if unknown:
        parser.error(f"--rows: unknown {unknown}; choose from {list(ROWS)}")
    torch.set_num_threads(args.threads)
    logging.getLogger("lightning.pytorch").setLevel(logging.ERROR)
    transformers.utils.logging.disable_progress_bar()
    limits = measure_limits()
    cpu = cpu_identity()
    print(f"{cpu['cpu']} ({cpu['cpu_model']}), {args.threads} threads: GEMM peak {quantity(limits.float32_flops, 'FLOP/s')} float32, "
          f"{quantity(limits.bfloat16_flops, 'FLOP/s')} bfloat16; triad bandwidth {quantity(limits.bandwidth, 'B/s')}; "
          f"median of {args.steps} steps after {args.warmup} warm-up\n")
    print("| row | phase | ms per step | work per step | least time | binds | share of the bound |")
    print("|---|---|---|---|---|---|---|")
    for name in names:
        row = ROWS[name]
        with tempfile.TemporaryDirectory() as scratch:
            run = profile(scratch, row, args.steps, args.warmup)
        total = statistics.median(step["total"] for step in run.steps)
        label = f"{name} ({run.params / 1e6:,.0f} M, {'bf16' if row.bf16 else 'fp32'})"
        module = run.module
        passes = int(module.reference is not None) + int(module.trainer.datamodule.producer.with_old_logprobs)
        for phase, seconds, work in phases(run.steps, run.rounds, Shape.of(module.policy.model), limits, row.bf16, passes):
            if work is None:
                cells = "— | — | — | —"
            else:
                done = ", ".join(part for part in (quantity(work.flops, "FLOP") if work.flops else "",
                                                    quantity(work.bytes, "B") if work.bytes else "") if part)
                share = f"{work.bound_s / seconds:.0%}" if seconds > 0 else "—"
                cells = f"{done} | {work.bound_s * 1000:,.0f} ms | {work.binds} | {share}"
            print(f"| {label} | {phase} | {seconds * 1000:,.0f} | {cells} |", flush=True)
        print(f"| {label} | whole step | {total * 1000:,.0f} | | | | |", flush=True)


if __name__ == "__main__":
    main()
