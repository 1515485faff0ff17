"""The statistics of benchmarks/experiments.py against hand-computed values."""

import importlib.util
import math
import sys
from pathlib import Path

import pytest
import torch

BENCHMARKS = Path(__file__).resolve().parent.parent / "benchmarks"
sys.path.insert(0, str(BENCHMARKS))
spec = importlib.util.spec_from_file_location("experiments", BENCHMARKS / "experiments.py")
experiments = importlib.util.module_from_spec(spec)
spec.loader.exec_module(experiments)


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


def test_verdict_calls_an_effect_only_when_the_interval_excludes_zero():
    assert experiments.verdict(1.0, 0.5) == "effect" and experiments.verdict(-1.0, 0.5) == "effect"
    assert experiments.verdict(0.3, 0.5) == "null" and experiments.verdict(0.3, math.nan) == "n/a"


def test_minimal_detectable_effect_by_hand():
    # n = 10: t(0.975, 9) = 2.262157, t(0.8, 9) = 0.883404; a half-width of 2.262157 is one standard error
    assert experiments.minimal_detectable_effect(2.262157, 10) == pytest.approx(2.262157 + 0.883404, abs=1e-4)
    assert math.isnan(experiments.minimal_detectable_effect(0.1, 1))


def test_a_null_with_a_large_minimal_detectable_effect_is_inconclusive():
    assert experiments.verdict(0.01, 0.05, mde=0.07, relevant=0.05) == "inconclusive"
    assert experiments.verdict(0.01, 0.03, mde=0.04, relevant=0.05) == "null"
    assert experiments.verdict(0.1, 0.05, mde=0.07, relevant=0.05) == "effect"
    assert experiments.verdict(0.01, 0.05, mde=0.07) == "null"


def test_steps_to_threshold_reads_the_moving_mean():
    runs = importlib.import_module("experiments_runs")
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
    runs = importlib.import_module("experiments_runs")
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
