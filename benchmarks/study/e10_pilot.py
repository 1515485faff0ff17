"""E10's pilot (the gate) and its summary: forced branching (forced_branching.py), 3 seeds x 3 arms.

    python benchmarks/study/e10_pilot.py --seeds 3 --threads 1      # runs what is missing, one at a time, then summarises
    python benchmarks/study/e10_pilot.py --summary                  # the table from the stored JSON only

Every run is ``lit-cancel fit --config configs/scaffold.yaml`` with overrides, through ``lab.runs.execute``
(the same record: command, wall time, provenance, every TensorBoard scalar), stored in
``benchmarks/study/results/E10/pilot/<arm>-<setting>-seed<N>.json``. ``e10_arms`` holds the override list of
every arm of the main study, in ``lab.runs``.
"""

import argparse
import json
import math
import statistics
from dataclasses import dataclass
from pathlib import Path

from lab.runs import E10_SETTING, RESULTS, Run, e10_arms, e10_common, execute
from lab.stats import mean_interval as _mean_interval

PILOT = RESULTS / "E10" / "pilot"
# E2's GRPO at scaffold 12, spread 8: mean of health/learning_tax over steps, mean over its 5 seeds
E2_REFERENCE = ("E2", "GRPO", "s12v8")
PILOT_ARMS = ("DFPOMin", "DFPOMin-SharedNoise", "GRPO")


@dataclass(frozen=True)
class PilotRun(Run):
    """A run of E10's pilot, stored under ``E10/pilot/``."""

    @property
    def path(self) -> Path:
        return PILOT / f"{self.arm}-{self.setting}-seed{self.seed}.json"


# pilot 1 had no PreambleDrift probe (its per-step shared-context KL did not separate the arms); pilot 2 adds it,
# with the training itself unchanged (the probe samples in a forked random state)
PILOTS = {"pilot-" + E10_SETTING: "pilot 1 (per-step shared KL only)", "pilot2-" + E10_SETTING: "pilot 2 (+ PreambleDrift)"}
CURRENT = "pilot2-" + E10_SETTING


def pilot_runs(seeds: list[int]) -> list[PilotRun]:
    return [PilotRun("E10", arm, CURRENT, seed, (*e10_common(), *e10_arms(seed)[arm])) for seed in seeds for arm in PILOT_ARMS]


# ----------------------------------------------------------------------------------------------- summary
def mean_interval(values: list[float]) -> tuple[float, float]:
    """The t-interval of experiments.py; (nan, nan) where a run lacks the value."""
    return (math.nan, math.nan) if any(math.isnan(v) for v in values) else _mean_interval(values)


def series(record: dict, tag: str) -> list[float]:
    return [value for _, value in record["scalars"].get(tag, [])]


def mean_of(record: dict, tag: str) -> float:
    values = series(record, tag)
    return statistics.fmean(values) if values else math.nan


def last_of(record: dict, tag: str) -> float:
    values = series(record, tag)
    return values[-1] if values else math.nan


def reference_tax() -> tuple[float, int]:
    experiment, arm, setting = E2_REFERENCE
    paths = sorted((RESULTS / experiment).glob(f"{arm}-{setting}-seed*.json"))
    taxes = [mean_of(json.loads(path.read_text()), "health/learning_tax") for path in paths]
    return statistics.fmean(taxes), len(taxes)


OUTCOMES = {
    "learning tax": lambda r: mean_of(r, "health/learning_tax"),
    "shared-context KL (mean)": lambda r: mean_of(r, "health/shared_kl"),
    "shared-context KL (last)": lambda r: last_of(r, "health/shared_kl"),
    "preamble p": lambda r: mean_of(r, "rollout/preamble_p"),
    "group shared tokens": lambda r: mean_of(r, "rollout/group_shared_tokens"),
    "zero-std groups": lambda r: mean_of(r, "rollout/frac_zero_std_groups"),
    "preference entropy (start)": lambda r: series(r, "health/drift_preference_entropy")[0],
    "preference entropy (end)": lambda r: last_of(r, "health/drift_preference_entropy"),
    "val accuracy (start)": lambda r: series(r, "val/accuracy")[0],
    "val accuracy (end)": lambda r: last_of(r, "val/accuracy"),
    "completion length": lambda r: mean_of(r, "rollout/completion_len"),
    "preamble KL from start (last)": lambda r: last_of(r, "probe/preamble_kl"),
    "preamble KL from start (mean)": lambda r: mean_of(r, "probe/preamble_kl"),
    "probe preamble entropy (last)": lambda r: last_of(r, "probe/preamble_entropy"),
    "probe preamble p (last)": lambda r: last_of(r, "probe/preamble_p"),
    "wall s": lambda r: r["wall_s"],
}


