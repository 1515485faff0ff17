"""Running: the ``lit-cancel`` command and what keeps a run safe.

* :mod:`.console` (the console script) and :mod:`.commands` (the dispatcher of ``fit``, ``validate``, ``export``,
  ``audit-objective``, ``serve``, ``diagnose``, and their exit statuses);
* :mod:`.cli` (``LightningCLI`` for ``fit`` and ``validate``), :mod:`.errors` (one-line messages), :mod:`.checks` (the
  checkpoint a command is given), :mod:`.flags` (on/off options), :mod:`.export`;
* :mod:`.folders` (one run, one folder: ``--ckpt_path last``, the run folder's lock), :mod:`.checkpointing` (atomic
  writes, signals), :mod:`.log_errors` (logs that cannot be written);
* :mod:`.precision` (the ``Trainer`` with ``precision: auto``), :mod:`.progress` (the progress bar).
"""
