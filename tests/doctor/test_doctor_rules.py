"""The run doctor's rules on synthetic series: each fires on a series that shows its cause, names it with its evidence
and remedy, and stays silent on a healthy series; findings are ordered by how much they explain."""

import math

import pytest
import yaml
from lit_cancel.callbacks.doctor.diagnoses import RULES, Finding, Rule, RunHistory, Series, diagnose, register, rules_named
from lit_cancel.callbacks.doctor.history import read_run
from torch.utils.tensorboard import SummaryWriter

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


# ---- agent runs: episodes of several turns (lit_cancel.agents) ----


def healthy_agent(**overrides) -> dict:
    """A healthy run of a number-guessing game (find a number in a range from "higher"/"lower" replies, 4 guesses):
    success rising from 0.4 to 0.8, so that 0.58 to 0.18 of the episodes run out of turns (a failed episode does); the
    replies (" higher\\n", 6 tokens to a guess's 3) are 0.57 of the tokens after the prompts, as such a run logged; no
    tools. Its shares of episodes out of turns and of the environment's tokens are higher than the embedded
    tool-addition agent's (:func:`healthy_tool_agent`), so the thresholds are tested against both."""
    success = lambda s: 0.4 + 0.4 * s / STEPS  # noqa: E731
    points = healthy(**{
        "rollout/reward_mean": series(success),
        "rollout/accuracy": series(success),
        "rollout/turns": series(lambda s: 3.5 - 0.5 * s / STEPS),
        "rollout/tool_calls": series(lambda s: 0.0),
        "rollout/tool_errors": series(lambda s: 0.0),
        "rollout/env_token_share": series(lambda s: 0.57),
        "rollout/frac_turn_limit": series(lambda s: 0.98 - success(s)),
        "rollout/frac_turn_cut": series(lambda s: 0.005),
        "rollout/frac_episode_cut": series(lambda s: 0.0),
        "rollout/staleness_max": series(lambda s: 0.0),  # an agent task refuses an engine that samples ahead
    })
    points.update(overrides)
    return points


def healthy_tool_agent() -> dict:
    """The embedded agent's quickstart (configs/quickstart-agent.yaml, seed 0, means over 20 steps): tool calls rising
    from 0.90 to 0.98 per episode with 0.03 of them failing (a call the tiny model miswrote), the replies 0.22 of the
    tokens, no episode out of turns, 0.015-0.026 of the turns cut."""
    success = lambda s: 0.69 + 0.11 * s / STEPS  # noqa: E731
    return healthy(**{
        "rollout/reward_mean": series(success),
        "rollout/accuracy": series(success),
        "rollout/turns": series(lambda s: 1.9 + 0.08 * s / STEPS),
        "rollout/tool_calls": series(lambda s: 0.9 + 0.08 * s / STEPS),
        "rollout/tool_errors": series(lambda s: 0.03),
        "rollout/env_token_share": series(lambda s: 0.22),
        "rollout/frac_turn_limit": series(lambda s: 0.0),
        "rollout/frac_turn_cut": series(lambda s: 0.02),
        "rollout/frac_episode_cut": series(lambda s: 0.0),
        "rollout/frac_truncated": series(lambda s: 0.02),
        "rollout/staleness_max": series(lambda s: 0.0),
    })


def test_the_embedded_agent_s_quickstart_has_no_finding():
    assert found(healthy_tool_agent(), **{**AGENT_SETTINGS, "max_new_tokens": 23, "max_turns": 3}) == []


AGENT_SETTINGS = {"temperature": 1.0, "max_new_tokens": 4, "kl_coef": 0.0, "max_staleness": 0, "max_turns": 4}


def test_a_healthy_agent_run_has_no_finding():
    assert found(healthy_agent(), **AGENT_SETTINGS) == []
    # the quickstart-agent run's worst stretch (seed 0, steps 9-11 of 40): 0.67 of the episodes out of turns, 0.33 solved
    worst = {"rollout/frac_turn_limit": series(lambda s: 0.67), "rollout/accuracy": series(lambda s: 0.33),
             "rollout/reward_mean": series(lambda s: 0.33)}
    assert found(healthy_agent(**worst), **AGENT_SETTINGS) == []


