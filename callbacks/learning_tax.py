r"""Learning tax: the share of an update's credit left uncancelled on tokens a whole group shares."""

import math
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from typing import Any, Literal, Protocol, runtime_checkable

import lightning.pytorch as pl
import torch
from lightning.pytorch.callbacks import Callback
from lightning.pytorch.utilities import rank_zero_warn
from torch import Tensor
from torch.distributed.fsdp import FSDPModule
from torchmetrics import SumMetric
from typing_extensions import override

# What the callback reads, from the training step's outputs first, then from the batch (a Mapping,
# or an object with these attributes). B rows, P prompt positions (left-padded), C completion positions.
CONTRACT = {
    "completion_mask": "[B, C]",  # 1 on the policy's completion tokens (not on an environment's, in multi-turn episodes)
    "credits": "[B, C]",  # -d loss / d logprobs, detached
    "group_ids": "[B]",  # the group (prompt) of each row
}
# the completion tokens: completion_ids (their context: completion_mask), or else input_ids after prompt_length (their
# context: attention_mask after prompt_length, which holds the environment's tokens of multi-turn episodes too)
COMPLETION_IDS = {"completion_ids": "[B, C]"}
SEQUENCES = {"prompt_length": "int", "input_ids": "[B, P + C]", "attention_mask": "[B, P + C]"}
# for the KL on shared contexts
KL_CONTRACT = {"completion_mask": "[B, C]", "group_ids": "[B]", **SEQUENCES}


@runtime_checkable
class NextTokenLogprobs(Protocol):
    """The LightningModule method that LearningTaxMonitor calls for the KL, before and after the optimizer step."""

    def next_token_logprobs(self, input_ids: Tensor, attention_mask: Tensor, positions: Tensor) -> Tensor:
        """``[N, V]`` log-distribution of the next token after each ``(row, position)`` of ``positions`` (``[N, 2]``)."""
        ...


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


def shared_positions(
    tokens: Tensor, mask: Tensor, group_ids: Tensor, context_mask: Tensor | None = None, prompts: Tensor | None = None
) -> Tensor:
    """``[B, C]`` mask of the completion positions whose prefix and token every member of the row's group shares.

    A group's shared positions are its longest common prefix, the single path of its prefix trie
    before the first branch, over each row's context: ``context_mask`` ``[B, C]`` (``mask`` when
    None), e.g. ``attention_mask[:, P:]`` of multi-turn episodes, whose environment tokens are in
    the context but not in ``mask``. Members agree at a position that all of them hold in their
    context, with the same token, from the same source (all in ``mask`` or none), so a prefix runs
    on through an observation they share; of that prefix only the ``mask`` positions are marked, the
    tokens that get credit. A row with no token in ``mask`` (an agent's episode that failed, inert)
    is no member of its group. Groups with fewer than two members in the batch have no shared
    positions, nor do groups whose members' ``prompts`` differ, where given (``[B, P]``,
    ``input_ids[:, :P]``): an environment whose opening text differs per episode gives a group's
    episodes different contexts.
    """
    context = mask if context_mask is None else context_mask
    _, group = torch.unique(group_ids, return_inverse=True)
    groups = int(group.max()) + 1 if len(group) else 0
    credited = mask.bool()
    member = credited.any(1)
    rows = torch.where(member, torch.arange(len(group), device=group.device), len(group))
    first_row = torch.full((groups,), len(group), device=group.device).scatter_reduce(0, group, rows, reduce="amin")[group]
    first_row = torch.where(first_row < len(group), first_row, torch.arange(len(group), device=group.device))
    agrees = ((tokens == tokens[first_row]) & (credited == credited[first_row]) & context.bool()).long()
    if prompts is not None:
        agrees *= (prompts == prompts[first_row]).all(1, keepdim=True).long()
    agrees |= (~member).long().unsqueeze(1)
    everyone = torch.ones(groups, tokens.shape[1], dtype=torch.long, device=tokens.device)
    everyone = everyone.scatter_reduce(0, group.unsqueeze(1).expand_as(agrees), agrees, reduce="amin")
    members = torch.bincount(group, weights=member.float(), minlength=groups)
    prefix = everyone.cumprod(1).bool() & (members > 1).unsqueeze(1)
    return prefix[group] & credited


