"""``lit-cancel diagnose RUN_DIR``: why a run is not learning, read from its TensorBoard event files.

Exit status (:data:`EXIT_STATUS`): 0 when the diagnoses found no cause, 1 when one did, 2 when nothing could be
diagnosed (the run folder cannot be read, an option is wrong, no diagnosis has a series to read), with one line
saying why, and 3 when it is too early to tell: no cause found yet, while diagnoses whose series the run logs have
fewer points than they judge from.
"""

import argparse
import json
import os
import sys
import textwrap
from pathlib import Path
from typing import Any

from rich.console import Console
from rich.markup import escape

from . import rule_book  # noqa: F401  (registers the rules)
from .diagnoses import SERIES, Finding, Rule, RunHistory, diagnose, rules_named
from .history import RunReadError, event_files, read_run

FRAMEWORK_NAMES = {"lit_cancel": "lit_cancel", "trl": "TRL", "verl": "verl"}
# 3, not 0, for a run read too early: a script that takes 0 for healthy must not take a run that cannot be judged yet
EXIT_STATUS = {"no_finding": 0, "finding": 1, "too_early": 3}
DESCRIPTION = (
    "Names why an RL run is not learning, from the TensorBoard event files of a lit_cancel, TRL (GRPOTrainer) or verl run. "
    "Exit status: 0 no cause found, 1 a cause found, 2 nothing could be diagnosed (the folder cannot be read, a wrong "
    "option), 3 too early to tell (no cause found yet, but diagnoses have too few points to judge)."
)


class PipedConsole(Console):
    """A console that stops writing when its reader goes away (``| head -1``) instead of exiting with status 1, as
    rich's does: the exit status stays the diagnosis's."""

    def on_broken_pipe(self) -> None:
        self.quiet = True
        discard_stdout()


def discard_stdout() -> None:
    """Sends what is still to be written to stdout to the null device: its reader is gone, and the flush at exit must
    not fail on it."""
    devnull = os.open(os.devnull, os.O_WRONLY)
    os.dup2(devnull, sys.stdout.fileno())
    os.close(devnull)


def not_run(rules: list[Rule], history: RunHistory) -> dict[str, str]:
    """Why each of ``rules`` that does not apply to ``history`` could not run, by rule name."""
    reasons = {}
    for rule in rules:
        if not rule.applies(history):
            missing = [name for name in rule.needs if name not in history]
            reasons[rule.name] = f"no {', '.join(missing)}" if missing else f"fewer than {rule.min_points} points"
    return reasons


def verdict(history: RunHistory, findings: list[Finding], rules: list[Rule]) -> str:
    """``"finding"`` when a rule found a cause; ``"too_early"`` when none did while a rule waits for points
    (:meth:`Rule.waits`); ``"no_finding"`` otherwise."""
    if findings:
        return "finding"
    return "too_early" if any(rule.waits(history) for rule in rules) else "no_finding"


def report(
    run_dir: str, history: RunHistory, findings: list[Finding], rules: list[Rule], files: int, at_step: int | None = None
) -> dict[str, Any]:
    """What ``--json`` prints: the run, its framework and series, the verdict, the findings (most likely cause first),
    and the rules that could not run.

    Args:
        run_dir: the folder as the command was given it.
        history: the run's series, as diagnosed.
        findings: what ``rules`` found in ``history``, most likely cause first.
        rules: the diagnoses asked for.
        files: how many event files were read.
        at_step: the step the run was cut at (``--at-step``), None for the whole run.
    """
    steps = sorted({step for series in history.series.values() for step in series.steps})
    return {
        "run": run_dir,
        "framework": history.framework,
        "event_files": files,
        "at_step": at_step,
        "steps": {"first": steps[0], "last": steps[-1], "logged": len(steps)} if steps else None,
        "settings": history.settings,
        "verdict": verdict(history, findings, rules),
        "findings": [finding.to_dict() for finding in findings],
        "series_found": [name for name in SERIES if name in history],
        "series_missing": [name for name in SERIES if name not in history],
        "rules_run": [rule.name for rule in rules if rule.applies(history)],
        "rules_waiting": {rule.name: rule.min_points for rule in rules if rule.waits(history)},
        "rules_not_run": not_run(rules, history),
    }


