"""Freed host memory goes back to the system before a rollout (glibc's malloc_trim), and only when there is much of it."""

import pytest
import torch

from lit_cancel import host_memory
from lit_cancel.host_memory import free_heap_bytes, release_free_heap, resident_bytes

MiB = 2**20
pytestmark = pytest.mark.skipif(free_heap_bytes() is None, reason="glibc 2.33 or later (Linux) only")


@pytest.fixture(autouse=True)
def nothing_released_yet(monkeypatch):
    monkeypatch.setattr(host_memory, "_least_idle", 0)


def heap_tensors(count: int) -> list[torch.Tensor]:
    """``count`` tensors of 1 MiB from glibc's heap."""
    large = torch.ones(24 * MiB, dtype=torch.uint8)
    del large  # a freed mmapped block raises glibc's mmap threshold: the tensors below now come from the heap
    return [torch.ones(MiB // 4) for _ in range(count)]


def test_the_memory_freed_tensors_leave_in_the_heap_goes_back_to_the_system():
    tensors = heap_tensors(400)
    last = tensors[-1]  # it holds the top of the heap, so nothing below it is trimmed when freed
    del tensors
    assert free_heap_bytes() >= 300 * MiB
    held = resident_bytes()
    assert not release_free_heap(min_free=2**40)  # less free than asked for: nothing happens
    assert resident_bytes() > held - 50 * MiB
    assert release_free_heap(min_free=256 * MiB)
    assert resident_bytes() < held - 300 * MiB
    assert last.sum() == MiB // 4  # what is still in use is untouched


def test_pages_handed_back_are_not_handed_back_again_until_as_much_more_has_been_freed():
    first = heap_tensors(400)
    second = heap_tensors(400)
    last = torch.ones(MiB // 4)  # holds the top of the heap
    del first
    assert release_free_heap(min_free=256 * MiB)
    held = resident_bytes()
    # the 400 MiB are still in glibc's free lists, already handed back: no second trim
    assert free_heap_bytes() >= 400 * MiB
    assert not release_free_heap(min_free=256 * MiB)
    reused = heap_tensors(200)  # takes 200 MiB of those chunks back, resident again
    del reused  # and frees them: 200 MiB resident and unused, below the 256 asked for
    assert not release_free_heap(min_free=256 * MiB)
    del second
    assert release_free_heap(min_free=256 * MiB)
    assert resident_bytes() < held - 300 * MiB
    assert last.sum() == MiB // 4
