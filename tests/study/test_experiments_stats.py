"""The statistics of the experiments (benchmarks/study/lab/stats.py) against scipy.stats and hand-computed values."""

import math
import random

import numpy as np
import pytest
import torch
from lab import stats as experiments
from lab import summaries
from scipy import stats as scipy_stats


@pytest.mark.parametrize("df, quantile", [(1, 12.706205), (2, 4.302653), (4, 2.776445), (9, 2.262157), (30, 2.042272)])
def test_t_quantile_matches_the_table(df, quantile):
    assert experiments.t_quantile(0.975, df) == pytest.approx(quantile, abs=2e-5)


def test_mean_interval_is_the_t_interval():
    mean, half = experiments.mean_interval([1, 2, 3, 4, 5])
    # sd = sqrt(2.5), se = sd / sqrt(5) = 0.7071068, t(0.975, 4) = 2.776445
    assert mean == 3 and half == pytest.approx(2.776445 * 0.7071068, abs=1e-5)
    assert math.isnan(experiments.mean_interval([0.4])[1])


def test_paired_difference_uses_the_seeds_both_arms_have():
    mean, half, pairs = experiments.paired_difference({0: 1, 1: 3, 2: 2}, {0: 0, 1: 1, 2: 1, 3: 9})
    # differences 1, 2, 1: mean 4/3, sd sqrt(1/3), se 1/3, t(0.975, 2) = 4.302653
    assert pairs == 3 and mean == pytest.approx(4 / 3) and half == pytest.approx(4.302653 / 3, abs=1e-5)


def test_slope_interval_is_the_least_squares_slope_with_its_t_interval():
    slope, half = experiments.slope_interval([0, 1, 2, 3], [1, 3, 2, 5])
    # sxx = 5, sxy = 5.5, residual sum of squares 2.7 over 2 df: se = sqrt(1.35 / 5)
    assert slope == pytest.approx(1.1) and half == pytest.approx(4.302653 * math.sqrt(0.27), abs=1e-5)


def test_verdict_calls_an_effect_only_where_the_test_rejects():
    assert experiments.verdict(0.049) == "effect" and experiments.verdict(0.0) == "effect"
    assert experiments.verdict(0.05) == "inconclusive" and experiments.verdict(math.nan) == "n/a"


def test_minimal_detectable_effect_by_hand():
    # n = 10: t(0.975, 9) = 2.262157, t(0.8, 9) = 0.883404; a half-width of 2.262157 is one standard error
    assert experiments.minimal_detectable_effect(2.262157, 10) == pytest.approx(2.262157 + 0.883404, abs=1e-4)
    assert math.isnan(experiments.minimal_detectable_effect(0.1, 1))


def test_no_difference_is_called_only_where_a_stated_margin_is_shown_by_tost():
    assert experiments.verdict(0.6, 0.01, 0.04) == "no difference larger than 0.04"
    assert experiments.verdict(0.6, 0.17, 0.04) == "inconclusive"  # E9's reward-balanced − shuffled: TOST fails
    assert experiments.verdict(0.6, 0.01) == "inconclusive"  # no margin was stated: never a null, whatever the TOST
    assert experiments.verdict(0.01, 0.01, 0.10) == "effect"  # the test rejects: an effect, even inside the margin


def test_steps_to_threshold_reads_the_moving_mean():
    runs = summaries
    accuracy = [0.5] * 10 + [0.7] * 10
    # the 10-step mean reaches 0.5 + 0.10 once 5 of its values are 0.7: at the 15th value, step index 14
    assert runs.steps_to_threshold(list(range(20)), accuracy) == 15
    assert runs.steps_to_threshold(list(range(20)), [0.5] * 20) is None


def test_coupling_probe_pairs_fall_in_the_classes_written_out_by_hand():
    from coupling_probe import eligible_pairs

    # four tokens: rows 0, 0, 1, 2; ids 7, 7, 7, 5; confidences 0.2, 0.9, 0.3, 0.1
    tokens, rows = torch.tensor([7, 7, 7, 5]), torch.tensor([0, 0, 1, 2])
    pairs = eligible_pairs(tokens, rows, torch.tensor([0.2, 0.9, 0.3, 0.1]))
    as_sets = {name: {tuple(pair) for pair in found.tolist()} for name, found in pairs.items()}
    # (0, 1) is excluded everywhere: one rollout
    assert as_sets["identical_low"] == {(0, 2), (2, 0)}
    assert as_sets["identical_high"] == set()
    assert as_sets["different_low"] == {(0, 3), (3, 0), (2, 3), (3, 2)}


