import copy

import pytest
import torch

from lit_cancel import (
    DAPO,
    GRPO,
    GSPO,
    PRESETS,
    RLOO,
    AdvOrthogonal,
    AsymmetricClip,
    BatchNormalised,
    DFPOMin,
    DFPOOrth,
    DrGRPO,
    DualClip,
    GroupNormalised,
    LeaveOneOut,
    MeanCentred,
    MinReplace,
    NoClip,
    PolicyGradient,
    RolloutBatch,
    SymmetricClip,
    TokenMean,
)
from lit_cancel.objectives.audit import learning_tax, policy_gradient_part
from lit_cancel.objectives.policy_gradient import kl_estimate


def test_advantage_estimators_by_hand():
    rewards = torch.tensor([[1.0, 0.0, 0.0, 1.0], [1.0, 1.0, 1.0, 0.0], [0.0, 0.0, 0.0, 0.0]])
    assert torch.allclose(MeanCentred()(rewards)[1], torch.tensor([0.25, 0.25, 0.25, -0.75]))
    # unbiased std of [1,0,0,1] is sqrt(1/3); of [1,1,1,0] it is 0.5
    normalised = GroupNormalised(eps=1e-12)(rewards)
    assert torch.allclose(normalised[0], torch.tensor([0.5, -0.5, -0.5, 0.5]) * 3**0.5)
    assert torch.allclose(normalised[1], torch.tensor([0.5, 0.5, 0.5, -1.5]))
    assert torch.equal(GroupNormalised()(rewards)[2], torch.zeros(4))  # equal rewards: 0, not NaN
    # leave-one-out: 1 - (1+1+0)/3 = 1/3 and 0 - 3/3 = -1
    assert torch.allclose(LeaveOneOut()(rewards)[1], torch.tensor([1 / 3, 1 / 3, 1 / 3, -1.0]))
    # batch-normalised: group-centred over the std of all 12 rewards; 5 ones, mean 5/12,
    # unbiased variance (5 (7/12)^2 + 7 (5/12)^2) / 11 = 35/132
    std = torch.tensor(35 / 132).sqrt()
    assert torch.allclose(BatchNormalised(eps=1e-12)(rewards)[1], torch.tensor([0.25, 0.25, 0.25, -0.75]) / std)
    for estimator in (MeanCentred(), GroupNormalised(), LeaveOneOut(), BatchNormalised()):
        assert torch.allclose(estimator(rewards).sum(1), torch.zeros(3), atol=1e-6)


@pytest.mark.parametrize("estimator", ["k1", "k2", "k3"])
def test_kl_estimator_derivative_matches_autograd(estimator):
    logprobs = torch.randn(5, requires_grad=True)
    ref = torch.randn(5)
    kl, derivative = kl_estimate(logprobs, ref, estimator)
    (grad,) = torch.autograd.grad(kl.sum(), logprobs)
    assert torch.allclose(grad, derivative)
    if estimator != "k1":
        assert (kl >= 0).all()


def test_clips_by_hand():
    ratio = torch.tensor([0.5, 0.9, 1.25, 1.5, 4.0, 0.5, 1.25, 4.0])
    advantages = torch.tensor([1.0, 1.0, 1.0, 1.0, -1.0, -1.0, -1.0, 1.0])
    symmetric = SymmetricClip(0.2)(ratio, advantages)
    assert symmetric.active.tolist() == [1, 1, 0, 0, 1, 0, 1, 0]
    assert symmetric.clipped_high.tolist() == [0, 0, 1, 1, 0, 0, 0, 1]
    assert symmetric.clipped_low.tolist() == [0, 0, 0, 0, 0, 1, 0, 0]
    higher = AsymmetricClip(0.2, 0.28)(ratio, advantages)
    assert higher.active.tolist() == [1, 1, 1, 0, 1, 0, 1, 0]  # 1.25 is inside the higher range
    dual = DualClip(0.2, c=3.0)(ratio, advantages)
    assert dual.active.tolist() == [1, 1, 0, 0, 0, 0, 1, 0]  # ratio 4 with A < 0 is bounded at c A
    assert dual.surrogate[4] == -3.0
    assert NoClip()(ratio, advantages).active.tolist() == [1] * 8


