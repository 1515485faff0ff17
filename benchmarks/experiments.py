"""The cancellation experiments on ScaffoldedAdditionTask: runs, statistics, and the report in docs/experiments.md.

    python benchmarks/experiments.py --only E2 --seeds 5      # run what is missing of E2 for seeds 0-4, then report
    python benchmarks/experiments.py --only E1 --max-runs 4   # a piece: at most 4 new runs
    python benchmarks/experiments.py --list                   # what is done and what is missing
    python benchmarks/experiments.py --report                 # tables and PNGs from the stored JSON alone
    python benchmarks/experiments.py --only E6 --seeds 5      # the coupling probe (benchmarks/coupling_probe.py)

Every run is ``lit-cancel fit --config configs/scaffold.yaml`` with command-line overrides, as a
user would run it; its TensorBoard scalars are read back and stored as one JSON file per run in
``benchmarks/experiments/<experiment>/``. E6 alone is a probe of one model (``coupling_probe.py``).
A run whose JSON exists is skipped, so the study can be run in pieces. The report (tables with 95%
t-intervals over seeds, paired differences, PNGs) is rewritten between the markers in
``docs/experiments.md``. Needs matplotlib (``pip install -e ".[bench]"``).
"""

import argparse
import itertools
import json
import math
import os
import statistics
import subprocess
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
RESULTS = ROOT / "benchmarks" / "experiments"
CONFIG = "configs/scaffold.yaml"


# ----------------------------------------------------------------------------------------------- statistics
def t_cdf(x: float, df: int) -> float:
    """Student's t distribution function, by Simpson's rule on the density from 0 to ``x``."""
    if x < 0:
        return 1.0 - t_cdf(-x, df)
    log_norm = math.lgamma((df + 1) / 2) - math.lgamma(df / 2) - 0.5 * math.log(df * math.pi)
    steps = 2000
    width = x / steps
    density = [math.exp(log_norm - (df + 1) / 2 * math.log1p((i * width) ** 2 / df)) for i in range(steps + 1)]
    simpson = density[0] + density[-1] + 4 * sum(density[1:-1:2]) + 2 * sum(density[2:-1:2])
    return 0.5 + simpson * width / 3


def t_quantile(probability: float, df: int) -> float:
    """The ``probability`` quantile of Student's t with ``df`` degrees of freedom (bisection on :func:`t_cdf`)."""
    if not 0.5 <= probability < 1 or df < 1:
        raise ValueError(f"t_quantile needs 0.5 <= probability < 1 and df >= 1, got {probability} and {df}")
    low, high = 0.0, 1.0
    while t_cdf(high, df) < probability:
        high *= 2
    for _ in range(60):
        middle = (low + high) / 2
        low, high = (middle, high) if t_cdf(middle, df) < probability else (low, middle)
    return (low + high) / 2


def mean_interval(values: list[float], confidence: float = 0.95) -> tuple[float, float]:
    """``(mean, half_width)`` of the t-interval for the mean; the half-width is nan below two values."""
    if not values:
        return math.nan, math.nan
    mean = statistics.fmean(values)
    if len(values) < 2:
        return mean, math.nan
    quantile = t_quantile(0.5 + confidence / 2, len(values) - 1)
    return mean, quantile * statistics.stdev(values) / math.sqrt(len(values))


def paired_difference(a: dict[int, float], b: dict[int, float], confidence: float = 0.95) -> tuple[float, float, int]:
    """``(mean, half_width, pairs)`` of ``a[seed] - b[seed]`` over the seeds both have."""
    seeds = sorted(set(a) & set(b))
    mean, half = mean_interval([a[s] - b[s] for s in seeds], confidence)
    return mean, half, len(seeds)


def slope_interval(x: list[float], y: list[float], confidence: float = 0.95) -> tuple[float, float]:
    """``(slope, half_width)`` of the least-squares line of ``y`` on ``x``, t-interval with ``n - 2`` degrees of freedom."""
    n = len(x)
    if n < 3 or len(set(x)) < 2:
        return math.nan, math.nan
    x_mean, y_mean = statistics.fmean(x), statistics.fmean(y)
    sxx = sum((a - x_mean) ** 2 for a in x)
    slope = sum((a - x_mean) * (b - y_mean) for a, b in zip(x, y)) / sxx
    residual = sum((b - y_mean - slope * (a - x_mean)) ** 2 for a, b in zip(x, y)) / (n - 2)
    return slope, t_quantile(0.5 + confidence / 2, n - 2) * math.sqrt(residual / sxx)


