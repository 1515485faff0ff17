"""E12's section of docs/experiments.md: does agreement itself raise GRPO's tax? Analysed exactly as pre-registered there.

At each of E11's two warm starts, ``GRPO-forced`` − ``GRPO-independent``, paired over the seeds both arms have. Primary
(one Holm family of 2 tests, their 2 TOST p-values within ±0.002 a Holm family of their own): P1 GRPO's learning tax
from the agreeing warm start, P2 from the mixed one. Secondary, each a Holm family of 2 with a TOST family of 2: S1
held-out success after step 40 (±0.04), S2 the entropy over the 40 steps (±0.01). Then the manipulation check, the
identity checks, the combined reading at each warm start, the numbers reported without tests, and the check before the
main runs (E12P), which can stop the study.
"""

import json
import math
import statistics
from dataclasses import dataclass

from lab.cells import FAMILIES, MIN_SEEDS, cell, finite_values, format_interval, format_p, seed_ranges, where_runs_ran
from lab.runs import E11_STEPS, E12_PILOT_SEED, E12_SEEDS, RESULTS, e11_setting
from lab.stats import (
    ALPHA,
    leave_one_out_tost,
    minimal_detectable_effect,
    paired_difference,
    paired_t_test,
    paired_values,
    sign_test,
    t_quantile,
    t_test,
    tost,
)
from lab.summaries import E11_EARLY_STEPS, E11_LAST_STEPS

FORCED, INDEPENDENT, DFPO_FORCED = "GRPO-forced", "GRPO-independent", "DFPOMin-forced"
WARM_STARTS = ("agreeing", "mixed")  # P1's and P2's
HOLM_TESTS = 2  # every family's size: its strictest Holm level is alpha / 2
ROUNDING = 1e-6  # DFPOMin's tax above this is a bug (on-policy it cancels exactly, forced sharing or not), not a result


@dataclass(frozen=True)
class Outcome:
    """A pre-registered outcome: the run summary's ``key``, ``forced − independent`` at each warm start, a Holm family of
    2 tests and a TOST family of 2 within ``margin``; ``predicted`` +1 where a direction was predicted, 0 where none."""

    name: str
    label: str
    key: str
    margin: float
    digits: int
    predicted: int
    family: str
    tost_family: str

    def tag(self, warm_start: str) -> str:
        """``P1`` / ``P2`` for the primary outcome (one test a warm start), ``S1`` / ``S2`` otherwise."""
        return f"P{WARM_STARTS.index(warm_start) + 1}" if self.name == "P" else self.name


PRIMARY = Outcome("P", f"GRPO's learning tax, mean over {E11_STEPS} steps", "tax", 0.002, 4, 1,
                  "E12 primary (P1, P2)", "E12 primary, TOST ±0.002")
S1 = Outcome("S1", f"success, `val/accuracy` after step {E11_STEPS}", "val_end", 0.04, 3, 0,
             "E12 S1 success (secondary)", "E12 S1 success, TOST ±0.04 (secondary)")
S2 = Outcome("S2", f"entropy, `health/entropy_mean` over {E11_STEPS} steps", "entropy", 0.01, 4, 0,
             "E12 S2 entropy (secondary)", "E12 S2 entropy, TOST ±0.01 (secondary)")
OUTCOMES = (PRIMARY, S1, S2)

READINGS = ("agreement itself raises GRPO's tax",
            "a forced shared first turn raised GRPO's tax, but agreement is not isolated",
            f"agreement itself does not raise GRPO's tax by more than {PRIMARY.margin:g}",
            "open")


def within(margin: float) -> str:
    """The verdict where equivalence is shown, the margin as the pre-registration writes it (0.002, not 0.00)."""
    return f"no difference larger than {margin:g}"


def e12_verdict(holm_p: float, holm_tost: float, mean: float, outcome: Outcome, n: int) -> str:
    """The pre-registered rule: an effect where the Holm-adjusted p is below 0.05 (naming whether it goes the predicted
    way where a direction was predicted); otherwise "no difference larger than m" where the Holm-adjusted TOST p is;
    otherwise inconclusive, and so with fewer than 5 pairs."""
    if n < MIN_SEEDS:
        return "inconclusive"
    if holm_p < ALPHA:
        if not outcome.predicted:
            return "effect"
        return "effect, the predicted direction" if mean * outcome.predicted > 0 else "effect, against the predicted direction"
    if holm_tost < ALPHA:
        return within(outcome.margin)
    return "inconclusive"


