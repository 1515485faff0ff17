"""The mini-batch that the training step receives."""

from dataclasses import dataclass, field, fields, replace

import torch
from torch import Tensor


@dataclass
class RolloutBatch:
    """Rollouts of whole or partial prompt groups, ready for one optimizer step.

    Row ``i`` is one completion: ``input_ids[i]`` holds its prompt, left-padded to
    ``prompt_length``, then the completion, right-padded. Per-token fields are ``[B, C]`` over the
    completion positions.

    Attributes:
        input_ids: ``[B, P + C]`` token ids.
        attention_mask: ``[B, P + C]``, zero on padding.
        completion_mask: ``[B, C]``, one on completion tokens (the closing EOS included).
        prompt_length: ``P``.
        rewards: ``[B]`` sequence rewards.
        advantages: ``[B]`` advantages, computed over each whole group before the round was split.
        group_ids: ``[B]`` the group (prompt) each row belongs to, unique within a round.
        old_logprobs: ``[B, C]`` log-probs under the policy that sampled the rollouts; None when the
            step is on-policy, in which case the objective uses the detached current log-probs.
        ref_logprobs: ``[B, C]`` log-probs under the reference model, or None without a KL term.
        step_sequences: sequences in the optimizer step (all micro-batches and processes), divided
            by the number of micro-batches that Lightning and DDP average over; a loss normalised by
            it does not depend on how the step's rollouts are split.
        step_tokens: completion tokens in the optimizer step, likewise divided.
        stats: rollout statistics of the round (``rollout/...``) to log with this mini-batch.
    """

    input_ids: Tensor
    attention_mask: Tensor
    completion_mask: Tensor
    prompt_length: int
    rewards: Tensor
    advantages: Tensor
    group_ids: Tensor
    old_logprobs: Tensor | None = None
    ref_logprobs: Tensor | None = None
    step_sequences: float = 0.0
    step_tokens: float = 0.0
    stats: dict[str, float] = field(default_factory=dict)

    def __len__(self) -> int:
        return self.input_ids.shape[0]

    def select(self, rows: Tensor) -> "RolloutBatch":
        """The rows ``rows`` of this batch (per-row tensors indexed, the rest kept)."""
        picked = {
            f.name: getattr(self, f.name)[rows]
            for f in fields(self)
            if isinstance(getattr(self, f.name), Tensor)
        }
        return replace(self, **picked)

    def to_state(self) -> dict:
        """A checkpointable dict of this batch."""
        return {f.name: getattr(self, f.name) for f in fields(self)}

    @classmethod
    def from_state(cls, state: dict) -> "RolloutBatch":
        return cls(**{k: v.cpu() if isinstance(v, torch.Tensor) else v for k, v in state.items()})
