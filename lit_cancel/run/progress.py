"""A rich progress bar that counts optimizer steps and shows the reward, for runs with one endless epoch."""

import math
import time
from typing import Any

import lightning.pytorch as pl
from lightning.pytorch.callbacks import RichProgressBar
from lightning.pytorch.callbacks.progress.rich_progress import (
    BatchesProcessedColumn,
    CustomBarColumn,
    CustomTimeColumn,
    ProcessingSpeedColumn,
    RichProgressBarTheme,
)
from rich.progress import TimeRemainingColumn
from rich.text import Text
from typing_extensions import override

DEFAULT_METRICS = {"reward": "rollout/reward_mean", "acc": "rollout/accuracy", "val_acc": "val/accuracy"}
# characters of the bar itself
BAR_WIDTH = 12


class StepProgressBar(RichProgressBar):
    r"""Lightning's :class:`~lightning.pytorch.callbacks.RichProgressBar`, counting optimizer steps instead of epochs.

    An RL run's rollouts are one endless epoch, so Lightning's bar reads ``Epoch 0/-2`` and counts
    batches without an end. This bar's training row reads ``step 37/100``: the optimizer steps
    done (``trainer.global_step``, so a resumed run continues its count) out of the steps the
    run will make (``max_steps``, or what ``max_epochs`` amounts to), and after it the latest
    values of the logged metrics in ``metrics``, then anything logged with ``prog_bar=True``.
    While validation runs within fit, the held-out metrics (``val/...``, ``val_acc``) read
    ``running``. Validation rows are Lightning's. The columns (description, a short bar, the time
    remaining, the metrics) fit an 80-column terminal with the default metrics.

    Outside a terminal (output to a file, a CI log), where rich does not draw the bar, it prints
    one line every ``print_every_n_steps`` optimizer steps and at the run's last step, with the
    numbers the bar shows, the time a step took since the previous line and the time left at
    that pace::

        step 20/30  reward 0.617  acc 0.617  86.7 s/step  14:27 left

    With ``trainer.enable_progress_bar: false`` the ``lit-cancel`` command drops this callback
    from the configured callbacks (Lightning refuses a progress bar callback otherwise), and
    neither the bar nor the lines are shown.

    Args:
        metrics: ``{label: logged metric name}`` to show, in order; a metric not logged yet is
            left out. Defaults to the round's mean reward and accuracy and the held-out accuracy.
        refresh_rate: redraws per second; 0 disables the bar.
        leave: keep each epoch's finished bar on screen.
        theme: rich styles of the bar's parts.
        console_kwargs: arguments of rich's ``Console``.
        print_every_n_steps: outside a terminal, print a line every this many optimizer steps
            (and at the last); 0 prints none.

    Example::

        trainer = Trainer(max_steps=100, callbacks=[StepProgressBar(metrics={"reward": "rollout/reward_mean"})])
    """

    def __init__(
        self,
        metrics: dict[str, str] | None = None,
        refresh_rate: int = 10,
        leave: bool = False,
        theme: RichProgressBarTheme | None = None,
        console_kwargs: dict[str, Any] | None = None,
        print_every_n_steps: int = 10,
    ) -> None:
        super().__init__(refresh_rate=refresh_rate, leave=leave, theme=theme or RichProgressBarTheme(), console_kwargs=console_kwargs)
        self.metrics = dict(DEFAULT_METRICS if metrics is None else metrics)
        if not all(isinstance(label, str) and isinstance(name, str) and name for label, name in self.metrics.items()):
            raise ValueError(f"StepProgressBar: metrics must map labels to logged metric names, got {metrics!r}")
        if isinstance(print_every_n_steps, bool) or not isinstance(print_every_n_steps, int) or print_every_n_steps < 0:
            raise ValueError(
                f"StepProgressBar: print_every_n_steps must be a whole number >= 0 (0 prints no lines), got {print_every_n_steps!r}"
            )
        self.print_every_n_steps = print_every_n_steps
        self._prints_lines = False
        # the step and time of the last printed line (of the start of training before the first)
        self._last_line: tuple[int, float] = (0, 0.0)

    @property
    @override
    def total_train_batches(self) -> int | float:
        """The optimizer steps the run will make (the training row counts steps); ``inf`` when it has no end."""
        total = self.trainer.estimated_stepping_batches
        return total if total >= 0 else math.inf

    def step_description(self, trainer: "pl.Trainer") -> str:
        """``step N/total`` (``step N`` when the run has no end)."""
        total = self.total_train_batches
        return f"step {trainer.global_step}" + (f"/{total}" if math.isfinite(total) else "")

    @override
    def configure_columns(self, trainer: "pl.Trainer") -> list:
        # the training row says its count in its description; the validation rows keep their batch count.
        # A short bar and the time remaining alone (no elapsed time, no speed) leave the metrics room in 80 columns.
        columns = []
        for column in super().configure_columns(trainer):
            if isinstance(column, BatchesProcessedColumn):
                column = _EvaluationBatchesColumn(self, style=self.theme.batch_progress)
            elif isinstance(column, CustomBarColumn):
                column.bar_width = BAR_WIDTH
            elif isinstance(column, CustomTimeColumn):
                column = TimeRemainingColumn(compact=True)
            elif isinstance(column, ProcessingSpeedColumn):
                continue
            columns.append(column)
        return columns

    @override
    def on_train_start(self, trainer: "pl.Trainer", pl_module: "pl.LightningModule") -> None:
        super().on_train_start(trainer, pl_module)
        console = self._console
        # rich draws the bar live on a terminal and on Jupyter; elsewhere only once, as training ends
        draws_live = console is not None and (console.is_jupyter or (console.is_terminal and not console.is_dumb_terminal))
        self._prints_lines = self.is_enabled and console is not None and not draws_live and self.print_every_n_steps > 0
        self._last_line = (trainer.global_step, time.monotonic())

    @override
    def on_train_end(self, trainer: "pl.Trainer", pl_module: "pl.LightningModule") -> None:
        # the last step, wherever the run stopped, unless its line was printed already
        if self._prints_lines and trainer.global_step > self._last_line[0]:
            self._print_line(trainer, pl_module)

    def _print_line(self, trainer: "pl.Trainer", pl_module: "pl.LightningModule") -> None:
        step, now = trainer.global_step, time.monotonic()
        seconds_per_step = (now - self._last_line[1]) / (step - self._last_line[0])
        self._last_line = (step, now)
        self._console.out(self.progress_line(trainer, pl_module, seconds_per_step), highlight=False)

    def progress_line(self, trainer: "pl.Trainer", pl_module: "pl.LightningModule", seconds_per_step: float) -> str:
        """``step N/total``, the bar's metrics, the time a step took and the time left at that pace, on one line."""
        parts = [self.step_description(trainer)]
        for label, value in self.get_metrics(trainer, pl_module).items():
            try:
                shown = value if isinstance(value, str) else f"{value:{self.theme.metrics_format}}"
            except (TypeError, ValueError):
                shown = str(value)
            parts.append(f"{label} {shown}")
        parts.append(f"{seconds_per_step:.2g} s/step" if seconds_per_step < 1 else f"{seconds_per_step:.1f} s/step")
        steps_left = self.total_train_batches - trainer.global_step
        if math.isfinite(steps_left) and steps_left > 0:
            parts.append(f"{_clock_time(steps_left * seconds_per_step)} left")
        return "  ".join(parts)

    @override
    def on_validation_start(self, trainer: "pl.Trainer", pl_module: "pl.LightningModule") -> None:
        super().on_validation_start(trainer, pl_module)
        if trainer.state.fn == "fit" and self.is_enabled and self.train_progress_bar_id is not None:
            self._update_metrics(trainer, pl_module)

    @override
    def on_train_epoch_start(self, trainer: "pl.Trainer", pl_module: "pl.LightningModule") -> None:
        super().on_train_epoch_start(trainer, pl_module)
        if self.is_enabled and self.progress is not None and self.train_progress_bar_id is not None:
            # a resumed run starts at its step count, without a jump that would distort the speed and ETA
            self.progress.reset(
                self.train_progress_bar_id, total=self.total_train_batches, completed=trainer.global_step,
                description=self.step_description(trainer),
            )

    @override
    def on_train_batch_end(self, trainer: "pl.Trainer", pl_module: "pl.LightningModule", outputs: Any, batch: Any, batch_idx: int) -> None:
        # Lightning's bar shows batch_idx + 1 done; this one shows the optimizer steps done
        super().on_train_batch_end(trainer, pl_module, outputs, batch, trainer.global_step - 1)
        if self.is_enabled and self.progress is not None and self.train_progress_bar_id is not None:
            self.progress.update(self.train_progress_bar_id, description=self.step_description(trainer))
        step = trainer.global_step
        if self._prints_lines and step > self._last_line[0] and step % self.print_every_n_steps == 0:
            self._print_line(trainer, pl_module)

    @override
    def get_metrics(self, trainer: "pl.Trainer", pl_module: "pl.LightningModule") -> dict[str, Any]:
        logged = trainer.callback_metrics
        shown: dict[str, Any] = {}
        for label, name in self.metrics.items():
            if trainer.validating and trainer.state.fn == "fit" and name.startswith("val/"):
                shown[label] = "running"
            elif name in logged:
                shown[label] = float(logged[name])
        for name, value in super().get_metrics(trainer, pl_module).items():
            if name != "v_num" and name not in self.metrics.values():
                shown[name] = value
        return shown


def _clock_time(seconds: float) -> str:
    """``m:ss``, or ``h:mm:ss`` from an hour on."""
    hours, rest = divmod(round(seconds), 3600)
    minutes, rest = divmod(rest, 60)
    return f"{hours}:{minutes:02d}:{rest:02d}" if hours else f"{minutes}:{rest:02d}"


class _EvaluationBatchesColumn(BatchesProcessedColumn):
    """Lightning's ``batches done/total`` column, blank on the training row."""

    def __init__(self, bar: StepProgressBar, style: Any):
        super().__init__(style=style)
        self.bar = bar

    @override
    def render(self, task: Any) -> Text:
        return Text() if task.id == self.bar.train_progress_bar_id else super().render(task)