@dataclass(frozen=True)
class Result:
    """One paired comparison: its pairs, mean difference, 95% half-width, SD of the differences, raw and Holm p, raw and
    Holm TOST p, and its verdict."""

    n: int
    mean: float
    half: float
    sd: float
    p: float
    holm: float
    p_tost: float
    holm_tost: float
    verdict: str

    def detectable(self, level: float) -> float:
        """The true difference a two-sided paired t-test at ``level`` finds with 80% power (nan below two pairs)."""
        if self.n < 2:
            return math.nan
        critical = t_quantile(1 - level / 2, self.n - 1)
        return minimal_detectable_effect(critical * self.sd / math.sqrt(self.n), self.n, 1 - level)


def compare(outcome: Outcome, warm_start: str, forced: dict[int, dict], independent: dict[int, dict]) -> Result:
    """``forced − independent`` on ``outcome`` at ``warm_start``, paired over the seeds both have (a seed missing from
    either arm drops out of the comparison), its tests Holm-adjusted over the outcome's families (:data:`FAMILIES`)."""
    a, b = finite_values(forced, outcome.key), finite_values(independent, outcome.key)
    differences = paired_values(a, b)
    mean, half, n = paired_difference(a, b)
    p = paired_t_test(a, b)[1]
    p_tost = tost(differences, outcome.margin)[0] if n >= 2 else math.nan
    holm = FAMILIES.adjust(outcome.family, (warm_start,), p)
    holm_tost = FAMILIES.adjust(outcome.tost_family, (warm_start,), p_tost)
    sd = statistics.stdev(differences) if n >= 2 else math.nan
    return Result(n, mean, half, sd, p, holm, p_tost, holm_tost, e12_verdict(holm, holm_tost, mean, outcome, n))


def _arms(runs: dict) -> dict[str, dict[str, dict[int, dict]]]:
    """``warm start -> arm -> seed -> summary``."""
    return {warm_start: {arm: runs.get((arm, e11_setting(warm_start)), {}) for arm in E12_SEEDS} for warm_start in WARM_STARTS}


def e12_results(runs: dict) -> dict[tuple[str, str], Result]:
    """``(outcome name, warm start) -> Result`` of every test (``runs``: ``(arm, setting) -> seed -> summary``,
    :func:`lab.summaries.load_e12`)."""
    arms = _arms(runs)
    return {(outcome.name, warm_start): compare(outcome, warm_start, arms[warm_start][FORCED], arms[warm_start][INDEPENDENT])
            for outcome in OUTCOMES for warm_start in WARM_STARTS}


def _row(outcome: Outcome, warm_start: str, result: Result) -> str:
    """One row: difference (95%), SD, MDE at alpha 0.05 and at alpha / 2, raw and Holm p, raw and Holm TOST p, verdict."""
    label = f"E12 {outcome.tag(warm_start)}: {outcome.label}"
    if result.n < 2:
        return f"| {label} | {warm_start} | {result.n} | – | – | – | – | – | – | – | **{result.verdict}** |"
    digits = outcome.digits
    detectable = f"{result.detectable(ALPHA):.{digits}f} / {result.detectable(ALPHA / HOLM_TESTS):.{digits}f}"
    return (f"| {label} | {warm_start} | {result.n} | {format_interval(result.mean, result.half, digits)} "
            f"| {result.sd:.{digits}f} | {detectable} | {format_p(result.p)} | {format_p(result.holm)} "
            f"| {format_p(result.p_tost)} (±{outcome.margin:g}) | {format_p(result.holm_tost)} | **{result.verdict}** |")


TABLE_HEAD = ["| outcome | warm start | pairs | forced − independent (95%) | SD | MDE (α 0.05 / Holm α/2) | p | Holm p "
              "| TOST p | Holm TOST p | verdict |", "|---|---|---|---|---|---|---|---|---|---|---|"]


