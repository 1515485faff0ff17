"""The run doctor's rules (registered in :data:`diagnoses.RULES` on import), most fundamental cause first.

Each threshold is a class attribute; docs/doctor.md says where each came from (the calibration runs of
``benchmarks/doctor/planted_faults.py``). Trends compare the first and the last quarter of a series (:func:`diagnoses.head`,
:func:`diagnoses.tail`), so a rule judges a run that has logged at least ``min_points`` values of what it needs.
"""

import math
import statistics

from .diagnoses import SETTING_KEYS, Finding, Rule, RunHistory, head, mean, register, tail


def _steps(history: RunHistory, name: str, share: float = 0.25) -> str:
    steps = tail(history.steps(name), share)
    return f"steps {steps[0]}-{steps[-1]}"


def _late(history: RunHistory, name: str, share: float = 0.25) -> float:
    """The mean of the last ``share`` of a series."""
    return mean(tail(history.values(name), share))


def _one_figure(value: float) -> float:
    """``value`` rounded to one significant figure (7,712 -> 8,000)."""
    return round(value, -math.floor(math.log10(value)))


def _agent_key(history: RunHistory, name: str) -> str:
    """Where an agent task's limit ``name`` is set: the run's framework's key, lit_cancel's where it has none (only
    lit_cancel's agent tasks log the series that lead to these limits)."""
    return SETTING_KEYS.get(history.framework, {}).get(name, SETTING_KEYS["lit_cancel"][name])


def _raise_to(key: str, limit: float | None) -> str:
    """``raise KEY (now N) to about 2N``, or ``raise KEY about 2x`` where the run's value is unknown."""
    return f"raise {key} (now {limit:g}) to about {2 * limit:g}" if limit else f"raise {key} about 2x"


def _accuracy(history: RunHistory) -> tuple[str, float] | None:
    """The late accuracy, or the late reward when no accuracy is logged, with the series' name."""
    for name in ("rollout/accuracy", "rollout/reward_mean"):
        if name in history:
            return name, _late(history, name)
    return None


@register
class RewardIgnoresAnswer(Rule):
    """The reward does not follow correctness: over the rollouts of a step, reward and correctness are uncorrelated
    (``rollout/reward_correct_corr``), while the rewards do vary. A reward function that scores format or length, or
    that reads the wrong field, trains the policy on something else than the task."""

    name = "reward_ignores_answer"
    needs = ("rollout/reward_correct_corr",)
    rank = 10
    max_correlation = 0.2

    def check(self, history: RunHistory) -> Finding | None:
        correlation = _late(history, "rollout/reward_correct_corr", 0.5)
        if correlation >= self.max_correlation:
            return None
        return self.finding(
            "severe",
            cause="The reward does not follow correctness: the policy is trained on something else than the task.",
            evidence=f"rollout/reward_correct_corr averages {correlation:.2f} over {_steps(history, 'rollout/reward_correct_corr', 0.5)} "
            f"(threshold {self.max_correlation}).",
            remedy="check the task's reward function (reward_fn) on a few completions by hand: it must score the answer.",
            strength=self.max_correlation - correlation,
            history=history,
        )


@register
class LowTemperature(Rule):
    """Sampling at a low temperature makes a group's samples alike, so many groups get one reward for all of them."""

    name = "low_temperature"
    needs = ("rollout/frac_zero_std_groups",)
    rank = 19
    max_temperature = 0.8
    min_zero_std = 0.5

    def check(self, history: RunHistory) -> Finding | None:
        temperature = history.settings.get("temperature", 1.0)
        share = _late(history, "rollout/frac_zero_std_groups")
        if temperature >= self.max_temperature or share < self.min_zero_std:
            return None
        evidence = (f"sampling temperature {temperature:g} (threshold {self.max_temperature:g}); rollout/frac_zero_std_groups "
                    f"averages {share:.2f} over {_steps(history, 'rollout/frac_zero_std_groups')} (threshold {self.min_zero_std})")
        if "health/entropy" in history:
            evidence += f"; health/entropy averages {_late(history, 'health/entropy'):.3f}"
        return self.finding(
            "severe", f"Sampling at temperature {temperature:g} makes a group's samples alike: their rewards do not differ.",
            evidence + ".", f"sample at temperature 1.0 ({history.setting_key('temperature')}).", strength=share, history=history,
        )


