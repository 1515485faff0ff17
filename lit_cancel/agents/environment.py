"""What an agent's episode runs against: an environment, reset from a task record, that answers each of the policy's turns.

An episode is the prompt, then the policy's turn, the environment's observation, the policy's next turn, and so on
until the environment says it is done or a limit is reached. The environment sees the policy's turns as text (their
stop token removed) and answers with text; the episode keeps every token as it was sampled or appended, so no turn is
ever tokenized twice (:mod:`lit_cancel.agents`).
"""

from abc import ABC, abstractmethod
from dataclasses import dataclass

from lit_cancel.tasks import Record


@dataclass(frozen=True)
class Observation:
    """The environment's answer to one turn of the policy.

    Attributes:
        text: what the policy reads next (appended to the episode as tokens, never trained); empty where ``done``
            needs no reply.
        done: the episode is over: the environment takes no more turns.
        tool_calls: tool calls the turn made.
        tool_errors: of those, the calls that failed (raised, timed out, were malformed or named no tool).
        tool_output_faults: of those, the calls whose output the policy read repaired (cut at the longest output read,
            or not UTF-8).
    """

    text: str
    done: bool = False
    tool_calls: int = 0
    tool_errors: int = 0
    tool_output_faults: int = 0


class Environment(ABC):
    """One episode's world. A new instance (or a :meth:`reset` one) per episode, so episodes share no state.

    Example::

        class Guess(Environment):
            def reset(self, record):
                self.secret = record["secret"]
                return None

            def step(self, action):
                guess = int(action) if action.strip().isdigit() else -1
                if guess == self.secret:
                    return Observation("", done=True)
                return Observation("higher" if guess < self.secret else "lower")
    """

    @abstractmethod
    def reset(self, record: Record) -> str | None:
        """Starts an episode on ``record`` (a row of the task's data); returns text appended to its prompt, or None."""

    @abstractmethod
    def step(self, action: str) -> Observation:
        """The environment's answer to the policy's turn ``action``."""

    def reward(self) -> float | None:
        """The finished episode's reward where the environment owns it (it read the state the episode left); None: the
        task's reward scores the episode."""
        return None


class EnvironmentFailure(RuntimeError):
    """An environment's ``reset`` or ``step`` raised, or answered with something else than it must: the run stops, in
    one line naming the environment, the method, the turn and the record."""


def reset_episode(environment: Environment, record: Record, where: str) -> str | None:
    """``environment.reset(record)``, checked: a text or None, else :class:`EnvironmentFailure` naming ``where`` (the
    record, e.g. ``"train row 12"``)."""
    name = type(environment).__name__
    try:
        text = environment.reset(record)
    except Exception as error:
        raise EnvironmentFailure(f"{name}.reset raised on {where}: {type(error).__name__}: {error}") from error
    if text is not None and not isinstance(text, str):
        raise EnvironmentFailure(f"{name}.reset returned {type(text).__name__} on {where}; it must return text or None")
    return text


def step_episode(environment: Environment, action: str, turn: int, where: str) -> Observation:
    """``environment.step(action)`` at turn ``turn`` (1 for the first), checked: an :class:`Observation`, else
    :class:`EnvironmentFailure` naming the turn and ``where``."""
    name = type(environment).__name__
    try:
        observation = environment.step(action)
    except Exception as error:
        raise EnvironmentFailure(f"{name}.step raised at turn {turn} of {where}: {type(error).__name__}: {error}") from error
    if not isinstance(observation, Observation):
        raise EnvironmentFailure(
            f"{name}.step returned {type(observation).__name__} at turn {turn} of {where}; it must return an Observation"
        )
    return observation


def episode_reward(environment: Environment, where: str) -> object:
    """``environment.reward()`` of the finished episode; one that raises becomes :class:`EnvironmentFailure` naming
    ``where`` (the value itself is checked as any reward is)."""
    try:
        return environment.reward()
    except Exception as error:
        raise EnvironmentFailure(f"{type(environment).__name__}.reward raised on {where}: {type(error).__name__}: {error}") from error