def agrees_at_every_step(run: dict) -> bool:
    """A run's ``rollout/first_turn_agreement`` is 1 at every step it trained (logged at as many steps as the tax)."""
    return run["agreement_points"] > 0 and run["agreement_points"] >= run["steps"] and not run["disagreeing_steps"]


def manipulation(arms: dict[str, dict[int, dict]]) -> tuple[bool, str]:
    """``(holds, description)`` at one warm start: the paired difference of ``rollout/shared_policy_tokens`` (mean over
    the steps) with its 95% interval, which must lie above 0, and every forced run (both forced arms) agreeing at every
    step."""
    mean, half, n = paired_difference(finite_values(arms[FORCED], "shared_policy"), finite_values(arms[INDEPENDENT], "shared_policy"))
    forced = [(arm, seed, run) for arm in (FORCED, DFPO_FORCED) for seed, run in sorted(arms[arm].items())]
    failing = [f"`{arm}` seed {seed}" + (f" (steps {seed_ranges(list(run['disagreeing_steps']))})" if run["disagreeing_steps"] else
                                         f" (logged at {run['agreement_points']} of {run['steps']} steps)")
               for arm, seed, run in forced if not agrees_at_every_step(run)]
    above = not math.isnan(half) and mean - half > 0
    holds = above and bool(forced) and not failing
    shared = (f"{format_interval(mean, half, 3)} over {n} pairs, " + ("above 0" if above else "NOT above 0")) if n else "no pairs"
    agreeing = (f"1 at every step of {len(forced) - len(failing)} of {len(forced)} forced runs"
                + (f" (not: {', '.join(failing)})" if failing else ""))
    return holds, (f"the policy's tokens the whole group shares, `{FORCED}` − `{INDEPENDENT}`: {shared}; "
                   f"`rollout/first_turn_agreement` {agreeing}")


def manipulation_lines(arms: dict[str, dict[str, dict[int, dict]]]) -> list[str]:
    lines = [f"Manipulation check (pre-registered, no test): `rollout/shared_policy_tokens`, mean over the {E11_STEPS} steps, "
             "paired, its 95% interval above 0, and `rollout/first_turn_agreement` 1 at every step of every forced run:", ""]
    for warm_start in WARM_STARTS:
        holds, described = manipulation(arms[warm_start])
        outcome = ("**the manipulation holds**" if holds else
                   f"**the manipulation does not hold**: {PRIMARY.tag(warm_start)} does not test its question")
        lines.append(f"* {warm_start}: {described}: {outcome}.")
    return lines


def identity_lines(arms: dict[str, dict[str, dict[int, dict]]]) -> list[str]:
    """``DFPOMin-forced``'s tax at every step within :data:`ROUNDING` of 0, and its step-0 episodes the same as
    ``GRPO-forced``'s at the same seed (same model, same engine: same step-0 agreement and shared tokens)."""
    runs = [(warm_start, seed, run) for warm_start in WARM_STARTS for seed, run in sorted(arms[warm_start][DFPO_FORCED].items())
            if not math.isnan(run["tax_abs_max"])]
    lines = []
    if runs:
        largest = max(run["tax_abs_max"] for _, _, run in runs)
        above = [f"{warm_start} seed {seed}" for warm_start, seed, run in runs if run["tax_abs_max"] > ROUNDING]
        state = (f"0 up to float rounding (≤ {ROUNDING:g}) at every step" if not above
                 else f"ABOVE {ROUNDING:g} ({', '.join(above)}), a bug to report, not a result")
        lines.append(f"* `{DFPO_FORCED}`'s learning tax, its largest absolute value at any step of its {len(runs)} runs: "
                     f"{largest:.1e}: {state}.")
    for warm_start in WARM_STARTS:
        grpo, dfpo = arms[warm_start][FORCED], arms[warm_start][DFPO_FORCED]
        seeds = sorted(set(grpo) & set(dfpo))
        if not seeds:
            continue
        differ = [seed for seed in seeds if (grpo[seed]["agreement_start"], grpo[seed]["shared_policy_start"])
                  != (dfpo[seed]["agreement_start"], dfpo[seed]["shared_policy_start"])]
        same = "the same at every seed" if not differ else f"NOT the same at seeds {seed_ranges(differ)}"
        lines.append(f"* {warm_start}: step-0 `rollout/first_turn_agreement` and `rollout/shared_policy_tokens` of "
                     f"`{FORCED}` and `{DFPO_FORCED}` at the same seed ({len(seeds)} seeds): {same}.")
    return ["Identity checks (pre-registered, no test):", "", *lines] if lines else []


