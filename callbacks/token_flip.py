r"""Token flipping: which tokens one optimizer step boosts and which it suppresses."""

from typing import Any, Literal

import lightning.pytorch as pl
import torch
from lightning.pytorch.callbacks import Callback
from lightning.pytorch.utilities import rank_zero_warn
from torch import Tensor
from torchmetrics import SumMetric
from typing_extensions import override

SPLITS = ("positive", "negative", "shared", "specific")


def shared_positions(tokens: Tensor, mask: Tensor, group_ids: Tensor) -> Tensor:
    """``[B, C]`` mask of the completion positions whose prefix and token every member of the row's group shares.

    A group's shared positions are its longest common prefix, the single path of its prefix trie
    before the first branch. Groups with one member in the batch have no shared positions.
    """
    _, group = torch.unique(group_ids, return_inverse=True)
    groups = int(group.max()) + 1 if len(group) else 0
    rows = torch.arange(len(group), device=group.device)
    first_row = torch.full((groups,), len(group), device=group.device).scatter_reduce(0, group, rows, reduce="amin")
    agrees = ((tokens == tokens[first_row[group]]) & mask.bool()).long()
    everyone = torch.ones(groups, tokens.shape[1], dtype=torch.long, device=tokens.device)
    everyone = everyone.scatter_reduce(0, group.unsqueeze(1).expand_as(agrees), agrees, reduce="amin")
    members = torch.bincount(group, minlength=groups)
    prefix = everyone.cumprod(1).bool() & (members > 1).unsqueeze(1)
    return prefix[group]


class TokenFlipMonitor(Callback):
    r"""Fractions of tokens whose log-probability one optimizer step raises or lowers.

    For the completion tokens of a micro-batch, ``delta = logp_after - logp_before`` across the
    optimizer step. It logs the fraction boosted (``delta > 0``) and suppressed (``delta < 0``),
    separately for positive (``A > 0``) and negative (``A < 0``) rollouts and for tokens shared
    by their whole group versus rollout-specific ones, and a histogram of ``delta`` (TensorBoard).
    Critic-free RL flips tokens in both directions in positive and negative rollouts alike; the
    split by shared and specific tokens shows where the reward-irrelevant movement is.

    Contract: the ``training_step`` returns a dict with ``logprobs`` (``[B, C]``, the log-probs of
    the training forward pass, before the step), ``completion_ids`` and ``completion_mask``
    (``[B, C]``), ``advantages`` and ``group_ids`` (``[B]``), ``input_ids`` and ``attention_mask``
    (``[B, P + C]``) and ``prompt_length``; the LightningModule has
    ``token_logprobs(input_ids, attention_mask, prompt_length) -> [B, C]`` for the pass after the
    step. Measured every ``every_n_steps`` steps whose optimizer step is a single micro-batch.

    Logged: ``health/flip_boosted_{split}`` and ``health/flip_suppressed_{split}`` for each split
    in ``positive, negative, shared, specific``, ``health/flip_mean_abs_change``. When the mean
    ``|delta|`` exceeds ``max_mean_abs_change`` it warns or stops.

    Args:
        every_n_steps: how often to measure, in optimizer steps (one extra forward pass each time).
        max_mean_abs_change: alert above this mean absolute change of token log-probs in one step.
        action: ``"warn"`` or ``"stop"``.
        histogram: also log a histogram of ``delta`` when the logger supports it.

    Example::

        trainer = Trainer(callbacks=[TokenFlipMonitor(every_n_steps=10)])
    """

    def __init__(
        self,
        every_n_steps: int = 10,
        max_mean_abs_change: float = 1.0,
        action: Literal["warn", "stop"] = "warn",
        histogram: bool = True,
    ) -> None:
        super().__init__()
        if every_n_steps < 1:
            raise ValueError(f"TokenFlipMonitor: every_n_steps must be >= 1, got {every_n_steps}")
        if max_mean_abs_change <= 0:
            raise ValueError(f"TokenFlipMonitor: max_mean_abs_change must be > 0, got {max_mean_abs_change}")
        if action not in ("warn", "stop"):
            raise ValueError(f"TokenFlipMonitor: action must be 'warn' or 'stop', got {action!r}")
        self.every_n_steps, self.max_mean_abs_change = every_n_steps, max_mean_abs_change
        self.action, self.histogram = action, histogram
        self.last: dict[str, float] = {}
        self.alerted = False
        self._counts = {name: SumMetric() for name in self._count_names()}

    @staticmethod
    def _count_names() -> list[str]:
        return ["abs_change", "tokens"] + [f"{kind}_{split}" for split in SPLITS for kind in ("boosted", "suppressed", "all")]

    @override
    def setup(self, trainer: "pl.Trainer", pl_module: "pl.LightningModule", stage: str) -> None:
        self._counts = {name: metric.to(pl_module.device) for name, metric in self._counts.items()}

    @override
    def on_train_batch_end(self, trainer: "pl.Trainer", pl_module: "pl.LightningModule", outputs: Any, batch: Any, batch_idx: int) -> None:
        if trainer.accumulate_grad_batches > 1 or (trainer.global_step - 1) % self.every_n_steps:
            return
        mask = outputs["completion_mask"].bool()
        after = pl_module.token_logprobs(outputs["input_ids"], outputs["attention_mask"], outputs["prompt_length"])
        delta = (after - outputs["logprobs"]).masked_fill(~mask, 0.0)
        shared = shared_positions(outputs["completion_ids"], outputs["completion_mask"], outputs["group_ids"])
        advantages = outputs["advantages"].unsqueeze(1)
        splits = {"positive": mask & (advantages > 0), "negative": mask & (advantages < 0), "shared": mask & shared, "specific": mask & ~shared}
        self._counts["abs_change"].update(delta.abs().sum())
        self._counts["tokens"].update(mask.sum())
        for split, where in splits.items():
            self._counts[f"boosted_{split}"].update((where & (delta > 0)).sum())
            self._counts[f"suppressed_{split}"].update((where & (delta < 0)).sum())
            self._counts[f"all_{split}"].update(where.sum())
        totals = {name: float(metric.compute()) for name, metric in self._counts.items()}
        for metric in self._counts.values():
            metric.reset()
        self.last = {"mean_abs_change": totals["abs_change"] / max(totals["tokens"], 1)}
        for split in SPLITS:
            if totals[f"all_{split}"] > 0:
                self.last[f"boosted_{split}"] = totals[f"boosted_{split}"] / totals[f"all_{split}"]
                self.last[f"suppressed_{split}"] = totals[f"suppressed_{split}"] / totals[f"all_{split}"]
        for name, value in self.last.items():
            pl_module.log(f"health/flip_{name}", value)
        experiment = getattr(trainer.logger, "experiment", None)
        if self.histogram and trainer.is_global_zero and hasattr(experiment, "add_histogram"):
            experiment.add_histogram("health/flip_delta", delta[mask].float().cpu(), trainer.global_step)
        if self.last["mean_abs_change"] > self.max_mean_abs_change:
            self.alerted = True
            rank_zero_warn(
                f"TokenFlipMonitor at step {trainer.global_step}: mean |delta logp| {self.last['mean_abs_change']:.3g} "
                f"> max_mean_abs_change={self.max_mean_abs_change}"
            )
            if self.action == "stop":
                trainer.should_stop = True
