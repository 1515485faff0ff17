"""What an agent's episode runs against: an environment, reset from a task record, that answers each of the policy's turns.

An episode is the prompt, then the policy's turn, the environment's observation, the policy's next turn, and so on
until the environment says it is done or a limit is reached. The environment sees the policy's turns as text (their
stop token removed) and answers with text; the episode keeps every token as it was sampled or appended, so no turn is
ever tokenized twice (:mod:`lit_cancel.agents`).
"""

import functools
import inspect
from abc import ABC, abstractmethod
from collections.abc import Callable
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

    def method_name(self, method: str) -> str:
        """How messages name this environment's ``method`` (``"reset"``, ``"step"``, ``"reward"``): ``Class.method``; an
        environment that adapts one written for another framework names the class and method its user wrote."""
        return f"{type(self).__name__}.{method}"


class EnvironmentFailure(RuntimeError):
    """An environment's factory, ``reset``, ``step`` or ``reward`` raised, or answered with something else than it must:
    one line naming the environment, the method, the turn and the record (``"val record 3"``)."""


def factory_name(make: Callable[[], object]) -> str:
    """How messages name an environment factory: a class's or a function's qualified name (``MyEnvironment``,
    ``MyTask.environment``); for a ``functools.partial``, what it calls, or the class it builds where jsonargparse made it
    (a class named in a config is a partial of jsonargparse's instantiator and the class)."""
    while isinstance(make, functools.partial):
        classes = [argument for argument in make.args if inspect.isclass(argument)]
        make = classes[0] if classes and getattr(make.func, "__module__", "").startswith("jsonargparse") else make.func
    return (getattr(make, "__qualname__", None) or type(make).__name__).rpartition("<locals>.")[2]


def new_environment(make: Callable[[], Environment], when: str) -> Environment:
    """``make()``, checked: an :class:`Environment`, else :class:`EnvironmentFailure` naming the factory and ``when``
    (``"at start-up"``, ``"for val record 3"``)."""
    try:
        environment = make()
    except Exception as error:
        raise EnvironmentFailure(
            f"the environment factory {factory_name(make)} raised {when}: {type(error).__name__}: {error}"
        ) from error
    if not isinstance(environment, Environment):
        raise EnvironmentFailure(
            f"the environment factory {factory_name(make)} returned {type(environment).__name__} {when}; it must return an "
            "Environment (lit_cancel.agents.Environment)"
        )
    return environment


def reset_episode(environment: Environment, record: Record, where: str) -> str | None:
    """``environment.reset(record)``, checked: a text or None, else :class:`EnvironmentFailure` naming ``where`` (the
    record, e.g. ``"train record 12"``)."""
    name = environment.method_name("reset")
    try:
        text = environment.reset(record)
    except Exception as error:
        raise EnvironmentFailure(f"{name} raised on {where}: {type(error).__name__}: {error}") from error
    if text is not None and not isinstance(text, str):
        raise EnvironmentFailure(f"{name} returned {type(text).__name__} on {where}; it must return text or None")
    return text


def step_episode(environment: Environment, action: str, turn: int, where: str) -> Observation:
    """``environment.step(action)`` at turn ``turn`` (1 for the first), checked: an :class:`Observation`, else
    :class:`EnvironmentFailure` naming the turn and ``where``."""
    name = environment.method_name("step")
    try:
        observation = environment.step(action)
    except Exception as error:
        raise EnvironmentFailure(f"{name} raised at turn {turn} of {where}: {type(error).__name__}: {error}") from error
    if not isinstance(observation, Observation):
        raise EnvironmentFailure(
            f"{name} returned {type(observation).__name__} at turn {turn} of {where}; it must return an Observation"
        )
    return observation


def episode_reward(environment: Environment, where: str) -> object:
    """``environment.reward()`` of the finished episode; one that raises becomes :class:`EnvironmentFailure` naming
    ``where`` (the value itself is checked as any reward is)."""
    try:
        return environment.reward()
    except Exception as error:
        raise EnvironmentFailure(
            f"{environment.method_name('reward')} raised on {where}: {type(error).__name__}: {error}"
        ) from error