def e11_warm_start_sha256(warm_start: str) -> str | None:
    """The SHA-256 of E11's ``warm_start`` weights, from the record stored beside them (None where there is none)."""
    record = RESULTS / "E11" / f"warmstart-{e11_setting(warm_start)}.json"
    return json.loads(record.read_text()).get("model_sha256") if record.exists() else None


def warm_start_lines(arms: dict[str, dict[str, dict[int, dict]]], e11_sha256=e11_warm_start_sha256) -> list[str]:
    """Whether every run started from E11's weights at its warm start (the SHA-256 the runner stored with each run
    against E11's record)."""
    lines = []
    for warm_start in WARM_STARTS:
        runs = [(arm, seed, run) for arm, by_seed in arms[warm_start].items() for seed, run in sorted(by_seed.items())]
        if not runs:
            continue
        expected = e11_sha256(warm_start)
        unknown = [run for _, _, run in runs if run.get("model_sha256") is None]
        other = sorted({seed for _, seed, run in runs if run.get("model_sha256") not in (None, expected)})
        if expected is None:
            state = "E11's record of its weights is missing: not compared"
        elif other:
            state = f"NOT E11's weights at seeds {seed_ranges(other)}"
        else:
            state = "E11's weights" + (f" ({len(unknown)} runs stored without their weights' SHA-256)" if unknown else "")
        lines.append(f"* {warm_start}: the warm start's weights of its {len(runs)} runs against E11's: {state}.")
    return lines


def combined_reading(primary: str, success: str, entropy: str, holds: bool) -> str:
    """The pre-registered combined reading at one warm start from P's, S1's and S2's verdicts and the manipulation check."""
    unmoved = success == within(S1.margin) and entropy == within(S2.margin)
    if primary == "effect, the predicted direction":
        if holds and unmoved:
            return READINGS[0]
        if not unmoved:
            return READINGS[1]
    elif primary == within(PRIMARY.margin) and holds and unmoved:
        return READINGS[2]
    return READINGS[3]


def reading_lines(arms: dict[str, dict[str, dict[int, dict]]], results: dict[tuple[str, str], Result]) -> list[str]:
    lines = ["The combined reading (pre-registered), at each warm start on its own:", ""]
    for warm_start in WARM_STARTS:
        holds = manipulation(arms[warm_start])[0]
        primary, success, entropy = (results[(outcome.name, warm_start)].verdict for outcome in OUTCOMES)
        reading = combined_reading(primary, success, entropy, holds)
        lines.append(f"* {warm_start}: {PRIMARY.tag(warm_start)} \"{primary}\", the manipulation "
                     f"{'holds' if holds else 'does not hold'}, S1 \"{success}\", S2 \"{entropy}\": "
                     + (f"**{reading}** there." if reading != READINGS[3] else f"the question is **{reading}** there."))
    return lines + ["", "E12 asks whether agreement, with the policy held fixed, raises the tax; it does not say how much of "
                    "E11's P2 difference agreement explains: the forcing sets agreement to 1 in every group, well beyond what "
                    "separated E11's warm starts."]


UNTESTED = (("tax", "learning tax", 4), ("val_end", f"`val/accuracy` after step {E11_STEPS}", 3),
            ("entropy", f"entropy, steps 0–{E11_STEPS - 1}", 3), ("shared_policy", "policy tokens the group shares", 3),
            ("agreement", "first turns agree", 3), ("forced_final", "groups ending at the shared first turn", 3),
            ("tool_calls", "tool calls per episode", 2), ("turns", "turns", 2), ("zero_std_groups", "groups with equal rewards", 3),
            ("val_start", "`val/accuracy` before training", 3), ("entropy_start", "entropy, step 0", 3),
            ("entropy_early", f"entropy, steps 0–{E11_EARLY_STEPS - 1}", 3),
            ("entropy_end", f"entropy, steps {E11_STEPS - E11_LAST_STEPS}–{E11_STEPS - 1}", 3),
            ("tax_early", f"learning tax, steps 0–{E11_EARLY_STEPS - 1}", 4), ("shared_kl", "`health/shared_kl`", 5),
            ("wall_s", "wall time (s)", 0))