@pytest.mark.parametrize(("share", "severity"), [(0.8, "warning"), (0.97, "severe")])
def test_episodes_that_run_out_of_turns_name_max_turns(share, severity):
    points = healthy_agent(**{
        "rollout/frac_turn_limit": series(lambda s: share),
        "rollout/turns": series(lambda s: 4.0),
        "rollout/accuracy": series(lambda s: 0.98 - share),
        "rollout/reward_mean": series(lambda s: 0.98 - share),
    })
    (finding,) = found(points, **AGENT_SETTINGS)
    assert finding.rule == "turn_limit" and finding.severity == severity
    assert f"rollout/frac_turn_limit averages {share:.2f} over steps 46-60 (threshold 0.7)" in finding.evidence
    assert "rollout/turns averages 4.00 per episode of at most 4" in finding.evidence
    assert finding.remedy.startswith("raise data.init_args.task.init_args.max_turns (now 4) to about 8, or reward progress")
    # where the run's config is not known, the key without a value
    (unknown,) = found(points)
    assert unknown.remedy.startswith("raise data.init_args.task.init_args.max_turns about 2x")


def test_episodes_that_end_at_the_turn_limit_and_succeed_are_no_finding():
    # an environment that never ends an episode itself: every episode runs to max_turns, most are correct
    points = healthy_agent(**{"rollout/frac_turn_limit": series(lambda s: 1.0), "rollout/accuracy": series(lambda s: 0.9)})
    assert found(points, **AGENT_SETTINGS) == []


@pytest.mark.parametrize(("errors", "severity", "share"), [(0.8, "warning", "40%"), (1.6, "severe", "80%")])
def test_failing_tool_calls_are_named_with_their_share(errors, severity, share):
    points = healthy_agent(**{"rollout/tool_calls": series(lambda s: 2.0), "rollout/tool_errors": series(lambda s: errors)})
    (finding,) = found(points, **AGENT_SETTINGS)
    assert finding.rule == "tool_failures" and finding.severity == severity
    assert finding.evidence.startswith(f"{share} of tool calls fail (threshold 30%): rollout/tool_errors averages {errors:.2f} per "
                                       "episode against 2.00 rollout/tool_calls over steps 46-60")
    assert "malformed calls" in finding.cause and "⟦env: …⟧" in finding.remedy and "SFT" in finding.remedy


def test_tool_errors_of_a_run_that_hardly_calls_tools_are_no_finding():
    # one call in twenty episodes, and it fails: too few calls for a share
    points = healthy_agent(**{"rollout/tool_calls": series(lambda s: 0.05), "rollout/tool_errors": series(lambda s: 0.05)})
    assert found(points, **AGENT_SETTINGS) == []


def test_an_environment_that_crowds_out_the_policy_is_named_with_the_episode_limit():
    points = healthy_agent(**{"rollout/env_token_share": series(lambda s: 0.9)})
    (finding,) = found(points, **AGENT_SETTINGS, max_episode_tokens=512)
    assert finding.rule == "environment_crowds_out" and finding.severity == "warning"
    assert "averages 0.90 over steps 46-60 (threshold 0.8): the policy wrote 10% of the episodes' tokens" in finding.evidence
    assert "max_output_chars" in finding.remedy and "data.init_args.task.init_args.max_episode_tokens (now 512)" in finding.remedy
    assert "learns only from its own tokens" in finding.remedy
    # long replies of a game (0.7 of the tokens) are no finding
    assert found(healthy_agent(**{"rollout/env_token_share": series(lambda s: 0.7)}), **AGENT_SETTINGS) == []


