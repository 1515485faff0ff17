"""The agent quickstart sharded with FSDP2 over 2 CPU processes: episodes end at different turns on each process, while
every forward pass of a sharded model is a collective that both processes must make."""

import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

CONFIG = Path(__file__).parents[2] / "configs" / "quickstart-agent.yaml"
LIT_CANCEL = shutil.which("lit-cancel") or str(Path(sys.executable).parent / "lit-cancel")
FSDP2 = [
    "--trainer.strategy=lightning.pytorch.strategies.ModelParallelStrategy", "--trainer.strategy.init_args.data_parallel_size=2",
    "--trainer.strategy.init_args.tensor_parallel_size=1", "--trainer.strategy.init_args.save_distributed_checkpoint=false",
    "--trainer.devices=2",
]


@pytest.mark.slow
def test_the_agent_quickstart_trains_and_validates_sharded_over_two_processes(tmp_path):
    result = subprocess.run(
        [LIT_CANCEL, "fit", "--config", str(CONFIG), *FSDP2, "--trainer.max_steps=2", "--trainer.val_check_interval=2",
         "--trainer.enable_progress_bar=false", f"--trainer.logger.init_args.save_dir={tmp_path}",
         "--data.init_args.prompts_per_round=4", "--data.init_args.group_size=4", "--data.init_args.task.init_args.val_size=8"],
        capture_output=True, text=True, timeout=900,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    (run,) = tmp_path.glob("*/version_0")
    events = EventAccumulator(str(run))
    events.Reload()
    turns = [event.value for event in events.Scalars("rollout/turns")]
    assert len(turns) == 2 and all(1 <= value <= 3 for value in turns)  # max_turns: 3
    assert len(events.Scalars("val/accuracy")) == 2  # before training and at step 2
    assert torch.load(run / "checkpoints" / "last.ckpt", weights_only=False)["global_step"] == 2
