"""Sampler-mismatch corrections: their weights by hand, the objective's use of them, and the audit's verdicts."""

import math

import pytest
import torch

from lit_cancel import DFPOMin, DrGRPO, GroupMin, RolloutBatch, SequenceMask, SequenceTruncate, TokenMask, TokenTruncate
from lit_cancel.objectives.audit import audit, credits, main
from lit_cancel.objectives.policy_gradient import mismatch_metrics

MISMATCH = "sampler mismatch, equal lengths"


def log_ratio_and_mask():
    # two groups of two; row 1 has two tokens, the others three
    ratio = torch.tensor([[2.0, 0.5, 4.0], [1.0, 3.5, 1.0], [0.25, 1.0, 1.0], [1.5, 1.5, 1.5]])
    mask = torch.tensor([[1.0, 1.0, 1.0], [1.0, 1.0, 0.0], [1.0, 1.0, 1.0], [1.0, 1.0, 1.0]])
    return ratio.log() * mask, mask, torch.tensor([0, 0, 1, 1])


def test_token_corrections_by_hand():
    log_ratio, mask, groups = log_ratio_and_mask()
    truncated = TokenTruncate(clip_max=3.0, clip_min=0.5)(log_ratio, mask, groups)
    expected = torch.tensor([[2.0, 0.5, 3.0], [1.0, 3.0, 0.0], [0.5, 1.0, 1.0], [1.5, 1.5, 1.5]])
    torch.testing.assert_close(truncated, expected)
    masked = TokenMask(clip_max=3.0, clip_min=0.5)(log_ratio, mask, groups)
    expected = torch.tensor([[2.0, 0.5, 0.0], [1.0, 0.0, 0.0], [0.0, 1.0, 1.0], [1.5, 1.5, 1.5]])
    torch.testing.assert_close(masked, expected)


def test_sequence_corrections_by_hand():
    log_ratio, mask, groups = log_ratio_and_mask()
    # sequence ratios: 2 * 0.5 * 4 = 4; 1 * 3.5 = 3.5 (padding ignored); 0.25; 1.5^3 = 3.375
    truncated = SequenceTruncate(clip_max=3.0)(log_ratio, mask, groups)
    torch.testing.assert_close(truncated, torch.tensor([3.0, 3.0, 0.25, 3.0]).unsqueeze(1) * mask)
    masked = SequenceMask(clip_max=3.6)(log_ratio, mask, groups)
    torch.testing.assert_close(masked, torch.tensor([0.0, 3.5, 0.25, 3.375]).unsqueeze(1) * mask)
    group_min = GroupMin(SequenceMask(clip_max=3.6))(log_ratio, mask, groups)
    torch.testing.assert_close(group_min, torch.tensor([0.0, 0.0, 0.25, 0.25]).unsqueeze(1) * mask)


@pytest.mark.parametrize("arguments", [dict(clip_max=None, clip_min=None), dict(clip_max=-1.0), dict(clip_max=2.0, clip_min=2.0)])
def test_bounds_are_checked(arguments):
    with pytest.raises(ValueError, match="TokenTruncate"):
        TokenTruncate(**arguments)


def test_group_min_takes_sequence_corrections_only():
    with pytest.raises(ValueError, match="sequence-level"):
        GroupMin(TokenTruncate())


def test_mismatch_metrics_by_hand():
    log_ratio = torch.tensor([[0.1, -0.2], [0.0, 0.5]])
    mask = torch.tensor([[1.0, 1.0], [1.0, 0.0]])
    metrics = mismatch_metrics(log_ratio * mask, mask)
    assert metrics["rollout/logprob_mismatch"].item() == pytest.approx(0.3 / 3)
    assert metrics["rollout/logprob_mismatch_max"].item() == pytest.approx(0.2)
    k3 = sum(math.exp(d) - 1 - d for d in (0.1, -0.2, 0.0)) / 3
    assert metrics["rollout/sampler_kl"].item() == pytest.approx(k3, rel=1e-5)


