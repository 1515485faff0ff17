"""The run doctor: why an RL run is not learning, named from the series it logs.

* :mod:`.diagnoses`: the rule book's frame (a run's series, a rule, a finding, the ranking of findings);
* :mod:`.rule_book`: the rules, each with its thresholds and where they came from;
* :mod:`.run_doctor`: :class:`RunDoctor`, the callback that diagnoses a run while it trains;
* :mod:`.history`: a finished run's TensorBoard files (lit_cancel's, TRL's, verl's) read into the rule book's names;
* :mod:`.command`: ``lit-cancel diagnose RUN_DIR``, its report and its exit status.

The callback needs the first two files beside it and imports Lightning and torch only; the last two need tensorboard
and rich, and are loaded only by the command.
"""

from .run_doctor import RunDoctor

__all__ = ["RunDoctor"]
