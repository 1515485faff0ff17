"""The advantages stage: what the objective needs of a draw's scored rollouts, as the rows a training step gets.

Each whole group's rewards become advantages by the objective's estimator (before a plan may split the group across
optimizer steps), over the group's members (a failed episode's row stays in its group, inert, and is no member:
:mod:`lit_cancel.rounds.failures`), and the old and reference log-probs the objective needs are computed in the
trainer's precision context, as the training step computes its own.
"""

import torch
from torch import Tensor

from lit_cancel.batch import RolloutBatch
from lit_cancel.objectives.advantages import member_advantages
from lit_cancel.rounds.failures import failure_codes
from lit_cancel.rounds.sample import Generation, RolloutPolicy


def advantaged_rows(policy: RolloutPolicy, generation: Generation, rewards: Tensor, correct: Tensor, group_size: int,
                    first_group: int, round_index: int, with_old_logprobs: bool) -> RolloutBatch:
    """``generation``'s rows, ``group_size`` completions of each group in turn, with their ``rewards`` and ``correct``ness,
    as a :class:`RolloutBatch`: the advantages by ``policy.objective`` over each group's rewards (of the rows whose
    episode did not fail, ``generation.failures``), the reference
    log-probs where the objective has a KL term, the old log-probs ``with_old_logprobs``; the groups are numbered from
    ``first_group``, sampled in round ``round_index``."""
    groups = len(rewards) // group_size
    failure = failure_codes(generation.failures or [None] * len(rewards))
    # a failed episode's row is in its group but no member of it: advantages are computed over the others
    members = (failure == 0).view(groups, group_size)
    advantage = member_advantages(policy.objective.advantages, rewards.view(groups, group_size), members).reshape(-1)
    with policy.precision_context():
        old_logprobs, ref_logprobs = policy.score_rollouts(generation, with_old_logprobs=with_old_logprobs)

    device = generation.input_ids.device
    return RolloutBatch(
        input_ids=generation.input_ids,
        attention_mask=generation.attention_mask,
        completion_mask=generation.completion_mask,
        prompt_length=generation.prompt_length,
        rewards=rewards.to(device),
        advantages=advantage.to(device),
        group_ids=torch.arange(first_group, first_group + groups, device=device).repeat_interleave(group_size),
        sampled_round=torch.full((groups * group_size,), round_index, device=device),
        old_logprobs=old_logprobs,
        ref_logprobs=ref_logprobs,
        sampler_logprobs=generation.sampler_logprobs,
        sampler_steps=None if generation.sampler_steps is None else generation.sampler_steps.to(device),
        correct=correct.to(device),
        failure=failure.to(device),
    )