def batch_with_sampler(sampler_shift: torch.Tensor) -> tuple[torch.Tensor, RolloutBatch]:
    torch.manual_seed(0)
    logprobs = -torch.rand(4, 5)
    mask = torch.ones(4, 5)
    batch = RolloutBatch(
        input_ids=torch.ones(4, 6, dtype=torch.long), attention_mask=torch.ones(4, 6, dtype=torch.long), completion_mask=mask,
        prompt_length=1, rewards=torch.tensor([1.0, 0.0, 1.0, 0.0]), advantages=torch.tensor([0.5, -0.5, 0.5, -0.5]),
        group_ids=torch.tensor([0, 0, 1, 1]), sampler_logprobs=logprobs - sampler_shift, step_sequences=4.0, step_tokens=20.0,
    )
    return logprobs, batch


def test_token_truncate_weights_each_tokens_credit_by_its_truncated_ratio():
    shift = torch.linspace(-1.5, 1.5, 20).view(4, 5)  # pi_train / pi_sampler from e^-1.5 to e^1.5
    logprobs, batch = batch_with_sampler(shift)
    objective = DrGRPO(length=5.0, correction=TokenTruncate(clip_max=2.0))
    reported, from_autograd = credits(objective, logprobs, batch)
    # on-policy: Dr. GRPO's credit is A_i / (S L), here times min(exp(shift), 2)
    expected = batch.advantages.unsqueeze(1) / (4 * 5.0) * shift.exp().clamp(max=2.0)
    torch.testing.assert_close(from_autograd, expected)
    torch.testing.assert_close(reported, expected)
    out = objective(logprobs.clone().requires_grad_(), batch)
    assert out.metrics["rollout/logprob_mismatch"].item() == pytest.approx(shift.abs().mean().item(), rel=1e-5)
    assert out.metrics["objective/correction_mean"].item() == pytest.approx(shift.exp().clamp(max=2.0).mean().item(), rel=1e-5)


def test_without_a_correction_the_mismatch_is_logged_and_the_credit_unchanged():
    logprobs, batch = batch_with_sampler(torch.full((4, 5), 0.3))
    objective = DrGRPO(length=5.0)
    _, from_autograd = credits(objective, logprobs, batch)
    torch.testing.assert_close(from_autograd, batch.advantages.unsqueeze(1).expand(4, 5) / 20.0)
    assert objective(logprobs, batch).metrics["rollout/logprob_mismatch"].item() == pytest.approx(0.3, rel=1e-5)


@pytest.mark.parametrize(
    ("correction", "cancels"),
    [(TokenTruncate(), True), (TokenMask(), True), (SequenceTruncate(), False), (SequenceMask(), False),
     (GroupMin(SequenceTruncate()), True), (GroupMin(SequenceMask()), True)],
)
def test_audit_separates_token_level_from_sequence_level_correction(correction, cancels):
    results = audit(DFPOMin(correction=correction))
    assert results["on-policy, equal lengths"].policy_tax < 1e-7
    if cancels:
        assert results[MISMATCH].policy_tax < 1e-7
    else:
        assert results[MISMATCH].policy_tax > 0.01
    assert all(r.credit_mismatch <= 1e-4 for r in results.values())


@pytest.mark.parametrize(("arguments", "code"), [
    (["DFPOMin", "--correction", "TokenTruncate"], 0),
    (["DFPOMin", "--correction", "SequenceMask"], 1),
    (["DFPOMin", "--correction", "SequenceTruncate"], 1),
    (["DFPOMin", "--correction", "GroupMin(SequenceTruncate)"], 0),
])
def test_audit_command_exit_codes_with_a_correction(arguments, code, capsys):
    assert main(arguments) == code
    printed = capsys.readouterr().out
    assert f"with {arguments[2]}" in printed
    assert ("DOES NOT CANCEL" in printed) == (code == 1)