def load(setting: str, folder: Path = PILOT) -> dict[str, dict[int, dict]]:
    runs: dict[str, dict[int, dict]] = {}
    for path in sorted(folder.glob(f"*-{setting}-seed*.json")):
        record = json.loads(path.read_text())
        runs.setdefault(record["arm"], {})[record["seed"]] = record
    return runs


def fmt(mean: float, half: float) -> str:
    if math.isnan(mean):
        return "–"
    small = abs(mean) < 0.01 and mean != 0
    if small:
        return f"{mean:.1e} ± {half:.1e}" if not math.isnan(half) else f"{mean:.1e}"
    return f"{mean:.3f} ± {half:.3f}" if not math.isnan(half) else f"{mean:.3f}"


def summary(setting: str) -> str:
    runs = load(setting)
    lines = [f"### {PILOTS.get(setting, setting)}", ""]
    lines += ["| arm | seeds | " + " | ".join(OUTCOMES) + " |", "|---|---|" + "---|" * len(OUTCOMES)]
    for arm in [a for a in PILOT_ARMS if a in runs] + sorted(set(runs) - set(PILOT_ARMS)):
        records = runs[arm]
        cells = [fmt(*mean_interval([f(r) for r in records.values()])) for f in OUTCOMES.values()]
        lines.append(f"| `{arm}` | {len(records)} | " + " | ".join(cells) + " |")
    reference, n = reference_tax()
    lines += ["", f"E2 reference: GRPO s12v8 learning tax {reference:.2e} (mean over steps, {n} seeds); 10x = {10 * reference:.2e}", ""]
    lines += ["| paired with `DFPOMin` (same seed) | " + " | ".join(OUTCOMES) + " |", "|---|" + "---|" * len(OUTCOMES)]
    base = runs.get("DFPOMin", {})
    for arm in runs:
        if arm == "DFPOMin":
            continue
        cells = []
        for f in OUTCOMES.values():
            seeds = sorted(set(base) & set(runs[arm]))
            differences = [f(runs[arm][s]) - f(base[s]) for s in seeds]
            mean, half = mean_interval(differences)
            sd = statistics.stdev(differences) if len(differences) > 1 and not math.isnan(mean) else math.nan
            cells.append(f"{fmt(mean, half)} (sd {sd:.2g})")
        lines.append(f"| `{arm}` − `DFPOMin` | " + " | ".join(cells) + " |")
    for arm, records in runs.items():
        for seed, record in sorted(records.items()):
            kl = series(record, "health/shared_kl")
            entropy = series(record, "health/drift_preference_entropy")
            drift = series(record, "probe/preamble_kl")
            lines.append(f"{arm} seed {seed}: shared KL {[f'{v:.2g}' for v in kl]}; preference entropy {[f'{v:.3f}' for v in entropy]}"
                         + (f"; preamble KL from start {[f'{v:.2g}' for v in drift]}" if drift else ""))
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--seeds", type=int, default=3)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--arms", nargs="+", choices=PILOT_ARMS, default=list(PILOT_ARMS))
    parser.add_argument("--summary", action="store_true", help="only print the summary of the stored runs")
    args = parser.parse_args()
    if not args.summary:
        for run in pilot_runs(list(range(args.seeds))):
            if run.arm in args.arms and not run.path.exists():
                execute(run, args.threads)
                print(f"{run.path.relative_to(RESULTS.parent.parent)}: {json.loads(run.path.read_text())['wall_s']} s", flush=True)
    print("\n\n".join(summary(setting) for setting in PILOTS))


if __name__ == "__main__":
    main()