def test_flip_changes_compared_at_equal_confidence_by_hand():
    runs = summaries
    bins = runs.CONFIDENCE_BINS
    run = {}
    for split, counts, changes in (("shared", [0, 0, 10, 30], [math.nan, math.nan, 0.004, 0.0002]),
                                   ("specific", [5, 20, 40, 35], [0.3, 0.1, 0.006, 0.0003])):
        for confidence, count, change in zip(bins, counts, changes):
            run[f"tokens_{split}_{confidence}"], run[f"mean_abs_change_{split}_{confidence}"] = count, change
    # shared tokens sit in the two top bins: (10 * (0.004 - 0.006) + 30 * (0.0002 - 0.0003)) / 40
    assert runs.confidence_adjusted(run, "shared", "specific") == pytest.approx((10 * -0.002 + 30 * -0.0001) / 40)
    # over all bins: (5 * 0.3 + 20 * 0.1 + 40 * 0.006 + 35 * 0.0003) / 100
    assert runs.pooled(run, "specific") == pytest.approx((1.5 + 2.0 + 0.24 + 0.0105) / 100)


# ----------------------------------------------------------------------------------------------- against scipy.stats
SAMPLE = [0.12, -0.03, 0.08, 0.21, 0.05, -0.01, 0.14, 0.09, 0.02, 0.11]
OTHER = [0.10, 0.01, 0.02, 0.15, 0.07, -0.06, 0.05, 0.12, -0.02, 0.04]


@pytest.mark.parametrize("df", [1, 2, 4, 9, 44])
@pytest.mark.parametrize("x", [-7.5, -1.2, 0.0, 0.4, 2.0, 5.0, 40.0, 1000.0])
def test_t_distribution_matches_scipy(df, x):
    assert experiments.t_cdf(x, df) == pytest.approx(scipy_stats.t.cdf(x, df), abs=1e-12)
    # the upper tail keeps its relative precision far out (p-values of very large t)
    assert experiments.t_sf(abs(x), df) == pytest.approx(scipy_stats.t.sf(abs(x), df), rel=1e-9, abs=1e-300)


@pytest.mark.parametrize("df", [1, 2, 4, 9, 44])
@pytest.mark.parametrize("probability", [0.5, 0.8, 0.9, 0.975, 0.995])
def test_t_quantile_matches_scipy(df, probability):
    assert experiments.t_quantile(probability, df) == pytest.approx(scipy_stats.t.ppf(probability, df), abs=1e-9)


def test_mean_interval_matches_scipy():
    mean, half = experiments.mean_interval(SAMPLE)
    low, high = scipy_stats.t.interval(0.95, len(SAMPLE) - 1, loc=np.mean(SAMPLE), scale=scipy_stats.sem(SAMPLE))
    assert mean - half == pytest.approx(low, abs=1e-12) and mean + half == pytest.approx(high, abs=1e-12)


def test_paired_t_test_is_scipys_ttest_rel():
    a, b = dict(enumerate(SAMPLE)), {**dict(enumerate(OTHER)), 99: 5.0}  # seed 99 has no pair
    t, p, pairs = experiments.paired_t_test(a, b)
    expected = scipy_stats.ttest_rel(SAMPLE, OTHER)
    assert pairs == 10 and t == pytest.approx(expected.statistic, rel=1e-12) and p == pytest.approx(expected.pvalue, rel=1e-9)


@pytest.mark.parametrize("alternative", ["two-sided", "greater", "less"])
def test_t_test_is_scipys_ttest_1samp(alternative):
    t, p = experiments.t_test(SAMPLE, 0.03, alternative)
    expected = scipy_stats.ttest_1samp(SAMPLE, 0.03, alternative=alternative)
    assert t == pytest.approx(expected.statistic, rel=1e-12) and p == pytest.approx(expected.pvalue, rel=1e-9)


def test_t_test_without_spread_or_pairs():
    assert experiments.t_test([1.0, 1.0, 1.0]) == (math.inf, 0.0)
    assert all(math.isnan(v) for v in experiments.t_test([0.0, 0.0]))
    assert all(math.isnan(v) for v in experiments.t_test([0.3]))


def test_holm_by_hand():
    # p sorted: 0.01 (x4 = 0.04), 0.02 (x3 = 0.06), 0.03 (x2 = 0.06, the running max), 0.5 (x1); the nan is no test
    p = [0.03, 0.5, 0.01, math.nan, 0.02]
    adjusted = experiments.holm(p)
    assert adjusted[:3] == pytest.approx([0.06, 0.5, 0.04]) and math.isnan(adjusted[3]) and adjusted[4] == pytest.approx(0.06)
    # the issue's worked example: E9's smallest p of a family of five, 0.0437, becomes 5 x 0.0437
    assert experiments.holm([0.0437, 0.84, 0.38, 0.071, 0.129])[0] == pytest.approx(0.2185)
    # the largest p keeps its own value unless a smaller one's adjusted value is above it; nothing exceeds 1
    assert experiments.holm([0.9, 0.01]) == pytest.approx([0.9, 0.02]) and experiments.holm([0.6, 0.7, 0.8]) == [1.0, 1.0, 1.0]


