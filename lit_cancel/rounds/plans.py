"""Mini-batch plans: which rollouts of a round meet in which optimizer step.

A plan selects the rollouts to train on this round (the rest may wait for a later round) and
splits them into the round's optimizer steps, once per epoch over the round. Paper B's
cancellation needs a group's opposing credits in the same update: ``QueryPreserved`` keeps every
group in one step, ``RewardBalanced`` puts positive and negative rollouts in every step in a set
proportion, and ``Shuffled`` is the common baseline that scatters them.
"""

from abc import ABC, abstractmethod
from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import Tensor

from lit_cancel.batch import RolloutBatch


@dataclass
class Selection:
    """Rows of the pool: trained this round, carried to the next, and dropped."""

    train: Tensor
    carry: Tensor
    dropped: int = 0


class MiniBatchPlan(ABC):
    """Splits a round's rollouts into optimizer steps."""

    #: whether rollouts may wait for a later round (they then need their old log-probs)
    carries_rollouts: bool = False

    def select(self, pool: RolloutBatch, rows: int, round_index: int, generator: torch.Generator) -> Selection:
        """Which of the ``pool``'s rows to train this round; by default, all of them."""
        return Selection(train=torch.arange(len(pool)), carry=torch.arange(0))

    @abstractmethod
    def split(self, batch: RolloutBatch, steps: int, generator: torch.Generator) -> list[Tensor]:
        """Row indices of each of ``steps`` equal optimizer steps; every row exactly once."""

    def splits_groups(self, steps: int, micro_batches: int) -> bool:
        """Whether a group's rollouts can land in different micro-batches, or some of them in a later round."""
        return self.carries_rollouts or steps * micro_batches > 1

    def check(self, rollouts: int, group_size: int, steps: int, micro_batches: int) -> None:
        """Raises ``ValueError`` at start-up when a round of ``rollouts`` cannot be planned."""
        if rollouts % (steps * micro_batches):
            raise ValueError(
                f"{type(self).__name__}: a round's {rollouts} rollouts (per process) must divide into "
                f"mini_batches_per_round ({steps}) x trainer.accumulate_grad_batches ({micro_batches}) equal micro-batches"
            )


class Shuffled(MiniBatchPlan):
    """Rows in random order, cut into equal steps: a group's members usually land in different steps."""

    def split(self, batch: RolloutBatch, steps: int, generator: torch.Generator) -> list[Tensor]:
        return list(torch.randperm(len(batch), generator=generator).chunk(steps))


class QueryPreserved(MiniBatchPlan):
    """Whole groups in random order, cut into equal steps: every group's rollouts share one update.

    Micro-batches hold whole groups too, so group transforms (DFPO) see every member.
    """

    def check(self, rollouts: int, group_size: int, steps: int, micro_batches: int) -> None:
        groups = rollouts // group_size
        if groups % (steps * micro_batches):
            raise ValueError(
                f"QueryPreserved: the {groups} groups of a round (per process) must divide into mini_batches_per_round "
                f"({steps}) x trainer.accumulate_grad_batches ({micro_batches}) micro-batches of whole groups"
            )

    def splits_groups(self, steps: int, micro_batches: int) -> bool:
        return False

    def split(self, batch: RolloutBatch, steps: int, generator: torch.Generator) -> list[Tensor]:
        groups, index = torch.unique(batch.group_ids, return_inverse=True)
        order = torch.randperm(len(groups), generator=generator)
        rank_of_group = torch.empty_like(order)
        rank_of_group[order] = torch.arange(len(groups))
        rows = torch.argsort(rank_of_group[index.cpu()] * len(batch) + torch.arange(len(batch)))
        return list(rows.chunk(steps))


