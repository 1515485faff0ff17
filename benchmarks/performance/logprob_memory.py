"""Peak memory of the log-prob and entropy step: chunked (lit_cancel) against full float32 logits.

    python benchmarks/performance/logprob_memory.py [--vocab 151936] [--tokens 1024] [--chunks 32 64 128]

A Qwen2-architecture model with a Qwen-sized vocabulary (one small layer, so the LM head dominates)
scores ``--tokens`` completion tokens with the forward and backward pass of a policy-gradient
loss. Each variant runs in a fresh process; the figure is the growth of its peak resident memory
over what the model and inputs already held (CPU), or the CUDA peak when a GPU is present.
"""

import argparse
import json
import resource
import subprocess
import sys

import torch


def measure(variant: str, vocab: int, tokens: int, chunk: int) -> float:
    from transformers import Qwen2Config, Qwen2ForCausalLM

    from lit_cancel.logprobs import completion_logprobs

    device = "cuda" if torch.cuda.is_available() else "cpu"
    config = Qwen2Config(vocab_size=vocab, hidden_size=64, intermediate_size=128, num_hidden_layers=1,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=tokens + 8)
    model = Qwen2ForCausalLM(config).to(device)
    input_ids = torch.randint(0, vocab, (1, tokens + 1), device=device)
    mask = torch.ones_like(input_ids)
    if device == "cuda":
        torch.cuda.reset_peak_memory_stats()
        start = torch.cuda.max_memory_allocated()
    else:
        start = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    if variant == "full logits":
        logits = model(input_ids=input_ids, attention_mask=mask).logits[:, :-1].float()
        log_dist = torch.log_softmax(logits, -1)
        logprobs = log_dist.gather(-1, input_ids[:, 1:, None]).squeeze(-1)
        entropy = -(log_dist.exp() * log_dist).sum(-1)
    else:
        logprobs, entropy = completion_logprobs(model, input_ids, mask, 1, chunk_size=chunk)
    (-(logprobs * torch.randn_like(logprobs)).sum()).backward()
    assert torch.isfinite(entropy).all()
    if device == "cuda":
        return (torch.cuda.max_memory_allocated() - start) / 2**20
    return (resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024 - start) / 2**20


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--vocab", type=int, default=151936)
    parser.add_argument("--tokens", type=int, default=1024)
    parser.add_argument("--chunks", type=int, nargs="+", default=[32, 64, 128], help="chunk sizes to measure")
    parser.add_argument("--chunk", type=int, default=128, help=argparse.SUPPRESS)
    parser.add_argument("--variant", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.variant:
        print(json.dumps(measure(args.variant, args.vocab, args.tokens, args.chunk)))
        return
    full_tensor = args.tokens * args.vocab * 4 / 2**20
    print(f"vocabulary {args.vocab}, {args.tokens} tokens; one float32 B x T x V tensor is {full_tensor:.0f} MiB\n")
    print(f"{'variant':<28}{'peak growth (MiB)':>18}{'x full tensor':>15}")
    for variant, chunk in [("full logits", 0)] + [(f"chunked ({chunk} positions)", chunk) for chunk in args.chunks]:
        out = subprocess.run([sys.executable, __file__, f"--variant={variant}", f"--vocab={args.vocab}",
                              f"--tokens={args.tokens}", f"--chunk={chunk}"], check=True, capture_output=True, text=True)
        peak = json.loads(out.stdout.strip().splitlines()[-1])
        print(f"{variant:<28}{peak:>18.0f}{peak / full_tensor:>15.2f}")
    # hidden 64: untied embedding and LM head, each V x 64 float32
    floor = 2 * args.vocab * 64 * 4 / 2**20
    print(f"\nheld by every variant: the gradients of the embedding and the LM head, {floor:.0f} MiB "
          f"({floor / full_tensor:.2f}x)")


if __name__ == "__main__":
    main()
