"""The decode loop's draw (lit_cancel.engines.draw): the softmax's distribution, tokens of probability zero never
chosen, the blocked search over a real vocabulary the same as the search over the whole cumulative sum, and an error on
logits that are not finite."""

import math

import pytest
import torch
from scipy.stats import chisquare

from lit_cancel.engines.draw import BLOCKED_FROM, DRAW_BLOCK, block_sums, sample_tokens, tokens_at, tokens_in_blocks


def assert_follows(draws: torch.Tensor, probabilities: torch.Tensor, kept: list[int]) -> None:
    counts = torch.bincount(draws, minlength=len(probabilities))
    assert int(counts.sum()) == int(counts[kept].sum()), "a token of probability zero was drawn"
    expected = probabilities[kept].double() / probabilities[kept].double().sum() * len(draws)
    assert chisquare(counts[kept].double().numpy(), expected.numpy()).pvalue > 1e-3
    # each frequency within 5 standard errors of its probability
    for token in kept:
        p = float(probabilities[token])
        assert abs(float(counts[token]) / len(draws) - p) < 5 * math.sqrt(p * (1 - p) / len(draws))


def test_draws_follow_the_softmax_of_the_scores_and_never_a_masked_token():
    scores = torch.tensor([1.0, -float("inf"), 0.0, 2.0, -1.0, -float("inf")])  # as top-k leaves them
    torch.manual_seed(0)
    assert_follows(sample_tokens(scores.expand(200_000, -1)), torch.softmax(scores, dim=-1), kept=[0, 2, 3, 4])


def test_over_a_real_vocabulary_the_blocked_draw_follows_the_softmax_at_block_edges_and_in_the_last_part_block():
    vocabulary = BLOCKED_FROM + 904  # four whole blocks and a part block
    scores = torch.full((vocabulary,), -float("inf"))
    # a block's first and last tokens, a masked block (the third), and the part block's first and last tokens
    kept = [0, DRAW_BLOCK - 1, DRAW_BLOCK, 3 * DRAW_BLOCK + 17, 4 * DRAW_BLOCK, vocabulary - 1]
    scores[kept] = torch.tensor([0.5, -1.0, 1.0, 0.0, 2.0, -0.5])
    torch.manual_seed(0)
    draws = torch.cat([sample_tokens(scores.expand(5_000, -1)) for _ in range(8)])
    assert_follows(draws, torch.softmax(scores, dim=-1), kept)


@pytest.mark.parametrize("vocabulary", [2 * DRAW_BLOCK + 300, 3 * DRAW_BLOCK])  # with a part block and without
def test_the_blocked_search_picks_what_the_search_over_the_whole_cumulative_sum_picks(vocabulary):
    torch.manual_seed(0)
    probabilities = torch.softmax(3 * torch.randn(64, vocabulary, dtype=torch.float64), dim=-1)
    probabilities[:, DRAW_BLOCK - 5 : DRAW_BLOCK + 5] = 0  # zeros across a block's edge
    cumulative = probabilities.cumsum(-1)
    points = (1 - torch.rand(64, 1, dtype=torch.float64)) * cumulative[:, -1:]
    running = block_sums(probabilities, DRAW_BLOCK).cumsum(-1)
    assert torch.equal(tokens_in_blocks(probabilities, running, points, DRAW_BLOCK), tokens_at(cumulative, points))


def test_a_blocked_draw_is_the_token_whose_slice_holds_the_point_and_never_one_of_probability_zero():
    # blocks of two: [0, 0.25], [0, 0], [0.5, 0.25] and a part block [0]
    probabilities = torch.tensor([[0.0, 0.25, 0.0, 0.0, 0.5, 0.25, 0.0]], dtype=torch.float64)
    running = torch.tensor([[0.25, 0.25, 1.0, 1.0]], dtype=torch.float64)

    def token(point: float, running: torch.Tensor = running) -> int:
        return int(tokens_in_blocks(probabilities, running, torch.tensor([[point]], dtype=torch.float64), block=2))

    assert token(1e-300) == 1  # not token 0, of probability zero
    assert token(0.25) == 1  # a slice holds its upper end
    assert token(0.25 + 1e-12) == 4  # past the empty block
    assert token(0.75) == 4
    assert token(0.75 + 1e-12) == 5
    assert token(1.0) == 5  # the total: not token 6, of probability zero
    # a block's total a little above the sum inside it (float32 against float64): the block's last token that can be drawn
    assert token(1.0 + 1e-9, torch.tensor([[0.25, 0.25, 1.0 + 1e-9, 1.0 + 1e-9]], dtype=torch.float64)) == 5
    # the same in a part block: its last token, not a column past the vocabulary
    part = torch.tensor([[0.5, 0.25, 0.25]], dtype=torch.float64)
    point = torch.tensor([[1.0 + 1e-9]], dtype=torch.float64)
    assert int(tokens_in_blocks(part, torch.tensor([[0.75, 1.0 + 1e-9]], dtype=torch.float64), point, block=2)) == 2


def test_a_draw_is_the_token_whose_slice_of_the_cumulative_distribution_holds_it():
    cumulative = torch.tensor([[0.0, 0.25, 0.25, 1.0, 1.0]], dtype=torch.float64)  # probabilities 0, 0.25, 0, 0.75, 0

    def token(point: float) -> int:
        return int(tokens_at(cumulative, torch.tensor([[point]], dtype=torch.float64)))

    assert token(1e-300) == 1  # the smallest point: not token 0, of probability zero
    assert token(0.25) == 1  # a slice holds its upper end
    assert token(0.25 + 1e-12) == 3  # past token 2's empty slice
    assert token(1.0) == 3  # the largest point, the total: not token 4, of probability zero


@pytest.mark.parametrize("vocabulary", [8, BLOCKED_FROM + 1])
def test_logits_that_are_not_finite_raise_instead_of_sampling(vocabulary):
    scores = torch.zeros(3, vocabulary)
    scores[1, 2] = float("nan")
    with pytest.raises(ValueError, match="not finite"):
        sample_tokens(scores)
