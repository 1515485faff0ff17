"""Two CPU processes over gloo, replicated (DDP) or sharded (FSDP2): the same training as one process; Lightning's FSDP (v1)
is refused."""

import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from lightning.pytorch.strategies import FSDPStrategy
from torch import nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import Shard, distribute_tensor

from lit_cancel import RLModule
from lit_cancel.sharding import ModelRoot, shard, total_norm

SCRIPT = Path(__file__).parent / "workers" / "split_step.py"
OBJECTIVES = ["GRPO", "DFPOMin"]


def train(tmp_path, devices: int, strategy: str, *options: str) -> dict:
    out = tmp_path / f"{strategy}-{devices}.pt"
    subprocess.run(
        [sys.executable, str(SCRIPT), str(out), f"--devices={devices}", f"--strategy={strategy}", "--steps=3",
         "--kl-coef=0.05", *options, "--objectives", *OBJECTIVES],
        check=True, capture_output=True, timeout=300,
    )
    return torch.load(out)


@pytest.fixture(scope="module")
def one_process(tmp_path_factory):
    return train(tmp_path_factory.mktemp("one"), devices=1, strategy="auto")


@pytest.mark.parametrize("strategy", ["ddp", "fsdp2"])
def test_two_processes_reach_the_parameters_of_one(one_process, tmp_path, strategy):
    """3 SGD steps (lr 0.1) on the same global batches, KL to a reference model (sharded too under FSDP2)."""
    initial = torch.cat([p.detach().flatten() for p in RLModule().policy.parameters()])
    two = train(tmp_path, devices=2, strategy=strategy)
    for name in OBJECTIVES:
        whole, split = one_process[name], two[name]
        assert torch.allclose(split["gradient"], whole["gradient"], rtol=1e-4, atol=1e-7), name
        assert (whole["parameters"] - initial).abs().max() > 5e-3, name  # training moved the parameters
        assert torch.allclose(split["parameters"], whole["parameters"], rtol=0, atol=2e-5), name
        # the process that decoded 40 tokens while the other stopped after 8 got the unsharded model's text
        assert split["greedy"] == whole["greedy"], name
        total = whole["local_parameters"]
        expected = total if strategy == "ddp" else total / 2
        assert abs(split["local_parameters"] - expected) <= 0.01 * total, name
        assert split["in_forward"] == {torch.float32}, name


def test_fsdp2_under_bf16_mixed_gathers_bfloat16_and_keeps_float32_shards_gradients_and_direction(one_process, tmp_path):
    two = train(tmp_path, 2, "fsdp2", "--precision=bf16-mixed")
    for name in OBJECTIVES:
        split, whole = two[name], one_process[name]
        assert split["in_forward"] == {torch.bfloat16}, name
        assert split["sharded"] == split["gradients"] == {torch.float32}, name
        # bfloat16 keeps 8 significant bits: the step's gradient is float32's up to rounding, not another direction
        cosine = torch.nn.functional.cosine_similarity(split["gradient"], whole["gradient"], dim=0)
        assert cosine > 0.99, (name, cosine)
        assert abs(split["gradient"].norm() / whole["gradient"].norm() - 1) < 0.05, name


def test_fsdp2_recomputing_uneven_chunks_reaches_the_gradient_and_parameters_of_one_process(one_process, tmp_path):
    """Activation checkpointing by chunk (and block within) under FSDP2: each backward recomputes its chunk's decoder pass
    (gathering the shards again), with budgets that give the two processes different numbers of chunks."""
    two = train(tmp_path, 2, "fsdp2", "--activation-checkpointing=blocks+chunks", "--max-tokens-per-chunk", "64", "24")
    for name in OBJECTIVES:
        split, whole = two[name], one_process[name]
        assert torch.allclose(split["gradient"], whole["gradient"], rtol=1e-4, atol=1e-7), name
        assert torch.allclose(split["parameters"], whole["parameters"], rtol=0, atol=2e-5), name


def test_lightnings_fsdp_v1_strategy_is_refused_where_the_module_is_sharded():
    """Without the CLI (a Trainer built in Python), configure_model refuses it in the same one line."""
    with pytest.raises(ValueError, match=r"^trainer.strategy FSDPStrategy is Lightning's FSDP \(v1\), which lit_cancel does "
                                         r"not support: shard with FSDP2, class_path: lightning.pytorch.strategies.ModelParallelStrategy"):
        shard(ModelRoot(nn.Linear(2, 2)), FSDPStrategy())


def test_total_norm_counts_sharded_and_whole_tensors_together():
    """The FSDP2 root's parameters stay gathered (plain tensors) after a forward without backward, the blocks' sharded."""
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        sharded = distribute_tensor(torch.tensor([3.0, 0.0]), init_device_mesh("cpu", (1,)), [Shard(0)])
        whole = [torch.tensor([4.0, 0.0]), torch.tensor([0.0, 12.0])]  # one value would pass as a replicated DTensor
        assert float(total_norm([sharded, *whole])) == pytest.approx(13.0)
        assert float(total_norm(whole)) == pytest.approx(float(torch.tensor([4.0, 12.0]).norm()))
    finally:
        dist.destroy_process_group()