@pytest.mark.parametrize(
    ("episode_cut", "cause", "remedy"),
    [
        (0.0, "Turns are cut off at the task's max_turn_tokens.", "raise data.init_args.task.init_args.max_turn_tokens (now 4) to about 8"),
        (0.6, "Episodes are cut off at the task's max_episode_tokens.",
         "raise data.init_args.task.init_args.max_episode_tokens (now 64) to about 128"),
        (0.25, "Episodes are cut off at the task's token limits, max_turn_tokens most, then max_episode_tokens.",
         "raise data.init_args.task.init_args.max_turn_tokens (now 4) to about 8 and raise "
         "data.init_args.task.init_args.max_episode_tokens (now 64) to about 128"),
    ],
)
def test_truncation_in_an_agent_run_names_the_task_s_token_limits(episode_cut, cause, remedy):
    points = healthy_agent(**{
        "rollout/frac_truncated": series(lambda s: 0.6),
        "rollout/frac_turn_cut": series(lambda s: 0.2),
        "rollout/frac_episode_cut": series(lambda s: episode_cut),
    })
    (finding,) = found(points, **AGENT_SETTINGS, max_turn_tokens=4, max_episode_tokens=64)
    assert finding.rule == "truncation" and finding.severity == "severe"
    assert finding.cause == cause and finding.remedy == remedy + ", or penalise length in the reward."
    assert "max_new_tokens" not in finding.cause + finding.remedy
    assert finding.evidence == ("rollout/frac_truncated averages 0.60 of episodes over steps 46-60 (threshold 0.2); rollout/frac_turn_cut "
                                f"averages 0.20 of turns, rollout/frac_episode_cut {episode_cut:.2f} of episodes.")


def test_truncation_names_max_turn_tokens_for_an_agent_run_and_max_new_tokens_for_a_single_turn_run():
    agent = healthy_agent(**{"rollout/frac_truncated": series(lambda s: 0.3), "rollout/frac_turn_cut": series(lambda s: 0.1)})
    (finding,) = found(agent, **AGENT_SETTINGS)
    assert finding.severity == "warning" and finding.cause == "Turns are cut off at the task's max_turn_tokens."
    # a task that leaves max_turn_tokens unset cuts turns at the module's max_new_tokens: both are named
    assert finding.remedy == ("raise data.init_args.task.init_args.max_turn_tokens about 2x (or model.init_args.max_new_tokens, "
                              "where the task leaves it unset), or penalise length in the reward.")
    # a run that logs no rollout/frac_episode_cut does not say which limit cut
    del agent["rollout/frac_episode_cut"]
    (unsplit,) = found(agent, **AGENT_SETTINGS)
    assert unsplit.cause == "Episodes are cut off at the task's token limits, max_turn_tokens or max_episode_tokens."
    assert "max_turn_tokens" in unsplit.remedy and "max_episode_tokens about 2x" in unsplit.remedy
    (single,) = found(healthy(**{"rollout/frac_truncated": series(lambda s: 0.3)}), max_new_tokens=40)
    assert single.cause == "Completions are cut off at max_new_tokens."
    assert single.remedy == "raise model.init_args.max_new_tokens (now 40) to about 80, or penalise length in the reward."


def test_agent_findings_are_ordered_tool_failures_before_the_turns_they_spend():
    points = healthy_agent(**{
        "rollout/tool_calls": series(lambda s: 2.0),
        "rollout/tool_errors": series(lambda s: 1.0),  # warning, rank 16
        "rollout/env_token_share": series(lambda s: 0.85),  # warning, rank 17
        "rollout/frac_turn_limit": series(lambda s: 0.8),  # warning, rank 19
        "rollout/accuracy": series(lambda s: 0.1),
        "rollout/reward_mean": series(lambda s: 0.1),
        "rollout/frac_zero_std_groups": series(lambda s: 0.7),  # warning, rank 20
    })
    assert rules_of(found(points, **AGENT_SETTINGS)) == ["tool_failures", "environment_crowds_out", "turn_limit", "no_reward_difference"]