@register
class NoRewardDifference(Rule):
    """Most groups get one reward for every completion, so their advantages, and their gradient, are zero: the prompts
    are too easy (all solved) or too hard (all failed) for the policy, or the reward never changes."""

    name = "no_reward_difference"
    needs = ("rollout/frac_zero_std_groups",)
    rank = 20
    warn_share = 0.6
    severe_share = 0.9
    solved = 0.8  # late accuracy above which the prompts count as too easy
    failed = 0.2  # and below which as too hard

    def check(self, history: RunHistory) -> Finding | None:
        share = _late(history, "rollout/frac_zero_std_groups")
        if share < self.warn_share:
            return None
        severity = "severe" if share >= self.severe_share else "warning"
        evidence = (f"rollout/frac_zero_std_groups averages {share:.2f} over {_steps(history, 'rollout/frac_zero_std_groups')} "
                    f"(threshold {self.warn_share})")
        level = _accuracy(history)
        rewards = history.values("rollout/reward_mean")
        constant = len(set(rewards)) == 1
        correct = _late(history, "rollout/accuracy") if "rollout/accuracy" in history else None
        group_size = history.setting_key("group_size")
        dynamic_sampling = "data.init_args.dynamic_sampling true" if history.framework == "lit_cancel" else None
        # one reward everywhere while a task's own check finds some completions right and others wrong
        if constant and correct is not None and self.failed < correct < self.solved:
            cause, remedy = (
                f"Every rollout gets the same reward ({rewards[0]:g}) though {correct:.0%} are correct: the reward does not "
                "depend on the completion.",
                "check the task's reward function on a correct and a wrong completion: it must score them apart.",
            )
            evidence += f"; rollout/accuracy is {correct:.2f}"
        elif constant and correct is None:
            cause, remedy = (
                f"The mean reward is {rewards[0]:g} at every step and most groups get one reward for all their samples: the "
                "reward may not depend on the completion, or the prompts are solved (or failed) alike; the run logs no "
                "correctness to tell which.",
                "check the reward function on a correct and a wrong completion: it must score them apart; if it does, "
                "train on prompts the policy solves only sometimes.",
            )
            evidence += f"; rollout/reward_mean is {rewards[0]:g} at all {len(rewards)} steps logged, and no rollout/accuracy is logged"
        elif level is not None and level[1] >= self.solved:
            cause, remedy = (
                "The prompts are too easy: most groups solve every sample, so they carry no advantage.",
                "train on harder prompts" + (f" (or drop solved ones: {dynamic_sampling})." if dynamic_sampling else "."),
            )
            evidence += f"; {level[0]} is {level[1]:.2f}"
        elif level is not None and level[1] <= self.failed:
            cause, remedy = (
                "The prompts are too hard: most groups fail every sample, so they carry no advantage.",
                f"train on easier prompts, warm-start with SFT, or raise {group_size} so that some samples succeed.",
            )
            evidence += f"; {level[0]} is {level[1]:.2f}"
        else:
            cause, remedy = (
                "Most groups get one reward for all their samples, so they carry no advantage.",
                f"make the reward finer (partial credit), raise {group_size}, or drop such groups"
                + (f" ({dynamic_sampling})." if dynamic_sampling else "."),
            )
        return self.finding(severity, cause, evidence + ".", remedy, strength=share, history=history)