def minimal_detectable_effect(half: float, n: int, confidence: float = 0.95, power: float = 0.8) -> float:
    """The smallest true mean difference a two-sided t-test on ``n`` values detects with probability ``power``,
    from the half-width of its interval: ``(t_{1-alpha/2} + t_{power}) * se`` with ``n - 1`` degrees of freedom."""
    if n < 2 or math.isnan(half):
        return math.nan
    critical = t_quantile(0.5 + confidence / 2, n - 1)
    return (critical + t_quantile(power, n - 1)) * half / critical


def verdict(mean: float, half: float, mde: float = math.nan, relevant: float | None = None) -> str:
    """"effect" when the interval excludes 0; otherwise "null", or "inconclusive" when the minimal detectable
    effect ``mde`` is above the smallest ``relevant`` difference; "n/a" without an interval."""
    if math.isnan(half):
        return "n/a"
    if abs(mean) > half:
        return "effect"
    return "inconclusive" if relevant is not None and not mde <= relevant else "null"


# ----------------------------------------------------------------------------------------------- the runs
@dataclass(frozen=True)
class Run:
    """One ``lit-cancel fit``: an experiment's arm (the compared variant) at one setting and seed."""

    experiment: str
    arm: str
    setting: str
    seed: int
    overrides: tuple[str, ...] = field(compare=False)

    @property
    def path(self) -> Path:
        return RESULTS / self.experiment / f"{self.arm}-{self.setting}-seed{self.seed}.json"

    def command(self, save_dir: str) -> list[str]:
        return [
            "lit-cancel", "fit", "--config", CONFIG, f"--seed_everything={self.seed}", f"--data.init_args.seed={self.seed}",
            "--trainer.enable_progress_bar=false",
            f"--trainer.logger.init_args.save_dir={save_dir}", "--trainer.logger.init_args.name=run",
            *self.overrides,
        ]


def knobs(scaffold: int, spread: int) -> list[str]:
    return [f"--data.init_args.task.init_args.scaffold={scaffold}", f"--data.init_args.task.init_args.spread={spread}"]


def budget(steps: int, lr: float, val_samples: int = 4) -> list[str]:
    # validation before training and after the last step only; curves come from the training rollouts
    return [f"--trainer.max_steps={steps}", f"--trainer.val_check_interval={steps}", f"--model.init_args.val_samples={val_samples}",
            f"--model.init_args.optimizer.init_args.lr={lr}"]


def objective(name: str) -> list[str]:
    return [f"--model.init_args.objective=lit_cancel.{name}"]


def trust_region(name: str) -> list[str]:
    return [f"--model.init_args.objective.init_args.trust_region=lit_cancel.{name}"]


def off_policy(mu: int, mini_batches: int) -> list[str]:
    return [f"--data.init_args.epochs_per_round={mu}", f"--data.init_args.mini_batches_per_round={mini_batches}"]


PLANS = {"shuffled": "lit_cancel.Shuffled", "query_preserved": "lit_cancel.QueryPreserved", "reward_balanced": "lit_cancel.RewardBalanced"}
E2_SCAFFOLDS, E2_SPREADS = (0, 12, 24), (0, 4, 8)
# E1, E3, E4 and E5 run at one knob setting: scaffold 12, spread 8 (E2 found scaffold 24 unstable at these rates)
STUDY_SCAFFOLD, STUDY_SPREAD = 12, 8
STUDY = f"s{STUDY_SCAFFOLD}v{STUDY_SPREAD}"
E7_TRUST_REGIONS = ("TokenRatioMask", "GroupRatioDrop", "TokenRatioWeight")
# E8 starts from a shorter supervised warm-up (benchmarks/scaffold_warmstart.py), whose scaffold is not saturated
E8_WARMSTART_STEPS, E8_SCAFFOLD, E8_SPREAD, E8_LR = 150, 12, 8, 2e-4
E8_WARMSTART = f"benchmarks/experiments/E8/warmstart-{E8_WARMSTART_STEPS}"
E8_SETTING = f"s{E8_SCAFFOLD}v{E8_SPREAD}-warm{E8_WARMSTART_STEPS}"
E9_FLIP_SEEDS = 5


