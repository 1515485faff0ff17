"""A TRL 1.16 port as a new user writes it: an environment_factory named by class path in a config, TRL's reward
functions reading the episodes' environments and the rows' fields, weighted and summed as TRL sums them, and TRL's rows
(a prompt of chat messages) read as they are by DatasetTask and rendered by a chat template."""

import json
import math
import re

import lightning as L
import pytest
import torch
import yaml

from lit_cancel import AdditionTask, DatasetTask, RewardError, RLModule
from lit_cancel.agents import ColonCalls, EnvironmentTask, TRLEnvironment, calculate
from lit_cancel.agents.episodes import Episode
from lit_cancel.agents.trl_rewards import RewardFunctions
from lit_cancel.rounds.sample import encode_prompts
from lit_cancel.run.cli import run_cli

ADDITION = {"num_digits": 5, "train_size": 8, "val_size": 4}


class Ledger:
    """A TRL environment whose tool keeps what it computed; what scores it reads that state, never the transcript."""

    def reset(self, **row):
        self.results = []

    def calculate(self, expression: str) -> str:
        """Evaluates arithmetic.

        Args:
            expression: what to compute, as 12+34.
        """
        self.results.append(calculate(expression))
        return self.results[-1]

    def get_reward(self):
        return 0.5 if self.results else None


SCORED = {}


def computed_the_sum(environments, completion_ids, a, b, **kwargs):
    """1.0 where the tool's last result is the row's sum, 0.0 where it is another, None where the tool was not called;
    kept by the episode's tokens, with the environment's own reward, for the test to compare."""
    values = [None if not env.results else float(env.results[-1] == str(x + y)) for env, x, y in zip(environments, a, b)]
    for ids, env, value in zip(completion_ids, environments, values):
        SCORED[tuple(ids)] = (value, env.get_reward())
    return values


class Trained(L.Callback):
    def __init__(self):
        self.batches = []

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
        self.batches.append(batch)


def port_config(folder, task: dict, max_steps: int = 2, limit_val_batches: int = 0, callbacks: tuple = ()) -> str:
    """A config of a few agent steps of the shipped tiny agent, 2 prompts x 4 episodes of at most 2 turns, with ``task``'s
    options for an EnvironmentTask."""
    config = {
        "seed_everything": 0,
        "trainer": {
            "max_steps": max_steps, "accelerator": "cpu", "devices": 1, "check_val_every_n_epoch": None,
            "val_check_interval": 1000, "num_sanity_val_steps": 0, "limit_val_batches": limit_val_batches,
            "enable_progress_bar": False, "enable_model_summary": False, "enable_checkpointing": False, "logger": False,
            "default_root_dir": str(folder),  # where the CLI saves the config it ran
            "callbacks": [{"class_path": path} for path in callbacks],
        },
        "model": {"class_path": "lit_cancel.RLModule",
                  "init_args": {"model_path": "embedded:tiny-agent", "max_new_tokens": 23, "val_samples": 1}},
        "data": {"class_path": "lit_cancel.RolloutDataModule",
                 "init_args": {"prompts_per_round": 2, "group_size": 4, "val_batch_size": 2, "task": {
                     "class_path": "lit_cancel.agents.EnvironmentTask",
                     "init_args": {"max_turns": 2, "max_episode_tokens": 64, **task}}}},
    }
    path = folder / "port.yaml"
    path.write_text(yaml.safe_dump(config))
    return str(path)


def test_a_trl_environment_named_in_a_config_trains_on_what_trl_reward_functions_compute_from_its_state(tmp_path):
    """TRL's rows as they are (a dataset file read by DatasetTask), its environment by class path, its reward function
    reading environments= and the rows' fields: the reward each episode trains on is theirs."""
    SCORED.clear()
    addition = AdditionTask(**ADDITION)
    for split, records in (("train", addition.train_records()), ("val", addition.val_records())):
        (tmp_path / f"{split}.jsonl").write_text("".join(json.dumps(record) + "\n" for record in records))
    config = port_config(tmp_path, {
        "task": {"class_path": "lit_cancel.DatasetTask",
                 "init_args": {"train_file": str(tmp_path / "train.jsonl"), "val_file": str(tmp_path / "val.jsonl")}},
        "trl_environment": "test_trl_port.Ledger", "call_format": {"class_path": "lit_cancel.agents.ColonCalls"},
        "reward_funcs": ["test_trl_port.computed_the_sum"], "reward_weights": [2.0],
    }, callbacks=("test_trl_port.Trained",))
    cli = run_cli(["fit", "--config", config])
    trained = next(callback for callback in cli.trainer.callbacks if isinstance(callback, Trained))
    assert len(trained.batches) == 2
    seen = []
    for batch in trained.batches:
        values = []
        for row in range(len(batch.rewards)):
            ids = batch.input_ids[row, batch.prompt_length:][batch.attention_mask[row, batch.prompt_length:].bool()]
            value, environment_reward = SCORED[tuple(ids.tolist())]
            # TRL's sum: each function's value times its weight, get_reward with weight 1, Nones left out; the task's
            # reward (a DatasetTask without reward_fn: 0) where all are None
            terms = [2.0 * value] if value is not None else []
            terms += [environment_reward] if environment_reward is not None else []
            assert batch.rewards[row].item() == (sum(terms) if terms else 0.0)
            values.append(value)
        seen += values
    # the tiny agent calls the tool in some episodes and answers at once in others
    assert 1.0 in seen and None in seen
    # each source's mean over the last round's episodes where it gave a value
    called = [value for value in values if value is not None]
    assert cli.trainer.callback_metrics["rollout/reward/computed_the_sum"].item() == pytest.approx(sum(called) / len(called))
    assert cli.trainer.callback_metrics["rollout/reward/Ledger"].item() == 0.5


