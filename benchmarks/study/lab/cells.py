"""The cells of the report's tables: intervals, p-values, paired differences with their verdicts, TOST and ratios.

Every paired comparison belongs to a Holm family (:class:`Families`); the report renders its sections twice, the
first pass to collect each family's raw p-values, the second with the Holm-adjusted ones.
"""

import math
from collections import Counter, defaultdict

from lab.stats import (
    ALPHA,
    bootstrap_ratio_interval,
    equivalent,
    fieller_interval,
    holm,
    mean_interval,
    minimal_detectable_effect,
    paired_difference,
    paired_t_test,
    paired_values,
    slope_test,
    tost,
    verdict,
    welch_test,
)

MIN_SEEDS = 5  # fewer paired seeds than this: the comparison is reported as inconclusive, whatever its interval
EQUIVALENCE_MARGIN = 0.04  # TOST margin on final accuracy, stated before the tests were run (round 3)


def finite_values(runs: dict[int, dict], key: str) -> dict[int, float]:
    """``key`` of each seed's run, leaving out the runs where it is nan."""
    return {seed: run[key] for seed, run in runs.items() if not math.isnan(run[key])}


def seed_ranges(seeds: list[int]) -> str:
    """``0–9, 12, 14–29``: sorted seeds as ranges."""
    if not seeds:
        return "none"
    ranges, start = [], seeds[0]
    for previous, current in zip(seeds, seeds[1:] + [None]):
        if current != previous + 1:
            ranges.append(f"{start}" if start == previous else f"{start}–{previous}")
            start = current
    return ", ".join(ranges)


def where_runs_ran(groups: list[dict[int, dict]]) -> str:
    """``commit …, CPU: N runs; …``: how many of the runs in ``groups`` (each seed -> summary with ``commit`` and ``cpu``)
    ran on each commit and CPU."""
    counts = Counter((run["commit"], run["cpu"]) for seeds in groups for run in seeds.values())
    return "; ".join(f"commit {commit[:12]}, {cpu}: {count} runs" for (commit, cpu), count in sorted(counts.items()))


def format_interval(mean: float, half: float, digits: int = 3) -> str:
    if math.isnan(mean):
        return "–"
    return f"{mean:.{digits}f}" if math.isnan(half) else f"{mean:.{digits}f} ± {half:.{digits}f}"


def cell(runs: dict[int, dict[str, float]], key: str, digits: int = 3) -> str:
    return format_interval(*mean_interval(list(finite_values(runs, key).values())), digits)


def scientific_cell(runs: dict[int, dict], key: str) -> str:
    """Mean ± half-width in scientific notation (taxes span 1e-9 to 1e-1)."""
    mean, half = mean_interval(list(finite_values(runs, key).values()))
    return "–" if math.isnan(mean) else f"{mean:.1e}" if math.isnan(half) else f"{mean:.1e} ± {half:.1e}"


class Families:
    """The Holm families of the report, filled in two passes over the sections.

    A family is one outcome of one experiment: every distinct paired comparison of that outcome the
    experiment's tables report. The first pass records each comparison's raw p-value; :meth:`close`
    adjusts each family with Holm's step-down method; the second pass renders with the adjusted values.
    """

    def __init__(self) -> None:
        self.raw: dict[str, dict[tuple, float]] = defaultdict(dict)
        self.adjusted: dict[str, dict[tuple, float]] | None = None

    def reset(self) -> None:
        """Forgets every family, for a new first pass."""
        self.raw.clear()
        self.adjusted = None

    def adjust(self, family: str, comparison: tuple, p: float) -> float:
        """The Holm-adjusted p of ``comparison`` in ``family`` (nan during the first pass)."""
        if self.adjusted is None:
            self.raw[family][comparison] = p
            return math.nan
        return self.adjusted[family][comparison]

    def close(self) -> None:
        self.adjusted = {}
        for family, comparisons in self.raw.items():
            keys = list(comparisons)
            self.adjusted[family] = dict(zip(keys, holm([comparisons[k] for k in keys])))

    def summary(self, family: str) -> tuple[int, int]:
        """``(comparisons, effects)``: the family's size (comparisons with a p-value) and how many Holm keeps."""
        adjusted = [p for p in (self.adjusted or {}).get(family, {}).values() if not math.isnan(p)]
        return len(adjusted), sum(p < ALPHA for p in adjusted)


