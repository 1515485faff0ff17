"""The warm start of a TRL port, on an environment other than the calculator: configs/sft-environment.yaml trains the
tiny model on demonstrations replayed against examples/unit_conversion's TRL environment (the call, the tool's result,
the answer), and configs/trl-environment.yaml, the RL run that starts from it, builds."""

import json
import random
import re
from pathlib import Path

import lightning as L
import pytest
from lightning.pytorch import LightningDataModule, LightningModule
from unit_conversion import FACTORS, UnitConverter, correct_answer, demonstration_turns

from lit_cancel import DatasetTask
from lit_cancel.agents import ColonCalls, EnvironmentTask
from lit_cancel.run.cli import LitCancelCLI, run_cli

ROOT = Path(__file__).parents[2]
SFT, RL = ROOT / "configs" / "sft-environment.yaml", ROOT / "configs" / "trl-environment.yaml"
EXAMPLE = ROOT / "examples" / "unit_conversion"


class Trained(L.Callback):
    def __init__(self):
        self.batches = []

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
        self.batches.append(batch)


def converted(prompt: str) -> str:
    """The converted amount of a prompt such as "123mi>km=", to two decimals: what the tool answers."""
    amount, units = prompt[:-6], prompt[-6:-1]
    return f"{int(amount) * FACTORS[units]:.2f}"


def test_the_rows_answers_are_what_the_tool_gives():
    rows = [json.loads(line) for name in ("train.jsonl", "val.jsonl") for line in (EXAMPLE / name).read_text().splitlines()]
    assert len(rows) == 2200 and len({row["prompt"] for row in rows}) == 2200  # held-out rows are no training rows
    assert all(row["answer"] == converted(row["prompt"]) for row in rows)


def test_the_warm_start_trains_on_the_call_and_the_result_the_environment_gives(tmp_path):
    output = tmp_path / "model"
    cli = run_cli([
        "fit", "--config", str(SFT), "--trainer.enable_progress_bar=false", f"--trainer.logger.init_args.save_dir={tmp_path}",
        "--trainer.max_steps=3", "--trainer.limit_val_batches=1", "--data.init_args.batch_size=8",
        "--data.init_args.val_batch_size=4", "--model.init_args.val_samples=1", f"--model.init_args.output_dir={output}",
        "--trainer.callbacks+=test_unit_conversion_recipe.Trained",
    ])
    assert cli.trainer.global_step == 3 and (output / "config.json").exists()
    tokenizer, eos = cli.model.tokenizer, cli.model.tokenizer.eos_token_id
    [trained] = [callback for callback in cli.trainer.callbacks if isinstance(callback, Trained)]
    rows = 0
    for batch in trained.batches:
        for ids, labels, mask in zip(batch["input_ids"].tolist(), batch["labels"].tolist(), batch["attention_mask"].tolist()):
            ids = ids[:sum(mask)]
            text = tokenizer.decode(ids)
            prompt = text[:text.index("=") + 1]
            quantity, answer = prompt.rstrip("="), converted(prompt)
            # the prompt, the call and its stop token, the tool's result as the environment renders it, the answer
            expected = tokenizer(f"{prompt}convert: {quantity}", add_special_tokens=False)["input_ids"] + [eos]
            result = tokenizer(f" = {answer}\n", add_special_tokens=False)["input_ids"]
            expected += result + tokenizer(answer, add_special_tokens=False)["input_ids"] + [eos]
            assert ids == expected, text
            # trained: the turns and their stop tokens; not the prompt nor the environment's reply
            trained_positions = [position for position, label in enumerate(labels[:len(ids)]) if label != -100]
            reply_start = expected.index(eos) + 1
            assert reply_start not in trained_positions and reply_start - 1 in trained_positions
            assert len(trained_positions) == len(ids) - len(tokenizer(prompt, add_special_tokens=False)["input_ids"]) - len(result)
            rows += 1
    assert rows == 24


def test_the_rl_recipe_builds_with_the_trl_environment_its_rows_and_reward_function(tmp_path, capsys):
    with pytest.raises(SystemExit):
        run_cli(["fit", "--config", str(RL), "--print_config"])
    assert "unit_conversion.UnitConverter" in capsys.readouterr().out
    cli = LitCancelCLI(LightningModule, LightningDataModule, subclass_mode_model=True, subclass_mode_data=True, run=False,
                       args=["--config", str(RL), "--model.init_args.model_path=embedded:tiny-agent",
                             f"--trainer.logger.init_args.save_dir={tmp_path}"])
    task = cli.datamodule.task
    assert isinstance(task, EnvironmentTask) and isinstance(task.task, DatasetTask)
    assert task.reward_functions.functions == [correct_answer] and task.reward_functions.weights == [1.0]
    assert isinstance(task.environment().instance, UnitConverter)
    assert task.train_records()[0] == json.loads((EXAMPLE / "train.jsonl").read_text().splitlines()[0])


def unit_task(turns) -> EnvironmentTask:
    return EnvironmentTask(DatasetTask(str(EXAMPLE / "train.jsonl"), str(EXAMPLE / "val.jsonl")), trl_environment=UnitConverter,
                           call_format=ColonCalls(), reward_funcs=[correct_answer], demonstration_turns=turns, max_turns=3)


def test_a_demonstration_is_replayed_against_a_new_environment_and_one_that_cannot_be_is_one_line_at_start_up():
    task = unit_task(demonstration_turns)
    record = task.train_records()[0]
    assert task.demonstration(record, random.Random(0)) == [
        (f"convert: {record['prompt'][:-1]}", f" = {record['answer']}\n"), (record["answer"], "")]
    where = "train record 0 ('" + str(EXAMPLE / "train.jsonl") + "' line 1)"
    with pytest.raises(ValueError, match="^" + re.escape(f"the demonstration of {where} has 3 turns, but its episode ends at "
                                                         "turn 2 ('82.55'): the environment ended it") + "$"):
        unit_task(lambda row: [*demonstration_turns(row), "again"]).check_startup()
    with pytest.raises(ValueError, match=r"^demonstration_turns <lambda> returned 'convert: 1mi>km' on train record 0 .*; it "
                                         "must return the policy's turns, a non-empty list of texts$"):
        unit_task(lambda row: "convert: 1mi>km").check_startup()
    with pytest.raises(ValueError, match=r"^demonstration_turns <lambda> raised on train record 0 .*: KeyError: 'solution'$"):
        unit_task(lambda row: [row["solution"]]).check_startup()
