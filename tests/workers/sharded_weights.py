"""The merged weights of a LoRA model sharded with FSDP2 over two CPU processes (run by test_merged_weights.py).

    python -m torch.distributed.run --standalone --nproc-per-node 2 tests/workers/sharded_weights.py MODEL_FOLDER OUT

Each process builds the same LoRA model, shards it block by block and iterates ``merged_weights``, in float32 and then
in bfloat16, dropping each weight once it has a copy; at each of ``DTensor.full_tensor``'s gathers it records the dtype
gathered and counts the tensors gathered before that are still alive. Process ``r`` saves, for each dtype, the weights,
the gathered dtypes and the counts in ``OUT.r``.
"""

import sys
import weakref

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor
from transformers import AutoModelForCausalLM

from lit_cancel.engines.vllm_common import merged_weights
from lit_cancel.lora import LoRA
from lit_cancel.sharding import ModelRoot, fully_shard_model


def lora_model(folder: str) -> torch.nn.Module:
    """The model in ``folder`` with rank-2 adapters, the same at every call; their ``B`` factors are drawn at random (peft
    starts them at zero, which would make every merged weight its base weight)."""
    torch.manual_seed(0)  # peft draws the A factors from torch's generator
    model = LoRA(rank=2, target_modules=["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj"]).apply(
        AutoModelForCausalLM.from_pretrained(folder)
    )
    generator = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for name, parameter in model.named_parameters():
            if "lora_B" in name:
                parameter.copy_(torch.randn(parameter.shape, generator=generator))
    return model


def recorded_push(model: torch.nn.Module, dtype: torch.dtype) -> dict:
    """``merged_weights(model, dtype)`` copied weight by weight, with the dtype of each gather and the number of tensors
    gathered before it that were still alive at it."""
    gathered, gathered_dtypes, alive_at_gather = [], [], []
    full_tensor = DTensor.full_tensor

    def counted_full_tensor(self, **kwargs):
        gathered_dtypes.append(self.dtype)
        alive_at_gather.append(sum(ref() is not None for ref in gathered))
        tensor = full_tensor(self, **kwargs)
        gathered.append(weakref.ref(tensor))
        return tensor

    DTensor.full_tensor = counted_full_tensor
    try:
        weights = {}
        for name, tensor in merged_weights(model, dtype):
            weights[name] = tensor.clone()  # a copy the count does not follow; the weight itself is dropped, as vLLM does
            del tensor
    finally:
        DTensor.full_tensor = full_tensor
    return {"weights": weights, "gathered_dtypes": gathered_dtypes, "alive_at_gather": alive_at_gather}


def main(folder: str, out: str) -> None:
    dist.init_process_group("gloo")
    root = ModelRoot(lora_model(folder))
    fully_shard_model(root, init_device_mesh("cpu", (dist.get_world_size(),)))
    pushes = {str(dtype): recorded_push(root.model, dtype) for dtype in (torch.float32, torch.bfloat16)}
    torch.save(pushes, f"{out}.{dist.get_rank()}")
    dist.destroy_process_group()


if __name__ == "__main__":
    main(*sys.argv[1:])