FAMILIES = Families()


def format_p(p: float) -> str:
    return "–" if math.isnan(p) else "<0.001" if p < 0.001 else f"{p:.2g}" if p < 0.1 else f"{p:.2f}"


def described(
    mean: float, half: float, pairs: int, digits: int = 3, p: float = math.nan, family: str | None = None,
    comparison: tuple = (), margin: float | None = None, p_equivalence: float = math.nan, equivalence_family: str | None = None,
) -> str:
    """``mean ± half (verdict; p raw, Holm adjusted; TOST ±margin p; MDE m; n=pairs)`` with the verdict of
    :func:`lab.stats.verdict`: on the Holm-adjusted p over ``family`` (the raw p without one), and, where a ``margin``
    was stated for the outcome, on the TOST p ``p_equivalence`` (Holm-adjusted over ``equivalence_family`` where one
    applies). Every cell states its minimal detectable effect (80% power), effects included."""
    mde = minimal_detectable_effect(half, pairs)
    adjusted = FAMILIES.adjust(family, comparison, p) if family else p
    adjusted_equivalence = (FAMILIES.adjust(equivalence_family, comparison, p_equivalence) if equivalence_family
                            else p_equivalence)
    call = verdict(adjusted, adjusted_equivalence, margin) if pairs >= MIN_SEEDS else "inconclusive"
    tests = "" if math.isnan(p) else f"; p {format_p(p)}" + (f", Holm {format_p(adjusted)}" if family else "")
    if margin is not None and not math.isnan(p_equivalence):
        holm = f", Holm {format_p(adjusted_equivalence)}" if equivalence_family else ""
        tests += f"; TOST ±{margin:.2f} p {format_p(p_equivalence)}{holm}"
    detectable = "" if math.isnan(mde) else f"; MDE {mde:.{digits}f}"
    return f"{format_interval(mean, half, digits)} ({call}{tests}{detectable}; n={pairs})"


def _paired(a: dict[int, dict], b: dict[int, dict], key: str, b_key: str | None = None) -> tuple[dict, dict]:
    return finite_values(a, key), finite_values(b, b_key or key)


def difference(
    a: dict[int, dict], b: dict[int, dict], key: str, digits: int = 3, b_key: str | None = None, family: str | None = None,
    comparison: tuple = (), margin: float | None = None, equivalence_family: str | None = None,
) -> str:
    """``a[key] - b[b_key or key]`` paired over seeds, with its interval, raw and Holm-adjusted p (in ``family``, where
    ``comparison`` names it; the same comparison from either side must get the same name), TOST within the ``margin``
    stated for the outcome (if any; Holm-adjusted over ``equivalence_family`` if given), verdict and MDE."""
    pairs_a, pairs_b = _paired(a, b, key, b_key)
    _, p, _ = paired_t_test(pairs_a, pairs_b)
    differences = paired_values(pairs_a, pairs_b)
    p_equivalence = tost(differences, margin)[0] if margin is not None and len(differences) >= 2 else math.nan
    return described(*paired_difference(pairs_a, pairs_b), digits, p, family, comparison, margin, p_equivalence,
                     equivalence_family)


def accuracy_difference(
    a: dict[int, dict], b: dict[int, dict], family: str | None = None, comparison: tuple = (), equivalence_family: str | None = None,
) -> str:
    """Final accuracy, ``a - b`` paired over seeds, with TOST within the accuracy margin stated in round 3."""
    return difference(a, b, "val_end", family=family, comparison=comparison, margin=EQUIVALENCE_MARGIN,
                      equivalence_family=equivalence_family)