def test_group_transforms_by_hand():
    weights = torch.tensor([1.2, 0.8, 1.0, 2.0, 0.5, 1.1])
    advantages = torch.tensor([1.0, -1.0, 0.0, 0.5, -0.5, 0.0])
    groups = torch.tensor([4, 4, 4, 9, 9, 9])
    assert MinReplace()(weights, advantages, groups).tolist() == pytest.approx([0.8, 0.8, 0.8, 0.5, 0.5, 0.5])
    orthogonal = AdvOrthogonal()(weights, advantages, groups)
    # group 4: A.w = 0.4, |A|^2 = 2 -> w - 0.2 A; group 9: A.w = 0.75, |A|^2 = 0.5 -> w - 1.5 A
    assert orthogonal.tolist() == pytest.approx([1.0, 1.0, 1.0, 1.25, 1.25, 1.1])
    for group in (4, 9):
        rows = groups == group
        assert (orthogonal[rows] * advantages[rows]).sum().abs() < 1e-6


def random_batch(num_groups: int, group_size: int, length: int, seed: int, spread: float, with_ref: bool):
    """Random groups of unequal lengths and mixed rewards, and current log-probs ``spread`` away from the old ones."""
    generator = torch.Generator().manual_seed(seed)
    rows = num_groups * group_size
    lengths = torch.randint(1, length + 1, (rows,), generator=generator)
    mask = (torch.arange(length) < lengths.unsqueeze(1)).long()
    rewards = torch.randint(0, 2, (num_groups, group_size), generator=generator).float()
    rewards[:, :2] = torch.tensor([1.0, 0.0])
    old = -torch.rand(rows, length, generator=generator) * 3
    batch = RolloutBatch(
        input_ids=torch.zeros(rows, length + 1, dtype=torch.long), attention_mask=torch.ones(rows, length + 1, dtype=torch.long),
        completion_mask=mask, prompt_length=1, rewards=rewards.view(-1),
        advantages=GroupNormalised()(rewards).view(-1), group_ids=torch.arange(num_groups).repeat_interleave(group_size),
        old_logprobs=old, ref_logprobs=old + torch.randn(rows, length, generator=generator) * 0.3 if with_ref else None,
        step_sequences=float(rows), step_tokens=float(mask.sum()),
    )
    return batch, old + torch.randn(rows, length, generator=generator) * spread


OBJECTIVES = {
    **{name: preset for name, preset in PRESETS.items()},
    "grpo_kl_k1": lambda: GRPO(kl_coef=0.1, kl_estimator="k1"),
    "grpo_kl_k3_entropy": lambda: GRPO(kl_coef=0.05, entropy_coef=0.01),
    "dr_grpo_kl": lambda: DrGRPO(kl_coef=0.1),
    "dual_clip_batch_norm": lambda: PolicyGradient(advantage=BatchNormalised(), clip=DualClip(0.2, 2.0), normaliser=TokenMean()),
    "gspo_kl_k2": lambda: PolicyGradient(ratio="sequence", clip=AsymmetricClip(0.05, 0.1), kl_coef=0.2, kl_estimator="k2"),
    "dfpo_orth_token_mean_kl": lambda: DFPOOrth(normaliser=TokenMean(), kl_coef=0.1),
}


@pytest.mark.parametrize("name", list(OBJECTIVES))
@pytest.mark.parametrize(("num_groups", "group_size", "length", "spread"), [(1, 2, 3, 0.0), (2, 4, 7, 0.3), (3, 5, 11, 1.0)])
def test_gradient_equals_credit_weighted_logprob_gradient(name, num_groups, group_size, length, spread):
    objective = OBJECTIVES[name]()
    batch, values = random_batch(num_groups, group_size, length, seed=length, spread=spread, with_ref=True)
    # log-probs as a function of parameters, so the identity is checked on parameter gradients
    features = torch.randn(*values.shape, 6, generator=torch.Generator().manual_seed(1))
    theta = torch.zeros(6, requires_grad=True)
    logprobs = values + features @ theta
    out = objective(logprobs, batch)
    (grad_loss,) = torch.autograd.grad(out.loss, theta, retain_graph=True)
    (grad_credits,) = torch.autograd.grad(-(out.credits * logprobs).sum(), theta)
    assert not out.credits.requires_grad
    assert torch.allclose(grad_loss, grad_credits, atol=1e-6, rtol=1e-5)
    assert grad_loss.abs().sum() > 0
    assert (out.credits[batch.completion_mask == 0] == 0).all()
    assert set(out.metrics) >= {"loss/policy", "loss/kl", "objective/clip_frac_low", "objective/clip_frac_high", "objective/ratio_mean", "objective/approx_kl"}


