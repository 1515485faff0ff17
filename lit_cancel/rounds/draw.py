"""The draw stage: which prompts each draw of a round takes.

The prompts of a run are consecutive slices of seeded permutations of the task's training records, a new permutation
for each pass over them; each process takes its own part of every draw.
"""

import functools
from collections.abc import Sequence

import torch

from lit_cancel.tasks import Task


def draw_indices(count: int, draw: int, prompts_per_draw: int, rank: int, world: int, seed: int) -> list[int]:
    """Which of ``count`` records are the prompts of draw ``draw`` for process ``rank`` of ``world``:
    ``prompts_per_draw // world`` consecutive positions of the permutations of them seeded ``seed``, ``seed + 1``, ...
    (one for each pass over them)."""
    per_rank = prompts_per_draw // world
    first = draw * prompts_per_draw + rank * per_rank
    indices = []
    for position in range(first, first + per_rank):
        epoch, index = divmod(position, count)
        indices.append(_permutation(count, seed + epoch)[index])
    return indices


def record_names(task: Task, split: str, indices: Sequence[int]) -> list[str]:
    """How messages name records ``indices`` of ``split`` (``"train"`` or ``"val"``, indices into the task's records of
    that split): ``"val record 3"``, followed by where the task read it where it tells (``"val record 3 ('test.jsonl'
    line 5)"``, :meth:`~lit_cancel.tasks.Task.record_source`)."""
    names = []
    for index in indices:
        name, source = f"{split} record {index}", task.record_source(split, index)
        names.append(name if source == name else f"{name} ({source})")
    return names


@functools.lru_cache(maxsize=4)
def _permutation(size: int, seed: int) -> list[int]:
    return torch.randperm(size, generator=torch.Generator().manual_seed(seed)).tolist()
