"""A round's statistics: the reward of cut and of finished completions, correctness apart from the reward and its
correlation with the reward, each left out of a round that lacks it."""

import math

import pytest
import torch

from lit_cancel import RolloutBatch
from lit_cancel.rounds.statistics import round_stats

STOP = 9
NAN = math.nan


def hand_batch(rewards: list[float], correct: list[float] | None) -> RolloutBatch:
    """Four completions of two tokens after a one-token prompt: rows 0 and 2 end with the stop token, 1 and 3 are cut."""
    completions = torch.tensor([[5, STOP], [5, 5], [STOP, 0], [5, 5]])
    mask = torch.tensor([[1, 1], [1, 1], [1, 0], [1, 1]])
    return RolloutBatch(
        input_ids=torch.cat([torch.ones(4, 1, dtype=torch.long), completions], 1),
        attention_mask=torch.cat([torch.ones(4, 1, dtype=torch.long), mask], 1),
        completion_mask=mask, prompt_length=1, rewards=torch.tensor(rewards), advantages=torch.zeros(4),
        group_ids=torch.tensor([0, 0, 1, 1]), correct=None if correct is None else torch.tensor(correct),
    )


def stats_of(batch: RolloutBatch) -> dict[str, float]:
    return round_stats(batch, len(batch), 2, seconds=1.0, sync_seconds=0.0, stop_token_ids=[STOP])


def test_round_stats_split_the_reward_by_how_completions_ended_and_score_correctness_apart():
    stats = stats_of(hand_batch([1.0, 0.5, 0.0, 0.25], correct=[1.0, 0.0, 0.0, 1.0]))
    assert stats["rollout/frac_truncated"] == 0.5
    assert stats["rollout/reward_finished"] == pytest.approx((1.0 + 0.0) / 2)  # rows 0 and 2
    assert stats["rollout/reward_truncated"] == pytest.approx((0.5 + 0.25) / 2)  # rows 1 and 3
    assert stats["rollout/accuracy"] == 0.5  # two correct of four, where reward > 0 would say three
    # rewards - mean 0.4375: .5625 .0625 -.4375 -.1875; correct - 0.5: .5 -.5 -.5 .5
    # sum of products .375; sums of squares .546875 and 1
    assert stats["rollout/reward_correct_corr"] == pytest.approx(0.375 / math.sqrt(0.546875))


def test_an_episode_whose_last_turn_was_cut_counts_as_truncated_whatever_its_first_turn_did():
    """Two episodes of a stopped first turn, a reply (out of the policy mask) and a second turn: cut in row 0, stopped
    in row 1."""
    completions = torch.tensor([[5, STOP, 7, 7, 5, 5], [5, STOP, 7, 7, 5, STOP]])
    policy = torch.tensor([[1, 1, 0, 0, 1, 1], [1, 1, 0, 0, 1, 1]])
    batch = RolloutBatch(
        input_ids=torch.cat([torch.ones(2, 1, dtype=torch.long), completions], 1), attention_mask=torch.ones(2, 7, dtype=torch.long),
        completion_mask=policy, prompt_length=1, rewards=torch.tensor([0.0, 1.0]), advantages=torch.zeros(2),
        group_ids=torch.tensor([0, 0]),
    )
    stats = round_stats(batch, 2, 2, seconds=1.0, sync_seconds=0.0, stop_token_ids=[STOP])
    assert stats["rollout/frac_truncated"] == 0.5
    assert (stats["rollout/reward_truncated"], stats["rollout/reward_finished"]) == (0.0, 1.0)


def test_a_round_without_cut_or_without_finished_completions_leaves_that_key_out():
    rewards = [1.0, 0.5, 0.0, 0.25]
    cut = hand_batch(rewards, None)
    cut.completion_mask = torch.tensor([[1, 0], [1, 1], [0, 0], [1, 1]])  # the stop tokens fall in padding
    assert "rollout/reward_finished" not in stats_of(cut)
    assert stats_of(cut)["rollout/reward_truncated"] == pytest.approx(sum(rewards) / 4)
    finished = hand_batch(rewards, None)
    finished.input_ids[:, -1] = STOP
    assert "rollout/reward_truncated" not in stats_of(finished)
    assert stats_of(finished)["rollout/reward_finished"] == pytest.approx(sum(rewards) / 4)


def test_without_correctness_accuracy_is_the_share_of_positive_rewards_and_no_correlation_is_logged():
    stats = stats_of(hand_batch([1.0, 0.5, 0.0, 0.25], correct=None))
    assert stats["rollout/accuracy"] == 0.75 and "rollout/reward_correct_corr" not in stats
    # a task that tells for some completions: those count by correctness, the others by reward > 0
    mixed = stats_of(hand_batch([1.0, 0.5, 0.0, 0.25], correct=[NAN, 0.0, 1.0, NAN]))
    assert mixed["rollout/accuracy"] == (1 + 0 + 1 + 1) / 4
    # the correlation over the two rows the task tells: rewards 0.5, 0.0 against correctness 0, 1
    assert mixed["rollout/reward_correct_corr"] == pytest.approx(-1.0)


@pytest.mark.parametrize(("rewards", "correct"), [([0.5] * 4, [1.0, 0.0, 0.0, 1.0]), ([1.0, 0.5, 0.0, 0.25], [1.0] * 4)])
def test_no_correlation_when_the_reward_or_correctness_does_not_vary(rewards, correct):
    stats = stats_of(hand_batch(rewards, correct))
    assert "rollout/reward_correct_corr" not in stats and stats["rollout/accuracy"] == sum(correct) / 4


def test_a_failed_episode_s_row_is_left_out_of_the_round_s_statistics():
    batch = hand_batch([1.0, 0.0, 0.0, 0.25], correct=[1.0, NAN, 0.0, 1.0])
    # row 1's episode failed: inert, no policy token; its group is left with one member that ran, so no reward difference
    batch.completion_mask[1] = 0
    batch.failure = torch.tensor([0, 5, 0, 0])
    stats = stats_of(batch)
    assert stats["rollout/reward_mean"] == pytest.approx((1.0 + 0.0 + 0.25) / 3)
    assert stats["rollout/accuracy"] == pytest.approx(2 / 3)
    assert stats["rollout/completion_len"] == pytest.approx((2 + 1 + 2) / 3)
    assert stats["rollout/frac_truncated"] == pytest.approx(1 / 3)  # row 3; row 1 counted none
    assert stats["rollout/frac_zero_std_groups"] == 0.5  # group 0 has one member that ran; group 1 differs
