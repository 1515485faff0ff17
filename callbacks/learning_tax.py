r"""Learning tax: the share of an update's credit left uncancelled on tokens a whole group shares."""

from typing import Any, Literal

import lightning.pytorch as pl
import torch
from lightning.pytorch.callbacks import Callback
from lightning.pytorch.utilities import rank_zero_warn
from torch import Tensor
from torchmetrics import SumMetric
from typing_extensions import override


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


class LearningTaxMonitor(Callback):
    r"""Measures the reward-irrelevant share of each update and the drift it causes on shared contexts.

    Each optimizer step has per-token credits ``c`` (the update is ``-sum c grad logp``). Within a
    group (the rollouts of one prompt) the positions every member shares (same prefix, same next
    token) should get credits that cancel. The learning tax is what does not::

        tax = sum_groups sum_shared |sum_i c_it| / sum |c_it|

    0 for an exchangeable objective on intact groups. Every ``kl_every_n_steps`` steps it also
    measures the drift itself: the mean KL between the next-token distributions before and after the
    optimizer step, at the shared contexts (one extra forward pass before and one after the step).

    Contract: the ``training_step`` returns a dict with ``credits``, ``completion_ids`` and
    ``completion_mask`` (``[B, C]``) and ``group_ids`` (``[B]``). For the KL, the batch also has
    (as attributes or keys) ``input_ids``, ``attention_mask`` (``[B, P + C]``, completions after
    ``prompt_length`` prompt positions), ``prompt_length``, ``completion_mask`` and ``group_ids``,
    and the LightningModule has ``next_token_logprobs(input_ids, attention_mask, positions) -> [N, V]``
    (``positions`` is ``[N, 2]`` of ``(row, position)``). Only the members of a group that are in
    the same micro-batch are compared.

    Logged: ``health/learning_tax`` every ``log_every_n_steps`` steps (summed over the step's
    micro-batches and all processes), ``health/shared_kl`` every ``kl_every_n_steps`` steps (when
    the step is a single micro-batch). When the tax exceeds ``max_tax`` it warns or stops.

    Args:
        max_tax: alert above this tax.
        action: ``"warn"`` or ``"stop"``.
        log_every_n_steps: how often to compute the tax, in optimizer steps.
        kl_every_n_steps: how often to measure the KL on shared contexts; 0 never.

    Example::

        trainer = Trainer(callbacks=[LearningTaxMonitor(max_tax=0.05, kl_every_n_steps=10)])
    """

    def __init__(
        self,
        max_tax: float = 0.5,
        action: Literal["warn", "stop"] = "warn",
        log_every_n_steps: int = 1,
        kl_every_n_steps: int = 10,
    ) -> None:
        super().__init__()
        if not 0 < max_tax <= 1:
            raise ValueError(f"LearningTaxMonitor: max_tax must be in (0, 1], got {max_tax}")
        if action not in ("warn", "stop"):
            raise ValueError(f"LearningTaxMonitor: action must be 'warn' or 'stop', got {action!r}")
        if log_every_n_steps < 1 or kl_every_n_steps < 0:
            raise ValueError(
                f"LearningTaxMonitor: log_every_n_steps must be >= 1 and kl_every_n_steps >= 0, got {log_every_n_steps} and {kl_every_n_steps}"
            )
        self.max_tax, self.action = max_tax, action
        self.log_every_n_steps, self.kl_every_n_steps = log_every_n_steps, kl_every_n_steps
        self.last_tax: float | None = None
        self.last_shared_kl: float | None = None
        self.alerted = False
        self._uncancelled, self._total = SumMetric(), SumMetric()
        self._before: tuple[Tensor, Tensor] | None = None

    @override
    def setup(self, trainer: "pl.Trainer", pl_module: "pl.LightningModule", stage: str) -> None:
        self._uncancelled, self._total = self._uncancelled.to(pl_module.device), self._total.to(pl_module.device)

    @override
    def on_train_batch_start(self, trainer: "pl.Trainer", pl_module: "pl.LightningModule", batch: Any, batch_idx: int) -> None:
        self._before = None
        if not self.kl_every_n_steps or trainer.accumulate_grad_batches > 1 or trainer.global_step % self.kl_every_n_steps:
            return
        field = (lambda name: batch[name]) if isinstance(batch, dict) else (lambda name: getattr(batch, name))
        prompt_length = field("prompt_length")
        tokens = field("input_ids")[:, prompt_length:]
        shared = shared_positions(tokens, field("completion_mask"), field("group_ids"))
        # one representative row per group: the shared contexts are identical across its members
        _, group = torch.unique(field("group_ids"), return_inverse=True)
        index = torch.arange(len(group), device=group.device)
        first_row = torch.full((int(group.max()) + 1,), len(group), device=group.device).scatter_reduce(0, group, index, reduce="amin")
        first = torch.zeros(len(group), dtype=torch.bool, device=group.device).index_fill_(0, first_row, True)
        rows, columns = torch.nonzero(shared & first.unsqueeze(1), as_tuple=True)
        if len(rows) == 0:
            return
        # only the representative rows go through the model; the distribution after completion
        # position t is predicted at sequence position P + t - 1
        kept, row_in_kept = torch.unique(rows, return_inverse=True)
        positions = torch.stack([row_in_kept, columns + prompt_length - 1], 1)
        inputs = (field("input_ids")[kept], field("attention_mask")[kept], positions)
        self._before = (inputs, pl_module.next_token_logprobs(*inputs))

    @override
    def on_train_batch_end(self, trainer: "pl.Trainer", pl_module: "pl.LightningModule", outputs: Any, batch: Any, batch_idx: int) -> None:
        completes_step = (batch_idx + 1) % trainer.accumulate_grad_batches == 0
        if self._before is not None and completes_step:
            inputs, before = self._before
            after = pl_module.next_token_logprobs(*inputs)
            self.last_shared_kl = float((before.exp() * (before - after)).sum(-1).mean())
            pl_module.log("health/shared_kl", self.last_shared_kl)
            self._before = None
        if (trainer.global_step - completes_step) % self.log_every_n_steps:
            return
        credits = outputs["credits"].detach()
        shared = shared_positions(outputs["completion_ids"], outputs["completion_mask"], outputs["group_ids"])
        _, group = torch.unique(outputs["group_ids"], return_inverse=True)
        per_group = torch.zeros(int(group.max()) + 1, credits.shape[1], dtype=credits.dtype, device=credits.device)
        per_group.index_add_(0, group, credits * shared)
        self._uncancelled.update(per_group.abs().sum())
        self._total.update(credits.abs().sum())
        if not completes_step:
            return
        total = float(self._total.compute())
        self.last_tax = float(self._uncancelled.compute()) / total if total > 0 else 0.0
        self._uncancelled.reset()
        self._total.reset()
        pl_module.log("health/learning_tax", self.last_tax)
        if self.last_tax > self.max_tax:
            self.alerted = True
            rank_zero_warn(f"LearningTaxMonitor at step {trainer.global_step}: learning tax {self.last_tax:.3f} > max_tax={self.max_tax}")
            if self.action == "stop":
                trainer.should_stop = True
