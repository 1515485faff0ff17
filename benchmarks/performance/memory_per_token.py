"""What a training step keeps per completion token, by activation checkpointing mode, for the GPU recipes' models.

    python benchmarks/performance/memory_per_token.py [--tokens 512]

Builds the Qwen2.5-0.5B and Qwen2.5-1.5B architectures (their published config.json values, random weights)
with one and with two transformer blocks, runs one log-prob pass under bfloat16 autocast (``precision:
bf16-mixed``) over one sequence of ``--tokens`` tokens, and counts the bytes autograd keeps for the backward
pass (each storage once, the weights aside: ``kept_by``): every block's activations (no checkpointing), each
block's input (Hugging Face gradient checkpointing, ``activation_checkpointing: blocks``) and the completion
tokens' final states (a checkpointed chunk, ``chunks``). The difference between two blocks and one gives the bytes per token per
block. From these, per ``activation_checkpointing`` mode, what is kept per token until the backward pass
and what one chunk's recomputation holds per token of the chunk (``blocks+chunks``: the chunk's block
inputs and one block's activations). The KV cache per token follows from the shapes. docs/gpu.md turns
these into the memory of a step with 4 k-token completions.
"""

import argparse
from functools import partial

import torch
from transformers import Qwen2Config, Qwen2ForCausalLM

from lit_cancel.activation_checkpointing import kept_by, stop_activation_checkpointing, use_activation_checkpointing
from lit_cancel.logprobs import completion_logprobs

# the published config.json of each model, the fields that size memory
ARCHITECTURES = {
    "Qwen2.5-0.5B": dict(hidden_size=896, intermediate_size=4864, num_hidden_layers=24, num_attention_heads=14,
                         num_key_value_heads=2, vocab_size=151936, tie_word_embeddings=True),
    "Qwen2.5-1.5B": dict(hidden_size=1536, intermediate_size=8960, num_hidden_layers=28, num_attention_heads=12,
                         num_key_value_heads=2, vocab_size=151936, tie_word_embeddings=True),
}
PROMPT = 64


def kept_bytes(model: Qwen2ForCausalLM, tokens: int, budget: int | None, recompute: bool) -> int:
    """Bytes of the distinct storages autograd keeps for the backward pass of one log-prob pass in bf16-mixed, the
    weights aside."""
    ids = torch.randint(model.config.vocab_size, (1, tokens), generator=torch.Generator().manual_seed(0))
    with torch.autocast("cpu", dtype=torch.bfloat16):
        return kept_by(model, partial(
            completion_logprobs, model, ids, torch.ones_like(ids), PROMPT, max_tokens_per_chunk=budget, recompute_chunks=recompute,
        ))


def per_token(fields: dict, tokens: int) -> dict[str, float]:
    """Bytes per completion token of each mode: per block, and what does not grow with the blocks."""
    measured = {}
    for blocks in (1, 2):
        model = Qwen2ForCausalLM(Qwen2Config(**{**fields, "num_hidden_layers": blocks}))
        use_activation_checkpointing(model, "blocks")
        by_block = kept_bytes(model, tokens, None, recompute=False)
        stop_activation_checkpointing(model)
        measured[blocks] = {"all": kept_bytes(model, tokens, None, recompute=False), "block": by_block,
                            "chunk": kept_bytes(model, tokens, tokens, recompute=True)}
    completion = tokens - PROMPT
    return {
        "every block, per block": (measured[2]["all"] - measured[1]["all"]) / completion,
        "block inputs, per block": (measured[2]["block"] - measured[1]["block"]) / completion,
        "chunk recompute, in all": measured[2]["chunk"] / completion,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tokens", type=int, default=512, help="tokens of the one sequence (64 of them prompt)")
    args = parser.parse_args()
    print(f"bf16-mixed, one sequence of {args.tokens} tokens; per completion token: kept until the backward pass reaches it "
          "(every token of the micro-batch), and held while one chunk is recomputed (every token of that chunk)\n")
    print("| model | blocks | KV cache (bf16) | none: kept | blocks: kept | blocks: recomputing | chunks: kept | chunks: recomputing "
          "| blocks+chunks: kept | blocks+chunks: recomputing |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    for name, fields in ARCHITECTURES.items():
        sizes = per_token(fields, args.tokens)
        blocks = fields["num_hidden_layers"]
        head_dim = fields["hidden_size"] // fields["num_attention_heads"]
        kv_cache = 2 * blocks * fields["num_key_value_heads"] * head_dim * 2
        every, inputs, states = sizes["every block, per block"], sizes["block inputs, per block"], sizes["chunk recompute, in all"]
        cells = [kv_cache, blocks * every, blocks * inputs, every, states, blocks * every, states, blocks * inputs + every]
        print(f"| {name} | {blocks} | " + " | ".join(f"{size / 1024:,.1f} KiB" for size in cells) + " |", flush=True)


if __name__ == "__main__":
    main()
