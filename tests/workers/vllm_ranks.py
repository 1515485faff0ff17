"""Two processes, one ``VLLMEngine`` each, that sample unevenly: rank 0 three times, 8 completions of up to 40 tokens
each time; rank 1 once, one completion of up to 4 tokens. Each saves its completion lengths and its engine's parallel
sizes (run by tests/engines/test_vllm_engine.py):

    python -m torch.distributed.run --standalone --nproc_per_node=2 tests/workers/vllm_ranks.py OUT_PREFIX
"""

import json
import sys

import torch
import torch.distributed as dist

from lit_cancel import RLModule, VLLMEngine
from lit_cancel.rounds.sample import encode_prompts

WORK = {0: (3, ["12+34=", "105+207=", "999+1=", "450+450="], 2, 40), 1: (1, ["7+8="], 1, 4)}


def main(prefix: str) -> None:
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    calls, texts, samples, max_new_tokens = WORK[rank]
    module = RLModule("embedded:tiny-adder", engine=VLLMEngine(kv_cache_memory_bytes=32 * 2**20), max_new_tokens=max_new_tokens)
    prompts = encode_prompts(module.tokenizer, [{"prompt": text} for text in texts])
    torch.manual_seed(rank)
    lengths = []
    for _ in range(calls):
        generation = module.rollout(prompts["input_ids"], prompts["attention_mask"], num_samples=samples)
        lengths.append(generation.completion_mask.sum(1).tolist())
    parallel = module.engine.llm.llm_engine.vllm_config.parallel_config
    sizes = {"data_parallel_size": parallel.data_parallel_size, "world_size": parallel.world_size}
    with open(f"{prefix}-rank{rank}.json", "w") as file:
        json.dump({"lengths": lengths, **sizes}, file)
    dist.barrier()


if __name__ == "__main__":
    main(sys.argv[1])
