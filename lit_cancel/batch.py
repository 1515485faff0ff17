"""The mini-batch that the training step receives."""

from dataclasses import dataclass, field, fields, replace

import torch
import torch.nn.functional as F
from torch import Tensor

from lit_cancel.logprobs import unpadded_span
from lit_cancel.rounds.failures import FAILURE_CAUSES


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
        group_ids: ``[B]`` the group (prompt) each row belongs to, unique across rounds and processes.
        sampled_round: ``[B]`` the round in which each row was sampled.
        old_logprobs: ``[B, C]`` log-probs under the policy that sampled the rollouts; None when the
            step is on-policy, in which case the objective uses the detached current log-probs.
        ref_logprobs: ``[B, C]`` log-probs under the reference model, or None without a KL term.
        sampler_logprobs: ``[B, C]`` log-probs under the engine that sampled the rollouts (vLLM), or None
            when the policy sampled them itself; the objective measures and corrects the mismatch with it.
        sampler_steps: ``[B]`` the optimizer step of the weights that sampled each row, for an engine whose
            weights may lag the trainer's (rollout servers); None: sampled by the weights being trained.
        correct: ``[B]`` whether each completion is correct by the task's ``correct`` (1.0 or 0.0), NaN where the
            task cannot tell; None when not recorded (batches built by hand, checkpoints written before it was).
        failure: ``[B]`` 0 where the rollout ran, else 1 + the index in
            :data:`~lit_cancel.rounds.failures.FAILURE_CAUSES` of why its episode failed: such a row is inert (no token in
            its completion mask, advantage 0, no member of its group's advantages); None when not recorded (batches
            built by hand, checkpoints written before it was), where no row failed.
        step_sequences: sequences in the optimizer step (all micro-batches and processes), divided
            by the number of micro-batches that Lightning and DDP average over; a loss normalised by
            it does not depend on how the step's rollouts are split.
        step_tokens: completion tokens in the optimizer step, likewise divided.
        stats: statistics to log at this micro-batch's optimizer step: the first micro-batch of each step carries
            its round's (``rollout/...``, ``perf/...``) and its step's (``batch/...``), the others none.
    """

    input_ids: Tensor
    attention_mask: Tensor
    completion_mask: Tensor
    prompt_length: int
    rewards: Tensor
    advantages: Tensor
    group_ids: Tensor
    sampled_round: Tensor | None = None
    old_logprobs: Tensor | None = None
    ref_logprobs: Tensor | None = None
    sampler_logprobs: Tensor | None = None
    sampler_steps: Tensor | None = None
    correct: Tensor | None = None
    failure: Tensor | None = None
    step_sequences: float = 0.0
    step_tokens: float = 0.0
    stats: dict[str, float] = field(default_factory=dict)

    def __len__(self) -> int:
        return self.input_ids.shape[0]

    @property
    def failed(self) -> Tensor:
        """``[B]`` bool: the rows whose episode failed (none where :attr:`failure` is not recorded)."""
        if self.failure is None:
            return torch.zeros(len(self), dtype=torch.bool, device=self.input_ids.device)
        return self.failure > 0

    @property
    def failures(self) -> list[str | None]:
        """Why each row's episode failed (a cause of :data:`~lit_cancel.rounds.failures.FAILURE_CAUSES`), None where it ran:
        what ``RolloutSamplesLogger`` shows."""
        codes = [0] * len(self) if self.failure is None else self.failure.tolist()
        return [None if code == 0 else FAILURE_CAUSES[code - 1] for code in codes]

    def select(self, rows: Tensor) -> "RolloutBatch":
        """The rows ``rows`` of this batch (per-row tensors indexed, the rest kept), without the columns that all of
        them pad: leading prompt columns and trailing completion columns (but for the first)."""
        picked = {f.name: getattr(self, f.name)[rows] for f in fields(self) if isinstance(getattr(self, f.name), Tensor)}
        start, end = unpadded_span(picked["attention_mask"], self.prompt_length)
        # one completion column stays where every row pads them all (episodes that all failed at their start)
        end = max(end, self.prompt_length + min(1, self.completion_mask.shape[1]))
        for name, value in picked.items():
            if name in ("input_ids", "attention_mask"):
                picked[name] = value[:, start:end]
            elif value.dim() == 2:
                picked[name] = value[:, : end - self.prompt_length]
        return replace(self, **picked, prompt_length=self.prompt_length - start, stats={})

    def to(self, device: torch.device | str) -> "RolloutBatch":
        """This batch with its tensors on ``device``."""
        moved = {f.name: getattr(self, f.name).to(device) for f in fields(self) if isinstance(getattr(self, f.name), Tensor)}
        return replace(self, **moved)

    @staticmethod
    def concat(batches: list["RolloutBatch"]) -> "RolloutBatch":
        """Rows of several batches in one, prompts left-padded and completions right-padded to the widest.

        Padding is masked out, so the padded token id is irrelevant.
        """
        prompt_length = max(b.prompt_length for b in batches)
        width = max(b.completion_mask.shape[1] for b in batches)

        def padded(batch: RolloutBatch, name: str) -> Tensor | None:
            value = getattr(batch, name)
            if name in ("input_ids", "attention_mask"):
                return F.pad(value, (prompt_length - batch.prompt_length, width - batch.completion_mask.shape[1]))
            if value is not None and value.dim() == 2:
                return F.pad(value, (0, width - value.shape[1]))
            return value

        merged = {}
        for f in fields(RolloutBatch):
            if f.name in ("prompt_length", "step_sequences", "step_tokens", "stats"):
                continue
            values = [padded(b, f.name) for b in batches]
            if f.name == "failure" and any(v is not None for v in values):  # a batch that does not record it had none
                values = [torch.zeros(len(b), dtype=torch.long, device=b.input_ids.device) if v is None else v
                          for b, v in zip(batches, values, strict=True)]
            merged[f.name] = None if any(v is None for v in values) else torch.cat(values)
        return RolloutBatch(prompt_length=prompt_length, **merged)

    def to_state(self) -> dict:
        """A checkpointable dict of this batch, on the CPU."""
        return {f.name: (v.cpu() if isinstance(v := getattr(self, f.name), Tensor) else v) for f in fields(self)}

    @classmethod
    def from_state(cls, state: dict) -> "RolloutBatch":
        """The batch of :meth:`to_state`; a field the state lacks (written before the field existed) takes its default."""
        return cls(**state)
