"""Training on episodes through ``Trainer.fit``: the environment's tokens stay in the context and get no credit, the
round logs the episodes' statistics, validation scores episodes, and an engine that samples ahead is refused."""

from functools import partial

import lightning as L
import pytest
import torch

from lit_cancel import GRPO, DFPOMin, RLModule, RolloutDataModule
from lit_cancel.agents import ToolAdditionTask
from lit_cancel.engines import DecodeLoop


def long_addition():
    return ToolAdditionTask(num_digits=5, train_size=64, val_size=8)


class Capture(L.Callback):
    def __init__(self):
        self.batches, self.outputs = [], []

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        self.batches.append(batch)
        self.outputs.append({k: v.detach() for k, v in outputs.items()})


def fit(objective, steps=2, **trainer_options):
    torch.manual_seed(0)
    module = RLModule("embedded:tiny-agent", max_new_tokens=23, val_samples=2, objective=objective,
                      optimizer=partial(torch.optim.AdamW, lr=1e-3))
    data = RolloutDataModule(long_addition(), prompts_per_round=4, group_size=4, mini_batches_per_round=2, val_batch_size=8, seed=1)
    capture = Capture()
    trainer = L.Trainer(max_steps=steps, accelerator="cpu", devices=1, logger=False, enable_checkpointing=False,
                        enable_progress_bar=False, enable_model_summary=False, callbacks=[capture], **trainer_options)
    trainer.fit(module, datamodule=data)
    return trainer, capture


@pytest.mark.parametrize("objective", [GRPO(), DFPOMin()], ids=["GRPO", "DFPOMin"])
def test_environment_tokens_are_attended_but_get_no_credit(objective):
    trainer, capture = fit(objective, limit_val_batches=0)
    for batch, outputs in zip(capture.batches, capture.outputs):
        completion = batch.attention_mask[:, batch.prompt_length:].bool()
        environment = completion & ~batch.completion_mask.bool()
        assert environment.any(), "the episodes need observations between turns"
        assert (outputs["credits"][environment] == 0).all()
        assert (outputs["credits"][batch.completion_mask.bool()] != 0).any()
    metrics = trainer.callback_metrics
    assert metrics["rollout/turns"] > 1 and 0 < metrics["rollout/env_token_share"] < 1


def test_steps_on_a_round_of_episodes_raise_the_policy_tokens_of_rewarded_episodes_over_unrewarded_ones():
    torch.manual_seed(0)
    module = RLModule("embedded:tiny-agent", max_new_tokens=23, optimizer=partial(torch.optim.AdamW, lr=3e-4))
    # three optimizer steps on the first round's episodes
    data = RolloutDataModule(long_addition(), prompts_per_round=8, group_size=8, epochs_per_round=3, seed=3)
    capture, before = Capture(), {}

    def policy_logprob(batch):
        logprobs = module.token_logprobs(batch.input_ids, batch.attention_mask, batch.prompt_length)
        return (logprobs * batch.completion_mask).sum(1)

    class Before(L.Callback):
        def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
            before.setdefault("logprob", policy_logprob(batch))

    trainer = L.Trainer(max_steps=3, accelerator="cpu", devices=1, logger=False, enable_checkpointing=False,
                        enable_progress_bar=False, enable_model_summary=False, limit_val_batches=0,
                        callbacks=[capture, Before()])
    trainer.fit(module, datamodule=data)
    batch = capture.batches[0]
    rewarded, unrewarded = batch.rewards > 0, batch.rewards == 0
    assert rewarded.any() and unrewarded.any(), "the round needs both right and wrong answers"
    change = policy_logprob(batch) - before["logprob"]
    assert change[rewarded].mean() > change[unrewarded].mean() + 0.1


def test_validation_scores_whole_episodes_with_the_environment_s_reward():
    trainer, _ = fit(GRPO(), steps=1, limit_val_batches=1, val_check_interval=1, num_sanity_val_steps=0)
    # the shipped agent answers some of the 8 held-out problems right and others wrong
    assert 0 < trainer.callback_metrics["val/accuracy"] < 1


def test_an_engine_that_samples_ahead_is_refused_for_an_agent_task():
    class Ahead(DecodeLoop):
        max_staleness = 1

    module = RLModule("embedded:tiny-agent", max_new_tokens=23, engine=Ahead())
    data = RolloutDataModule(long_addition(), prompts_per_round=4, group_size=4)
    trainer = L.Trainer(max_steps=1, accelerator="cpu", devices=1, logger=False, enable_checkpointing=False,
                        enable_progress_bar=False, enable_model_summary=False)
    with pytest.raises(ValueError, match="ToolAdditionTask runs episodes turn by turn.*max_staleness=1"):
        trainer.fit(module, datamodule=data)


def test_drift_probes_are_refused_for_an_agent_task_whose_solutions_hold_replies():
    with pytest.raises(ValueError, match="SolutionProbabilityDriftMonitor scores each solution as one completion"):
        RolloutDataModule(long_addition()).drift_probes(4)
