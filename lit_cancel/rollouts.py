"""One draw of rollouts, top to bottom: prompts -> completions -> rewards (and correctness) -> advantages -> log-probs
-> RolloutBatch.

Plain functions of the policy (which holds the tokenizer, ``rollout()`` and the reference model), the
objective's advantage estimator, the prompt records and the task. :class:`~lit_cancel.producer.RolloutProducer`
decides which prompts each draw takes, and ``RolloutDataModule`` how a round is cut into optimizer steps; validation
scores its samples with :func:`accuracy_terms`.
"""

import math
import numbers
import time
from collections.abc import Callable, Sequence
from concurrent.futures import Future

import torch
from torch import Tensor
from transformers import PreTrainedTokenizerBase

from lit_cancel.batch import RolloutBatch
from lit_cancel.tasks import Record, Task


class RewardError(RuntimeError):
    """A task's reward function raised on a completion, or returned something that is not a finite number; or its
    ``correct`` raised, or returned something other than a bool or None."""


def encode_prompts(tokenizer: PreTrainedTokenizerBase, records: list[Record]) -> dict:
    """Left-padded prompt ids and mask of ``records``, and the records themselves."""
    encoded = tokenizer([r["prompt"] for r in records], return_tensors="pt", padding=True)
    return {"input_ids": encoded["input_ids"], "attention_mask": encoded["attention_mask"], "records": records}


def record_names(task: Task, split: str, indices: Sequence[int]) -> list[str]:
    """How messages name records ``indices`` of ``split`` (``"train"`` or ``"val"``, indices into the task's records of
    that split): ``"val record 3"``, followed by where the task read it where it tells (``"val record 3 ('test.jsonl'
    line 5)"``, :meth:`~lit_cancel.tasks.Task.record_source`)."""
    names = []
    for index in indices:
        name, source = f"{split} record {index}", task.record_source(split, index)
        names.append(name if source == name else f"{name} ({source})")
    return names


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


def sample_groups(
    policy, advantages: Callable[[Tensor], Tensor], task: Task, records: list[Record], group_size: int, *, seed: int, first_group: int,
    round_index: int, with_old_logprobs: bool, sampled_ahead: Future | None = None, names: Sequence[str] | None = None,
) -> tuple[RolloutBatch, float, float, dict[str, float]]:
    """``group_size`` scored rollouts of each of ``records``, the seconds spent sampling, those spent
    pushing weights to the engine before it (see :meth:`PolicyModule.rollout`), and the engine's statistics.

    ``policy`` is a :class:`~lit_cancel.producer.RolloutPolicy`; ``advantages`` turns rewards ``[groups, group_size]``
    into advantages of the same shape. Sampling is seeded by ``seed`` without touching the global random state. Rows
    ``i * G .. i * G + G - 1`` are the group of ``records[i]``, numbered ``first_group + i``. Generation and the
    old and reference log-probs run in the trainer's precision context, as the training step does,
    so that the step's first importance ratios are exactly 1. ``sampled_ahead``: the draw's rollouts, sampled in the
    background (:meth:`~lit_cancel.producer.RolloutProducer.prefetch`); the seconds spent are those waited for them.
    ``names``: how messages name each record (:func:`record_names`).
    """
    started = time.perf_counter()
    if sampled_ahead is not None:
        generation = sampled_ahead.result().to(policy.device)
    else:
        prompts = encode_prompts(policy.tokenizer, records)
        with torch.random.fork_rng(devices=[policy.device] if policy.device.type == "cuda" else []), policy.precision_context():
            torch.manual_seed(seed)
            generation = task.rollout(policy, records, prompts["input_ids"].to(policy.device),
                                      prompts["attention_mask"].to(policy.device), group_size, names=names)
    seconds = time.perf_counter() - started

    repeated = [r for r in records for _ in range(group_size)]
    rewards = score(task, repeated, generation.texts, generation.rewards)
    correct = correctness(task, repeated, generation.texts)
    advantage = advantages(rewards.view(len(records), group_size)).reshape(-1)
    with policy.precision_context():
        old_logprobs, ref_logprobs = policy.score_rollouts(generation, with_old_logprobs=with_old_logprobs)

    device = generation.input_ids.device
    batch = RolloutBatch(
        input_ids=generation.input_ids,
        attention_mask=generation.attention_mask,
        completion_mask=generation.completion_mask,
        prompt_length=generation.prompt_length,
        rewards=rewards.to(device),
        advantages=advantage.to(device),
        group_ids=torch.arange(first_group, first_group + len(records), device=device).repeat_interleave(group_size),
        sampled_round=torch.full((len(records) * group_size,), round_index, device=device),
        old_logprobs=old_logprobs,
        ref_logprobs=ref_logprobs,
        sampler_logprobs=generation.sampler_logprobs,
        sampler_steps=None if generation.sampler_steps is None else generation.sampler_steps.to(device),
        correct=correct.to(device),
    )
    return batch, seconds - generation.sync_seconds, generation.sync_seconds, generation.stats


