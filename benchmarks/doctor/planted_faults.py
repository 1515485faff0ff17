"""Planted faults: does the run doctor name the cause a config change planted, and stay silent on healthy runs?

    python benchmarks/doctor/planted_faults.py [--seeds 0 1 2] [--steps 40] [--jobs 2] [--out runs/doctor] [--write-docs]
    python benchmarks/doctor/planted_faults.py --from-runs runs/doctor      # diagnose runs made before, without training
    python benchmarks/doctor/planted_faults.py --kl-sweep --seeds 101 102 103 --steps 60 --out runs/doctor-kl   # calibrates kl_dominates

Each fault is a change to ``configs/quickstart.yaml`` that a user could make (a learning rate, a completion limit, a
KL coefficient, a reward function, prompts of another difficulty, a sampling temperature); each healthy run is the
quickstart or another shipped objective. Prompts too easy cannot be planted on the shipped model, which adds 3-digit
numbers only (it solves no 1- or 2-digit sum): that side of ``no_reward_difference`` is tested on synthetic series.
Every (fault, seed) trains the shipped tiny model for ``--steps`` optimizer
steps with ``lit-cancel fit`` (the run doctor's callback is in the config), then ``lit_cancel.callbacks.doctor.history.read_run``
reads its event files and the rules diagnose them as ``lit-cancel diagnose`` does, at every 10th step and at the end.
A faulty run counts as right when the first finding at the end names the planted cause; "known at" is the first
step from which the first finding named it at every later check. A healthy run counts as right when nothing is found.

The rules' thresholds were set on calibration runs of seed 100 (``--seeds 100``), not on the seeds of the table.

``--kl-sweep`` trains the quickstart at KL coefficients from 0 to 20 (held-out accuracy at the start, the middle and
the end) and tables what ``kl_dominates`` reads against the held-out accuracy each strength gains compared with no KL
term of the same seed; its threshold was set on that sweep, at seeds 101-103, which the table does not use.
"""

import argparse
import os
import statistics
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

from lit_cancel.callbacks.doctor.diagnoses import diagnose, mean, rules_named, tail
from lit_cancel.callbacks.doctor.history import read_run

ROOT = Path(__file__).resolve().parents[2]
CONFIG = ROOT / "configs" / "quickstart.yaml"
DOCS = ROOT / "docs" / "doctor.md"
SCRIPT = "benchmarks/doctor/planted_faults.py"
CHECK_EVERY = 10


@dataclass(frozen=True)
class Case:
    name: str
    expected: str | None  # the rule that should come first; None for a healthy run
    overrides: tuple[str, ...]


MODEL, TASK, DATA = "--model.init_args", "--data.init_args.task.init_args", "--data.init_args"
CASES = [
    Case("learning rate 50x", "learning_rate_too_high", (f"{MODEL}.optimizer.init_args.lr=0.01",)),
    Case("learning rate / 10,000", "learning_rate_too_low", (f"{MODEL}.optimizer.init_args.lr=2e-8",)),
    Case("max_new_tokens 20", "truncation", (f"{MODEL}.max_new_tokens=20",)),
    Case("kl_coef 20", "kl_dominates", (f"{MODEL}.objective.init_args.kl_coef=20",)),
    Case("kl_coef 5", "kl_dominates", (f"{MODEL}.objective.init_args.kl_coef=5",)),
    Case("reward ignores the answer", "reward_ignores_answer", (f"{TASK}.reward_fn=broken_rewards.ignores_answer",)),
    Case("reward always 1", "no_reward_difference", (f"{TASK}.reward_fn=broken_rewards.always_one",)),
    Case("6-digit prompts", "no_reward_difference", (f"{TASK}.num_digits=6",)),
    Case("temperature 0.3", "low_temperature", (f"{MODEL}.temperature=0.3",)),
    Case("quickstart", None, ()),
    Case("DrGRPO", None, (f"{MODEL}.objective=lit_cancel.DrGRPO", f"{MODEL}.objective.init_args.length=40")),
    Case("DFPOMin, 2 mini-batches", None, (f"{MODEL}.objective=lit_cancel.DFPOMin", f"{DATA}.mini_batches_per_round=2")),
]


def run_folder(out: Path, case: Case, seed: int) -> Path:
    return out / f"{case.name.replace(' ', '_').replace('/', 'div')}-seed{seed}" / "version_0"


