"""The staleness bound: which draws an engine samples ahead, with which weights, and the checks of what reaches training."""

import pytest
import torch

from lit_cancel import AdditionTask, DecodeLoop, RolloutBatch
from lit_cancel.agents import ToolAdditionTask
from lit_cancel.rounds.staleness import Staleness


class Ahead(DecodeLoop):
    max_staleness = 1


class TurnsAhead(Ahead):
    can_sample_ahead = True

    def sample_ahead(self, request, oldest_step, first_seed):
        return self.sample(None, request)


def test_a_draw_is_sampled_ahead_by_weights_at_most_max_staleness_rounds_older_than_the_round_that_trains_it():
    staleness = Staleness(Ahead(), steps_per_round=2)
    assert list(staleness.later_draws(3)) == [4]
    # the round starting at step 8 trains draw 3; draw 4 is trained one round later, at step 10 at the earliest
    assert staleness.oldest_step(8, rounds_ahead=1) == 8 and staleness.oldest_step(8, rounds_ahead=2) == 10
    assert staleness.oldest_step(0, rounds_ahead=0) == 0
    assert list(Staleness(DecodeLoop(), 2).later_draws(3)) == []


def test_staleness_counts_rounds_and_refuses_what_admission_control_should_have_kept_out():
    batch = RolloutBatch(
        input_ids=torch.zeros(4, 3, dtype=torch.long), attention_mask=torch.ones(4, 3, dtype=torch.long),
        completion_mask=torch.ones(4, 2, dtype=torch.long), prompt_length=1, rewards=torch.zeros(4),
        advantages=torch.zeros(4), group_ids=torch.tensor([0, 0, 1, 1]), sampler_steps=torch.tensor([6, 6, 8, 8]),
    )
    # rounds of two steps starting at step 8: groups sampled one round and zero rounds before
    assert Staleness(Ahead(), steps_per_round=2).check(batch, step=8) == {"rollout/staleness": 0.5, "rollout/staleness_max": 1.0}
    with pytest.raises(RuntimeError, match=r"steps \[6, 8\] reached the round that starts at step 10"):
        Staleness(Ahead(), steps_per_round=2).check(batch, step=10)
    assert Staleness(DecodeLoop(), 2).check(RolloutBatch(**{**batch.__dict__, "sampler_steps": None}), 8) == {}


def test_an_engine_that_samples_ahead_but_not_turn_by_turn_is_refused_for_a_task_of_several_calls_a_rollout():
    agent, single = ToolAdditionTask(train_size=8, val_size=2), AdditionTask(num_digits=2, train_size=8, val_size=2)
    with pytest.raises(ValueError, match="ToolAdditionTask runs episodes turn by turn.*max_staleness=1"):
        Staleness(Ahead(), 1).check_task(agent)
    for engine, task in [(Ahead(), single), (TurnsAhead(), agent), (DecodeLoop(), agent)]:
        Staleness(engine, 1).check_task(task)

