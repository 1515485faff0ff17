import pytest
import torch

from lit_cancel.batch import RolloutBatch
from lit_cancel.objectives import GRPO, group_advantages, k3_kl


def test_group_advantages_by_hand():
    rewards = torch.tensor([[1.0, 0.0, 0.0, 1.0], [1.0, 1.0, 1.0, 0.0], [0.0, 0.0, 0.0, 0.0]])
    centred = group_advantages(rewards, scale_by_std=False)
    assert torch.allclose(centred[0], torch.tensor([0.5, -0.5, -0.5, 0.5]))
    assert torch.allclose(centred[1], torch.tensor([0.25, 0.25, 0.25, -0.75]))
    assert torch.equal(centred[2], torch.zeros(4))
    scaled = group_advantages(rewards, scale_by_std=True, eps=0.0)
    # unbiased std of [1,0,0,1] is sqrt(1/3); of [1,1,1,0] it is 0.5
    assert torch.allclose(scaled[0], torch.tensor([0.5, -0.5, -0.5, 0.5]) * 3**0.5)
    assert torch.allclose(scaled[1], torch.tensor([0.5, 0.5, 0.5, -1.5]))
    assert torch.equal(group_advantages(rewards)[2], torch.zeros(4))  # equal rewards: 0, not NaN


def test_k3_kl_derivative_matches_autograd():
    logprobs = torch.randn(5, requires_grad=True)
    ref = torch.randn(5)
    kl, derivative = k3_kl(logprobs, ref)
    assert (kl >= 0).all()
    (grad,) = torch.autograd.grad(kl.sum(), logprobs)
    assert torch.allclose(grad, derivative)


def make_batch(num_groups: int, group_size: int, length: int, seed: int, off_policy: float, with_ref: bool):
    generator = torch.Generator().manual_seed(seed)
    rows = num_groups * group_size
    lengths = torch.randint(1, length + 1, (rows,), generator=generator)
    mask = (torch.arange(length) < lengths.unsqueeze(1)).long()
    rewards = torch.randint(0, 2, (num_groups, group_size), generator=generator).float()
    rewards[:, :2] = torch.tensor([1.0, 0.0])  # every group has mixed rewards
    old = -torch.rand(rows, length, generator=generator) * 3
    return RolloutBatch(
        input_ids=torch.zeros(rows, length + 1, dtype=torch.long),
        attention_mask=torch.ones(rows, length + 1, dtype=torch.long),
        completion_mask=mask,
        prompt_length=1,
        rewards=rewards.view(-1),
        advantages=group_advantages(rewards).view(-1),
        group_ids=torch.arange(num_groups).repeat_interleave(group_size),
        old_logprobs=old,
        ref_logprobs=old + torch.randn(rows, length, generator=generator) * 0.3 if with_ref else None,
        step_sequences=rows,
        step_tokens=int(mask.sum()),
    ), old + torch.randn(rows, length, generator=generator) * off_policy


@pytest.mark.parametrize(
    ("num_groups", "group_size", "length", "off_policy", "kl_coef"),
    [(1, 2, 3, 0.0, 0.0), (2, 4, 7, 0.3, 0.0), (3, 5, 11, 0.5, 0.1), (4, 8, 16, 1.0, 0.05)],
)
def test_grpo_gradient_equals_credit_weighted_logprob_gradient(num_groups, group_size, length, off_policy, kl_coef):
    batch, logprob_values = make_batch(num_groups, group_size, length, seed=length, off_policy=off_policy, with_ref=kl_coef > 0)
    # log-probs as a differentiable function of parameters, so the identity is checked on parameter gradients
    generator = torch.Generator().manual_seed(0)
    features = torch.randn(*logprob_values.shape, 6, generator=generator)
    theta = torch.zeros(6, requires_grad=True)
    logprobs = logprob_values + features @ theta
    objective = GRPO(clip_eps=0.2, kl_coef=kl_coef)
    out = objective(logprobs, batch)
    (grad_loss,) = torch.autograd.grad(out.loss, theta, retain_graph=True)
    (grad_credits,) = torch.autograd.grad(-(out.credits * logprobs).sum(), theta)
    assert not out.credits.requires_grad
    assert torch.allclose(grad_loss, grad_credits, atol=1e-6, rtol=1e-5)
    assert grad_loss.abs().sum() > 0
    assert torch.equal(out.credits[batch.completion_mask == 0], torch.zeros_like(out.credits[batch.completion_mask == 0]))
    if off_policy > 0:
        assert 0 < out.metrics["objective/clip_frac"] < 1


def test_grpo_credit_by_hand():
    # one group of two, lengths 1 and 2, on-policy: c_it = A_i / (S |y_i|)
    batch = RolloutBatch(
        input_ids=torch.zeros(2, 3, dtype=torch.long),
        attention_mask=torch.ones(2, 3, dtype=torch.long),
        completion_mask=torch.tensor([[1, 0], [1, 1]]),
        prompt_length=1,
        rewards=torch.tensor([1.0, 0.0]),
        advantages=torch.tensor([0.5, -0.5]),
        group_ids=torch.tensor([0, 0]),
        step_sequences=2,
    )
    out = GRPO()(torch.log(torch.tensor([[0.5, 0.1], [0.4, 0.3]])), batch)
    assert torch.allclose(out.credits, torch.tensor([[0.25, 0.0], [-0.125, -0.125]]))
    # the first token is shared but its credits do not cancel: +0.25 - 0.125
    assert out.credits[:, 0].sum() == pytest.approx(0.125)


def test_grpo_clipping_zeroes_credit_outside_the_range():
    batch = RolloutBatch(
        input_ids=torch.zeros(2, 2, dtype=torch.long),
        attention_mask=torch.ones(2, 2, dtype=torch.long),
        completion_mask=torch.ones(2, 1, dtype=torch.long),
        prompt_length=1,
        rewards=torch.tensor([1.0, 0.0]),
        advantages=torch.tensor([1.0, -1.0]),
        group_ids=torch.tensor([0, 0]),
        old_logprobs=torch.log(torch.tensor([[0.5], [0.5]])),
        step_sequences=2,
    )
    # ratio 1.5 with A > 0 is clipped (no credit); ratio 0.6 with A < 0 is clipped too
    out = GRPO(clip_eps=0.2)(torch.log(torch.tensor([[0.75], [0.3]])), batch)
    assert torch.equal(out.credits, torch.zeros(2, 1))
    assert out.metrics["objective/clip_frac"] == 1.0
    # ratio 1.5 with A < 0 is not clipped: credit r * A / S = 1.5 * -1 / 2
    out = GRPO(clip_eps=0.2)(torch.log(torch.tensor([[0.5], [0.75]])), batch)
    assert torch.allclose(out.credits, torch.tensor([[0.5], [-0.75]]))


def test_grpo_rejects_bad_options():
    with pytest.raises(ValueError, match="clip_eps must be > 0"):
        GRPO(clip_eps=0)
    with pytest.raises(ValueError, match="kl_coef must be >= 0"):
        GRPO(kl_coef=-1)
