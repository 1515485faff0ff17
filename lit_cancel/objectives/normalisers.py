"""Normalisers ``N_it``: what each token's loss is divided by.

All of them use counts of the whole optimizer step (``RolloutBatch.step_sequences`` and
``step_tokens``), so a loss does not change when the step is split into micro-batches or processes.
A normaliser that is equal for every member of a group keeps shared tokens' credits cancelling;
``SequenceMean`` is not.
"""

from abc import ABC, abstractmethod

import torch
from torch import Tensor

from lit_cancel.batch import RolloutBatch


class Normaliser(ABC):
    @abstractmethod
    def __call__(self, batch: RolloutBatch) -> Tensor:
        """``N``, broadcastable to ``[B, C]``."""


class SequenceMean(Normaliser):
    """``N_it = |y_i| S``: mean over each sequence's tokens, then over the step's sequences (GRPO).

    Members of unequal length give a shared token unequal credit.
    """

    def __call__(self, batch: RolloutBatch) -> Tensor:
        return batch.completion_mask.sum(1, keepdim=True).clamp(min=1) * batch.step_sequences


class TokenMean(Normaliser):
    """``N = T``: mean over all completion tokens of the optimizer step, across micro-batches and processes (DAPO)."""

    def __call__(self, batch: RolloutBatch) -> Tensor:
        return torch.tensor(float(batch.step_tokens), device=batch.completion_mask.device)


class ConstantLength(Normaliser):
    """``N = L S``: token sum of each sequence over a constant length ``L``, mean over sequences (Dr. GRPO).

    Args:
        length: the constant ``L``; near the longest completion keeps the loss scale of a token mean.
    """

    def __init__(self, length: float = 64.0):
        if length <= 0:
            raise ValueError(f"ConstantLength: length must be > 0, got {length}")
        self.length = length

    def __call__(self, batch: RolloutBatch) -> Tensor:
        return torch.tensor(self.length * batch.step_sequences, device=batch.completion_mask.device)