@register
class LearningRateTooHigh(Rule):
    """The reward fell well below the best it reached, and the policy was thrown about: large parameter updates,
    entropy that grew, or gradient-norm spikes. Too large steps wreck what the policy could do, and the groups without
    a reward difference, the rambling completions cut at the limit and the risen entropy that follow are symptoms."""

    name = "learning_rate_too_high"
    needs = ("rollout/reward_mean",)
    rank = 15
    min_fall = 0.5  # share of the best smoothed reward lost by the last quarter
    min_fall_absolute = 0.1  # in reward units: a smaller fall is noise
    update_ratio = 1e-2  # median parameter update over parameter size in the first half
    entropy_rise = 2.0  # last-quarter entropy over first-quarter entropy
    spike = 10.0  # largest gradient norm over the early median

    def thrown_about(self, history: RunHistory) -> str | None:
        """The evidence that the steps were too large, or None."""
        if "health/update_ratio" in history:
            ratio = statistics.median(head(history.values("health/update_ratio"), 0.5))
            if ratio >= self.update_ratio:
                return f"health/update_ratio has a median of {ratio:.2g} in the first half (threshold {self.update_ratio:g})"
        if "health/entropy" in history:
            entropy = history.values("health/entropy")
            rise = mean(tail(entropy)) / max(mean(head(entropy)), 1e-12)
            if rise >= self.entropy_rise:
                return f"health/entropy grew {rise:.1f}x (threshold {self.entropy_rise:g}x)"
        if "health/grad_norm" in history:
            norms = history.values("health/grad_norm")
            # a step without a gradient (no group with a reward difference) is no baseline for a spike
            early = [norm for norm in head(norms) if norm > 0]
            if early:
                jump = max(norms) / statistics.median(early)
                if jump >= self.spike:
                    return (f"health/grad_norm peaked at {jump:.0f}x the median of its nonzero values in the first quarter "
                            f"(threshold {self.spike:g}x)")
        return None

    def check(self, history: RunHistory) -> Finding | None:
        rewards = history.values("rollout/reward_mean")
        before_end = rewards[: len(rewards) - len(tail(rewards))]
        smooth = [statistics.fmean(before_end[i : i + 3]) for i in range(max(1, len(before_end) - 2))]
        best, end = max(smooth), mean(tail(rewards))
        fall = best - end
        if fall < max(self.min_fall_absolute, self.min_fall * best):
            return None
        why = self.thrown_about(history)
        if why is None:
            return None
        lr = mean(head(history.values("lr"))) if "lr" in history else None
        return self.finding(
            "severe", "The learning rate is too high: the reward fell back from its best, and the policy was thrown about.",
            f"rollout/reward_mean fell from {best:.2f} to {end:.2f} by {_steps(history, 'rollout/reward_mean')} "
            f"(threshold: a fall of {self.min_fall:.0%}); {why}.",
            "lower the learning rate 3-10x" + (f" (from {lr:.2g})" if lr else "") + ", or add warm-up.",
            strength=fall / max(best, 1e-12), history=history,
        )


