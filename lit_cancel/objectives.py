"""Objectives of the GRPO family.

Every objective has a gradient of the form ``-sum_{i,t} c_{i,t} grad logp_{i,t}`` and returns its
loss together with the detached per-token credits ``c`` (``ObjectiveOutput.credits``), so
instruments and tests can read them without knowing the objective.
"""

from abc import ABC, abstractmethod
from dataclasses import dataclass

import torch
from torch import Tensor

from lit_cancel.batch import RolloutBatch


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


def group_advantages(rewards: Tensor, scale_by_std: bool = True, eps: float = 1e-4) -> Tensor:
    """``r_i - mean(r)`` within each group (row of ``rewards``), divided by the group std if asked.

    Args:
        rewards: ``[num_groups, group_size]``.
        scale_by_std: divide by the unbiased standard deviation of the group plus ``eps``.
        eps: added to the std so that groups with equal rewards get advantage 0, not NaN.
    """
    centred = rewards - rewards.mean(dim=1, keepdim=True)
    if scale_by_std:
        centred = centred / (rewards.std(dim=1, keepdim=True) + eps)
    return centred


def k3_kl(logprobs: Tensor, ref_logprobs: Tensor) -> tuple[Tensor, Tensor]:
    """The k3 estimator of KL(policy || reference) per token, and its derivative w.r.t. ``logprobs``."""
    log_ratio = ref_logprobs - logprobs
    return log_ratio.exp() - log_ratio - 1, 1 - log_ratio.exp()


class Objective(ABC):
    """A policy-gradient objective over a :class:`RolloutBatch`.

    Attributes:
        kl_coef: weight of the KL penalty to the reference model; at 0 no reference model is built.
    """

    kl_coef: float = 0.0

    @abstractmethod
    def advantages(self, rewards: Tensor) -> Tensor:
        """Advantages ``[num_groups, group_size]`` from rewards of the same shape."""

    @abstractmethod
    def __call__(self, logprobs: Tensor, batch: RolloutBatch) -> ObjectiveOutput:
        """The loss and credits for ``logprobs`` (``[B, C]``, with grad) of ``batch``'s completions."""


class GRPO(Objective):
    """GRPO: PPO-clipped token ratios, group-normalised advantages, per-sequence token mean.

    ::

        r_it = exp(logp_it - logp_old_it)
        L = 1/S sum_i 1/|y_i| sum_t [ -min(r_it A_i, clip(r_it, 1-eps, 1+eps) A_i) + beta k3_it ]
        c_it = 1/(S |y_i|) [ r_it A_i 1{not clipped} + beta (exp(logp_ref_it - logp_it) - 1) ]

    ``S`` is ``batch.step_sequences``. The ``1/|y_i|`` normaliser gives tokens that every member of
    a group shares unequal credit when the members' lengths differ, so GRPO does not cancel on them.

    Args:
        clip_eps: PPO clip range ``eps``.
        kl_coef: ``beta``, weight of the k3 KL estimator to the reference model.
        scale_by_std: divide group-centred rewards by the group std.
    """

    def __init__(self, clip_eps: float = 0.2, kl_coef: float = 0.0, scale_by_std: bool = True):
        if clip_eps <= 0:
            raise ValueError(f"GRPO: clip_eps must be > 0, got {clip_eps}")
        if kl_coef < 0:
            raise ValueError(f"GRPO: kl_coef must be >= 0, got {kl_coef}")
        self.clip_eps, self.kl_coef, self.scale_by_std = clip_eps, kl_coef, scale_by_std

    def advantages(self, rewards: Tensor) -> Tensor:
        return group_advantages(rewards, self.scale_by_std)

    def __call__(self, logprobs: Tensor, batch: RolloutBatch) -> ObjectiveOutput:
        mask = batch.completion_mask.to(logprobs.dtype)
        old = logprobs.detach() if batch.old_logprobs is None else batch.old_logprobs
        advantages = batch.advantages.unsqueeze(1).to(logprobs.dtype)
        ratio = (logprobs - old).exp()
        clipped_ratio = ratio.clamp(1 - self.clip_eps, 1 + self.clip_eps)
        token_loss = -torch.min(ratio * advantages, clipped_ratio * advantages)
        active = (ratio * advantages <= clipped_ratio * advantages).to(logprobs.dtype)
        weight = mask / (mask.sum(1, keepdim=True).clamp(min=1) * batch.step_sequences)

        policy_loss = (token_loss * weight).sum()
        credits = ratio.detach() * advantages * active
        kl_loss = torch.zeros((), device=logprobs.device)
        if self.kl_coef > 0:
            kl, kl_grad = k3_kl(logprobs, batch.ref_logprobs)
            kl_loss = (kl * weight).sum()
            credits = credits - self.kl_coef * kl_grad.detach()
        loss = policy_loss + self.kl_coef * kl_loss

        tokens = mask.sum().clamp(min=1)
        metrics = {
            "loss/policy": policy_loss.detach(),
            "loss/kl": kl_loss.detach(),
            "objective/ratio_mean": (ratio.detach() * mask).sum() / tokens,
            "objective/clip_frac": ((1 - active) * mask).sum() / tokens,
            "objective/approx_kl": (0.5 * (logprobs.detach() - old) ** 2 * mask).sum() / tokens,
        }
        return ObjectiveOutput(loss=loss, credits=(credits * weight).detach(), metrics=metrics)
