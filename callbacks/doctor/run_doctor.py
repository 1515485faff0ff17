r"""Run doctor: names why a run is not learning, with the evidence and the change to make, while it trains."""

import math
from numbers import Real
from typing import Any, Literal

import lightning.pytorch as pl
import torch
from lightning.pytorch.callbacks import Callback
from lightning.pytorch.utilities import rank_zero_warn
from typing_extensions import override

from . import rule_book  # noqa: F401  (registers the rules)
from .diagnoses import SERIES, SETTINGS, Finding, RunHistory, diagnose, rules_named


class RunDoctor(Callback):
    r"""Reads the run's scalars as they are logged and, every ``every_n_steps`` optimizer steps, runs the rules of
    ``diagnoses.py`` on them: each names a cause of a stalled run (groups without a reward difference, a learning rate
    too high or too low, truncated completions, a KL penalty that pins the policy, sampler mismatch, stale rollouts,
    entropy collapse, learning tax with drift), with its evidence and a remedy. Findings are ordered by how much they
    explain, the most likely cause first.

    It uses whatever series it finds under the names of ``diagnoses.SERIES`` (lit_cancel's own tags), from the
    module's ``self.log`` calls (``trainer.callback_metrics``) and from anything logged straight to the trainer's
    loggers (the other monitors): a rule whose series are missing does not run. It logs one series of its own,
    ``health/update_ratio``: the root-mean-square change of a fixed sample of the trainable parameters at each
    optimizer step over their root-mean-square value (each process samples its own shard under FSDP2). The
    learning rate is read from the first optimizer. Settings (``temperature``, ``max_new_tokens``, ``kl_coef``,
    ``max_staleness``) are read from the module, its ``objective`` and ``engine`` where they have them, and
    ``settings`` overrides them.

    Each finding is warned once, in one line, when it first appears; the current findings are written to
    TensorBoard's Text tab (``doctor/findings``) when they change; with ``action="stop"`` a severe finding stops
    the run on every process. The series it read and the findings it reported are in the checkpoint.

    This file needs ``diagnoses.py`` and ``rule_book.py`` beside it; it imports Lightning and torch only.

    Args:
        every_n_steps: check every this many optimizer steps.
        action: ``"warn"`` or ``"stop"`` (on a severe finding).
        rules: names of the rules to run (``diagnoses.RULES``); None runs them all.
        settings: run settings (``diagnoses.SETTINGS``) that the module does not hold.
        update_sample: parameter values sampled for ``health/update_ratio``.

    Example::

        trainer = Trainer(callbacks=[RunDoctor(every_n_steps=10, action="stop")])
    """

    def __init__(
        self,
        every_n_steps: int = 10,
        action: Literal["warn", "stop"] = "warn",
        rules: list[str] | None = None,
        settings: dict[str, float] | None = None,
        update_sample: int = 4096,
    ) -> None:
        super().__init__()
        if every_n_steps < 1:
            raise ValueError(f"RunDoctor: every_n_steps must be >= 1, got {every_n_steps}")
        if action not in ("warn", "stop"):
            raise ValueError(f"RunDoctor: action must be 'warn' or 'stop', got {action!r}")
        if update_sample < 1:
            raise ValueError(f"RunDoctor: update_sample must be >= 1, got {update_sample}")
        unknown = sorted(set(settings or {}) - set(SETTINGS))
        if unknown:
            raise ValueError(f"RunDoctor: unknown settings {unknown}; known: {sorted(SETTINGS)}")
        self.rules = rules_named(rules)  # an unknown name fails here, at start-up
        self.rule_names = rules
        self.every_n_steps, self.action, self.update_sample = every_n_steps, action, update_sample
        self.settings = dict(settings or {})
        self.points: dict[str, dict[int, float]] = {}
        self.findings: list[Finding] | None = None  # None until the first check
        self._reported_state: tuple[list[str], bool] | None = None  # the findings' rules, and whether it was too early
        self.reported: dict[str, int] = {}  # rule name: the step it was first reported at
        self._before: list[torch.Tensor] | None = None
        self._wrapped: list[tuple[Any, Any]] = []

    @property
    @override
    def state_key(self) -> str:
        return self._generate_state_key(every_n_steps=self.every_n_steps, rules=self.rule_names)

    def history(self) -> RunHistory:
        """What the doctor has read so far."""
        return RunHistory.from_points({name: points.items() for name, points in self.points.items()}, settings=dict(self.settings))

    def record(self, metrics: dict[str, Any], step: int) -> None:
        for name, value in metrics.items():
            if name in SERIES:
                value = value.item() if isinstance(value, torch.Tensor) and value.numel() == 1 else value
                if isinstance(value, Real) and math.isfinite(value):
                    self.points.setdefault(name, {})[int(step)] = float(value)

    @override
    def setup(self, trainer: "pl.Trainer", pl_module: "pl.LightningModule", stage: str) -> None:
        if stage != "fit":
            return
        found = {}
        for owner in (pl_module, getattr(pl_module, "objective", None), getattr(pl_module, "engine", None)):
            for name in SETTINGS:
                value = getattr(owner, name, None)
                if isinstance(value, Real) and not isinstance(value, bool):
                    found.setdefault(name, float(value))
        self.settings = {**found, **self.settings}
        for logger in trainer.loggers:  # the monitors log straight to the loggers, not through self.log
            original = logger.log_metrics

            def log_metrics(metrics, step=None, _original=original):
                if step is not None:
                    self.record(metrics, step)
                return _original(metrics, step)

            logger.log_metrics = log_metrics
            self._wrapped.append((logger, original))

    @override
    def teardown(self, trainer: "pl.Trainer", pl_module: "pl.LightningModule", stage: str) -> None:
        for logger, original in self._wrapped:
            logger.log_metrics = original
        self._wrapped = []

    def _sample(self, pl_module: "pl.LightningModule") -> list[torch.Tensor]:
        parameters = [p for p in pl_module.parameters() if p.requires_grad]
        local = [p.to_local() if hasattr(p, "to_local") else p for p in parameters]
        total = sum(p.numel() for p in local) or 1
        samples = []
        for p in local:
            count = max(1, self.update_sample * p.numel() // total)
            flat = p.detach().reshape(-1)
            samples.append(flat[:: max(1, flat.numel() // count)][:count].float().clone())
        return samples

    @override
    def on_before_optimizer_step(self, trainer: "pl.Trainer", pl_module: "pl.LightningModule", optimizer: Any) -> None:
        self._before = self._sample(pl_module)

    @override
    def on_train_batch_end(self, trainer: "pl.Trainer", pl_module: "pl.LightningModule", outputs: Any, batch: Any, batch_idx: int) -> None:
        if self._before is None:  # a micro-batch that did not complete an optimizer step
            return
        step = trainer.global_step
        after = self._sample(pl_module)
        change = sum(float(((a - b) ** 2).sum()) for a, b in zip(after, self._before, strict=True))
        size = sum(float((b**2).sum()) for b in self._before)
        self._before = None
        metrics = dict(trainer.callback_metrics)  # record keeps the names of SERIES
        if size > 0:
            metrics["health/update_ratio"] = math.sqrt(change / size)
            pl_module.log("health/update_ratio", metrics["health/update_ratio"], on_step=True, on_epoch=False)
        if trainer.optimizers:
            metrics["lr"] = trainer.optimizers[0].param_groups[0]["lr"]
        self.record(metrics, step)
        if step % self.every_n_steps == 0:
            self.check(trainer, step)

    def check(self, trainer: "pl.Trainer", step: int) -> list[Finding]:
        """Runs the rules on what was read up to ``step``; warns of new findings, writes them to TensorBoard, and with
        ``action="stop"`` stops the run on a severe one (every process decides as rank 0 did)."""
        history = self.history()
        findings = diagnose(history, self.rules) if trainer.is_global_zero else []
        waiting = [rule.name for rule in self.rules if rule.waits(history)]
        state = ([f.rule for f in findings], not findings and bool(waiting))
        changed = state != self._reported_state
        self.findings, self._reported_state = findings, state
        for finding in findings:
            if finding.rule not in self.reported:
                self.reported[finding.rule] = step
                rank_zero_warn(f"RunDoctor at step {step}: {finding.line()}")
        if changed and trainer.is_global_zero:
            for logger in trainer.loggers:
                if hasattr(getattr(logger, "experiment", None), "add_text"):
                    logger.experiment.add_text("doctor/findings", findings_markdown(findings, waiting), global_step=step)
        severe = any(f.severity == "severe" for f in findings)
        if self.action == "stop" and trainer.strategy.broadcast(severe):
            trainer.should_stop = True
        return findings

    @override
    def state_dict(self) -> dict[str, Any]:
        return {"points": {name: dict(points) for name, points in self.points.items()}, "reported": dict(self.reported)}

    @override
    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self.points = {name: dict(points) for name, points in state_dict["points"].items()}
        self.reported = dict(state_dict["reported"])


def findings_markdown(findings: list[Finding], waiting: list[str] = ()) -> str:
    """The findings as a Markdown table, most likely cause first (TensorBoard's Text tab renders it); without one,
    whether it is too early to tell (``waiting``: the rules that have their series but too few points)."""
    if not findings and waiting:
        verb = "has" if len(waiting) == 1 else "have"
        return f"Too early to tell: no cause found yet, but {', '.join(waiting)} {verb} too few points to judge."
    if not findings:
        return "No finding: nothing the rules know of is holding the run back."
    rows = ["| # | severity | cause | evidence | remedy |", "|---|---|---|---|---|"]
    rows += [f"| {i} | {f.severity} | {f.cause} | {f.evidence} | {f.remedy} |" for i, f in enumerate(findings, 1)]
    return "\n".join(rows)

