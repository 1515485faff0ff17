"""What ``lit-cancel`` says when a user's environment or its tools are wrong: one line naming the environment's class and
method and the record by split and index, exit status 2 when found before training (a start-up check builds one
environment; the validation before training runs the episodes, of which no more than ``max_failed_share`` may fail),
the step and checkpoint when a run that trained stops (its failure budget spent); and one line for an environment option
that names nothing usable, a TRL reward function with the wrong signature or a TRL row whose prompt of chat messages no
chat template renders."""

import json
import re
from pathlib import Path

import pytest
import yaml
from test_run_messages import NOTHING_RUN, STOPPED_AT
from test_run_safety import console, saved_step

from lit_cancel import AdditionTask
from lit_cancel.agents import Environment, Observation, ToolEnvironment, calculate
from lit_cancel.run.cli import run_cli

ADDITION = {"num_digits": 5, "train_size": 8, "val_size": 4}
# validation batches of 2: the third held-out record is the first of the second batch
THIRD_VAL_PROMPT = AdditionTask(**ADDITION).val_records()[2]["prompt"]


def agent_config(folder: Path, environment: dict, max_steps: int = 2, limit_val_batches: int = 2) -> Path:
    """A config of a few quick agent steps: the embedded agent, 2 prompts x 2 episodes of at most 2 turns, against
    ``environment`` (``{"environment": ...}`` or ``{"trl_environment": ...}``), checkpoints of every step."""
    config = {
        "seed_everything": 0,
        "trainer": {
            "max_steps": max_steps, "accelerator": "cpu", "devices": 1, "check_val_every_n_epoch": None,
            "val_check_interval": 1000, "num_sanity_val_steps": 0, "limit_val_batches": limit_val_batches,
            "enable_progress_bar": False, "enable_model_summary": False,
            "logger": {"class_path": "lightning.pytorch.loggers.TensorBoardLogger", "init_args": {"save_dir": str(folder), "name": "agent"}},
            "callbacks": [{"class_path": "lit_cancel.RunCheckpoint", "init_args": {"save_last": True, "every_n_train_steps": 1}}],
        },
        "model": {"class_path": "lit_cancel.RLModule",
                  "init_args": {"model_path": "embedded:tiny-agent", "max_new_tokens": 23, "val_samples": 1}},
        "data": {
            "class_path": "lit_cancel.RolloutDataModule",
            "init_args": {"prompts_per_round": 2, "group_size": 2, "val_batch_size": 2, "task": {
                "class_path": "lit_cancel.agents.EnvironmentTask",
                "init_args": {"task": {"class_path": "lit_cancel.AdditionTask", "init_args": ADDITION}, "max_turns": 2,
                              "max_episode_tokens": 64, **environment}}},
        },
    }
    path = folder / "agent.yaml"
    path.write_text(yaml.safe_dump(config))
    return path


class ResetRaises(Environment):
    """Its reset reads a field that the third held-out record lacks."""

    def reset(self, record):
        return record["secret"] if record["prompt"] == THIRD_VAL_PROMPT else None

    def step(self, action):
        return Observation("", done=True)


class StepReturnsInt(Environment):
    def reset(self, record):
        return None

    def step(self, action):
        return len(action)


class TRLCounter:
    """A TRL environment_factory whose reset reads a field that the third held-out record lacks."""

    def reset(self, **row):
        return row["secret"] if row["prompt"] == THIRD_VAL_PROMPT else None

    def increment(self, by: int) -> int:
        """Adds to the counter.

        Args:
            by: how much to add.
        """
        return by


def undocumented(expression: str) -> str:
    return expression


class UndocumentedTool(ToolEnvironment):
    def __init__(self):
        super().__init__([undocumented])


class OneToolTwice(ToolEnvironment):
    def __init__(self):
        super().__init__([calculate, calculate])


class FailsInRound2(Environment):
    """Its reset raises from the 5th episode on: round 1 (2 prompts x 2 episodes) trains step 1, every later round's
    episodes all fail."""

    resets = 0
    failed_on: list[str] = []

    def reset(self, record):
        FailsInRound2.resets += 1
        if FailsInRound2.resets > 4:
            FailsInRound2.failed_on.append(record["prompt"])
            raise KeyError("secret")
        return None

    def step(self, action):
        return Observation("", done=True)


def untyped_factory():
    return ResetRaises()


