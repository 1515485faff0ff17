"""E11's section of docs/experiments.md: cancellation across turns, analysed exactly as pre-registered there.

Primary (one Holm family of 3): P1 the learning tax, ``GRPO`` − ``DFPOMin`` at the agreeing warm start, paired; P2
GRPO's tax, agreeing − mixed, Welch; P3 held-out success, ``GRPO`` − ``DFPOMin`` at the agreeing warm start, paired,
with TOST ±0.04 (one TOST, not adjusted). Secondary, each family Holm-adjusted on its own: S1 entropy over the last 5
steps, S2 the normaliser (``DrGRPO`` − ``GRPO``), S3 the mixed warm start, S4 the success interaction (Welch on paired
differences), S5 P2's test on the tax over steps 0-9. Then P2's confound (the warm starts' step-0 entropy and success,
no test), the manipulation check, the identity checks and the numbers reported without tests.
"""

import hashlib
import json
import math
import statistics

import yaml

from lab.cells import (
    EQUIVALENCE_MARGIN,
    FAMILIES,
    MIN_SEEDS,
    accuracy_difference,
    cell,
    difference,
    finite_values,
    format_interval,
    format_p,
    seed_ranges,
    welch_difference,
    where_runs_ran,
)
from lab.runs import AGENT_CONFIG, E11_ARMS, E11_SEEDS, E11_STEPS, E11_TOOL_SHARES, RESULTS, ROOT, e11_setting
from lab.sections_e10 import confirm_verdict
from lab.stats import (
    ALPHA,
    minimal_detectable_effect,
    paired_difference,
    paired_t_test,
    paired_values,
    t_quantile,
    tost,
    verdict,
    welch_test,
)
from lab.summaries import E11_EARLY_STEPS, E11_LAST_STEPS

AGREEING, MIXED = e11_setting("agreeing"), e11_setting("mixed")
PRIMARY = "E11 primary (P1–P3)"
S1, S2, S3, S4, S5 = ("E11 S1 entropy (secondary)", "E11 S2 the normaliser (secondary)",
                      "E11 S3 the mixed warm start (secondary)", "E11 S4 the success interaction (secondary)",
                      "E11 S5 GRPO's tax over steps 0–9 (secondary, added after the pilot)")
HOLM_TESTS = 3  # the primary family's size: its strictest Holm level is alpha / 3
ROUNDING = 1e-6  # DFPOMin's and DrGRPO's tax above this is a bug (on-policy both cancel exactly), not a result
SHIPPED_WEIGHTS = ROOT / "lit_cancel" / "assets" / "tiny-agent" / "model.safetensors"


def predicted_verdict(p: float, p_tost: float, mean: float, margin: float | None, predicted: int, n: int) -> str:
    """The pre-registered rule (:func:`lab.stats.verdict` on the Holm-adjusted p; inconclusive below 5 seeds), an
    effect naming whether it goes the predicted way where a direction was predicted (``predicted`` ±1, 0 for none:
    E10-confirm's :func:`lab.sections_e10.confirm_verdict`)."""
    if n < MIN_SEEDS:
        return "inconclusive"
    return confirm_verdict(p, p_tost, mean, margin, predicted) if predicted else verdict(p, p_tost, margin)


def _strict_mde(half: float, n: int, df: float) -> float:
    """The MDE at 80% power at Holm's strictest level alpha / 3, from a 95% half-width with ``df`` degrees of freedom."""
    strict = 1 - ALPHA / HOLM_TESTS
    se = half / t_quantile(0.975, df)
    return minimal_detectable_effect(se * t_quantile(0.5 + strict / 2, df), n, strict, df=df)


