"""The run doctor's rules on synthetic series: each fires on a series that shows its cause, names it with its evidence
and remedy, and stays silent on a healthy series; findings are ordered by how much they explain."""

import math

import pytest
from lit_cancel.callbacks.doctor.diagnoses import RULES, Finding, Rule, RunHistory, Series, diagnose, register, rules_named

STEPS = 60


def series(fn, steps: int = STEPS) -> list[tuple[int, float]]:
    return [(step, fn(step)) for step in range(1, steps + 1)]


def healthy(**overrides) -> dict:
    """A run that learns: reward and accuracy rise, groups differ, entropy eases, the parameters move."""
    points = {
        "rollout/reward_mean": series(lambda s: 0.3 + 0.4 * s / STEPS),
        "rollout/accuracy": series(lambda s: 0.3 + 0.4 * s / STEPS),
        "rollout/reward_correct_corr": series(lambda s: 1.0),
        "rollout/frac_zero_std_groups": series(lambda s: 0.2),
        "rollout/frac_truncated": series(lambda s: 0.02),
        "rollout/logprob_mismatch": series(lambda s: 0.01),
        "rollout/staleness_max": series(lambda s: 1.0),
        "health/entropy": series(lambda s: 1.0 - 0.5 * s / STEPS),
        "health/grad_norm": series(lambda s: 1.0 + 0.1 * math.sin(s)),
        "health/update_ratio": series(lambda s: 1e-3),
        "health/learning_tax": series(lambda s: 0.05),
        "health/drift_preference_entropy_ratio": series(lambda s: 0.95),
        "objective/kl_share": series(lambda s: 0.02),  # kl_coef 0.5 on the quickstart
        "lr": series(lambda s: 2e-4),
    }
    points.update(overrides)
    return points


def found(points: dict, **settings) -> list[Finding]:
    return diagnose(RunHistory.from_points(points, settings=settings))


def rules_of(findings: list[Finding]) -> list[str]:
    return [f.rule for f in findings]


def test_a_healthy_run_has_no_finding():
    assert found(healthy(), temperature=1.0, max_new_tokens=40, kl_coef=0.0, max_staleness=2) == []


def test_a_reward_that_ignores_correctness_is_named_first_and_severe():
    findings = found(healthy(**{"rollout/reward_correct_corr": series(lambda s: 0.05)}))
    assert rules_of(findings) == ["reward_ignores_answer"]
    assert findings[0].severity == "severe" and "0.05" in findings[0].evidence and "reward_fn" in findings[0].remedy


@pytest.mark.parametrize(("accuracy", "word"), [(0.95, "too easy"), (0.03, "too hard")])
def test_groups_without_reward_difference_name_the_side(accuracy, word):
    findings = found(healthy(**{
        "rollout/frac_zero_std_groups": series(lambda s: 0.95),
        "rollout/accuracy": series(lambda s: accuracy),
        "rollout/reward_mean": series(lambda s: accuracy + 0.01 * math.sin(s)),
    }))
    assert rules_of(findings)[0] == "no_reward_difference"
    assert word in findings[0].cause and findings[0].severity == "severe"
    assert f"{accuracy:.2f}" in findings[0].evidence


@pytest.mark.parametrize(("accuracy", "cause"), [(0.6, "same reward (0) though 60% are correct"), (0.0, "too hard")])
def test_a_constant_reward_is_told_from_prompts_that_all_fail_by_correctness(accuracy, cause):
    findings = found(healthy(**{
        "rollout/frac_zero_std_groups": series(lambda s: 1.0),
        "rollout/reward_mean": series(lambda s: 0.0),
        "rollout/accuracy": series(lambda s: accuracy),
    }))
    assert findings[0].rule == "no_reward_difference" and cause in findings[0].cause


def test_half_the_groups_without_difference_is_not_a_finding():
    assert found(healthy(**{"rollout/frac_zero_std_groups": series(lambda s: 0.5)})) == []


def test_a_reward_that_rises_then_falls_with_gradient_spikes_is_a_learning_rate_too_high():
    rise_fall = lambda s: 0.2 + 0.5 * s / 20 if s <= 20 else max(0.05, 0.7 - 0.6 * (s - 20) / 20)  # noqa: E731
    points = healthy(**{
        "rollout/reward_mean": series(rise_fall),
        "health/grad_norm": series(lambda s: 1.0 if s < 25 else 40.0),
    })
    findings = found(points)
    assert rules_of(findings)[0] == "learning_rate_too_high"
    assert "fell" in findings[0].evidence and "2e-04" in findings[0].remedy.replace("0.0002", "2e-04")
    # the same fall without gradient-norm spikes is noise the rule does not call
    calm = found(healthy(**{"rollout/reward_mean": series(rise_fall)}))
    assert "learning_rate_too_high" not in rules_of(calm)