def test_a_finished_agent_run_s_limits_are_read_from_its_config(tmp_path):
    writer = SummaryWriter(str(tmp_path))
    for step in range(12):
        writer.add_scalar("rollout/frac_turn_limit", 0.9, step)
        writer.add_scalar("rollout/accuracy", 0.05, step)
    writer.close()
    task = {"class_path": "lit_cancel.agents.EnvironmentTask", "init_args": {"max_turns": 6, "max_turn_tokens": None,
                                                                              "max_episode_tokens": 1024}}
    (tmp_path / "config.yaml").write_text(yaml.safe_dump({"data": {"init_args": {"task": task}}}))
    history = read_run(tmp_path)
    assert history.settings == {"max_turns": 6.0, "max_episode_tokens": 1024.0}  # max_turn_tokens unset: the module's
    (finding,) = diagnose(history)
    assert finding.rule == "turn_limit" and finding.remedy.startswith("raise data.init_args.task.init_args.max_turns (now 6) to about 12")


def test_a_rising_share_of_failed_episodes_is_named_with_its_most_frequent_cause_and_the_budget():
    rising = healthy_tool_agent() | {
        "rollout/failed_episodes": series(lambda s: 0.36 * s / STEPS),
        "rollout/failed_episodes/step_raised": series(lambda s: 0.24 * s / STEPS),
        "rollout/failed_episodes/timeout": series(lambda s: 0.12 * s / STEPS),
    }
    (finding,) = found(rising, **AGENT_SETTINGS, max_failed_share=0.25)
    assert finding.rule == "failing_episodes" and finding.severity == "severe"
    assert finding.cause.startswith("A rising share of episodes fails")
    assert finding.evidence == ("rollout/failed_episodes rose from 0.05 to 0.32 of the episodes by steps 46-60 (threshold 0.05, "
                                "rising 2x); most often step_raised (rollout/failed_episodes/step_raised averages 0.21).")
    assert "⟦failed: CAUSE⟧" in finding.remedy and "episode_timeout" not in finding.remedy
    assert finding.remedy.endswith("the run stops where more than data.init_args.max_failed_share (now 0.25) of a round's "
                                   "episodes fail in data.init_args.max_failed_rounds rounds in a row.")
    # a rise that stays small warns; where the environment times out most, the remedy names episode_timeout
    slow = healthy_tool_agent() | {"rollout/failed_episodes": series(lambda s: 0.1 * s / STEPS),
                                   "rollout/failed_episodes/timeout": series(lambda s: 0.1 * s / STEPS)}
    (finding,) = found(slow, **AGENT_SETTINGS)
    assert finding.severity == "warning" and "raise data.init_args.task.init_args.episode_timeout" in finding.remedy


@pytest.mark.parametrize(("share", "expected"), [(0.03, []), (0.08, []), (0.12, ["failing_episodes"])])
def test_a_steady_share_of_failed_episodes_is_named_only_from_0_1(share, expected):
    steady = healthy_tool_agent() | {"rollout/failed_episodes": series(lambda s: share)}
    findings = found(steady, **AGENT_SETTINGS)
    assert rules_of(findings) == expected
    if expected:
        assert findings[0].cause.startswith("A steady share") and "averages 0.12 of the episodes over steps 46-60" in findings[0].evidence


def test_a_finished_agent_run_s_failure_budget_is_read_from_its_config(tmp_path):
    writer = SummaryWriter(str(tmp_path))
    for step in range(12):
        writer.add_scalar("rollout/failed_episodes", 0.02 * step, step)
    writer.close()
    (tmp_path / "config.yaml").write_text(yaml.safe_dump({"data": {"init_args": {"max_failed_share": 0.3}}}))
    history = read_run(tmp_path)
    assert history.settings == {"max_failed_share": 0.3}
    (finding,) = diagnose(history)
    assert finding.rule == "failing_episodes" and "data.init_args.max_failed_share (now 0.3)" in finding.remedy
