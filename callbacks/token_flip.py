r"""Token flipping: which tokens one optimizer step boosts and which it suppresses."""

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

SPLITS = ("positive", "negative", "shared", "specific", "positive_specific", "negative_specific")
# splits that are also reported per bin of the token's probability before the step
BINNED_SPLITS = ("shared", "specific", "both_signs", "one_sign")

# What the callback reads, from the training step's outputs first, then from the batch (a Mapping,
# or an object with these attributes). B rows, P prompt positions (left-padded), C completion positions.
CONTRACT = {
    "completion_mask": "[B, C]",  # 1 on the policy's completion tokens (not on an environment's, in multi-turn episodes)
    "prompt_length": "int",  # P
    "input_ids": "[B, P + C]",  # prompts, then completions
    "attention_mask": "[B, P + C]",  # 0 on padding (1 on an episode's environment tokens: context for shared prefixes)
    "advantages": "[B]",
    "group_ids": "[B]",  # the group (prompt) of each row
}


@runtime_checkable
class TokenLogprobs(Protocol):
    """The LightningModule method that TokenFlipMonitor calls, before and after the optimizer step."""

    def token_logprobs(self, input_ids: Tensor, attention_mask: Tensor, prompt_length: int) -> Tensor:
        """``[B, C]`` log-probabilities of the completion tokens ``input_ids[:, prompt_length:]``."""
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


def both_signs(tokens: Tensor, mask: Tensor, group_ids: Tensor, advantages: Tensor) -> Tensor:
    """``[B, C]`` mask of the completion tokens whose id appears, in the same group, both in a rollout with
    ``A > 0`` and in one with ``A < 0`` (anywhere in those rollouts)."""
    _, group = torch.unique(group_ids, return_inverse=True)
    vocabulary = int(tokens.max()) + 1 if tokens.numel() else 1
    # one index per (group, token id) that occurs
    pairs, index = torch.unique(group.unsqueeze(1) * vocabulary + tokens, return_inverse=True)
    present = []
    for sign in (advantages > 0, advantages < 0):
        where = (mask.bool() & sign.unsqueeze(1)).reshape(-1).long()
        seen = torch.zeros(len(pairs), dtype=torch.long, device=tokens.device).scatter_reduce(0, index.reshape(-1), where, reduce="amax")
        present.append(seen[index].bool())
    return present[0] & present[1] & mask.bool()


def bin_names(edges: tuple[float, ...]) -> list[str]:
    """``p0-0.5``, ``p0.5-0.9``, ... for the bins ``[0, e_1), [e_1, e_2), ..., [e_k, 1]``."""
    bounds = [0, *edges, 1]
    return [f"p{low:g}-{high:g}" for low, high in zip(bounds[:-1], bounds[1:])]


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