class RewardBalanced(MiniBatchPlan):
    """Every step holds positive (``A > 0``) and negative (``A < 0``) rollouts in a set proportion.

    Each round it trains as many rollouts as a round samples, chosen from a pool of this round's
    rollouts and those carried from earlier rounds, oldest first: ``round(positive_share * n)``
    positives and the rest negatives. The class in excess waits in the pool for rollouts of the
    other class, at most ``max_wait_rounds`` rounds; then it is dropped (and counted). Fallback
    when one class is short or absent: the other class fills its places (the step's share is then
    off target, and ``batch/pos_share`` shows it). Rollouts with ``A = 0`` carry no policy gradient:
    they fill places only when both classes are exhausted, and never wait. Positives and negatives
    are dealt evenly over the round's steps, so each step holds the round's share, within one rollout.

    Args:
        positive_share: target share of positives among a step's rollouts with ``A != 0``.
        max_wait_rounds: rounds a rollout may wait in the pool before it is dropped.
    """

    carries_rollouts = True

    def __init__(self, positive_share: float = 0.5, max_wait_rounds: int = 2):
        if not 0 < positive_share < 1:
            raise ValueError(f"RewardBalanced: positive_share must be in (0, 1), got {positive_share}")
        if max_wait_rounds < 0:
            raise ValueError(f"RewardBalanced: max_wait_rounds must be >= 0, got {max_wait_rounds}")
        self.positive_share, self.max_wait_rounds = positive_share, max_wait_rounds

    def select(self, pool: RolloutBatch, rows: int, round_index: int, generator: torch.Generator) -> Selection:
        advantages = pool.advantages.cpu()
        age_order = torch.argsort(pool.sampled_round.cpu() * len(pool) + torch.randperm(len(pool), generator=generator))
        oldest_first = [age_order[(advantages[age_order] > 0)], age_order[(advantages[age_order] < 0)]]
        wanted = [round(self.positive_share * rows), rows - round(self.positive_share * rows)]
        taken = [min(w, len(c)) for w, c in zip(wanted, oldest_first)]
        short = [w - t for w, t in zip(wanted, taken)]
        # fallback: the other class fills a short class's places
        taken = [min(len(oldest_first[0]), taken[0] + short[1]), min(len(oldest_first[1]), taken[1] + short[0])]
        zeros = age_order[advantages[age_order] == 0][: rows - sum(taken)]
        train = torch.cat([oldest_first[0][: taken[0]], oldest_first[1][: taken[1]], zeros])
        waiting = torch.cat([oldest_first[0][taken[0] :], oldest_first[1][taken[1] :]])
        fresh = pool.sampled_round.cpu()[waiting] > round_index - self.max_wait_rounds
        carry = waiting[fresh]
        return Selection(train=train, carry=carry, dropped=len(pool) - len(train) - len(carry))

    def split(self, batch: RolloutBatch, steps: int, generator: torch.Generator) -> list[Tensor]:
        advantages = batch.advantages.cpu()
        dealt = torch.cat([
            (rows := torch.nonzero(condition).squeeze(1))[torch.randperm(len(rows), generator=generator)]
            for condition in (advantages > 0, advantages < 0, advantages == 0)
        ])
        return [dealt[step::steps] for step in range(steps)]


def micro_batches(train: RolloutBatch, steps: list[Tensor], stats: dict[str, float], accumulation: int, world: int,
                  sum_over_processes: Callable[[Tensor], Tensor]) -> list[RolloutBatch]:
    """Cuts each of ``steps`` (row indices of ``train``) into ``accumulation`` micro-batches with the step's global counts.

    ``step_sequences`` and ``step_tokens`` count the whole step over all ``world`` processes, divided by
    the number of micro-batches that Lightning and DDP average over, so that normalising by
    them gives the same gradient however the step is split. A failed episode's row (inert, no token to credit) counts in
    neither; a step of nothing but such rows counts one of each, which no credit is divided by. The first micro-batch of
    each step carries the round's ``stats`` and the step's own, everything the step logs of them.
    """
    device = train.input_ids.device
    trained = ~train.failed
    counts = torch.stack([torch.stack([train.completion_mask[rows.to(device)].sum(), trained[rows.to(device)].sum()])
                          for rows in steps]).float()
    tokens, sequences = sum_over_processes(counts).clamp(min=1).unbind(1)
    batches = []
    for step, rows in enumerate(steps):
        signed = train.advantages[rows.to(device)] != 0
        step_stats = {}
        if signed.any():
            step_stats["batch/pos_share"] = ((train.advantages[rows.to(device)] > 0).sum() / signed.sum()).item()
        for micro, micro_rows in enumerate(rows.chunk(accumulation)):
            batch = train.select(micro_rows.to(device))
            batch.step_sequences = float(sequences[step]) / (world * accumulation)
            batch.step_tokens = float(tokens[step]) / (world * accumulation)
            batch.stats = {**stats, **step_stats} if micro == 0 else {}
            batches.append(batch)
    return batches


def groups_split(group_ids: Tensor, steps: list[Tensor]) -> int:
    """How many groups have rows in more than one of ``steps``."""
    step_of_row = torch.empty(len(group_ids), dtype=torch.long)
    for step, rows in enumerate(steps):
        step_of_row[rows.cpu()] = step
    pairs = torch.unique(torch.stack([group_ids.cpu(), step_of_row]), dim=1)
    return int((torch.unique(pairs[0], return_counts=True)[1] > 1).sum())
