"""Training-health and logging callbacks, installed as ``lit_cancel.callbacks``.

Each file stands alone: it imports Lightning, torch and torchmetrics, never ``lit_cancel``, so it
can be copied into any Lightning project whose training step meets its documented contract; ``run_doctor.py``
takes its rules from ``diagnoses.py`` and ``doctor_rules.py``, copied with it.
"""

from .entropy_collapse import EntropyCollapseMonitor
from .learning_tax import LearningTaxMonitor
from .rollout_samples import RolloutSamplesLogger
from .run_doctor import RunDoctor
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
