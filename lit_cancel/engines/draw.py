"""How the decode loop draws a token: :func:`sample_tokens`, one per row, from the softmax of its scores.

Each row's cumulative distribution is inverted at a uniform point: ``torch.multinomial`` on a CPU races one exponential
draw per vocabulary entry, several times slower (benchmarks/performance/sampling.py). Over a real vocabulary (more than
:data:`BLOCKED_FROM` tokens) the cumulative sum runs over blocks of :data:`DRAW_BLOCK` tokens first, then inside the
one block that holds the point: a float64 sum over the whole of Qwen2.5's 151,936 tokens took most of a draw.
"""

import torch
from torch import Tensor

DRAW_BLOCK = 1024
BLOCKED_FROM = 4 * DRAW_BLOCK


def sample_tokens(scores: Tensor) -> Tensor:
    """One token per row of ``scores`` (``[rows, vocabulary]`` logits after the processors), drawn from their softmax.

    Running sums are float64 (float32 on Apple's MPS, which has no float64); a block's own total is summed in float32,
    which moves a block's chance by about a millionth of itself. Logits that are not finite (a diverged model) raise
    instead of sampling."""
    dtype = torch.float32 if scores.device.type == "mps" else torch.float64
    probabilities = torch.softmax(scores, dim=-1)
    if probabilities.shape[-1] <= BLOCKED_FROM:
        return draw_over_whole(probabilities, dtype)
    running = block_sums(probabilities, DRAW_BLOCK).to(dtype).cumsum(-1)
    return tokens_in_blocks(probabilities, running, _uniform_points(running[:, -1:]), DRAW_BLOCK)


def draw_over_whole(probabilities: Tensor, dtype: torch.dtype = torch.float64) -> Tensor:
    """One token per row of ``probabilities`` from one cumulative sum in ``dtype`` over the whole vocabulary: the draw
    below :data:`BLOCKED_FROM` tokens."""
    cumulative = probabilities.cumsum(-1, dtype=dtype)
    return tokens_at(cumulative, _uniform_points(cumulative[:, -1:]))


def _uniform_points(total: Tensor) -> Tensor:
    if not bool(torch.isfinite(total).all()):
        raise ValueError("the decode loop: the policy's logits are not finite (NaN or inf), so nothing can be sampled; "
                         "the model has diverged or its weights hold NaN")
    return (1 - torch.rand(total.shape, dtype=total.dtype, device=total.device)) * total


def tokens_at(cumulative: Tensor, points: Tensor) -> Tensor:
    """The token of each row whose slice of ``cumulative`` (``[rows, vocabulary]``, non-decreasing) holds its point
    (``[rows, 1]``, in ``(0, total]``): the first entry at or above it. A token of probability zero adds an empty slice,
    so it is never chosen, at either end of the range included."""
    return torch.searchsorted(cumulative, points).squeeze(1)


def block_sums(probabilities: Tensor, block: int) -> Tensor:
    """Each row's sum over consecutive blocks of ``block`` tokens, the last block holding what is left."""
    rows, vocabulary = probabilities.shape
    whole = vocabulary // block * block
    sums = probabilities[:, :whole].reshape(rows, -1, block).sum(-1)
    if whole == vocabulary:
        return sums
    return torch.cat([sums, probabilities[:, whole:].sum(-1, keepdim=True)], dim=1)


def tokens_in_blocks(probabilities: Tensor, running: Tensor, points: Tensor, block: int) -> Tensor:
    """What :func:`tokens_at` gives over the cumulative sum of ``probabilities``, from the running sum of their
    blocks' totals (``running``, ``[rows, blocks]``) and a cumulative sum inside the one block that holds each point.

    The point's block is the first whose running total reaches it, so the part of the point left inside it is above
    zero; a block's float32 total and the float64 sum inside it differ in the last bits, and a point past the block's
    own sum takes its last token of nonzero probability. A token of probability zero is never chosen."""
    vocabulary = probabilities.shape[-1]
    chosen = torch.searchsorted(running, points)
    before = running.gather(1, (chosen - 1).clamp(min=0)).masked_fill(chosen == 0, 0)
    columns = chosen * block + torch.arange(block, device=probabilities.device)
    inside = probabilities.gather(1, columns.clamp(max=vocabulary - 1)).masked_fill(columns >= vocabulary, 0)
    cumulative = inside.cumsum(-1, dtype=running.dtype)
    left = torch.minimum(points - before, cumulative[:, -1:])
    return chosen.squeeze(1) * block + tokens_at(cumulative, left)
