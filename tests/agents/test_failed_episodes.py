"""Episodes whose environment fails, trained through on the embedded agent: each fault is counted by its cause, a failed
row is inert (no credit, advantage 0), its group's other members train with advantages that sum to zero, the failure
budget stops a run whose rounds keep failing, and a resumed run goes on exactly as one that was not stopped."""

import inspect
import re
import threading
from functools import partial
from pathlib import Path

import lightning as L
import pytest
import torch
import yaml
from lightning.pytorch.callbacks import ModelCheckpoint

from lit_cancel import GRPO, DFPOMin, RLModule, RolloutDataModule
from lit_cancel.agents import Environment, EnvironmentTask, ToolAdditionTask
from lit_cancel.agents.episodes import EpisodeLimits
from lit_cancel.rounds.failures import FAILURE_CAUSES, FailedEpisodes, FailureBudget


class Faulty(Environment):
    """The embedded agent's calculator environment, failing as ``fault`` says on the records of ``failing``: its reset, or
    its step where the policy calls the tool (so that the episodes of a group that answer at once run on)."""

    def __init__(self, inner: Environment, fault: str, failing: set[str]) -> None:
        self.inner, self.fault, self.failing = inner, fault, failing

    def reset(self, record):
        self.bad = record["prompt"] in self.failing
        if self.bad and self.fault == "reset raises":
            raise KeyError("secret")
        return self.inner.reset(record)

    def step(self, action):
        if self.bad and action.startswith("calculate"):
            if self.fault == "step raises":
                raise ConnectionError("sandbox lost")
            if self.fault == "step returns text":
                return "42"
            if self.fault == "step hangs":
                threading.Event().wait()
        return self.inner.step(action)


class FailingAddition(ToolAdditionTask):
    """The embedded agent's task whose environment fails as ``fault`` says on one training record in ``every``."""

    def __init__(self, fault: str, episode_timeout: float | None = None, every: int = 2) -> None:
        super().__init__(num_digits=5, train_size=64, val_size=8, episode_timeout=episode_timeout)
        self.fault, self.failing = fault, {record["prompt"] for record in self.train_records()[::every]}

    def environment(self) -> Environment:
        return Faulty(super().environment(), self.fault, self.failing)


class EveryOtherEpisodeFails(FailingAddition):
    """The embedded agent's task whose environment's reset raises in every other episode of one training record in two:
    a group of such a record has two failed members and two that ran."""

    def __init__(self) -> None:
        super().__init__("reset raises")
        self.made = 0

    def environment(self) -> Environment:
        self.made += 1
        return Faulty(ToolAdditionTask.environment(self), self.fault, self.failing if self.made % 2 else set())


class Capture(L.Callback):
    def __init__(self):
        self.batches, self.credits, self.metrics = [], [], []

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        self.batches.append(batch)
        self.credits.append(outputs["credits"].detach())
        self.metrics.append({name: float(value) for name, value in trainer.callback_metrics.items() if name.startswith("rollout/")})


def fit(task, objective, steps, callbacks=(), ckpt_path=None, **data_options):
    module = RLModule("embedded:tiny-agent", max_new_tokens=23, objective=objective, optimizer=partial(torch.optim.AdamW, lr=1e-3))
    data = RolloutDataModule(task, prompts_per_round=4, group_size=4, seed=1, **data_options)
    trainer = L.Trainer(max_steps=steps, accelerator="cpu", devices=1, logger=False, enable_progress_bar=False,
                        enable_model_summary=False, limit_val_batches=0, callbacks=list(callbacks),
                        enable_checkpointing=any(isinstance(c, ModelCheckpoint) for c in callbacks))
    trainer.fit(module, datamodule=data, ckpt_path=ckpt_path)
    return trainer, module, data


FAULTS = [("reset raises", "reset_raised", None), ("step raises", "step_raised", None),
          ("step returns text", "step_wrong_type", None), ("step hangs", "timeout", 0.3)]


@pytest.mark.parametrize(("fault", "cause", "timeout"), FAULTS, ids=[cause for _, cause, _ in FAULTS])
def test_a_run_trains_through_failed_episodes_counted_by_cause_with_the_group_rule(fault, cause, timeout):
    capture = Capture()
    trainer, _, _ = fit(FailingAddition(fault, timeout), GRPO(), steps=2, callbacks=[capture], max_failed_share=1.0)
    assert trainer.global_step == 2
    failed_rows, trained = 0, False
    for batch, credits, metrics in zip(capture.batches, capture.credits, capture.metrics, strict=True):
        failed = batch.failed
        failed_rows += int(failed.sum())
        # one optimizer step a round: the step's batch is the round, and its share of failed rows is what was counted
        assert metrics["rollout/failed_episodes"] == pytest.approx(failed.float().mean().item())
        assert metrics[f"rollout/failed_episodes/{cause}"] == pytest.approx(failed.float().mean().item())
        assert all(metrics[f"rollout/failed_episodes/{other}"] == 0 for other in FAILURE_CAUSES if other != cause)
        assert batch.failures == [cause if row else None for row in failed.tolist()]
        # a failed row is inert: no policy token, no credit, advantage 0
        assert (batch.completion_mask[failed] == 0).all() and (credits[failed] == 0).all() and (batch.advantages[failed] == 0).all()
        trained |= bool((credits[~failed] != 0).any())
        for group in batch.group_ids.unique():
            rows = batch.group_ids == group
            members = rows & ~failed
            assert batch.advantages[members].sum().abs() < 1e-5
            if members.sum() < 2:
                assert (batch.advantages[rows] == 0).all()
    assert failed_rows > 0 and trained


