"""E10's section of docs/experiments.md: forced branching, analysed exactly as pre-registered there.

Primary: P1 (mean of ``probe/preamble_kl``) and P2 (last ``health/drift_preference_entropy``), each arm paired by seed
with ``DFPOMin``; one Holm family of 4 tests, TOST with margins of ±0.05 and ±0.10 whose 4 p-values form a Holm family
of their own, the same again on seeds 3-29 (the seeds the pilot did not see). Secondary: F2 learning tax, F3 per-step
shared KL, F4 accuracy (TOST ±0.04), F5 the 10-seed arms on P1 and P2, each Holm-adjusted separately; ``DFPOMinTR``
as an identity check against ``DFPOMin`` (no test); the quantities reported without tests.
"""

import math
import statistics
from typing import NamedTuple

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
    scientific_cell,
    seed_ranges,
    where_runs_ran,
)
from lab.runs import E10_SEEDS, E10_SETTING, E10C_ARMS, E10C_SEEDS, WALL_CLOCK, compare_scalars, without_timings
from lab.stats import (
    ALPHA,
    equivalent,
    leave_one_out_tost,
    mean_interval,
    minimal_detectable_effect,
    paired_difference,
    paired_t_test,
    paired_values,
    sign_test,
    t_quantile,
    tost,
    verdict,
    welch_test,
)
from lab.summaries import at_matched_movement, matched_movement

BASE = "DFPOMin"
PRIMARY_ARMS = ("DFPOMin-SharedNoise", "GRPO")
TEN_SEED_ARMS = ("DrGRPO", "GSPO", "DFPOMin-PositiveOnly")
IDENTITY_ARM = "DFPOMinTR"
# (key, label, TOST margin): the primary outcomes and their margins, stated before the main runs
OUTCOMES = (("preamble_kl", "P1: KL from start at the preamble contexts", 0.05),
            ("preference_entropy", "P2: preference entropy (end)", 0.10))
PRIMARY, PRIMARY_TOST = "E10 primary (P1, P2)", "E10 primary, equivalence (TOST)"
SENSITIVITY, SENSITIVITY_TOST = "E10 primary, seeds 3–29 (sensitivity)", "E10 primary, seeds 3–29, equivalence (TOST)"
F2, F3, F4, F4_TOST = ("E10 F2 learning tax (secondary)", "E10 F3 per-step shared KL (secondary)",
                       "E10 F4 accuracy (secondary)", "E10 F4 accuracy, equivalence (TOST, secondary)")
F5 = "E10 F5 10-seed arms on P1, P2 (secondary)"
SENSITIVITY_FIRST_SEED = 3  # seeds 0-2 were seen in the pilot, which chose P1's aggregation and the margins
HOLM_TESTS = 4  # the primary family's size: its strictest Holm level is alpha / 4


def _from(runs: dict[int, dict], first: int) -> dict[int, dict]:
    return {seed: run for seed, run in runs.items() if seed >= first}


def _stored_lines(arms: dict[str, dict[int, dict]]) -> list[str]:
    """How many of the pre-registered runs are stored, which seeds are missing, and on which commits and CPUs they ran."""
    expected = sum(E10_SEEDS.values())
    stored = sum(len(arms.get(arm, {})) for arm in E10_SEEDS)
    parts = []
    for arm, count in E10_SEEDS.items():
        missing = sorted(set(range(count)) - set(arms.get(arm, {})))
        parts.append(f"`{arm}` {count - len(missing)}/{count}" + (f" (missing seeds {seed_ranges(missing)})" if missing else ""))
    return [f"Runs stored: {stored} of the {expected} pre-registered ({', '.join(parts)}). {where_runs_ran(list(arms.values()))}."]


def _arm_table(arms: dict[str, dict[int, dict]]) -> list[str]:
    lines = ["| arm | seeds | learning tax | per-step shared KL (`health/shared_kl`, mean) | P1: KL from start at preamble contexts "
             "(`probe/preamble_kl`, mean) | P2: preference entropy (end) | preamble p (`rollout/preamble_p`, mean) "
             "| group shared tokens | `val/accuracy` end | wall time (s) |", "|---|---|---|---|---|---|---|---|---|---|"]
    for arm, seeds in arms.items():
        lines.append(f"| `{arm}` | {len(seeds)} | {scientific_cell(seeds, 'tax')} | {cell(seeds, 'shared_kl', 5)} "
                     f"| {cell(seeds, 'preamble_kl')} | {cell(seeds, 'preference_entropy')} | {cell(seeds, 'preamble_p')} "
                     f"| {cell(seeds, 'group_shared_tokens', 2)} | {cell(seeds, 'val_end')} | {cell(seeds, 'wall_s', 1)} |")
    return lines