def welch_difference(a: list[float], b: list[float], digits: int = 3, family: str | None = None,
                     comparison: tuple = ()) -> str:
    """``mean(a) - mean(b)`` of two unpaired samples by Welch's t-test: ``mean ± half (verdict; p raw, Holm adjusted;
    MDE m; Welch df d; n=len(a)+len(b))``, the MDE with Welch's degrees of freedom, no margin (so an effect or
    inconclusive; inconclusive where either sample has fewer than 5 values)."""
    mean, half, p, df = welch_test(a, b)
    adjusted = FAMILIES.adjust(family, comparison, p) if family else p
    call = verdict(adjusted) if min(len(a), len(b)) >= MIN_SEEDS else "inconclusive"
    tests = "" if math.isnan(p) else f"; p {format_p(p)}" + (f", Holm {format_p(adjusted)}" if family else "")
    mde = minimal_detectable_effect(half, len(a) + len(b), df=df) if not math.isnan(df) else math.nan
    detectable = "" if math.isnan(mde) else f"; MDE {mde:.{digits}f}; Welch df {df:.1f}"
    return f"{format_interval(mean, half, digits)} ({call}{tests}{detectable}; n={len(a)}+{len(b)})"


def pair(*names: str) -> tuple:
    """A comparison's name that is the same whichever side is subtracted."""
    return tuple(sorted(names))


def equivalence(a: dict[int, dict], b: dict[int, dict], key: str = "val_end", margin: float = EQUIVALENCE_MARGIN) -> str:
    """TOST of ``a - b`` paired over seeds with ``margin``: "no difference larger than margin" only where both one-sided
    tests reject at 5%, otherwise "inconclusive"."""
    differences = paired_values(*_paired(a, b, key))
    if len(differences) < 2:
        return "–"
    p, lower, upper = tost(differences, margin)
    call = equivalent(margin) if p < ALPHA else "inconclusive"
    return (f"TOST p {format_p(p)} (p of > −{margin:g}: {format_p(lower)}, of < +{margin:g}: {format_p(upper)}): "
            f"**{call}** (n={len(differences)})")


def ratio(a: dict[int, dict], b: dict[int, dict], key: str, b_key: str | None = None, digits: int = 1) -> str:
    """``mean(a) / mean(b)`` of paired per-seed values with Fieller's 95% interval and the percentile bootstrap's
    (10,000 resamples of the seeds, seed 0)."""
    pairs_a, pairs_b = _paired(a, b, key, b_key)
    seeds = sorted(set(pairs_a) & set(pairs_b))
    if len(seeds) < 2:
        return "–"
    x, y = [pairs_a[s] for s in seeds], [pairs_b[s] for s in seeds]
    value, low, high = fieller_interval(x, y)
    if math.isinf(low):  # the denominator is not distinguishable from 0: no ratio to speak of (nor a bootstrap)
        return f"{value:.{digits}f}× (Fieller 95%: unbounded, the denominator's interval includes 0; n={len(seeds)})"
    _, boot_low, boot_high = bootstrap_ratio_interval(x, y)
    return (f"{value:.{digits}f}× (Fieller 95%: {low:.{digits}f} to {high:.{digits}f}; "
            f"bootstrap: {boot_low:.{digits}f} to {boot_high:.{digits}f}; n={len(seeds)})")


def trend(
    points: list[tuple[float, float]], scale: float = 1.0, digits: int = 3, family: str | None = None, comparison: tuple = (),
) -> tuple[str, str]:
    """The least-squares slope of ``y`` on ``x`` times ``scale``, its interval, and the verdict of
    :func:`lab.stats.verdict` on the Holm-adjusted p in ``family`` (no margin was stated for a slope, so it is an effect
    or inconclusive; inconclusive below 5 seeds) with the minimal detectable slope (``n - 2`` degrees of freedom)."""
    slope, half, p = slope_test([x for x, _ in points], [y for _, y in points])
    seeds = len(points) // max(len({x for x, _ in points}), 1)
    mde = minimal_detectable_effect(half, len(points) - 1) * scale  # n - 1 values give n - 2 degrees of freedom
    adjusted = FAMILIES.adjust(family, comparison, p) if family else p
    call = verdict(adjusted) if seeds >= MIN_SEEDS else "inconclusive"
    if not math.isnan(p):
        call += f"; p {format_p(p)}" + (f", Holm {format_p(adjusted)}" if family else "")
    if not math.isnan(mde):
        call += f"; MDE {mde:.{digits}f}"
    return format_interval(slope * scale, half * scale, digits), call