def scored_episodes(instances, transcripts):
    """Finished episodes of train records 0, 1, ... against TRL environments ``instances``."""
    return [Episode([], TRLEnvironment(instance), f"train record {i}", tokens=[i], transcript=transcript)
            for i, (instance, transcript) in enumerate(zip(instances, transcripts))]


class Plain:
    def reset(self, **row):
        pass


def answers(completions, **kwargs):
    return [float(c.endswith("5")) if c else None for c in completions]


@pytest.mark.parametrize(("function", "message"), [
    (lambda completions, answer, **kwargs: [float(a) for a in answer],
     "the reward function <lambda> raised ValueError: could not convert string to float: 'x' on train record 1"),
    (lambda completions, **kwargs: [1.0, 0.0],
     "the reward function <lambda> returned 2 values for 3 completions (train record 0, train record 1 and 1 more); "
     "expected one number or None per completion"),
    (lambda completions, **kwargs: [1.0, "yes", 0.0],
     "the reward function <lambda> returned 'yes' (str), expected a finite number, on train record 1"),
    (lambda completions, **kwargs: [1.0, math.inf, 0.0],
     "the reward function <lambda> returned inf (float), expected a finite number, on train record 1"),
    (lambda completions, **kwargs: 1.0, "the reward function <lambda> returned float on train record 0, train record 1 "
     "and 1 more; expected a list of one number or None per completion"),
    (lambda prompts, completions: [0.0] * 3,
     "the reward function <lambda> raised TypeError: <lambda>() got an unexpected keyword argument 'answer' on train record 0"),
    (lambda completions, **kwargs: [1.0] if len(completions) == 1 else completions.scores,  # raises on no episode alone
     "the reward function <lambda> raised AttributeError: 'list' object has no attribute 'scores' on the 3 episodes of "
     "train record 0, train record 1 and 1 more"),
])
def test_a_reward_function_that_fails_is_one_line_naming_it_and_the_record(function, message):
    rows = [{"prompt": "q", "answer": answer} for answer in ("1", "x", "2")]
    with pytest.raises(RewardError) as raised:
        RewardFunctions([function])(rows, scored_episodes([Plain() for _ in rows], [["a"]] * 3))
    assert str(raised.value) == message


def test_reward_functions_are_weighted_and_summed_with_the_environments_reward_and_none_left_out():
    class Scored(Plain):
        def __init__(self, value):
            self.value = value

        def get_reward(self):
            return self.value

    rows = [{"prompt": "q", "answer": "5"}] * 3
    episodes = scored_episodes([Scored(value) for value in (1.0, None, None)], [["5"], ["4"], [""]])
    rewards, stats = RewardFunctions([answers, lambda environments, **kwargs: [0.25] * 3], [3.0, 2.0])(rows, episodes)
    # 3 * 1 + 2 * 0.25 + 1 (get_reward); 3 * 0 + 2 * 0.25; answers None: 2 * 0.25
    assert rewards == [4.5, 0.5, 0.5]
    assert stats == {"rollout/reward/answers": 0.5, "rollout/reward/<lambda>": 0.25, "rollout/reward/Scored": 1.0}
    with pytest.warns(UserWarning, match="every reward function and the environment returned None on train record 2"):
        rewards, _ = RewardFunctions([answers])(rows, episodes[1:] + episodes[2:])
    assert rewards[0] == 0.0 and math.isnan(rewards[1])  # for the task's reward


