"""The cancellation experiments' code (docs/experiments.md), run by ``python benchmarks/study/experiments.py``.

Each module imports only the ones before it, so there is no import circle:

* ``lab.stats``: the statistics, pure Python (intervals, t-tests, Holm, TOST, MDE, ratio intervals);
* ``lab.runs``: what each experiment runs, how a run is executed, stored (with its provenance) and replayed;
* ``lab.summaries``: each stored run's numbers, read from its TensorBoard scalars;
* ``lab.cells``: the tables' cells (intervals, p-values, verdicts, TOST, ratios) and the Holm families;
* ``lab.sections_e10``: E10's section, analysed as pre-registered in docs/experiments.md;
* ``lab.sections_e11``: E11's section, analysed as pre-registered in docs/experiments.md;
* ``lab.sections_e12``: E12's section and its check before the main runs, analysed as pre-registered there;
* ``lab.sections``: the sections of docs/experiments.md, one per experiment (E10's, E11's and E12's from their modules);
* ``lab.report``: docs/experiments.md's generated part, the PNGs and the experiment numbers of README.md;
* ``lab.parts``: callbacks, trust regions and plans the runs load by class path (``lab.parts.X``).

The results live beside the code, one JSON per run in ``benchmarks/study/results/<experiment>/``.
"""
