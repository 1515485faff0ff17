"""lit_cancel: critic-free RL fine-tuning of language models whose token gradients cancel within a group.

Names are imported on first use (PEP 562), so ``from lit_cancel.callbacks import ...`` loads the
callbacks alone, without the models, peft or the datamodules.
"""

import importlib
from typing import Any

from lit_cancel.exports import EXPORTS as _EXPORTS

__all__ = sorted(_EXPORTS)


def __getattr__(name: str) -> Any:
    if name not in _EXPORTS:
        raise AttributeError(f"module 'lit_cancel' has no attribute {name!r}")
    value = getattr(importlib.import_module(_EXPORTS[name]), name)
    globals()[name] = value  # later lookups skip this function
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(__all__))
