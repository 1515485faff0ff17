"""The statistics of the experiments, in pure Python (``math``, ``random``, ``statistics``; no numpy, scipy or torch).

Every test is over seeds, paired where two arms share a seed:

* :func:`mean_interval`, :func:`paired_difference`: the t-interval of a mean, of a paired difference;
* :func:`t_test`, :func:`paired_t_test`: the two-sided one-sample / paired t-test's p-value;
* :func:`holm`: Holm's step-down adjusted p-values over a family of tests;
* :func:`tost`: the paired equivalence test (two one-sided t-tests with a margin); :func:`leave_one_out_tost`, its p
  with each value left out in turn;
* :func:`minimal_detectable_effect`: the smallest true difference a test finds with 80% power;
* :func:`slope_interval`: a least-squares slope with its t-interval and p-value;
* :func:`fieller_interval`, :func:`bootstrap_ratio_interval`: intervals for a ratio of paired means;
* :func:`verdict`: the report's one rule from a test's p, and an equivalence test's where a margin was stated.

tests/study/test_experiments_stats.py compares each of them with scipy.stats on fixed inputs.
"""

import math
import random
import statistics


# ----------------------------------------------------------------------------------------------- Student's t
def _beta_fraction(a: float, b: float, x: float) -> float:
    """The continued fraction of the incomplete beta function (modified Lentz)."""
    tiny = 1e-300
    c, d = 1.0, 1.0 - (a + b) * x / (a + 1)
    d = 1.0 / (d if abs(d) > tiny else tiny)
    fraction = d
    for m in range(1, 500):
        for numerator in (m * (b - m) * x / ((a + 2 * m - 1) * (a + 2 * m)),
                          -(a + m) * (a + b + m) * x / ((a + 2 * m) * (a + 2 * m + 1))):
            d = 1.0 + numerator * d
            d = 1.0 / (d if abs(d) > tiny else tiny)
            c = 1.0 + numerator / c
            c = c if abs(c) > tiny else tiny
            fraction *= d * c
        if abs(d * c - 1.0) < 1e-15:
            break
    return fraction


def regularized_beta(x: float, a: float, b: float) -> float:
    """The regularized incomplete beta function ``I_x(a, b)``."""
    if x <= 0:
        return 0.0
    if x >= 1:
        return 1.0
    front = math.exp(math.lgamma(a + b) - math.lgamma(a) - math.lgamma(b) + a * math.log(x) + b * math.log1p(-x))
    if x < (a + 1) / (a + b + 2):
        return front * _beta_fraction(a, b, x) / a
    return 1.0 - front * _beta_fraction(b, a, 1.0 - x) / b


def t_sf(x: float, df: float) -> float:
    """``P(T > x)`` for Student's t with ``df`` degrees of freedom, accurate in the far tail."""
    if math.isnan(x):
        return math.nan
    if x < 0:
        return 1.0 - t_sf(-x, df)
    if math.isinf(x):
        return 0.0
    return 0.5 * regularized_beta(df / (df + x * x), df / 2, 0.5)


def t_cdf(x: float, df: float) -> float:
    """Student's t distribution function ``P(T <= x)`` (by the incomplete beta function)."""
    return t_sf(-x, df)


def t_quantile(probability: float, df: float) -> float:
    """The ``probability`` quantile of Student's t with ``df`` degrees of freedom (bisection on :func:`t_cdf`)."""
    if not 0.5 <= probability < 1 or df < 1:
        raise ValueError(f"t_quantile needs 0.5 <= probability < 1 and df >= 1, got {probability} and {df}")
    low, high = 0.0, 1.0
    while t_cdf(high, df) < probability:
        high *= 2
    for _ in range(100):
        middle = (low + high) / 2
        low, high = (middle, high) if t_cdf(middle, df) < probability else (low, middle)
    return (low + high) / 2


