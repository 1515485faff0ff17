"""The cancellation experiments on ScaffoldedAdditionTask: runs, statistics, and the report in docs/experiments.md.

    python benchmarks/study/experiments.py --only E2 --seeds 5      # run what is missing of E2 for seeds 0-4, then report
    python benchmarks/study/experiments.py --only E1 --max-runs 4   # a piece: at most 4 new runs
    python benchmarks/study/experiments.py --list                   # what is done and what is missing
    python benchmarks/study/experiments.py --report                 # tables and PNGs from the stored JSON alone
    python benchmarks/study/experiments.py --only E6 --seeds 5      # the coupling probe (benchmarks/study/coupling_probe.py)
    python benchmarks/study/experiments.py --replay benchmarks/study/results/E7/GRPO-s12v8-mu2-seed0.json   # bit-identical?

Every run is ``lit-cancel fit --config configs/scaffold.yaml`` with command-line overrides, as a
user would run it; its TensorBoard scalars are read back and stored as one JSON file per run in
``benchmarks/study/results/<experiment>/``. E6 alone is a probe of one model (``coupling_probe.py``).
A run whose JSON exists is skipped, so the study can be run in pieces. The report (tables with 95%
t-intervals over seeds, paired differences, PNGs) is rewritten between the markers in
``docs/experiments.md``. Needs matplotlib (``pip install -e ".[bench]"``).

The code is the package ``benchmarks/study/lab/``, each module importing only those before it:
``stats`` (pure statistics) <- ``runs`` (what runs, execution, replay) <- ``summaries`` (per-run numbers)
<- ``cells`` (table cells, Holm families) <- ``sections_e10``, ``sections_e11``, ``sections_e12`` (E10's, E11's, E12's)
<- ``sections`` (one per experiment) <- ``report`` (the document, PNGs, the README's numbers) <- this script;
``lab.parts`` holds the callbacks, trust regions and plans the runs load by class path.
"""

import argparse
import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from lab.report import write_report
from lab.runs import (
    EXPERIMENTS,
    PROBES,
    ROOT,
    TMP,
    describe_comparison,
    ensure_warmstart,
    execute,
    experiment_runs,
    probe_path,
    replay,
    run_probe,
)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--only", nargs="+", choices=EXPERIMENTS + PROBES, default=list(EXPERIMENTS + PROBES))
    parser.add_argument("--seeds", type=int, default=5, help="seeds 0 .. N-1")
    parser.add_argument("--settings", nargs="+", help="only these settings, e.g. s24v8 s0v0")
    parser.add_argument("--max-runs", type=int, default=None, help="stop after this many new runs")
    parser.add_argument("--jobs", type=int, default=1, help="runs at a time")
    parser.add_argument("--threads", type=int, default=None,
                        help="OMP_NUM_THREADS of each run; 1 is much faster on cores shared with other work")
    parser.add_argument("--list", action="store_true", help="print done and missing runs, run nothing")
    parser.add_argument("--report", action="store_true", help="only rewrite the report from the stored JSON")
    parser.add_argument("--replay", metavar="FILE", type=Path,
                        help="rerun one stored run's command and report whether its scalars are bit-identical")
    args = parser.parse_args()
    if args.replay:
        comparison = replay(args.replay, args.threads)
        for key, (stored, now) in comparison["provenance"].items():
            print(f"{key}: {stored} (stored), {now} (now)" + ("" if stored == now else "  <- differs"))
        print("\n".join(describe_comparison(comparison)))
        sys.exit(0 if comparison["identical"] else 1)
    runs = [run for name in args.only if name in EXPERIMENTS for run in experiment_runs(name, list(range(args.seeds)))]
    probes = [seed for seed in range(args.seeds) if "E6" in args.only and not probe_path(seed).exists()]
    if args.settings:
        runs = [run for run in runs if run.setting in args.settings]
    missing = [run for run in runs if not run.path.exists()]
    if args.list:
        for name in args.only:
            done = sum(1 for r in runs if r.experiment == name and r.path.exists())
            if name in PROBES:
                print(f"{name}: {args.seeds - len(probes)}/{args.seeds} seeds done")
            else:
                print(f"{name}: {done}/{sum(1 for r in runs if r.experiment == name)} runs done")
        return
    if not args.report:
        todo = missing[: args.max_runs]
        ensure_warmstart([" ".join(run.command(TMP)) for run in todo], args.threads)
        with ThreadPoolExecutor(args.jobs) as pool:
            for index, run in enumerate(pool.map(lambda r: execute(r, args.threads) or r, todo)):
                print(f"[{index + 1}/{len(todo)}] {run.path.relative_to(ROOT)}", flush=True)
        for seed in probes:
            run_probe(seed, args.threads)
            print(f"{probe_path(seed).relative_to(ROOT)}", flush=True)
    write_report()


if __name__ == "__main__":
    main()