def test_truncation_names_the_limit_and_what_truncated_completions_earn():
    points = healthy(**{
        "rollout/frac_truncated": series(lambda s: 0.6),
        "rollout/reward_truncated": series(lambda s: 0.0),
        "rollout/reward_finished": series(lambda s: 0.7),
    })
    (finding,) = found(points, max_new_tokens=16)
    assert finding.rule == "truncation" and finding.severity == "severe"
    assert "0.60" in finding.evidence and "0.00 against 0.70" in finding.evidence
    assert "(now 16) to about 32" in finding.remedy
    assert found(healthy(**{"rollout/frac_truncated": series(lambda s: 0.1)})) == []


def test_a_kl_term_that_carries_most_credit_is_named_with_its_coefficient():
    (finding,) = found(healthy(**{"objective/kl_share": series(lambda s: 0.8)}), kl_coef=2.0)
    assert finding.rule == "kl_dominates" and "(now 2)" in finding.remedy


@pytest.mark.parametrize(("share", "fires"), [(0.11, True), (0.056, True), (0.037, False), (0.022, False)])
def test_a_kl_that_holds_learning_back_is_named_at_a_small_share_of_the_credit(share, fires):
    # the quickstart's shares at kl_coef 5 (0.11, where held-out accuracy gained 0.012 against 0.088 without a KL),
    # 2, 1 and 0.5: a KL keeps under half of the accuracy gained without it from kl_coef 2 on
    findings = found(healthy(**{"objective/kl_share": series(lambda s: share)}), kl_coef=5.0)
    assert rules_of(findings) == (["kl_dominates"] if fires else [])
    if fires:
        assert f"has a median of {share:.3f} over steps 46-60 (threshold 0.045" in findings[0].evidence
        assert findings[0].remedy == "lower model.init_args.objective.init_args.kl_coef (now 5) about 10x, or to 0."


def test_a_single_step_s_kl_share_does_not_make_a_finding():
    # kl_coef 1 on the quickstart (seed 102): a step with little policy credit logged 0.184 among values near 0.037
    spike = found(healthy(**{"objective/kl_share": series(lambda s: 0.184 if s == 58 else 0.037)}))
    assert spike == []


def test_the_kl_remedy_names_trl_s_beta():
    history = RunHistory.from_points(healthy(**{"objective/kl_share": series(lambda s: 0.3)}), settings={"kl_coef": 0.4}, framework="trl")
    assert diagnose(history)[0].remedy == "lower beta (now 0.4) about 10x, or to 0."


def test_a_frozen_policy_is_a_learning_rate_too_low_unless_groups_carry_no_signal():
    frozen = {"health/update_ratio": series(lambda s: 1e-8)}
    (finding,) = found(healthy(**frozen))
    assert finding.rule == "learning_rate_too_low" and "1.0e-08" in finding.evidence
    no_signal = found(healthy(**frozen, **{"rollout/frac_zero_std_groups": series(lambda s: 0.95),
                                           "rollout/accuracy": series(lambda s: 0.97)}))
    assert rules_of(no_signal) == ["no_reward_difference"]


def test_sampler_mismatch_and_staleness_past_their_bounds():
    findings = found(healthy(**{"rollout/logprob_mismatch": series(lambda s: 0.3),
                                "rollout/staleness_max": series(lambda s: 4.0)}), max_staleness=2)
    assert rules_of(findings) == ["sampler_mismatch", "stale_rollouts"]
    assert "bound 2" in findings[1].evidence


@pytest.mark.parametrize(("settings", "cause"), [({"temperature": 0.5}, "temperature 0.5"), ({"temperature": 1.0}, "nearly deterministic")])
def test_entropy_collapse_names_its_cause(settings, cause):
    findings = found(healthy(**{"health/entropy": series(lambda s: 1.0 if s < 10 else 0.02)}), **settings)
    assert rules_of(findings) == ["entropy_collapse"] and cause in findings[0].cause


def test_entropy_collapse_under_a_high_tax_blames_the_tax_and_the_tax_rule_needs_drift():
    points = healthy(**{
        "health/entropy": series(lambda s: 1.0 if s < 10 else 0.02),
        "health/learning_tax": series(lambda s: 0.8),
        "health/drift_preference_entropy_ratio": series(lambda s: 0.3),
    })
    findings = found(points, temperature=1.0)
    assert rules_of(findings) == ["entropy_collapse", "learning_tax_drift"]
    assert "learning tax" in findings[0].cause
    without_drift = found(healthy(**{"health/learning_tax": series(lambda s: 0.8)}))
    assert without_drift == []


def test_findings_are_ordered_severe_first_then_by_rank():
    points = healthy(**{
        "rollout/frac_truncated": series(lambda s: 0.3),  # warning, rank 40
        "health/entropy": series(lambda s: 1.0 if s < 10 else 0.02),  # warning, rank 80
        "rollout/frac_zero_std_groups": series(lambda s: 0.95),  # severe, rank 20
        "rollout/accuracy": series(lambda s: 0.02),
    })
    assert rules_of(found(points)) == ["no_reward_difference", "truncation", "entropy_collapse"]