def shared_prefix_group(lengths: list[int], shared_log_ratio: float, own_log_ratio: float, objective):
    """One group of four: a 3-token prefix every member shares, then tokens of its own.

    Rewards [1, 0, 1, 0]. At the shared positions every member has the same context and token, hence
    the same old and current log-prob; ``shared_log_ratio`` is their common log-ratio.
    """
    generator = torch.Generator().manual_seed(0)
    rows, width, prefix = len(lengths), max(lengths), 3
    tokens = torch.randint(20, 90, (rows, width), generator=generator)
    tokens[:, :prefix] = torch.tensor([5, 6, 7])
    tokens[:, prefix] = torch.arange(rows) + 10
    mask = (torch.arange(width) < torch.tensor(lengths).unsqueeze(1)).long()
    old = -torch.rand(rows, width, generator=generator) * 2
    old[:, :prefix] = torch.tensor([-0.3, -1.2, -0.7])
    log_ratio = (torch.rand(rows, width, generator=generator) * 2 - 1) * own_log_ratio
    log_ratio[:, :prefix] = shared_log_ratio
    rewards = torch.tensor([[1.0, 0.0, 1.0, 0.0]])
    batch = RolloutBatch(
        input_ids=torch.cat([torch.ones(rows, 1, dtype=torch.long), tokens], 1), attention_mask=torch.ones(rows, width + 1, dtype=torch.long),
        completion_mask=mask, prompt_length=1, rewards=rewards.view(-1), advantages=objective.advantages(rewards).view(-1),
        group_ids=torch.zeros(rows, dtype=torch.long), old_logprobs=old, step_sequences=float(rows), step_tokens=float(mask.sum()),
    )
    credits = objective(old + log_ratio, batch).credits
    return credits[:, :prefix].sum(0), learning_tax(credits, tokens, mask, batch.group_ids)


UNEQUAL = [5, 9, 12, 7]


@pytest.mark.parametrize(
    ("objective", "shared_log_ratio", "own_log_ratio"),
    [
        (DrGRPO(), 0.0, 0.0),
        (DrGRPO(), 0.1, 0.6),  # off-policy, shared ratio inside the clip range
        (DAPO(), 0.0, 0.0),  # on-policy
        (DFPOMin(), 0.1, 0.6),
        (DFPOMin(), -0.05, 0.2),
        (DFPOOrth(), 0.1, 0.6),
        (DFPOOrth(), -0.05, 0.2),
        (RLOO(), 0.0, 0.3),
    ],
)
def test_exchangeable_objectives_cancel_on_the_shared_prefix(objective, shared_log_ratio, own_log_ratio):
    net, tax = shared_prefix_group(UNEQUAL, shared_log_ratio, own_log_ratio, objective)
    assert torch.allclose(net, torch.zeros(3), atol=1e-7)
    assert tax < 1e-6


@pytest.mark.parametrize(
    ("objective", "shared_log_ratio", "own_log_ratio"),
    [
        (GRPO(), 0.0, 0.0),  # on-policy, unequal lengths: 1/|y_i| differs
        (GSPO(), 0.0, 0.3),  # off-policy: sequence ratios differ across members
        (DAPO(), 0.3, 0.3),  # shared ratio 1.35 is above 1 + eps_high: positive members clipped, negative not
        (DAPO(), -0.3, 0.3),  # shared ratio 0.74 is below 1 - eps_low: negative members clipped
        (DrGRPO(), 0.3, 0.0),  # a symmetric clip too selects one sign once the shared ratio leaves its range
    ],
)
def test_breakers_leave_credit_on_the_shared_prefix(objective, shared_log_ratio, own_log_ratio):
    net, tax = shared_prefix_group(UNEQUAL, shared_log_ratio, own_log_ratio, objective)
    assert net.abs().max() > 1e-3
    assert tax > 1e-3


def test_gspo_cancels_on_policy_with_equal_lengths_but_not_off_policy():
    net, _ = shared_prefix_group([8, 8, 8, 8], 0.0, 0.0, GSPO())
    assert torch.allclose(net, torch.zeros(3), atol=1e-7)
    net, _ = shared_prefix_group([8, 8, 8, 8], 0.0, 0.3, GSPO())
    assert net.abs().max() > 1e-3