def _measured_at(arms: dict[str, dict[int, dict]]) -> str:
    """Where P1 and P2 were measured, over every stored run (pre-registered: steps 5, 10, ..., 40; step 30)."""
    runs = [run for seeds in arms.values() for run in seeds.values()]
    kl_steps = sorted({run["preamble_kl_steps"] for run in runs})
    end_steps = sorted({run["preference_step_end"] for run in runs if not math.isnan(run["preference_step_end"])})
    kl = "; ".join(f"steps {', '.join(map(str, steps))}" if steps else "no measurement" for steps in kl_steps)
    return (f"P1 is measured at {kl} ({'the same in every run' if len(kl_steps) == 1 else 'NOT the same in every run'}); "
            f"P2's last measurement is at step {', '.join(f'{s:g}' for s in end_steps) or '–'}"
            f"{' in every run' if len(end_steps) == 1 else ' (NOT the same in every run)'}.")


def _primary_row(arm: str, runs: dict[int, dict], base: dict[int, dict], key: str, margin: float, seeds: str,
                 family: str, tost_family: str) -> str:
    """One primary comparison: the paired difference, its raw and Holm p, TOST (Holm over its own family), MDE at
    alpha 0.05 and at Holm's strictest alpha / 4 (effects included), and the pre-registered verdict, which is
    :func:`lab.stats.verdict` on the Holm-adjusted p and TOST p (inconclusive below 5 pairs)."""
    a, b = finite_values(runs, key), finite_values(base, key)
    mean, half, n = paired_difference(a, b)
    _, p, _ = paired_t_test(a, b)
    differences = paired_values(a, b)
    p_tost = tost(differences, margin)[0] if n >= 2 else math.nan
    comparison = (arm, key)
    holm_p = FAMILIES.adjust(family, comparison, p)
    holm_tost = FAMILIES.adjust(tost_family, comparison, p_tost)
    if n < 2 or math.isnan(half):
        call, within, detectable = "n/a", "–", "–"
    else:
        within = f"within ±{margin:.2f}" if holm_tost < ALPHA else "not shown"
        call = verdict(holm_p, holm_tost, margin) if n >= MIN_SEEDS else "inconclusive"
        strict = 1 - ALPHA / HOLM_TESTS
        se = half / t_quantile(0.975, n - 1)
        mde_holm = minimal_detectable_effect(se * t_quantile(0.5 + strict / 2, n - 1), n, strict)
        detectable = f"{minimal_detectable_effect(half, n):.3f} / {mde_holm:.3f}"
    equivalence_p = "–" if math.isnan(p_tost) else f"{format_p(p_tost)}, Holm {format_p(holm_tost)}"
    return (f"| {seeds} | {n} | {format_interval(mean, half)} | {format_p(p)} | {format_p(holm_p)} "
            f"| {equivalence_p} | {within} | {detectable} | **{call}** |")


def _primary_table(arms: dict[str, dict[int, dict]]) -> list[str]:
    base = arms.get(BASE, {})
    lines = ["| outcome | comparison (paired by seed) | seeds | n | difference (95%) | p | Holm p | TOST p (raw, Holm) "
             "| equivalence | MDE (α 0.05 / Holm α/4) | verdict |", "|---|---|---|---|---|---|---|---|---|---|---|"]
    for key, label, margin in OUTCOMES:
        for arm in PRIMARY_ARMS:
            runs = arms.get(arm, {})
            for first, families in ((0, (PRIMARY, PRIMARY_TOST)), (SENSITIVITY_FIRST_SEED, (SENSITIVITY, SENSITIVITY_TOST))):
                seeds = "all" if first == 0 else f"{first}–29 (sensitivity)"
                row = _primary_row(arm, _from(runs, first), _from(base, first), key, margin, seeds, *families)
                lines.append(f"| {label} (±{margin:.2f}) | `{arm}` − `{BASE}` {row}")
    return lines