def test_a_rule_waits_for_enough_points_and_a_history_can_be_cut_at_a_step():
    points = healthy(**{"rollout/frac_truncated": series(lambda s: 0.6 if s > 40 else 0.0)})
    history = RunHistory.from_points(points)
    assert rules_of(diagnose(history)) == ["truncation"]
    assert diagnose(history.upto(40)) == []
    assert diagnose(RunHistory.from_points({"rollout/frac_truncated": series(lambda s: 0.9, steps=5)})) == []


def test_non_finite_points_are_dropped_and_repeated_steps_keep_the_last():
    history = RunHistory.from_points({"x": [(2, 1.0), (1, float("nan")), (2, 3.0), (3, float("inf")), (0, 5.0)]})
    assert history.series["x"] == Series((0, 2), (5.0, 3.0))


def test_rules_are_registered_once_and_unknown_names_are_refused():
    assert len(RULES) >= 10
    with pytest.raises(ValueError, match=r"unknown diagnoses \['lr_too_hgh'\]; known: \["):
        rules_named(["lr_too_hgh"])

    class Impostor(Rule):
        name = "truncation"

    with pytest.raises(ValueError, match="a diagnosis named 'truncation' is registered already"):
        register(Impostor)


def test_a_constant_reward_without_a_correctness_series_claims_no_correctness():
    # a TRL run logs its reward, never whether a completion is correct
    points = {"rollout/reward_mean": series(lambda s: 0.5), "rollout/frac_zero_std_groups": series(lambda s: 1.0)}
    (finding,) = diagnose(RunHistory.from_points(points, framework="trl"))
    assert finding.rule == "no_reward_difference" and "are correct" not in finding.cause
    assert finding.cause.startswith("The mean reward is 0.5 at every step") and "logs no correctness" in finding.cause
    assert "rollout/reward_mean is 0.5 at all 60 steps logged, and no rollout/accuracy is logged" in finding.evidence


@pytest.mark.parametrize(
    ("framework", "key"),
    [("lit_cancel", "model.init_args.max_new_tokens"), ("trl", "max_completion_length"), ("verl", "data.max_response_length")],
)
def test_the_truncation_remedy_names_the_framework_s_own_limit(framework, key):
    points = healthy(**{"rollout/frac_truncated": series(lambda s: 0.6)})
    (finding,) = diagnose(RunHistory.from_points(points, settings={"max_new_tokens": 256}, framework=framework))
    assert finding.remedy == f"raise {key} (now 256) to about 512, or penalise length in the reward."
    assert finding.cause == f"Completions are cut off at {key.split('.')[-1]}."


def test_truncation_evidence_compares_rewards_over_the_same_steps():
    points = healthy(**{
        "rollout/frac_truncated": series(lambda s: 0.5 if s <= 20 else 1.0),
        "rollout/reward_truncated": series(lambda s: 0.0),
        "rollout/reward_finished": series(lambda s: 0.8, steps=20),  # a step logs it only when some completion finished
    })
    (finding,) = found(points)
    assert "over steps 46-60" in finding.evidence
    assert "truncated completions earn 0.00, and no completion finished in those steps" in finding.evidence


def test_the_learning_rate_remedy_is_sized_from_the_update_ratio():
    (finding,) = found(healthy(**{"health/update_ratio": series(lambda s: 2e-9), "lr": series(lambda s: 1e-9)}))
    assert finding.rule == "learning_rate_too_low"
    assert "raise the learning rate about 50,000x (from 1e-09 to about 5e-05)" in finding.remedy  # 1e-4 / 2e-9
    # parameters that do not change at all give no ratio to size from: a float32 parameter moved less than 2**-24
    (frozen,) = found(healthy(**{"health/update_ratio": series(lambda s: 0.0), "lr": series(lambda s: 1e-9)}))
    assert "did not change at all" in frozen.cause
    assert "raise the learning rate (now 1e-09) at least 2,000x" in frozen.remedy  # 1e-4 * 2**24 = 1,678


def test_a_gradient_spike_is_measured_against_the_early_steps_that_had_a_gradient():
    rise_fall = lambda s: 0.2 + 0.5 * s / 20 if s <= 20 else max(0.05, 0.7 - 0.6 * (s - 20) / 20)  # noqa: E731
    without_gradient_at_first = {"rollout/reward_mean": series(rise_fall), "health/grad_norm": series(lambda s: 0.0 if s <= 15 else 0.35)}
    assert "learning_rate_too_high" not in rules_of(found(healthy(**without_gradient_at_first)))
    # the first quarter (steps 1-15): 8 steps without a gradient, 7 with norm 1
    spiking = {"rollout/reward_mean": series(rise_fall),
               "health/grad_norm": series(lambda s: (float(s % 2 == 0) if s <= 15 else 40.0 if s > 25 else 1.0))}
    finding = found(healthy(**spiking))[0]
    assert finding.rule == "learning_rate_too_high" and "peaked at 40x the median of its nonzero values" in finding.evidence
