"""The rollout producer: it owns a round's rollouts, from the prompts each draw takes to the scored, advantaged rows.

For each draw of prompts it runs the stages of :mod:`lit_cancel.rounds` (:meth:`RolloutProducer.sample_draw`, one draw
top to bottom): the draw's prompts (:mod:`.draw`), ``group_size`` completions of each by the policy's engine
(:mod:`.sample`; an engine that samples ahead of the trainer is first asked for the next draws, with weights as old as
:mod:`.staleness` allows), their rewards and correctness (:mod:`.score`), advantages over each whole group and the
log-probs the objective needs (:mod:`.advantages`). With dynamic sampling (DAPO) it draws again until enough groups have
a reward difference. What it hands on is the round's rows and statistics (:mod:`.statistics`); which rows meet in which
optimizer step is the :class:`~lit_cancel.data.RolloutDataModule`'s business (:mod:`.plans`).
"""

import concurrent.futures
import random
import threading
from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import dataclass

import torch
from torch import Tensor

from lit_cancel.batch import RolloutBatch
from lit_cancel.engines import SampleRequest
from lit_cancel.engines.base import in_background
from lit_cancel.rounds.advantages import advantaged_rows
from lit_cancel.rounds.draw import draw_indices, record_names
from lit_cancel.rounds.failures import FailedEpisodes, FailureBudget, FailureCount, varied_groups
from lit_cancel.rounds.sample import AheadPolicy, RolloutPolicy, encode_prompts, named_rollout, sample_groups
from lit_cancel.rounds.score import score_groups
from lit_cancel.rounds.staleness import Staleness
from lit_cancel.rounds.statistics import CannotLearnWarnings, round_stats
from lit_cancel.tasks import Record, Task


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
        with_old_logprobs: record the log-probs of the policy that sampled the rollouts, which the objective needs where
            a round's steps go off-policy (several steps a round, or rollouts that wait for a later round).
        budget: how many failed episodes (an agent's, :mod:`lit_cancel.rounds.failures`) the run accepts; none is
            refused when None.

    The counter :attr:`prompt_draws` (draws made so far) and the budget's bad rounds in a row are the state a resumed run
    restores.
    """

    def __init__(self, task: Task, prompts_per_round: int, group_size: int, steps_per_round: int, dynamic_sampling: bool = False,
                 max_prompt_draws: int = 4, seed: int = 0, with_old_logprobs: bool = False,
                 budget: FailureBudget | None = None) -> None:
        self.task, self.prompts_per_round, self.group_size = task, prompts_per_round, group_size
        self.steps_per_round, self.dynamic_sampling, self.max_prompt_draws = steps_per_round, dynamic_sampling, max_prompt_draws
        self.seed, self.with_old_logprobs, self.budget = seed, with_old_logprobs, budget
        self.prompt_draws = 0
        # draws whose rollouts a task of several engine calls (an agent's episodes) runs ahead, in the background
        self.ahead: dict[int, Future] = {}
        self.stopping = threading.Event()
        self.cannot_learn = CannotLearnWarnings()

    def draw_indices(self, draw: int, rank: int, world: int) -> list[int]:
        """Which of the task's training records are the prompts of draw ``draw`` for process ``rank``
        (:func:`~lit_cancel.rounds.draw.draw_indices`)."""
        return draw_indices(len(self.task.train_records()), draw, self.prompts_per_round, rank, world, self.seed)

    def draw_records(self, draw: int, rank: int, world: int) -> list[Record]:
        """The prompts of draw ``draw`` for process ``rank`` (:meth:`draw_indices`)."""
        records = self.task.train_records()
        return [records[index] for index in self.draw_indices(draw, rank, world)]

    def seed_of(self, rank: int, *keys: int) -> int:
        """A seed for ``keys`` (a draw, a round) on process ``rank``, from the producer's seed."""
        return hash((self.seed, *keys, rank)) % 2**63

    def sample_round(self, policy: RolloutPolicy, processes: Processes, round_index: int) -> tuple[RolloutBatch, dict[str, float]]:
        """This process's groups of round ``round_index``, after dynamic sampling when it is on, and the round's
        statistics (``rollout/...``, ``perf/...``; an agent task's ``rollout/failed_episodes`` too).

        Raises :class:`~lit_cancel.rounds.failures.FailedEpisodes` where the round spends the failure budget; the draws
        and the budget are then as they were before the round, so a checkpoint written on it samples the round again."""
        groups_needed = self.prompts_per_round // processes.world
        staleness = Staleness(policy.engine, self.steps_per_round)
        informative, uninformative, seconds, sync_seconds, engine_stats = [], [], 0.0, 0.0, {}
        first_draw, failures = self.prompt_draws, FailureCount()
        for _ in range(self.max_prompt_draws if self.dynamic_sampling else 1):
            draw, spent, synced, drawn_stats = self.sample_draw(policy, processes, round_index, staleness, failures)
            seconds, sync_seconds = seconds + spent, sync_seconds + synced
            engine_stats = {k: engine_stats.get(k, 0.0) + v if k.startswith("perf/") else v for k, v in drawn_stats.items()}
            flat = draw.rewards.view(-1, self.group_size)
            varied = varied_groups(flat, (~draw.failed).view(-1, self.group_size)).repeat_interleave(self.group_size)
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
        stats |= engine_stats | staleness.check(kept, processes.step())
        if not self.task.rollout_in_one_call:  # an agent's episodes, which may fail
            stats |= failures.stats("rollout/failed_episodes")
            if self.budget is not None and (stop := self.budget.judge(failures.summed(processes.sum, kept.input_ids.device))):
                self.prompt_draws, self.budget.bad_rounds = first_draw, self.budget.bad_rounds - 1
                raise FailedEpisodes(stop)
        self.cannot_learn.warn(policy.policy_weights().model.parameters(), policy.sampling_options().max_new_tokens, stats,
                               round_index + 1)
        return kept, stats

    def sample_draw(self, policy: RolloutPolicy, processes: Processes, round_index: int, staleness: Staleness,
                    failures: FailureCount | None = None) -> tuple[RolloutBatch, float, float, dict[str, float]]:
        """Runs the next draw of prompts through the stages (draw, sample, score, advantages); returns its rows, the seconds
        spent sampling and syncing the engine, and the engine's statistics; counts its failed episodes in ``failures``.
        An engine that samples ahead is first asked for the draws after it."""
        draw = self.prompt_draws
        # the engine gets the weights of this round before draws wait for them
        ahead, synced = self.ahead.pop(draw, None), 0.0
        if ahead is not None:
            synced = policy.sync_engine()
        for later in staleness.later_draws(draw):
            self.prefetch(policy, processes, later, staleness.oldest_step(processes.step(), rounds_ahead=later - draw))
        indices = self.draw_indices(draw, processes.rank, processes.world)
        records = [self.task.train_records()[index] for index in indices]
        rollout = named_rollout(self.task.rollout, record_names(self.task, "train", indices))
        generation, seconds = sample_groups(policy, rollout, records, self.group_size, self.seed_of(processes.rank, draw),
                                            sampled_ahead=ahead)
        if failures is not None:
            failures.add(generation.failures or [None] * len(generation.texts))
        rewards, correct = score_groups(self.task, records, self.group_size, generation)
        batch = advantaged_rows(policy, generation, rewards, correct, self.group_size,
                                first_group=(draw * processes.world + processes.rank) * len(records), round_index=round_index,
                                with_old_logprobs=self.with_old_logprobs)
        self.prompt_draws += 1
        return batch, seconds - generation.sync_seconds, generation.sync_seconds + synced, generation.stats

    def prefetch(self, policy: RolloutPolicy, processes: Processes, draw: int, oldest_step: int) -> None:
        """Has the engine start sampling draw ``draw`` with weights of optimizer step ``oldest_step`` or later
        (:meth:`Staleness.oldest_step`)."""
        records = self.draw_records(draw, processes.rank, processes.world)
        prompts = encode_prompts(policy.tokenizer, records)
        if self.task.rollout_in_one_call:
            request = SampleRequest(prompts["input_ids"], prompts["attention_mask"], self.group_size, policy.sampling_options())
            policy.engine.prefetch(policy.policy_weights(), request, self.seed_of(processes.rank, draw), oldest_step)
        elif draw not in self.ahead:
            # a task that calls the engine several times (an agent's turns, the environment answering between them)
            ahead = AheadPolicy(policy, oldest_step, random.Random(self.seed_of(processes.rank, draw)), self.stopping)
            names = record_names(self.task, "train", self.draw_indices(draw, processes.rank, processes.world))
            rollout = named_rollout(self.task.rollout, names)
            self.ahead[draw] = in_background(rollout, ahead, records, prompts["input_ids"], prompts["attention_mask"],
                                             self.group_size)

    def stop(self, seconds: float = 10.0) -> None:
        """Stops the rollouts running ahead at their next engine call, waiting up to ``seconds`` for the calls in progress
        (a trainer whose fit ended leaves nothing running behind it), and drops them."""
        self.stopping.set()
        concurrent.futures.wait(list(self.ahead.values()), timeout=seconds)
        self.ahead, self.stopping = {}, threading.Event()