def _secondary_lines(arms: dict[str, dict[int, dict]]) -> list[str]:
    base = arms.get(BASE, {})
    lines = ["| paired with `DFPOMin` (same seed) | F2: learning tax | F3: per-step shared KL | F4: `val/accuracy` end "
             f"| F4: equivalence within ±{EQUIVALENCE_MARGIN:g} (TOST, Holm over F4's 2) |", "|---|---|---|---|---|"]
    for arm in PRIMARY_ARMS:
        runs, name = arms.get(arm, {}), (arm,)
        tests = (f"| `{arm}` − `{BASE}` | {difference(runs, base, 'tax', 4, family=F2, comparison=name)} "
                 f"| {difference(runs, base, 'shared_kl', 5, family=F3, comparison=name)} "
                 f"| {accuracy_difference(runs, base, F4, name, F4_TOST)} |")
        differences = paired_values(finite_values(runs, "val_end"), finite_values(base, "val_end"))
        p_tost, lower, upper = tost(differences, EQUIVALENCE_MARGIN) if len(differences) >= 2 else (math.nan,) * 3
        holm_tost = FAMILIES.adjust(F4_TOST, name, p_tost)
        if len(differences) < 2:
            shown = "–"
        else:
            call = equivalent(EQUIVALENCE_MARGIN) if holm_tost < ALPHA else "inconclusive"
            shown = (f"TOST p {format_p(p_tost)}, Holm {format_p(holm_tost)} (p of > −{EQUIVALENCE_MARGIN:g}: "
                          f"{format_p(lower)}, of < +{EQUIVALENCE_MARGIN:g}: {format_p(upper)}): **{call}** (n={len(differences)})")
        lines.append(f"{tests} {shown} |")
    lines += ["", "F5, the 10-seed arms paired with `DFPOMin` on seeds 0–9 (one family of 6; TOST within the primary "
              "margins, ±0.05 on P1 and ±0.10 on P2, per comparison):", "",
              "| arm | seeds | P1: KL from start | P1 − `DFPOMin` (paired) | P2: preference entropy (end) | P2 − `DFPOMin` (paired) |",
              "|---|---|---|---|---|---|"]
    for arm in TEN_SEED_ARMS:
        runs = arms.get(arm, {})
        ten = {seed: run for seed, run in base.items() if seed < E10_SEEDS[arm]}
        cells = [f"{cell(runs, key)} | {difference(runs, ten, key, family=F5, comparison=(arm, key), margin=margin)}"
                 for key, _, margin in OUTCOMES]
        lines.append(f"| `{arm}` | {len(runs)} | " + " | ".join(cells) + " |")
    return lines


def _compared(scalars: dict[str, list], other: dict[str, list]) -> dict[str, list]:
    """The series of ``scalars`` that ``other`` logs too, without wall-clock timings."""
    return {tag: points for tag, points in without_timings(scalars).items() if tag in other}


def _identity_line(arms: dict[str, dict[int, dict]]) -> str:
    """``DFPOMinTR`` against ``DFPOMin`` at each shared seed, every series both log point for point, timings aside
    (pre-registered as an identity check: on-policy every ratio is 1 and the mask never acts; a difference is a bug,
    not a result). The trust region's own series (its mask's share and mean) have no counterpart and are named."""
    checked, base = arms.get(IDENTITY_ARM, {}), arms.get(BASE, {})
    seeds = sorted(set(checked) & set(base))
    if not seeds:
        return f"Identity check, `{IDENTITY_ARM}` against `{BASE}` (same seed, every scalar series point for point): no pairs yet."
    comparisons = {seed: compare_scalars(_compared(base[seed]["scalars"], checked[seed]["scalars"]),
                                         _compared(checked[seed]["scalars"], base[seed]["scalars"])) for seed in seeds}
    same = [seed for seed in seeds if comparisons[seed]["identical"]]
    series = sorted({comparison["tags"] for comparison in comparisons.values()})
    own = sorted({tag for seed in seeds for tag in set(checked[seed]["scalars"]) - set(base[seed]["scalars"])})
    line = (f"Identity check, `{IDENTITY_ARM}` against `{BASE}` (same seed, every series both log point for point, "
            f"{'/'.join(map(str, series))} series per run; wall-clock timings `{WALL_CLOCK}…` aside, and the trust "
            f"region's own {', '.join(f'`{tag}`' for tag in own) or 'none'}): **identical at {len(same)} of {len(seeds)} seeds**")
    different = [seed for seed in seeds if seed not in same]
    if not different:
        return line + f" (seeds {seed_ranges(seeds)})."
    details = []
    for seed in different:
        comparison = comparisons[seed]
        differ = comparison["differ"]
        named = ", ".join(sorted(differ)[:3]) + (", …" if len(differ) > 3 else "")
        first = min((d["first_step"] for d in differ.values()), default=math.nan)
        where = f", from step {first:g} ({named})" if differ else ""
        details.append(f"seed {seed}: {len(differ)} of {comparison['tags']} series differ{where}; "
                       f"{len(comparison['missing'])} only in `{BASE}`, {len(comparison['extra'])} only in `{IDENTITY_ARM}`")
    return line + "; NOT identical at " + "; ".join(details) + " (a bug to report, not a result)."