def test_a_group_with_failed_episodes_trains_its_other_members_with_advantages_over_them_alone():
    capture = Capture()
    fit(EveryOtherEpisodeFails(), GRPO(), steps=2, callbacks=[capture], max_failed_share=1.0)
    varied = 0
    for batch, credits in zip(capture.batches, capture.credits, strict=True):
        for group in batch.group_ids.unique():
            rows = batch.group_ids == group
            members = rows & ~batch.failed
            if members.sum() == rows.sum():
                continue
            assert members.sum() == 2  # every other episode of its record failed
            rewards = batch.rewards[members]
            # GRPO's advantages over the two members alone: (r - mean) / (std + 1e-4)
            expected = (rewards - rewards.mean()) / (rewards.std() + 1e-4)
            assert torch.allclose(batch.advantages[members], expected, atol=1e-5)
            if rewards[0] != rewards[1]:
                varied += 1
                assert (credits[members] != 0).any(1).all()
    assert varied, "a group with failed episodes needs members whose rewards differ"


def test_the_budget_stops_a_run_whose_rounds_keep_failing_and_its_bad_rounds_resume_with_the_checkpoint(tmp_path):
    every_round = {"max_failed_share": 0.1, "max_failed_rounds": 3}
    with pytest.raises(FailedEpisodes) as stopped:
        fit(FailingAddition("reset raises", every=1), GRPO(), steps=10, **every_round)
    message = str(stopped.value)
    assert message.startswith("3 rounds in a row had more than data.init_args.max_failed_share=0.1 of their episodes fail "
                              "(data.init_args.max_failed_rounds=3); in the last, ")
    assert "most often reset_raised (" in message and "Faulty.reset raised on train record " in message
    checkpoint = ModelCheckpoint(dirpath=tmp_path, every_n_train_steps=1, save_top_k=-1)
    fit(FailingAddition("reset raises", every=1), GRPO(), steps=1, callbacks=[checkpoint], **every_round)
    assert torch.load(tmp_path / "epoch=0-step=1.ckpt", weights_only=False)["RolloutDataModule"]["failed_rounds_in_a_row"] == 1
    # resumed after one bad round, it stops where the run that was not stopped did: at the third round, after step 2
    trainers = []

    class Keep(L.Callback):
        def on_fit_start(self, trainer, pl_module):
            trainers.append(trainer)

    with pytest.raises(FailedEpisodes):
        fit(FailingAddition("reset raises", every=1), GRPO(), steps=10, callbacks=[Keep()],
            ckpt_path=str(tmp_path / "epoch=0-step=1.ckpt"), **every_round)
    assert trainers[0].global_step == 2


@pytest.mark.slow
def test_a_run_resumed_after_failed_episodes_goes_on_as_the_run_that_was_not_stopped(tmp_path):
    options = {"max_failed_share": 1.0, "mini_batches_per_round": 2}
    straight = Capture()
    _, module, _ = fit(FailingAddition("step raises"), DFPOMin(), steps=5, callbacks=[straight], **options)
    checkpoint = ModelCheckpoint(dirpath=tmp_path, every_n_train_steps=3, save_top_k=-1)
    first = Capture()
    fit(FailingAddition("step raises"), DFPOMin(), steps=3, callbacks=[first, checkpoint], **options)
    resumed = Capture()
    _, resumed_module, _ = fit(FailingAddition("step raises"), DFPOMin(), steps=5, callbacks=[resumed],
                                  ckpt_path=str(tmp_path / "epoch=0-step=3.ckpt"), **options)
    steps = first.batches + resumed.batches
    assert [b.failure.tolist() for b in steps] == [b.failure.tolist() for b in straight.batches]
    assert any(b.failed.any() for b in straight.batches)
    assert [b.input_ids.tolist() for b in steps] == [b.input_ids.tolist() for b in straight.batches]
    assert [b.stats["rollout/failed_episodes"] for b in steps] == [b.stats["rollout/failed_episodes"] for b in straight.batches]
    for (name, tensor), resumed_tensor in zip(module.state_dict().items(), resumed_module.state_dict().values(), strict=True):
        assert torch.allclose(tensor, resumed_tensor, atol=1e-6), name


def test_the_failure_budget_in_docs_agents_md_names_real_options():
    text = (Path(__file__).parents[2] / "docs" / "agents.md").read_text()
    (block,) = [b for b in re.findall(r"```yaml\n(.*?)```", text, re.S) if "max_failed_share" in b]
    data = yaml.safe_load(block)["data"]
    assert data["class_path"] == "lit_cancel.RolloutDataModule"
    budget = {key: value for key, value in data["init_args"].items() if key != "task"}
    assert set(budget) == {"max_failed_share", "max_failed_rounds"}
    assert set(budget) <= set(inspect.signature(RolloutDataModule).parameters)
    FailureBudget(**budget)
    task = data["init_args"]["task"]
    assert task["class_path"] == "lit_cancel.agents.EnvironmentTask"
    assert set(task["init_args"]) <= set(inspect.signature(EnvironmentTask).parameters)
    assert EpisodeLimits(episode_timeout=task["init_args"]["episode_timeout"]).episode_timeout == 60.0
