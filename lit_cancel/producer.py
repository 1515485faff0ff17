"""The rollout producer: it owns a round's rollouts, from the prompts each draw takes to the scored, advantaged rows.

For each draw of prompts it asks the policy's engine for ``group_size`` completions of each (an engine that samples
ahead of the trainer is first asked for the next draws, with weights at most ``max_staleness`` rounds old), scores them,
turns rewards into advantages over each whole group, and records the log-probs the objective needs
(:func:`lit_cancel.rollouts.sample_groups`, one draw top to bottom). With dynamic sampling (DAPO) it draws again until
enough groups have a reward difference. What it hands on is the round's rows and statistics; which rows meet in which
optimizer step is the :class:`~lit_cancel.data.RolloutDataModule`'s business.
"""

import concurrent.futures
import copy
import functools
import random
import threading
from collections.abc import Callable
from concurrent.futures import Future
from contextlib import AbstractContextManager
from dataclasses import dataclass, replace
from typing import Protocol

import torch
from torch import Tensor
from transformers import PreTrainedTokenizerBase

from lit_cancel.batch import RolloutBatch
from lit_cancel.engines import PolicyWeights, RolloutEngine, SampleRequest, SamplingOptions
from lit_cancel.engines.base import in_background
from lit_cancel.generation import Generation
from lit_cancel.rollouts import encode_prompts, record_names, round_stats, sample_groups, staleness_stats
from lit_cancel.round_warnings import CannotLearnWarnings
from lit_cancel.tasks import Record, Task


class RolloutPolicy(Protocol):
    """What the producer needs of the policy it samples (:class:`~lit_cancel.PolicyModule` is one)."""

    tokenizer: PreTrainedTokenizerBase
    stop_token_ids: list[int]
    engine: RolloutEngine
    device: torch.device

    def sampling_options(self) -> SamplingOptions:
        """How the engine samples."""

    def policy_weights(self) -> PolicyWeights:
        """The policy as the engine sees it."""

    def precision_context(self) -> AbstractContextManager:
        """The trainer's precision context, in which rollouts and their log-probs are computed as the training step's."""

    def rollout(self, input_ids: Tensor, attention_mask: Tensor, num_samples: int = 1, greedy: bool = False,
                max_new_tokens: int | None = None, keep_engine: bool = False) -> Generation:
        """Completions of left-padded prompts, sampled by the engine with the current weights, each at most
        ``max_new_tokens`` long (the policy's own limit when None; an agent's episode sets each turn's); ``keep_engine``:
        more calls follow at once (an agent's turns), released by :meth:`release_engine` after the last."""

    def release_engine(self) -> None:
        """Lets the engine release what it kept through calls made with ``keep_engine``."""

    def sync_engine(self) -> float:
        """Gives the engine the current weights where it holds older ones; returns the seconds it took."""

    def score_rollouts(self, generation: Generation, with_old_logprobs: bool) -> tuple[Tensor | None, Tensor | None]:
        """``(old_logprobs, ref_logprobs)`` of fresh completions; None where the objective needs none."""


@dataclass(frozen=True)
class Processes:
    """The processes a round is sampled on: each samples and keeps its own groups.

    Attributes:
        rank: this process's global rank.
        world: the number of processes.
        step: the optimizer steps done, as the trainer counts them.
        sum: sums a tensor over the processes (identity in one process).
    """

    rank: int
    world: int
    step: Callable[[], int]
    sum: Callable[[Tensor], Tensor]

    @classmethod
    def of(cls, trainer) -> "Processes":
        """A Lightning ``Trainer``'s processes."""
        return cls(rank=trainer.global_rank, world=trainer.world_size, step=lambda: trainer.global_step,
                   sum=lambda tensor: trainer.strategy.reduce(tensor, reduce_op="sum"))


