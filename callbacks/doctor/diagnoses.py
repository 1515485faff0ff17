"""Why a run is not learning: rules that read a run's scalar series and each name a cause, its evidence and a remedy.

Plain Python (no torch, no Lightning), so that the same rules judge a run while it trains (:class:`RunDoctor`, in
``run_doctor.py`` beside this file) and after it ended (``lit-cancel diagnose RUN_DIR``, which maps TRL's and verl's
tags to the names below). A rule is a small class registered with :func:`register`:

    @register
    class MyRule(Rule):
        name = "my_rule"
        needs = ("rollout/reward_mean",)
        rank = 50

        def check(self, history):
            rewards = history.values("rollout/reward_mean")
            if ...:
                return self.finding("warning", cause="...", evidence="...", remedy="...", strength=1.0, history=history)
            return None

Findings are ordered by how much they explain (:func:`diagnose`): severe before warning, then by the rule's
``rank``, low first, then by ``strength``.
"""

import math
import statistics
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import asdict, dataclass, field
from typing import Any, ClassVar, Literal

# The series the rules read, under lit_cancel's own names; ``lit-cancel diagnose`` maps other frameworks' tags to them.
SERIES = {
    "rollout/reward_mean": "mean reward of the step's rollouts",
    "rollout/accuracy": "share of the step's rollouts that are correct",
    "rollout/reward_correct_corr": "correlation, over the step's rollouts, of the reward with correctness",
    "rollout/frac_zero_std_groups": "share of the step's groups whose rewards are all equal (no advantage, no gradient)",
    "rollout/frac_truncated": "share of completions cut at max_new_tokens (agents: episodes cut at max_turn_tokens or max_episode_tokens)",
    "rollout/reward_truncated": "mean reward of the completions cut at max_new_tokens",
    "rollout/reward_finished": "mean reward of the completions that ended by themselves",
    "rollout/completion_len": "mean completion length in tokens",
    "rollout/logprob_mismatch": "mean |trainer log-prob - sampler log-prob| per completion token",
    "rollout/staleness_max": "most optimizer rounds between a rollout's weights and the weights it trains",
    "rollout/turns": "mean turns of the policy per episode (agent tasks)",
    "rollout/tool_calls": "mean tool calls per episode (agent tasks)",
    "rollout/tool_errors": "mean failed tool calls per episode: malformed, to no tool, raised or timed out (agent tasks)",
    "rollout/env_token_share": "share of the environment's tokens among all tokens after the prompts (agent tasks)",
    "rollout/frac_turn_limit": "share of episodes that ran out of turns (max_turns) (agent tasks)",
    "rollout/frac_turn_cut": "share of turns cut at max_turn_tokens (agent tasks)",
    "rollout/frac_episode_cut": "share of episodes cut at max_episode_tokens (agent tasks)",
    "rollout/failed_episodes": "share of episodes whose environment failed: raised, wrong type, past episode_timeout (agent tasks)",
    "health/entropy": "mean per-token entropy of the policy on its rollouts",
    "health/grad_norm": "gradient norm before clipping",
    "health/update_ratio": "root-mean-square parameter update over root-mean-square parameter, per optimizer step",
    "health/learning_tax": "share of an update's credit left uncancelled on tokens shared within a group",
    "health/shared_kl": "KL at shared contexts across an optimizer step",
    "health/drift_preference_entropy_ratio": "entropy of the preference among solutions, against its start",
    "loss/kl": "KL to the reference model, per token",
    "objective/kl_share": "share of the per-token credit that comes from the KL term",
    "objective/clip_frac_low": "share of tokens clipped at 1 - eps (negative advantage)",
    "objective/clip_frac_high": "share of tokens clipped at 1 + eps (positive advantage)",
    "objective/clip_frac": "share of tokens clipped at either end (verl logs only this)",
    "objective/approx_kl": "KL between the policy that sampled the step's rollouts and the policy being updated, per token",
    "lr": "learning rate",
    "val/accuracy": "held-out accuracy",
}
# run settings some rules use when the run's config is known
SETTINGS = {
    "temperature": "sampling temperature",
    "max_new_tokens": "longest completion",
    "kl_coef": "weight of the KL term",
    "max_staleness": "the run's bound on staleness, in rounds",
    "max_turns": "an agent task's turns per episode at most",
    "max_turn_tokens": "an agent task's tokens per turn at most (max_new_tokens when the task leaves it unset)",
    "max_episode_tokens": "an agent task's tokens after the prompt per episode at most, the policy's and the environment's",
    "max_failed_share": "the share of a round's episodes that may fail before the round counts against the failure budget",
}
# where each framework sets what a remedy changes: lit_cancel's config keys (as `lit-cancel fit` takes them), TRL's
# GRPOConfig fields, verl's config keys
SETTING_KEYS = {
    "lit_cancel": {
        "max_new_tokens": "model.init_args.max_new_tokens",
        "temperature": "model.init_args.temperature",
        "kl_coef": "model.init_args.objective.init_args.kl_coef",
        "group_size": "data.init_args.group_size",
        # an agent task's limits (lit_cancel.agents.AgentTask); only lit_cancel's agent tasks log the series they explain
        "max_turns": "data.init_args.task.init_args.max_turns",
        "max_turn_tokens": "data.init_args.task.init_args.max_turn_tokens",
        "max_episode_tokens": "data.init_args.task.init_args.max_episode_tokens",
        "episode_timeout": "data.init_args.task.init_args.episode_timeout",
        # the failure budget of an agent task's episodes (lit_cancel.RolloutDataModule)
        "max_failed_share": "data.init_args.max_failed_share",
        "max_failed_rounds": "data.init_args.max_failed_rounds",
    },
    "trl": {"max_new_tokens": "max_completion_length", "temperature": "temperature", "kl_coef": "beta", "group_size": "num_generations"},
    "verl": {
        "max_new_tokens": "data.max_response_length",
        "temperature": "actor_rollout_ref.rollout.temperature",
        "kl_coef": "algorithm.kl_ctrl.kl_coef",  # the in-reward KL, whose penalty is the loss/kl verl logs
        "group_size": "actor_rollout_ref.rollout.n",
    },
}
Severity = Literal["severe", "warning"]