def train(case: Case, seed: int, steps: int, out: Path, validate_every: int = 1000) -> Path:
    folder = run_folder(out, case, seed)
    if (folder / "checkpoints" / "last.ckpt").exists():
        return folder  # made by an earlier call
    command = [
        str(Path(sys.executable).parent / "lit-cancel"), "fit", "--config", str(CONFIG), f"--seed_everything={seed}", f"{DATA}.seed={seed}",
        f"--trainer.max_steps={steps}", f"--trainer.val_check_interval={validate_every}", "--trainer.enable_progress_bar=false",
        f"--trainer.logger.init_args.save_dir={out}", f"--trainer.logger.init_args.name={folder.parent.name}", *case.overrides,
    ]
    path = os.pathsep.join([str(Path(__file__).parent), os.environ.get("PYTHONPATH", "")])  # broken_rewards
    environment = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": path}
    result = subprocess.run(command, capture_output=True, text=True, env=environment, cwd=ROOT)
    if result.returncode != 0:
        raise RuntimeError(f"{case.name} seed {seed} failed:\n{result.stderr[-3000:]}")
    return folder


KL_COEFS = [0.0, 0.5, 1.0, 2.0, 5.0, 10.0, 20.0]


def kl_case(coef: float) -> Case:
    return Case(f"kl_coef {coef:g}", None, (f"{MODEL}.objective.init_args.kl_coef={coef:g}",))


def judge(case: Case, folder: Path) -> dict:
    history = read_run(folder)
    findings = diagnose(history)
    first = findings[0].rule if findings else None
    known_at = None
    if case.expected is not None:
        checks = range(CHECK_EVERY, history.last_step + 1, CHECK_EVERY)
        firsts = [(step, (diagnose(history.upto(step)) or [None])[0]) for step in checks]
        for step, finding in firsts:
            if finding is not None and finding.rule == case.expected and all(
                later is not None and later.rule == case.expected for s, later in firsts if s >= step
            ):
                known_at = step
                break
    right = first == case.expected if case.expected is not None else not findings
    return {"first": first, "all": [f.rule for f in findings], "right": right, "known_at": known_at}


def table(results: dict[str, list[dict]], seeds: list[int]) -> str:
    lines = ["| run | planted cause | right (of seeds) | first finding per seed | known at step (median) |", "|---|---|---|---|---|"]
    for case in CASES:
        rows = results.get(case.name, [])
        if not rows:
            continue
        firsts = ", ".join(r["first"] or "none" for r in rows)
        known = [r["known_at"] for r in rows if r["known_at"] is not None]
        known_text = f"{statistics.median(known):g}" if known else "-"
        lines.append(f"| {case.name} | {case.expected or 'healthy: no finding'} | {sum(r['right'] for r in rows)}/{len(rows)} "
                     f"| {firsts} | {known_text if case.expected else '-'} |")
    faulty = [r for c in CASES if c.expected for r in results.get(c.name, [])]
    healthy = [r for c in CASES if not c.expected for r in results.get(c.name, [])]
    lines.append("")
    lines.append(f"Faulty runs with the planted cause first: {sum(r['right'] for r in faulty)}/{len(faulty)} "
                 f"({sum(r['right'] for r in faulty) / max(1, len(faulty)):.0%}); healthy runs without a finding: "
                 f"{sum(r['right'] for r in healthy)}/{len(healthy)}. Seeds {', '.join(map(str, seeds))}.")
    return "\n".join(lines)


