"""TRL's reward functions, called on finished episodes as TRL 1.16's ``GRPOTrainer`` calls them.

A reward function is called once per draw of episodes as ``f(prompts=..., completions=..., completion_ids=...,
environments=..., trainer_state=None, log_extra=..., log_metric=..., **columns)``, the columns being the rows' other
fields as lists, and returns one number or None per episode. An episode's reward is TRL's: the sum of each function's
value times its weight, plus the environment's own reward (a TRL environment's ``get_reward``) with weight 1, Nones
left out. Where every function and the environment give None, the task's ``reward(record, transcript)`` scores the
episode (TRL leaves it unscored).

What lit_cancel passes: ``prompts``, each row's prompt as the dataset gives it (text or chat messages; TRL adds the
environment's ``reset`` text and, for chat messages, the tool calls and their results); ``completions``, the
episode's transcript as text (turns and observations), or for chat-message prompts one assistant message per turn of
the policy (``{"role": "assistant", "content": turn}``, the calls not parsed, the observations left out, as TRL's
tool results are); ``completion_ids``, the episode's tokens after the prompt, the environment's included, as TRL's;
``environments``, each episode's TRL environment instance (or :class:`~lit_cancel.agents.Environment`);
``trainer_state``, None; ``log_extra``, which drops what it is given; ``log_metric(name, value)``, logged as
``rollout/reward_metric/NAME``, the mean of a draw's values.
"""

import functools
import importlib
import math
import warnings
from collections import defaultdict
from collections.abc import Callable, Sequence

from lit_cancel.agents.environment import EnvironmentFailure, episode_reward
from lit_cancel.agents.episodes import Episode
from lit_cancel.agents.trl_environment import TRLEnvironment, awaited, dataset_row
from lit_cancel.rounds.score import RewardError, checked_reward
from lit_cancel.tasks import Record

CALLED_AS = ("a reward function is called as TRL calls it, f(prompts=..., completions=..., completion_ids=..., "
             "environments=..., **columns), and returns one number or None per completion")


def reward_function_name(function: Callable) -> str:
    """How TRL names a reward function: its ``__name__`` (of what a partial wraps), else its class's."""
    while isinstance(function, functools.partial):
        function = function.func
    return getattr(function, "__name__", type(function).__name__)


def resolved(function: Callable | str, option: str) -> Callable:
    """``function``, or the callable its import path (``my_rewards.accuracy``) names; ValueError in one line naming
    ``option`` where it names nothing callable."""
    if callable(function):
        return function
    expected = "expected a function or the import path (module.function) of one, as TRL's reward_funcs take them"
    module, _, name = str(function).rpartition(".")
    if not isinstance(function, str) or not module:
        raise ValueError(f"{option}: {function!r} is not an import path; {expected}")
    try:
        value = getattr(importlib.import_module(module), name)
    except ModuleNotFoundError as error:
        raise ValueError(f"{option}: {function} was not found: no module named {error.name!r} on the Python path; {expected}") from None
    except AttributeError:
        raise ValueError(f"{option}: {function} was not found: module {module!r} has no attribute {name!r}; {expected}") from None
    if not callable(value):
        raise ValueError(f"{option}: {function} is a {type(value).__name__}, not callable; {expected}")
    return value


def named(wheres: Sequence[str]) -> str:
    """Records for a message: ``"train record 3"``, ``"train record 3, train record 5 and 6 more"``."""
    unique = list(dict.fromkeys(wheres))
    shown = ", ".join(unique[:2])
    return shown if len(unique) <= 2 else f"{shown} and {len(unique) - 2} more"


def trl_instance(episode: Episode) -> object:
    """What TRL's ``environments`` holds for an episode: the TRL environment instance, else the environment itself."""
    environment = episode.environment
    return environment.instance if isinstance(environment, TRLEnvironment) else environment


def environment_reward(episode: Episode) -> float | None:
    """The episode's environment's own reward (a TRL environment's ``get_reward``), checked as any reward is; None where
    it gives none, or where it raises or runs past the episode's time: the episode then fails (its row inert)."""
    try:
        value = episode_reward(episode.environment, episode.where, episode.clock)
        return None if value is None else checked_reward(value, episode.environment.method_name("reward"), f"on {episode.where}")
    except EnvironmentFailure as error:
        episode.fail(error)
    except RewardError as error:
        episode.fail(EnvironmentFailure(str(error), "reward_wrong_type"))
    return None


def completion(row: Record, episode: Episode) -> str | list[dict]:
    """The episode as TRL's ``completions`` holds it: one assistant message per turn of the policy where the row's prompt
    is chat messages, else the transcript as text."""
    if isinstance(row["prompt"], list):
        return [{"role": "assistant", "content": turn} for turn in episode.turn_texts()]
    return "".join(episode.transcript)


