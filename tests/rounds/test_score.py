"""The score stage: rewards and correctness by the task, each failure named with its input."""

import pytest

from lit_cancel import AdditionTask, MathWordTask, RewardError
from lit_cancel.rounds.score import score


def test_reward_function_that_raises_names_prompt_and_completion(gsm8k_file):
    def broken(record, completion):
        raise KeyError("score")

    task = MathWordTask(train_file=gsm8k_file, val_size=2, reward_fn=broken)
    record = task.train_records()[0]
    with pytest.raises(RewardError, match=r"raised KeyError: 'score' on prompt 'Question: Tom has 1 apples.*' and completion ' 7'"):
        score(task, [record], [" 7"])


def test_score_returns_rewards_in_order():
    task = AdditionTask(num_digits=1, train_size=20, val_size=5)
    record = task.train_records()[0]
    right = task.solutions(record)[0]
    assert score(task, [record, record, record], [right, "", right + "9"]).tolist() == [1.0, 0.0, 0.0]
