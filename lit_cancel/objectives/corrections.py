"""Corrections for the mismatch between the engine that sampled the rollouts and the trainer's policy.

An engine with its own copy of the weights (vLLM, or any sampler in another precision) samples from
``pi_sampler``, not from the trainer's ``pi_old``. The policy-gradient term of the loss is then
weighted per token by ``rho_it``, a function of the log-ratio ``log pi_old(y_it) - log pi_sampler(y_it)``
under stop-gradient (the KL term is not weighted). The four modes of Hugging Face TRL and one of
lit_cancel's own:

* :class:`TokenTruncate` ``rho_it = clamp(exp(d_it), clip_min, clip_max)``
* :class:`TokenMask` ``rho_it = exp(d_it)`` inside ``[clip_min, clip_max]``, else 0
* :class:`SequenceTruncate` ``rho_i = clamp(exp(sum_t d_it), clip_min, clip_max)`` on every token of ``y_i``
* :class:`SequenceMask` ``rho_i = exp(sum_t d_it)`` inside ``[clip_min, clip_max]``, else 0
* :class:`GroupMin` a sequence correction made equal across the group: ``rho~_i = min_{j in group} rho_j``

Why the level matters for cancellation: at a position every member of a group shares, the context
and the token are the same for all of them, so ``d_it`` and a *token-level* ``rho_it`` are the
same too, and the shared credits still sum to ``sum_i A_i = 0``. A *sequence-level* ``rho_i``
depends on the member's own tokens, differs across the group, and multiplies the shared tokens'
credit as GSPO's sequence ratio does: they stop cancelling. :class:`GroupMin` applies DFPO's
min-replace to the correction weight, which makes it group-constant and restores cancellation.
"""

import math
from abc import ABC, abstractmethod

from torch import Tensor

from lit_cancel.objectives.group_transforms import MinReplace


class MismatchCorrection(ABC):
    """Per-token weights ``rho`` ``[B, C]`` for the policy-gradient term, from the sampler-to-trainer log-ratio."""

    @abstractmethod
    def __call__(self, log_ratio: Tensor, mask: Tensor, group_ids: Tensor) -> Tensor:
        """``rho`` from ``log_ratio = log pi_old - log pi_sampler`` (``[B, C]``, 0 on padding), the mask and the group ids."""


class _Bounded(MismatchCorrection):
    """A correction with bounds ``[clip_min, clip_max]`` on the importance ratio (None: unbounded on that side)."""

    def __init__(self, clip_max: float | None = 3.0, clip_min: float | None = None):
        name = type(self).__name__
        if clip_max is None and clip_min is None:
            raise ValueError(f"{name}: give clip_max, clip_min or both (an unbounded ratio has unbounded variance)")
        if (clip_max is not None and clip_max <= 0) or (clip_min is not None and clip_min < 0):
            raise ValueError(f"{name}: need clip_max > 0 and clip_min >= 0, got clip_max={clip_max} and clip_min={clip_min}")
        if clip_max is not None and clip_min is not None and clip_min >= clip_max:
            raise ValueError(f"{name}: need clip_min < clip_max, got clip_min={clip_min} and clip_max={clip_max}")
        self.clip_max, self.clip_min = clip_max, clip_min

    def truncated(self, ratio: Tensor) -> Tensor:
        return ratio.clamp(min=self.clip_min, max=self.clip_max)

    def masked(self, ratio: Tensor) -> Tensor:
        low = -math.inf if self.clip_min is None else self.clip_min
        high = math.inf if self.clip_max is None else self.clip_max
        return ratio.masked_fill((ratio < low) | (ratio > high), 0.0)


class TokenTruncate(_Bounded):
    """Token-level truncated importance sampling: ``rho_it = clamp(pi_old / pi_sampler, clip_min, clip_max)``.

    Keeps cancellation: a shared position has the same ratio for every member.

    Args:
        clip_max: upper bound of the ratio (TRL's default is 3).
        clip_min: lower bound of the ratio; None leaves it unbounded below.

    Example::

        GRPO(correction=TokenTruncate(clip_max=2.0))
    """

    def __call__(self, log_ratio: Tensor, mask: Tensor, group_ids: Tensor) -> Tensor:
        return self.truncated(log_ratio.exp()) * mask


