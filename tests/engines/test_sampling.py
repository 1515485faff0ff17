"""The decode loop's draw (lit_cancel.engines.decode_loop.sample_tokens): the softmax's distribution, tokens of probability
zero never chosen, and an error on logits that are not finite."""

import math

import pytest
import torch
from scipy.stats import chisquare

from lit_cancel.engines.decode_loop import sample_tokens, tokens_at


def test_draws_follow_the_softmax_of_the_scores_and_never_a_masked_token():
    scores = torch.tensor([1.0, -float("inf"), 0.0, 2.0, -1.0, -float("inf")])  # as top-k leaves them
    probabilities = torch.softmax(scores, dim=-1)
    torch.manual_seed(0)
    draws = sample_tokens(scores.expand(200_000, -1))
    counts = torch.bincount(draws, minlength=6)
    assert counts[1] == 0 and counts[5] == 0
    kept = [0, 2, 3, 4]
    expected = probabilities[kept].double() / probabilities[kept].double().sum() * len(draws)
    assert chisquare(counts[kept].double().numpy(), expected.numpy()).pvalue > 1e-3
    # each frequency within 5 standard errors of its probability (0.0055 at p = 0.2 over 200,000 draws: about 0.0045)
    for token in kept:
        p = float(probabilities[token])
        assert abs(float(counts[token]) / len(draws) - p) < 5 * math.sqrt(p * (1 - p) / len(draws))


def test_a_draw_is_the_token_whose_slice_of_the_cumulative_distribution_holds_it():
    cumulative = torch.tensor([[0.0, 0.25, 0.25, 1.0, 1.0]], dtype=torch.float64)  # probabilities 0, 0.25, 0, 0.75, 0

    def token(point: float) -> int:
        return int(tokens_at(cumulative, torch.tensor([[point]], dtype=torch.float64)))

    assert token(1e-300) == 1  # the smallest point: not token 0, of probability zero
    assert token(0.25) == 1  # a slice holds its upper end
    assert token(0.25 + 1e-12) == 3  # past token 2's empty slice
    assert token(1.0) == 3  # the largest point, the total: not token 4, of probability zero


def test_logits_that_are_not_finite_raise_instead_of_sampling():
    scores = torch.zeros(3, 8)
    scores[1, 2] = float("nan")
    with pytest.raises(ValueError, match="not finite"):
        sample_tokens(scores)
