"""StepProgressBar: steps and reward on a tiny RL run, outside a terminal (as in CI)."""

import io
import re
import sys
from functools import partial
from pathlib import Path
from types import SimpleNamespace

import lightning as L
import pytest
import rich
import torch
import yaml
from lightning.pytorch import LightningDataModule, LightningModule
from lit_cancel.callbacks import RolloutSamplesLogger
from rich.console import Console

from lit_cancel import AdditionTask, RLModule, RolloutDataModule
from lit_cancel.run.cli import LitCancelCLI
from lit_cancel.run.progress import StepProgressBar

CONFIGS = Path(__file__).parents[2] / "configs"
CLI_DOC = Path(__file__).parents[2] / "docs" / "cli.md"

TASK = AdditionTask(num_digits=3, train_size=64, val_size=4, seed=0)


class RecordBar(L.Callback):
    """After each training batch: the step, the batch's rewards, and what the bar shows."""

    def __init__(self, bar: StepProgressBar):
        self.bar, self.rows, self.validations, self.screens = bar, [], [], []

    def on_validation_end(self, trainer, pl_module):
        self.validations.append(float(trainer.callback_metrics["val/accuracy"]))

    def on_validation_batch_end(self, trainer, pl_module, outputs, batch, batch_idx, dataloader_idx=0):
        self.screens.append(self.screen())

    def screen(self) -> list[str]:
        """The bar's rows as a wide terminal shows them."""
        console = Console(width=200, file=io.StringIO(), record=True)
        console.print(self.bar.progress.make_tasks_table(self.bar.progress.tasks))
        return [line.rstrip() for line in console.export_text().splitlines()]

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        task = self.bar.train_progress_bar
        self.rows.append({
            "step": trainer.global_step, "rewards": batch.rewards.clone(), "description": task.description,
            "completed": task.completed, "total": task.total, "metrics": self.bar.get_metrics(trainer, pl_module),
        })
        self.screens.append(self.screen())


class StopAfter(L.Callback):
    def __init__(self, steps: int):
        self.steps = steps

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        trainer.should_stop = trainer.global_step >= self.steps


def fit(bar: StepProgressBar, steps: int, accumulate: int = 1, callbacks=(), **trainer_options):
    record = RecordBar(bar)
    trainer = L.Trainer(
        max_steps=steps, accelerator="cpu", devices=1, logger=False, enable_checkpointing=False, enable_model_summary=False,
        accumulate_grad_batches=accumulate, callbacks=[bar, record, *callbacks], **trainer_options,
    )
    torch.manual_seed(0)
    module = RLModule("embedded:tiny-adder", max_new_tokens=40, val_samples=1, optimizer=partial(torch.optim.AdamW, lr=1e-4))
    trainer.fit(module, datamodule=RolloutDataModule(TASK, prompts_per_round=4, group_size=4, val_batch_size=4))
    return trainer, record


def test_the_bar_counts_steps_and_shows_the_round_reward_and_accuracy_outside_a_terminal():
    assert not rich.get_console().is_terminal  # pytest captures the output: the same as a CI log
    bar = StepProgressBar()
    trainer, record = fit(bar, steps=4, val_check_interval=2, check_val_every_n_epoch=None, num_sanity_val_steps=0)
    rows = record.rows
    assert trainer.progress_bar_callback is bar and trainer.global_step == 4
    assert [row["description"] for row in rows] == ["step 1/4", "step 2/4", "step 3/4", "step 4/4"]
    assert [(row["completed"], row["total"]) for row in rows] == [(1, 4), (2, 4), (3, 4), (4, 4)]
    for row in rows:
        # one round per step: the round's mean reward and accuracy are the batch's (its rewards are 1 for a correct sum, else 0)
        assert row["metrics"]["reward"] == pytest.approx(float(row["rewards"].mean()))
        assert row["metrics"]["acc"] == pytest.approx(float((row["rewards"] == 1).float().mean()))
    assert "val_acc" not in rows[1]["metrics"]  # validation runs after step 2's batch
    assert rows[2]["metrics"]["val_acc"] == rows[3]["metrics"]["val_acc"] == pytest.approx(record.validations[0])