class TokenFlipMonitor(Callback):
    r"""Fractions of tokens whose log-probability one optimizer step raises or lowers.

    For the completion tokens of an optimizer step (all its micro-batches),
    ``delta = logp_after - logp_before`` across the step. It logs the fraction boosted
    (``delta > 0``) and suppressed (``delta < 0``), separately for positive (``A > 0``) and
    negative (``A < 0``) rollouts and for tokens shared by their whole group versus
    rollout-specific ones (also split by the rollout's sign), the mean ``|delta|`` of each split, and
    a histogram of ``delta`` (TensorBoard). Critic-free RL flips tokens in both directions in
    positive and negative rollouts alike; the split by shared and specific tokens shows where the
    reward-irrelevant movement is.

    Both passes run after the step, from the step's own inputs: in ``on_before_optimizer_step`` it
    copies the trainable parameters, and in ``on_train_batch_end`` it scores the step's tokens with
    the new parameters, swaps the copy in, scores them again and swaps back. Both passes run without
    grad, in eval mode and in the trainer's precision context, so a step that changes nothing
    (learning rate 0) gives ``delta = 0`` exactly, dropout or not.

    Contract (``CONTRACT``): each key is read from the training step's outputs first, then from the
    batch (a Mapping, or an object with the attribute); ``B`` rows, ``P`` prompt positions,
    ``C`` completion positions:

    * ``completion_mask`` ``[B, C]``: 1 on the policy's completion tokens, the ones measured (0 on
      the environment's tokens of a multi-turn episode);
    * ``prompt_length``: ``P``, an int;
    * ``input_ids`` and ``attention_mask`` ``[B, P + C]``: prompts (left-padded), then completions;
      ``attention_mask[:, P:]`` is the completions' context, so that a prefix shared by a whole group
      runs on through the environment's tokens of its episodes while they are the same;
    * ``advantages`` ``[B]``; ``group_ids`` ``[B]``: the group (prompt) of each row.

    The LightningModule has ``token_logprobs(input_ids, attention_mask, prompt_length) -> [B, C]``
    (``TokenLogprobs``). The method is checked in ``setup``, the keys and shapes whenever they are
    read; a mistake fails with one line naming the key, the expected and the actual shape.

    Logged every ``every_n_steps`` optimizer steps (steps 0, n, 2n, ...), reduced over all
    processes, straight to the trainer's loggers at that step: ``health/flip_boosted_{split}`` and
    ``health/flip_suppressed_{split}`` and ``health/flip_mean_abs_change_{split}`` for each split in
    ``positive, negative, shared, specific, positive_specific, negative_specific``, and
    ``health/flip_mean_abs_change`` over all tokens. The same three per bin of the token's probability
    before the step (``confidence_bins``) for the splits ``shared``, ``specific``, ``both_signs`` (the
    token's id appears in its group both in a rollout with ``A > 0`` and in one with ``A < 0``, within
    the micro-batch) and ``one_sign``, e.g. ``health/flip_mean_abs_change_shared_p0.9-0.99``, with
    ``health/flip_tokens_{split}_{bin}``, the number of tokens in it: a near-certain token barely moves
    whatever its credit, so compare splits within a bin. When the mean ``|delta|`` exceeds ``max_mean_abs_change``
    it warns once (again only after it has come back under), or stops the trainer on every process.

    Args:
        every_n_steps: how often to measure, in optimizer steps (two extra forward passes each time).
        max_mean_abs_change: alert above this mean absolute change of token log-probs in one step.
        action: ``"warn"`` or ``"stop"``.
        histogram: also log a histogram of ``delta`` when the logger supports it.
        confidence_bins: increasing edges in (0, 1) of the bins of the probability before the step.

    Example::

        trainer = Trainer(callbacks=[TokenFlipMonitor(every_n_steps=10)])
    """

    def __init__(
        self,
        every_n_steps: int = 10,
        max_mean_abs_change: float = 1.0,
        action: Literal["warn", "stop"] = "warn",
        histogram: bool = True,
        confidence_bins: tuple[float, ...] = (0.5, 0.9, 0.99),
    ) -> None:
        super().__init__()
        edges = tuple(confidence_bins)
        if any(not 0 < edge < 1 for edge in edges) or list(edges) != sorted(set(edges)):
            raise ValueError(f"TokenFlipMonitor: confidence_bins must be increasing values in (0, 1), got {confidence_bins}")
        if every_n_steps < 1:
            raise ValueError(f"TokenFlipMonitor: every_n_steps must be >= 1, got {every_n_steps}")
        if max_mean_abs_change <= 0:
            raise ValueError(f"TokenFlipMonitor: max_mean_abs_change must be > 0, got {max_mean_abs_change}")
        if action not in ("warn", "stop"):
            raise ValueError(f"TokenFlipMonitor: action must be 'warn' or 'stop', got {action!r}")
        self.every_n_steps, self.max_mean_abs_change = every_n_steps, max_mean_abs_change
        self.action, self.histogram = action, histogram
        self.confidence_bins = edges
        self.last: dict[str, float] = {}
        self.flipping = False
        self.alert_steps: list[int] = []
        self._step = 0
        self._micro_batches: list[dict[str, Any]] = []
        self._snapshot: StepSnapshot | None = None
        self._counts = {name: SumMetric() for name in self._count_names()}

    def _binned_splits(self) -> list[str]:
        return [f"{split}_{name}" for split in BINNED_SPLITS for name in bin_names(self.confidence_bins)]

    def _count_names(self) -> list[str]:
        kinds = ("boosted", "suppressed", "all", "abs_change")
        return ["abs_change", "tokens"] + [f"{kind}_{split}" for split in (*SPLITS, *self._binned_splits()) for kind in kinds]

    @property
    @override
    def state_key(self) -> str:
        return self._generate_state_key(every_n_steps=self.every_n_steps, max_mean_abs_change=self.max_mean_abs_change, action=self.action)

    @override
    def setup(self, trainer: "pl.Trainer", pl_module: "pl.LightningModule", stage: str) -> None:
        if not isinstance(pl_module, TokenLogprobs):
            raise TypeError(
                f"TokenFlipMonitor needs {type(pl_module).__name__}.token_logprobs(input_ids, attention_mask, prompt_length) -> [B, C]; "
                "it has none"
            )
        self._counts = {name: metric.to(pl_module.device) for name, metric in self._counts.items()}

    @override
    def on_train_batch_start(self, trainer: "pl.Trainer", pl_module: "pl.LightningModule", batch: Any, batch_idx: int) -> None:
        self._step = trainer.global_step

    @override
    def on_before_optimizer_step(self, trainer: "pl.Trainer", pl_module: "pl.LightningModule", optimizer: Any) -> None:
        if trainer.global_step % self.every_n_steps == 0:
            self._snapshot = self._snapshot or StepSnapshot()
            self._snapshot.add(optimizer)

    @override
    def on_train_batch_end(self, trainer: "pl.Trainer", pl_module: "pl.LightningModule", outputs: Any, batch: Any, batch_idx: int) -> None:
        if self._step % self.every_n_steps:
            return
        self._micro_batches.append(read_contract("TokenFlipMonitor", CONTRACT, outputs, batch))
        if trainer.global_step == self._step:  # a micro-batch that did not complete the optimizer step
            return
        micro_batches, snapshot = self._micro_batches, self._snapshot
        self._micro_batches, self._snapshot = [], None
        if snapshot is None:
            raise RuntimeError(f"TokenFlipMonitor saw no on_before_optimizer_step for step {self._step}; it needs automatic optimization")
        arguments = [(fields["input_ids"], fields["attention_mask"], fields["prompt_length"]) for fields in micro_batches]
        with measuring(trainer, pl_module):
            after = [self._token_logprobs(pl_module, *args) for args in arguments]
            with snapshot.before_step(pl_module):
                before = [self._token_logprobs(pl_module, *args) for args in arguments]
        deltas = []
        for fields, new, old in zip(micro_batches, after, before):
            mask = fields["completion_mask"].bool()
            delta = (new.float() - old.float()).masked_fill(~mask, 0.0)
            completion_ids, context = (fields[key][:, fields["prompt_length"] :] for key in ("input_ids", "attention_mask"))
            prompts = fields["input_ids"][:, : fields["prompt_length"]]
            shared = shared_positions(completion_ids, mask, fields["group_ids"], context, prompts)
            advantages = fields["advantages"].unsqueeze(1)
            splits = {
                "positive": mask & (advantages > 0), "negative": mask & (advantages < 0),
                "shared": mask & shared, "specific": mask & ~shared,
                "positive_specific": mask & ~shared & (advantages > 0), "negative_specific": mask & ~shared & (advantages < 0),
            }
            both = both_signs(completion_ids, mask, fields["group_ids"], fields["advantages"])
            unbinned = {"shared": splits["shared"], "specific": splits["specific"], "both_signs": both, "one_sign": mask & ~both}
            edges = torch.tensor(self.confidence_bins, device=delta.device)
            confidence_bin = torch.bucketize(old.float().exp(), edges, right=True)
            for index, name in enumerate(bin_names(self.confidence_bins)):
                for split, where in unbinned.items():
                    splits[f"{split}_{name}"] = where & (confidence_bin == index)
            self._counts["abs_change"].update(delta.abs().sum())
            self._counts["tokens"].update(mask.sum())
            for split, where in splits.items():
                self._counts[f"boosted_{split}"].update((where & (delta > 0)).sum())
                self._counts[f"suppressed_{split}"].update((where & (delta < 0)).sum())
                self._counts[f"all_{split}"].update(where.sum())
                self._counts[f"abs_change_{split}"].update(delta.abs()[where].sum())
            deltas.append(delta[mask])
        totals = {name: float(metric.compute()) for name, metric in self._counts.items()}
        for metric in self._counts.values():
            metric.reset()
        self.last = {"mean_abs_change": totals["abs_change"] / max(totals["tokens"], 1)}
        for split in self._binned_splits():
            self.last[f"tokens_{split}"] = totals[f"all_{split}"]
        for split in (*SPLITS, *self._binned_splits()):
            if totals[f"all_{split}"] > 0:
                self.last[f"boosted_{split}"] = totals[f"boosted_{split}"] / totals[f"all_{split}"]
                self.last[f"suppressed_{split}"] = totals[f"suppressed_{split}"] / totals[f"all_{split}"]
                self.last[f"mean_abs_change_{split}"] = totals[f"abs_change_{split}"] / totals[f"all_{split}"]
        if trainer.is_global_zero:
            for logger in trainer.loggers:
                logger.log_metrics({f"health/flip_{name}": value for name, value in self.last.items()}, step=self._step)
                experiment = getattr(logger, "experiment", None)
                if self.histogram and hasattr(experiment, "add_histogram"):
                    experiment.add_histogram("health/flip_delta", torch.cat(deltas).cpu(), self._step)
        flipping = trainer.strategy.reduce_boolean_decision(self.last["mean_abs_change"] > self.max_mean_abs_change, all=False)
        if flipping and not self.flipping:
            self.alert_steps.append(self._step)
            rank_zero_warn(
                f"TokenFlipMonitor at step {self._step}: mean |delta logp| {self.last['mean_abs_change']:.3g} "
                f"> max_mean_abs_change={self.max_mean_abs_change}"
            )
        self.flipping = flipping
        if flipping and self.action == "stop":
            trainer.should_stop = True

    @staticmethod
    def _token_logprobs(pl_module: "pl.LightningModule", input_ids: Tensor, attention_mask: Tensor, prompt_length: int) -> Tensor:
        logprobs = pl_module.token_logprobs(input_ids, attention_mask, prompt_length)
        expected = [input_ids.shape[0], input_ids.shape[1] - prompt_length]
        if not isinstance(logprobs, Tensor) or list(logprobs.shape) != expected:
            got = list(logprobs.shape) if isinstance(logprobs, Tensor) else type(logprobs).__name__
            raise ValueError(f"TokenFlipMonitor needs token_logprobs(...) to return shape [B, C] = {expected}, got {got}")
        return logprobs
