"""What FSDP2's mixed-precision policy changes under ``bf16-mixed``: bytes moved and time of a training step, on 2 CPU
processes over gloo.

    python benchmarks/performance/fsdp2_precision.py [--hidden 512] [--layers 8] [--rows 8] [--length 256] [--repeats 5]

A randomly initialised Qwen2 (character vocabulary) is sharded block by block as lit_cancel shards a policy
(:func:`lit_cancel.sharding.fully_shard_model`) and runs forward and backward of a language-model loss on
``--rows`` sequences of ``--length`` tokens per process, in three ways:

* ``32-true``: float32 throughout.
* ``bf16-mixed, float32 gathers``: bfloat16 autocast around float32 gathers (FSDP2 without a policy).
* ``bf16-mixed, bfloat16 gathers`` (lit_cancel under ``bf16-mixed``): parameters gathered and used in bfloat16,
  gradients reduce-scattered in float32 (:func:`lit_cancel.sharding.mixed_precision_policy`).

Prints, for rank 0, the bytes all-gathered and reduce-scattered per step (counted at ``torch.distributed``'s
collectives) and the median step time of ``--repeats`` steps after one warm-up step.
"""

import argparse
import copy
import os
import statistics
import tempfile
import time
from contextlib import nullcontext

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch.distributed.device_mesh import init_device_mesh
from transformers import Qwen2Config, Qwen2ForCausalLM

from lit_cancel.sharding import ModelRoot, fully_shard_model
from lit_cancel.tokenizer import build_char_tokenizer

WAYS = {  # name: (precision of the sharding policy, autocast to bfloat16)
    "32-true": ("32-true", False),
    "bf16-mixed, float32 gathers": ("32-true", True),
    "bf16-mixed, bfloat16 gathers (lit_cancel)": ("bf16-mixed", True),
}


class CollectiveBytes:
    """Counts the bytes that FSDP2's all-gathers and reduce-scatters write (it calls these two functions)."""

    def __init__(self):
        self.gathered = self.reduced = 0
        self._all_gather, self._reduce_scatter = dist.all_gather_single, dist.reduce_scatter_single

        def all_gather(output, input, *args, **kwargs):
            self.gathered += output.numel() * output.element_size()
            return self._all_gather(output, input, *args, **kwargs)

        def reduce_scatter(output, input, *args, **kwargs):
            self.reduced += input.numel() * input.element_size()
            return self._reduce_scatter(output, input, *args, **kwargs)

        dist.all_gather_single, dist.reduce_scatter_single = all_gather, reduce_scatter


def language_model_loss(model, input_ids):
    return model(input_ids=input_ids, labels=input_ids).loss


def run(rank: int, args, port: int, out: str) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=2)
    torch.set_num_threads(1)
    counter = CollectiveBytes()
    vocabulary = len(build_char_tokenizer())
    torch.manual_seed(0)
    config = Qwen2Config(vocab_size=vocabulary, hidden_size=args.hidden, intermediate_size=4 * args.hidden,
                         num_hidden_layers=args.layers, num_attention_heads=8, num_key_value_heads=2, tie_word_embeddings=True)
    model = ModelRoot(Qwen2ForCausalLM(config))
    input_ids = torch.randint(2, vocabulary, (args.rows, args.length), generator=torch.Generator().manual_seed(rank))
    results = {}
    for name, (precision, autocast) in WAYS.items():
        root = fully_shard_model(copy.deepcopy(model), init_device_mesh("cpu", (2,)), precision)
        seconds, gathered, reduced = [], [], []
        for repeat in range(args.repeats + 1):  # the first step warms up
            dist.barrier()
            counter.gathered = counter.reduced = 0
            started = time.perf_counter()
            with torch.autocast("cpu", dtype=torch.bfloat16) if autocast else nullcontext():
                loss = root(language_model_loss, input_ids)
            loss.backward()
            dist.barrier()
            if repeat:
                seconds.append(time.perf_counter() - started)
                gathered.append(counter.gathered)
                reduced.append(counter.reduced)
            root.zero_grad(set_to_none=True)
        results[name] = {"seconds": statistics.median(seconds), "gathered": gathered[-1], "reduced": reduced[-1]}
    if rank == 0:
        torch.save({"results": results, "parameters": sum(p.numel() for p in model.parameters())}, out)
    dist.destroy_process_group()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--hidden", type=int, default=512)
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--rows", type=int, default=8)
    parser.add_argument("--length", type=int, default=256)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--port", type=int, default=29517)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as folder:
        out = os.path.join(folder, "results.pt")
        mp.spawn(run, args=(args, args.port, out), nprocs=2)
        saved = torch.load(out)
    results = saved["results"]
    baseline = results["32-true"]["seconds"]
    print(f"{saved['parameters'] / 1e6:.1f} M parameters, {args.rows} x {args.length} tokens per process, 2 processes (gloo)")
    print(f"| way | MiB all-gathered/step | MiB reduce-scattered/step | s/step (median of {args.repeats}) | vs 32-true |")
    print("|---|---|---|---|---|")
    for name, result in results.items():
        print(f"| {name} | {result['gathered'] / 2**20:.1f} | {result['reduced'] / 2**20:.1f} | {result['seconds']:.3f} "
              f"| {result['seconds'] / baseline:.2f}x |")


if __name__ == "__main__":
    main()