@contextmanager
def measuring(trainer: "pl.Trainer", pl_module: "pl.LightningModule") -> Iterator[None]:
    """An extra forward pass of the policy: no grad, every submodule in eval mode (each restored after),
    the trainer's precision context. Dropout is off, so the pass measures the policy, not noise."""
    modes = [(module, module.training) for module in pl_module.modules()]
    pl_module.eval()
    try:
        with torch.no_grad(), trainer.precision_plugin.forward_context():
            yield
    finally:
        for module, training in modes:
            module.training = training


class StepSnapshot:
    """The values that the parameters an optimizer trains had before its step.

    Taken in ``on_before_optimizer_step`` (one copy of the trainable parameters: cheap under LoRA);
    :meth:`before_step` swaps them in for a pass of the policy as it was, and back.
    """

    def __init__(self) -> None:
        self.parameters: list[Tensor] = []
        self.values: list[Tensor] = []

    def add(self, optimizer: Any) -> None:
        for group in optimizer.param_groups:
            for parameter in group["params"]:
                if parameter.requires_grad:
                    self.parameters.append(parameter)
                    self.values.append(parameter.detach().clone())

    @contextmanager
    def before_step(self, pl_module: "pl.LightningModule") -> Iterator[None]:
        self._swap(pl_module)
        try:
            yield
        finally:
            self._swap(pl_module)

    def _swap(self, pl_module: "pl.LightningModule") -> None:
        with torch.no_grad():
            for parameter, value in zip(self.parameters, self.values):
                current = parameter.detach().clone()
                parameter.copy_(value)
                value.copy_(current)
        # FSDP2 keeps a root module's gathered parameters after a forward without backward: drop them,
        # so that the next pass gathers the swapped values
        for module in pl_module.modules():
            if isinstance(module, FSDPModule):
                module.reshard()


def uncancelled_credit(
    credits: Tensor, tokens: Tensor, mask: Tensor, group_ids: Tensor, context_mask: Tensor | None = None,
    prompts: Tensor | None = None,
) -> tuple[Tensor, Tensor]:
    """``(uncancelled, total)``: ``sum_groups sum_shared |sum_i c_it|`` and ``sum |c_it|`` (``context_mask`` and
    ``prompts`` as in :func:`shared_positions`)."""
    shared = shared_positions(tokens, mask, group_ids, context_mask, prompts)
    _, group = torch.unique(group_ids, return_inverse=True)
    per_group = torch.zeros(int(group.max()) + 1, credits.shape[1], dtype=credits.dtype, device=credits.device)
    per_group.index_add_(0, group, credits * shared)
    return per_group.abs().sum(), (credits * mask).abs().sum()


def shared_contexts(
    tokens: Tensor, mask: Tensor, group_ids: Tensor, prompt_length: int, context_mask: Tensor | None = None,
    prompts: Tensor | None = None,
) -> tuple[Tensor, Tensor]:
    """``(rows, positions)``: one representative row per group, and the ``[N, 2]`` ``(row in rows, position)``
    of the sequence positions that predict its shared completion tokens (``context_mask`` and ``prompts`` as in
    :func:`shared_positions`: the environment's tokens of an episode are context, never predicted).

    A row with no shared context stands in when the batch has none, so that every process runs the
    same passes (sharded models gather parameters in each).
    """
    shared = shared_positions(tokens, mask, group_ids, context_mask, prompts)
    _, group = torch.unique(group_ids, return_inverse=True)
    index = torch.arange(len(group), device=group.device)
    first_row = torch.full((int(group.max()) + 1,), len(group), device=group.device).scatter_reduce(0, group, index, reduce="amin")
    first = torch.zeros(len(group), dtype=torch.bool, device=group.device).index_fill_(0, first_row, True)
    rows, columns = torch.nonzero(shared & first.unsqueeze(1), as_tuple=True)
    if len(rows) == 0:
        return index[:1], torch.zeros(0, 2, dtype=torch.long, device=group.device)
    kept, row_in_kept = torch.unique(rows, return_inverse=True)
    # the distribution of completion token t is predicted at sequence position P + t - 1
    return kept, torch.stack([row_in_kept, columns + prompt_length - 1], 1)