@register
class Truncation(Rule):
    """Many completions are cut at ``max_new_tokens``: they rarely earn a reward, and their credit goes to unfinished
    text. In an agent run (one that logs ``rollout/frac_turn_cut``) an episode is cut at its task's token limits
    instead: a turn at ``max_turn_tokens``, the whole episode at ``max_episode_tokens``."""

    name = "truncation"
    needs = ("rollout/frac_truncated",)
    rank = 18
    warn_share = 0.2
    severe_share = 0.5
    other_limit = 0.1  # an agent run's remedy names the limit that cut fewer episodes too from this share of them

    def check(self, history: RunHistory) -> Finding | None:
        share = _late(history, "rollout/frac_truncated")
        if share < self.warn_share:
            return None
        severity = "severe" if share >= self.severe_share else "warning"
        steps = tail(history.steps("rollout/frac_truncated"))
        evidence = f"rollout/frac_truncated averages {share:.2f} over steps {steps[0]}-{steps[-1]} (threshold {self.warn_share})"
        if "rollout/frac_turn_cut" in history:
            return self.episodes_cut(history, share, severity)

        def over_those_steps(name: str) -> list[float]:
            return [value for step, value in zip(history.steps(name), history.values(name)) if steps[0] <= step <= steps[-1]]

        # a step logs a reward only for the kind of completion it had
        truncated, finished = over_those_steps("rollout/reward_truncated"), over_those_steps("rollout/reward_finished")
        if truncated and finished:
            evidence += f"; truncated completions earn {mean(truncated):.2f} against {mean(finished):.2f} for finished ones"
        elif truncated:
            evidence += f"; truncated completions earn {mean(truncated):.2f}, and no completion finished in those steps"
        key = history.setting_key("max_new_tokens")
        remedy = _raise_to(key, history.settings.get("max_new_tokens")) + ", or penalise length in the reward."
        return self.finding(severity, f"Completions are cut off at {key.split('.')[-1]}.", evidence + ".", remedy, strength=share,
                            history=history)

    def episodes_cut(self, history: RunHistory, share: float, severity: str) -> Finding:
        """An agent run's finding: which of the task's token limits cut the episodes. The reward of cut and finished
        completions is not quoted: it tells an episode none of whose turns stopped from the others, not a cut episode."""
        turn_cut = _late(history, "rollout/frac_turn_cut")
        evidence = (f"rollout/frac_truncated averages {share:.2f} of episodes over {_steps(history, 'rollout/frac_truncated')} "
                    f"(threshold {self.warn_share}); rollout/frac_turn_cut averages {turn_cut:.2f} of turns")
        if "rollout/frac_episode_cut" in history:
            episode_cut = _late(history, "rollout/frac_episode_cut")
            evidence += f", rollout/frac_episode_cut {episode_cut:.2f} of episodes"
            # an episode ends at its cut turn: the episodes cut at max_turn_tokens are the truncated ones less those
            cut = {"max_turn_tokens": max(share - episode_cut, 0.0), "max_episode_tokens": episode_cut}
        else:  # which limit cut is not known: both are named
            cut = {"max_turn_tokens": share, "max_episode_tokens": share}
        first, second = sorted(cut, key=cut.get, reverse=True)
        limits = [first] + ([second] if cut[second] >= self.other_limit else [])
        raises = []
        for limit in limits:
            raises.append(_raise_to(_agent_key(history, limit), history.settings.get(limit)))
            if limit == "max_turn_tokens" and limit not in history.settings:  # unset, a turn may take max_new_tokens
                raises[-1] += f" (or {history.setting_key('max_new_tokens')}, where the task leaves it unset)"
        remedy = " and ".join(raises)
        cause = ("Turns are cut off at the task's max_turn_tokens." if limits == ["max_turn_tokens"] else
                 "Episodes are cut off at the task's max_episode_tokens." if limits == ["max_episode_tokens"] else
                 f"Episodes are cut off at the task's token limits, {limits[0]} most, then {limits[1]}."
                 if cut[first] > cut[second] else "Episodes are cut off at the task's token limits, max_turn_tokens or max_episode_tokens.")
        return self.finding(severity, cause, evidence + ".", remedy + ", or penalise length in the reward.", strength=share,
                            history=history)


