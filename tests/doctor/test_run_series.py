"""The round series a run doctor reads: reward of cut and of finished completions, correctness apart from the reward
and its correlation with the reward; each logged only for a round that has it, and carried through checkpoints."""

from functools import partial

import lightning as L
import numpy as np
import pytest
import torch
from lightning.pytorch.callbacks import ModelCheckpoint
from lightning.pytorch.loggers import Logger

from lit_cancel import AdditionTask, RewardError, RLModule, RolloutBatch, RolloutDataModule
from lit_cancel.rounds.score import accuracy_terms, check_reward, correctness
from lit_cancel.tasks import Task


def quarter(record, completion):
    """A shaped reward that says nothing of correctness."""
    return 0.25


class Undecided(AdditionTask):
    """Addition that cannot tell correctness: ``correct`` is None."""

    def correct(self, record, completion):
        return None


def test_correctness_and_validation_terms_by_hand():
    task = AdditionTask(num_digits=1, train_size=20, val_size=5, reward_fn=quarter)
    record = task.train_records()[0]
    right, wrong = task.solutions(record)[0], "|" + str(int(record["answer"]) + 1)
    assert correctness(task, [record] * 3, [right, wrong, ""]).tolist() == [1.0, 0.0, 0.0]
    assert accuracy_terms(task, [record] * 2, [right, wrong]).tolist() == [1.0, 0.0]
    undecided = Undecided(num_digits=1, train_size=20, val_size=5, reward_fn=quarter)
    assert correctness(undecided, [record], [right])[0].isnan()
    assert accuracy_terms(undecided, [record] * 2, [right, wrong]).tolist() == [0.25, 0.25]  # the reward, as before


class Verdict(AdditionTask):
    """A task whose ``correct`` returns ``verdict``, and whose reward is a number whatever it is."""

    def __init__(self, verdict):
        super().__init__(num_digits=1, train_size=20, val_size=5, reward_fn=quarter)
        self.verdict = verdict

    def correct(self, record, completion):
        return self.verdict


@pytest.mark.parametrize("verdict", [True, np.False_, torch.tensor(True), 1, None])
def test_bools_and_none_are_verdicts(verdict):
    task = Verdict(verdict)
    value = correctness(task, task.train_records()[:1], [""])[0]
    assert value.isnan() if verdict is None else value == float(verdict)


@pytest.mark.parametrize("verdict", [0.5, "yes", float("nan")])
def test_a_verdict_that_is_not_a_bool_is_named_with_its_input_and_stops_the_run_at_start_up(verdict):
    task = Verdict(verdict)
    with pytest.raises(RewardError, match=r"Verdict.correct returned .* expected True, False or None, on prompt '"):
        correctness(task, task.train_records()[:1], [""])
    with pytest.raises(RewardError, match=r"and completion '' \(checked at start-up: a task's correct is called as correct"):
        check_reward(task)


def fit(data, steps: int, **trainer_options) -> tuple[L.Trainer, RLModule]:
    module = RLModule("embedded:tiny-adder", max_new_tokens=40, optimizer=partial(torch.optim.AdamW, lr=1e-4))
    options = dict(logger=False, enable_checkpointing=False) | trainer_options
    trainer = L.Trainer(max_steps=steps, accelerator="cpu", devices=1, enable_progress_bar=False, enable_model_summary=False,
                        limit_val_batches=0, **options)
    trainer.fit(module, datamodule=data)
    return trainer, module


class FirstBatch(L.Callback):
    """The first micro-batch the training step receives, and its statistics."""

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
        if not hasattr(self, "batch"):
            self.batch, self.stats = batch, dict(batch.stats)


def length_reward(record, completion):
    """A shaped reward that differs from correctness."""
    return len(completion) / 40


def test_rollouts_carry_the_tasks_correctness_beside_a_reward_that_differs_from_it():
    task = AdditionTask(num_digits=3, train_size=64, val_size=4, reward_fn=length_reward)
    data = RolloutDataModule(task, prompts_per_round=2, group_size=4, seed=3)
    first = FirstBatch()
    trainer, module = fit(data, 1, callbacks=[first])
    batch = first.batch
    # the first draw's groups are numbered from 0 (rows are reordered: groups with a reward difference first)
    records = [data.producer.draw_records(0, rank=0, world=1)[group] for group in batch.group_ids.tolist()]
    texts = [module.tokenizer.decode(ids[mask.bool()], skip_special_tokens=True)
             for ids, mask in zip(batch.input_ids[:, batch.prompt_length:], batch.completion_mask)]
    expected = [float(task.correct(r, t)) for r, t in zip(records, texts)]
    assert batch.correct.tolist() == expected
    assert batch.rewards.tolist() == pytest.approx([length_reward(r, t) for r, t in zip(records, texts)])
    assert first.stats["rollout/accuracy"] == pytest.approx(sum(expected) / 8)
    rewards = batch.rewards.numpy()
    if np.ptp(rewards) > 0 and 0 < sum(expected) < 8:
        assert first.stats["rollout/reward_correct_corr"] == pytest.approx(np.corrcoef(rewards, expected)[0, 1], abs=1e-6)
    else:
        assert "rollout/reward_correct_corr" not in first.stats