def experiment_runs(name: str, seeds: list[int]) -> list[Run]:
    """Every run of experiment ``name`` for ``seeds``. The settings and their reasons are in docs/experiments.md."""
    runs = []
    for seed in seeds:
        if name == "E1":  # exchangeability: five objectives at mu = 2, one knob setting; GRPO and DFPOMin also at half the rate
            arms = [(arm, 1e-4) for arm in ("GRPO", "GSPO", "DrGRPO", "DFPOMin", "DFPOOrth")] + [("GRPO", 5e-5), ("DFPOMin", 5e-5)]
            for arm, lr in arms:
                setting = f"{STUDY}-mu2" + ("" if lr == 1e-4 else f"-lr{lr:g}")
                runs.append(Run(name, arm, setting, seed, (
                    *knobs(STUDY_SCAFFOLD, STUDY_SPREAD), *objective(arm), *off_policy(2, 2), *budget(60, lr),
                )))
        elif name == "E2":  # dose-response: GRPO and DFPOMin over scaffold x spread, on-policy, 8 prompts x 8 per step
            for scaffold, spread, arm in itertools.product(E2_SCAFFOLDS, E2_SPREADS, ("GRPO", "DFPOMin")):
                runs.append(Run(name, arm, f"s{scaffold}v{spread}", seed, (
                    *knobs(scaffold, spread), *objective(arm), "--data.init_args.prompts_per_round=8", *budget(40, 2e-4),
                )))
        elif name == "E3":  # token flipping under GRPO on-policy (the config measures every 10 steps)
            runs.append(Run(name, "GRPO", STUDY, seed, (*knobs(STUDY_SCAFFOLD, STUDY_SPREAD), *objective("GRPO"), *budget(60, 2e-4))))
        elif name == "E4":  # batching plans at mu = 1, 2, 4 with GRPO
            for mu, plan in itertools.product((1, 2, 4), PLANS):
                runs.append(Run(name, plan, f"{STUDY}-mu{mu}", seed, (
                    *knobs(STUDY_SCAFFOLD, STUDY_SPREAD), *objective("GRPO"), *off_policy(mu, 4), f"--data.init_args.plan={PLANS[plan]}",
                    *budget(60, 2e-4 / mu),
                )))
        elif name == "E5":  # group size at 128 rollouts per step
            for group, arm in itertools.product((2, 4, 8, 16), ("GRPO", "GSPO", "DFPOMin")):
                runs.append(Run(name, arm, f"{STUDY}-G{group}", seed, (
                    *knobs(STUDY_SCAFFOLD, STUDY_SPREAD), *objective(arm), *off_policy(2, 2), f"--data.init_args.group_size={group}",
                    f"--data.init_args.prompts_per_round={128 // group}", *budget(60, 1e-4),
                )))
        elif name == "E7":  # does DFPO with a trust region that keeps cancelling beat GRPO? E1's off-policy setting
            arms = {arm: objective(arm) for arm in ("GRPO", "DrGRPO", "DFPOMin")}
            arms |= {f"DFPOMin-{region}": [*objective("DFPOMin"), *trust_region(region)] for region in E7_TRUST_REGIONS}
            for arm, chosen in arms.items():
                runs.append(Run(name, arm, f"{STUDY}-mu2", seed, (
                    *knobs(STUDY_SCAFFOLD, STUDY_SPREAD), *chosen, *off_policy(2, 2), *budget(60, 1e-4, val_samples=8),
                )))
        elif name == "E8":  # a causal test of the learning tax: break cancellation on shared positions only, on-policy
            arms = {
                "DFPOMin": [],
                "DFPOMin-SharedNoise": [
                    "--model.init_args.objective.init_args.trust_region=experiment_parts.SharedPositionNoise",
                    f"--model.init_args.objective.init_args.trust_region.init_args.seed={seed}",
                ],
                "DFPOMin-PositiveOnly": ["--model.init_args.objective.init_args.trust_region=experiment_parts.AdvantageSign"],
            }
            for arm, chosen in arms.items():
                runs.append(Run(name, arm, E8_SETTING, seed, (
                    *knobs(E8_SCAFFOLD, E8_SPREAD), f"--model.init_args.model_path={E8_WARMSTART}", *objective("DFPOMin"), *chosen,
                    "--trainer.callbacks+=experiment_parts.ScaffoldProbe", *budget(40, E8_LR, val_samples=8),
                )))
        elif name == "E9":  # paper B at full dose: batching plans at mu = 4, 8 mini-batches; token flips by confidence
            for plan, class_path in {**PLANS, "sign_sorted": "experiment_parts.SignSorted"}.items():
                runs.append(Run(name, plan, f"{STUDY}-mu4-mb8", seed, (
                    *knobs(STUDY_SCAFFOLD, STUDY_SPREAD), *objective("GRPO"), *off_policy(4, 8), f"--data.init_args.plan={class_path}",
                    *budget(128, 5e-5, val_samples=8),
                )))
            if seed < E9_FLIP_SEEDS:  # E3's setting; the one-sign arms train on one sign of advantage only
                for arm, keep in {"GRPO": None, "GRPO-PositiveOnly": "positive", "GRPO-NegativeOnly": "negative"}.items():
                    chosen = [] if keep is None else [
                        "--model.init_args.objective.init_args.trust_region=experiment_parts.AdvantageSign",
                        f"--model.init_args.objective.init_args.trust_region.init_args.keep={keep}",
                    ]
                    runs.append(Run(name, arm, f"{STUDY}-flips", seed, (
                        *knobs(STUDY_SCAFFOLD, STUDY_SPREAD), "--model.init_args.objective=lit_cancel.PolicyGradient", *chosen,
                        *budget(60, 2e-4),
                    )))
        else:
            raise ValueError(f"unknown experiment {name!r}; expected one of {EXPERIMENTS}")
    return runs


