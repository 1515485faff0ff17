"""Objectives of the GRPO family, composed from small parts.

Every objective has a gradient of the form ``-sum_{i,t} c_{i,t} grad logp_{i,t}`` and returns its
loss together with the detached per-token credits ``c`` (``ObjectiveOutput.credits``), so
instruments and tests can read them without knowing the objective. The named presets are in
:mod:`lit_cancel.objectives.presets`.
"""

from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import Literal

import torch
from torch import Tensor

from lit_cancel.batch import RolloutBatch
from lit_cancel.objectives.advantages import AdvantageEstimator, GroupNormalised, member_advantages
from lit_cancel.objectives.clipping import Clip, NoClip, SymmetricClip
from lit_cancel.objectives.corrections import MismatchCorrection
from lit_cancel.objectives.group_transforms import GroupTransform, transformed
from lit_cancel.objectives.normalisers import Normaliser, SequenceMean
from lit_cancel.objectives.trust_regions import TrustRegion


@dataclass
class ObjectiveOutput:
    """What an objective returns.

    Attributes:
        loss: the scalar to minimise.
        credits: ``[B, C]`` detached; ``-d loss / d logprobs``, zero on padding.
        metrics: scalars to log, keyed by their full metric name (``loss/...``, ``objective/...``).
    """

    loss: Tensor
    credits: Tensor
    metrics: dict[str, Tensor]


class Objective(ABC):
    """A policy-gradient objective over a :class:`RolloutBatch`.

    Attributes:
        kl_coef: weight of the KL penalty to the reference model; at 0 no reference model is built.
    """

    kl_coef: float = 0.0

    @abstractmethod
    def advantages(self, rewards: Tensor, members: Tensor | None = None) -> Tensor:
        """Advantages ``[num_groups, group_size]`` from rewards of the same shape, over each group's ``members`` (``[num_groups,
        group_size]`` bool, every row when None; a failed episode's row is none), 0 for the other rows. A round calls it
        through :func:`~lit_cancel.objectives.advantages.member_advantages`, which calls an objective of your own written
        without ``members`` on each group's members alone where some rows are not."""

    @abstractmethod
    def __call__(self, logprobs: Tensor, batch: RolloutBatch) -> ObjectiveOutput:
        """The loss and credits for ``logprobs`` (``[B, C]``, with grad) of ``batch``'s completions."""

    def credits_need_values(self, old_logprobs: bool, sampler_logprobs: bool) -> bool:
        """Whether the output depends on the log-prob values of the training pass, for batches with (or without) old and
        sampler log-probs. Where it does not, the training pass may send each chunk's gradient back as soon as its forward
        ends (:func:`lit_cancel.logprobs.backward_by_chunk`). An objective of your own is taken to depend on them."""
        return True


def kl_estimate(logprobs: Tensor, ref_logprobs: Tensor, estimator: str) -> tuple[Tensor, Tensor]:
    """A per-token estimate of KL(policy || reference) and its derivative w.r.t. ``logprobs``.

    ``k1 = logp - logp_ref``, ``k2 = (logp - logp_ref)^2 / 2``, ``k3 = exp(logp_ref - logp) - (logp_ref - logp) - 1``.
    """
    delta = logprobs - ref_logprobs
    if estimator == "k1":
        return delta, torch.ones_like(delta)
    if estimator == "k2":
        return 0.5 * delta**2, delta
    if estimator == "k3":
        return (-delta).exp() + delta - 1, 1 - (-delta).exp()
    raise ValueError(f"kl_estimator must be 'k1', 'k2' or 'k3', got {estimator!r}")


def mismatch_metrics(log_ratio: Tensor, mask: Tensor) -> dict[str, Tensor]:
    """Mean and largest ``|log pi_old - log pi_sampler|`` over completion tokens, and the k3 estimate of
    KL(sampler || trainer), ``E[r - 1 - log r]`` with ``r = pi_old / pi_sampler`` on the sampler's tokens."""
    tokens = mask.sum().clamp(min=1)
    gap = log_ratio.abs() * mask
    return {
        "rollout/logprob_mismatch": gap.sum() / tokens,
        "rollout/logprob_mismatch_max": gap.max(),
        "rollout/sampler_kl": ((log_ratio.exp() - 1 - log_ratio) * mask).sum() / tokens,
    }


@dataclass
class Term:
    """A term of a :class:`PolicyGradient`'s loss: its value, its detached credits (``-d loss / d logprobs``) and what it logs."""

    loss: Tensor
    credits: Tensor
    metrics: dict[str, Tensor]


