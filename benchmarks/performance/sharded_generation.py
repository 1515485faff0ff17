"""What generating with a sharded (FSDP2) policy costs: rollout time on 2 CPU processes over gloo.

    python benchmarks/performance/sharded_generation.py [--hidden 512] [--layers 8] [--prompts 8] [--samples 8] [--new-tokens 40]

A randomly initialised Qwen2 (character vocabulary) samples ``--samples`` completions of each of
``--prompts`` prompts per process, ``--new-tokens`` tokens each (no EOS), in three ways:

* replicated: each process holds the whole model; no communication.
* sharded, gathered once (lit_cancel): resharding is switched off for the call, so each unit is
  all-gathered at the first decoding step and kept until ``generate`` returns.
* sharded, gathered per step: FSDP2's default; every decoding step all-gathers every unit again,
  so the processes must keep stepping together (``synced_gpus=True``).

Prints the median of ``--repeats`` calls on rank 0 and the ratio to the replicated time.
"""

import argparse
import copy
import os
import statistics
import tempfile
import time

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch.distributed.device_mesh import init_device_mesh
from transformers import GenerationConfig, Qwen2Config, Qwen2ForCausalLM

from lit_cancel.sharding import ModelRoot, fully_shard_model, gathered
from lit_cancel.tokenizer import build_char_tokenizer


def generate(model, **kwargs):
    return model.generate(**kwargs)


def timed(root, args, inputs, synced: bool, keep_gathered: bool) -> float:
    config = GenerationConfig(do_sample=True, top_k=0, max_new_tokens=args.new_tokens, min_new_tokens=args.new_tokens,
                              num_return_sequences=args.samples, pad_token_id=0, eos_token_id=1)
    dist.barrier()
    started = time.perf_counter()
    if keep_gathered:
        with gathered(root):
            root(generate, **inputs, generation_config=config, synced_gpus=synced)
    else:
        root(generate, **inputs, generation_config=config, synced_gpus=synced)
    dist.barrier()
    return time.perf_counter() - started


def run(rank: int, args, port: int, out: str) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=2)
    torch.set_num_threads(1)
    tokenizer = build_char_tokenizer()
    torch.manual_seed(0)
    config = Qwen2Config(vocab_size=len(tokenizer), hidden_size=args.hidden, intermediate_size=4 * args.hidden,
                         num_hidden_layers=args.layers, num_attention_heads=8, num_key_value_heads=2, tie_word_embeddings=True)
    replicated = ModelRoot(Qwen2ForCausalLM(config).eval())
    sharded = fully_shard_model(copy.deepcopy(replicated), init_device_mesh("cpu", (2,)))
    prompts = tokenizer([f"{100 + 7 * i}+{200 + 3 * i}=" for i in range(args.prompts)], return_tensors="pt", padding=True)
    inputs = {"input_ids": prompts["input_ids"], "attention_mask": prompts["attention_mask"]}
    ways = {
        "replicated": (replicated, False, False),
        "sharded, gathered once (lit_cancel)": (sharded, False, True),
        "sharded, gathered per step": (sharded, True, False),
    }
    seconds = {name: [] for name in ways}
    with torch.no_grad():
        for repeat in range(args.repeats + 1):  # the first round warms up
            for name, (root, synced, keep) in ways.items():
                elapsed = timed(root, args, inputs, synced, keep)
                if repeat:
                    seconds[name].append(elapsed)
    if rank == 0:
        parameters = sum(p.numel() for p in replicated.parameters())
        torch.save({"seconds": seconds, "parameters": parameters}, out)
    dist.destroy_process_group()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--hidden", type=int, default=512)
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--prompts", type=int, default=8)
    parser.add_argument("--samples", type=int, default=8)
    parser.add_argument("--new-tokens", type=int, default=40)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--port", type=int, default=29561)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as scratch:
        out = os.path.join(scratch, "seconds.pt")
        mp.spawn(run, args=(args, args.port, out), nprocs=2)
        result = torch.load(out)
    print(f"Qwen2 {result['parameters'] / 1e6:.1f} M parameters ({args.layers} blocks, hidden {args.hidden}), 2 CPU processes, "
          f"{args.prompts} prompts x {args.samples} samples x {args.new_tokens} tokens per process, "
          f"median of {args.repeats}\n")
    base = statistics.median(result["seconds"]["replicated"])
    print(f"{'generate with':<38}{'seconds':>9}{'x replicated':>14}")
    for name, values in result["seconds"].items():
        median = statistics.median(values)
        print(f"{name:<38}{median:>9.2f}{median / base:>14.2f}")


if __name__ == "__main__":
    main()