def kl_sweep(coefs: list[float], seeds: list[int], steps: int, jobs: int, out: Path, train_runs: bool) -> str:
    """Trains the quickstart at each KL coefficient and seed (held-out accuracy at steps 0, ``steps / 2`` and ``steps``)
    and tables, per coefficient, what ``kl_dominates`` reads (``objective/kl_share``, median of the last quarter), the held-out
    accuracy gained against ``kl_coef`` 0 of the same seed, the gradient norm before clipping, and at how many seeds
    the rule fires at every check (every 10th step) and at some check."""
    work = [(kl_case(coef), seed) for seed in seeds for coef in coefs]
    if train_runs:
        with ThreadPoolExecutor(jobs) as pool:
            list(pool.map(lambda item: train(*item, steps, out, validate_every=steps // 2), work))
    rule = rules_named(["kl_dominates"])
    measured: dict[float, dict[int, dict]] = {}
    for case, seed in work:
        history = read_run(run_folder(out, case, seed))
        accuracy = dict(zip(history.steps("val/accuracy"), history.values("val/accuracy"), strict=True))
        measured.setdefault(float(case.overrides[0].split("=")[1]), {})[seed] = {
            "share": statistics.median(tail(history.values("objective/kl_share"))) if "objective/kl_share" in history else 0.0,
            "gain": accuracy[steps] - accuracy[0],
            "grad_norm": mean(tail(history.values("health/grad_norm"))),
            "fires": [bool(diagnose(history.upto(step), rule)) for step in range(CHECK_EVERY, steps + 1, CHECK_EVERY)],
        }
    if 0.0 not in measured:
        raise SystemExit("--kl-sweep needs kl_coef 0 among the coefficients: the accuracy gained is measured against it")
    lines = [
        f"| kl_coef | objective/kl_share, median of the last quarter (per seed) | held-out accuracy gained, steps 0-{steps} (per seed) "
        f"| gained, mean, against kl_coef 0 | health/grad_norm, last quarter, mean | kl_dominates fires (seeds): at every check "
        f"({CHECK_EVERY}-{steps}), at some |",
        "|---|---|---|---|---|---|",
    ]
    base = statistics.fmean(measured[0.0][seed]["gain"] for seed in seeds)
    for coef in sorted(measured):
        rows = [measured[coef][seed] for seed in seeds]
        gain = statistics.fmean(row["gain"] for row in rows)
        shares = ", ".join(f"{row['share']:.3f}" for row in rows)
        gains = ", ".join(f"{row['gain']:+.3f}" for row in rows)
        fired = f"{sum(all(row['fires']) for row in rows)}/{len(rows)}, {sum(any(row['fires']) for row in rows)}/{len(rows)}"
        grad_norm = statistics.fmean(row["grad_norm"] for row in rows)
        lines.append(f"| {coef:g} | {shares} | {gains} | {gain:+.3f} ({gain / base:.0%}) | {grad_norm:.2f} | {fired} |")
    lines.append("")
    lines.append(f"Seeds {', '.join(map(str, seeds))}; {steps} optimizer steps; kl_dominates' threshold {rule[0].max_share}.")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    parser.add_argument("--steps", type=int, default=40)
    parser.add_argument("--jobs", type=int, default=2)
    parser.add_argument("--out", type=Path, default=ROOT / "runs" / "doctor")
    parser.add_argument("--from-runs", type=Path, help="diagnose the runs under this folder; train nothing")
    parser.add_argument("--cases", nargs="+", help="only these runs (names as in the table)")
    parser.add_argument("--write-docs", action="store_true", help="put the table into docs/doctor.md")
    parser.add_argument("--kl-sweep", type=float, nargs="*", metavar="COEF",
                        help=f"instead of the planted faults, train the quickstart at these KL coefficients (default {KL_COEFS})")
    args = parser.parse_args()
    if args.kl_sweep is not None:
        text = kl_sweep(args.kl_sweep or KL_COEFS, args.seeds, args.steps, args.jobs, args.from_runs or args.out, not args.from_runs)
        print(text)
        if args.write_docs:
            coefs = " ".join(f"{coef:g}" for coef in args.kl_sweep or KL_COEFS)
            seeds = " ".join(map(str, args.seeds))
            write_docs("doctor-kl-sweep", f"python {SCRIPT} --kl-sweep {coefs} --seeds {seeds} --steps {args.steps}", text)
        return
    cases = [c for c in CASES if not args.cases or c.name in args.cases]
    out = args.from_runs or args.out
    work = [(case, seed) for case in cases for seed in args.seeds]
    if not args.from_runs:
        with ThreadPoolExecutor(args.jobs) as pool:
            list(pool.map(lambda item: train(*item, args.steps, out), work))
    results: dict[str, list[dict]] = {}
    for case, seed in work:
        verdict = judge(case, run_folder(out, case, seed))
        results.setdefault(case.name, []).append(verdict)
        print(f"{case.name} seed {seed}: {verdict['all'] or 'no finding'}", flush=True)
    text = table(results, args.seeds)
    print(text)
    if args.write_docs:
        write_docs("doctor-benchmark", f"python {SCRIPT} --seeds {' '.join(map(str, args.seeds))} --steps {args.steps}", text)


def write_docs(marker: str, command: str, text: str) -> None:
    """Puts ``command`` and its ``text`` between ``<!-- marker -->`` and ``<!-- /marker -->`` in docs/doctor.md."""
    begin, end = f"<!-- {marker} -->", f"<!-- /{marker} -->"
    docs = DOCS.read_text()
    start, stop = docs.index(begin), docs.index(end) + len(end)
    DOCS.write_text(docs[:start] + f"{begin}\n`{command}`\n\n{text}\n{end}" + docs[stop:])


if __name__ == "__main__":
    main()