def test_grpo_credit_by_hand():
    # one group of two, lengths 1 and 2, on-policy: c_it = A_i / (S |y_i|)
    batch = RolloutBatch(
        input_ids=torch.zeros(2, 3, dtype=torch.long), attention_mask=torch.ones(2, 3, dtype=torch.long),
        completion_mask=torch.tensor([[1, 0], [1, 1]]), prompt_length=1, rewards=torch.tensor([1.0, 0.0]),
        advantages=torch.tensor([0.5, -0.5]), group_ids=torch.tensor([0, 0]), step_sequences=2.0, step_tokens=3.0,
    )
    logprobs = torch.log(torch.tensor([[0.5, 0.1], [0.4, 0.3]]))
    assert torch.allclose(GRPO()(logprobs, batch).credits, torch.tensor([[0.25, 0.0], [-0.125, -0.125]]))
    # Dr. GRPO with L = 4: A_i / (S L) on every token; DAPO: A_i / T
    assert torch.allclose(DrGRPO(length=4)(logprobs, batch).credits, torch.tensor([[0.0625, 0.0], [-0.0625, -0.0625]]))
    assert torch.allclose(DAPO()(logprobs, batch).credits, torch.tensor([[0.5, 0.0], [-0.5, -0.5]]) / 3)


def test_clipped_members_get_no_credit():
    batch = RolloutBatch(
        input_ids=torch.zeros(2, 2, dtype=torch.long), attention_mask=torch.ones(2, 2, dtype=torch.long),
        completion_mask=torch.ones(2, 1, dtype=torch.long), prompt_length=1, rewards=torch.tensor([1.0, 0.0]),
        advantages=torch.tensor([1.0, -1.0]), group_ids=torch.tensor([0, 0]),
        old_logprobs=torch.log(torch.tensor([[0.5], [0.5]])), step_sequences=2.0, step_tokens=2.0,
    )
    out = GRPO(clip_eps=0.2)(torch.log(torch.tensor([[0.75], [0.3]])), batch)  # ratios 1.5 (A > 0) and 0.6 (A < 0)
    assert torch.equal(out.credits, torch.zeros(2, 1))
    assert out.metrics["objective/clip_frac_high"] == 0.5 and out.metrics["objective/clip_frac_low"] == 0.5
    out = GRPO(clip_eps=0.2)(torch.log(torch.tensor([[0.5], [0.75]])), batch)  # ratio 1.5 with A < 0 is not clipped
    assert torch.allclose(out.credits, torch.tensor([[0.5], [-0.75]]))


def test_kl_share_by_hand():
    # the batch above: policy credits 0.25 | -0.125, -0.125, absolute mass 0.5
    batch = RolloutBatch(
        input_ids=torch.zeros(2, 3, dtype=torch.long), attention_mask=torch.ones(2, 3, dtype=torch.long),
        completion_mask=torch.tensor([[1, 0], [1, 1]]), prompt_length=1, rewards=torch.tensor([1.0, 0.0]),
        advantages=torch.tensor([0.5, -0.5]), group_ids=torch.tensor([0, 0]), step_sequences=2.0, step_tokens=3.0,
    )
    logprobs = torch.log(torch.tensor([[0.5, 0.1], [0.4, 0.3]]))
    # k2's derivative is logp - logp_ref: 0.4 | -0.2, 0.6 (5.0 on padding); KL credits 0.5 * that / (S |y_i|):
    # 0.1 | -0.025, 0.075, absolute mass 0.2, so the share is 0.2 / (0.5 + 0.2)
    batch.ref_logprobs = logprobs - torch.tensor([[0.4, 5.0], [-0.2, 0.6]])
    assert GRPO(kl_coef=0.5, kl_estimator="k2", scale_by_std=False)(logprobs, batch).metrics["objective/kl_share"] == pytest.approx(2 / 7)
    # the entropy bonus's credits count in neither term
    with_entropy = GRPO(kl_coef=0.5, kl_estimator="k2", scale_by_std=False, entropy_coef=0.3)(logprobs, batch)
    assert with_entropy.metrics["objective/kl_share"] == pytest.approx(2 / 7)
    assert GRPO(scale_by_std=False)(logprobs, batch).metrics["objective/kl_share"] == 0.0
    # no credit at all (advantages 0, policy = reference): 0, not NaN
    batch.advantages, batch.ref_logprobs = torch.zeros(2), logprobs.clone()
    assert GRPO(kl_coef=0.5, kl_estimator="k2")(logprobs, batch).metrics["objective/kl_share"] == 0.0