@register
class FailingEpisodes(Rule):
    """A share of episodes fails, and it rises or stays high (``rollout/failed_episodes``): the environment raises, answers
    with the wrong type or runs past the task's ``episode_timeout``. A failed episode trains nothing (its row is inert,
    its group trains the others), so the share is learning signal lost, and a run whose rounds keep failing more than
    ``max_failed_share`` stops."""

    name = "failing_episodes"
    needs = ("rollout/failed_episodes",)
    rank = 14  # the environment itself fails: before its tools' failures (16) and the turns and groups it spoils
    min_share = 0.05  # late mean below which no share is read
    min_rise = 2.0  # late mean over early mean that makes a share rising
    steady_share = 0.1  # late mean that is a finding even when it does not rise
    severe_share = 0.2

    def check(self, history: RunHistory) -> Finding | None:
        values = history.values("rollout/failed_episodes")
        early, late = mean(head(values)), mean(tail(values))
        rising = late >= self.min_rise * early
        if late < self.min_share or (not rising and late < self.steady_share):
            return None
        steps = _steps(history, "rollout/failed_episodes")
        evidence = (f"rollout/failed_episodes rose from {early:.2f} to {late:.2f} of the episodes by {steps}" if rising else
                    f"rollout/failed_episodes averages {late:.2f} of the episodes over {steps}")
        evidence += f" (threshold {self.min_share:g}{', rising 2x' if rising else f', or {self.steady_share:g} steady'})"
        by_cause = {name.rpartition("/")[2]: _late(history, name) for name in history.series
                    if name.startswith("rollout/failed_episodes/")}
        cause = max(by_cause, key=by_cause.get, default=None)
        if cause is not None and by_cause[cause] > 0:
            evidence += f"; most often {cause} (rollout/failed_episodes/{cause} averages {by_cause[cause]:.2f})"
        budget = history.settings.get("max_failed_share")
        remedy = ("read the failed episodes in TensorBoard's Text tab (RolloutSamplesLogger marks them ⟦failed: CAUSE⟧, "
                  "the messages name the environment's method and the record) and call the environment by hand on those "
                  "records")
        if cause == "timeout":
            remedy += f", or raise {_agent_key(history, 'episode_timeout')} where the environment is slow rather than stuck"
        remedy += (f"; the run stops where more than {_agent_key(history, 'max_failed_share')}"
                   + (f" (now {budget:g})" if budget is not None else "")
                   + f" of a round's episodes fail in {_agent_key(history, 'max_failed_rounds')} rounds in a row.")
        return self.finding(
            "severe" if late >= self.severe_share else "warning",
            ("A rising share" if rising else "A steady share") + " of episodes fails: the environment raises, answers with "
            "the wrong type, or runs past episode_timeout, and a failed episode trains nothing.",
            evidence + ".", remedy, strength=late, history=history,
        )


@register
class ToolFailures(Rule):
    """The policy's tool calls fail on a large share of calls (``rollout/tool_errors`` over ``rollout/tool_calls``):
    calls the environment cannot read, calls to no tool, tools that raise or time out. Each failure is an observation
    the policy reads and a turn spent; an episode that reaches no answer earns no reward."""

    name = "tool_failures"
    needs = ("rollout/tool_calls", "rollout/tool_errors")
    rank = 16  # failing calls spend turns (turn_limit) and fill the context with errors (environment_crowds_out)
    min_calls = 0.1  # tool calls per episode, late mean, below which the run hardly uses tools: no share is read
    warn_share = 0.3
    severe_share = 0.7

    def check(self, history: RunHistory) -> Finding | None:
        calls = _late(history, "rollout/tool_calls")
        if calls < self.min_calls:
            return None
        errors = _late(history, "rollout/tool_errors")
        share = errors / calls
        if share < self.warn_share:
            return None
        return self.finding(
            "severe" if share >= self.severe_share else "warning",
            "The policy's tool calls fail: malformed calls, calls to unknown tools, or tools that raise or time out.",
            f"{share:.0%} of tool calls fail (threshold {self.warn_share:.0%}): rollout/tool_errors averages {errors:.2f} per "
            f"episode against {calls:.2f} rollout/tool_calls over {_steps(history, 'rollout/tool_calls')}.",
            "read a few episodes in TensorBoard's Text tab (RolloutSamplesLogger marks the environment's replies ⟦env: …⟧) "
            "for the errors the tools return, call the tools by hand with the arguments the policy gave, and warm-start "
            "the call format with SFT (lit_cancel.SFTModule on episodes that call the tools right).",
            strength=share, history=history,
        )