EXPERIMENTS = ("E1", "E2", "E3", "E4", "E5", "E7", "E8", "E9")
PROBES = ("E6",)


def probe_path(seed: int) -> Path:
    return RESULTS / "E6" / f"probe-seed{seed}.json"


def run_probe(seed: int, threads: int | None = None) -> None:
    """E6 for one seed (``coupling_probe.probe``, in this process), stored as JSON."""
    import torch
    from coupling_probe import probe

    if threads:
        torch.set_num_threads(threads)
    path = probe_path(seed)
    path.parent.mkdir(parents=True, exist_ok=True)
    partial = path.with_suffix(".part")
    partial.write_text(json.dumps(probe(seed), indent=1))
    partial.rename(path)


def scalars(log_dir: Path) -> dict[str, list[list[float]]]:
    """Every scalar the run logged to TensorBoard, as ``[step, value]`` pairs."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    events = EventAccumulator(str(log_dir), size_guidance={"scalars": 0})
    events.Reload()
    return {tag: [[e.step, float(f"{e.value:.6g}")] for e in events.Scalars(tag)] for tag in events.Tags()["scalars"]}


def provenance(threads: int | None) -> dict[str, str | int | None]:
    """What a run's numbers depend on beyond its command: they replay bit for bit only on the same commit and machine."""
    import platform

    import torch

    commit = subprocess.run(["git", "rev-parse", "HEAD"], cwd=ROOT, capture_output=True, text=True).stdout.strip()
    dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"], cwd=ROOT, capture_output=True, text=True).stdout
    cpu = next((line.split(":", 1)[1].strip() for line in Path("/proc/cpuinfo").read_text().splitlines()
                if line.startswith("model name")), platform.processor()) if Path("/proc/cpuinfo").exists() else platform.processor()
    return {"commit": commit + ("+modified" if dirty.strip() else ""), "torch": torch.__version__, "cpu": cpu,
            "cores": os.cpu_count(), "threads": threads or torch.get_num_threads(), "python": platform.python_version()}


def execute(run: Run, threads: int | None = None) -> None:
    """Runs ``run`` through the CLI and writes its JSON (config, command, wall time, scalars)."""
    # experiment_parts (E8, E9) is loaded by class path from this folder
    path = os.pathsep.join(filter(None, [str(ROOT / "benchmarks"), os.environ.get("PYTHONPATH")]))
    environment = {**os.environ, "PYTHONPATH": path, **({"OMP_NUM_THREADS": str(threads)} if threads else {})}
    with tempfile.TemporaryDirectory() as save_dir:
        command = run.command(save_dir)
        started = time.perf_counter()
        result = subprocess.run(command, cwd=ROOT, env=environment, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
        wall = time.perf_counter() - started
        if result.returncode != 0:
            raise RuntimeError(f"{run.path.name}: lit-cancel failed:\n{result.stderr[-3000:]}")
        (log_dir,) = Path(save_dir, "run").glob("version_*")
        record = {"experiment": run.experiment, "arm": run.arm, "setting": run.setting, "seed": run.seed,
                  "command": " ".join(command).replace(save_dir, "<tmp>"),
                  "wall_s": round(wall, 1), "provenance": provenance(threads), "scalars": scalars(log_dir)}
    run.path.parent.mkdir(parents=True, exist_ok=True)
    partial = run.path.with_suffix(".part")
    partial.write_text(json.dumps(record, separators=(",", ":")))
    partial.rename(run.path)


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
    args = parser.parse_args()
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
        if any(run.experiment == "E8" for run in todo) and not (ROOT / E8_WARMSTART).exists():
            from scaffold_warmstart import train

            train(E8_WARMSTART_STEPS)
        with ThreadPoolExecutor(args.jobs) as pool:
            for index, run in enumerate(pool.map(lambda r: execute(r, args.threads) or r, todo)):
                print(f"[{index + 1}/{len(todo)}] {run.path.relative_to(ROOT)}", flush=True)
        for seed in probes:
            run_probe(seed, args.threads)
            print(f"{probe_path(seed).relative_to(ROOT)}", flush=True)
    from experiments_report import write_report

    write_report()


if __name__ == "__main__":
    sys.path.insert(0, str(Path(__file__).parent))
    main()
