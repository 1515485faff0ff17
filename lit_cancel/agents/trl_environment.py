"""Environments written for TRL's ``GRPOTrainer(environment_factory=...)``, run as lit_cancel environments.

TRL's shape: a callable returns one environment instance per rollout; the instance's public methods (typed, with
docstrings) are the tools; ``reset(**row)`` gets the dataset row's fields and returns None or text appended to the
prompt; an optional ``get_reward()`` scores the finished rollout from the instance's state. :func:`from_trl_factory`
turns such a callable into a factory of :class:`TRLEnvironment`, which runs the tools as :class:`ToolEnvironment`
runs any (timeouts, capped output, errors the policy reads) and owns the reward where ``get_reward`` is defined. Messages
name the TRL class and its methods (``MyEnv.reset``, ``MyEnv.get_reward``), not the adapter.

``reset`` gets the dataset row as the task gave it, its prompt included as the row has it (text or chat messages), also
where an :class:`~lit_cancel.agents.EnvironmentTask` rendered the prompt with a chat template (:func:`dataset_row`).
"""

import asyncio
import inspect
from collections.abc import Callable

from lit_cancel.agents.environment import factory_name
from lit_cancel.agents.tools import CallFormat, ToolEnvironment
from lit_cancel.tasks import Record

UNRENDERED_PROMPT = "prompt_before_chat_template"
"""The field of a record whose prompt a chat template rendered that holds the prompt as the task gave it."""


def rendered(record: Record, prompt: str) -> Record:
    """``record`` with ``prompt``, the chat template's rendering of its prompt (the policy's prompt), in its place, and
    the prompt it had in :data:`UNRENDERED_PROMPT` (a field, so that copies of the record keep it)."""
    return {**record, "prompt": prompt, UNRENDERED_PROMPT: record["prompt"]}


def dataset_row(record: Record) -> Record:
    """The row ``record`` was made from: its fields with the prompt as the task gave it (text or chat messages) where a
    chat template rendered it (:func:`rendered`), else the record itself."""
    if UNRENDERED_PROMPT not in record:
        return record
    row = {name: value for name, value in record.items() if name != UNRENDERED_PROMPT}
    return row | {"prompt": record[UNRENDERED_PROMPT]}


def awaited(value: object) -> object:
    """``value``, or what it gives where it is awaitable (a TRL ``get_reward`` or reward function written ``async``)."""
    return asyncio.run(value) if inspect.isawaitable(value) else value


def public_methods(instance: object) -> list[Callable]:
    """The instance's tools as TRL finds them: the public functions of its class other than ``reset`` and
    ``get_reward``, bound to the instance (properties are not evaluated)."""
    return [getattr(instance, name) for name, _ in inspect.getmembers(type(instance), predicate=inspect.isfunction)
            if not name.startswith("_") and name not in ("reset", "get_reward")]


class TRLEnvironment(ToolEnvironment):
    """One instance of a TRL ``environment_factory``: its public methods are the tools, its ``reset`` takes the record's
    fields, its ``get_reward`` (where defined) the episode's reward.

    Args:
        instance: what the factory returned.
        calls, timeout, max_output_chars, max_calls_per_turn: as :class:`ToolEnvironment`.
    """

    def __init__(self, instance: object, calls: CallFormat | None = None, timeout: float = 10.0, max_output_chars: int = 2000,
                 max_calls_per_turn: int = 8):
        name = type(instance).__name__
        if not callable(getattr(instance, "reset", None)):
            raise ValueError(f"{name}: an environment_factory's instance must define reset(**row), as TRL requires")
        super().__init__(public_methods(instance), calls, timeout, max_output_chars, max_calls_per_turn)
        self.instance = instance

    def reset(self, record: Record) -> str | None:
        return self.instance.reset(**dataset_row(record))

    def reward(self) -> float | None:
        get_reward = getattr(self.instance, "get_reward", None)
        return None if get_reward is None else awaited(get_reward())

    def method_name(self, method: str) -> str:
        if method in ("reset", "reward"):
            return f"{type(self.instance).__name__}.{'get_reward' if method == 'reward' else method}"
        return super().method_name(method)


def from_trl_factory(factory: Callable[[], object], **options) -> Callable[[], TRLEnvironment]:
    """A factory of :class:`TRLEnvironment`, one new TRL instance each; ``options`` as :class:`TRLEnvironment` takes them.
    It bears the name of ``factory``, which messages give. A start-up check builds one
    (:meth:`~lit_cancel.agents.AgentTask.check_environment`), so that a factory whose tools lack docstrings is refused
    before anything runs."""

    def make() -> TRLEnvironment:
        return TRLEnvironment(factory(), **options)

    make.__qualname__ = factory_name(factory)
    return make