def print_report(summary: dict[str, Any], console: Console) -> None:
    """The report a person reads: the run, then the findings, the most likely cause first, then what was missing."""
    steps = summary["steps"]
    read = f"steps {steps['first']}-{steps['last']} ({steps['logged']} logged)" if steps else "no steps"
    console.print(f"[bold]run[/] {escape(summary['run'])}")
    files = f"{summary['event_files']} event file{'s' if summary['event_files'] != 1 else ''}"
    console.print(f"[bold]framework[/] {FRAMEWORK_NAMES[summary['framework']]}, {files}, "
                  f"{len(summary['series_found'])} of {len(SERIES)} series, {read}")
    if summary["settings"]:
        console.print("[bold]settings[/] " + ", ".join(f"{name} {value:g}" for name, value in summary["settings"].items()))
    if summary["at_step"] is not None and steps and summary["at_step"] > steps["last"]:
        console.print(f"[yellow]note[/]: --at-step {summary['at_step']} is past the run's last logged step, {steps['last']}: "
                      "the whole run is diagnosed")
    findings = summary["findings"]
    ran, total = len(summary["rules_run"]), len(summary["rules_run"]) + len(summary["rules_not_run"])
    if summary["verdict"] == "too_early":
        waiting = summary["rules_waiting"]
        needed = "-".join(f"{points}" for points in sorted({min(waiting.values()), max(waiting.values())}))
        said = f"{len(waiting)} of {total} diagnoses have too few points yet to judge (they need {needed}; {steps['logged']} steps logged)"
        console.print(f"[yellow]too early to tell[/]: {said}" + (f"; the {ran} that could run found no cause" if ran else ""))
    elif not findings:
        console.print(f"[green]no finding[/]: the {ran} of {total} diagnoses that could run found no cause")
    else:
        console.print(f"[bold]most likely cause[/]: {escape(findings[0]['cause'])}")
        for number, finding in enumerate(findings, 1):
            colour = "red" if finding["severity"] == "severe" else "yellow"
            console.print(f"{number}. [{colour}]{finding['severity']}[/] {escape(finding['cause'])} "
                          f"[dim]({finding['rule']}, step {finding['step']})[/]")
            for part in ("evidence", "remedy"):  # indented as they wrap
                lines = textwrap.fill(f"{part} {finding[part]}", max(console.width, 40), initial_indent="   ", subsequent_indent="   ")
                console.print(escape(lines).replace(part, f"[bold]{part}[/]", 1), soft_wrap=True)
    if summary["series_missing"]:
        console.print(f"[dim]series not found: {', '.join(summary['series_missing'])}[/]")
    if summary["rules_not_run"]:
        console.print("[dim]rules that could not run: "
                      + "; ".join(f"{name} ({why})" for name, why in summary["rules_not_run"].items()) + "[/]")


def refuse(reason: str) -> int:
    """Says in one line why nothing was diagnosed; the exit status 2."""
    sys.stderr.write(f"lit-cancel diagnose: {reason}\n")
    return 2


def parser() -> argparse.ArgumentParser:
    """The options of ``lit-cancel diagnose``."""
    options = argparse.ArgumentParser(prog="lit-cancel diagnose", description=DESCRIPTION)
    options.add_argument("run_dir", metavar="RUN_DIR", help="the folder of the run's event files, or a folder above it")
    options.add_argument("--json", action="store_true", help="print a JSON object instead of the report")
    options.add_argument("--rules", nargs="+", metavar="NAME", help="run these diagnoses only (default: all)")
    options.add_argument("--at-step", type=int, metavar="N", help="diagnose the run as it was at step N")
    return options


def main(argv: list[str]) -> int:
    """``lit-cancel diagnose RUN_DIR [--json] [--rules NAME ...] [--at-step N]``; returns the exit status."""
    args = parser().parse_args(argv)
    if args.at_step is not None and args.at_step < 0:
        return refuse(f"--at-step: a step number >= 0 is expected, got {args.at_step}")
    try:
        rules = rules_named(args.rules)
    except ValueError as error:
        return refuse(f"--rules: {error}")
    try:
        history = read_run(args.run_dir)
    except RunReadError as error:
        return refuse(str(error))
    if args.at_step is not None:
        if args.at_step < history.first_step:
            return refuse(f"--at-step {args.at_step}: the run's first logged step is {history.first_step}: nothing to diagnose before it")
        history = history.upto(args.at_step)
    if not any(rule.applies(history) or rule.waits(history) for rule in rules):
        needed = sorted({name for rule in rules for name in rule.needs})
        return refuse(f"{args.run_dir}: no diagnosis could run: the run logs none of the series they read ({', '.join(needed)})")
    findings = diagnose(history, rules)
    summary = report(args.run_dir, history, findings, rules, len(event_files(Path(args.run_dir))), args.at_step)
    if args.json:
        try:
            print(json.dumps(summary, indent=2), flush=True)
        except BrokenPipeError:
            discard_stdout()
    else:
        print_report(summary, PipedConsole(highlight=False))
    return EXIT_STATUS[summary["verdict"]]
