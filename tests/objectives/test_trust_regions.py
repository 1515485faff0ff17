"""Trust regions: their weights by hand, the credits they give against autograd, and the audit's verdicts."""

import pytest
import torch

from lit_cancel import DAPO, DFPOMin, DFPOMinTR, DFPOOrth, GroupRatioDrop, TokenRatioMask, TokenRatioWeight
from lit_cancel.batch import RolloutBatch
from lit_cancel.objectives.audit import SCENARIOS, _group, audit, credits, main

SHARED_OUTSIDE = "shared tokens outside the clip range"
REGIONS = [TokenRatioMask, GroupRatioDrop, TokenRatioWeight]


def batch_of(log_ratio: torch.Tensor, mask: torch.Tensor, group_ids: torch.Tensor, advantages: torch.Tensor) -> RolloutBatch:
    rows, width = mask.shape
    tokens = torch.arange(rows * width).view(rows, width) % 7 + 10
    return RolloutBatch(
        input_ids=torch.cat([torch.ones(rows, 1, dtype=torch.long), tokens], 1),
        attention_mask=torch.cat([torch.ones(rows, 1, dtype=torch.long), mask], 1),
        completion_mask=mask, prompt_length=1, rewards=advantages.clone(), advantages=advantages, group_ids=group_ids,
        old_logprobs=torch.full((rows, width), -1.0) * mask, step_sequences=float(rows), step_tokens=float(mask.sum()),
    )


def test_token_ratio_mask_by_hand():
    log_ratio = torch.log(torch.tensor([[1.0, 1.19, 1.21, 0.81], [0.79, 1.0, 1.0, 1.0]]))
    mask = torch.tensor([[1, 1, 1, 1], [1, 1, 1, 0]])
    batch = batch_of(log_ratio, mask, torch.tensor([0, 0]), torch.tensor([1.0, -1.0]))
    weights = TokenRatioMask(0.2)(log_ratio * mask, mask.float(), batch)
    assert weights.tolist() == [[1, 1, 0, 1], [0, 1, 1, 0]]


def test_group_ratio_drop_by_hand():
    # sequence ratios: row 0 exp(mean(0.3, 0.1)) = exp(0.2) = 1.22 (outside 0.2), row 1 1.0, rows 2-3 exp(0.1) = 1.105
    log_ratio = torch.tensor([[0.3, 0.1, 0.0], [0.0, 0.0, 0.0], [0.1, 0.1, 0.1], [0.1, 0.0, 0.0]])
    mask = torch.tensor([[1, 1, 0], [1, 1, 1], [1, 1, 1], [1, 0, 0]])
    batch = batch_of(log_ratio, mask, torch.tensor([4, 4, 9, 9]), torch.tensor([1.0, -1.0, 1.0, -1.0]))
    weights = GroupRatioDrop(0.2)(log_ratio * mask, mask.float(), batch)
    # group 4 leaves the step whole; group 9 stays
    assert weights.tolist() == [[0, 0, 0], [0, 0, 0], [1, 1, 1], [1, 0, 0]]


def test_token_ratio_weight_is_the_ratio():
    log_ratio = torch.tensor([[0.1, -0.2], [0.3, 0.0]])
    mask = torch.tensor([[1, 1], [1, 0]])
    batch = batch_of(log_ratio, mask, torch.tensor([0, 0]), torch.tensor([1.0, -1.0]))
    weights = TokenRatioWeight()(log_ratio * mask, mask.float(), batch)
    assert torch.allclose(weights, torch.tensor([[1.1051709, 0.8187308], [1.3498588, 0.0]]))


@pytest.mark.parametrize("region", [TokenRatioMask, GroupRatioDrop])
def test_eps_is_validated(region):
    for eps in (0.0, 1.0, -0.1):
        with pytest.raises(ValueError, match=f"{region.__name__}: eps must be in \\(0, 1\\)"):
            region(eps)


def scenario_batch(objective, name: str) -> tuple[torch.Tensor, RolloutBatch, torch.Tensor, torch.Tensor]:
    index = list(SCENARIOS).index(name)
    tokens, mask, rewards, old, current, sampler, _ = _group(rewards=[1.0, 0.0, 1.0, 0.0], seed=index, **SCENARIOS[name])
    group_ids = torch.arange(2).repeat_interleave(rewards.shape[1])
    batch = RolloutBatch(
        input_ids=torch.cat([torch.ones(len(tokens), 1, dtype=torch.long), tokens], 1),
        attention_mask=torch.cat([torch.ones(len(tokens), 1, dtype=torch.long), mask], 1),
        completion_mask=mask, prompt_length=1, rewards=rewards.view(-1), advantages=objective.advantages(rewards).view(-1),
        group_ids=group_ids, old_logprobs=old, sampler_logprobs=sampler, step_sequences=float(len(tokens)),
        step_tokens=float(mask.sum()),
    )
    return current, batch, tokens, mask


