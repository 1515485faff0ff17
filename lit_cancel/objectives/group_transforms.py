"""Intra-group transforms of trajectory weights under stop-gradient (DFPO).

They make the non-advantage factor of the credit cancel within each group: ``MinReplace`` gives
every member the group's smallest weight; ``AdvOrthogonal`` removes the part of the weights that is
correlated with the advantages, so ``sum_i w_i A_i = 0``.
"""

from abc import ABC, abstractmethod

import torch
from torch import Tensor


class GroupTransform(ABC):
    @abstractmethod
    def __call__(self, weights: Tensor, advantages: Tensor, group_ids: Tensor) -> Tensor:
        """Transformed weights ``[B]`` from sequence weights, advantages and group ids, each ``[B]``."""


class MinReplace(GroupTransform):
    """``w~_i = min_{j in group(i)} w_j``."""

    def __call__(self, weights: Tensor, advantages: Tensor, group_ids: Tensor) -> Tensor:
        _, index = torch.unique(group_ids, return_inverse=True)
        smallest = torch.full((int(index.max()) + 1,), float("inf"), dtype=weights.dtype, device=weights.device)
        smallest = smallest.scatter_reduce(0, index, weights, reduce="amin")
        return smallest[index]


class AdvOrthogonal(GroupTransform):
    """``w~ = w - (A^T w / |A|^2) A`` within each group; a group with ``A = 0`` keeps its weights."""

    def __call__(self, weights: Tensor, advantages: Tensor, group_ids: Tensor) -> Tensor:
        _, index = torch.unique(group_ids, return_inverse=True)
        groups = int(index.max()) + 1
        dot = torch.zeros(groups, dtype=weights.dtype, device=weights.device).index_add(0, index, weights * advantages)
        norm = torch.zeros(groups, dtype=weights.dtype, device=weights.device).index_add(0, index, advantages**2)
        coefficient = torch.where(norm > 0, dot / norm.clamp(min=torch.finfo(weights.dtype).tiny), torch.zeros_like(dot))
        return weights - coefficient[index] * advantages
