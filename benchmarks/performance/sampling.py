"""The decode loop's draw of one token per row against ``torch.multinomial``, by vocabulary size.

    python benchmarks/performance/sampling.py [--rows 64 128] [--repeats 15] [--threads 2]

Each cell is the median time of one draw for every row from a softmax over random logits: ``torch.multinomial``
as Hugging Face ``generate`` calls it (after ``torch.softmax``), and lit_cancel's ``sample_tokens`` (the softmax,
its cumulative sum in float64 and a search at a uniform point per row). The vocabularies: a character tokenizer
(the shipped models), Llama 2's 32,000 and Qwen2.5's 151,936 tokens. Both draw from the same distribution
(tests/engines/test_sampling.py); the ratio is sample_tokens' time over multinomial's.
"""

import argparse

import torch
from timing import median_ms  # benchmarks/performance is on the path when run as a script

from lit_cancel.engines.decode_loop import sample_tokens

VOCABULARIES = {"characters": 64, "Llama 2": 32_000, "Qwen2.5": 151_936}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rows", type=int, nargs="+", default=[64, 128], help="rows drawn at once (prompts x samples)")
    parser.add_argument("--repeats", type=int, default=15, help="timed draws per cell")
    parser.add_argument("--threads", type=int, default=2, help="torch threads")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    torch.manual_seed(0)

    def multinomial(scores: torch.Tensor) -> torch.Tensor:
        return torch.multinomial(torch.softmax(scores, dim=-1), 1).squeeze(1)

    print(f"{'vocabulary':<22} {'rows':>5} {'multinomial ms':>15} {'sample_tokens ms':>17} {'ratio':>6}")
    for name, size in VOCABULARIES.items():
        for rows in args.rows:
            scores = torch.randn(rows, size)
            before, after = median_ms(multinomial, (scores,), args.repeats), median_ms(sample_tokens, (scores,), args.repeats)
            print(f"{f'{name} ({size:,})':<22} {rows:>5} {before:>15.3f} {after:>17.3f} {after / before:>6.2f}")


if __name__ == "__main__":
    main()
