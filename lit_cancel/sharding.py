"""Sharding a model with FSDP2 (``fully_shard``), and running it while sharded.

Lightning's FSDP (v1) strategy, ``FSDPStrategy``, is refused (:func:`check_strategy`): its flat shards, one per
process, break the logged gradient norm, LoRA checkpoints and weight pushes to vLLM, which take FSDP2's whole
tensors, and Lightning refuses its gradient clipping by norm (docs/distributed.md).

FSDP gathers a unit's parameters in that unit's ``forward``. Log-probs use the decoder and the LM
head separately, ``generate`` runs its own loop, and the health callbacks make extra forward
passes: none of them is a single ``forward`` of the Hugging Face model. So the model sits inside a
:class:`ModelRoot` whose ``forward`` runs any function of it. Each transformer block is one sharded
unit and the root is another holding what lies outside the blocks (embeddings, final norm, LM head),
so every use of every parameter happens inside a forward that gathered it.
"""

import importlib
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

import torch
from lightning.pytorch.strategies import FSDPStrategy, ModelParallelStrategy, Strategy, StrategyRegistry
from torch import Tensor, nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import FSDPModule, MixedPrecisionPolicy, fully_shard
from torch.distributed.tensor import DTensor

from lit_cancel.float32_products import float32_products


class ModelRoot(nn.Module):
    """Holds a model and runs ``fn(model, *args, **kwargs)`` inside its own ``forward``.

    With ``float32_products`` set (by the module, when fitting or validating starts), ``fn`` runs inside
    :class:`~lit_cancel.float32_products.Float32Products`.

    Example::

        root = ModelRoot(model)
        logprobs, entropy = root(completion_logprobs, input_ids, attention_mask, prompt_length)
    """

    def __init__(self, model: nn.Module):
        super().__init__()
        self.model = model
        self.float32_products = False

    def forward(self, fn: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
        with float32_products(self.float32_products):
            return fn(self.model, *args, **kwargs)


def transformer_blocks(model: nn.Module) -> list[nn.Module]:
    """The modules Hugging Face names in ``_no_split_modules`` (e.g. ``Qwen2DecoderLayer``), in order."""
    names = set()
    for module in model.modules():
        names.update(getattr(module, "_no_split_modules", None) or [])
    blocks = [module for module in model.modules() if type(module).__name__ in names]
    if not blocks:
        raise ValueError(
            f"{type(model).__name__} declares no transformer block classes (_no_split_modules); "
            "cannot shard it block by block"
        )
    return blocks


def is_sharded(module: nn.Module) -> bool:
    return isinstance(module, FSDPModule)


def mixed_precision_policy(precision: str) -> MixedPrecisionPolicy:
    """FSDP2's dtypes under the trainer's ``precision``. Under ``bf16-mixed`` parameters are all-gathered, and used, in
    bfloat16 (half the bytes of float32 on every gather, and no cast per matmul) and gradients are reduce-scattered in
    float32; the sharded parameters, their gradients and the optimizer state stay float32. Any other precision gathers
    and reduces in the parameters' own dtype."""
    if precision == "bf16-mixed":
        return MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    return MixedPrecisionPolicy()


def fully_shard_model(root: ModelRoot, mesh: DeviceMesh, precision: str = "32-true") -> FSDPModule:
    """FSDP2: ``fully_shard`` every transformer block, then the root, over ``mesh``, with :func:`mixed_precision_policy`."""
    policy = mixed_precision_policy(precision)
    for block in transformer_blocks(root.model):
        fully_shard(block, mesh=mesh, mp_policy=policy)
    return fully_shard(root, mesh=mesh, mp_policy=policy)


def shards(strategy: Strategy) -> bool:
    """Whether :func:`shard` shards a model under ``strategy``."""
    return isinstance(strategy, ModelParallelStrategy)


def check_strategy(strategy: Any) -> None:
    """Raises ValueError, in one line naming ``trainer.strategy``, for Lightning's FSDP (v1) strategy, given as the
    config gives it (a registered name such as ``fsdp``, or a ``class_path``), as a class or as an instance."""
    if hasattr(strategy, "class_path"):
        module, _, name = strategy.class_path.rpartition(".")
        strategy = getattr(importlib.import_module(module), name)
    elif isinstance(strategy, str):
        strategy = StrategyRegistry[strategy]["strategy"] if strategy in StrategyRegistry else None
    cls = strategy if isinstance(strategy, type) else type(strategy)
    if issubclass(cls, FSDPStrategy):
        raise ValueError(
            f"trainer.strategy {cls.__name__} is Lightning's FSDP (v1), which lit_cancel does not support: shard with FSDP2, "
            "class_path: lightning.pytorch.strategies.ModelParallelStrategy with init_args data_parallel_size: the number of "
            "processes and tensor_parallel_size: 1 (as configs/qwen2.5-1.5b-gsm8k-fsdp.yaml does)"
        )


def shard(root: ModelRoot, strategy: Strategy, precision: str = "32-true") -> nn.Module:
    """Shards ``root`` block by block under ``ModelParallelStrategy`` (FSDP2); other strategies get it back unchanged,
    except ``FSDPStrategy``, which is refused (:func:`check_strategy`).

    Call it from ``configure_model`` with the trainer's ``precision``. Every block and then the root are
    ``fully_shard``-ed over the data-parallel mesh, in the dtypes of :func:`mixed_precision_policy`.
    """
    check_strategy(strategy)
    if is_sharded(root):
        return root
    if isinstance(strategy, ModelParallelStrategy):
        tensor_parallel = strategy.device_mesh["tensor_parallel"].size()
        if tensor_parallel > 1:
            raise ValueError(
                f"trainer.strategy ModelParallelStrategy: tensor_parallel_size is {tensor_parallel}; lit_cancel "
                "shards by data parallelism only: set tensor_parallel_size: 1 and data_parallel_size to the "
                "number of processes"
            )
        return fully_shard_model(root, strategy.device_mesh["data_parallel"], precision)
    return root


@contextmanager
def gathered(root: nn.Module) -> Iterator[None]:
    """Keeps an FSDP2 model's parameters gathered from its first forward inside the block to the block's end.

    ``generate`` calls the model once per new token. Without this, every call would all-gather
    every block again; with it each process gathers the whole model once (memory: the full
    parameters, as without sharding) and the decoding steps need no communication, so processes
    whose completions end early need not keep stepping with the others.
    """
    if not isinstance(root, FSDPModule):
        yield
        return
    root.set_reshard_after_forward(False)
    try:
        yield
    finally:
        for module in root.modules():
            if isinstance(module, FSDPModule):
                module.reshard()
        root.set_reshard_after_forward(True)
        # the root stays gathered between forward and backward, as fully_shard sets it up
        root.set_reshard_after_forward(False, recurse=False)


def total_norm(tensors: list[Tensor]) -> Tensor:
    """The 2-norm of ``tensors`` taken together; sharded ones (DTensor, under FSDP2) count whole, on every process.

    ``tensors`` may mix both: after a forward without backward (old log-probs, a health probe), the FSDP2 root keeps
    its parameters gathered as plain tensors while the blocks' are sharded again.
    """
    sharded = [t for t in tensors if isinstance(t, DTensor)]
    whole = [t for t in tensors if not isinstance(t, DTensor)]
    if not sharded:
        return torch.nn.utils.get_total_norm(whole)
    norm = torch.nn.utils.get_total_norm(sharded).full_tensor()
    return torch.linalg.vector_norm(torch.stack([norm, torch.nn.utils.get_total_norm(whole).to(norm)])) if whole else norm
