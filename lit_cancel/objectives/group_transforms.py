"""Intra-group transforms of trajectory weights under stop-gradient (DFPO).

They make the non-advantage factor of the credit cancel within each group: ``MinReplace`` gives
every member the group's smallest weight; ``AdvOrthogonal`` removes the part of the weights that is
correlated with the advantages, so ``sum_i w_i A_i = 0``.
"""

from abc import ABC, abstractmethod

import torch
from torch import Tensor

from lit_cancel.objectives.advantages import takes_members


class GroupTransform(ABC):
    @abstractmethod
    def __call__(self, weights: Tensor, advantages: Tensor, group_ids: Tensor, members: Tensor | None = None) -> Tensor:
        """Transformed weights ``[B]`` from sequence weights, advantages and group ids, each ``[B]``, over each group's
        ``members`` (``[B]`` bool; every row when None): a row that is no member (a failed episode's) takes no part."""


def transformed(transform: GroupTransform, weights: Tensor, advantages: Tensor, group_ids: Tensor, members: Tensor | None) -> Tensor:
    """``transform`` of ``weights`` over each group's ``members``; a transform of your own written without ``members`` is
    called without them (where some rows are no member, it sees their weights, and their advantages of 0)."""
    if members is None or bool(members.all()) or not takes_members(transform):
        return transform(weights, advantages, group_ids)
    return transform(weights, advantages, group_ids, members=members)


class MinReplace(GroupTransform):
    """``w~_i = min_{j in group(i)} w_j`` over the group's members; a row of a group without members keeps its weight."""

    def __call__(self, weights: Tensor, advantages: Tensor, group_ids: Tensor, members: Tensor | None = None) -> Tensor:
        _, index = torch.unique(group_ids, return_inverse=True)
        groups = int(index.max()) + 1
        smallest = torch.full((groups,), float("inf"), dtype=weights.dtype, device=weights.device)
        candidates = weights if members is None else torch.where(members, weights, torch.full_like(weights, float("inf")))
        smallest = smallest.scatter_reduce(0, index, candidates, reduce="amin")
        if members is None:
            return smallest[index]
        counted = torch.zeros(groups, dtype=torch.long, device=weights.device).index_add(0, index, members.long())
        return torch.where(counted[index] > 0, smallest[index], weights)


class AdvOrthogonal(GroupTransform):
    """``w~ = w - (A^T w / |A|^2) A`` within each group, over its members; a group with ``A = 0`` keeps its weights."""

    def __call__(self, weights: Tensor, advantages: Tensor, group_ids: Tensor, members: Tensor | None = None) -> Tensor:
        _, index = torch.unique(group_ids, return_inverse=True)
        groups = int(index.max()) + 1
        if members is not None:
            advantages = advantages * members
        dot = torch.zeros(groups, dtype=weights.dtype, device=weights.device).index_add(0, index, weights * advantages)
        norm = torch.zeros(groups, dtype=weights.dtype, device=weights.device).index_add(0, index, advantages**2)
        coefficient = torch.where(norm > 0, dot / norm.clamp(min=torch.finfo(weights.dtype).tiny), torch.zeros_like(dot))
        return weights - coefficient[index] * advantages
