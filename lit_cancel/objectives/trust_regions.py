"""Trust regions that keep cancellation: per-token weights that treat every member of a group alike.

A trust region limits how far an off-policy step moves the policy by weighting each token's
policy-gradient credit with a factor computed under stop-gradient from the importance ratios
``r_it = exp(logp_it - logp_old_it)``. At a position every member of a group shares (same prefix,
same token) the ratio is the same for every member, so a factor that depends on ``r_it`` alone
(:class:`TokenRatioMask`, :class:`TokenRatioWeight`) or on the whole group (:class:`GroupRatioDrop`)
is the same for every member there, and their credits still cancel. PPO's clip is not of this
kind: it keeps or zeroes a token's gradient by the ratio *and the sign of the advantage*, so once a
shared ratio leaves its range it keeps one sign of member and drops the other.
"""

from abc import ABC, abstractmethod

from torch import Tensor

from lit_cancel.batch import RolloutBatch
from lit_cancel.objectives.group_transforms import MinReplace


class TrustRegion(ABC):
    @abstractmethod
    def __call__(self, log_ratio: Tensor, mask: Tensor, batch: RolloutBatch) -> Tensor:
        """``[B, C]`` weights (no grad) from the token log-ratios ``logp - logp_old`` (``[B, C]``, 0 on padding)."""


class _RatioRange(TrustRegion):
    """A trust region that asks whether a ratio lies in ``[1 - eps, 1 + eps]``."""

    def __init__(self, eps: float = 0.2):
        if not 0 < eps < 1:
            raise ValueError(f"{type(self).__name__}: eps must be in (0, 1), got {eps}")
        self.eps = eps

    def inside(self, log_ratio: Tensor) -> Tensor:
        return (log_ratio.exp() - 1).abs() <= self.eps


class TokenRatioMask(_RatioRange):
    """``1{|r_it - 1| <= eps}``: a token whose ratio left the range loses its gradient, whatever its advantage's sign.

    Args:
        eps: half-width of the range around 1.
    """

    def __call__(self, log_ratio: Tensor, mask: Tensor, batch: RolloutBatch) -> Tensor:
        return self.inside(log_ratio).to(mask.dtype) * mask


class GroupRatioDrop(_RatioRange):
    """A group leaves the step when any member's sequence ratio ``s_i = exp(mean_t log r_it)`` leaves ``[1 - eps, 1 + eps]``.

    Args:
        eps: half-width of the range around 1.
    """

    def __call__(self, log_ratio: Tensor, mask: Tensor, batch: RolloutBatch) -> Tensor:
        inside = self.inside((log_ratio * mask).sum(1) / mask.sum(1).clamp(min=1)).to(mask.dtype)
        # the group keeps its credit only when every member is inside: the group's smallest value, DFPO's min-replace
        kept = MinReplace()(inside, batch.advantages, batch.group_ids, members=mask.bool().any(1))
        return kept.unsqueeze(1) * mask


class TokenRatioWeight(TrustRegion):
    """``r_it`` itself: the per-token ratio stays in the gradient (``sg(w~_i) r_it grad logp_it`` under DFPO).

    Meant for DFPO's clip-free estimator, whose gradient otherwise carries only the group's
    sequence weight; it is not a bound, but it reweights each token by how far it has already moved.
    """

    def __call__(self, log_ratio: Tensor, mask: Tensor, batch: RolloutBatch) -> Tensor:
        return log_ratio.exp() * mask


TRUST_REGIONS: dict[str, type[TrustRegion]] = {
    region.__name__: region for region in (TokenRatioMask, GroupRatioDrop, TokenRatioWeight)
}