class RewardFunctions:
    """TRL's ``reward_funcs`` with their ``reward_weights``, scoring finished episodes with their environments at hand
    (an :data:`~lit_cancel.agents.episodes.EpisodeScorer`).

    Args:
        functions: callables, or import paths of them (``my_rewards.accuracy``).
        weights: one per function; 1.0 each when None.
    """

    def __init__(self, functions: Sequence[Callable | str], weights: Sequence[float] | None = None):
        self.functions = [resolved(function, f"EnvironmentTask: reward_funcs[{index}]") for index, function in enumerate(functions)]
        if weights is None:
            weights = [1.0] * len(self.functions)
        if len(weights) != len(self.functions):
            raise ValueError(f"EnvironmentTask: reward_weights has {len(weights)} values for {len(self.functions)} reward "
                             "functions; give one weight per function (the environment's get_reward has weight 1), as TRL's "
                             "reward_weights")
        if not all(isinstance(w, int | float) and not isinstance(w, bool) and math.isfinite(w) for w in weights):
            raise ValueError(f"EnvironmentTask: reward_weights must be finite numbers, got {list(weights)!r}")
        self.weights = [float(w) for w in weights]
        self.names = [reward_function_name(function) for function in self.functions]
        self.warned_unscored = False

    def __call__(self, records: list[Record], episodes: list[Episode]) -> tuple[list[float], dict[str, float]]:
        """Each episode's reward (NaN where every function and the environment give None) and ``rollout/reward/NAME``,
        the mean of each function's and the environment's values that are not None, with ``log_metric``'s values."""
        rows = [dataset_row(record) for record in records]
        wheres = [episode.where for episode in episodes]
        metrics: dict[str, list[float]] = defaultdict(list)
        sources = [(name, weight, self.called(index, rows, episodes, wheres, lambda key, value: metrics[key].append(float(value))))
                   for index, (name, weight) in enumerate(zip(self.names, self.weights, strict=True))]
        environment_values = [environment_reward(episode) for episode in episodes]
        if any(value is not None for value in environment_values):
            sources.append((type(trl_instance(episodes[0])).__name__, 1.0, environment_values))
        rewards = []
        for index in range(len(episodes)):
            given = [weight * column[index] for _, weight, column in sources if column[index] is not None]
            rewards.append(math.fsum(given) if given else math.nan)
        if not self.warned_unscored and any(map(math.isnan, rewards)):
            self.warned_unscored = True
            unscored = [where for where, reward in zip(wheres, rewards, strict=True) if math.isnan(reward)]
            warnings.warn(f"every reward function and the environment returned None on {named(unscored)}: the task's reward "
                          "scores such an episode (TRL would leave it unscored); said once", stacklevel=2)
        stats = {f"rollout/reward/{name}": sum(scored) / len(scored)
                 for name, _, column in sources if (scored := [v for v in column if v is not None])}
        return rewards, stats | {f"rollout/reward_metric/{name}": sum(logged) / len(logged) for name, logged in metrics.items()}

    def arguments(self, rows: list[Record], episodes: list[Episode], indices: Sequence[int],
                  log_metric: Callable[[str, float], None]) -> dict:
        """The keyword arguments of a call on the episodes ``indices``, as TRL gives them."""
        chosen = [rows[i] for i in indices]
        columns = {key: [row.get(key) for row in chosen] for key in chosen[0] if key not in ("prompt", "completion", "completion_ids")}
        return columns | {
            "prompts": [row["prompt"] for row in chosen],
            "completions": [completion(rows[i], episodes[i]) for i in indices],
            "completion_ids": [list(episodes[i].tokens) for i in indices],
            "environments": [trl_instance(episodes[i]) for i in indices],
            "trainer_state": None,
            "log_extra": lambda column, values: None,
            "log_metric": log_metric,
        }

    def called(self, index: int, rows: list[Record], episodes: list[Episode], wheres: list[str],
               log_metric: Callable[[str, float], None]) -> list[float | None]:
        """Function ``index`` on every episode, its values checked: :class:`RewardError` in one line naming the function
        and the record where it raises (found by calling it on one episode at a time), returns another count of values,
        or a value that is neither a finite number nor None."""
        function, name, count = self.functions[index], f"the reward function {self.names[index]}", len(episodes)
        try:
            values = awaited(function(**self.arguments(rows, episodes, range(count), log_metric)))
        except Exception as error:
            where = self.first_raising(function, rows, episodes, wheres) or f"the {count} episodes of {named(wheres)}"
            raise RewardError(f"{name} raised {type(error).__name__}: {error} on {where}") from error
        if isinstance(values, str | bytes | dict) or not hasattr(values, "__len__"):
            raise RewardError(f"{name} returned {type(values).__name__} on {named(wheres)}; expected a list of one number or "
                              "None per completion")
        if len(values) != count:
            raise RewardError(f"{name} returned {len(values)} values for {count} completions ({named(wheres)}); expected one "
                              "number or None per completion")
        return [None if value is None else checked_reward(value, name, f"on {where}")
                for value, where in zip(list(values), wheres, strict=True)]

    def first_raising(self, function: Callable, rows: list[Record], episodes: list[Episode], wheres: list[str]) -> str | None:
        """The record of the first episode that ``function`` raises on alone; None where it raises on none alone."""
        for index in range(len(episodes)):
            try:
                awaited(function(**self.arguments(rows, episodes, [index], lambda key, value: None)))
            except Exception:
                return wheres[index]
        return None
