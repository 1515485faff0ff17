"""Failed episodes: which rows of a round are inert, what a round counts of them, and the budget that stops a run whose
environment keeps failing.

An agent's episode fails when its environment does: its factory, ``reset``, ``step`` or ``reward`` raises or answers with
the wrong type, or its calls run past the task's ``episode_timeout``. :func:`~lit_cancel.agents.episodes.run_episodes`
marks such an episode with a :class:`Failure` and runs the others on. The group rule (docs/agents.md): the failed row stays
in its round, so group sizes and the plans' cuts are unchanged, but it is inert: none of its tokens is credited (its
completion mask is zero) and its group's advantages are computed over the members that did not fail (a group with fewer
than 2 of them gets advantage 0), so they still sum to zero over the members that train.
"""

import math
from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import torch
from torch import Tensor

# why an episode failed, as the per-cause series (rollout/failed_episodes/<cause>) and the messages name it
FAILURE_CAUSES = (
    "factory_raised", "factory_wrong_type", "reset_raised", "reset_wrong_type", "step_raised", "step_wrong_type",
    "reward_raised", "reward_wrong_type", "timeout", "program_raised",
)


@dataclass(frozen=True)
class Failure:
    """Why an episode failed: ``cause``, one of :data:`FAILURE_CAUSES`, and the one-line ``message`` that names the
    environment's class and method, the turn and the record (``"MyEnvironment.step raised at turn 2 of train record 12:
    KeyError: 'x'"``)."""

    cause: str
    message: str

    def __post_init__(self) -> None:
        if self.cause not in FAILURE_CAUSES:
            raise ValueError(f"unknown failure cause {self.cause!r}; the causes: {', '.join(FAILURE_CAUSES)}")


class FailedEpisodes(RuntimeError):
    """More episodes failed than the run allows: its budget (``max_failed_share``, ``max_failed_rounds``) is spent, or the
    validation before training failed more than ``max_failed_share`` of its episodes."""


def failure_codes(failures: Sequence[Failure | None]) -> Tensor:
    """``[B]`` what :attr:`~lit_cancel.batch.RolloutBatch.failure` holds: 0 where the episode ran, else 1 + the index of its
    cause in :data:`FAILURE_CAUSES`."""
    return torch.tensor([0 if f is None else FAILURE_CAUSES.index(f.cause) + 1 for f in failures], dtype=torch.long)


def varied_groups(rewards: Tensor, members: Tensor | None = None) -> Tensor:
    """``[G]`` whether each group (a row of ``rewards``, ``[G, n]``) has a reward difference among its ``members``
    (``[G, n]`` bool, every row's when None): at least two members whose rewards differ, so nonzero advantages."""
    if members is None:
        return (rewards != rewards[:, :1]).any(1)
    highest = torch.where(members, rewards, -math.inf).amax(1)
    lowest = torch.where(members, rewards, math.inf).amin(1)
    return (members.sum(1) >= 2) & (highest > lowest)


@dataclass
class FailureCount:
    """The failed episodes among ``episodes``, by cause, and the first message of each cause (it names the record).

    Attributes:
        episodes: episodes counted, failed or not.
        by_cause: failed episodes by cause.
        first: the first failure's message of each cause.
    """

    episodes: int = 0
    by_cause: Counter = field(default_factory=Counter)
    first: dict[str, str] = field(default_factory=dict)

    def add(self, failures: Sequence[Failure | None]) -> None:
        """Counts the episodes of ``failures`` (one entry an episode, None where it ran)."""
        self.episodes += len(failures)
        for failure in failures:
            if failure is not None:
                self.by_cause[failure.cause] += 1
                self.first.setdefault(failure.cause, failure.message)

    @property
    def failed(self) -> int:
        return sum(self.by_cause.values())

    @property
    def share(self) -> float:
        return self.failed / self.episodes if self.episodes else 0.0

    def stats(self, name: str) -> dict[str, float]:
        """``{name: share}`` and ``{name/<cause>: share of the episodes that failed by it}`` for every cause."""
        episodes = max(self.episodes, 1)
        return {name: self.share} | {f"{name}/{cause}": self.by_cause[cause] / episodes for cause in FAILURE_CAUSES}

    def summed(self, sum_over_processes: Callable[[Tensor], Tensor], device: torch.device | str = "cpu") -> "FailureCount":
        """The counts summed over the processes (every process calls it, with a tensor on ``device``, the one its
        collectives take); the messages stay this process's."""
        counts = torch.tensor([self.episodes] + [self.by_cause[cause] for cause in FAILURE_CAUSES], dtype=torch.float64,
                              device=device)
        counts = sum_over_processes(counts).tolist()
        by_cause = Counter({cause: round(n) for cause, n in zip(FAILURE_CAUSES, counts[1:], strict=True) if n})
        return FailureCount(round(counts[0]), by_cause, dict(self.first))

    def most_frequent(self) -> str:
        """The cause of the most failures (the first in :data:`FAILURE_CAUSES` of those tied), with its count and an
        example: ``"step_raised (5 of them), e.g. MyEnvironment.step raised at turn 1 of train record 3: ..."``."""
        cause = max(FAILURE_CAUSES, key=lambda c: (self.by_cause[c], -FAILURE_CAUSES.index(c)))
        example = self.first.get(cause, "on another process")
        return f"{cause} ({self.by_cause[cause]} of them), e.g. {example}"


class FailureBudget:
    """How many failed episodes a run accepts: a round whose share of failed episodes is above ``max_failed_share`` is a
    bad round, and ``max_failed_rounds`` bad rounds in a row stop it. :attr:`bad_rounds` (the bad rounds in a row so far)
    is the state a checkpoint keeps.

    Args:
        max_failed_share: the share of a round's episodes that may fail, in ``[0, 1]``; 0: any failure makes a bad round.
        max_failed_rounds: bad rounds in a row that stop the run, at least 1.
        option: how messages name the options (``"data.init_args."``).
    """

    def __init__(self, max_failed_share: float, max_failed_rounds: int, option: str = "") -> None:
        if not 0 <= max_failed_share <= 1:
            raise ValueError(f"max_failed_share must be in [0, 1], got {max_failed_share}")
        if max_failed_rounds < 1:
            raise ValueError(f"max_failed_rounds must be >= 1, got {max_failed_rounds}")
        self.max_failed_share, self.max_failed_rounds, self.option = max_failed_share, max_failed_rounds, option
        self.bad_rounds = 0

    def exceeded(self, count: FailureCount) -> bool:
        return count.share > self.max_failed_share

    def judge(self, count: FailureCount) -> str | None:
        """Counts a round whose episodes failed as ``count`` says (summed over the processes); the one-line reason to stop
        when the budget is spent, else None."""
        self.bad_rounds = self.bad_rounds + 1 if self.exceeded(count) else 0
        if self.bad_rounds < self.max_failed_rounds:
            return None
        rounds = "a round" if self.max_failed_rounds == 1 else f"{self.bad_rounds} rounds in a row"
        return (f"{rounds} had more than {self.option}max_failed_share={self.max_failed_share:g} of their episodes fail "
                f"({self.option}max_failed_rounds={self.max_failed_rounds}); in the last, {count.failed} of {count.episodes} "
                f"({count.share:.0%}), most often {count.most_frequent()}")

    def validation_message(self, count: FailureCount) -> str:
        """The one-line reason a validation whose episodes failed as ``count`` says is refused."""
        return (f"{count.failed} of {count.episodes} episodes of the validation failed ({count.share:.0%}, more than "
                f"{self.option}max_failed_share={self.max_failed_share:g}), most often {count.most_frequent()}")
