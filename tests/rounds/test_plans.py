import pytest
import torch
from jsonargparse import ArgumentParser

from lit_cancel import MiniBatchPlan, QueryPreserved, RewardBalanced, RolloutBatch, Shuffled
from lit_cancel.rounds.plans import groups_split


def pool(rewards: list[list[float]], sampled_round: int = 0, first_group: int = 0) -> RolloutBatch:
    """Rows of groups with the given rewards; advantages are the group-centred rewards."""
    r = torch.tensor(rewards)
    groups, size = r.shape
    rows = groups * size
    return RolloutBatch(
        input_ids=torch.arange(rows).unsqueeze(1).repeat(1, 3), attention_mask=torch.ones(rows, 3, dtype=torch.long),
        completion_mask=torch.ones(rows, 2, dtype=torch.long), prompt_length=1, rewards=r.view(-1),
        advantages=(r - r.mean(1, keepdim=True)).view(-1),
        group_ids=torch.arange(first_group, first_group + groups).repeat_interleave(size),
        sampled_round=torch.full((rows,), sampled_round),
    )


def random_rewards(groups: int, size: int, seed: int) -> list[list[float]]:
    return torch.randint(0, 2, (groups, size), generator=torch.Generator().manual_seed(seed)).float().tolist()


@pytest.mark.parametrize("plan", [Shuffled(), QueryPreserved(), RewardBalanced()])
@pytest.mark.parametrize("seed", range(5))
def test_each_rollout_is_used_exactly_once_per_epoch(plan, seed):
    batch = pool(random_rewards(8, 4, seed))
    generator = torch.Generator().manual_seed(seed)
    for steps in (1, 2, 4):
        split = plan.split(batch, steps, generator)
        assert len(split) == steps and {len(rows) for rows in split} == {32 // steps}
        assert sorted(torch.cat(split).tolist()) == list(range(32))


@pytest.mark.parametrize("seed", range(5))
def test_query_preserved_never_splits_a_group_and_shuffled_does(seed):
    batch = pool(random_rewards(8, 4, seed))
    generator = torch.Generator().manual_seed(seed)
    kept = QueryPreserved().split(batch, 4, generator)
    assert groups_split(batch.group_ids, kept) == 0
    for rows in kept:  # a micro-batch of consecutive rows holds whole groups too
        assert torch.equal(batch.group_ids[rows].view(-1, 4), batch.group_ids[rows].view(-1, 4)[:, :1].expand(-1, 4))
    assert groups_split(batch.group_ids, Shuffled().split(batch, 4, generator)) > 0


@pytest.mark.parametrize("share", [0.5, 0.25, 0.75])
@pytest.mark.parametrize("seed", range(4))
def test_reward_balanced_holds_its_share_when_both_classes_are_there(share, seed):
    batch = pool(random_rewards(32, 4, seed))
    plan = RewardBalanced(positive_share=share)
    generator = torch.Generator().manual_seed(seed)
    selection = plan.select(batch, 32, round_index=0, generator=generator)
    positives, negatives = int((batch.advantages > 0).sum()), int((batch.advantages < 0).sum())
    assert positives >= 32 * share and negatives >= 32 * (1 - share), "the pool has enough of both classes"
    chosen = batch.select(selection.train)
    assert len(chosen) == 32 and int((chosen.advantages > 0).sum()) == round(32 * share)
    for rows in plan.split(chosen, 4, generator):
        step_share = (chosen.advantages[rows] > 0).float().mean().item()
        assert abs(step_share - share) <= 1 / 8  # within one rollout of the 8 in a step
    # nothing is used twice; the excess waits, nothing signed is dropped in the first round
    assert not set(selection.train.tolist()) & set(selection.carry.tolist())
    signed = int((batch.advantages != 0).sum())
    assert len(selection.carry) == signed - 32 and selection.dropped == len(batch) - signed


def test_reward_balanced_pairs_waiting_rollouts_with_later_ones_then_drops_them():
    plan = RewardBalanced(positive_share=0.5, max_wait_rounds=1)
    generator = torch.Generator().manual_seed(0)
    # round 0: 3 groups of [1, 0, 0, 0] -> 3 positives, 9 negatives; 8 places: 3 positives, 5 negatives (fallback)
    first = pool([[1.0, 0.0, 0.0, 0.0]] * 2, sampled_round=0)
    selection = plan.select(first, 4, round_index=0, generator=generator)
    chosen = first.select(selection.train)
    assert int((chosen.advantages > 0).sum()) == 2 and int((chosen.advantages < 0).sum()) == 2
    waiting = first.select(selection.carry)
    assert len(waiting) == 4 and (waiting.advantages < 0).all()  # the excess negatives wait
    # round 1: mostly positives; the waiting negatives (oldest first) balance them
    second = pool([[1.0, 1.0, 1.0, 0.0]] * 1, sampled_round=1, first_group=10)
    merged = RolloutBatch.concat([waiting, second])
    selection = plan.select(merged, 4, round_index=1, generator=generator)
    chosen = merged.select(selection.train)
    assert int((chosen.advantages > 0).sum()) == 2
    assert (chosen.sampled_round[chosen.advantages < 0] == 0).all()  # the oldest negatives went first
    # the round-0 negatives not trained in round 1 would wait past max_wait_rounds: dropped, counted
    left = merged.select(selection.carry)
    assert (left.sampled_round == 1).all()
    assert selection.dropped == 2 and len(selection.train) + len(selection.carry) + selection.dropped == len(merged)


def test_reward_balanced_fallback_when_a_class_is_absent():
    plan = RewardBalanced(positive_share=0.5)
    all_equal = pool([[1.0, 1.0, 1.0, 1.0]] * 2)  # no signed rollouts: zero-advantage rows fill the places
    selection = plan.select(all_equal, 8, 0, torch.Generator().manual_seed(0))
    assert len(selection.train) == 8 and len(selection.carry) == 0
    only_positive = pool([[1.0, 0.0, 0.0, 0.0]] * 2)
    only_positive.advantages = only_positive.advantages.clamp(min=0)  # negatives made neutral
    selection = plan.select(only_positive, 4, 0, torch.Generator().manual_seed(0))
    assert len(selection.train) == 4 and int((only_positive.advantages[selection.train] > 0).sum()) == 2


@pytest.mark.parametrize(("make", "message"), [
    (lambda: RewardBalanced(positive_share=1.0), "positive_share must be in"),
    (lambda: RewardBalanced(max_wait_rounds=-1), "max_wait_rounds must be >= 0"),
])
def test_plan_options_are_checked(make, message):
    with pytest.raises(ValueError, match=message):
        make()


@pytest.mark.parametrize("class_path", ["lit_cancel.RewardBalanced", "lit_cancel.rounds.plans.RewardBalanced",
                                        "lit_cancel.plans.RewardBalanced"])
def test_a_config_names_a_plan_by_its_public_name_its_module_or_the_module_it_was_defined_in_before(class_path):
    parser = ArgumentParser()
    parser.add_argument("--plan", type=MiniBatchPlan)
    config = parser.parse_args([f'--plan={{"class_path": "{class_path}", "init_args": {{"positive_share": 0.25}}}}'])
    plan = parser.instantiate_classes(config).plan
    assert type(plan) is RewardBalanced and plan.positive_share == 0.25