def refusal(monkeypatch, capsys, *args: str) -> list[str]:
    """The stderr lines of ``lit-cancel`` run with ``args``, which it must refuse with exit status 2 and no traceback."""
    status, lines = console(monkeypatch, capsys, *args)
    assert status == 2, lines[-5:]
    assert not any("Traceback" in line for line in lines)
    return lines


@pytest.mark.parametrize("command", ["fit", "validate"])
def test_episodes_that_fail_past_the_budget_in_the_validation_before_training_are_one_line_naming_the_cause_and_record(
        tmp_path, monkeypatch, capsys, command):
    config = agent_config(tmp_path, {"environment": "test_agent_messages.ResetRaises"})
    lines = refusal(monkeypatch, capsys, command, "--config", str(config), "--data.init_args.max_failed_share=0.2")
    # the third held-out record's greedy episode and its one sample, of 4 records' 8 episodes
    assert lines[-2:] == [NOTHING_RUN, "error: 2 of 8 episodes of the validation failed (25%, more than "
                          "data.init_args.max_failed_share=0.2), most often reset_raised (2 of them), e.g. ResetRaises.reset "
                          "raised on val record 2: KeyError: 'secret'"]


def test_episodes_that_fail_within_the_budget_are_counted_and_leave_the_accuracy_to_the_others(tmp_path):
    config = agent_config(tmp_path, {"environment": "test_agent_messages.ResetRaises"})
    cli = run_cli(["validate", "--config", str(config)])  # the default budget, 0.25, takes 2 of 8
    assert cli.trainer.callback_metrics["val/failed_episodes"] == 0.25


def test_a_step_that_returns_no_observation_is_one_line_naming_its_turn_and_record(tmp_path, monkeypatch, capsys):
    config = agent_config(tmp_path, {"environment": "test_agent_messages.StepReturnsInt"})
    lines = refusal(monkeypatch, capsys, "fit", "--config", str(config))
    assert lines[-2:] == [NOTHING_RUN, "error: 8 of 8 episodes of the validation failed (100%, more than "
                          "data.init_args.max_failed_share=0.25), most often step_wrong_type (8 of them), e.g. "
                          "StepReturnsInt.step returned int at turn 1 of val record 0; it must return an Observation"]


def test_a_trl_environment_named_in_a_config_runs_and_its_failure_names_its_own_class(tmp_path, monkeypatch, capsys):
    config = agent_config(tmp_path, {"trl_environment": "test_agent_messages.TRLCounter"})
    lines = refusal(monkeypatch, capsys, "fit", "--config", str(config), "--data.init_args.max_failed_share=0")
    assert lines[-1].endswith("most often reset_raised (2 of them), e.g. TRLCounter.reset raised on val record 2: KeyError: 'secret'")


@pytest.mark.parametrize(("environment", "message"), [
    ("UndocumentedTool", "UndocumentedTool raised at start-up: ValueError: tool undocumented: .*docstring"),
    ("OneToolTwice", "OneToolTwice raised at start-up: ValueError: two tools are named calculate"),
])
def test_a_tool_mistake_is_refused_at_start_up_before_anything_runs(tmp_path, monkeypatch, capsys, environment, message):
    validated = []
    monkeypatch.setattr("lightning.pytorch.Trainer.validate", lambda *args, **kwargs: validated.append(True))
    config = agent_config(tmp_path, {"environment": f"test_agent_messages.{environment}"})
    lines = refusal(monkeypatch, capsys, "fit", "--config", str(config))
    assert lines[-2] == NOTHING_RUN and validated == []
    assert re.fullmatch(f"error: the environment factory {message}.*", lines[-1]), lines[-1]


def test_a_spent_failure_budget_stops_the_run_naming_the_step_the_cause_a_record_and_the_checkpoint_to_resume_from(
        tmp_path, monkeypatch, capsys):
    monkeypatch.setattr(FailsInRound2, "resets", 0)
    monkeypatch.setattr(FailsInRound2, "failed_on", [])
    config = agent_config(tmp_path, {"environment": "test_agent_messages.FailsInRound2"}, max_steps=6, limit_val_batches=0)
    status, lines = console(monkeypatch, capsys, "fit", "--config", str(config), "--data.init_args.max_failed_rounds=2")
    last_ckpt = tmp_path / "agent" / "version_0" / "checkpoints" / "last.ckpt"
    assert status == 1 and not any("Traceback" in line for line in lines)
    # rounds 2 and 3 fail every episode: round 2 trains step 2 on nothing, round 3 spends the budget before step 3
    first_of_round_3 = FailsInRound2.failed_on[-4]
    index = [r["prompt"] for r in AdditionTask(**ADDITION).train_records()].index(first_of_round_3)
    assert lines[-3:] == [
        STOPPED_AT.format(2),
        "error: 2 rounds in a row had more than data.init_args.max_failed_share=0.25 of their episodes fail "
        "(data.init_args.max_failed_rounds=2); in the last, 4 of 4 (100%), most often reset_raised (4 of them), e.g. "
        f"FailsInRound2.reset raised on train record {index}: KeyError: 'secret'",
        f"the last good step is in {last_ckpt}",
    ]
    assert saved_step(last_ckpt) == 2