class PolicyGradient(Objective):
    """The family's common form, composed from parts::

        w_it  = exp(logp_it - logp_old_it)                              ratio="token"
        w_i   = exp(mean_t (logp_it - logp_old_it))                      ratio="sequence" (GSPO)
        L     = -sum_{i,t} clip(w, A_i) / N_it + beta sum KL_it / N_it - alpha sum H^_it / N_it
        c_it  = w A_i 1{not clipped} / N_it  (token)   or   w_i A_i 1{not clipped} mean_t'(1/N_it')  (sequence)

    With a ``group_transform`` (DFPO) the estimator is clip-free and linear: the sequence weights are
    transformed within each group under stop-gradient, ``L = -sum sg(w~_i) A_i logp_it / N_it`` and
    ``c_it = w~_i A_i / N_it``. The entropy bonus uses the sampled tokens' estimate
    ``grad H ~ -sum sg(logp) grad logp``, so the credit form still holds.

    Logged: ``objective/kl_share``, the share of the credits' absolute mass that the KL term gives,
    ``sum |beta dKL_it / N_it| / (sum |c_it of the policy term| + sum |beta dKL_it / N_it|)`` over the
    micro-batch's completion tokens (the entropy bonus's left out; 0 without a KL term).

    When the rollouts come from an engine with its own copy of the weights (the batch carries
    ``sampler_logprobs``), the mismatch is logged (``rollout/logprob_mismatch``, ``..._max``,
    ``rollout/sampler_kl``) and, with a ``correction``, the policy-gradient term's ``1 / N_it`` is
    multiplied by its weight ``rho_it`` (see :mod:`lit_cancel.objectives.corrections`). A ``trust_region``
    multiplies it likewise by a weight computed from the token ratios under stop-gradient (see
    :mod:`lit_cancel.objectives.trust_regions`); it is the off-policy bound of the clip-free DFPO estimator.

    A row with no token in its completion mask (a failed episode's, :mod:`lit_cancel.rounds.failures`) gets no credit and
    no loss: its ratios and normaliser are finite (a sequence ratio of no token is 1), and a group transform takes only
    the rows with a token to credit as the group's members.

    Args:
        advantage: advantage estimator; :class:`GroupNormalised` when None.
        ratio: ``"token"`` or ``"sequence"`` (the length-normalised sequence ratio, GSPO).
        clip: ratio clipping; :class:`SymmetricClip` when None. Must be :class:`NoClip` with a group transform.
        normaliser: ``N``; :class:`SequenceMean` when None.
        group_transform: DFPO's intra-group transform of the sequence weights; needs ``ratio="sequence"``.
        kl_coef: ``beta``, weight of the KL to the reference model.
        kl_estimator: ``"k1"``, ``"k2"`` or ``"k3"``.
        entropy_coef: ``alpha``, weight of the entropy bonus.
        correction: weights for the sampler/trainer mismatch; None applies none (the mismatch is still logged).
        trust_region: per-token weights from the ratios, e.g. :class:`TokenRatioMask`; None applies none.
    """

    def __init__(
        self,
        advantage: AdvantageEstimator | None = None,
        ratio: Literal["token", "sequence"] = "token",
        clip: Clip | None = None,
        normaliser: Normaliser | None = None,
        group_transform: GroupTransform | None = None,
        kl_coef: float = 0.0,
        kl_estimator: Literal["k1", "k2", "k3"] = "k3",
        entropy_coef: float = 0.0,
        correction: MismatchCorrection | None = None,
        trust_region: TrustRegion | None = None,
    ):
        name = type(self).__name__
        if ratio not in ("token", "sequence"):
            raise ValueError(f"{name}: ratio must be 'token' or 'sequence', got {ratio!r}")
        if kl_estimator not in ("k1", "k2", "k3"):
            raise ValueError(f"{name}: kl_estimator must be 'k1', 'k2' or 'k3', got {kl_estimator!r}")
        if kl_coef < 0 or entropy_coef < 0:
            raise ValueError(f"{name}: kl_coef and entropy_coef must be >= 0, got {kl_coef} and {entropy_coef}")
        if clip is None:
            clip = NoClip() if group_transform is not None else SymmetricClip()
        if group_transform is not None and (ratio != "sequence" or not isinstance(clip, NoClip)):
            raise ValueError(f"{name}: a group_transform weights whole trajectories: it needs ratio='sequence' and clip NoClip")
        self.advantage = advantage or GroupNormalised()
        self.ratio, self.clip, self.normaliser = ratio, clip, normaliser or SequenceMean()
        self.group_transform = group_transform
        self.kl_coef, self.kl_estimator, self.entropy_coef = kl_coef, kl_estimator, entropy_coef
        self.correction, self.trust_region = correction, trust_region

    def advantages(self, rewards: Tensor, members: Tensor | None = None) -> Tensor:
        return member_advantages(self.advantage, rewards, members)

    def credits_need_values(self, old_logprobs: bool, sampler_logprobs: bool) -> bool:
        """Without old and sampler log-probs every ratio is ``exp(logp - sg(logp)) = 1``, and the parts (clip, normaliser,
        trust region, group transform) see only ratios: the output is a function of the batch alone, unless a KL or
        entropy term reads the values, or a subclass computes the loss its own way (overrides one of the methods that
        make it)."""
        own_loss = any(getattr(type(self), name) is not getattr(PolicyGradient, name) for name in _LOSS_METHODS)
        return own_loss or old_logprobs or sampler_logprobs or self.kl_coef > 0 or self.entropy_coef > 0

    def __call__(self, logprobs: Tensor, batch: RolloutBatch) -> ObjectiveOutput:
        check_step_counts(type(self).__name__, batch)
        mask = batch.completion_mask.to(logprobs.dtype)
        old = logprobs.detach() if batch.old_logprobs is None else batch.old_logprobs
        inverse_n = mask / self.normaliser(batch)
        log_ratio = (logprobs - old) * mask
        policy_n, corrected = self.mismatch_corrected(inverse_n, old, batch, mask)
        policy_n, bounded = self.within_trust_region(policy_n, log_ratio, batch, mask)
        weight = log_ratio.exp() if self.ratio == "token" else (log_ratio.sum(1, keepdim=True) / sequence_lengths(mask)).exp()
        policy = self.policy_term(logprobs, weight, policy_n, batch, mask)
        kl = self.kl_term(logprobs, batch.ref_logprobs, inverse_n) if self.kl_coef > 0 else None
        entropy = self.entropy_term(logprobs, inverse_n) if self.entropy_coef > 0 else None
        zero, tokens = torch.zeros((), device=logprobs.device), mask.sum().clamp(min=1)
        loss, credits, metrics = policy.loss, policy.credits, {"loss/kl": zero} | corrected | bounded | policy.metrics
        for term in (kl, entropy):
            if term is not None:
                loss, credits, metrics = loss + term.loss, credits + term.credits, metrics | term.metrics
        policy_mass, kl_mass = (policy.credits * mask).abs().sum(), zero if kl is None else (kl.credits * mask).abs().sum()
        mass = policy_mass + kl_mass
        metrics |= {
            "objective/ratio_mean": (weight.detach() * mask).sum() / tokens,
            "objective/approx_kl": (0.5 * (logprobs.detach() - old) ** 2 * mask).sum() / tokens,
            "objective/kl_share": torch.where(mass > 0, kl_mass / mass.clamp(min=torch.finfo(mass.dtype).tiny), 0.0),
        }
        return ObjectiveOutput(loss=loss, credits=(credits * mask).detach(), metrics=metrics)

    def mismatch_corrected(self, inverse_n: Tensor, old: Tensor, batch: RolloutBatch, mask: Tensor) -> tuple[Tensor, dict[str, Tensor]]:
        """The policy term's ``1 / N``, times the correction's weight ``rho`` where the rollouts come from an engine with its
        own copy of the weights (``sampler_logprobs``) and the objective has a ``correction``; the mismatch's metrics."""
        if batch.sampler_logprobs is None:
            return inverse_n, {}
        sampler_log_ratio = (old - batch.sampler_logprobs) * mask
        metrics = mismatch_metrics(sampler_log_ratio, mask)
        if self.correction is None:
            return inverse_n, metrics
        correction = self.correction(sampler_log_ratio, mask, batch.group_ids)
        tokens = mask.sum().clamp(min=1)
        return inverse_n * correction, metrics | {
            "objective/correction_mean": correction.sum() / tokens,
            "objective/correction_zero_frac": ((correction == 0) * mask).sum() / tokens,
        }

    def within_trust_region(self, policy_n: Tensor, log_ratio: Tensor, batch: RolloutBatch,
                            mask: Tensor) -> tuple[Tensor, dict[str, Tensor]]:
        """``policy_n`` times the ``trust_region``'s weights of the token ratios (stop-gradient), where the objective has one."""
        if self.trust_region is None:
            return policy_n, {}
        region = self.trust_region(log_ratio.detach(), mask, batch)
        tokens = mask.sum().clamp(min=1)
        return policy_n * region, {
            "objective/trust_region_mean": (region * mask).sum() / tokens,
            "objective/trust_region_zero_frac": ((region == 0) * mask).sum() / tokens,
        }

    def policy_term(self, logprobs: Tensor, weight: Tensor, policy_n: Tensor, batch: RolloutBatch, mask: Tensor) -> Term:
        """The policy-gradient term of the ratios ``weight``: DFPO's clip-free estimator over the group-transformed
        weights with a ``group_transform``, else the clipped surrogate."""
        advantages = batch.advantages.to(logprobs.dtype).unsqueeze(1)
        zeros, tokens = torch.zeros_like(mask), mask.sum().clamp(min=1)
        if self.group_transform is not None:
            # a row with no token to credit (a failed episode's) has a weight of no ratio at all: it is no member
            weights = transformed(self.group_transform, weight.detach().squeeze(1), batch.advantages.to(logprobs.dtype),
                                  batch.group_ids, members=mask.bool().any(1))
            credits = weights.unsqueeze(1) * advantages * policy_n
            # value w~ A / N at the current point, gradient w~ A grad logp / N
            loss = -(credits * (logprobs - logprobs.detach() + 1)).sum()
            clipped_low, clipped_high = zeros, zeros
        else:
            clipped = self.clip(weight, advantages)
            if self.ratio == "token":
                loss = -(clipped.surrogate * policy_n).sum()
                credits = weight.detach() * advantages * clipped.active * policy_n
            else:
                per_sequence_n = policy_n.sum(1, keepdim=True)
                loss = -(clipped.surrogate * per_sequence_n).sum()
                credits = weight.detach() * advantages * clipped.active * per_sequence_n / sequence_lengths(mask) * mask
            clipped_low, clipped_high = clipped.clipped_low * mask, clipped.clipped_high * mask
        return Term(loss, credits, {"loss/policy": loss.detach(), "objective/clip_frac_low": clipped_low.sum() / tokens,
                                    "objective/clip_frac_high": clipped_high.sum() / tokens})

    def kl_term(self, logprobs: Tensor, ref_logprobs: Tensor, inverse_n: Tensor) -> Term:
        """``beta sum KL_it / N_it``, the KL to the reference model by the objective's estimator (``loss/kl`` logs the sum)."""
        kl, derivative = kl_estimate(logprobs, ref_logprobs, self.kl_estimator)
        kl_loss = (kl * inverse_n).sum()
        return Term(self.kl_coef * kl_loss, -(self.kl_coef * derivative.detach() * inverse_n), {"loss/kl": kl_loss.detach()})

    def entropy_term(self, logprobs: Tensor, inverse_n: Tensor) -> Term:
        """The entropy bonus ``-alpha sum H^_it / N_it`` by the sampled tokens' estimate ``grad H ~ -sum sg(logp) grad logp``."""
        sampled = logprobs.detach()
        # value: alpha * sum logp / N (minus the sampled entropy estimate); gradient alpha sg(logp) grad logp / N
        bonus = (sampled * (logprobs - sampled + 1) * inverse_n).sum()
        return Term(self.entropy_coef * bonus, -(self.entropy_coef * sampled * inverse_n),
                    {"loss/entropy_bonus": self.entropy_coef * bonus.detach()})


def sequence_lengths(mask: Tensor) -> Tensor:
    """``[B, 1]`` completion tokens per row, at least 1."""
    return mask.sum(1, keepdim=True).clamp(min=1)


def check_step_counts(name: str, batch: RolloutBatch) -> None:
    """Raises ValueError, saying how to set them, when ``batch`` lacks the optimizer step's counts the normalisers divide by."""
    if batch.step_sequences <= 0 or batch.step_tokens <= 0:
        raise ValueError(
            f"{name} needs the optimizer step's counts on the RolloutBatch, got step_sequences="
            f"{batch.step_sequences} and step_tokens={batch.step_tokens}: for a step of one micro-batch on one process "
            f"set step_sequences=len(batch) and step_tokens=float(batch.completion_mask.sum()) "
            f"(RolloutDataModule sets both, divided by the micro-batches and processes averaged over)"
        )


# the methods of PolicyGradient that compute its output from the log-probs
_LOSS_METHODS = ("__call__", "mismatch_corrected", "within_trust_region", "policy_term", "kl_term", "entropy_term")
