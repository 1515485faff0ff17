"""A broken reward for ``benchmarks/doctor.py``: it varies between completions but never looks at the answer, as a
reward function that reads the wrong field or scores only the text's form does."""

import zlib


def ignores_answer(record: dict, completion: str) -> float:
    """1 or 0 by a checksum of the completion's text: independent of whether its answer is right."""
    return float(zlib.crc32(completion.encode()) % 2)
