"""Training-health and logging callbacks, installed as ``lit_cancel.callbacks``.

Each file stands alone: it imports Lightning, torch and torchmetrics, never ``lit_cancel``, so it
can be copied into any Lightning project whose training step meets its documented contract. The run doctor is a
folder, ``doctor/``, copied whole: the callback, its rules, and ``lit-cancel diagnose`` for finished runs.
"""

from .doctor.run_doctor import RunDoctor
from .entropy_collapse import EntropyCollapseMonitor
from .learning_tax import LearningTaxMonitor
from .rollout_samples import RolloutSamplesLogger
from .solution_drift import SolutionProbabilityDriftMonitor
from .token_flip import TokenFlipMonitor

__all__ = [
    "EntropyCollapseMonitor",
    "LearningTaxMonitor",
    "RolloutSamplesLogger",
    "RunDoctor",
    "SolutionProbabilityDriftMonitor",
    "TokenFlipMonitor",
]