class RolloutProducer:
    """Samples the rounds of an RL run: prompts -> engine -> rewards -> group advantages -> log-probs.

    Args:
        task: where prompts come from and how completions are rewarded.
        prompts_per_round: prompts per round, summed over processes.
        group_size: completions sampled per prompt.
        steps_per_round: optimizer steps each round trains (staleness is counted in rounds).
        dynamic_sampling: drop groups whose rewards are all equal and draw more prompts.
        max_prompt_draws: draws per round at most, with dynamic sampling.
        seed: seed of the prompt order and of the sampling.

    The counter :attr:`prompt_draws` (draws made so far) is the state a resumed run restores.
    """

    def __init__(self, task: Task, prompts_per_round: int, group_size: int, steps_per_round: int, dynamic_sampling: bool = False,
                 max_prompt_draws: int = 4, seed: int = 0) -> None:
        self.task, self.prompts_per_round, self.group_size = task, prompts_per_round, group_size
        self.steps_per_round, self.dynamic_sampling, self.max_prompt_draws = steps_per_round, dynamic_sampling, max_prompt_draws
        self.seed = seed
        self.prompt_draws = 0
        # draws whose rollouts a task of several engine calls (an agent's episodes) runs ahead, in the background
        self.ahead: dict[int, Future] = {}
        self.stopping = threading.Event()
        self.cannot_learn = CannotLearnWarnings()

    def draw_indices(self, draw: int, rank: int, world: int) -> list[int]:
        """Which of the task's training records are the prompts of draw ``draw`` for process ``rank``: consecutive
        slices of seeded permutations."""
        count = len(self.task.train_records())
        per_rank = self.prompts_per_round // world
        first = draw * self.prompts_per_round + rank * per_rank
        indices = []
        for position in range(first, first + per_rank):
            epoch, index = divmod(position, count)
            indices.append(_permutation(count, self.seed + epoch)[index])
        return indices

    def draw_records(self, draw: int, rank: int, world: int) -> list[Record]:
        """The prompts of draw ``draw`` for process ``rank`` (:meth:`draw_indices`)."""
        records = self.task.train_records()
        return [records[index] for index in self.draw_indices(draw, rank, world)]

    def seed_of(self, rank: int, *keys: int) -> int:
        """A seed for ``keys`` (a draw, a round) on process ``rank``, from the producer's seed."""
        return hash((self.seed, *keys, rank)) % 2**63

    def sample_round(self, policy: RolloutPolicy, advantages: Callable[[Tensor], Tensor], processes: Processes, round_index: int,
                     with_old_logprobs: bool) -> tuple[RolloutBatch, dict[str, float]]:
        """This process's groups of round ``round_index``, after dynamic sampling when it is on, and the round's
        statistics (``rollout/...``, ``perf/...``)."""
        groups_needed = self.prompts_per_round // processes.world
        informative, uninformative, seconds, sync_seconds, engine_stats = [], [], 0.0, 0.0, {}
        for _ in range(self.max_prompt_draws if self.dynamic_sampling else 1):
            draw, spent, synced, drawn_stats = self.sample_draw(policy, advantages, processes, round_index, with_old_logprobs)
            seconds, sync_seconds = seconds + spent, sync_seconds + synced
            engine_stats = {k: engine_stats.get(k, 0.0) + v if k.startswith("perf/") else v for k, v in drawn_stats.items()}
            flat = draw.rewards.view(-1, self.group_size)
            varied = (flat != flat[:, :1]).any(1).repeat_interleave(self.group_size)
            informative.append(draw.select(torch.nonzero(varied).squeeze(1)))
            uninformative.append(draw.select(torch.nonzero(~varied).squeeze(1)))
            if not self.dynamic_sampling:
                break
            have = sum(len(b) for b in informative) // self.group_size
            # every process draws as often as the neediest one, so collectives stay in step
            if processes.sum(torch.tensor(float(have < groups_needed), device=draw.input_ids.device)) == 0:
                break
        sampled = RolloutBatch.concat(informative + uninformative)
        rows = groups_needed * self.group_size
        kept = sampled.select(torch.arange(rows, device=sampled.input_ids.device))
        stats = round_stats(sampled, rows, self.group_size, seconds, sync_seconds, policy.stop_token_ids)
        stats |= engine_stats | staleness_stats(kept, processes.step(), self.steps_per_round, policy.engine.max_staleness)
        self.cannot_learn.warn(policy.policy_weights().model.parameters(), policy.sampling_options().max_new_tokens, stats,
                               round_index + 1)
        return kept, stats

    def sample_draw(self, policy: RolloutPolicy, advantages: Callable[[Tensor], Tensor], processes: Processes, round_index: int,
                    with_old_logprobs: bool) -> tuple[RolloutBatch, float, float, dict[str, float]]:
        """Samples and scores the next draw of prompts; returns the rollouts, the seconds spent sampling and syncing the
        engine, and the engine's statistics. An engine that samples ahead is first asked for the draws after it."""
        draw = self.prompt_draws
        # the engine gets the weights of this round before draws wait for them
        ahead, synced = self.ahead.pop(draw, None), 0.0
        if ahead is not None:
            synced = policy.sync_engine()
        for later in range(draw + 1, draw + 1 + policy.engine.max_staleness):
            self.prefetch(policy, processes, later, rounds_ahead=later - draw)
        indices = self.draw_indices(draw, processes.rank, processes.world)
        records = self.draw_records(draw, processes.rank, processes.world)
        batch, seconds, sync_seconds, stats = sample_groups(
            policy, advantages, self.task, records, self.group_size, seed=self.seed_of(processes.rank, draw),
            first_group=(draw * processes.world + processes.rank) * len(records), round_index=round_index,
            with_old_logprobs=with_old_logprobs, sampled_ahead=ahead, names=record_names(self.task, "train", indices),
        )
        self.prompt_draws += 1
        return batch, seconds, sync_seconds + synced, stats

    def prefetch(self, policy: RolloutPolicy, processes: Processes, draw: int, rounds_ahead: int) -> None:
        """Has the engine start sampling draw ``draw`` with weights of the round at most ``max_staleness`` rounds
        before the one that trains it; that round is at most ``rounds_ahead`` after this one (a round takes one
        draw or more)."""
        engine = policy.engine
        records = self.draw_records(draw, processes.rank, processes.world)
        prompts = encode_prompts(policy.tokenizer, records)
        oldest_step = max(processes.step() + (rounds_ahead - engine.max_staleness) * self.steps_per_round, 0)
        if type(self.task).rollout is Task.rollout:
            request = SampleRequest(prompts["input_ids"], prompts["attention_mask"], self.group_size, policy.sampling_options())
            engine.prefetch(policy.policy_weights(), request, self.seed_of(processes.rank, draw), oldest_step)
        elif draw not in self.ahead:
            # a task that calls the engine several times (an agent's turns, the environment answering between them)
            ahead = AheadPolicy(policy, oldest_step, random.Random(self.seed_of(processes.rank, draw)), self.stopping)
            names = record_names(self.task, "train", self.draw_indices(draw, processes.rank, processes.world))
            rollout = functools.partial(self.task.rollout, names=names)
            self.ahead[draw] = in_background(rollout, ahead, records, prompts["input_ids"], prompts["attention_mask"],
                                             self.group_size)

    def stop(self, seconds: float = 10.0) -> None:
        """Stops the rollouts running ahead at their next engine call, waiting up to ``seconds`` for the calls in progress
        (a trainer whose fit ended leaves nothing running behind it), and drops them."""
        self.stopping.set()
        concurrent.futures.wait(list(self.ahead.values()), timeout=seconds)
        self.ahead, self.stopping = {}, threading.Event()