@pytest.mark.parametrize("name", list(OBJECTIVES))
def test_kl_share_is_the_kl_terms_share_of_the_credit_mass_in_every_objective(name):
    # off-policy, so that clipping, sequence weights and group transforms shape the policy credits
    objective = OBJECTIVES[name]()
    batch, logprobs = random_batch(3, 4, 7, seed=2, spread=0.3, with_ref=True)
    without_entropy = copy.copy(objective)
    without_entropy.entropy_coef = 0.0
    policy = policy_gradient_part(objective)(logprobs, batch).credits
    kl = policy - without_entropy(logprobs, batch).credits
    expected = kl.abs().sum() / (policy.abs().sum() + kl.abs().sum())
    assert objective(logprobs, batch).metrics["objective/kl_share"] == pytest.approx(float(expected), abs=1e-6)
    assert (expected > 0) == (objective.kl_coef > 0)


@pytest.mark.parametrize(
    ("make", "message"),
    [
        (lambda: GRPO(clip_eps=0), "need 0 < eps_low < 1"),
        (lambda: GRPO(kl_coef=-1), "kl_coef and entropy_coef must be >= 0"),
        (lambda: GRPO(kl_estimator="k4"), "kl_estimator must be 'k1', 'k2' or 'k3'"),
        (lambda: PolicyGradient(ratio="word"), "ratio must be 'token' or 'sequence'"),
        (lambda: PolicyGradient(group_transform=MinReplace()), "needs ratio='sequence' and clip NoClip"),
        (lambda: PolicyGradient(ratio="sequence", clip=SymmetricClip(), group_transform=MinReplace()), "clip NoClip"),
        (lambda: DualClip(c=0.5), "c must be > 1"),
    ],
)
def test_bad_options_are_refused(make, message):
    with pytest.raises(ValueError, match=message):
        make()


@pytest.mark.parametrize("name", list(OBJECTIVES))
def test_an_objective_whose_credits_need_no_values_gives_the_same_output_at_any_log_probs(name):
    """Where ``credits_need_values`` says no (no old or sampler log-probs, no KL or entropy term), the training pass takes
    the credits from the objective at zeros (``RLModule.training_step``): they, the loss and every metric must be the
    same at the pass's own log-probs."""
    objective = OBJECTIVES[name]()
    batch, values = random_batch(3, 5, 11, seed=3, spread=1.0, with_ref=True)
    batch.old_logprobs = None
    needs_values = objective.credits_need_values(old_logprobs=False, sampler_logprobs=False)
    assert needs_values == (objective.kl_coef > 0 or objective.entropy_coef > 0)
    assert objective.credits_need_values(old_logprobs=True, sampler_logprobs=False)
    assert objective.credits_need_values(old_logprobs=False, sampler_logprobs=True)
    if needs_values:  # a KL or entropy term's credits read the values (k1's happen not to: the answer may be cautious)
        return
    at_zeros, at_values = objective(torch.zeros_like(values), batch), objective(values, batch)
    torch.testing.assert_close(at_zeros.credits, at_values.credits, rtol=0, atol=0)
    torch.testing.assert_close(at_zeros.loss, at_values.loss)
    assert at_zeros.metrics.keys() == at_values.metrics.keys()
    for metric in at_zeros.metrics:
        torch.testing.assert_close(at_zeros.metrics[metric], at_values.metrics[metric], msg=metric)


def test_a_subclass_that_computes_the_loss_its_own_way_is_taken_to_read_the_values():
    """Its credits are not known before the pass: the training step runs the whole pass, then the objective."""

    class Scaled(GRPO):
        def __call__(self, logprobs, batch):
            out = super().__call__(logprobs, batch)
            out.loss = out.loss * logprobs.detach().mean().exp()
            return out

    assert not GRPO().credits_need_values(old_logprobs=False, sampler_logprobs=False)
    assert Scaled().credits_need_values(old_logprobs=False, sampler_logprobs=False)