def _untested_lines(arms: dict[str, dict[int, dict]]) -> list[str]:
    movement = matched_movement({(arm, E10_SETTING): seeds for arm, seeds in arms.items()})
    matched = movement > 0  # on-policy every ratio is 1, so objective/approx_kl may be 0 at every step: nothing to match
    if matched:
        note = (f"Preference entropy at matched movement: at the first step where the summed `objective/approx_kl` reaches "
                f"{movement:.3f} (the most every E10 run reaches by its last drift measurement), interpolated between measurements.")
    else:
        note = ("Preference entropy at matched movement (E7's method) is not defined here: the summed `objective/approx_kl` "
                "is 0 by the last drift measurement in at least one run (on-policy the old and the current policy are the same "
                "at every step, so there is no movement to match).")
    lines = [f"Reported without tests (mean ± 95% t-interval over seeds). {note}", "",
             "| arm | " + ("preference entropy at matched movement | " if matched else "")
             + "preference entropy (start) | `probe/preamble_entropy` (step 40) | `probe/preamble_p` (step 40) "
             "| `rollout/frac_zero_std_groups` | `rollout/preamble_stopped` | completion length | `val/accuracy` start |",
             "|---|---|---|---|---|---|---|---|" + ("---|" if matched else "")]
    for arm, seeds in arms.items():
        at = {seed: {"matched": at_matched_movement(run, movement)} for seed, run in seeds.items()}
        lines.append(f"| `{arm}` | " + (f"{cell(at, 'matched')} | " if matched else "")
                     + f"{cell(seeds, 'preference_entropy_start')} | {cell(seeds, 'probe_entropy_end')} | {cell(seeds, 'probe_p_end')} "
                     f"| {cell(seeds, 'zero_std_groups')} | {cell(seeds, 'preamble_stopped')} | {cell(seeds, 'completion_len', 1)} "
                     f"| {cell(seeds, 'val_start')} |")
    return lines


def e10_section(runs: dict) -> list[str]:
    """E10's tables from its main runs (``(arm, setting) -> seed -> summary``, :func:`lab.summaries.load_e10`); every
    table renders with whatever runs are stored, so the section can be regenerated while the study runs."""
    arms = {arm: seeds for arm in E10_SEEDS for (name, setting), seeds in runs.items() if name == arm and setting == E10_SETTING}
    arms |= {name: seeds for (name, setting), seeds in sorted(runs.items()) if setting == E10_SETTING and name not in arms}
    lines = [f"#### E10 forced branching (on-policy, `{E10_SETTING}`: scaffold 0, spread 8, K = 8 preamble tokens; 40 steps, lr 2e-4)",
             ""] + _stored_lines(arms) + [""]
    if not arms:
        return lines + ["No runs yet."]
    lines += _arm_table(arms) + ["", _measured_at(arms), "",
                                 "Primary outcomes, paired with the same seed's `DFPOMin`: one Holm family of the 4 tests "
                                 "(paired two-sided t-tests), and one of their 4 TOST p-values (the larger one-sided p, margins "
                                 "±0.05 on P1 and ±0.10 on P2); an effect is called only on the Holm-adjusted p, equivalence only "
                                 "on the Holm-adjusted TOST p, and a comparison that is neither is inconclusive (as is any with "
                                 f"fewer than {MIN_SEEDS} pairs). Each comparison is shown on all seeds and on seeds 3–29, which "
                                 "the pilot did not see (a family of its own, adjusted the same way).", ""]
    lines += _primary_table(arms) + ["", "Secondary families, each Holm-adjusted separately (F2, F3, F4 on all paired seeds; "
                                         "F4's TOST p-values Holm-adjusted as a family of their own):", ""]
    lines += _secondary_lines(arms) + ["", _identity_line(arms), ""] + _untested_lines(arms)
    return lines