class Recorded(Logger):
    """The metrics each call of ``log_metrics`` received, by step."""

    def __init__(self):
        super().__init__()
        self.steps: dict[int, dict[str, float]] = {}

    name, version = "recorded", 0

    def log_metrics(self, metrics, step=None):
        self.steps.setdefault(step, {}).update(metrics)

    def log_hyperparams(self, *args, **kwargs):
        pass


class SecondRoundWithoutFinished(RolloutDataModule):
    """Its second round has no ``rollout/reward_finished``, as a round whose every completion was cut."""

    def micro_batches(self, train, steps, stats):
        if self.rounds_done == 1:
            stats = {k: v for k, v in stats.items() if k != "rollout/reward_finished"}
        return super().micro_batches(train, steps, stats)


class CallbackMetricNames(L.Callback):
    """The names in ``trainer.callback_metrics`` after each optimizer step."""

    def __init__(self):
        self.names = []

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        self.names.append(set(trainer.callback_metrics))


def test_a_key_a_round_lacks_is_not_logged_at_its_steps_and_the_others_are_at_every_step():
    logger, seen = Recorded(), CallbackMetricNames()
    data = SecondRoundWithoutFinished(AdditionTask(num_digits=3, train_size=64, val_size=4), prompts_per_round=2, group_size=2,
                                      mini_batches_per_round=2)
    fit(data, 6, logger=logger, log_every_n_steps=1, callbacks=[seen])
    logged = {step: set(metrics) for step, metrics in logger.steps.items()}
    assert sorted(logged) == list(range(6))  # 3 rounds of 2 steps
    assert all("rollout/reward_mean" in names and "rollout/frac_truncated" in names for names in logged.values())
    # the tiny adder ends most of its completions: the first and third rounds have finished ones
    assert [step for step, names in sorted(logged.items()) if "rollout/reward_finished" in names] == [0, 1, 4, 5]
    assert ["rollout/reward_finished" in names for names in seen.names] == [True, True, False, False, True, True]
    # a round's values at both of its steps
    assert logger.steps[0]["rollout/reward_mean"] == logger.steps[1]["rollout/reward_mean"]
    assert logger.steps[4]["rollout/reward_finished"] == logger.steps[5]["rollout/reward_finished"]


def test_a_checkpoint_written_before_correctness_was_recorded_resumes(tmp_path):
    def make():
        return RolloutDataModule(AdditionTask(num_digits=3, train_size=64, val_size=4), prompts_per_round=2, group_size=2,
                                 mini_batches_per_round=2, seed=5)

    fit(make(), 1, enable_checkpointing=True, callbacks=[ModelCheckpoint(dirpath=tmp_path, every_n_train_steps=1)])
    path = tmp_path / "epoch=0-step=1.ckpt"
    checkpoint = torch.load(path, weights_only=False)
    (state,) = checkpoint["RolloutDataModule"]["processes"]
    assert len(state["pending"]) == 1 and state["pending"][0]["correct"] is not None
    for pending in state["pending"]:
        del pending["correct"]  # as the rollout state was written before
    torch.save(checkpoint, path)

    first, data = FirstBatch(), make()
    module = RLModule("embedded:tiny-adder", max_new_tokens=40, optimizer=partial(torch.optim.AdamW, lr=1e-4))
    trainer = L.Trainer(max_steps=3, accelerator="cpu", devices=1, logger=False, enable_checkpointing=False,
                        enable_progress_bar=False, enable_model_summary=False, limit_val_batches=0, callbacks=[first])
    trainer.fit(module, datamodule=data, ckpt_path=str(path))
    assert trainer.global_step == 3 and data.rounds_done == 2
    assert first.batch.correct is None  # the round's second step, from the checkpoint
    assert RolloutBatch.from_state(first.batch.to_state()).correct is None


def test_validation_accuracy_counts_correct_completions_whatever_the_reward():
    class Always(AdditionTask):
        def correct(self, record, completion):
            return True

    def validate(task):
        module = RLModule("embedded:tiny-adder", max_new_tokens=40, val_samples=2)
        trainer = L.Trainer(accelerator="cpu", devices=1, logger=False, enable_progress_bar=False, enable_model_summary=False)
        trainer.validate(module, datamodule=RolloutDataModule(task, val_batch_size=4), verbose=False)
        return float(trainer.callback_metrics["val/accuracy"]), float(trainer.callback_metrics["val/greedy_accuracy"])

    assert validate(Always(num_digits=3, train_size=64, val_size=2, reward_fn=quarter)) == (1.0, 1.0)
    assert validate(Undecided(num_digits=3, train_size=64, val_size=2, reward_fn=quarter)) == (0.25, 0.25)


class TellsNothing(Task):
    """A task written without ``correct``."""

    def train_records(self):
        return [{"prompt": "1+1="}]

    def val_records(self):
        return self.train_records()

    def reward(self, record, completion):
        return float(completion == "2")

    def solutions(self, record):
        return ["2"]


def test_a_task_that_does_not_define_correct_cannot_tell():
    assert TellsNothing().correct({"prompt": "1+1="}, "2") is None
    assert accuracy_terms(TellsNothing(), [{"prompt": "1+1="}] * 2, ["2", "3"]).tolist() == [1.0, 0.0]