EXPECTED_ENVIRONMENT = ("expected the import path (module.Name) of a subclass of Environment or a function with the return "
                        "type hint -> Environment")


@pytest.mark.parametrize(("option", "value", "message"), [
    ("environment", "test_agent_messages.NoSuchEnv",
     f"test_agent_messages.NoSuchEnv was not found: module 'test_agent_messages' has no attribute 'NoSuchEnv'; {EXPECTED_ENVIRONMENT}"),
    ("environment", "nosuchmodule.Env",
     f"nosuchmodule.Env was not found: no module named 'nosuchmodule' on the Python path; {EXPECTED_ENVIRONMENT}"),
    ("environment", "test_agent_messages.untyped_factory",
     "test_agent_messages.untyped_factory is a function without the return type hint -> Environment, which the option needs "
     "to take it: add it (def untyped_factory() -> Environment), or name a subclass of Environment"),
    ("environment", "test_agent_messages.TRLCounter", f"test_agent_messages.TRLCounter is not a subclass of Environment; {EXPECTED_ENVIRONMENT}"),
    ("trl_environment", "nosuchmodule.Env",
     "nosuchmodule.Env was not found: no module named 'nosuchmodule' on the Python path; expected the import path "
     "(module.Name) of a class or a function"),
])
def test_an_environment_option_that_names_nothing_usable_is_one_line_naming_the_option_the_path_and_what_was_expected(
        tmp_path, monkeypatch, capsys, option, value, message):
    lines = refusal(monkeypatch, capsys, "fit", "--config", str(agent_config(tmp_path, {option: value})))
    assert lines == [NOTHING_RUN, f"error: data.init_args.task.init_args.{option}: {message}"]


def two_arguments(prompts, completions):
    """A TRL reward function that takes no other keyword arguments: TRL's call gives it environments=, columns, ..."""
    return [0.0] * len(prompts)


def test_a_trl_reward_function_with_the_wrong_signature_is_refused_at_start_up(tmp_path, monkeypatch, capsys):
    config = agent_config(tmp_path, {"trl_environment": "test_agent_messages.TRLCounter",
                                     "reward_funcs": ["test_agent_messages.two_arguments"]})
    lines = refusal(monkeypatch, capsys, "fit", "--config", str(config))
    assert lines[-2] == NOTHING_RUN
    assert re.fullmatch(r"error: the reward function two_arguments raised TypeError: .*unexpected keyword argument .* on "
                        r"train record 0 \(checked at start-up: a reward function is called as TRL calls it, f\(prompts=\.\.\., "
                        r"completions=\.\.\., completion_ids=\.\.\., environments=\.\.\., \*\*columns\), and returns one number "
                        r"or None per completion\)", lines[-1]), lines[-1]


def test_a_trl_row_whose_prompt_is_chat_messages_without_a_chat_template_is_refused_at_start_up(tmp_path, monkeypatch, capsys):
    data = tmp_path / "rows.jsonl"
    rows = [{"prompt": [{"role": "user", "content": f"{a}+{a}?"}], "answer": str(2 * a)} for a in range(4)]
    data.write_text("".join(json.dumps(row) + "\n" for row in rows))
    task = {"class_path": "lit_cancel.DatasetTask", "init_args": {"train_file": str(data), "val_size": 1}}
    config = agent_config(tmp_path, {"task": task, "trl_environment": "test_agent_messages.TRLCounter",
                                     "reward_funcs": ["test_agent_messages.two_arguments"]})
    lines = refusal(monkeypatch, capsys, "fit", "--config", str(config))
    assert lines[-2:] == [NOTHING_RUN, f"error: EnvironmentTask: the prompt of train record 0 ({str(data)!r} line 1) is a list "
                          "of chat messages; set chat_template to a folder whose tokenizer has a chat template (an instruct "
                          "model's) to render them, as TRL renders a conversational prompt"]
