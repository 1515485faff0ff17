"""The named objectives: small subclasses of :class:`PolicyGradient` that fix its parts.

Whether a preset cancels on tokens that every member of a group shares (same prefix, same next
token) depends on whether the non-advantage factor of the credit, ``w_it / N_it``, is equal across
the members there: the ratio at a shared position is the same for every member, so token ratios
keep it equal, and the normaliser and any sequence-level weight decide.

A preset is registered once, as a public name of ``lit_cancel`` (:mod:`lit_cancel.exports`): :data:`PRESETS` holds the
objectives exported from this module.
"""

from lit_cancel.exports import EXPORTS
from lit_cancel.objectives.advantages import GroupNormalised, LeaveOneOut, MeanCentred
from lit_cancel.objectives.clipping import AsymmetricClip, SymmetricClip
from lit_cancel.objectives.corrections import MismatchCorrection
from lit_cancel.objectives.group_transforms import AdvOrthogonal, GroupTransform, MinReplace
from lit_cancel.objectives.normalisers import ConstantLength, Normaliser, TokenMean
from lit_cancel.objectives.policy_gradient import Objective, PolicyGradient
from lit_cancel.objectives.trust_regions import TokenRatioMask, TrustRegion


class GRPO(PolicyGradient):
    """GRPO: token ratios, PPO clip, group mean/std advantages, per-sequence token mean::

        L = -1/S sum_i 1/|y_i| sum_t min(r_it A_i, clip(r_it, 1-eps, 1+eps) A_i)

    Does not cancel when members' lengths differ (``1/|y_i|``), nor once a shared ratio leaves the clip range.

    Args:
        clip_eps: PPO clip range.
        kl_coef: weight of the KL to the reference model.
        kl_estimator: ``"k1"``, ``"k2"`` or ``"k3"``.
        scale_by_std: divide group-centred rewards by the group std.
        entropy_coef: weight of the entropy bonus.
        correction: weights for a sampler/trainer mismatch (vLLM rollouts); see :mod:`lit_cancel.objectives.corrections`.
    """

    def __init__(
        self, clip_eps: float = 0.2, kl_coef: float = 0.0, kl_estimator: str = "k3", scale_by_std: bool = True, entropy_coef: float = 0.0,
        correction: MismatchCorrection | None = None,
    ):
        super().__init__(
            advantage=GroupNormalised() if scale_by_std else MeanCentred(), ratio="token", clip=SymmetricClip(clip_eps),
            kl_coef=kl_coef, kl_estimator=kl_estimator, entropy_coef=entropy_coef, correction=correction,
        )


class DrGRPO(PolicyGradient):
    """Dr. GRPO: GRPO without the std and without the per-sequence length normaliser::

        L = -1/(S L) sum_i sum_t min(r_it A_i, clip(r_it, 1-eps, 1+eps) A_i),   A_i = r_i - mean(r)

    Cancels: every member's shared token gets ``A_i / (S L)`` while its ratio is inside the clip range.

    Args:
        clip_eps: PPO clip range.
        length: the constant ``L`` (Dr. GRPO uses the generation budget); set it near ``max_new_tokens``.
        kl_coef: weight of the KL to the reference model.
        entropy_coef: weight of the entropy bonus.
        correction: weights for a sampler/trainer mismatch (vLLM rollouts); see :mod:`lit_cancel.objectives.corrections`.
    """

    def __init__(
        self, clip_eps: float = 0.2, length: float = 64.0, kl_coef: float = 0.0, entropy_coef: float = 0.0,
        correction: MismatchCorrection | None = None,
    ):
        super().__init__(
            advantage=MeanCentred(), ratio="token", clip=SymmetricClip(clip_eps), normaliser=ConstantLength(length),
            kl_coef=kl_coef, entropy_coef=entropy_coef, correction=correction,
        )


class DAPO(PolicyGradient):
    """DAPO: clip-higher and a token mean over the whole optimizer step::

        L = -1/T sum_{i,t} min(r_it A_i, clip(r_it, 1-eps_low, 1+eps_high) A_i)

    ``T`` counts the step's tokens across micro-batches and processes. Cancels on-policy; off-policy
    the asymmetric range clips one sign of advantage once a shared ratio leaves it. (DAPO's dynamic
    sampling is a batching policy, not part of the loss.)

    Args:
        eps_low: lower clip range.
        eps_high: upper clip range.
        kl_coef: weight of the KL to the reference model (DAPO uses none).
        entropy_coef: weight of the entropy bonus.
        correction: weights for a sampler/trainer mismatch (vLLM rollouts); see :mod:`lit_cancel.objectives.corrections`.
    """

    def __init__(
        self, eps_low: float = 0.2, eps_high: float = 0.28, kl_coef: float = 0.0, entropy_coef: float = 0.0,
        correction: MismatchCorrection | None = None,
    ):
        super().__init__(
            advantage=GroupNormalised(), ratio="token", clip=AsymmetricClip(eps_low, eps_high), normaliser=TokenMean(),
            kl_coef=kl_coef, entropy_coef=entropy_coef, correction=correction,
        )


class GSPO(PolicyGradient):
    """GSPO: one length-normalised ratio per sequence multiplies every token of it::

        s_i = exp(mean_t (logp_it - logp_old_it)),   L = -1/S sum_i min(s_i A_i, clip(s_i, 1-eps_low, 1+eps_high) A_i)

    Does not cancel off-policy: ``s_i`` couples each token's credit to its whole sequence and
    differs across members, and ``1/|y_i|`` differs with their lengths.

    Args:
        eps_low: lower clip range (GSPO's are tiny because ``s_i`` averages over the sequence).
        eps_high: upper clip range.
        kl_coef: weight of the KL to the reference model.
        correction: weights for a sampler/trainer mismatch (vLLM rollouts); see :mod:`lit_cancel.objectives.corrections`.
    """

    def __init__(self, eps_low: float = 3e-4, eps_high: float = 4e-4, kl_coef: float = 0.0, correction: MismatchCorrection | None = None):
        super().__init__(
            advantage=GroupNormalised(), ratio="sequence", clip=AsymmetricClip(eps_low, eps_high), kl_coef=kl_coef,
            correction=correction,
        )


