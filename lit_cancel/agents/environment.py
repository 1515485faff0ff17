"""What an agent's episode runs against: an environment, reset from a task record, that answers each of the policy's turns.

An episode is the prompt, then the policy's turn, the environment's observation, the policy's next turn, and so on
until the environment says it is done or a limit is reached. The environment sees the policy's turns as text (their
stop token removed) and answers with text; the episode keeps every token as it was sampled or appended, so no turn is
ever tokenized twice (:mod:`lit_cancel.agents`).
"""

import functools
import inspect
import threading
import time
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
    """An environment's factory, ``reset``, ``step`` or ``reward`` raised, answered with something else than it must, or
    ran past the episode's ``episode_timeout``: one line naming the environment, the method, the turn and the record
    (``"val record 3"``); ``cause`` says which (one of :data:`~lit_cancel.rounds.failures.FAILURE_CAUSES`), None where
    no episode fails by it (a task's demonstration that cannot be replayed against its environment)."""

    def __init__(self, message: str, cause: str | None = None) -> None:
        super().__init__(message)
        self.cause = cause


class RanPastTimeout(Exception):
    """An environment's call ran past the time its episode had left."""


class EpisodeClock:
    """The time an episode's environment calls may take in all: ``limit`` seconds (the task's ``episode_timeout``), None
    for no limit. :meth:`call` runs a call within what is left; one that runs past it is left running in a daemon thread
    (its late answer dropped), as a tool's call that runs past its timeout is."""

    def __init__(self, limit: float | None = None) -> None:
        self.limit, self.spent = limit, 0.0

    def call(self, function: Callable, *args: object) -> object:
        """``function(*args)``; :class:`RanPastTimeout` where it runs past the time left (an exception it raises, raised)."""
        if self.limit is None:
            return function(*args)
        outcome: dict = {}

        def run() -> None:
            try:
                outcome["value"] = function(*args)
            except BaseException as error:  # noqa: BLE001 - raised again in the episode's thread
                outcome["error"] = error

        started = time.monotonic()
        thread = threading.Thread(target=run, daemon=True, name=f"environment-{getattr(function, '__name__', 'call')}")
        thread.start()
        thread.join(max(self.limit - self.spent, 0.0))
        self.spent += time.monotonic() - started
        if thread.is_alive():
            raise RanPastTimeout
        if "error" in outcome:
            raise outcome["error"]
        return outcome["value"]

    def overrun(self) -> str:
        return f"within episode_timeout={self.limit:g} s (all of an episode's environment calls)"


def factory_name(make: Callable[[], object]) -> str:
    """How messages name an environment factory: a class's or a function's qualified name (``MyEnvironment``,
    ``MyTask.environment``); for a ``functools.partial``, what it calls, or the class it builds where jsonargparse made it
    (a class named in a config is a partial of jsonargparse's instantiator and the class)."""
    while isinstance(make, functools.partial):
        classes = [argument for argument in make.args if inspect.isclass(argument)]
        make = classes[0] if classes and getattr(make.func, "__module__", "").startswith("jsonargparse") else make.func
    return (getattr(make, "__qualname__", None) or type(make).__name__).rpartition("<locals>.")[2]


def new_environment(make: Callable[[], Environment], when: str, clock: EpisodeClock | None = None) -> Environment:
    """``make()``, checked: an :class:`Environment`, else :class:`EnvironmentFailure` naming the factory and ``when``
    (``"at start-up"``, ``"for val record 3"``); within the time ``clock`` leaves, where given."""
    clock = clock or EpisodeClock()
    try:
        environment = clock.call(make)
    except RanPastTimeout:
        raise EnvironmentFailure(f"the environment factory {factory_name(make)} did not answer {when} {clock.overrun()}",
                                 "timeout") from None
    except Exception as error:
        raise EnvironmentFailure(
            f"the environment factory {factory_name(make)} raised {when}: {type(error).__name__}: {error}", "factory_raised"
        ) from error
    if not isinstance(environment, Environment):
        raise EnvironmentFailure(
            f"the environment factory {factory_name(make)} returned {type(environment).__name__} {when}; it must return an "
            "Environment (lit_cancel.agents.Environment)", "factory_wrong_type"
        )
    return environment


def reset_episode(environment: Environment, record: Record, where: str, clock: EpisodeClock | None = None) -> str | None:
    """``environment.reset(record)``, checked: a text or None, else :class:`EnvironmentFailure` naming ``where`` (the
    record, e.g. ``"train record 12"``); within the time ``clock`` leaves, where given."""
    name, clock = environment.method_name("reset"), clock or EpisodeClock()
    try:
        text = clock.call(environment.reset, record)
    except RanPastTimeout:
        raise EnvironmentFailure(f"{name} did not answer on {where} {clock.overrun()}", "timeout") from None
    except Exception as error:
        raise EnvironmentFailure(f"{name} raised on {where}: {type(error).__name__}: {error}", "reset_raised") from error
    if text is not None and not isinstance(text, str):
        raise EnvironmentFailure(f"{name} returned {type(text).__name__} on {where}; it must return text or None", "reset_wrong_type")
    return text


def step_episode(environment: Environment, action: str, turn: int, where: str, clock: EpisodeClock | None = None) -> Observation:
    """``environment.step(action)`` at turn ``turn`` (1 for the first), checked: an :class:`Observation`, else
    :class:`EnvironmentFailure` naming the turn and ``where``; within the time ``clock`` leaves, where given."""
    name, clock = environment.method_name("step"), clock or EpisodeClock()
    try:
        observation = clock.call(environment.step, action)
    except RanPastTimeout:
        raise EnvironmentFailure(f"{name} did not answer at turn {turn} of {where} {clock.overrun()}", "timeout") from None
    except Exception as error:
        raise EnvironmentFailure(f"{name} raised at turn {turn} of {where}: {type(error).__name__}: {error}",
                                 "step_raised") from error
    if not isinstance(observation, Observation):
        raise EnvironmentFailure(
            f"{name} returned {type(observation).__name__} at turn {turn} of {where}; it must return an Observation",
            "step_wrong_type"
        )
    return observation


def episode_reward(environment: Environment, where: str, clock: EpisodeClock | None = None) -> object:
    """``environment.reward()`` of the finished episode, within the time ``clock`` leaves, where given; one that raises
    or runs past it becomes :class:`EnvironmentFailure` naming ``where`` (the value itself is checked as any reward is)."""
    name, clock = environment.method_name("reward"), clock or EpisodeClock()
    try:
        return clock.call(environment.reward)
    except RanPastTimeout:
        raise EnvironmentFailure(f"{name} did not answer on {where} {clock.overrun()}", "timeout") from None
    except Exception as error:
        raise EnvironmentFailure(f"{name} raised on {where}: {type(error).__name__}: {error}", "reward_raised") from error
