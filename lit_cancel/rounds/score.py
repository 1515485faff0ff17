"""The score stage: each completion's reward and correctness by the task, checked.

A task's ``reward`` must return a finite number and its ``correct`` a bool or None; anything else, or a call that raises,
is a :class:`RewardError` naming the prompt and the completion. :func:`check_reward` calls both once at start-up;
validation scores its samples with :func:`accuracy_terms`.
"""

import math
import numbers

import torch
from torch import Tensor

from lit_cancel.rounds.sample import Generation
from lit_cancel.tasks import Record, Task


class RewardError(RuntimeError):
    """A task's reward function raised on a completion, or returned something that is not a finite number; or its
    ``correct`` raised, or returned something other than a bool or None."""


def checked_reward(reward: object, source: str, where: str) -> float:
    """``reward`` as a float: a finite real number (bool, int, float, a numpy scalar or a one-element tensor).

    Anything else raises :class:`RewardError` naming ``source`` and ``where``. A numeric string is
    refused too: ``"1.0"`` usually means a reward function that formats instead of scoring.
    """
    if isinstance(reward, Tensor) and reward.numel() == 1:
        reward = reward.item()
    if isinstance(reward, numbers.Real) and math.isfinite(reward):
        return float(reward)
    raise RewardError(f"{source} returned {reward!r} ({type(reward).__name__}), expected a finite number, {where}")


def judged(task: Task, method: str, check, records: list[Record], completions: list[str]) -> Tensor:
    """``check(task.<method>(records[i], completions[i]), source, where)`` for each pair; a method that raises is named
    with its input, as ``check`` names a value it refuses."""
    source = f"{type(task).__name__}.{method}"
    values = []
    for record, completion in zip(records, completions, strict=True):
        where = f"on prompt {record['prompt']!r} and completion {completion!r}"
        try:
            value = getattr(task, method)(record, completion)
        except Exception as error:
            raise RewardError(f"{source} raised {type(error).__name__}: {error} {where}") from error
        values.append(check(value, source, where))
    return torch.tensor(values)


def score(task: Task, records: list[Record], completions: list[str], given: Tensor | None = None) -> Tensor:
    """Rewards of ``completions[i]`` for ``records[i]``: ``given[i]`` where the rollout has one (not NaN), else the
    task's; a reward function that raises or returns a non-number is named with its input."""
    if given is None:
        return judged(task, "reward", checked_reward, records, completions)
    rewards = given.detach().cpu().float().clone()
    unscored = torch.nonzero(rewards.isnan()).squeeze(1).tolist()
    if unscored:
        rewards[unscored] = judged(task, "reward", checked_reward, [records[i] for i in unscored], [completions[i] for i in unscored])
    return rewards


def checked_verdict(verdict: object, source: str, where: str) -> float:
    """``verdict`` of a task's ``correct`` as 1.0 or 0.0 (True or False, 1 or 0, also as a numpy scalar or a
    one-element tensor), NaN for None; anything else raises :class:`RewardError` naming ``source`` and ``where``."""
    if isinstance(verdict, Tensor) and verdict.numel() == 1 or getattr(verdict, "shape", None) == ():
        verdict = verdict.item()
    if verdict is None:
        return math.nan
    if isinstance(verdict, numbers.Real) and verdict in (0, 1):
        return float(verdict)
    raise RewardError(f"{source} returned {verdict!r} ({type(verdict).__name__}), expected True, False or None, {where}")


def correctness(task: Task, records: list[Record], completions: list[str]) -> Tensor:
    """Whether ``completions[i]`` is correct for ``records[i]`` by ``task.correct``: 1.0, 0.0, or NaN where the task
    cannot tell (None); a ``correct`` that raises or returns something else is named with its input."""
    return judged(task, "correct", checked_verdict, records, completions)


def accuracy_terms(task: Task, records: list[Record], completions: list[str], given: Tensor | None = None) -> Tensor:
    """What ``val/accuracy`` averages: per completion 1.0 or 0.0 by ``task.correct`` where the task tells, else the
    reward (``given`` where the rollout has one, as :func:`score`; rewards are computed only for those)."""
    terms = correctness(task, records, completions)
    unknown = torch.nonzero(terms.isnan()).squeeze(1).tolist()
    if unknown:
        terms[unknown] = score(task, [records[i] for i in unknown], [completions[i] for i in unknown],
                               None if given is None else given.cpu()[unknown])
    return terms


def check_reward(task: Task) -> None:
    """Calls ``task.reward`` and ``task.correct`` once, on the first training record and an empty completion.

    A reward function with the wrong signature, one that raises on an empty completion, or one that
    returns something other than a finite number raises :class:`RewardError` here, before any training;
    so does a ``correct`` that raises or returns something other than a bool or None.
    """
    records = task.train_records()[:1] or task.val_records()[:1]
    try:
        score(task, records, [""])
    except RewardError as error:
        expected = "a task's reward is called as reward(record, completion) and returns a number"
        raise RewardError(f"{error} (checked at start-up: {expected})") from error
    try:
        correctness(task, records, [""])
    except RewardError as error:
        expected = "a task's correct is called as correct(record, completion) and returns True, False or None"
        raise RewardError(f"{error} (checked at start-up: {expected})") from error


def score_groups(task: Task, records: list[Record], group_size: int, generation: Generation) -> tuple[Tensor, Tensor]:
    """``(rewards, correct)`` of ``generation``'s rows, ``group_size`` completions of each of ``records`` in turn: the
    rewards by :func:`score` (those the rollouts already have kept), correctness by :func:`correctness`. A failed episode's
    row (``generation.failures``) is not scored: it keeps the reward its rollout has (0) and its correctness is NaN."""
    repeated = [record for record in records for _ in range(group_size)]
    ran = [row for row, failure in enumerate(generation.failures or [None] * len(repeated)) if failure is None]
    correct = torch.full((len(repeated),), math.nan)
    if ran:
        correct[ran] = correctness(task, [repeated[row] for row in ran], [generation.texts[row] for row in ran])
    return score(task, repeated, generation.texts, generation.rewards), correct
