"""FSDP (v1) sharding of the policy on 2 CPU processes over gloo (run by test_sharding.py).

    python tests/fsdp_wrap.py OUT.pt

Lightning's ``FSDPStrategy`` refuses a CPU accelerator, so this drives :func:`lit_cancel.sharding.shard`
the way the strategy does: inside ``enable_wrap`` with the strategy's FSDP settings. Each process
keeps an unsharded copy and compares greedy completions (the processes decode different numbers
of tokens) and the gradient of a log-prob sum, averaged over processes.
"""

import copy
import os
import sys

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from lightning.pytorch.strategies import FSDPStrategy
from torch.distributed.fsdp import FullyShardedDataParallel
from torch.distributed.fsdp.wrap import enable_wrap

from lit_cancel import RLModule
from lit_cancel.sharding import shard


def backward(module: RLModule, root, input_ids, attention_mask, prompt_length) -> None:
    module.completion_logprobs(root, input_ids, attention_mask, prompt_length)[0].sum().backward()


def flat_gradient(root) -> torch.Tensor:
    return torch.cat([p.grad.flatten() for p in root.parameters()]).clone()


def run(rank: int, out: str) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT="29541")
    dist.init_process_group("gloo", rank=rank, world_size=2)
    module = RLModule("embedded:tiny-adder", max_new_tokens=40 if rank == 0 else 8)
    plain = copy.deepcopy(module.policy)
    prompts = module.tokenizer(["123+456=", "999+101=", "505+505="], return_tensors="pt", padding=True)
    args = (prompts["input_ids"], prompts["attention_mask"])

    expected_texts = module.rollout(*args, greedy=True).texts
    sequences = module.rollout(*args, greedy=True)
    batch = (sequences.input_ids, sequences.attention_mask, sequences.prompt_length)
    backward(module, module.policy, *batch)
    # the processes decoded different lengths: FSDP's gradient is the mean of their gradients
    expected_gradient = flat_gradient(module.policy)
    dist.all_reduce(expected_gradient)
    expected_gradient /= 2

    with enable_wrap(wrapper_cls=FullyShardedDataParallel, device_id=torch.device("cpu"), use_orig_params=True):
        module.policy = shard(plain, FSDPStrategy())
    units = sum(isinstance(m, FullyShardedDataParallel) for m in module.policy.modules())
    texts = module.rollout(*args, greedy=True).texts
    backward(module, module.policy, *batch)
    with FullyShardedDataParallel.summon_full_params(module.policy, with_grads=True):
        sharded = flat_gradient(module.policy)
    if rank == 0:
        torch.save({"units": units, "texts": texts, "expected_texts": expected_texts,
                    "gradient": sharded, "expected_gradient": expected_gradient}, out)
    dist.destroy_process_group()


if __name__ == "__main__":
    mp.spawn(run, args=(sys.argv[1],), nprocs=2)