def robustness_line(outcome: Outcome, warm_start: str, forced: dict[int, dict], independent: dict[int, dict],
                    result: Result) -> str | None:
    """How much one comparison rests on single seeds (descriptive, no test): the median of the paired differences beside
    their mean, how many go each way (an exact sign test), and the mean and raw p with any one seed left out; for a
    verdict that is an effect, whether its raw p stays below the Holm family's strictest level (alpha / 2) whichever seed
    is left out, and for one within the margin, whether its TOST p does. None below 3 pairs."""
    a, b = finite_values(forced, outcome.key), finite_values(independent, outcome.key)
    seeds, differences = sorted(set(a) & set(b)), paired_values(a, b)
    if len(differences) < 3:
        return None
    digits, n = outcome.digits, len(differences)
    left_out = [differences[:index] + differences[index + 1:] for index in range(n)]
    means, ps = [statistics.fmean(values) for values in left_out], [t_test(values)[1] for values in left_out]
    above = sum(difference > 0 for difference in differences)
    line = (f"* {outcome.tag(warm_start)} ({outcome.label}, {warm_start}): median {statistics.median(differences):+.{digits}f} "
            f"(mean {statistics.fmean(differences):+.{digits}f}); {above} of {n} seeds above 0 (sign p "
            f"{format_p(sign_test(above, n))}); one seed left out: mean {min(means):+.{digits}f} to {max(means):+.{digits}f}, "
            f"p {format_p(min(ps))}–{format_p(max(ps))}")
    level = ALPHA / HOLM_TESTS
    if result.verdict.startswith("effect"):
        failing = [seed for seed, p in zip(seeds, ps, strict=True) if p >= level]
        return line + (f"; the effect's p is {level:g} or above without seed {seed_ranges(failing)}: fragile" if failing
                       else f"; the effect's p stays below {level:g} whichever seed is left out")
    if result.verdict == within(outcome.margin):
        tost_ps = leave_one_out_tost(differences, outcome.margin)
        failing = [seed for seed, p in zip(seeds, tost_ps, strict=True) if p >= level]
        return line + (f"; the TOST p is {level:g} or above without seed {seed_ranges(failing)}: the label is fragile" if failing
                       else f"; the TOST p stays below {level:g} whichever seed is left out")
    return line


def robustness_lines(arms: dict[str, dict[str, dict[int, dict]]], results: dict[tuple[str, str], Result]) -> list[str]:
    """:func:`robustness_line` of every comparison that has 3 pairs or more, under a line saying what it is."""
    lines = [robustness_line(outcome, warm_start, arms[warm_start][FORCED], arms[warm_start][INDEPENDENT],
                             results[(outcome.name, warm_start)]) for outcome in OUTCOMES for warm_start in WARM_STARTS]
    lines = [line for line in lines if line]
    if not lines:
        return []
    return ["How much each comparison rests on single seeds (descriptive, no test; added after the runs started and "
            "before any was analysed, as the audit of E11 asked): the median of the paired differences beside their mean, "
            "the seeds above 0, and the mean and raw p with any one seed left out.", "", *lines]


def _paired_cell(forced: dict[int, dict], independent: dict[int, dict], key: str, digits: int) -> str:
    mean, half, _ = paired_difference(finite_values(forced, key), finite_values(independent, key))
    return format_interval(mean, half, digits)