@dataclass(frozen=True)
class Series:
    """One scalar's history: ``values[i]`` was logged at optimizer step ``steps[i]``, steps increasing."""

    steps: tuple[int, ...]
    values: tuple[float, ...]

    def __post_init__(self) -> None:
        if len(self.steps) != len(self.values):
            raise ValueError(f"Series: {len(self.steps)} steps for {len(self.values)} values")

    def __len__(self) -> int:
        return len(self.values)

    def upto(self, step: int) -> "Series":
        """The points logged at or before ``step``."""
        count = sum(1 for s in self.steps if s <= step)
        return Series(self.steps[:count], self.values[:count])


@dataclass
class RunHistory:
    """A run's scalar series under the names of :data:`SERIES` (others are kept, and ignored by the rules), and the
    settings of :data:`SETTINGS` that are known.

    Example::

        history = RunHistory.from_points({"rollout/reward_mean": [(0, 0.1), (1, 0.2)]}, settings={"temperature": 1.0})
    """

    series: dict[str, Series] = field(default_factory=dict)
    settings: dict[str, float] = field(default_factory=dict)
    framework: str = "lit_cancel"

    @classmethod
    def from_points(cls, points: Mapping[str, Iterable[tuple[int, float]]], **kwargs: Any) -> "RunHistory":
        """From ``{name: [(step, value), ...]}``: points sorted by step, the last value of a repeated step kept,
        non-finite values dropped."""
        series = {}
        for name, pairs in points.items():
            by_step = {int(step): float(value) for step, value in pairs if math.isfinite(float(value))}
            if by_step:
                steps = tuple(sorted(by_step))
                series[name] = Series(steps, tuple(by_step[s] for s in steps))
        return cls(series, **kwargs)

    def __contains__(self, name: str) -> bool:
        return name in self.series and len(self.series[name]) > 0

    def values(self, name: str) -> tuple[float, ...]:
        return self.series[name].values if name in self.series else ()

    def steps(self, name: str) -> tuple[int, ...]:
        return self.series[name].steps if name in self.series else ()

    @property
    def last_step(self) -> int:
        return max((s.steps[-1] for s in self.series.values() if len(s)), default=-1)

    @property
    def first_step(self) -> int:
        return min((s.steps[0] for s in self.series.values() if len(s)), default=-1)

    def upto(self, step: int) -> "RunHistory":
        """The history as it was at ``step``: what a check at that step would have seen."""
        return RunHistory({n: s.upto(step) for n, s in self.series.items()}, dict(self.settings), self.framework)

    def setting_key(self, name: str) -> str:
        """Where the run's framework sets ``name`` (a name of :data:`SETTING_KEYS`), for a remedy to say."""
        return SETTING_KEYS.get(self.framework, SETTING_KEYS["lit_cancel"])[name]