# ----------------------------------------------------------------------------------------------- means and tests
def mean_interval(values: list[float], confidence: float = 0.95) -> tuple[float, float]:
    """``(mean, half_width)`` of the t-interval for the mean; the half-width is nan below two values."""
    if not values:
        return math.nan, math.nan
    mean = statistics.fmean(values)
    if len(values) < 2:
        return mean, math.nan
    quantile = t_quantile(0.5 + confidence / 2, len(values) - 1)
    return mean, quantile * statistics.stdev(values) / math.sqrt(len(values))


def sign_test(successes: int, n: int) -> float:
    """The exact two-sided p of ``successes`` of ``n`` signs under a fair coin: twice the smaller tail, at most 1."""
    if n == 0:
        return math.nan
    tail = sum(math.comb(n, k) for k in range(min(successes, n - successes) + 1)) / 2**n
    return min(1.0, 2 * tail)


def paired_values(a: dict[int, float], b: dict[int, float]) -> list[float]:
    """``a[seed] - b[seed]`` over the seeds both have, in seed order."""
    return [a[s] - b[s] for s in sorted(set(a) & set(b))]


def paired_difference(a: dict[int, float], b: dict[int, float], confidence: float = 0.95) -> tuple[float, float, int]:
    """``(mean, half_width, pairs)`` of ``a[seed] - b[seed]`` over the seeds both have."""
    differences = paired_values(a, b)
    mean, half = mean_interval(differences, confidence)
    return mean, half, len(differences)


def t_test(values: list[float], mu: float = 0.0, alternative: str = "two-sided") -> tuple[float, float]:
    """``(t, p)`` of the one-sample t-test of ``mean(values) = mu`` (``alternative``: two-sided, greater, less).

    nan below two values; a sample with no spread gives ``t = ±inf`` (p 0) or nan (its mean is ``mu``).
    """
    n = len(values)
    if n < 2:
        return math.nan, math.nan
    mean, sd = statistics.fmean(values), statistics.stdev(values)
    if sd == 0:
        t = math.nan if mean == mu else math.copysign(math.inf, mean - mu)
    else:
        t = (mean - mu) / (sd / math.sqrt(n))
    if math.isnan(t):
        return t, math.nan
    if alternative == "two-sided":
        return t, min(1.0, 2 * t_sf(abs(t), n - 1))
    if alternative == "greater":
        return t, t_sf(t, n - 1)
    if alternative == "less":
        return t, t_sf(-t, n - 1)
    raise ValueError(f"alternative must be two-sided, greater or less, got {alternative!r}")


def paired_t_test(a: dict[int, float], b: dict[int, float]) -> tuple[float, float, int]:
    """``(t, p, pairs)`` of the two-sided paired t-test of ``a - b`` over the seeds both have (scipy's ``ttest_rel``)."""
    differences = paired_values(a, b)
    t, p = t_test(differences)
    return t, p, len(differences)


def holm(p_values: list[float]) -> list[float]:
    """Holm's step-down adjusted p-values, in the input's order; nan entries are not counted in the family.

    Sorted ascending, ``p_(k)`` becomes ``max_{j <= k} min(1, (m - j + 1) p_(j))``: rejecting where the adjusted
    value is below alpha keeps the chance of any false effect in the family at most alpha.
    """
    order = sorted((p, index) for index, p in enumerate(p_values) if not math.isnan(p))
    adjusted = [math.nan] * len(p_values)
    running, family = 0.0, len(order)
    for rank, (p, index) in enumerate(order):
        running = max(running, min(1.0, (family - rank) * p))
        adjusted[index] = running
    return adjusted


def tost(values: list[float], margin: float) -> tuple[float, float, float]:
    """``(p, p_lower, p_upper)`` of the equivalence test that the mean of ``values`` is inside ``(-margin, margin)``.

    Two one-sided t-tests: ``p_lower`` of ``mean > -margin`` and ``p_upper`` of ``mean < margin``; equivalence is
    shown at level alpha when ``p = max(p_lower, p_upper) < alpha`` (the same as the ``1 - 2 alpha`` interval
    lying inside the margin).
    """
    if not margin > 0:
        raise ValueError(f"tost: margin must be > 0, got {margin}")
    _, lower = t_test(values, -margin, "greater")
    _, upper = t_test(values, margin, "less")
    return max(lower, upper), lower, upper


