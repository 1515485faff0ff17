"""The group rule's objectives: advantages over the members of a group whose other rows failed (by hand, and for an
estimator or objective written before members were), group transforms over members, and every preset on a batch with
a failed row: no NaN, no credit on it, and the other rows' credits as if it were not there."""

import math

import pytest
import torch

from lit_cancel import (
    PRESETS,
    AdvOrthogonal,
    BatchNormalised,
    DFPOMin,
    GroupMin,
    GroupNormalised,
    GroupRatioDrop,
    LeaveOneOut,
    MeanCentred,
    MinReplace,
    PolicyGradient,
    RolloutBatch,
    SequenceTruncate,
)
from lit_cancel.objectives.advantages import member_advantages

REWARDS = torch.tensor([[1.0, 0.0, 0.0, 1.0], [1.0, 1.0, 1.0, 0.0], [0.5, 1.0, 1.0, 1.0]])
# row 2 of group 0 failed; rows 1 and 2 of group 1; only row 0 of group 2 ran
MEMBERS = torch.tensor([[True, True, False, True], [True, False, False, True], [True, False, False, False]])
R3, R2 = math.sqrt(3), math.sqrt(2)


@pytest.mark.parametrize(("estimator", "expected"), [
    # group 0's members [1, 0, 1]: mean 2/3; group 1's [1, 0]: mean 1/2; group 2 has one member: 0 for all
    (MeanCentred(), [[1 / 3, -2 / 3, 0, 1 / 3], [0.5, 0, 0, -0.5], [0, 0, 0, 0]]),
    # unbiased std of [1, 0, 1] is sqrt(1/3), of [1, 0] sqrt(1/2)
    (GroupNormalised(eps=1e-12), [[1 / R3, -2 / R3, 0, 1 / R3], [1 / R2, 0, 0, -1 / R2], [0, 0, 0, 0]]),
    # 1 - (2 - 1) / 2 and 0 - 2 / 2; 1 - 0 / 1 and 0 - 1 / 1
    (LeaveOneOut(), [[0.5, -1, 0, 0.5], [1, 0, 0, -1], [0, 0, 0, 0]]),
    # group-centred over the std of the round's 6 members [1, 0, 1, 1, 0, 0.5]: mean 7/12, unbiased variance 29/120
    (BatchNormalised(eps=1e-12), [[v / math.sqrt(29 / 120) for v in row] for row in [[1 / 3, -2 / 3, 0, 1 / 3], [0.5, 0, 0, -0.5],
                                                                                    [0, 0, 0, 0]]]),
])
def test_advantages_over_a_group_s_members_by_hand(estimator, expected):
    advantages = member_advantages(estimator, REWARDS, MEMBERS)
    assert torch.allclose(advantages, torch.tensor(expected), atol=1e-6)
    assert torch.allclose((advantages * MEMBERS).sum(1), torch.zeros(3), atol=1e-6)
    # an objective's advantages are its estimator's over the members
    assert torch.allclose(PolicyGradient(advantage=estimator).advantages(REWARDS, MEMBERS), advantages)
    # where every row is a member, the estimator as it always was
    assert torch.equal(member_advantages(estimator, REWARDS, torch.ones_like(MEMBERS)), estimator(REWARDS))


class CentredWithoutMembers:
    """An advantage estimator written before members were: ``__call__(self, rewards)``."""

    def __init__(self):
        self.shapes = []

    def __call__(self, rewards):
        self.shapes.append(tuple(rewards.shape))
        return rewards - rewards.mean(dim=1, keepdim=True)


def test_an_estimator_written_without_members_works_and_is_called_on_each_group_s_members_where_rows_failed():
    estimator = CentredWithoutMembers()
    assert torch.equal(PolicyGradient(advantage=estimator).advantages(REWARDS), MeanCentred()(REWARDS))
    assert torch.equal(member_advantages(estimator, REWARDS, torch.ones_like(MEMBERS)), MeanCentred()(REWARDS))
    estimator.shapes.clear()
    advantages = member_advantages(estimator, REWARDS, MEMBERS)
    assert torch.allclose(advantages, member_advantages(MeanCentred(), REWARDS, MEMBERS), atol=1e-6)
    # each group with a failed row and two members on its own; group 2, of one member, not at all
    assert estimator.shapes == [(1, 3), (1, 2)]


class ObjectiveWithoutMembers(PolicyGradient):
    """An objective of one's own whose ``advantages`` was written before members were."""

    def advantages(self, rewards):
        return LeaveOneOut()(rewards)


def test_an_objective_whose_advantages_take_no_members_is_called_on_each_group_s_members():
    objective = ObjectiveWithoutMembers()
    expected = member_advantages(LeaveOneOut(), REWARDS, MEMBERS)
    assert torch.allclose(member_advantages(objective.advantages, REWARDS, MEMBERS), expected, atol=1e-6)