def test_holm_agrees_with_its_definition_on_random_families():
    generator = random.Random(3)
    for _ in range(50):
        p = [generator.random() ** 3 for _ in range(generator.randrange(1, 9))]
        m, order = len(p), sorted(range(len(p)), key=p.__getitem__)
        by_hand = {}
        for rank, index in enumerate(order):
            by_hand[index] = min(1.0, max((m - j) * p[order[j]] for j in range(rank + 1)))
        assert experiments.holm(p) == pytest.approx([by_hand[i] for i in range(m)])


@pytest.mark.parametrize("margin", [0.02, 0.05, 0.2])
def test_tost_is_two_one_sided_scipy_tests(margin):
    differences = [a - b for a, b in zip(SAMPLE, OTHER)]
    p, lower, upper = experiments.tost(differences, margin)
    expected_lower = scipy_stats.ttest_1samp(differences, -margin, alternative="greater").pvalue
    expected_upper = scipy_stats.ttest_1samp(differences, margin, alternative="less").pvalue
    assert lower == pytest.approx(expected_lower, rel=1e-9) and upper == pytest.approx(expected_upper, rel=1e-9)
    assert p == max(lower, upper)


def test_tost_rejects_exactly_when_the_90_percent_interval_is_inside_the_margin():
    differences = [a - b for a, b in zip(SAMPLE, OTHER)]
    mean, half = experiments.mean_interval(differences, confidence=0.90)
    for margin in (0.01, 0.03, 0.05, 0.08, 0.12):
        assert (experiments.tost(differences, margin)[0] < 0.05) == (abs(mean) + half < margin)


def test_leave_one_out_tost_is_scipys_tost_without_each_value_in_turn():
    differences = [a - b for a, b in zip(SAMPLE, OTHER)]
    expected = [max(scipy_stats.ttest_1samp(rest, -0.05, alternative="greater").pvalue,
                    scipy_stats.ttest_1samp(rest, 0.05, alternative="less").pvalue)
                for rest in (np.delete(differences, index) for index in range(len(differences)))]
    assert experiments.leave_one_out_tost(differences, 0.05) == pytest.approx(expected, rel=1e-9)


def test_slope_test_is_scipys_linregress():
    x, y = [0, 0, 1, 1, 2, 2, 3, 3], [1.0, 1.4, 3.0, 2.2, 2.0, 2.9, 5.0, 4.1]
    slope, half, p = experiments.slope_test(x, y)
    expected = scipy_stats.linregress(x, y)
    assert slope == pytest.approx(expected.slope) and p == pytest.approx(expected.pvalue, rel=1e-9)
    assert half == pytest.approx(scipy_stats.t.ppf(0.975, len(x) - 2) * expected.stderr, rel=1e-9)


def test_minimal_detectable_effect_matches_scipys_quantiles():
    half, n = 0.045, 10
    se = half / scipy_stats.t.ppf(0.975, n - 1)
    expected = (scipy_stats.t.ppf(0.975, n - 1) + scipy_stats.t.ppf(0.8, n - 1)) * se
    assert experiments.minimal_detectable_effect(half, n) == pytest.approx(expected, rel=1e-9)


def test_welch_test_is_scipys_unequal_variance_ttest_ind():
    rng = random.Random(3)
    a = [rng.gauss(0.010, 0.004) for _ in range(10)]
    b = [rng.gauss(0.006, 0.001) for _ in range(9)]
    difference, half, p, df = experiments.welch_test(a, b)
    expected = scipy_stats.ttest_ind(a, b, equal_var=False)
    interval = expected.confidence_interval(0.95)
    assert p == pytest.approx(expected.pvalue, rel=1e-6) and df == pytest.approx(expected.df, rel=1e-9)
    assert difference == pytest.approx(np.mean(a) - np.mean(b)) and half == pytest.approx((interval.high - interval.low) / 2, rel=1e-6)
    se = half / scipy_stats.t.ppf(0.975, df)
    mde = experiments.minimal_detectable_effect(half, 10, df=df)
    assert mde == pytest.approx((scipy_stats.t.ppf(0.975, df) + scipy_stats.t.ppf(0.8, df)) * se, rel=1e-6)


def test_welch_test_by_hand_and_without_spread():
    # a: mean 2, variance 1 / 3 = 1/3; b: mean 0, variance 1 / 3 = 1/3; se = sqrt(2/3), df = (2/3)^2 / (2 (1/3)^2 / 2) = 4
    difference, half, p, df = experiments.welch_test([1, 2, 3], [-1, 0, 1])
    assert (difference, df) == (pytest.approx(2.0), pytest.approx(4.0))
    assert half == pytest.approx(2.776445 * math.sqrt(2 / 3), abs=1e-5)
    assert math.isnan(experiments.welch_test([1, 1], [2, 2])[2]) and math.isnan(experiments.welch_test([1], [2, 3])[0])