def test_the_bar_fits_80_columns_and_says_when_validation_is_running():
    bar = StepProgressBar()
    # out of 100 steps (the width of a real run's count), stopped after 3
    record = fit(bar, steps=100, val_check_interval=2, check_val_every_n_epoch=None, num_sanity_val_steps=0, callbacks=[StopAfter(3)])[1]
    assert max(len(line) for screen in record.screens for line in screen) <= 80, record.screens
    during_validation = [screen[0] for screen in record.screens if len(screen) == 2]
    assert during_validation and all(line.endswith("val_acc: running") for line in during_validation)
    assert isinstance(record.rows[2]["metrics"]["val_acc"], float)  # the step after validation shows its value


def test_accuracy_is_shown_beside_the_reward():
    bar = StepProgressBar()
    trainer = SimpleNamespace(
        callback_metrics={"rollout/reward_mean": torch.tensor(0.25), "rollout/accuracy": torch.tensor(0.5)},
        progress_bar_metrics={}, loggers=[], validating=False, state=SimpleNamespace(fn="fit"),
    )
    assert bar.get_metrics(trainer, None) == {"reward": 0.25, "acc": 0.5}
    trainer.callback_metrics["rollout/accuracy"] = torch.tensor(0.25)
    assert bar.get_metrics(trainer, None) == {"reward": 0.25, "acc": 0.25}


def test_with_accumulation_the_bar_counts_optimizer_steps_not_micro_batches():
    bar = StepProgressBar(metrics={"r": "rollout/reward_mean"})
    rows = fit(bar, steps=2, accumulate=2, limit_val_batches=0)[1].rows
    assert [(row["step"], row["description"], row["completed"]) for row in rows] == [
        (0, "step 0/2", 0), (1, "step 1/2", 1), (1, "step 1/2", 1), (2, "step 2/2", 2),
    ]
    # a round's rollout metrics are logged with its first micro-batch and shown until the next round
    assert set(rows[1]["metrics"]) == {"r"}
    assert rows[1]["metrics"]["r"] == rows[0]["metrics"]["r"]


def test_without_an_end_the_bar_shows_the_step_alone():
    bar = StepProgressBar()
    trainer = L.Trainer(max_steps=-1, max_epochs=-1, logger=False, callbacks=[bar])
    bar.setup(trainer, RLModule("embedded:tiny-adder"), "fit")
    assert bar.total_train_batches == float("inf")
    assert bar.step_description(trainer) == "step 0"


def test_bad_metrics_fail_at_construction():
    with pytest.raises(ValueError, match="StepProgressBar: metrics"):
        StepProgressBar(metrics={"reward": ""})


@pytest.mark.parametrize("enabled", [True, False])
def test_the_shipped_config_shows_it_and_enable_progress_bar_false_drops_it(tmp_path, enabled):
    args = ["--config", str(CONFIGS / "quickstart.yaml"), f"--trainer.enable_progress_bar={str(enabled).lower()}",
            f"--trainer.logger.init_args.save_dir={tmp_path}"]
    cli = LitCancelCLI(LightningModule, LightningDataModule, subclass_mode_model=True, subclass_mode_data=True, run=False, args=args)
    assert isinstance(cli.trainer.progress_bar_callback, StepProgressBar) if enabled else cli.trainer.progress_bar_callback is None
    assert any(isinstance(c, RolloutSamplesLogger) for c in cli.trainer.callbacks)  # the rest of the list stays