class LearningTaxMonitor(Callback):
    r"""Measures the reward-irrelevant share of each update and the drift it causes on shared contexts.

    Each optimizer step has per-token credits ``c`` (the update is ``-sum c grad logp``). Within a
    group (the rollouts of one prompt) the positions every member shares (same prefix, same next
    token) should get credits that cancel. In multi-turn episodes the prefix runs on through the
    environment's tokens (in ``attention_mask``, out of ``completion_mask``) while every member has
    the same, and only the policy's tokens in it count. The learning tax is what does not cancel::

        tax = sum_groups sum_shared |sum_i c_it| / sum |c_it|

    0 for an exchangeable objective on intact groups. Every ``kl_every_n_steps`` steps it also
    measures the drift itself: the mean KL between the next-token distributions before and after the
    optimizer step, at the shared contexts. Both passes run after the step, from the step's own
    inputs: in ``on_before_optimizer_step`` it copies the trainable parameters, and in
    ``on_train_batch_end`` it runs the new policy, swaps the copy in, runs the old one and swaps
    back, without grad, in eval mode and in the trainer's precision context (a step that changes
    nothing gives a KL of exactly 0). Only the members of a group in the same micro-batch are compared.

    Contract: each key is read from the training step's outputs first, then from the batch (a
    Mapping, or an object with the attribute); ``B`` rows, ``P`` prompt positions, ``C``
    completion positions:

    * ``completion_mask`` ``[B, C]`` (1 on the policy's tokens, 0 on padding and on the environment's
      tokens of a multi-turn episode), ``credits`` ``[B, C]`` (``-d loss / d logprobs``, detached),
      ``group_ids`` ``[B]`` (``CONTRACT``);
    * the completion tokens: ``completion_ids`` ``[B, C]`` (single-turn: their context is the
      ``completion_mask``), or else ``input_ids`` and ``attention_mask`` ``[B, P + C]`` after
      ``prompt_length`` ``P`` (an int; the context is ``attention_mask[:, P:]``, 1 on the
      environment's tokens of an episode too);
    * for the KL, also ``input_ids`` and ``attention_mask`` ``[B, P + C]`` and ``prompt_length``
      (``KL_CONTRACT``), and the LightningModule method
      ``next_token_logprobs(input_ids, attention_mask, positions) -> [N, V]`` (``NextTokenLogprobs``;
      ``positions`` is ``[N, 2]`` of ``(row, position)``).

    The method is checked in ``setup``, the keys and shapes whenever they are read; a mistake fails
    with one line naming the key, the expected and the actual shape.

    Logged, reduced over the step's micro-batches and all processes, straight to the trainer's
    loggers at the step they measure: ``health/learning_tax`` every ``log_every_n_steps`` steps and
    ``health/shared_kl`` every ``kl_every_n_steps`` steps (steps 0, n, 2n, ...). When the tax
    exceeds ``max_tax`` it warns once (again only after it has come back under) or stops the
    trainer on every process. A step in which no group has two members (in a micro-batch of this
    process) has no shared tokens: its tax is 0 and means nothing, which it warns about once. A step
    with credits that are not finite has a tax of NaN, also warned once.

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
                "LearningTaxMonitor: log_every_n_steps must be >= 1 and kl_every_n_steps >= 0, "
                f"got {log_every_n_steps} and {kl_every_n_steps}"
            )
        self.max_tax, self.action = max_tax, action
        self.log_every_n_steps, self.kl_every_n_steps = log_every_n_steps, kl_every_n_steps
        self.last_tax: float | None = None
        self.last_shared_kl: float | None = None
        self.taxed = False
        self.warned_no_groups = self.warned_nonfinite = False
        self.alert_steps: list[int] = []
        self._step_has_group = False
        self._step = 0
        self._uncancelled, self._total, self._nonfinite = SumMetric(), SumMetric(), SumMetric()
        self._kl_sum, self._kl_count = SumMetric(), SumMetric()
        self._contexts: list[tuple[Tensor, Tensor, Tensor]] = []
        self._snapshot: StepSnapshot | None = None

    @property
    @override
    def state_key(self) -> str:
        return self._generate_state_key(
            max_tax=self.max_tax, action=self.action, log_every_n_steps=self.log_every_n_steps, kl_every_n_steps=self.kl_every_n_steps
        )

    def _measures_kl(self, step: int) -> bool:
        return self.kl_every_n_steps > 0 and step % self.kl_every_n_steps == 0

    @override
    def setup(self, trainer: "pl.Trainer", pl_module: "pl.LightningModule", stage: str) -> None:
        if self.kl_every_n_steps and not isinstance(pl_module, NextTokenLogprobs):
            raise TypeError(
                f"LearningTaxMonitor needs {type(pl_module).__name__}.next_token_logprobs(input_ids, attention_mask, positions) "
                f"-> [N, V] for the KL; it has none (kl_every_n_steps=0 turns the KL off)"
            )
        for name in ("_uncancelled", "_total", "_nonfinite", "_kl_sum", "_kl_count"):
            setattr(self, name, getattr(self, name).to(pl_module.device))

    @override
    def on_train_batch_start(self, trainer: "pl.Trainer", pl_module: "pl.LightningModule", batch: Any, batch_idx: int) -> None:
        self._step = trainer.global_step

    @override
    def on_before_optimizer_step(self, trainer: "pl.Trainer", pl_module: "pl.LightningModule", optimizer: Any) -> None:
        if self._measures_kl(trainer.global_step):
            self._snapshot = self._snapshot or StepSnapshot()
            self._snapshot.add(optimizer)

    @override
    def on_train_batch_end(self, trainer: "pl.Trainer", pl_module: "pl.LightningModule", outputs: Any, batch: Any, batch_idx: int) -> None:
        completes_step = trainer.global_step > self._step
        if self._measures_kl(self._step):
            fields = read_contract("LearningTaxMonitor", KL_CONTRACT, outputs, batch)
            prompt_length = fields["prompt_length"]
            prompts, tokens = fields["input_ids"][:, :prompt_length], fields["input_ids"][:, prompt_length:]
            context = fields["attention_mask"][:, prompt_length:]
            rows, positions = shared_contexts(tokens, fields["completion_mask"], fields["group_ids"], prompt_length, context, prompts)
            self._contexts.append((fields["input_ids"][rows], fields["attention_mask"][rows], positions))
            if completes_step:
                self._measure_kl(trainer, pl_module)
        if self._step % self.log_every_n_steps == 0:
            self._update_tax(outputs, batch)
            if completes_step:
                self._log_tax(trainer)

    def _update_tax(self, outputs: Any, batch: Any) -> None:
        has_ids = (isinstance(outputs, Mapping) and outputs.get("completion_ids") is not None) or (
            batch.get("completion_ids") if isinstance(batch, Mapping) else getattr(batch, "completion_ids", None)
        ) is not None
        fields = read_contract("LearningTaxMonitor", {**CONTRACT, **(COMPLETION_IDS if has_ids else SEQUENCES)}, outputs, batch)
        if has_ids:
            tokens, context, prompts = fields["completion_ids"], None, None
        else:
            tokens, context = (fields[key][:, fields["prompt_length"] :] for key in ("input_ids", "attention_mask"))
            prompts = fields["input_ids"][:, : fields["prompt_length"]]
        credits, mask = fields["credits"].detach(), fields["completion_mask"]
        finite = torch.isfinite(credits)
        self._nonfinite.update((~finite & mask.bool()).sum())
        uncancelled, total = uncancelled_credit(credits.masked_fill(~finite, 0.0), tokens, mask, fields["group_ids"], context, prompts)
        self._step_has_group = self._step_has_group or bool((torch.unique(fields["group_ids"], return_counts=True)[1] > 1).any())
        self._uncancelled.update(uncancelled)
        self._total.update(total)

    def _log_tax(self, trainer: "pl.Trainer") -> None:
        total, nonfinite = float(self._total.compute()), int(self._nonfinite.compute())
        self.last_tax = math.nan if nonfinite else float(self._uncancelled.compute()) / total if total > 0 else 0.0
        for metric in (self._uncancelled, self._total, self._nonfinite):
            metric.reset()
        if nonfinite and not self.warned_nonfinite:
            self.warned_nonfinite = True
            rank_zero_warn(
                f"LearningTaxMonitor at step {self._step}: {nonfinite} completion tokens have credits that are not finite "
                "(NaN or inf), so its learning tax is NaN, not a measure: the training step's loss, advantages or importance "
                "ratios were not finite (warned once)"
            )
        if not self._step_has_group and not self.warned_no_groups:
            self.warned_no_groups = True
            rank_zero_warn(
                f"LearningTaxMonitor at step {self._step}: no group has two members in this step's micro-batches "
                f"(every group_ids value appears once), so no token is shared and the tax {self.last_tax:.1f} measures "
                "nothing; give the rows of one prompt the same group id (warned once)"
            )
        self._step_has_group = False
        if trainer.is_global_zero:
            for logger in trainer.loggers:
                logger.log_metrics({"health/learning_tax": self.last_tax}, step=self._step)
        taxed = trainer.strategy.reduce_boolean_decision(self.last_tax > self.max_tax, all=False)
        if taxed and not self.taxed:
            self.alert_steps.append(self._step)
            where = "" if self.last_tax > self.max_tax else " on another process"
            rank_zero_warn(
                f"LearningTaxMonitor at step {self._step}: learning tax{where} > max_tax={self.max_tax} (here {self.last_tax:.3f})"
            )
        self.taxed = taxed
        if taxed and self.action == "stop":
            trainer.should_stop = True

    def _measure_kl(self, trainer: "pl.Trainer", pl_module: "pl.LightningModule") -> None:
        contexts, snapshot = self._contexts, self._snapshot
        self._contexts, self._snapshot = [], None
        if snapshot is None:
            raise RuntimeError(f"LearningTaxMonitor saw no on_before_optimizer_step for step {self._step}; it needs automatic optimization")
        with measuring(trainer, pl_module):
            after = [self._next_token_logprobs(pl_module, *context) for context in contexts]
            with snapshot.before_step(pl_module):
                before = [self._next_token_logprobs(pl_module, *context) for context in contexts]
        for old, new in zip(before, after):
            old, new = old.float(), new.float()
            probability = old.exp()
            # tokens the old policy cannot produce add nothing (and would give 0 * inf)
            self._kl_sum.update(torch.where(probability > 0, probability * (old - new), 0.0).sum())
            self._kl_count.update(len(old))
        count = float(self._kl_count.compute())
        if count > 0:
            self.last_shared_kl = float(self._kl_sum.compute()) / count
            if trainer.is_global_zero:
                for logger in trainer.loggers:
                    logger.log_metrics({"health/shared_kl": self.last_shared_kl}, step=self._step)
        self._kl_sum.reset()
        self._kl_count.reset()

    @staticmethod
    def _next_token_logprobs(pl_module: "pl.LightningModule", input_ids: Tensor, attention_mask: Tensor, positions: Tensor) -> Tensor:
        logprobs = pl_module.next_token_logprobs(input_ids, attention_mask, positions)
        if not isinstance(logprobs, Tensor) or logprobs.dim() != 2 or len(logprobs) != len(positions):
            got = list(logprobs.shape) if isinstance(logprobs, Tensor) else type(logprobs).__name__
            raise ValueError(
                f"LearningTaxMonitor needs next_token_logprobs(...) to return shape [N, V] with N = {len(positions)}, got {got}"
            )
        return logprobs