@pytest.mark.parametrize(("options", "message"), [
    ({"reward_funcs": ["test_trl_port.nothing"]}, "EnvironmentTask: reward_funcs[0]: test_trl_port.nothing was not found: "
     "module 'test_trl_port' has no attribute 'nothing'; expected a function or the import path (module.function) of one"),
    ({"reward_funcs": ["nomodule.f"]}, "EnvironmentTask: reward_funcs[0]: nomodule.f was not found: no module named "
     "'nomodule' on the Python path"),
    ({"reward_funcs": ["answers"]}, "EnvironmentTask: reward_funcs[0]: 'answers' is not an import path"),
    ({"reward_funcs": [answers], "reward_weights": [1.0, 2.0]},
     "EnvironmentTask: reward_weights has 2 values for 1 reward functions; give one weight per function"),
    ({"reward_weights": [1.0]}, "EnvironmentTask: reward_weights weigh reward_funcs, and none are given"),
])
def test_reward_functions_and_weights_that_name_nothing_usable_are_refused_in_one_line(options, message):
    with pytest.raises(ValueError, match=f"^{re.escape(message)}"):
        EnvironmentTask(AdditionTask(num_digits=1, train_size=4, val_size=2), trl_environment=Plain, **options)


CHAT_ROWS = [
    {"prompt": [{"role": "system", "content": "You add."}, {"role": "user", "content": f"{a}+{b}?"}], "answer": str(a + b), "id": a}
    for a, b in [(1, 2), (3, 4), (5, 6), (7, 8)]
]


class Recorder(Ledger):
    rows = []

    def reset(self, **row):
        Recorder.rows.append(row)
        super().reset(**row)


CALLS = []


def recorded(prompts, completions, completion_ids, environments, answer, id, **kwargs):
    CALLS.append({"prompts": prompts, "completions": completions, "answer": answer, "id": id, "environments": environments})
    return [0.5] * len(prompts)


def test_trl_rows_with_chat_message_prompts_run_through_a_dataset_task_and_a_chat_template(tmp_path, qwen_like_path):
    data = tmp_path / "rows.jsonl"
    data.write_text("".join(json.dumps(row) + "\n" for row in CHAT_ROWS))
    task = EnvironmentTask(DatasetTask(str(data), val_size=1), trl_environment=Recorder, reward_funcs=[recorded],
                           reward_weights=[2.0], chat_template=qwen_like_path, max_turns=2, max_turn_tokens=8, max_episode_tokens=64)
    Recorder.rows.clear()
    CALLS.clear()
    task.check_startup()
    records = task.train_records()
    assert len(records) == 3 and records[0]["answer"] == "3" and records[0]["id"] == 1
    # rendered by the chat template: the system message, the tool's schema, the user's turn, the assistant's to come
    prompt = records[0]["prompt"]
    assert prompt.startswith("<|im_start|>system\nYou add.") and '"name": "calculate"' in prompt
    assert prompt.endswith("<|im_start|>user\n1+2?<|im_end|>\n<|im_start|>assistant\n")
    module = RLModule(qwen_like_path, max_new_tokens=8)
    encoded = encode_prompts(module.tokenizer, records)
    Recorder.rows.clear()
    CALLS.clear()
    torch.manual_seed(0)
    generation = task.rollout(module, records, encoded["input_ids"], encoded["attention_mask"], num_samples=2)
    assert generation.rewards.tolist() == [1.0] * 6
    # reset(**row) and the reward functions get the rows as the file has them, the prompt as chat messages
    assert [row["prompt"] for row in Recorder.rows] == [CHAT_ROWS[i]["prompt"] for i in (0, 0, 1, 1, 2, 2)]
    [call] = CALLS
    assert call["prompts"] == [CHAT_ROWS[i]["prompt"] for i in (0, 0, 1, 1, 2, 2)]
    assert call["answer"] == ["3", "3", "7", "7", "11", "11"] and call["id"] == [1, 1, 3, 3, 5, 5]
    assert [type(environment) for environment in call["environments"]] == [Recorder] * 6
    # a completion is the policy's turns as assistant messages
    for completion, text in zip(call["completions"], generation.texts):
        assert completion and all(message["role"] == "assistant" for message in completion)
        assert completion[0]["content"] == text[:len(completion[0]["content"])]


def test_a_dataset_task_that_nothing_scores_is_refused_at_start_up(tmp_path):
    data = tmp_path / "rows.jsonl"
    data.write_text("".join(json.dumps({"prompt": f"{a}+{a}=", "answer": str(2 * a)}) + "\n" for a in range(4)))
    task = EnvironmentTask(DatasetTask(str(data), val_size=1), trl_environment=Plain, call_format=ColonCalls())
    with pytest.raises(ValueError, match="^EnvironmentTask: nothing scores the episodes: DatasetTask has no reward of its own, "
                                         "reward_funcs is empty and Plain.get_reward is not defined"):
        task.check_startup()
    # a reward function, or an environment's get_reward, scores them
    EnvironmentTask(DatasetTask(str(data), val_size=1), trl_environment=Plain, reward_funcs=[answers]).check_startup()
    EnvironmentTask(DatasetTask(str(data), val_size=1), trl_environment=Ledger).check_startup()
