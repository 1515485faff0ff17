"""The class paths ``experiment_parts.X`` that E8's and E9's stored commands name: the parts now live in ``lab.parts``.

Kept so that ``python benchmarks/study/experiments.py --replay`` reruns those commands as stored; new runs name ``lab.parts.X``.
"""

from lab.parts import AdvantageSign, ScaffoldProbe, SharedPositionNoise, SignSorted, scaffold_probabilities

__all__ = ["AdvantageSign", "ScaffoldProbe", "SharedPositionNoise", "SignSorted", "scaffold_probabilities"]
