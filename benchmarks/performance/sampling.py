"""The decode loop's draw of one token per row against ``torch.multinomial``, by vocabulary size.

    python benchmarks/performance/sampling.py [--rows 32 64 128] [--repeats 15] [--threads 2]

Each cell is the median time of one draw for every row from a softmax over random logits: ``torch.multinomial``
as Hugging Face ``generate`` calls it (after ``torch.softmax``), the softmax's cumulative sum in float64 over the whole
vocabulary and a search at a uniform point per row, and lit_cancel's ``sample_tokens``, which does that over a small
vocabulary and, over a real one, sums blocks of 1,024 tokens first and then only inside the block the point falls in.
The vocabularies: a character tokenizer (the shipped models), Llama 2's 32,000 and Qwen2.5's 151,936 tokens. All three
draw from the same distribution (tests/engines/test_draw.py); the ratios are sample_tokens' time over the other two's.
"""

import argparse

import torch
from timing import median_ms  # benchmarks/performance is on the path when run as a script

from lit_cancel.engines.draw import draw_over_whole, sample_tokens

VOCABULARIES = {"characters": 64, "Llama 2": 32_000, "Qwen2.5": 151_936}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rows", type=int, nargs="+", default=[32, 64, 128], help="rows drawn at once (prompts x samples)")
    parser.add_argument("--repeats", type=int, default=15, help="timed draws per cell")
    parser.add_argument("--threads", type=int, default=2, help="torch threads")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    torch.manual_seed(0)

    def multinomial(scores: torch.Tensor) -> torch.Tensor:
        return torch.multinomial(torch.softmax(scores, dim=-1), 1).squeeze(1)

    def whole_cumulative_sum(scores: torch.Tensor) -> torch.Tensor:
        return draw_over_whole(torch.softmax(scores, dim=-1))

    print(f"{'vocabulary':<22} {'rows':>5} {'multinomial ms':>15} {'whole cumsum ms':>16} {'sample_tokens ms':>17}"
          f" {'/ multinomial':>14} {'/ whole cumsum':>15}")
    for name, size in VOCABULARIES.items():
        for rows in args.rows:
            scores = torch.randn(rows, size)
            racing, whole, drawn = (median_ms(draw, (scores,), args.repeats) for draw in (multinomial, whole_cumulative_sum, sample_tokens))
            print(f"{f'{name} ({size:,})':<22} {rows:>5} {racing:>15.3f} {whole:>16.3f} {drawn:>17.3f}"
                  f" {drawn / racing:>14.2f} {drawn / whole:>15.2f}")


if __name__ == "__main__":
    main()