def untested_lines(arms: dict[str, dict[str, dict[int, dict]]]) -> list[str]:
    lines = ["Reported without tests (mean ± 95% t-interval over seeds; the paired rows over the seeds both arms have; the "
             "first four columns are the tested outcomes' and the manipulation check's per arm):", "",
             "| warm start | arm | seeds | " + " | ".join(label for _, label, _ in UNTESTED) + " |",
             "|---|---|---|" + "---|" * len(UNTESTED)]
    for warm_start in WARM_STARTS:
        for arm, seeds in arms[warm_start].items():
            if seeds:
                lines.append(f"| {warm_start} | `{arm}` | {len(seeds)} | "
                             + " | ".join(cell(seeds, key, digits) for key, _, digits in UNTESTED) + " |")
        forced, independent = arms[warm_start][FORCED], arms[warm_start][INDEPENDENT]
        pairs = len(set(forced) & set(independent))
        if pairs:
            lines.append(f"| {warm_start} | `{FORCED}` − `{INDEPENDENT}` (paired) | {pairs} | "
                         + " | ".join(_paired_cell(forced, independent, key, digits) for key, _, digits in UNTESTED) + " |")
    return lines


def _stored_line(runs: dict) -> str:
    """How many of the 114 pre-registered runs are stored, which are missing (a seed that failed twice is dropped from
    every comparison that uses it), and on which commits and CPUs they ran."""
    expected = len(WARM_STARTS) * sum(map(len, E12_SEEDS.values()))
    missing = [f"`{arm}` {warm_start} seeds {seed_ranges(absent)}" for warm_start in WARM_STARTS for arm, seeds in E12_SEEDS.items()
               if (absent := sorted(set(seeds) - set(runs.get((arm, e11_setting(warm_start)), {}))))]
    stored = sum(len(runs.get((arm, e11_setting(warm_start)), {})) for arm in E12_SEEDS for warm_start in WARM_STARTS)
    steps = sorted({run["steps"] for seeds in runs.values() for run in seeds.values()})
    return (f"Runs stored: {stored} of the {expected} pre-registered" + (f" (missing: {'; '.join(missing)})" if missing else "")
            + f". {where_runs_ran(list(runs.values()))}. Steps logged per run: {', '.join(map(str, steps))}.")


def forcing_works(pilot: dict) -> dict[str, bool | None]:
    """E12P's verdict at each warm start: the forced run agrees at every step and its groups share more of the policy's
    tokens than the independent run's; None where either run is not stored."""
    works = {}
    for warm_start in WARM_STARTS:
        forced = pilot.get((FORCED, e11_setting(warm_start)), {}).get(E12_PILOT_SEED)
        independent = pilot.get((INDEPENDENT, e11_setting(warm_start)), {}).get(E12_PILOT_SEED)
        works[warm_start] = (None if forced is None or independent is None else
                             agrees_at_every_step(forced) and forced["shared_policy"] > independent["shared_policy"])
    return works


def pilot_lines(pilot: dict) -> list[str]:
    """The check before the main runs (E12P, pre-registered as one that can stop the study, not change it)."""
    lines = [f"Check before the main runs (E12P: `{FORCED}` and `{INDEPENDENT}` at seed {E12_PILOT_SEED}, 4 steps at lr "
             "1e-12, no validation): the forcing works where the forced run's first turns agree at every step and its "
             "groups share more of the policy's tokens than the independent run's.", ""]
    for warm_start, works in forcing_works(pilot).items():
        if works is None:
            lines.append(f"* {warm_start}: not both runs stored.")
            continue
        forced = pilot[(FORCED, e11_setting(warm_start))][E12_PILOT_SEED]
        independent = pilot[(INDEPENDENT, e11_setting(warm_start))][E12_PILOT_SEED]
        if agrees_at_every_step(forced):
            agreeing = f"agree at every step ({forced['agreement_points']} steps)"
        elif forced["disagreeing_steps"]:
            agreeing = f"do NOT agree at every step (not at steps {seed_ranges(list(forced['disagreeing_steps']))})"
        else:
            agreeing = f"are logged at {forced['agreement_points']} of {forced['steps']} steps"
        lines.append(f"* {warm_start}: the forced run's first turns {agreeing}; policy "
                     f"tokens the group shares {forced['shared_policy']:.3f} against {independent['shared_policy']:.3f}: "
                     + ("**the forcing works**." if works else "**the forcing does not work**: the study stops here."))
    return lines