@dataclass(frozen=True)
class Finding:
    """What a rule found: ``cause`` in one line, the ``evidence`` (which series, which steps, which values against which
    threshold) and the ``remedy`` (which setting, which way, how far)."""

    rule: str
    severity: Severity
    cause: str
    evidence: str
    remedy: str
    rank: int
    strength: float
    step: int

    def line(self) -> str:
        return f"[{self.severity}] {self.cause} Evidence: {self.evidence} Remedy: {self.remedy}"

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


class Rule:
    """A diagnosis: ``check`` returns a :class:`Finding` or None, from the series in ``needs`` (all of them present);
    ``rank`` orders findings of one severity (low first: a cause that explains the others, such as groups without
    a reward difference, before a symptom, such as entropy collapse)."""

    name: ClassVar[str]
    needs: ClassVar[tuple[str, ...]] = ()
    rank: ClassVar[int] = 100
    min_points: ClassVar[int] = 10

    def applies(self, history: RunHistory) -> bool:
        return all(name in history and len(history.series[name]) >= self.min_points for name in self.needs)

    def waits(self, history: RunHistory) -> bool:
        """Whether the run logs every series the rule needs, but not yet ``min_points`` of each: too early to judge."""
        return all(name in history for name in self.needs) and not self.applies(history)

    def check(self, history: RunHistory) -> Finding | None:
        raise NotImplementedError

    def finding(self, severity: Severity, cause: str, evidence: str, remedy: str, strength: float, history: RunHistory) -> Finding:
        return Finding(self.name, severity, cause, evidence, remedy, self.rank, float(strength), history.last_step)


RULES: dict[str, type[Rule]] = {}


def register(rule: type[Rule]) -> type[Rule]:
    """Adds ``rule`` to :data:`RULES` under its ``name`` (a class decorator)."""
    if rule.name in RULES and RULES[rule.name] is not rule:
        raise ValueError(f"a diagnosis named {rule.name!r} is registered already ({RULES[rule.name].__qualname__})")
    RULES[rule.name] = rule
    return rule


def rules_named(names: Sequence[str] | None) -> list[Rule]:
    """Instances of the registered rules called ``names`` (all of them when None); an unknown name raises ValueError
    naming the known ones."""
    unknown = sorted(set(names or ()) - set(RULES))
    if unknown:
        raise ValueError(f"unknown diagnoses {unknown}; known: {sorted(RULES)}")
    return [RULES[name]() for name in (names if names is not None else RULES)]


def diagnose(history: RunHistory, rules: Sequence[Rule] | None = None) -> list[Finding]:
    """Every finding of ``rules`` (all registered ones when None) that apply to ``history``, most explaining first."""
    findings = []
    for rule in rules if rules is not None else rules_named(None):
        if rule.applies(history):
            found = rule.check(history)
            if found is not None:
                findings.append(found)
    return sorted(findings, key=lambda f: (f.severity != "severe", f.rank, -f.strength))


# ---- summaries of a series, shared by the rules ----


def tail(values: Sequence[float], share: float = 0.25) -> Sequence[float]:
    """The last ``share`` of ``values`` (at least one)."""
    return values[-max(1, round(len(values) * share)) :]


def head(values: Sequence[float], share: float = 0.25) -> Sequence[float]:
    return values[: max(1, round(len(values) * share))]


def mean(values: Sequence[float]) -> float:
    return statistics.fmean(values) if values else math.nan
