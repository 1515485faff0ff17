from pathlib import Path

import pytest
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

from lit_cancel.run.cli import run_cli

QUICKSTART = Path(__file__).parents[1] / "configs" / "quickstart.yaml"


@pytest.mark.slow
def test_quickstart_raises_held_out_accuracy_by_ten_points(tmp_path):
    cli = run_cli(["fit", "--config", str(QUICKSTART), f"--trainer.logger.init_args.save_dir={tmp_path}",
                   "--trainer.enable_progress_bar=false"])
    events = EventAccumulator(cli.trainer.logger.log_dir)
    events.Reload()
    accuracy = [e.value for e in events.Scalars("val/accuracy")]
    assert len(accuracy) == 5  # before training, then every 25 of the 100 steps
    assert accuracy[-1] - accuracy[0] >= 0.10, accuracy


@pytest.mark.slow
def test_the_agent_quickstart_raises_held_out_success_by_ten_points_with_the_health_callbacks_on(tmp_path):
    config = QUICKSTART.with_name("quickstart-agent.yaml")
    cli = run_cli(["fit", "--config", str(config), f"--trainer.logger.init_args.save_dir={tmp_path}",
                   "--trainer.enable_progress_bar=false"])
    monitors = {type(callback).__name__ for callback in cli.trainer.callbacks}
    assert {"EntropyCollapseMonitor", "LearningTaxMonitor", "TokenFlipMonitor", "RunDoctor"} <= monitors
    events = EventAccumulator(cli.trainer.logger.log_dir)
    events.Reload()
    success = [e.value for e in events.Scalars("val/accuracy")]
    assert len(success) == 4  # before training, then every 20 of the 60 steps
    assert success[-1] - success[0] >= 0.10, success
    assert events.Scalars("rollout/tool_calls")[-1].value > events.Scalars("rollout/tool_calls")[0].value


@pytest.mark.slow
def test_the_agent_program_example_raises_held_out_success_by_ten_points_in_twenty_steps(tmp_path):
    """configs/quickstart-agent-program.yaml: the openai-SDK program of examples/agent_program through the endpoint."""
    config = QUICKSTART.with_name("quickstart-agent-program.yaml")
    cli = run_cli(["fit", "--config", str(config), f"--trainer.logger.init_args.save_dir={tmp_path}",
                   "--trainer.enable_progress_bar=false", "--trainer.max_steps=20",
                   "--data.init_args.task.init_args.task.init_args.val_size=100"])
    events = EventAccumulator(cli.trainer.logger.log_dir)
    events.Reload()
    success = [e.value for e in events.Scalars("val/accuracy")]
    assert len(success) == 2  # before training and after the 20th step
    assert success[-1] - success[0] >= 0.10, success
    assert events.Scalars("rollout/tool_calls")[-1].value > 0
    assert all(e.value == 0 for e in events.Scalars("rollout/history_rewrites"))
    assert all(e.value == 0 for e in events.Scalars("rollout/unauthorized_requests"))
