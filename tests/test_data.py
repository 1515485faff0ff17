import pytest
import torch

from lit_cancel import AdditionTask, RolloutBatch, RolloutDataModule, Shuffled


@pytest.mark.parametrize(
    ("options", "message"),
    [
        ({"group_size": 1}, "group_size must be >= 2"),
        ({"prompts_per_round": 10, "mini_batches_per_round": 3}, r"the 10 groups of a round \(per process\) must divide into mini_batches_per_round \(3\)"),
        ({"prompts_per_round": 10, "mini_batches_per_round": 3, "plan": Shuffled()}, r"80 rollouts \(per process\) must divide into mini_batches_per_round \(3\)"),
        ({"prompts_per_round": 0}, "prompts_per_round must be >= 1"),
        ({"epochs_per_round": 0}, "epochs_per_round must be >= 1"),
        ({"val_batch_size": 0}, "val_batch_size must be >= 1"),
    ],
)
def test_bad_sizes_are_refused(options, message):
    with pytest.raises(ValueError, match=message):
        RolloutDataModule(AdditionTask(num_digits=2, train_size=100, val_size=5), **options)


def test_round_prompts_cover_the_training_set_and_differ_by_rank():
    task = AdditionTask(num_digits=2, train_size=24, val_size=4)
    data = RolloutDataModule(task, prompts_per_round=8, group_size=2, seed=5)
    one_pass = [r["prompt"] for k in range(3) for r in data.producer.draw_records(k, rank=0, world=1)]
    assert sorted(one_pass) == sorted(r["prompt"] for r in task.train_records())
    assert one_pass != [r["prompt"] for r in task.train_records()]  # shuffled
    # two ranks split the same global round between them
    halves = data.producer.draw_records(1, rank=0, world=2) + data.producer.draw_records(1, rank=1, world=2)
    assert [r["prompt"] for r in halves] == one_pass[8:16]
    # the second pass is another permutation
    assert [r["prompt"] for r in data.producer.draw_records(3, 0, 1)] != one_pass[:8]


def test_state_dict_round_trip_keeps_unspent_mini_batches():
    data = RolloutDataModule(AdditionTask(num_digits=2, train_size=100, val_size=5), group_size=2)
    batch = RolloutBatch(
        input_ids=torch.ones(2, 3, dtype=torch.long), attention_mask=torch.ones(2, 3, dtype=torch.long),
        completion_mask=torch.ones(2, 2, dtype=torch.long), prompt_length=1, rewards=torch.tensor([1.0, 0.0]),
        advantages=torch.tensor([0.7, -0.7]), group_ids=torch.tensor([3, 3]), step_sequences=2, step_tokens=4,
    )
    data.rounds_done, data.producer.prompt_draws, data.pending, data.waiting = 7, 9, [batch], batch.select(torch.tensor([1]))
    restored = RolloutDataModule(AdditionTask(num_digits=2, train_size=100, val_size=5), group_size=2)
    restored.load_state_dict(data.state_dict())
    assert (restored.rounds_done, restored.producer.prompt_draws) == (7, 9)
    assert restored.waiting.advantages.tolist() == pytest.approx([-0.7])
    assert torch.equal(restored.pending[0].advantages, batch.advantages) and restored.pending[0].step_tokens == 4