def test_group_transforms_over_members_by_hand():
    weights = torch.tensor([1.2, 1.1, 0.3, 2.0, 0.5, 1.3, 0.7])
    advantages = torch.tensor([1.0, -1.0, 0.0, 0.5, 0.0, -0.5, 0.0])
    groups = torch.tensor([4, 4, 4, 9, 9, 9, 7])
    members = torch.tensor([True, True, False, True, False, True, False])
    # the failed rows' weights (0.3, 0.5) are no group's minimum; group 7, without a member, keeps its weight
    assert MinReplace()(weights, advantages, groups, members).tolist() == pytest.approx([1.1, 1.1, 1.1, 1.3, 1.3, 1.3, 0.7])
    assert MinReplace()(weights, advantages, groups).tolist() == pytest.approx([0.3, 0.3, 0.3, 0.5, 0.5, 0.5, 0.7])
    # a failed row's advantage, were it not 0, takes no part: group 4, A.w = 0.1, |A|^2 = 2 -> w - 0.05 A
    advantages[2] = 3.0
    orthogonal = AdvOrthogonal()(weights, advantages, groups, members)
    assert orthogonal[:2].tolist() == pytest.approx([1.15, 1.15])
    assert (orthogonal[:3] * advantages[:3] * members[:3]).sum().abs() < 1e-6


def batch_with_a_failed_row(objective, failed: bool) -> tuple[RolloutBatch, torch.Tensor]:
    """A group of four off-policy rollouts of unequal lengths sharing a 3-token prefix, every member's sequence ratio
    above 1 and the sampler's log-probs off the trainer's; with ``failed``, a fifth row whose episode failed: tokens in its
    context, none to credit, finite log-probs of its own. The step counts are the members'."""
    generator = torch.Generator().manual_seed(0)
    lengths, width = [5, 9, 12, 7], 12
    tokens = torch.randint(20, 90, (4, width), generator=generator)
    tokens[:, :3] = torch.tensor([5, 6, 7])
    mask = (torch.arange(width) < torch.tensor(lengths).unsqueeze(1)).long()
    old = -torch.rand(4, width, generator=generator) * 2
    old[:, :3] = torch.tensor([-0.3, -1.2, -0.7])
    log_ratio = 0.05 + torch.rand(4, width, generator=generator) * 0.3
    log_ratio[:, :3] = 0.1
    sampler = old - torch.rand(4, width, generator=generator) * 0.5
    rewards = torch.tensor([1.0, 0.0, 1.0, 0.0])
    attention = mask.clone()
    if failed:  # its step raised after a turn of 6 tokens, which stay in its context
        tokens = torch.cat([tokens, tokens[:1]])
        mask = torch.cat([mask, torch.zeros(1, width, dtype=torch.long)])
        attention = torch.cat([attention, (torch.arange(width) < 6).long().unsqueeze(0)])
        old, sampler = torch.cat([old, -torch.full((1, width), 7.0)]), torch.cat([sampler, -torch.full((1, width), 1.0)])
        log_ratio, rewards = torch.cat([log_ratio, torch.full((1, width), -3.0)]), torch.cat([rewards, torch.tensor([0.0])])
    members = mask.any(1)
    rows = len(tokens)
    batch = RolloutBatch(
        input_ids=torch.cat([torch.ones(rows, 1, dtype=torch.long), tokens], 1),
        attention_mask=torch.cat([torch.ones(rows, 1, dtype=torch.long), attention], 1), completion_mask=mask, prompt_length=1,
        rewards=rewards, advantages=member_advantages(objective.advantages, rewards.view(1, -1), members.view(1, -1)).view(-1),
        group_ids=torch.zeros(rows, dtype=torch.long), old_logprobs=old, ref_logprobs=old - 0.2, sampler_logprobs=sampler,
        failure=(~members).long() * 5, step_sequences=4.0, step_tokens=float(mask.sum()),
    )
    return batch, old + log_ratio


OBJECTIVES = {
    **PRESETS,
    # the failed row's correction (1, of no token) is below every member's: it must be no group's minimum
    "DFPOMin with GroupMin(SequenceTruncate)": lambda: DFPOMin(correction=GroupMin(SequenceTruncate()), kl_coef=0.1),
    "DFPOMin with GroupRatioDrop": lambda: DFPOMin(trust_region=GroupRatioDrop(eps=0.5)),
    "GRPO with KL and entropy": lambda: PRESETS["GRPO"](kl_coef=0.1, entropy_coef=0.01),
}


@pytest.mark.parametrize("name", list(OBJECTIVES))
def test_a_failed_row_gets_no_credit_and_leaves_the_members_credits_as_without_it(name):
    objective = OBJECTIVES[name]()
    batch, current = batch_with_a_failed_row(objective, failed=True)
    logprobs = current.clone().requires_grad_()
    out = objective(logprobs, batch)
    (gradient,) = torch.autograd.grad(out.loss, logprobs)
    assert torch.isfinite(out.loss) and torch.isfinite(out.credits).all() and torch.isfinite(gradient).all()
    assert all(torch.isfinite(value).all() for value in out.metrics.values())
    assert (out.credits[4] == 0).all() and (gradient[4] == 0).all()
    assert torch.allclose(out.credits, -gradient * batch.completion_mask, atol=1e-7)
    members, members_now = batch_with_a_failed_row(objective, failed=False)
    alone = objective(members_now, members).credits
    assert alone.abs().sum() > 0
    assert torch.allclose(out.credits[:4], alone, atol=1e-6)