# E10-confirm's outcomes as pre-registered: (key, label, TOST margin, the sign Prop. 3.1 predicts, primary)
CONFIRM_OUTCOMES = (("preference_entropy", "P2: preference entropy (end)", 0.10, -1, True),
                    ("preamble_kl", "P1: KL from start at the preamble contexts", 0.05, 1, False))


def confirm_verdict(p: float, p_tost: float, mean: float, margin: float, predicted: int) -> str:
    """E10-confirm's pre-registered rule, :func:`lab.stats.verdict` on one test: an effect (its direction, and whether it
    is the predicted one) where p < 0.05; else no difference larger than the margin where TOST rejects at 0.05; else
    inconclusive."""
    call = verdict(p, p_tost, margin)
    if call != "effect":
        return call
    return "effect, the predicted direction" if mean * predicted > 0 else "effect, against the predicted direction"


def _confirm_row(noise: dict[int, dict], base: dict[int, dict], key: str, label: str, margin: float, predicted: int,
                 primary: bool) -> tuple[str, str]:
    """One outcome's row of E10-confirm's table, and its verdict."""
    a, b = finite_values(noise, key), finite_values(base, key)
    differences = paired_values(a, b)
    mean, half, n = paired_difference(a, b)
    if n < 2:
        return f"| {label} | {'primary' if primary else 'secondary'} | {n} | – | – | – | – | – | – | n/a |", "n/a"
    _, p, _ = paired_t_test(a, b)
    p_tost = tost(differences, margin)[0]
    sd = half / t_quantile(0.975, n - 1) * math.sqrt(n)
    agreeing = sum(1 for d in differences if d * predicted > 0)
    call = confirm_verdict(p, p_tost, mean, margin, predicted)
    return (f"| {label} | {'primary' if primary else 'secondary'} | {n} | {format_interval(mean, half)} | {sd:.3f} "
            f"| {minimal_detectable_effect(half, n):.3f} | {format_p(p)} | {format_p(p_tost)} (±{margin:.2f}) "
            f"| {agreeing} of {n} (sign p {format_p(sign_test(agreeing, n))}) | **{call}** |"), call


class SeedDependence(NamedTuple):
    """How much E10-confirm's two verdicts rest on single seeds (descriptive, no test)."""

    kl_mean: float  # P1, noise − untouched
    kl_median: float
    kl_largest_share: float  # the largest difference in the predicted direction, as a share of the differences' sum
    kl_predicted: int  # seeds that go the predicted way
    pairs: int
    tost_left_out: dict[int, float]  # P2's TOST p with each seed left out


def seed_dependence(noise: dict[int, dict], base: dict[int, dict]) -> SeedDependence:
    """P1's median, largest seed's share and sign count beside its mean; P2's TOST p (E10's margin) with each seed
    left out, by seed (:func:`lab.stats.leave_one_out_tost`)."""
    (p2, _, margin, _, _), (p1, _, _, predicted, _) = CONFIRM_OUTCOMES
    kl = paired_values(finite_values(noise, p1), finite_values(base, p1))
    a, b = finite_values(noise, p2), finite_values(base, p2)
    left_out = leave_one_out_tost(paired_values(a, b), margin)
    toward = predicted * sum(kl)
    share = max(d * predicted for d in kl) / toward if toward > 0 else math.nan
    return SeedDependence(statistics.fmean(kl), statistics.median(kl), share, sum(1 for d in kl if d * predicted > 0),
                          len(kl), dict(zip(sorted(set(a) & set(b)), left_out)))


def _seed_dependence_line(dependence: SeedDependence, p2_call: str) -> str:
    """The line under E10-confirm's table: P1's median and its largest seed beside its mean; the TOST p of P2 with one
    seed left out, and whether P2's equivalence label (where it has one) survives leaving out any one seed."""
    margin = CONFIRM_OUTCOMES[0][2]
    left_out = dependence.tost_left_out
    fragile = [seed for seed, p in left_out.items() if p >= ALPHA]
    p2 = f"P2's TOST p (±{margin:.2f}) with one seed left out {min(left_out.values()):.3f}–{max(left_out.values()):.3f}"
    if p2_call == equivalent(margin):
        p2 += (f": {ALPHA:g} or above without any one of seeds {seed_ranges(fragile)} ({len(fragile)} of {len(left_out)}), "
               "so its equivalence label is fragile" if fragile else f": below {ALPHA:g} whichever seed is left out")
    return (f"How much the verdicts rest on single seeds (descriptive, no test): P1's median difference "
            f"{dependence.kl_median:.3f} (mean {dependence.kl_mean:.3f}), its largest seed {dependence.kl_largest_share:.0%} "
            f"of the {dependence.pairs} differences' sum, {dependence.kl_predicted} of {dependence.pairs} seeds the predicted "
            f"way; {p2}.")