@register
class EnvironmentCrowdsOut(Rule):
    """The environment's tokens crowd out the policy's (``rollout/env_token_share``): the policy learns only from its
    own tokens, so long observations cost context and compute and train nothing, and they fill ``max_episode_tokens``."""

    name = "environment_crowds_out"
    needs = ("rollout/env_token_share",)
    rank = 17  # long observations fill the episode: the episodes cut at max_episode_tokens (truncation) follow
    # a healthy number-guessing run shares 0.56-0.58 (a reply " higher\n", 6 tokens, per guess of 3); the embedded agent 0.22
    max_share = 0.8

    def check(self, history: RunHistory) -> Finding | None:
        share = _late(history, "rollout/env_token_share")
        if share < self.max_share:
            return None
        evidence = (f"rollout/env_token_share averages {share:.2f} over {_steps(history, 'rollout/env_token_share')} (threshold "
                    f"{self.max_share}): the policy wrote {1 - share:.0%} of the episodes' tokens after the prompts")
        if "rollout/frac_episode_cut" in history:
            evidence += f"; rollout/frac_episode_cut averages {_late(history, 'rollout/frac_episode_cut'):.2f}"
        key = _agent_key(history, "max_episode_tokens")
        limit = history.settings.get("max_episode_tokens")
        return self.finding(
            "warning", "The environment's tokens crowd out the policy's: most of each episode is observations.",
            evidence + ".",
            "cap tool output (ToolEnvironment's max_output_chars), shorten the environment's observations, or raise "
            f"{key}" + (f" (now {limit:g})" if limit else "") + ": the policy learns only from its own tokens, so long "
            "observations cost context and compute for nothing trained.",
            strength=share, history=history,
        )


@register
class TurnLimit(Rule):
    """Most episodes run out of turns (``rollout/frac_turn_limit``): they end at the task's ``max_turns`` before the
    environment says they are done, and earn no reward for the task left unfinished. Not where the run's accuracy is
    high: there ending at the limit costs nothing (an environment that never ends an episode itself)."""

    name = "turn_limit"
    needs = ("rollout/frac_turn_limit",)
    rank = 19  # after tool failures (16), whose retries spend turns; before no_reward_difference (20), which episodes that all fail make
    warn_share = 0.7
    severe_share = 0.95
    solved = 0.8  # late rollout/accuracy from which episodes at the limit are taken to be its normal end

    def check(self, history: RunHistory) -> Finding | None:
        share = _late(history, "rollout/frac_turn_limit")
        if share < self.warn_share:
            return None
        accuracy = _late(history, "rollout/accuracy") if "rollout/accuracy" in history else None
        if accuracy is not None and accuracy >= self.solved:
            return None
        evidence = (f"rollout/frac_turn_limit averages {share:.2f} over {_steps(history, 'rollout/frac_turn_limit')} "
                    f"(threshold {self.warn_share})")
        limit = history.settings.get("max_turns")
        if "rollout/turns" in history:
            evidence += f"; rollout/turns averages {_late(history, 'rollout/turns'):.2f} per episode" + (
                f" of at most {limit:g}" if limit else "")
        if accuracy is not None:
            evidence += f"; rollout/accuracy is {accuracy:.2f}"
        return self.finding(
            "severe" if share >= self.severe_share else "warning",
            "Most episodes run out of turns: they end at the task's max_turns before the environment says they are done.",
            evidence + ".",
            _raise_to(_agent_key(history, "max_turns"), limit) + ", or reward progress within the episode (partial credit "
            "for each step towards the goal), so that episodes cut short still differ in reward.",
            strength=share, history=history,
        )


@register
class KLDominates(Rule):
    """The KL term to the reference holds learning back. It does so at a small share of the per-token credit
    (``objective/kl_share``): its credit pulls every token towards the reference, while the policy term's credit
    largely cancels across a group's samples, so the KL carries much more of the net update than of the credit (the
    gradient norm before clipping grows several-fold with it). The share settles within the first steps and grows
    with the coefficient, so it tells a weak KL from a strong one at the first check."""

    name = "kl_dominates"
    needs = ("objective/kl_share",)
    rank = 50
    # benchmarks/doctor/planted_faults.py --kl-sweep: on the quickstart, kl_coef 2 (share 0.054-0.056) kept 36% of the held-out accuracy
    # gained without a KL in 60 steps, kl_coef 1 (0.034-0.036) 51%, kl_coef 0.5 (0.021-0.022) 84%
    max_share = 0.045

    def check(self, history: RunHistory) -> Finding | None:
        # the median: a step with few groups carrying a reward difference has little policy credit, and a spike of share
        share = statistics.median(tail(history.values("objective/kl_share")))
        if share < self.max_share:
            return None
        key = history.setting_key("kl_coef")
        coef = history.settings.get("kl_coef")
        return self.finding(
            "warning", "The KL penalty holds learning back: it keeps the policy near the reference.",
            f"objective/kl_share has a median of {share:.3f} over {_steps(history, 'objective/kl_share')} (threshold {self.max_share}: "
            "the KL's credit pulls every token the same way, the policy's largely cancels within a group).",
            f"lower {key}" + (f" (now {coef:g})" if coef else "") + " about 10x, or to 0.",
            strength=share, history=history,
        )


