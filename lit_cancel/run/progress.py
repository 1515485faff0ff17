"""A rich progress bar that counts optimizer steps and shows the reward, for runs with one endless epoch."""

import math
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

    With ``trainer.enable_progress_bar: false`` the ``lit-cancel`` command drops this callback
    from the configured callbacks (Lightning refuses a progress bar callback otherwise). Outside a
    terminal (CI logs) rich prints the bar once, when training ends.

    Args:
        metrics: ``{label: logged metric name}`` to show, in order; a metric not logged yet is
            left out. Defaults to the round's mean reward and accuracy and the held-out accuracy.
        refresh_rate: redraws per second; 0 disables the bar.
        leave: keep each epoch's finished bar on screen.
        theme: rich styles of the bar's parts.
        console_kwargs: arguments of rich's ``Console``.

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
    ) -> None:
        super().__init__(refresh_rate=refresh_rate, leave=leave, theme=theme or RichProgressBarTheme(), console_kwargs=console_kwargs)
        self.metrics = dict(DEFAULT_METRICS if metrics is None else metrics)
        if not all(isinstance(label, str) and isinstance(name, str) and name for label, name in self.metrics.items()):
            raise ValueError(f"StepProgressBar: metrics must map labels to logged metric names, got {metrics!r}")

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


class _EvaluationBatchesColumn(BatchesProcessedColumn):
    """Lightning's ``batches done/total`` column, blank on the training row."""

    def __init__(self, bar: StepProgressBar, style: Any):
        super().__init__(style=style)
        self.bar = bar

    @override
    def render(self, task: Any) -> Text:
        return Text() if task.id == self.bar.train_progress_bar_id else super().render(task)