def e10_confirm_section(runs: dict, e10: dict) -> list[str]:
    """E10-confirm's table (``(arm, setting) -> seed -> summary`` of its runs), its replication verdict by the
    pre-registered rule, and the descriptive pooled estimate over E10's and E10-confirm's seeds (``e10``: E10's runs)."""
    arms = {name: seeds for (name, setting), seeds in runs.items() if setting == E10_SETTING}
    base, noise = arms.get(BASE, {}), arms.get("DFPOMin-SharedNoise", {})
    stored = sum(len(arms.get(arm, {})) for arm in E10C_ARMS)
    commits = sorted({run["commit"] for seeds in arms.values() for run in seeds.values()})
    cpus = sorted({run["cpu"] for seeds in arms.values() for run in seeds.values()})
    lines = ["#### E10-confirm (E10's untouched and noise arms on seeds "
             f"{seed_ranges(list(E10C_SEEDS))}; pre-registered above)", "",
             f"Stored: {stored} of {len(E10C_ARMS) * len(E10C_SEEDS)} runs; commit {', '.join(c[:7] for c in commits) or '–'}; "
             f"CPU {', '.join(cpus) or '–'}.", ""]
    if not base or not noise:
        return lines + ["No paired runs yet."]
    lines += ["| outcome (`DFPOMin-SharedNoise` − `DFPOMin`, paired by seed) | test | n | difference (95%) | SD | MDE (80%) "
              "| p | TOST p | seeds the predicted way | verdict |", "|---|---|---|---|---|---|---|---|---|---|"]
    calls = {}
    for key, label, margin, predicted, primary in CONFIRM_OUTCOMES:
        row, calls[key] = _confirm_row(noise, base, key, label, margin, predicted, primary)
        lines.append(row)
    tax = paired_difference(finite_values(noise, "tax"), finite_values(base, "tax"))
    accuracy = paired_difference(finite_values(noise, "val_end"), finite_values(base, "val_end"))
    replicated = calls["preference_entropy"] == "effect, the predicted direction"
    lines += ["", f"Manipulation check (no test): learning tax {format_interval(tax[0], tax[1], 4)}; `val/accuracy` at step 40 "
              f"{format_interval(accuracy[0], accuracy[1])} (n={accuracy[2]}).", "",
              f"**Replication of E10's P2 effect (the pre-registered rule: E10-confirm's P2 verdict alone): "
              f"{'replicated' if replicated else 'not replicated'}.**", "",
              _seed_dependence_line(seed_dependence(noise, base), calls["preference_entropy"])]
    e10_arms = {name: seeds for (name, setting), seeds in e10.items() if setting == E10_SETTING}
    earlier_noise, earlier_base = e10_arms.get("DFPOMin-SharedNoise", {}), e10_arms.get(BASE, {})
    pooled = {key: paired_values(finite_values(earlier_noise, key), finite_values(earlier_base, key))
              + paired_values(finite_values(noise, key), finite_values(base, key)) for key, *_ in CONFIRM_OUTCOMES}
    described = [f"{label.split(':')[0]} {format_interval(*mean_interval(values))} (n={len(values)})"
                 for (key, label, *_), values in zip(CONFIRM_OUTCOMES, pooled.values(), strict=True) if len(values) >= 2]
    if described:
        lines += ["", "Pooled over E10's seeds and E10-confirm's (descriptive only, not a test: E10's seeds chose this "
                  f"follow-up), noise − untouched: {'; '.join(described)}."]
    key = CONFIRM_OUTCOMES[0][0]
    earlier, again = (paired_values(finite_values(a, key), finite_values(b, key))
                      for a, b in ((earlier_noise, earlier_base), (noise, base)))
    if min(len(earlier), len(again)) >= 2:
        gap, half, p, _ = welch_test(earlier, again)
        lines += ["", f"E10's P2 estimate against E10-confirm's (Welch on the two sets of paired differences, descriptive): "
                  f"E10 − E10-confirm {format_interval(gap, half)} (p {format_p(p)}): the two estimates are "
                  f"{'not distinguishable' if p >= ALPHA else 'different'}."]
    return lines
