import pytest
import torch
from lit_cancel.callbacks.learning_tax import shared_positions

from lit_cancel import ScaffoldedAdditionTask
from lit_cancel.tasks import SCAFFOLD_TEXT, VERBOSE_TEXT
from lit_cancel.tokenizer import build_char_tokenizer


def record(scaffold: int, spread: int) -> dict:
    return {"prompt": f"s{scaffold}v{spread}:047+385=", "a": 47, "b": 385, "answer": "432", "scaffold": scaffold, "spread": spread}


def test_solutions_are_written_as_documented():
    task = ScaffoldedAdditionTask(scaffold=16, spread=6, train_size=10, val_size=2)
    example = record(16, 6)
    assert task.solution(example, [False, False, False], verbose=True) == "we-add-the-digit7+5+0=12;so-we,4+8+1=13;so-we,0+3+1=4;so-we|432"
    assert task.solution(example, [True, True, True]) == "we-add-the-digit5+7+0=12,8+4+1=13,3+0+1=4|432"
    assert len(task.solutions(example)) == 16  # 8 operand orders x terse/verbose
    assert len(task.solutions(record(16, 0))) == 8  # no verbose style without spread
    assert task.val_records()[0]["prompt"].startswith("s16v6:")


@pytest.mark.parametrize(
    "completion, reward",
    [
        ("we-add-the-digit7+5+0=12;so-we,4+8+1=13;so-we,0+3+1=4;so-we|432", 1.0),
        ("we-7+5+0=12,4+8+1=13|432", 1.0),  # only the answer is verified
        ("we-add-the-digit7+5+0=12,4+8+1=13,0+3+1=4|431", 0.0),
        ("we-add-the-digit7+5+0=12,4+8+1=13,0+3+1=4|432;so", 0.0),  # rambling after the answer
        ("we-add-the-digit7+5+0=12,4+8+1=13,0+3+1=4", 0.0),  # no answer
        ("", 0.0),
    ],
)
def test_reward_verifies_the_number_after_the_last_bar(completion, reward):
    task = ScaffoldedAdditionTask(train_size=10, val_size=2)
    assert task.reward(record(16, 6), completion) == reward


@pytest.mark.parametrize("scaffold", [0, 12, 24])
@pytest.mark.parametrize("spread", [0, 4, 8])
def test_knobs_set_the_shared_prefix_and_the_length_spread(scaffold, spread):
    task = ScaffoldedAdditionTask(scaffold=scaffold, spread=spread, train_size=10, val_size=50)
    tokenizer = build_char_tokenizer()
    for problem in task.val_records():
        solutions = task.solutions(problem)
        ids = [tokenizer(s, add_special_tokens=False)["input_ids"] for s in solutions]
        width = max(map(len, ids))
        tokens = torch.tensor([row + [0] * (width - len(row)) for row in ids])
        mask = torch.tensor([[1] * len(row) + [0] * (width - len(row)) for row in ids])
        shared = shared_positions(tokens, mask, torch.zeros(len(ids), dtype=torch.long))
        # all reference solutions share the scaffold, and exactly it where the first column's digits differ
        # (else the whole first step, written the same in either order, is shared too)
        if problem["a"] % 10 != problem["b"] % 10:
            assert int(shared[0].sum()) == scaffold
        else:
            assert int(shared[0].sum()) > scaffold
        assert solutions[0].startswith(SCAFFOLD_TEXT[:scaffold])
        assert all(len(row) == len(s) for row, s in zip(ids, solutions))  # one token per character, none dropped
        lengths = [len(s) for s in solutions]
        assert max(lengths) - min(lengths) == 3 * spread


def test_list_knobs_draw_a_setting_per_problem_and_the_splits_do_not_depend_on_them():
    mixed = ScaffoldedAdditionTask(scaffold=[0, 12], spread=[2, 8], train_size=400, val_size=20)
    settings = {(r["scaffold"], r["spread"]) for r in mixed.train_records()}
    assert settings == {(0, 2), (0, 8), (12, 2), (12, 8)}
    assert all(r["prompt"].startswith(f"s{r['scaffold']}v{r['spread']}:") for r in mixed.train_records())
    fixed = ScaffoldedAdditionTask(scaffold=24, spread=0, train_size=400, val_size=20)
    assert [(r["a"], r["b"]) for r in fixed.val_records()] == [(r["a"], r["b"]) for r in mixed.val_records()]


@pytest.mark.parametrize("options, name", [({"scaffold": -1}, "scaffold"), ({"spread": len(VERBOSE_TEXT) + 1}, "spread"), ({"scaffold": []}, "scaffold")])
def test_bad_knobs_fail_naming_the_option(options, name):
    with pytest.raises(ValueError, match=f"ScaffoldedAdditionTask: {name} must be"):
        ScaffoldedAdditionTask(**options)


def test_scaffold_config_trains_the_embedded_model_and_logs_the_tax(tmp_path):
    from lit_cancel.run.cli import run_cli

    cli = run_cli([
        "fit", "--config", "configs/scaffold.yaml", "--trainer.max_steps=2", "--trainer.enable_progress_bar=false",
        f"--trainer.logger.init_args.save_dir={tmp_path}", "--trainer.callbacks=[]", "--trainer.enable_checkpointing=false",
        "--data.init_args.prompts_per_round=2", "--data.init_args.group_size=4",
        "--data.init_args.task.init_args.val_size=4", "--model.init_args.val_samples=1",
        "--trainer.callbacks+=lit_cancel.callbacks.LearningTaxMonitor",
    ])
    assert cli.trainer.global_step == 2
    assert isinstance(cli.datamodule.task, ScaffoldedAdditionTask) and cli.datamodule.task.scaffolds == [24]
    (monitor,) = [c for c in cli.trainer.callbacks if type(c).__name__ == "LearningTaxMonitor"]
    assert monitor.last_tax is not None and 0 <= monitor.last_tax <= 1
