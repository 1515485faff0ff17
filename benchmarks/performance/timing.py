"""Timing one call of a function, for the microbenchmarks of ``benchmarks/performance``."""

import statistics
import time


def median_ms(call, operands: tuple, repeats: int) -> float:
    """The median milliseconds of ``call(*operands)`` over ``repeats`` calls, after one untimed call."""
    call(*operands)
    times = []
    for _ in range(repeats):
        started = time.perf_counter()
        call(*operands)
        times.append(time.perf_counter() - started)
    return 1e3 * statistics.median(times)