RAW = [-0.0231, -0.0262, -0.0195, -0.0208, -0.0234]  # numerator: five seeds' paired differences
ADJUSTED = [-0.0041, -0.0018, -0.0035, -0.0012, -0.0044]  # denominator, the same five seeds


def test_fieller_endpoints_are_where_the_paired_t_test_of_a_minus_r_b_stops_rejecting():
    ratio, low, high = experiments.fieller_interval(RAW, ADJUSTED)
    assert ratio == pytest.approx(np.mean(RAW) / np.mean(ADJUSTED)) and low < ratio < high
    for end in (low, high):
        assert scipy_stats.ttest_1samp(np.array(RAW) - end * np.array(ADJUSTED), 0).pvalue == pytest.approx(0.05, abs=1e-9)
    inside = (low + high) / 2
    assert scipy_stats.ttest_1samp(np.array(RAW) - inside * np.array(ADJUSTED), 0).pvalue > 0.05


def test_fieller_is_unbounded_when_the_denominator_is_not_distinguishable_from_zero():
    _, low, high = experiments.fieller_interval(RAW, [0.002, -0.003, 0.001, -0.001, 0.0015])
    assert (low, high) == (-math.inf, math.inf)


def test_bootstrap_ratio_interval_equals_a_numpy_percentile_of_the_same_resamples():
    ratio, low, high = experiments.bootstrap_ratio_interval(RAW, ADJUSTED, resamples=2000, seed=7)
    generator, a, b = random.Random(7), np.array(RAW), np.array(ADJUSTED)
    picks = np.array([[generator.randrange(5) for _ in range(5)] for _ in range(2000)])
    ratios = a[picks].sum(1) / b[picks].sum(1)
    assert (low, high) == pytest.approx(tuple(np.percentile(ratios, [2.5, 97.5])), rel=1e-12)
    assert ratio == pytest.approx(a.mean() / b.mean())
    # reproducible: the same seed gives the same interval
    assert experiments.bootstrap_ratio_interval(RAW, ADJUSTED, resamples=2000, seed=7) == (ratio, low, high)


def test_bootstrap_ratio_interval_agrees_with_scipys_percentile_bootstrap():
    generator = np.random.default_rng(0)
    a = generator.normal(3.0, 0.5, 40)
    b = a / 3 + generator.normal(1.0, 0.2, 40)
    _, low, high = experiments.bootstrap_ratio_interval(list(a), list(b), resamples=4000)
    expected = scipy_stats.bootstrap((a, b), lambda x, y, axis=-1: x.mean(axis) / y.mean(axis), paired=True, vectorized=True,
                                     method="percentile", n_resamples=4000, random_state=0).confidence_interval
    width = expected.high - expected.low
    assert low == pytest.approx(expected.low, abs=0.1 * width) and high == pytest.approx(expected.high, abs=0.1 * width)


def test_bootstrap_ratio_interval_covers_the_true_ratio_about_95_percent_of_the_time():
    generator, covered, trials = np.random.default_rng(1), 0, 200
    for _ in range(trials):
        a, b = generator.normal(2.0, 0.4, 30), generator.normal(1.0, 0.2, 30)  # true ratio of means 2
        _, low, high = experiments.bootstrap_ratio_interval(list(a), list(b), resamples=400)
        covered += low <= 2.0 <= high
    assert 0.88 <= covered / trials <= 0.99


def test_a_cell_follows_the_adjusted_p_and_states_its_mde_and_tost():
    from lab import cells

    # E9's reward-balanced − shuffled with its Holm p: the interval excludes 0, the test does not reject, TOST fails
    text = cells.described(-0.028, 0.0268, 10, p=0.2185, margin=0.04, p_equivalence=0.17)
    assert text == "-0.028 ± 0.027 (inconclusive; p 0.22; TOST ±0.04 p 0.17; MDE 0.037; n=10)"
    assert cells.described(-0.028, 0.0268, 10, p=0.01) == "-0.028 ± 0.027 (effect; p 0.01; MDE 0.037; n=10)"
    assert cells.described(0.1, 0.5, 3, p=0.001) == "0.100 ± 0.500 (inconclusive; p 0.001; MDE 0.623; n=3)"  # below 5 pairs


@pytest.mark.parametrize(("successes", "n"), [(19, 30), (11, 30), (15, 30), (0, 10), (10, 10), (3, 7), (17, 34)])
def test_the_sign_test_is_scipys_exact_binomial_test(successes, n):
    assert experiments.sign_test(successes, n) == pytest.approx(scipy_stats.binomtest(successes, n).pvalue, rel=1e-12)