class _DFPO(PolicyGradient):
    """DFPO's estimator around a group transform of the sequence ratios (subclasses name the transform)."""

    transform: type[GroupTransform]

    def __init__(
        self, length: float = 64.0, normaliser: Normaliser | None = None, kl_coef: float = 0.0,
        correction: MismatchCorrection | None = None, trust_region: TrustRegion | None = None,
    ):
        super().__init__(
            advantage=GroupNormalised(), ratio="sequence", group_transform=self.transform(),
            normaliser=normaliser or ConstantLength(length), kl_coef=kl_coef, correction=correction,
            trust_region=trust_region,
        )


class DFPOMin(_DFPO):
    """DFPO with min-replace: every member is weighted by its group's smallest sequence ratio::

        w~_i = min_j s_j (stop-gradient),   L = -1/(S L) sum_{i,t} w~_i A_i logp_it

    Clip-free and linear in ``logp``. Cancels: the weight and the normaliser are equal across the group.
    DFPO's normaliser is not public; the default is a constant length (``ConstantLength``), an option.

    Args:
        length: the constant ``L`` of the default normaliser.
        normaliser: another normaliser; it must be equal across a group's members to cancel.
        kl_coef: weight of the KL to the reference model.
        correction: weights for a sampler/trainer mismatch (vLLM rollouts); see :mod:`lit_cancel.objectives.corrections`.
        trust_region: an off-policy bound that keeps cancelling (:mod:`lit_cancel.objectives.trust_regions`); none by default.
    """

    transform = MinReplace


class DFPOOrth(_DFPO):
    """DFPO with the advantage-orthogonal transform of the sequence ratios::

        w~ = s - (A^T s / |A|^2) A (per group, stop-gradient),   L = -1/(S L) sum_{i,t} w~_i A_i logp_it

    Clip-free and linear in ``logp``. Cancels: ``sum_i w~_i A_i = 0`` in every group by construction.
    The default normaliser (a constant length) is our choice; DFPO's is not public.

    Args:
        length: the constant ``L`` of the default normaliser.
        normaliser: another normaliser; it must be equal across a group's members to cancel.
        kl_coef: weight of the KL to the reference model.
        correction: weights for a sampler/trainer mismatch (vLLM rollouts); see :mod:`lit_cancel.objectives.corrections`.
        trust_region: an off-policy bound that keeps cancelling (:mod:`lit_cancel.objectives.trust_regions`); none by default.
    """

    transform = AdvOrthogonal


class DFPOMinTR(DFPOMin):
    """DFPOMin with a trust region that keeps cancelling: tokens whose ratio left ``[1 - eps, 1 + eps]`` lose their gradient::

        L = -1/(S L) sum_{i,t} w~_i A_i 1{|r_it - 1| <= eps} logp_it,   w~_i = min_j s_j (stop-gradient)

    The mask depends on ``r_it`` alone, which every member shares at a shared position, so the
    credits there still cancel; PPO's clip also depends on the advantage's sign and does not.
    Use it when rollouts are reused (``epochs_per_round > 1``) or split into several mini-batches:
    on ScaffoldedAdditionTask at two epochs and two mini-batches per round (docs/experiments.md, E7)
    it recovered most of clip-free DFPOMin's loss and ended 0.06 below GRPO, the best of the three
    trust regions.

    Args:
        eps: half-width of the token-ratio range.
        length: the constant ``L`` of the default normaliser.
        normaliser: another normaliser; it must be equal across a group's members to cancel.
        kl_coef: weight of the KL to the reference model.
        correction: weights for a sampler/trainer mismatch (vLLM rollouts); see :mod:`lit_cancel.objectives.corrections`.
    """

    def __init__(
        self, eps: float = 0.2, length: float = 64.0, normaliser: Normaliser | None = None, kl_coef: float = 0.0,
        correction: MismatchCorrection | None = None,
    ):
        super().__init__(length, normaliser, kl_coef, correction, trust_region=TokenRatioMask(eps))


class RLOO(PolicyGradient):
    """RLOO: leave-one-out baseline, token ratios with the PPO clip, token mean over the step::

        A_i = r_i - mean_{j != i} r_j,   L = -1/T sum_{i,t} min(r_it A_i, clip(r_it, 1-eps, 1+eps) A_i)

    Cancels while shared ratios are inside the clip range (leave-one-out advantages sum to zero).

    Args:
        clip_eps: PPO clip range.
        kl_coef: weight of the KL to the reference model.
        correction: weights for a sampler/trainer mismatch (vLLM rollouts); see :mod:`lit_cancel.objectives.corrections`.
    """

    def __init__(self, clip_eps: float = 0.2, kl_coef: float = 0.0, correction: MismatchCorrection | None = None):
        super().__init__(
            advantage=LeaveOneOut(), ratio="token", clip=SymmetricClip(clip_eps), normaliser=TokenMean(), kl_coef=kl_coef,
            correction=correction,
        )


PRESETS: dict[str, type[Objective]] = {name: value for name, value in list(globals().items())
                                       if isinstance(value, type) and EXPORTS.get(name) == __name__}
