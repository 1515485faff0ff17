"""Two CPU processes over gloo, replicated (DDP) or sharded (FSDP2): the same training as one process."""

import subprocess
import sys
from pathlib import Path

import pytest
import torch

from lit_cancel import RLModule

SCRIPT = Path(__file__).parent / "split_step.py"
OBJECTIVES = ["GRPO", "DFPOMin"]


def train(tmp_path, devices: int, strategy: str) -> dict:
    out = tmp_path / f"{strategy}-{devices}.pt"
    subprocess.run(
        [sys.executable, str(SCRIPT), str(out), f"--devices={devices}", f"--strategy={strategy}", "--steps=3",
         "--kl-coef=0.05", "--objectives", *OBJECTIVES],
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


def test_fsdp_v1_wrapping_gathers_for_generation_and_gradients(tmp_path):
    """Lightning's FSDPStrategy needs a GPU; fsdp_wrap.py runs the same shard() call on 2 CPU processes."""
    out = tmp_path / "fsdp.pt"
    subprocess.run([sys.executable, str(Path(__file__).parent / "fsdp_wrap.py"), str(out)], check=True, capture_output=True, timeout=300)
    result = torch.load(out)
    assert result["units"] == 5  # 4 transformer blocks and the root
    assert result["texts"] == result["expected_texts"]
    assert result["expected_gradient"].abs().max() > 0
    assert torch.allclose(result["gradient"], result["expected_gradient"], rtol=1e-5, atol=1e-7)