@register
class PolicyFrozen(Rule):
    """The parameters barely move per step while the rewards do differ within groups: the learning rate is too low
    (or the optimizer does not reach the policy's parameters)."""

    name = "learning_rate_too_low"
    needs = ("health/update_ratio",)
    rank = 60
    max_ratio = 1e-5
    target_ratio = 1e-4  # what the remedy aims at: 10x the threshold (the quickstart learns at 1e-3)
    max_zero_std = 0.6  # with more groups than this without a reward difference, another rule explains the stall

    def check(self, history: RunHistory) -> Finding | None:
        ratio = statistics.median(tail(history.values("health/update_ratio"), 0.5))
        if ratio >= self.max_ratio:
            return None
        if "rollout/frac_zero_std_groups" in history and _late(history, "rollout/frac_zero_std_groups") >= self.max_zero_std:
            return None
        evidence = (f"health/update_ratio has a median of {ratio:.1e} over {_steps(history, 'health/update_ratio', 0.5)} "
                    f"(threshold {self.max_ratio:.0e}).")
        lr = _late(history, "lr") if "lr" in history else None
        strength = math.log10(self.max_ratio / max(ratio, 1e-30))
        if ratio == 0:
            # an update below half a float32 parameter's last bit (2**-24 of it) rounds away: the run moved less than that
            at_least = _one_figure(self.target_ratio / 2**-24)
            return self.finding(
                "warning", "The policy does not move: its parameters did not change at all.", evidence,
                "check that the optimizer holds the policy's trainable parameters; if it does, their updates are lost to "
                f"rounding: raise the learning rate{f' (now {lr:.2g})' if lr else ''} at least {at_least:,.0f}x, so that "
                f"health/update_ratio reaches about {self.target_ratio:.0e}.",
                strength=strength, history=history,
            )
        factor = _one_figure(self.target_ratio / ratio)
        to = f" (from {lr:.2g} to about {lr * factor:.1g})" if lr else ""
        return self.finding(
            "warning", "The learning rate is too low: the policy barely moves.", evidence,
            f"raise the learning rate about {factor:,.0f}x{to}, so that health/update_ratio reaches about {self.target_ratio:.0e} "
            "(it grows in proportion to the learning rate).",
            strength=strength, history=history,
        )


@register
class SamplerMismatch(Rule):
    """The sampler's log-probs differ from the trainer's beyond bfloat16 rounding: the rollouts come from another
    policy than the one trained (stale or wrong weights in the engine, another dtype, another temperature)."""

    name = "sampler_mismatch"
    needs = ("rollout/logprob_mismatch",)
    rank = 70
    min_points = 3
    max_mismatch = 0.05

    def check(self, history: RunHistory) -> Finding | None:
        mismatch = _late(history, "rollout/logprob_mismatch")
        if mismatch < self.max_mismatch:
            return None
        return self.finding(
            "warning", "The sampler's log-probs differ from the trainer's: rollouts come from another policy.",
            f"rollout/logprob_mismatch averages {mismatch:.3f} per token over {_steps(history, 'rollout/logprob_mismatch')} "
            f"(threshold {self.max_mismatch}, bfloat16 rounding).",
            "check that the engine receives each step's weights and samples at the trainer's temperature; sample in "
            "float32 (engine dtype) or correct for it (objective correction: TokenTruncate).",
            strength=mismatch / self.max_mismatch, history=history,
        )


