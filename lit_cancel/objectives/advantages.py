"""Advantage estimators: rewards ``[num_groups, group_size]`` of one round to advantages of the same shape.

Every estimator here gives advantages that sum to zero within each group, the condition under which
equal credit on a shared token cancels.
"""

from abc import ABC, abstractmethod

from torch import Tensor


class AdvantageEstimator(ABC):
    """Turns the rewards of a round, one row per group, into advantages."""

    @abstractmethod
    def __call__(self, rewards: Tensor) -> Tensor:
        """Advantages ``[num_groups, group_size]``."""


class MeanCentred(AdvantageEstimator):
    """``A_i = r_i - mean_j r_j`` within the group (Dr. GRPO)."""

    def __call__(self, rewards: Tensor) -> Tensor:
        return rewards - rewards.mean(dim=1, keepdim=True)


class GroupNormalised(AdvantageEstimator):
    """``A_i = (r_i - mean_j r_j) / (std_j r_j + eps)`` within the group (GRPO); unbiased std.

    Args:
        eps: added to the std, so a group with equal rewards gets advantage 0, not NaN.
    """

    def __init__(self, eps: float = 1e-4):
        if eps <= 0:
            raise ValueError(f"GroupNormalised: eps must be > 0, got {eps}")
        self.eps = eps

    def __call__(self, rewards: Tensor) -> Tensor:
        return (rewards - rewards.mean(dim=1, keepdim=True)) / (rewards.std(dim=1, keepdim=True) + self.eps)


class LeaveOneOut(AdvantageEstimator):
    """``A_i = r_i - mean_{j != i} r_j`` (RLOO): each member's baseline excludes itself."""

    def __call__(self, rewards: Tensor) -> Tensor:
        size = rewards.shape[1]
        if size < 2:
            raise ValueError(f"LeaveOneOut needs groups of at least 2, got {size}")
        return rewards - (rewards.sum(dim=1, keepdim=True) - rewards) / (size - 1)


class BatchNormalised(AdvantageEstimator):
    """``A_i = (r_i - mean_group r) / (std_round r + eps)``: group-centred, scaled by the std of the whole round.

    The round is the process's own: under several processes each scales by its own rewards' std.

    Args:
        eps: added to the std.
    """

    def __init__(self, eps: float = 1e-4):
        if eps <= 0:
            raise ValueError(f"BatchNormalised: eps must be > 0, got {eps}")
        self.eps = eps

    def __call__(self, rewards: Tensor) -> Tensor:
        centred = rewards - rewards.mean(dim=1, keepdim=True)
        return centred / (rewards.std() + self.eps)