def _primary_row(label: str, comparison: str, a: dict[int, float], b: dict[int, float], paired: bool, digits: int,
                 predicted: int, margin: float | None = None) -> str:
    """One primary outcome: difference (95%), SD, MDE at alpha 0.05 and at alpha / 3, raw and Holm p, TOST p where a
    margin was stated, and the verdict. ``paired``: over the seeds both have; otherwise Welch's test of two samples."""
    if paired:
        mean, half, n = paired_difference(a, b)
        p = paired_t_test(a, b)[1]
        differences = paired_values(a, b)
        df, size = n - 1, f"{n}"
        spread = f"{statistics.stdev(differences):.{digits}f}" if n >= 2 else "–"
        p_tost = tost(differences, margin)[0] if margin is not None and n >= 2 else math.nan
        smallest = n
    else:
        values_a, values_b = list(a.values()), list(b.values())
        mean, half, p, df = welch_test(values_a, values_b)
        n = len(values_a) + len(values_b)
        size = f"{len(values_a)} + {len(values_b)} (Welch df {df:.1f})"
        spread = (" / ".join(f"{statistics.stdev(v):.{digits}f}" for v in (values_a, values_b))
                  if min(len(values_a), len(values_b)) >= 2 else "–")
        p_tost, smallest = math.nan, min(len(values_a), len(values_b))
    holm_p = FAMILIES.adjust(PRIMARY, (label.split(":")[0],), p)
    if math.isnan(half):
        return f"| {label} | {comparison} | {size} | – | – | – | – | – | – | **n/a** |"
    detectable = f"{minimal_detectable_effect(half, n, df=df):.{digits}f} / {_strict_mde(half, n, df):.{digits}f}"
    equivalence = "–" if math.isnan(p_tost) else f"{format_p(p_tost)} (±{margin:.2f})"
    call = predicted_verdict(holm_p, p_tost, mean, margin, predicted, smallest)
    return (f"| {label} | {comparison} | {size} | {format_interval(mean, half, digits)} | {spread} | {detectable} "
            f"| {format_p(p)} | {format_p(holm_p)} | {equivalence} | **{call}** |")


def _arms(runs: dict, setting: str) -> dict[str, dict[int, dict]]:
    return {arm: runs.get((arm, setting), {}) for arm in E11_ARMS}


def _primary_table(agreeing: dict[str, dict[int, dict]], mixed: dict[str, dict[int, dict]]) -> list[str]:
    grpo, dfpo = agreeing["GRPO"], agreeing["DFPOMin"]
    return [
        "| outcome | comparison | n | difference (95%) | SD | MDE (α 0.05 / Holm α/3) | p | Holm p | TOST p | verdict |",
        "|---|---|---|---|---|---|---|---|---|---|",
        _primary_row(f"E11 P1: learning tax, mean over {E11_STEPS} steps", "`GRPO` − `DFPOMin`, agreeing (paired)",
                     finite_values(grpo, "tax"), finite_values(dfpo, "tax"), True, 4, predicted=1),
        _primary_row(f"E11 P2: GRPO's learning tax, mean over {E11_STEPS} steps", "agreeing − mixed (Welch)",
                     finite_values(grpo, "tax"), finite_values(mixed["GRPO"], "tax"), False, 4, predicted=1),
        _primary_row(f"E11 P3: `val/accuracy` after step {E11_STEPS}", "`GRPO` − `DFPOMin`, agreeing (paired)",
                     finite_values(grpo, "val_end"), finite_values(dfpo, "val_end"), True, 3, predicted=0,
                     margin=EQUIVALENCE_MARGIN),
    ]


COVARIATES = (("entropy_start", "entropy (`health/entropy_mean`)"), ("val_start", "held-out success (`val/accuracy`)"))


def confound_line(agreeing: dict[str, dict[int, dict]], mixed: dict[str, dict[int, dict]]) -> str:
    """P2's confound, as the pre-registration named it (no test): the two warm starts differ at step 0 in more than how
    often first turns agree. Each covariate's means (``GRPO``'s runs: the arms' step-0 episodes are the same) and their
    distance in within-warm-start SDs (the root of the mean of the two warm starts' variances across seeds)."""
    parts = []
    for key, label in COVARIATES:
        values = [list(finite_values(arms["GRPO"], key).values()) for arms in (agreeing, mixed)]
        if min(map(len, values)) < 2:
            return "P2's confound: not both warm starts have two runs yet."
        means = [statistics.fmean(v) for v in values]
        spread = math.sqrt(statistics.fmean(statistics.variance(v) for v in values))
        apart = (f"{abs(means[0] - means[1]) / spread:.1f} within-warm-start SDs apart" if spread
                 else "no spread within either warm start")
        parts.append(f"{label} {means[0]:.3f} against {means[1]:.3f}, {apart}")
    return ("P2's confound (named in the pre-registration, no test): the warm starts differ at step 0 in more than how often "
            f"first turns agree; the agreeing one against the mixed one: {'; '.join(parts)}. P2's difference is what the "
            "two warm starts give, not agreement alone.")


