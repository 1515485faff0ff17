"""A step's gradient does not depend on how its rollouts are split: one mini-batch, micro-batches, processes
(replicated or sharded)."""

import subprocess
import sys
from pathlib import Path

import pytest
import torch

SCRIPT = Path(__file__).parent / "workers" / "split_step.py"
OBJECTIVES = ["GRPO", "DrGRPO", "DAPO", "DFPOMin"]


def gradients(tmp_path, devices: int, accumulate: int, strategy: str = "auto", *options: str) -> dict[str, torch.Tensor]:
    out = tmp_path / f"grad-{devices}-{accumulate}-{strategy}.pt"
    subprocess.run(
        [sys.executable, str(SCRIPT), str(out), f"--devices={devices}", f"--strategy={strategy}",
         f"--accumulate={accumulate}", *options, "--objectives", *OBJECTIVES],
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


@pytest.mark.parametrize("accumulate", [1, 2])
def test_chunks_sent_back_during_the_step_give_the_whole_step_gradient(whole, tmp_path, accumulate):
    """Chunks of 16 tokens: the on-policy step sends all but its last chunk's gradient back inside the training step,
    before Lightning's backward of the returned loss (scaled as Lightning scales it under accumulation)."""
    split = gradients(tmp_path, 1, accumulate, "auto", "--max-tokens-per-chunk", "16")
    for name in OBJECTIVES:
        torch.testing.assert_close(split[name], whole[name], rtol=1e-4, atol=1e-7, msg=name)
