"""A step's gradient does not depend on how its rollouts are split: one mini-batch, micro-batches, processes
(replicated or sharded)."""

import subprocess
import sys
from pathlib import Path

import pytest
import torch

SCRIPT = Path(__file__).parent / "workers" / "split_step.py"
OBJECTIVES = ["GRPO", "DrGRPO", "DAPO", "DFPOMin"]


def gradients(tmp_path, devices: int, accumulate: int, strategy: str = "auto") -> dict[str, torch.Tensor]:
    out = tmp_path / f"grad-{devices}-{accumulate}-{strategy}.pt"
    subprocess.run(
        [sys.executable, str(SCRIPT), str(out), f"--devices={devices}", f"--strategy={strategy}",
         f"--accumulate={accumulate}", "--objectives", *OBJECTIVES],
        check=True, capture_output=True, timeout=300,
    )
    return {name: result["gradient"] for name, result in torch.load(out).items()}


@pytest.fixture(scope="module")
def whole(tmp_path_factory):
    return gradients(tmp_path_factory.mktemp("whole"), devices=1, accumulate=1)


@pytest.mark.parametrize(
    ("devices", "accumulate", "strategy"), [(1, 2, "auto"), (1, 4, "auto"), (2, 1, "ddp"), (2, 2, "ddp"), (2, 2, "fsdp2")]
)
def test_step_gradient_is_independent_of_the_split(whole, tmp_path, devices, accumulate, strategy):
    split = gradients(tmp_path, devices, accumulate, strategy)
    for name in OBJECTIVES:
        assert whole[name].abs().sum() > 0
        assert torch.allclose(split[name], whole[name], rtol=1e-4, atol=1e-7), name