def _interaction(agreeing: dict[str, dict[int, dict]], mixed: dict[str, dict[int, dict]]) -> list[list[float]]:
    """S4's two samples: each warm start's per-seed ``GRPO`` − ``DFPOMin`` final accuracy."""
    return [paired_values(finite_values(arms["GRPO"], "val_end"), finite_values(arms["DFPOMin"], "val_end"))
            for arms in (agreeing, mixed)]


def _secondary_lines(agreeing: dict[str, dict[int, dict]], mixed: dict[str, dict[int, dict]]) -> list[str]:
    lines = [f"| warm start | S1: entropy, steps {E11_STEPS - E11_LAST_STEPS}–{E11_STEPS - 1}, `GRPO` − `DFPOMin` "
             "| S1: entropy, `DrGRPO` − `GRPO` | S2: learning tax, `DrGRPO` − `GRPO` "
             f"| S2: `val/accuracy` end, `DrGRPO` − `GRPO` (TOST ±{EQUIVALENCE_MARGIN:g}) |", "|---|---|---|---|---|"]
    for name, arms in (("agreeing", agreeing), ("mixed", mixed)):
        grpo, drgrpo, dfpo = arms["GRPO"], arms["DrGRPO"], arms["DFPOMin"]
        lines.append(f"| {name} | {difference(grpo, dfpo, 'entropy_end', family=S1, comparison=(name, 'GRPO'))} "
                     f"| {difference(drgrpo, grpo, 'entropy_end', family=S1, comparison=(name, 'DrGRPO'))} "
                     f"| {difference(drgrpo, grpo, 'tax', 4, family=S2, comparison=(name, 'tax'))} "
                     f"| {accuracy_difference(drgrpo, grpo, family=S2, comparison=(name, 'val_end'))} |")
    grpo, dfpo = mixed["GRPO"], mixed["DFPOMin"]
    interaction = _interaction(agreeing, mixed)
    early = [list(finite_values(arms["GRPO"], "tax_early").values()) for arms in (agreeing, mixed)]
    return lines + [
        "",
        f"* S3, the mixed warm start, `GRPO` − `DFPOMin` (paired): learning tax "
        f"{difference(grpo, dfpo, 'tax', 4, family=S3, comparison=('tax',))}; `val/accuracy` at the end "
        f"{accuracy_difference(grpo, dfpo, family=S3, comparison=('val_end',))}.",
        f"* S4, the success interaction, (`GRPO` − `DFPOMin`)_agreeing − (`GRPO` − `DFPOMin`)_mixed on `val/accuracy` "
        f"at the end (Welch on each warm start's paired differences): {welch_difference(*interaction, 3, S4, ('S4',))}.",
        f"* S5, P2's test on GRPO's tax over steps 0–{E11_EARLY_STEPS - 1}, agreeing − mixed (Welch): "
        f"{welch_difference(*early, 4, S5, ('S5',))}.",
    ]


def group_shape() -> tuple[int, int]:
    """``(groups per step, episodes per group)``: the agent quickstart's ``prompts_per_round`` and ``group_size``."""
    data = yaml.safe_load((ROOT / AGENT_CONFIG).read_text())["data"]["init_args"]
    return int(data["prompts_per_round"]), int(data["group_size"])


