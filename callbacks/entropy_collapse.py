r"""Entropy collapse: the policy's per-token entropy on its own rollouts, against its value at the start."""

from collections.abc import Mapping
from typing import Any, Literal

import lightning.pytorch as pl
from lightning.pytorch.callbacks import Callback
from lightning.pytorch.utilities import rank_zero_warn
from torch import Tensor
from torchmetrics import MeanMetric
from typing_extensions import override

# What the callback reads, from the training step's outputs first, then from the batch (a Mapping,
# or an object with these attributes). B rows, C completion positions.
CONTRACT = {
    "completion_mask": "[B, C]",  # 1 on completion tokens
    "entropy": "[B, C]",  # the policy's entropy at each completion position, from the training forward pass
}


def read_contract(owner: str, contract: dict[str, str], outputs: Any, batch: Any) -> dict[str, Any]:
    """Each key of ``contract``, from ``outputs`` first, then from ``batch``, checked against its shape.

    Shapes are written over ``B``, ``C`` and ``P`` (the ``prompt_length``, declared ``"int"``), for
    example ``"[B, C]"`` or ``"[B, P + C]"``; a symbol takes its size where it first appears.
    """
    sizes: dict[str, int] = {}
    values = {}
    for key, shape in contract.items():
        if isinstance(outputs, Mapping) and outputs.get(key) is not None:
            value, where = outputs[key], f"outputs[{key!r}]"
        elif isinstance(batch, Mapping):
            value, where = batch.get(key), f"batch[{key!r}]"
        else:
            value, where = getattr(batch, key, None), f"batch.{key}"
        if value is None:
            raise ValueError(f"{owner} needs {key!r} ({shape}) in the training step's outputs or the batch; found in neither")
        if shape == "int":
            if isinstance(value, Tensor) and value.dim() == 0:
                value = int(value)
            if not isinstance(value, int):
                raise ValueError(f"{owner} needs {where} to be an int, got {type(value).__name__}")
            sizes["P"] = value
        else:
            if not isinstance(value, Tensor):
                raise ValueError(f"{owner} needs {where} to be a tensor of shape {shape}, got {type(value).__name__}")
            dims = shape[1:-1].split(", ")
            if value.dim() == len(dims):
                for dim, size in zip(dims, value.shape):
                    if dim.isidentifier():
                        sizes.setdefault(dim, size)
            expected = [sum(sizes[p] for p in dim.split(" + ")) if all(p in sizes for p in dim.split(" + ")) else dim for dim in dims]
            if list(value.shape) != expected:
                raise ValueError(
                    f"{owner} needs {where} of shape {shape} = [{', '.join(map(str, expected))}], got [{', '.join(map(str, value.shape))}]"
                )
        values[key] = value
    return values


class EntropyCollapseMonitor(Callback):
    r"""Tracks the mean per-token entropy of the policy on its rollouts and alerts when it collapses.

    Contract (``CONTRACT``): each key is read from the training step's outputs first, then from the
    batch (a Mapping, or an object with the attribute); ``B`` rows, ``C`` completion positions:

    * ``completion_mask`` ``[B, C]``: 1 on completion tokens;
    * ``entropy`` ``[B, C]``: the policy's entropy at each completion position, from the training pass.

    A missing key or a wrong shape fails with one line naming the key, the expected and the actual shape.

    Every ``log_every_n_steps`` optimizer steps (steps 0, n, 2n, ...) it logs, averaged over the
    step's micro-batches and all processes, straight to the trainer's loggers at that step:
    ``health/entropy_mean`` and ``health/entropy_ratio`` (to the baseline, the mean over the first
    ``baseline_steps`` logged steps). When the ratio falls below ``min_ratio`` it warns once (again
    only after it has recovered), or stops the trainer on every process with ``action="stop"``. The
    baseline is in the checkpoint, so a resumed run compares against the same start.

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
        self.collapsed = False
        self.alert_steps: list[int] = []
        self._step = 0
        self._entropy = MeanMetric()

    @property
    @override
    def state_key(self) -> str:
        return self._generate_state_key(
            min_ratio=self.min_ratio, action=self.action, baseline_steps=self.baseline_steps, log_every_n_steps=self.log_every_n_steps
        )

    @override
    def setup(self, trainer: "pl.Trainer", pl_module: "pl.LightningModule", stage: str) -> None:
        self._entropy = self._entropy.to(pl_module.device)

    @override
    def on_train_batch_start(self, trainer: "pl.Trainer", pl_module: "pl.LightningModule", batch: Any, batch_idx: int) -> None:
        self._step = trainer.global_step

    @override
    def on_train_batch_end(self, trainer: "pl.Trainer", pl_module: "pl.LightningModule", outputs: Any, batch: Any, batch_idx: int) -> None:
        if self._step % self.log_every_n_steps:
            return
        fields = read_contract("EntropyCollapseMonitor", CONTRACT, outputs, batch)
        entropy = fields["entropy"].detach()
        self._entropy.update(entropy, weight=fields["completion_mask"].to(entropy.dtype))
        if trainer.global_step == self._step:  # a micro-batch that did not complete the optimizer step
            return
        entropy = float(self._entropy.compute())
        self._entropy.reset()
        if self.baseline is None:
            self.baseline_values.append(entropy)
            if len(self.baseline_values) == self.baseline_steps:
                self.baseline = sum(self.baseline_values) / len(self.baseline_values)
        metrics = {"health/entropy_mean": entropy}
        collapsed = False
        if self.baseline is not None and self.baseline > 0:
            self.last_ratio = metrics["health/entropy_ratio"] = entropy / self.baseline
            collapsed = self.last_ratio < self.min_ratio
        if trainer.is_global_zero:
            for logger in trainer.loggers:
                logger.log_metrics(metrics, step=self._step)
        collapsed = trainer.strategy.reduce_boolean_decision(collapsed, all=False)
        if collapsed and not self.collapsed:
            self.alert_steps.append(self._step)
            rank_zero_warn(
                f"EntropyCollapseMonitor at step {self._step}: entropy {entropy:.4g} is {self.last_ratio:.3f} of its "
                f"baseline {self.baseline:.4g} (min_ratio={self.min_ratio})"
            )
        self.collapsed = collapsed
        if collapsed and self.action == "stop":
            trainer.should_stop = True

    @override
    def state_dict(self) -> dict[str, Any]:
        return {"baseline": self.baseline, "baseline_values": list(self.baseline_values)}

    @override
    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self.baseline, self.baseline_values = state_dict["baseline"], list(state_dict["baseline_values"])