class RolloutsStopped(RuntimeError):
    """Rollouts sampled ahead were stopped: the producer no longer wants them."""


class AheadPolicy:
    """The policy as a task's rollouts sampled ahead of the trainer, in a background thread, see it: each call is
    sampled by the engine with the weights it holds of optimizer step ``oldest_step`` or later, waiting for them but
    never pushing (:meth:`~lit_cancel.engines.RolloutEngine.sample_ahead`), each row's step recorded; seeds come from
    ``rng``, not torch's generator, which training uses meanwhile. It decodes with its own copy of the tokenizer, and
    raises :class:`RolloutsStopped` at a call once ``stopping`` is set.
    """

    def __init__(self, policy: RolloutPolicy, oldest_step: int, rng: random.Random, stopping: threading.Event) -> None:
        self.engine, self.oldest_step, self.rng, self.stopping = policy.engine, oldest_step, rng, stopping
        self.tokenizer = copy.deepcopy(policy.tokenizer)
        self.stop_token_ids = list(policy.stop_token_ids)
        self.options = policy.sampling_options()

    def sampling_options(self) -> SamplingOptions:
        return self.options

    def rollout(self, input_ids: Tensor, attention_mask: Tensor, num_samples: int = 1, greedy: bool = False,
                max_new_tokens: int | None = None, keep_engine: bool = False) -> Generation:
        if self.stopping.is_set():
            raise RolloutsStopped("the producer stopped the rollouts it sampled ahead")
        options = self.options if max_new_tokens is None else replace(self.options, max_new_tokens=max_new_tokens)
        request = SampleRequest(input_ids, attention_mask, num_samples, options, greedy)
        sampled = self.engine.sample_ahead(request, self.oldest_step, self.rng.randrange(2**30))
        return Generation.from_sampled(sampled, attention_mask, num_samples, self.tokenizer, 0.0, self.stop_token_ids)

    def release_engine(self) -> None:
        return None


@functools.lru_cache(maxsize=4)
def _permutation(size: int, seed: int) -> list[int]:
    return torch.randperm(size, generator=torch.Generator().manual_seed(seed)).tolist()