def _step_zero(arms: dict[str, dict[int, dict]], per_step: int) -> tuple[int, int, list[int]]:
    """``(agreeing groups, groups, seeds where the arms' step 0 differs)`` pooled over the seeds, ``per_step`` groups a
    step: the arms start from the same model at the same seed, so their step-0 episodes, and these counts, should be
    the same."""
    seeds = sorted(set().union(*(set(runs) for runs in arms.values())))
    agreeing = groups = 0
    differ = []
    for seed in seeds:
        runs = [by_seed[seed] for by_seed in arms.values() if seed in by_seed]
        if len({(run["agreement_start"], run["shared_policy_start"]) for run in runs}) > 1:
            differ.append(seed)
        agreement = runs[0]["agreement_start"]
        if not math.isnan(agreement):
            agreeing += round(agreement * per_step)
            groups += per_step
    return agreeing, groups, differ


def manipulation_lines(agreeing: dict[str, dict[int, dict]], mixed: dict[str, dict[int, dict]]) -> list[str]:
    """The manipulation check as pre-registered: whole-group first-turn agreement at step 0, pooled over the seeds."""
    per_step, group_size = group_shape()
    counts = {name: _step_zero(arms, per_step) for name, arms in (("agreeing", agreeing), ("mixed", mixed))}
    if not all(groups for _, groups, _ in counts.values()):
        return ["Manipulation check: not both warm starts have runs yet."]
    described = "; ".join(f"{name} {hits} of {groups} ({hits / groups:.3f})" for name, (hits, groups, _) in counts.items())
    same = "; ".join(f"{name}: {'the same in every arm at every seed' if not differ else f'NOT the same at seeds {seed_ranges(differ)}'}"
                     for name, (_, _, differ) in counts.items())
    holds = counts["agreeing"][0] / counts["agreeing"][1] > counts["mixed"][0] / counts["mixed"][1]
    outcome = ("**the manipulation holds** (the agreeing warm start's groups agree more often)" if holds else
               "**the manipulation does not hold**: P2 does not test its question")
    return [f"Manipulation check (pre-registered, no test): groups whose {group_size} first turns all agree at "
            f"step 0, before any update, pooled over the seeds: {described}: {outcome}. The step-0 episodes: {same}."]


def identity_line(runs: dict) -> str:
    """``DFPOMin``'s and ``DrGRPO``'s learning tax (on-policy both cancel exactly): its largest value at any step."""
    parts = []
    for arm in ("DFPOMin", "DrGRPO"):
        values = [run["tax_max"] for (name, _), seeds in runs.items() if name == arm for run in seeds.values()
                  if not math.isnan(run["tax_max"])]
        if not values:
            continue
        largest = max(values)
        state = (f"0 up to float rounding (≤ {ROUNDING:g}) at every step" if largest <= ROUNDING
                 else f"ABOVE {ROUNDING:g}, a bug to report, not a result")
        parts.append(f"`{arm}` {largest:.1e} over {len(values)} runs: {state}")
    return "Identity check, the largest per-step learning tax of the arms that cancel exactly: " + "; ".join(parts) + "."


def warm_start_lines() -> list[str]:
    """What each warm start's JSON records: its tool share, wall time, held-out success and weights hash; whether the
    mixed warm start is the shipped ``embedded:tiny-agent`` bit for bit."""
    shipped = hashlib.sha256(SHIPPED_WEIGHTS.read_bytes()).hexdigest()
    lines = []
    for warm_start in E11_TOOL_SHARES:
        path = RESULTS / "E11" / f"warmstart-{e11_setting(warm_start)}.json"
        if not path.exists():
            lines.append(f"* {warm_start}: not trained yet.")
            continue
        record = json.loads(path.read_text())
        accuracy = [value for _, value in record["scalars"].get("val/accuracy", [])]
        same = "the shipped model's weights bit for bit" if record["model_sha256"] == shipped else "NOT the shipped weights"
        lines.append(f"* {warm_start} (tool share {record['tool_share']}): {record['wall_s']:.0f} s, held-out success after "
                     f"training {accuracy[-1]:.3f}, weights SHA-256 {record['model_sha256'][:8]}… ({same}), commit "
                     f"{record['provenance']['commit'][:7]}.")
    return lines


