"""The draw stage: which prompts each draw of a round takes.

The prompts of a run are consecutive slices of seeded permutations of the task's training records, a new permutation
for each pass over them; each process takes its own part of every draw.
"""

import functools

import torch

from lit_cancel.tasks import Record


def draw_records(records: list[Record], draw: int, prompts_per_draw: int, rank: int, world: int, seed: int) -> list[Record]:
    """The prompts of draw ``draw`` for process ``rank`` of ``world``: ``prompts_per_draw // world`` consecutive records
    of the permutations of ``records`` seeded ``seed``, ``seed + 1``, ... (one for each pass over them)."""
    per_rank = prompts_per_draw // world
    first = draw * prompts_per_draw + rank * per_rank
    picked = []
    for position in range(first, first + per_rank):
        epoch, index = divmod(position, len(records))
        picked.append(records[_permutation(len(records), seed + epoch)[index]])
    return picked


@functools.lru_cache(maxsize=4)
def _permutation(size: int, seed: int) -> list[int]:
    return torch.randperm(size, generator=torch.Generator().manual_seed(seed)).tolist()
