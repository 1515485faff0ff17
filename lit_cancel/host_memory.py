"""Handing freed host memory back to the system before a rollout, where the C library is glibc (Linux).

glibc's ``malloc`` raises its mmap threshold each time a large block is freed, so later tensors of up to
32 MiB come from its heap, and when they are freed the memory stays in the process. A rollout that starts
after a training pass then stacks its KV cache on top of all the memory the pass freed: the process's peak
is the two phases' sum, not the larger. ``malloc_trim`` gives the free pages back (in the middle of the heap
too, not only at its end); it runs only when at least ``min_free`` bytes are free and have stayed resident since it
last ran, so that steps that free little do not pay for touching fresh pages again.

oneDNN, which runs torch's bfloat16 matrix products on a CPU, compiles a kernel for every matrix shape it meets
and keeps up to 1,024 of them; completion lengths change the shapes every step, so by default that cache grows
over the first few dozen steps (by about 200 MiB for a 0.8 M-parameter model). :func:`bound_kernel_cache` caps it.
"""

import ctypes
import ctypes.util
import os
import threading
from functools import cache

KERNEL_CACHE_VARIABLE = "ONEDNN_PRIMITIVE_CACHE_CAPACITY"
# the least the process held and did not use (_idle_bytes) since free pages were last handed back; before they ever
# were, none
_least_idle = 0
_release_lock = threading.Lock()  # a rollout may run in a thread beside training


class _MallInfo2(ctypes.Structure):
    _fields_ = [(name, ctypes.c_size_t) for name in
                ("arena", "ordblks", "smblks", "hblks", "hblkhd", "usmblks", "fsmblks", "uordblks", "fordblks", "keepcost")]


@cache
def _glibc() -> ctypes.CDLL | None:
    name = ctypes.util.find_library("c")
    try:
        libc = ctypes.CDLL(name)
        libc.mallinfo2.restype = _MallInfo2
        libc.malloc_trim.argtypes = [ctypes.c_size_t]
    except (OSError, AttributeError, TypeError):  # not glibc, or one older than 2.33
        return None
    return libc


def free_heap_bytes() -> int | None:
    """Bytes free in glibc's heaps (``mallinfo2().fordblks``), still held by the process; None without glibc."""
    libc = _glibc()
    return None if libc is None else libc.mallinfo2().fordblks


def release_free_heap(min_free: int = 256 * 2**20) -> bool:
    """Hands the heap's free pages back to the system when at least ``min_free`` bytes are free and what the process
    holds without using it has grown by ``min_free`` over the least it was since the last time; whether it did.

    Pages handed back stay in glibc's lists of free chunks, so the count of free bytes alone would trim again at every
    call, each time paying to touch fresh pages for what the next tensors take from those chunks (a training pass in
    chunks calls this twice per chunk). What the process holds and does not use is its resident memory less the heap's
    chunks in use and its mmapped blocks: it grows when freed chunks stay resident, not when handed-back ones sit in
    the lists."""
    global _least_idle
    libc = _glibc()
    if libc is None:
        return False
    with _release_lock:
        heap = libc.mallinfo2()
        idle = _idle_bytes(heap)
        _least_idle = min(_least_idle, idle)
        if heap.fordblks < min_free or idle - _least_idle < min_free:
            return False
        libc.malloc_trim(0)
        _least_idle = _idle_bytes(libc.mallinfo2())
    return True


def resident_bytes() -> int:
    """The process's resident memory (Linux's ``/proc/self/statm``), now rather than at its peak."""
    with open("/proc/self/statm") as statm:
        return int(statm.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def _idle_bytes(heap: _MallInfo2) -> int:
    """The process's resident bytes less the heap's chunks in use and its mmapped blocks."""
    return resident_bytes() - heap.uordblks - heap.hblkhd


def bound_kernel_cache(capacity: int = 64) -> bool:
    """Caps oneDNN's cache of compiled CPU kernels at ``capacity`` (``ONEDNN_PRIMITIVE_CACHE_CAPACITY``) unless that
    variable is set already; whether it set it.

    oneDNN reads the variable once, when the process first runs one of its kernels, so lit_cancel calls this
    before its first model arithmetic (``RLModule``'s constructor, ``precision: auto``'s measurement). 64 kernels
    is fewer than one step meets, so some are built again every step (``ONEDNN_VERBOSE=profile_create`` shows them),
    for less peak memory; set the variable to 1024 for oneDNN's default.
    """
    if KERNEL_CACHE_VARIABLE in os.environ:
        return False
    os.environ[KERNEL_CACHE_VARIABLE] = str(capacity)
    return True
