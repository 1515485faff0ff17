"""Clipping of importance ratios: which members of a group keep their gradient.

A clip maps ratios ``r`` and advantages ``A`` to the surrogate to maximise and to a mask of the
entries whose gradient survives. Any clip zeroes the gradient of members on one side of the
advantage's sign once a shared token's ratio leaves the range, so their credits no longer cancel.
"""

from abc import ABC, abstractmethod
from dataclasses import dataclass

import torch
from torch import Tensor


@dataclass
class Clipped:
    """A clip's result, broadcast to the ratio's shape.

    Attributes:
        surrogate: the value to maximise, differentiable in the ratio.
        active: 1 where the surrogate's gradient w.r.t. the ratio is ``A``, 0 where clipping zeroed it.
        clipped_low: 1 where a ratio below the range was clipped (negative advantage).
        clipped_high: 1 where a ratio above the range was clipped (positive advantage, or the dual clip).
    """

    surrogate: Tensor
    active: Tensor
    clipped_low: Tensor
    clipped_high: Tensor


class Clip(ABC):
    @abstractmethod
    def __call__(self, ratio: Tensor, advantages: Tensor) -> Clipped:
        """Clips ``ratio`` given ``advantages`` (broadcastable to it)."""


class NoClip(Clip):
    """The plain importance-weighted surrogate ``r A``: every member keeps its gradient."""

    def __call__(self, ratio: Tensor, advantages: Tensor) -> Clipped:
        surrogate = ratio * advantages
        zeros = torch.zeros_like(surrogate)
        return Clipped(surrogate, torch.ones_like(surrogate), zeros, zeros)


class AsymmetricClip(Clip):
    """PPO's ``min(r A, clip(r, 1 - eps_low, 1 + eps_high) A)``; ``eps_high > eps_low`` is DAPO's clip-higher.

    Args:
        eps_low: lower clip range.
        eps_high: upper clip range.
    """

    def __init__(self, eps_low: float = 0.2, eps_high: float = 0.28):
        if not 0 < eps_low < 1 or eps_high <= 0:
            raise ValueError(f"{type(self).__name__}: need 0 < eps_low < 1 and eps_high > 0, got {eps_low} and {eps_high}")
        self.eps_low, self.eps_high = eps_low, eps_high

    def __call__(self, ratio: Tensor, advantages: Tensor) -> Clipped:
        unclipped = ratio * advantages
        clipped = ratio.clamp(1 - self.eps_low, 1 + self.eps_high) * advantages
        surrogate = torch.min(unclipped, clipped)
        active = (unclipped <= clipped).to(ratio.dtype)
        low = ((ratio < 1 - self.eps_low) & (advantages < 0)).to(ratio.dtype)
        high = ((ratio > 1 + self.eps_high) & (advantages > 0)).to(ratio.dtype)
        return Clipped(surrogate, active, low, high)


class SymmetricClip(AsymmetricClip):
    """PPO's ``min(r A, clip(r, 1 - eps, 1 + eps) A)``.

    Args:
        eps: clip range on both sides.
    """

    def __init__(self, eps: float = 0.2):
        super().__init__(eps, eps)


class DualClip(AsymmetricClip):
    """Dual-clip PPO: the PPO clip, and for negative advantages the surrogate is bounded below by ``c A``.

    Args:
        eps: clip range on both sides.
        c: lower bound factor (> 1); a ratio above ``c`` with a negative advantage gets no gradient.
    """

    def __init__(self, eps: float = 0.2, c: float = 3.0):
        super().__init__(eps, eps)
        if c <= 1:
            raise ValueError(f"DualClip: c must be > 1, got {c}")
        self.c = c

    def __call__(self, ratio: Tensor, advantages: Tensor) -> Clipped:
        ppo = super().__call__(ratio, advantages)
        bounded = (advantages < 0) & (ppo.surrogate < self.c * advantages)
        surrogate = torch.where(bounded, self.c * advantages, ppo.surrogate)
        active = ppo.active * (~bounded).to(ratio.dtype)
        return Clipped(surrogate, active, ppo.clipped_low, torch.maximum(ppo.clipped_high, bounded.to(ratio.dtype)))