class TokenMask(_Bounded):
    """Token-level masked importance sampling: ``rho_it = pi_old / pi_sampler`` inside ``[clip_min, clip_max]``, else 0.

    Keeps cancellation: a shared position has the same ratio, so the same mask, for every member.

    Args:
        clip_max: tokens whose ratio is above it get no gradient.
        clip_min: tokens whose ratio is below it get no gradient; None: no lower bound.
    """

    def __call__(self, log_ratio: Tensor, mask: Tensor, group_ids: Tensor) -> Tensor:
        return self.masked(log_ratio.exp()) * mask


class SequenceCorrection(_Bounded):
    """A correction that weights every token of a sequence alike, from the sequence's ratio ``exp(sum_t d_it)``."""

    @abstractmethod
    def sequence_weights(self, log_ratio: Tensor, mask: Tensor) -> Tensor:
        """``[B]`` one weight per sequence."""

    def __call__(self, log_ratio: Tensor, mask: Tensor, group_ids: Tensor) -> Tensor:
        return self.sequence_weights(log_ratio, mask).unsqueeze(1) * mask


class SequenceTruncate(SequenceCorrection):
    """Sequence-level truncated importance sampling: ``rho_i = clamp(prod_t pi_old / pi_sampler, clip_min, clip_max)``.

    Does not cancel: ``rho_i`` differs across members and multiplies their shared tokens' credit.
    :class:`GroupMin` around it does.

    Args:
        clip_max: upper bound of the sequence ratio.
        clip_min: lower bound; None leaves it unbounded below.
    """

    def sequence_weights(self, log_ratio: Tensor, mask: Tensor) -> Tensor:
        return self.truncated(log_ratio.sum(1).exp())


class SequenceMask(SequenceCorrection):
    """Sequence-level masked importance sampling (TRL's default mode): sequences whose ratio leaves
    ``[clip_min, clip_max]`` get no gradient, the others are weighted by their ratio.

    Does not cancel: ``rho_i`` differs across members and multiplies their shared tokens' credit.
    :class:`GroupMin` around it does.

    Args:
        clip_max: sequences whose ratio is above it are masked.
        clip_min: sequences whose ratio is below it are masked; None: no lower bound.
    """

    def sequence_weights(self, log_ratio: Tensor, mask: Tensor) -> Tensor:
        return self.masked(log_ratio.sum(1).exp())


class GroupMin(MismatchCorrection):
    """A sequence correction made group-constant: every member gets its group's smallest weight.

    DFPO's min-replace applied to the correction weight: ``rho~_i = min_{j in group(i)} rho_j``. The
    weight no longer depends on the member, so the shared tokens' credit cancels again, at the cost of
    the most conservative member's correction for the whole group (a masked member masks its group).

    Args:
        correction: the sequence-level correction whose weights are replaced.

    Example::

        GRPO(correction=GroupMin(SequenceTruncate(clip_max=3.0)))
    """

    def __init__(self, correction: SequenceCorrection):
        if not isinstance(correction, SequenceCorrection):
            raise ValueError(
                f"GroupMin: correction must be a sequence-level correction (SequenceTruncate, SequenceMask), got "
                f"{type(correction).__name__}; a token-level correction already keeps cancellation"
            )
        self.correction = correction

    def __call__(self, log_ratio: Tensor, mask: Tensor, group_ids: Tensor) -> Tensor:
        weights = self.correction.sequence_weights(log_ratio, mask)
        # a row with no token to credit (a failed episode's) has weight 1 from no ratio at all: it takes no part
        return MinReplace()(weights, weights, group_ids, members=mask.bool().any(1)).unsqueeze(1) * mask


CORRECTIONS = {
    "TokenTruncate": TokenTruncate,
    "TokenMask": TokenMask,
    "SequenceTruncate": SequenceTruncate,
    "SequenceMask": SequenceMask,
    "GroupMin(SequenceTruncate)": lambda: GroupMin(SequenceTruncate()),
    "GroupMin(SequenceMask)": lambda: GroupMin(SequenceMask()),
}
"""Each correction with its default bounds, by name (``lit-cancel audit-objective --correction``)."""