def e12_section(runs: dict, pilot: dict | None = None) -> list[str]:
    """E12's tables from its runs (``(arm, setting) -> seed -> summary``, :func:`lab.summaries.load_e12`) and its check
    before them (``pilot``, the same from ``results/E12P``); every table renders with whatever runs are stored."""
    lines = [f"#### E12 does agreement itself raise GRPO's tax? (agent quickstart, a forced shared first turn against "
             f"independent episodes, on-policy, {E11_STEPS} steps, lr 2e-4; pre-registered above)", ""]
    if pilot:
        lines += pilot_lines(pilot) + [""]
    if not runs:
        return lines + ["No main runs stored yet."]
    arms = _arms(runs)
    results = e12_results(runs)
    lines += [_stored_line(runs), ""] + manipulation_lines(arms) + [""]
    identity = identity_lines(arms)
    lines += identity + ([""] if identity else [])
    lines += ["The warm starts (their weights' SHA-256, as the runner stored it with each run, against E11's record):", "",
              *warm_start_lines(arms), ""]
    lines += ["Primary outcome, one Holm family of the 2 tests (paired two-sided t-tests over the seeds both arms have, "
              f"predicted > 0), their TOST p within ±{PRIMARY.margin:g} a Holm family of 2 of their own; an effect is called "
              f"only on the Holm-adjusted p, a comparison with fewer than {MIN_SEEDS} pairs is inconclusive. SD: of the paired "
              "differences; MDE: the true difference found with 80% power.", "", *TABLE_HEAD]
    lines += [_row(PRIMARY, warm_start, results[("P", warm_start)]) for warm_start in WARM_STARTS]
    lines += ["", "Secondary outcomes (S1, S2), each a Holm family of 2 tests with its TOST p a Holm family of 2: the forcing "
              "must not move what E11's warm starts differed in.", "", *TABLE_HEAD]
    lines += [_row(outcome, warm_start, results[(outcome.name, warm_start)]) for outcome in (S1, S2) for warm_start in WARM_STARTS]
    robustness = robustness_lines(arms, results)
    return lines + [""] + reading_lines(arms, results) + [""] + (robustness + [""] if robustness else []) + untested_lines(arms)


def _readme_claim(outcome: Outcome, result: Result) -> str:
    """``forced − independent (Holm p X, TOST ±m Holm p Y: verdict)``, the form tests/study/test_verdict_wording.py reads."""
    interval = format_interval(result.mean, result.half, outcome.digits).replace("-", "−")  # the README's minus sign
    return (f"{interval} (Holm p {format_p(result.holm)}, TOST ±{outcome.margin:g} "
            f"Holm p {format_p(result.holm_tost)}: {result.verdict})")


def e12_readme_lines(runs: dict) -> list[str]:
    """E12's bullet in README.md (after the report's families are filled): at each warm start GRPO's tax forced −
    independent, how far the forcing moved success and entropy, and the pre-registered combined reading; nothing until
    both warm starts have :data:`MIN_SEEDS` pairs."""
    results = e12_results(runs)
    if any(results[("P", warm_start)].n < MIN_SEEDS for warm_start in WARM_STARTS):
        return []
    arms = _arms(runs)
    readings = {warm_start: combined_reading(*(results[(o.name, warm_start)].verdict for o in OUTCOMES), manipulation(arms[warm_start])[0])
                for warm_start in WARM_STARTS}
    seeds = min(results[("P", warm_start)].n for warm_start in WARM_STARTS)
    taxes = "; ".join(f"from the {w} warm start {_readme_claim(PRIMARY, results[('P', w)])}" for w in WARM_STARTS)
    moved = "; ".join(f"{w}: success {_readme_claim(S1, results[('S1', w)])}, entropy {_readme_claim(S2, results[('S2', w)])}"
                      for w in WARM_STARTS)
    return [f"* **Agreement itself (E12, pre-registered, {seeds} seeds a warm start)**: a group's first turn forced to be shared "
            f"against independent episodes, GRPO's tax forced − independent {taxes};",
            f"  the forcing had to leave success and entropy as they were ({moved}): the reading is "
            + ", ".join(f"{w}: {readings[w]}" for w in WARM_STARTS) + "."]