@register
class StaleRollouts(Rule):
    """Rollouts trained on are older than the run allows."""

    name = "stale_rollouts"
    needs = ("rollout/staleness_max",)
    rank = 75
    min_points = 3
    default_bound = 2

    def check(self, history: RunHistory) -> Finding | None:
        bound = history.settings.get("max_staleness", self.default_bound)
        worst = max(history.values("rollout/staleness_max"))
        if worst <= bound:
            return None
        return self.finding(
            "warning", "Rollouts are staler than the run's bound.",
            f"rollout/staleness_max reached {worst:g} rounds (bound {bound:g}).",
            "lower the engine's max_staleness, or add rollout servers so that sampling keeps up with training.",
            strength=worst / max(bound, 1), history=history,
        )


@register
class EntropyCollapse(Rule):
    """The policy's entropy on its rollouts fell to a small share of its start: samples in a group become one."""

    name = "entropy_collapse"
    needs = ("health/entropy",)
    rank = 80
    min_ratio = 0.1
    low_temperature = 0.8
    high_tax = 0.5

    def check(self, history: RunHistory) -> Finding | None:
        entropy = history.values("health/entropy")
        start, end = mean(head(entropy)), mean(tail(entropy))
        if start <= 0 or end / start >= self.min_ratio:
            return None
        evidence = (f"health/entropy fell from {start:.3f} to {end:.3f} ({end / start:.0%} of its start; threshold "
                    f"{self.min_ratio:.0%}) by {_steps(history, 'health/entropy')}")
        temperature = history.settings.get("temperature")
        tax = _late(history, "health/learning_tax") if "health/learning_tax" in history else None
        if temperature is not None and temperature < self.low_temperature:
            cause = f"Entropy collapsed, sharpened by sampling at temperature {temperature:g}."
            remedy = "sample at temperature 1.0 (model.init_args.temperature)."
        elif tax is not None and tax >= self.high_tax:
            cause = "Entropy collapsed under a high learning tax (uncancelled credit on shared tokens)."
            remedy = "use an objective whose shared-token credit cancels (DrGRPO, DFPOMin) and keep each group in one mini-batch."
            evidence += f"; health/learning_tax averages {tax:.2f}"
        else:
            cause = "Entropy collapsed: the policy became nearly deterministic on its rollouts."
            remedy = "lower the learning rate, raise the upper clip (clip_eps_high, as DAPO), or add an entropy bonus (entropy_coef)."
        return self.finding("warning", cause, evidence + ".", remedy, strength=1 - end / start, history=history)


@register
class LearningTaxDrift(Rule):
    """Much of each update's credit is left uncancelled on tokens a group shares, and the preference among solutions
    drifts: the learning tax moves the policy where the reward does not ask it to."""

    name = "learning_tax_drift"
    needs = ("health/learning_tax",)
    rank = 90
    min_points = 3
    max_tax = 0.5
    min_drift = 0.5  # preference entropy left, as a share of its start

    def check(self, history: RunHistory) -> Finding | None:
        tax = _late(history, "health/learning_tax")
        if tax < self.max_tax:
            return None
        evidence = (f"health/learning_tax averages {tax:.2f} over {_steps(history, 'health/learning_tax')} (threshold {self.max_tax})")
        if "health/drift_preference_entropy_ratio" in history:
            drift = _late(history, "health/drift_preference_entropy_ratio")
            if drift > self.min_drift:
                return None
            evidence += f"; health/drift_preference_entropy_ratio fell to {drift:.2f} (threshold {self.min_drift})"
        return self.finding(
            "warning", "A high learning tax drifts the policy: shared-token credit does not cancel.", evidence + ".",
            "use an objective whose shared-token credit cancels (DrGRPO, DFPOMin), and keep each group in one mini-batch "
            "(the reward-balanced batching).", strength=tax, history=history,
        )