def progress_lines(text: str, total: int) -> dict[int, str]:
    """The progress lines in ``text``, by step, each without its timing (which is the machine's)."""
    lines = {}
    for line in text.splitlines():
        found = re.fullmatch(rf"step (\d+)/{total}  (.*)  \d+(?:\.\d+)?(?:e-\d+)? s/step(  (?:\d+:)?\d+:\d\d left)?", line)
        if found:
            step = int(found.group(1))
            assert step not in lines, f"step {step} printed twice"
            assert bool(found.group(3)) == (step < total), line  # the time left, until the last step
            lines[step] = found.group(2)
    return lines


def test_outside_a_terminal_it_prints_what_the_bar_shows_every_n_steps_and_at_the_last(capsys):
    assert not rich.get_console().is_terminal  # pytest captures the output: the same as a log file
    bar = StepProgressBar(print_every_n_steps=2)
    record = fit(bar, steps=5, val_check_interval=2, check_val_every_n_epoch=None, num_sanity_val_steps=0)[1]
    out = capsys.readouterr().out
    lines = progress_lines(out, total=5)
    assert sorted(lines) == [2, 4, 5] and out.count(" s/step") == 3
    shown = {row["step"]: "  ".join(f"{label} {value:.3f}" for label, value in row["metrics"].items()) for row in record.rows}
    assert lines == {2: shown[2], 4: shown[4], 5: shown[5]}
    assert "val_acc" not in lines[2] and "val_acc" in lines[4]  # the first validation runs after step 2's line


def test_with_0_steps_between_lines_it_prints_none(capsys):
    fit(StepProgressBar(print_every_n_steps=0), steps=2, limit_val_batches=0)
    assert "s/step" not in capsys.readouterr().out


def test_on_a_terminal_the_bar_is_drawn_and_no_line_is_printed(monkeypatch):
    class Terminal(io.StringIO):
        def isatty(self):
            return True

    terminal = Terminal()
    try:
        with monkeypatch.context() as patch:
            for name in ("FORCE_COLOR", "TTY_COMPATIBLE", "NO_COLOR"):
                patch.delenv(name, raising=False)
            patch.setenv("TERM", "xterm")
            patch.setattr(sys, "stdout", terminal)
            fit(StepProgressBar(print_every_n_steps=1), steps=3, limit_val_batches=0)
    finally:
        rich.reconfigure()  # the bar set rich's console up for this terminal
    drawn = terminal.getvalue()
    assert "\x1b[" in drawn and "step 3/3" in drawn  # rich drew the bar live
    assert "s/step" not in drawn


def test_bad_print_every_n_steps_fails_at_construction():
    for bad in (-1, 2.5, True):
        with pytest.raises(ValueError, match="StepProgressBar: print_every_n_steps must be a whole number >= 0"):
            StepProgressBar(print_every_n_steps=bad)


def test_docs_cli_md_shows_the_lines_as_printed_and_its_progress_bar_entry_sets_them_apart(tmp_path):
    """The documented lines have the printed form; the documented ``trainer.callbacks`` entry, in place of the
    quickstart's, configures the bar."""
    section = CLI_DOC.read_text().split("### Progress in a log file", 1)[1]
    assert sorted(progress_lines(re.search(r"```\n(.*?)```", section, re.S).group(1), total=30)) == [10, 20, 30]
    entry = yaml.safe_load(re.search(r"```yaml\n(.*?)```", section, re.S).group(1))[0]
    config = yaml.safe_load((CONFIGS / "quickstart.yaml").read_text())
    callbacks = config["trainer"]["callbacks"]
    callbacks[[item["class_path"] for item in callbacks].index(entry["class_path"])] = entry
    (tmp_path / "config.yaml").write_text(yaml.safe_dump(config))
    args = ["--config", str(tmp_path / "config.yaml"), f"--trainer.logger.init_args.save_dir={tmp_path}"]
    cli = LitCancelCLI(LightningModule, LightningDataModule, subclass_mode_model=True, subclass_mode_data=True, run=False, args=args)
    assert cli.trainer.progress_bar_callback.print_every_n_steps == entry["init_args"]["print_every_n_steps"] != 10