def staleness_stats(batch: RolloutBatch, step: int, steps_per_round: int, max_staleness: int) -> dict[str, float]:
    """``rollout/staleness`` (mean) and ``rollout/staleness_max``: rounds between the weights that sampled ``batch``'s
    rows and the round that trains them, which starts at optimizer step ``step``; nothing for rollouts sampled by
    the weights being trained. A row more than ``max_staleness`` rounds behind raises RuntimeError: the engine's
    admission control should have kept it from being sampled."""
    if batch.sampler_steps is None:
        return {}
    behind = (step - batch.sampler_steps.float()) / steps_per_round
    if behind.max() > max_staleness or behind.min() < 0:
        raise RuntimeError(
            f"rollouts sampled by the weights of steps {sorted(set(batch.sampler_steps.tolist()))} reached the round that "
            f"starts at step {step}, outside the {max_staleness} rounds of staleness allowed"
        )
    return {"rollout/staleness": behind.mean().item(), "rollout/staleness_max": behind.max().item()}


def round_stats(
    sampled: RolloutBatch, kept: int, group_size: int, seconds: float, sync_seconds: float, stop_token_ids: Sequence[int]
) -> dict[str, float]:
    """``rollout/...`` statistics of every rollout sampled in a round, of which the first ``kept`` are trained.

    ``seconds`` were spent sampling, ``sync_seconds`` pushing the policy's weights to the engine; a
    completion whose last token is not one of ``stop_token_ids`` was cut at ``max_new_tokens`` (an agent's episode
    whose last turn was cut, at its turn or episode token limit). A statistic of
    no rollout is left out: ``rollout/reward_truncated`` of a round without a cut completion,
    ``rollout/reward_finished`` of one where every completion was cut, ``rollout/reward_correct_corr``
    of one whose rewards or correctness are all equal or whose task cannot tell correctness.
    """
    rewards = sampled.rewards.view(-1, group_size)
    flat = sampled.rewards.float()
    lengths = sampled.completion_mask.sum(1).float()
    completions = sampled.input_ids[:, sampled.prompt_length :]
    stops = torch.tensor(list(stop_token_ids), device=completions.device)
    # a completion ends at its last policy token: in an agent's episode, the last turn's, whatever earlier turns did
    policy = sampled.completion_mask.bool()
    last = torch.where(policy, torch.arange(policy.shape[1], device=policy.device), -1).max(1).values
    ended = (last >= 0) & torch.isin(completions.gather(1, last.clamp(min=0).unsqueeze(1)).squeeze(1), stops)
    told = sampled.correct if sampled.correct is not None else torch.full_like(flat, math.nan)
    correct = torch.where(told.isnan(), (flat > 0).float(), told.float())
    stats = {
        "rollout/reward_mean": rewards.mean().item(),
        "rollout/accuracy": correct.mean().item(),
        "rollout/completion_len": lengths.mean().item(),
        "rollout/frac_truncated": (~ended).float().mean().item(),
        "rollout/frac_zero_std_groups": (rewards.std(dim=1) == 0).float().mean().item(),
        "rollout/dropped_groups": float(len(sampled) - kept) / group_size,
        "perf/rollout_tokens_per_s": lengths.sum().item() / max(seconds, 1e-9),
        "perf/weight_sync_s": sync_seconds,
    }
    if ended.any():
        stats["rollout/reward_finished"] = flat[ended].mean().item()
    if not ended.all():
        stats["rollout/reward_truncated"] = flat[~ended].mean().item()
    known = ~told.isnan()
    if (correlation := pearson(flat[known], told[known].float())) is not None:
        stats["rollout/reward_correct_corr"] = correlation
    return stats


def pearson(x: Tensor, y: Tensor) -> float | None:
    """The Pearson correlation of ``x`` and ``y``; None when either holds one value only (or nothing)."""
    if len(x) < 2 or (x == x[0]).all() or (y == y[0]).all():
        return None
    return torch.corrcoef(torch.stack([x, y]).double())[0, 1].item()
