"""A bfloat16 matrix product three ways: torch's own kernel, lit_cancel's ``Float32Products``, and float32 throughout.

    python benchmarks/performance/float32_products.py [--rows 64 1024] [--repeats 30] [--threads 2]

Each cell is the median time of ``F.linear`` of ``rows`` rows of 512 by the 24 M model's 1,280 × 512 weight
(benchmarks/performance/vs_trl.py's large rows): in bfloat16 by torch's kernel (oneDNN, emulated on a CPU without AVX-512
BF16 or AMX), in bfloat16 inside :class:`lit_cancel.float32_products.Float32Products`, and in float32. The last
columns compare the two bfloat16 results: the share of elements that differ, and the largest difference over the sum
of the magnitudes of its products, ``sum_k |x_k w_k|``: a result rounded the other way by a different order of the
float32 sums differs by one bfloat16 step, at most 2^-7 = 7.8e-3 of that sum.
"""

import argparse

import torch
import torch.nn.functional as F
from timing import median_ms  # benchmarks/performance is on the path when run as a script

from lit_cancel.float32_products import Float32Products, bf16_instructions

HIDDEN, MLP = 512, 1280


def widened(inputs: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    with Float32Products():
        return F.linear(inputs, weight)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rows", type=int, nargs="+", default=[64, 1024], help="rows of each product")
    parser.add_argument("--repeats", type=int, default=30, help="timed products per cell")
    parser.add_argument("--threads", type=int, default=2, help="torch threads")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    print(f"F.linear, {HIDDEN} -> {MLP}, {args.threads} threads, median ms of {args.repeats}; CPU: {bf16_instructions()}\n")
    print("| rows | bf16, torch's kernel | bf16, Float32Products | float32 | kernel / Float32Products | elements differing "
          "| largest difference / sum of magnitudes |")
    print("|---|---|---|---|---|---|---|")
    weight = torch.randn(MLP, HIDDEN)
    for rows in args.rows:
        inputs = torch.randn(rows, HIDDEN)
        low_inputs, low_weight = inputs.bfloat16(), weight.bfloat16()
        kernel = median_ms(F.linear, (low_inputs, low_weight), args.repeats)
        ours = median_ms(widened, (low_inputs, low_weight), args.repeats)
        full = median_ms(F.linear, (inputs, weight), args.repeats)
        by_kernel, by_us = F.linear(low_inputs, low_weight).float(), widened(low_inputs, low_weight).float()
        magnitude = F.linear(low_inputs.float().abs(), low_weight.float().abs())
        largest = ((by_kernel - by_us).abs() / magnitude).max().item()
        differing = (by_kernel != by_us).float().mean().item()
        print(f"| {rows} | {kernel:.2f} | {ours:.2f} | {full:.2f} | {kernel / ours:.2f}× | {differing:.4%} | {largest:.1e} |")


if __name__ == "__main__":
    main()