def leave_one_out_tost(values: list[float], margin: float) -> list[float]:
    """The :func:`tost` p of ``values`` with each one left out in turn, in their order: how much an equivalence verdict
    rests on single seeds."""
    return [tost(values[:index] + values[index + 1 :], margin)[0] for index in range(len(values))]


def minimal_detectable_effect(half: float, n: int, confidence: float = 0.95, power: float = 0.8, df: float | None = None) -> float:
    """The smallest true mean difference a two-sided t-test on ``n`` values detects with probability ``power``,
    from the half-width of its interval: ``(t_{1-alpha/2} + t_{power}) * se`` with ``n - 1`` degrees of freedom
    (``df`` where given: Welch's, from :func:`welch_test`)."""
    if n < 2 or math.isnan(half):
        return math.nan
    df = n - 1 if df is None else df
    critical = t_quantile(0.5 + confidence / 2, df)
    return (critical + t_quantile(power, df)) * half / critical


def welch_test(a: list[float], b: list[float], confidence: float = 0.95) -> tuple[float, float, float, float]:
    """``(difference, half_width, p, df)`` of Welch's two-sided t-test of ``mean(a) - mean(b)`` (unpaired, unequal
    variances; scipy's ``ttest_ind(equal_var=False)``), the interval with Welch–Satterthwaite degrees of freedom.
    nan below two values in either sample or when neither has spread."""
    if len(a) < 2 or len(b) < 2:
        return math.nan, math.nan, math.nan, math.nan
    va, vb = statistics.variance(a) / len(a), statistics.variance(b) / len(b)
    difference = statistics.fmean(a) - statistics.fmean(b)
    if va + vb == 0:
        return difference, math.nan, math.nan, math.nan
    se = math.sqrt(va + vb)
    df = (va + vb) ** 2 / (va**2 / (len(a) - 1) + vb**2 / (len(b) - 1))
    p = min(1.0, 2 * t_sf(abs(difference) / se, df))
    return difference, t_quantile(0.5 + confidence / 2, df) * se, p, df


def slope_interval(x: list[float], y: list[float], confidence: float = 0.95) -> tuple[float, float]:
    """``(slope, half_width)`` of the least-squares line of ``y`` on ``x``, t-interval with ``n - 2`` degrees of freedom."""
    slope, half, _ = slope_test(x, y, confidence)
    return slope, half


def slope_test(x: list[float], y: list[float], confidence: float = 0.95) -> tuple[float, float, float]:
    """``(slope, half_width, p)``: the least-squares slope, its t-interval and the two-sided p of ``slope = 0``
    (``n - 2`` degrees of freedom, scipy's ``linregress``)."""
    n = len(x)
    if n < 3 or len(set(x)) < 2:
        return math.nan, math.nan, math.nan
    x_mean, y_mean = statistics.fmean(x), statistics.fmean(y)
    sxx = sum((a - x_mean) ** 2 for a in x)
    slope = sum((a - x_mean) * (b - y_mean) for a, b in zip(x, y)) / sxx
    residual = sum((b - y_mean - slope * (a - x_mean)) ** 2 for a, b in zip(x, y)) / (n - 2)
    se = math.sqrt(residual / sxx)
    p = (0.0 if slope else math.nan) if se == 0 else min(1.0, 2 * t_sf(abs(slope) / se, n - 2))
    return slope, t_quantile(0.5 + confidence / 2, n - 2) * se, p


