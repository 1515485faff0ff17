"""Advantage estimators: rewards ``[num_groups, group_size]`` of one round to advantages of the same shape.

Every estimator here gives advantages that sum to zero within each group, the condition under which
equal credit on a shared token cancels.

A group's members are the rollouts that train: where an agent's episode failed (:mod:`lit_cancel.rounds.failures`), its
row stays in the group but is no member. An estimator takes ``members`` (``[num_groups, group_size]`` bool, None when
every row is one) and computes each group's advantages over its members alone, 0 for the rows that are not; so they
still sum to zero over the members. :func:`member_advantages` is how a round calls an estimator: it gives advantage 0 to
every row of a group with fewer than 2 members, and calls an estimator written without ``members`` (your own, for
the old signature ``__call__(self, rewards)``) as before where every row is a member, and on each group's members alone,
as a group of their own, where some are not.
"""

import inspect
from abc import ABC, abstractmethod
from collections.abc import Callable

import torch
from torch import Tensor


class AdvantageEstimator(ABC):
    """Turns the rewards of a round, one row per group, into advantages."""

    @abstractmethod
    def __call__(self, rewards: Tensor, members: Tensor | None = None) -> Tensor:
        """Advantages ``[num_groups, group_size]``, over each group's ``members`` (every row when None), 0 elsewhere."""


def takes_members(function: Callable) -> bool:
    """Whether ``function`` (an estimator, an objective's ``advantages``, a group transform) takes ``members``."""
    try:
        return "members" in inspect.signature(function).parameters
    except (TypeError, ValueError):
        return False


def member_advantages(estimate: Callable[..., Tensor], rewards: Tensor, members: Tensor | None) -> Tensor:
    """``estimate``'s advantages of ``rewards`` (``[num_groups, group_size]``) over each group's ``members`` (``[num_groups,
    group_size]`` bool; None, or all True: every row), 0 for the rows that are no member and for every row of a group
    with fewer than 2 members.

    Where every row is a member, ``estimate(rewards)``, exactly as an estimator written before members were; else
    ``estimate(rewards, members=members)`` where it takes them, and otherwise ``estimate`` of each group's members' rewards
    alone (``[1, members]``), the groups without a failed row together.
    """
    if members is None or bool(members.all()):
        return estimate(rewards)
    members = members.bool()
    counted = members.sum(1, keepdim=True)
    if takes_members(estimate):
        advantages = estimate(rewards, members=members)
    else:
        advantages = torch.zeros_like(rewards)
        whole = members.all(1)
        if whole.any():
            advantages[whole] = estimate(rewards[whole]).to(advantages.dtype)
        for group in torch.nonzero(~whole & (counted.squeeze(1) >= 2)).squeeze(1).tolist():
            kept = members[group]
            advantages[group, kept] = estimate(rewards[group, kept].unsqueeze(0)).squeeze(0).to(advantages.dtype)
    return torch.where(members & (counted >= 2), advantages, torch.zeros_like(advantages))


def _member_mean(rewards: Tensor, members: Tensor) -> Tensor:
    return (rewards * members).sum(1, keepdim=True) / members.sum(1, keepdim=True).clamp(min=1)


def _member_std(rewards: Tensor, members: Tensor) -> Tensor:
    """The unbiased std of each group's members' rewards (0 for a group of one member)."""
    centred = (rewards - _member_mean(rewards, members)) * members
    return ((centred**2).sum(1, keepdim=True) / (members.sum(1, keepdim=True) - 1).clamp(min=1)).sqrt()


class MeanCentred(AdvantageEstimator):
    """``A_i = r_i - mean_j r_j`` within the group (Dr. GRPO)."""

    def __call__(self, rewards: Tensor, members: Tensor | None = None) -> Tensor:
        if members is None:
            return rewards - rewards.mean(dim=1, keepdim=True)
        return (rewards - _member_mean(rewards, members)) * members


class GroupNormalised(AdvantageEstimator):
    """``A_i = (r_i - mean_j r_j) / (std_j r_j + eps)`` within the group (GRPO); unbiased std.

    Args:
        eps: added to the std, so a group with equal rewards gets advantage 0, not NaN.
    """

    def __init__(self, eps: float = 1e-4):
        if eps <= 0:
            raise ValueError(f"GroupNormalised: eps must be > 0, got {eps}")
        self.eps = eps

    def __call__(self, rewards: Tensor, members: Tensor | None = None) -> Tensor:
        if members is None:
            return (rewards - rewards.mean(dim=1, keepdim=True)) / (rewards.std(dim=1, keepdim=True) + self.eps)
        return (rewards - _member_mean(rewards, members)) / (_member_std(rewards, members) + self.eps) * members


class LeaveOneOut(AdvantageEstimator):
    """``A_i = r_i - mean_{j != i} r_j`` (RLOO): each member's baseline excludes itself."""

    def __call__(self, rewards: Tensor, members: Tensor | None = None) -> Tensor:
        size = rewards.shape[1]
        if size < 2:
            raise ValueError(f"LeaveOneOut needs groups of at least 2, got {size}")
        if members is None:
            return rewards - (rewards.sum(dim=1, keepdim=True) - rewards) / (size - 1)
        others = (members.sum(1, keepdim=True) - 1).clamp(min=1)
        return (rewards - ((rewards * members).sum(1, keepdim=True) - rewards) / others) * members


class BatchNormalised(AdvantageEstimator):
    """``A_i = (r_i - mean_group r) / (std_round r + eps)``: group-centred, scaled by the std of the whole round.

    The round is the process's own: under several processes each scales by its own rewards' std. With ``members``, the
    round's std is its members'.

    Args:
        eps: added to the std.
    """

    def __init__(self, eps: float = 1e-4):
        if eps <= 0:
            raise ValueError(f"BatchNormalised: eps must be > 0, got {eps}")
        self.eps = eps

    def __call__(self, rewards: Tensor, members: Tensor | None = None) -> Tensor:
        if members is None:
            centred = rewards - rewards.mean(dim=1, keepdim=True)
            return centred / (rewards.std() + self.eps)
        return (rewards - _member_mean(rewards, members)) * members / (rewards[members].std() + self.eps)
