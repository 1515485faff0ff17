r"""Entropy collapse: the policy's per-token entropy on its own rollouts, against its value at the start."""

from typing import Any, Literal

import lightning.pytorch as pl
from lightning.pytorch.callbacks import Callback
from lightning.pytorch.utilities import rank_zero_warn
from torchmetrics import MeanMetric
from typing_extensions import override


class EntropyCollapseMonitor(Callback):
    r"""Tracks the mean per-token entropy of the policy on its rollouts and alerts when it collapses.

    Contract: the ``training_step`` returns a dict with ``entropy`` (``[B, C]``, the policy's
    entropy at each completion position, as computed in the training forward pass) and
    ``completion_mask`` (``[B, C]``, 1 on completion tokens). Nothing else is needed.

    Logged every ``log_every_n_steps`` optimizer steps, averaged over the step's micro-batches and
    all processes: ``health/entropy_mean`` and ``health/entropy_ratio`` (to the baseline, the mean
    over the first ``baseline_steps`` logged steps). When the ratio falls below ``min_ratio`` it
    warns, or stops the trainer with ``action="stop"``. The baseline is in the checkpoint, so a
    resumed run compares against the same start.

    Args:
        min_ratio: alert when the entropy falls below this fraction of its baseline.
        action: ``"warn"`` or ``"stop"``.
        baseline_steps: number of logged steps averaged into the baseline.
        log_every_n_steps: how often to compute and log, in optimizer steps.

    Example::

        trainer = Trainer(callbacks=[EntropyCollapseMonitor(min_ratio=0.2, action="stop")])
    """

    def __init__(
        self,
        min_ratio: float = 0.1,
        action: Literal["warn", "stop"] = "warn",
        baseline_steps: int = 1,
        log_every_n_steps: int = 1,
    ) -> None:
        super().__init__()
        if not 0 < min_ratio < 1:
            raise ValueError(f"EntropyCollapseMonitor: min_ratio must be in (0, 1), got {min_ratio}")
        if action not in ("warn", "stop"):
            raise ValueError(f"EntropyCollapseMonitor: action must be 'warn' or 'stop', got {action!r}")
        if baseline_steps < 1 or log_every_n_steps < 1:
            raise ValueError(
                f"EntropyCollapseMonitor: baseline_steps and log_every_n_steps must be >= 1, got {baseline_steps} and {log_every_n_steps}"
            )
        self.min_ratio, self.action = min_ratio, action
        self.baseline_steps, self.log_every_n_steps = baseline_steps, log_every_n_steps
        self.baseline_values: list[float] = []
        self.baseline: float | None = None
        self.last_ratio: float | None = None
        self.alerted = False
        self._entropy = MeanMetric()

    @override
    def setup(self, trainer: "pl.Trainer", pl_module: "pl.LightningModule", stage: str) -> None:
        self._entropy = self._entropy.to(pl_module.device)

    @override
    def on_train_batch_end(self, trainer: "pl.Trainer", pl_module: "pl.LightningModule", outputs: Any, batch: Any, batch_idx: int) -> None:
        completes_step = (batch_idx + 1) % trainer.accumulate_grad_batches == 0
        # global_step already counts the step that this micro-batch completed
        if (trainer.global_step - completes_step) % self.log_every_n_steps:
            return
        mask = outputs["completion_mask"].to(outputs["entropy"].dtype)
        self._entropy.update(outputs["entropy"].detach(), weight=mask)
        if not completes_step:
            return
        entropy = float(self._entropy.compute())
        self._entropy.reset()
        if self.baseline is None:
            self.baseline_values.append(entropy)
            if len(self.baseline_values) == self.baseline_steps:
                self.baseline = sum(self.baseline_values) / len(self.baseline_values)
        pl_module.log("health/entropy_mean", entropy)
        if self.baseline is None or self.baseline <= 0:
            return
        self.last_ratio = entropy / self.baseline
        pl_module.log("health/entropy_ratio", self.last_ratio)
        if self.last_ratio < self.min_ratio:
            self._alert(trainer, f"entropy {entropy:.4g} is {self.last_ratio:.3f} of its baseline {self.baseline:.4g} (min_ratio={self.min_ratio})")

    def _alert(self, trainer: "pl.Trainer", message: str) -> None:
        self.alerted = True
        rank_zero_warn(f"EntropyCollapseMonitor at step {trainer.global_step}: {message}")
        if self.action == "stop":
            trainer.should_stop = True

    @override
    def state_dict(self) -> dict[str, Any]:
        return {"baseline": self.baseline, "baseline_values": list(self.baseline_values)}

    @override
    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self.baseline, self.baseline_values = state_dict["baseline"], list(state_dict["baseline_values"])
