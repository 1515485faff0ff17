"""A LoRA policy's adapters as vLLM loads them: which adapters can go to vLLM alone, and the folder one version is written to.

vLLM keeps the base weights and applies an adapter per request (``LoRARequest`` in the trainer's process, the request's
``model`` naming a loaded adapter on a server), so a LoRA run pushes its base weights once and then only the adapters:
for a 7 B model with rank-16 adapters on every linear layer of its blocks, some 80 MB a step instead of 15 GB.
"""

import json
import os
import shutil
import tempfile

import torch
from torch import nn
from torch.distributed.tensor import DTensor

# the ranks vLLM's engines accept as max_lora_rank (vllm/config/lora.py, MaxLoRARanks; vLLM 0.32)
VLLM_LORA_RANKS = (1, 8, 16, 32, 64, 128, 256, 320, 512)
# peft settings vLLM cannot load as an adapter (PEFTHelper._validate_features, vllm/lora/peft_helper.py; vLLM 0.32), each
# with the value that means "not used"
_UNSUPPORTED = {
    "use_dora": False, "modules_to_save": None, "bias": "none", "lora_bias": False, "layer_replication": None,
    "target_parameters": None, "trainable_token_indices": None, "alora_invocation_tokens": None, "use_qalora": False,
}


def adapter_config(model: nn.Module):
    """The peft ``LoraConfig`` of ``model``'s active adapter; None for a model without adapters."""
    configs = getattr(model, "peft_config", None)
    return configs[model.active_adapter] if configs else None


def adapter_refusal(model: nn.Module) -> str | None:
    """Why vLLM cannot take ``model``'s adapters as an adapter, in words for a user (None: it can): adapters on a layer
    that is not a linear layer of the blocks (embeddings, ``lm_head``), DoRA, ``modules_to_save`` and the other peft
    features vLLM does not load, or a rank above vLLM's largest."""
    config = adapter_config(model)
    used = [
        f"{name}={getattr(config, name)!r}" for name, unused in _UNSUPPORTED.items()
        if getattr(config, name, unused) not in (unused, [], {})
    ]
    if used:
        return f"vLLM does not load adapters with {', '.join(used)}"
    from peft.tuners.lora import LoraLayer

    for name, module in model.named_modules():
        if isinstance(module, LoraLayer) and (not isinstance(module.get_base_layer(), nn.Linear) or name.endswith("lm_head")):
            return f"vLLM does not take an adapter on {name.removeprefix('base_model.model.')} (only on the blocks' linear layers)"
    rank = max_rank(config)
    if rank > VLLM_LORA_RANKS[-1]:
        return f"vLLM takes adapters of rank {VLLM_LORA_RANKS[-1]} at most, these have rank {rank}"
    return None


def max_rank(config) -> int:
    """The largest rank among ``config``'s adapters (``rank_pattern`` included)."""
    return max([config.r, *(config.rank_pattern or {}).values()])


def vllm_max_lora_rank(config) -> int:
    """vLLM's ``max_lora_rank`` for adapters of ``config``: the smallest rank vLLM accepts that holds them."""
    return next(rank for rank in VLLM_LORA_RANKS if rank >= max_rank(config))


def write_adapter(model: nn.Module, folder: str, dtype: torch.dtype, write: bool = True) -> int:
    """Writes the active adapter of ``model`` to ``folder`` as peft saves it (``adapter_config.json`` and
    ``adapter_model.safetensors``, whole or not at all: written aside, then renamed), in ``dtype``; returns the bytes of
    its tensors. Sharded (FSDP2) adapters are gathered one at a time, a collective every process takes part in;
    ``write`` False: this process gathers and writes nothing (not the one that writes)."""
    from peft.utils import get_peft_model_state_dict
    from safetensors.torch import save_file

    tensors = {}
    for name, tensor in get_peft_model_state_dict(model).items():
        tensor = tensor.detach().to(dtype)
        if isinstance(tensor, DTensor):
            tensor = tensor.full_tensor()
        if write:
            tensors[name] = tensor.to("cpu").contiguous()
    if not write:
        return 0
    partial = f"{folder}.partial"
    os.makedirs(partial, exist_ok=True)
    save_file(tensors, os.path.join(partial, "adapter_model.safetensors"))
    with open(os.path.join(partial, "adapter_config.json"), "w") as file:
        json.dump(adapter_config(model).to_dict(), file, default=sorted)  # target_modules may be a set
    os.replace(partial, folder)
    return sum(tensor.numel() * tensor.itemsize for tensor in tensors.values())


def adapters_to_push(model: nn.Module, push_adapters: bool, option: str):
    """The ``LoraConfig`` of the adapters an engine pushes apart from the base weights; None where it pushes the weights
    merged: the policy has no adapters, ``push_adapters`` is False, or vLLM cannot take them as an adapter (said in one
    line naming ``option``)."""
    from lightning.pytorch.utilities import rank_zero_info

    config = adapter_config(model)
    if config is None or not push_adapters:
        return None
    refusal = adapter_refusal(model)
    if refusal is not None:
        rank_zero_info(f"{option}: {refusal}, so each push merges the adapters and sends the whole model")
        return None
    return config


class ColocatedAdapter:
    """The adapter version a vLLM engine in the trainer's process samples with: each push is written to a folder of its own
    (``LoRARequest`` reads adapters from files), added to the engine, and replaces the one before it, which is removed
    from the engine and from disk."""

    def __init__(self):
        self.folder = tempfile.TemporaryDirectory(prefix="lit-cancel-adapter-")
        self.request = None
        self.pushes = 0

    def push(self, llm, model: nn.Module, dtype: torch.dtype) -> int:
        """Pushes ``model``'s adapter to the engine ``llm`` as a new version; returns the bytes of its tensors."""
        from vllm.lora.request import LoRARequest

        self.pushes += 1
        path = os.path.join(self.folder.name, f"v{self.pushes}")
        size = write_adapter(model, path, dtype)
        previous, self.request = self.request, LoRARequest(f"v{self.pushes}", self.pushes, path)
        llm.llm_engine.add_lora(self.request)
        if previous is not None:
            llm.llm_engine.remove_lora(previous.lora_int_id)
            shutil.rmtree(previous.lora_path, ignore_errors=True)
        return size


def adapter_server_args(config, keep: int) -> list[str]:
    """The arguments of a vLLM server that loads adapters of ``config`` at run time, ``keep`` versions at once (and one
    more in its host memory, so that none it still serves is dropped as a new one loads)."""
    return ["--enable-lora", "--max-lora-rank", str(vllm_max_lora_rank(config)), "--max-loras", str(keep),
            "--max-cpu-loras", str(keep + 1)]
