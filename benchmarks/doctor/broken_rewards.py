"""Broken rewards for ``benchmarks/doctor/planted_faults.py``, as a reward function that reads the wrong field, scores only the
text's form, or returns a default, does."""

import zlib


def ignores_answer(record: dict, completion: str) -> float:
    """1 or 0 by a checksum of the completion's text: independent of whether its answer is right."""
    return float(zlib.crc32(completion.encode()) % 2)


def always_one(record: dict, completion: str) -> float:
    """1 whatever the completion: no group's rewards differ."""
    return 1.0