# ----------------------------------------------------------------------------------------------- ratios
def fieller_interval(a: list[float], b: list[float], confidence: float = 0.95) -> tuple[float, float, float]:
    """``(ratio, low, high)``: ``mean(a) / mean(b)`` of paired values and Fieller's interval for it.

    The interval is every ``r`` for which the paired t-test of ``a - r b`` does not reject at ``1 - confidence``
    (``n - 1`` degrees of freedom, the covariance of the pairs included). When ``mean(b)`` is not itself
    distinguishable from 0 the set is unbounded: ``(ratio, -inf, inf)`` (or the two outer rays; reported as
    unbounded too).
    """
    n = len(a)
    if n != len(b) or n < 2:
        raise ValueError(f"fieller_interval needs two paired lists of >= 2 values, got {len(a)} and {len(b)}")
    ma, mb = statistics.fmean(a), statistics.fmean(b)
    vaa = statistics.variance(a) / n
    vbb = statistics.variance(b) / n
    vab = sum((x - ma) * (y - mb) for x, y in zip(a, b)) / (n - 1) / n
    t2 = t_quantile(0.5 + confidence / 2, n - 1) ** 2
    ratio = ma / mb if mb else math.nan
    # (ma - r mb)^2 <= t2 (vaa - 2 r vab + r^2 vbb)  <=>  A r^2 - 2 B r + C <= 0
    quad_a, quad_b, quad_c = mb * mb - t2 * vbb, ma * mb - t2 * vab, ma * ma - t2 * vaa
    discriminant = quad_b * quad_b - quad_a * quad_c
    if quad_a <= 0 or discriminant < 0:
        return ratio, -math.inf, math.inf
    root = math.sqrt(discriminant)
    return ratio, (quad_b - root) / quad_a, (quad_b + root) / quad_a


def percentile(values: list[float], q: float) -> float:
    """The ``q`` quantile (0..1) of ``values`` with linear interpolation between order statistics (numpy's default)."""
    ordered = sorted(values)
    position = q * (len(ordered) - 1)
    low = math.floor(position)
    high = min(low + 1, len(ordered) - 1)
    return ordered[low] + (ordered[high] - ordered[low]) * (position - low)


BOOTSTRAP_RESAMPLES = 10_000
BOOTSTRAP_SEED = 0


def bootstrap_ratio_interval(
    a: list[float], b: list[float], confidence: float = 0.95, resamples: int = BOOTSTRAP_RESAMPLES, seed: int = BOOTSTRAP_SEED
) -> tuple[float, float, float]:
    """``(ratio, low, high)``: ``mean(a) / mean(b)`` of paired values and its percentile bootstrap interval.

    Each resample draws ``n`` pairs with replacement (``random.Random(seed)``, so the interval is reproducible),
    keeping each seed's ``a`` and ``b`` together; resamples whose ``b`` mean is 0 are dropped. With few pairs
    (5 seeds give 126 distinct resamples) the percentile interval is too narrow: prefer :func:`fieller_interval`.
    """
    n = len(a)
    if n != len(b) or n < 2:
        raise ValueError(f"bootstrap_ratio_interval needs two paired lists of >= 2 values, got {len(a)} and {len(b)}")
    generator = random.Random(seed)
    ratios = []
    for _ in range(resamples):
        picks = [generator.randrange(n) for _ in range(n)]
        denominator = sum(b[i] for i in picks)
        if denominator:
            ratios.append(sum(a[i] for i in picks) / denominator)
    tail = (1 - confidence) / 2
    ratio = statistics.fmean(a) / statistics.fmean(b) if statistics.fmean(b) else math.nan
    return ratio, percentile(ratios, tail), percentile(ratios, 1 - tail)


# ----------------------------------------------------------------------------------------------- verdicts
ALPHA = 0.05


def equivalent(margin: float) -> str:
    """The verdict where equivalence is shown: "no difference larger than ``margin``"."""
    return f"no difference larger than {margin:.2f}"


def verdict(p: float, p_equivalence: float = math.nan, margin: float | None = None) -> str:
    """The report's one rule. "effect" where the test rejects at 0.05 (``p``: Holm-adjusted where a family applies);
    otherwise "no difference larger than ``margin``" only where a margin was stated before the test and the equivalence
    test rejects at 0.05 (``p_equivalence``: TOST, adjusted where its family is); otherwise "inconclusive". A comparison
    without a stated margin is never called a null. "n/a" without a test."""
    if math.isnan(p):
        return "n/a"
    if p < ALPHA:
        return "effect"
    if margin is not None and p_equivalence < ALPHA:
        return equivalent(margin)
    return "inconclusive"