# GroupRatioDrop at 0.15 drops the first group of that scenario (a sequence ratio of 1.198) and keeps the second
@pytest.mark.parametrize("region", [TokenRatioMask(), GroupRatioDrop(0.15), TokenRatioWeight()], ids=lambda r: type(r).__name__)
def test_dfpo_credits_with_a_trust_region_by_hand_and_by_autograd(region):
    objective = DFPOMin(length=8.0, trust_region=region)
    current, batch, _, mask = scenario_batch(objective, "own tokens outside the clip range")
    reported, autograd = credits(objective, current, batch)
    log_ratio = (current - batch.old_logprobs) * mask
    sequence_ratio = (log_ratio.sum(1) / mask.sum(1)).exp()
    smallest = torch.stack([sequence_ratio[batch.group_ids == g].min() for g in batch.group_ids])
    weights = region(log_ratio, mask.float(), batch)
    # c_it = min_j s_j * A_i * weight_it / (S L), S = 8 sequences, L = 8
    expected = smallest.unsqueeze(1) * batch.advantages.unsqueeze(1) * weights / (8 * 8.0)
    assert torch.allclose(reported, expected, atol=1e-7) and torch.allclose(autograd, expected, atol=1e-7)
    assert not torch.equal(weights, mask.float()) and weights.sum() > 0  # the region acts here, and leaves some credit


@pytest.mark.parametrize("region", REGIONS)
@pytest.mark.parametrize("objective", [DFPOMin, DFPOOrth])
def test_trust_regions_keep_dfpo_cancelling_in_every_scenario(objective, region, capsys):
    assert main([objective.__name__, "--trust-region", region.__name__]) == 0
    assert f"with {region.__name__}" in capsys.readouterr().out


@pytest.mark.parametrize("region", REGIONS)
def test_each_trust_region_acts_where_the_shared_ratio_left_the_range(region):
    objective = DFPOMin(trust_region=region())
    current, batch, tokens, mask = scenario_batch(objective, SHARED_OUTSIDE)
    log_ratio = (current - batch.old_logprobs) * mask
    weights = region()(log_ratio, mask.float(), batch)
    assert (weights[:, :4] != 1).all()  # the four shared positions, ratio exp(0.3) = 1.35
    assert audit(objective)[SHARED_OUTSIDE].policy_tax == 0.0


def test_ppo_asymmetric_clip_stops_cancelling_where_it_acts_at_shared_positions(capsys):
    results = audit(DAPO())
    assert all(results[name].policy_tax < 1e-7 for name in SCENARIOS if name != SHARED_OUTSIDE)
    assert results[SHARED_OUTSIDE].policy_tax > 0.1
    assert main(["DAPO"]) == 1
    assert "DOES NOT CANCEL" in capsys.readouterr().out


def test_dfpo_min_tr_is_dfpo_min_with_the_token_ratio_mask():
    preset, composed = DFPOMinTR(eps=0.1), DFPOMin(trust_region=TokenRatioMask(0.1))
    current, batch, _, _ = scenario_batch(preset, "own tokens outside the clip range")
    out, expected = preset(current, batch), composed(current, batch)
    assert torch.equal(out.credits, expected.credits)
    assert 0 < float(out.metrics["objective/trust_region_zero_frac"]) < 1
    assert main(["DFPOMinTR"]) == 0


def test_trust_region_metrics_by_hand():
    objective = DFPOMin(trust_region=TokenRatioMask(0.2))
    log_ratio = torch.log(torch.tensor([[1.0, 1.5, 1.0], [1.0, 1.0, 1.0]]))
    mask = torch.tensor([[1, 1, 1], [1, 1, 0]])
    batch = batch_of(log_ratio, mask, torch.tensor([0, 0]), torch.tensor([1.0, -1.0]))
    metrics = objective(batch.old_logprobs + log_ratio * mask, batch).metrics
    assert float(metrics["objective/trust_region_zero_frac"]) == pytest.approx(1 / 5)
    assert float(metrics["objective/trust_region_mean"]) == pytest.approx(4 / 5)