def _stored_line(runs: dict) -> str:
    """How many of the 60 pre-registered runs are stored, which are missing, and on which commits and CPUs they ran."""
    parts, expected = [], len(E11_ARMS) * len(E11_TOOL_SHARES) * len(E11_SEEDS)
    for setting in (AGREEING, MIXED):
        for arm in E11_ARMS:
            missing = sorted(set(E11_SEEDS) - set(runs.get((arm, setting), {})))
            if missing:
                parts.append(f"`{arm}` {setting} missing seeds {seed_ranges(missing)}")
    stored = sum(len(runs.get((arm, setting), {})) for arm in E11_ARMS for setting in (AGREEING, MIXED))
    provenance = where_runs_ran(list(runs.values()))
    steps = sorted({run["steps"] for seeds in runs.values() for run in seeds.values()})
    return (f"Runs stored: {stored} of the {expected} pre-registered" + (f" ({'; '.join(parts)})" if parts else "")
            + f". {provenance}. Steps logged per run: {', '.join(map(str, steps))}.")


UNTESTED = (("agreement_start", "first turns agree, step 0", 3), ("agreement", "first turns agree, mean", 3),
            ("shared_policy_start", "policy tokens the group shares, step 0", 3),
            ("shared_policy", "policy tokens the group shares, mean", 3), ("tool_calls", "tool calls per episode", 2),
            ("turns", "turns", 2), ("zero_std_groups", "groups with equal rewards", 3),
            ("val_start", "`val/accuracy` start", 3), ("val_end", "`val/accuracy` end", 3),
            ("tax", "learning tax", 4), ("tax_early", f"learning tax, steps 0–{E11_EARLY_STEPS - 1}", 4),
            ("entropy_start", "entropy, step 0", 3),
            ("entropy_end", f"entropy, steps {E11_STEPS - E11_LAST_STEPS}–{E11_STEPS - 1}", 3),
            ("entropy_ratio", "`health/entropy_ratio` end", 3), ("shared_kl", "`health/shared_kl`", 5),
            ("wall_s", "wall time (s)", 0))


def _untested_table(runs: dict) -> list[str]:
    lines = ["| warm start | arm | seeds | " + " | ".join(label for _, label, _ in UNTESTED) + " |",
             "|---|---|---|" + "---|" * len(UNTESTED)]
    for setting in (AGREEING, MIXED):
        for arm in E11_ARMS:
            seeds = runs.get((arm, setting), {})
            if seeds:
                lines.append(f"| {setting} | `{arm}` | {len(seeds)} | "
                             + " | ".join(cell(seeds, key, digits) for key, _, digits in UNTESTED) + " |")
    return lines


def e11_section(runs: dict) -> list[str]:
    """E11's tables from its runs (``(arm, setting) -> seed -> summary``, :func:`lab.summaries.load_e11`); every table
    renders with whatever runs are stored."""
    lines = [f"#### E11 cancellation across turns (agent quickstart, on-policy, {E11_STEPS} steps, lr 2e-4; "
             "pre-registered above)", "", _stored_line(runs), "", "Warm starts:", "", *warm_start_lines(), ""]
    agreeing, mixed = _arms(runs, AGREEING), _arms(runs, MIXED)
    if not any(agreeing.values()) and not any(mixed.values()):
        return lines + ["No runs yet."]
    lines += manipulation_lines(agreeing, mixed) + ["", identity_line(runs), "",
              "Primary outcomes, one Holm family of the 3 tests (two-sided; P1 and P2 paired / Welch t-tests with a "
              "predicted direction, P3 a paired t-test with TOST ±0.04 beside it, not adjusted); an effect is called only "
              f"on the Holm-adjusted p, a comparison with fewer than {MIN_SEEDS} seeds is inconclusive. SD: of the paired "
              "differences (P1, P3) or of each warm start's runs (P2).", ""]
    lines += _primary_table(agreeing, mixed) + ["", confound_line(agreeing, mixed), "",
                                                  "Secondary outcomes, each family Holm-adjusted on its own (S1 4 tests, "
                                                  "S2 4, S3 2, S4 1, S5 1); cells paired by seed unless Welch is named:", ""]
    lines += _secondary_lines(agreeing, mixed) + ["", "Reported without tests (mean ± 95% t-interval over seeds; step 0 is "
                                                  "the warm start's own episodes, before any update):", ""]
    return lines + _untested_table(runs)
