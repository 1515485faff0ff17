"""MathVerifyReward on hand-made answers, through MathWordTask and through its config."""

import sys

import pytest
from jsonargparse import ArgumentParser

from lit_cancel import MathVerifyReward, MathWordTask


def test_a_missing_package_names_the_extra_at_construction(monkeypatch):
    monkeypatch.setitem(sys.modules, "math_verify", None)  # makes `import math_verify` raise ImportError
    with pytest.raises(ImportError, match=r'pip install "lit-cancel\[math\]"'):
        MathVerifyReward()


@pytest.mark.parametrize(
    ("answer", "completion", "reward"),
    [
        ("He has 1/2 left.\n#### 0.5", r"So the share is $\boxed{1/2}$.", 1.0),
        ("#### 0.5", r"Half of it: \boxed{\frac{1}{2}}", 1.0),
        (r"#### \frac{1}{2}", "The answer is 0.5", 1.0),
        ("#### 1,000", r"\boxed{1000}", 1.0),
        ("#### 72", "She sold 48+24 = 72 clips.\n#### 72", 1.0),
        ("#### x^2+1", r"\boxed{1+x^2}", 1.0),
        ("#### 0.5", r"\boxed{\frac{1}{3}}", 0.0),
        ("#### 72", "#### 71", 0.0),
        ("#### 3", r"\boxed{3}, or rather \boxed{4}", 0.0),
        ("#### 0.5", "I do not know.", 0.0),
        ("#### 0.5", "", 0.0),
    ],
)
def test_hand_made_answers(answer, completion, reward):
    pytest.importorskip("math_verify")
    assert MathVerifyReward()({"answer": answer}, completion) == reward


def test_a_reference_it_cannot_parse_raises_instead_of_scoring_zero():
    pytest.importorskip("math_verify")
    with pytest.raises(ValueError, match="cannot parse the reference answer ''"):
        MathVerifyReward()({"answer": "It is unknown.\n#### "}, r"\boxed{1}")
    with pytest.raises(KeyError, match="no field 'solution'"):
        MathVerifyReward(answer_field="solution")({"answer": "#### 1"}, r"\boxed{1}")


def test_math_word_task_takes_it_from_a_config(gsm8k_file):
    pytest.importorskip("math_verify")
    parser = ArgumentParser()
    parser.add_class_arguments(MathWordTask, "task")
    config = parser.parse_args([f"--task.train_file={gsm8k_file}", "--task.val_size=2",
                                "--task.reward_fn=lit_cancel.MathVerifyReward"])
    task = parser.instantiate_classes(config).task
    assert isinstance(task.reward_fn, MathVerifyReward)
    record = task.train_records()[0]  # Tom has 1 apples and buys 2 more
    assert task.reward(record, r"He has $\boxed{3}$ apples.") == 1.0
    assert task.reward(record, r"He has $\boxed{\frac{6}{2}}$ apples.") == 1.0
    assert task.reward(record, r"He has $\boxed{2}$ apples.") == 0.0
