from functools import partial

import lightning as L
import pytest
import torch
from lightning.pytorch.callbacks import ModelCheckpoint

from lit_cancel import AdditionTask, QueryPreserved, RewardBalanced, RLModule, RolloutDataModule, Shuffled


class RecordBatches(L.Callback):
    """Keeps what each micro-batch held: group ids, a fingerprint of its token ids, and its stats."""

    def __init__(self):
        self.seen = []

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
        self.seen.append((batch.group_ids.tolist(), int((batch.input_ids * torch.arange(batch.input_ids.shape[1])).sum()), dict(batch.stats)))


class AlwaysRight(AdditionTask):
    """Every completion gets reward 1: every group has equal rewards."""

    def reward(self, record, completion):
        return 1.0


def fit(data, steps, callbacks=(), **trainer_options):
    module = RLModule("embedded:tiny-adder", max_new_tokens=40, optimizer=partial(torch.optim.AdamW, lr=1e-4))
    trainer = L.Trainer(
        max_steps=steps, accelerator="cpu", devices=1, logger=False, enable_progress_bar=False, enable_model_summary=False,
        limit_val_batches=0, callbacks=list(callbacks), **{"enable_checkpointing": False, **trainer_options},
    )
    trainer.fit(module, datamodule=data)
    return trainer


def small_task(cls=AdditionTask):
    return cls(num_digits=3, train_size=64, val_size=4, seed=0)


@pytest.mark.parametrize(("plan", "split_groups"), [(QueryPreserved(), False), (Shuffled(), True)])
def test_groups_split_is_logged_per_plan(plan, split_groups):
    record = RecordBatches()
    data = RolloutDataModule(small_task(), prompts_per_round=4, group_size=4, mini_batches_per_round=2, plan=plan)
    fit(data, 2, [record])
    stats = record.seen[0][2]
    assert (stats["batch/groups_split"] > 0) == split_groups
    steps_of = {}
    for step, (groups, _, _) in enumerate(record.seen):
        for group in groups:
            steps_of.setdefault(group, set()).add(step)
    assert any(len(s) > 1 for s in steps_of.values()) == split_groups


def test_epochs_and_micro_batches_cover_the_round():
    record = RecordBatches()
    data = RolloutDataModule(small_task(), prompts_per_round=4, group_size=4, mini_batches_per_round=2, epochs_per_round=2)
    trainer = fit(data, 4, [record], accumulate_grad_batches=2)
    # a round: 2 epochs x 2 optimizer steps x 2 micro-batches of one whole group (4 rollouts) each
    assert trainer.global_step == 4 and data.rounds_done == 1 and len(record.seen) == 8
    first_round = [g for groups, _, _ in record.seen for g in groups]
    assert sorted(first_round) == sorted([g for g in range(4) for _ in range(4)] * 2)  # every rollout once per epoch
    assert all(len(groups) == 4 and len(set(groups)) == 1 for groups, _, _ in record.seen)


def test_dynamic_sampling_never_crashes_and_logs_what_it_dropped():
    record = RecordBatches()
    data = RolloutDataModule(small_task(AlwaysRight), prompts_per_round=4, group_size=4, dynamic_sampling=True, max_prompt_draws=3)
    trainer = fit(data, 2, [record])
    assert trainer.global_step == 2
    stats = record.seen[0][2]
    # three draws of 4 prompts, all with equal rewards: 12 dropped, then 4 refill the round
    assert stats["rollout/dropped_groups"] == 8 and stats["rollout/frac_zero_std_groups"] == 1.0
    assert data.producer.prompt_draws == 6


class HalfDecided(AdditionTask):
    """Prompts with an even first digit always get reward 1 (equal rewards); the rest are verified."""

    def reward(self, record, completion):
        return 1.0 if int(record["prompt"][0]) % 2 == 0 else super().reward(record, completion)


class RecordRewards(L.Callback):
    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
        self.rewards = batch.rewards.view(-1, 8)


def test_dynamic_sampling_trains_only_on_informative_groups_when_it_can():
    record, rewards = RecordBatches(), RecordRewards()
    data = RolloutDataModule(small_task(HalfDecided), prompts_per_round=4, group_size=8, dynamic_sampling=True, max_prompt_draws=8)
    fit(data, 1, [record, rewards])
    stats = record.seen[0][2]
    assert stats["rollout/frac_zero_std_groups"] > 0 and stats["rollout/dropped_groups"] > 0
    assert (rewards.rewards.std(dim=1) > 0).all()  # every trained group has mixed rewards


def test_reward_balanced_logs_its_share():
    record = RecordBatches()
    data = RolloutDataModule(small_task(), prompts_per_round=8, group_size=4, mini_batches_per_round=2, plan=RewardBalanced(0.5))
    fit(data, 2, [record])
    shares = [stats["batch/pos_share"] for _, _, stats in record.seen if "batch/pos_share" in stats]
    assert len(shares) == 2 and all(0 <= s <= 1 for s in shares)
    assert "batch/waiting_rollouts" in record.seen[0][2]


def test_resume_mid_round_replays_the_same_mini_batches(tmp_path):
    def make():
        return RolloutDataModule(small_task(), prompts_per_round=4, group_size=4, mini_batches_per_round=2,
                                 epochs_per_round=2, plan=RewardBalanced(0.5, max_wait_rounds=2), seed=7)

    straight = RecordBatches()
    fit(make(), 7, [straight])
    first, checkpoint = RecordBatches(), ModelCheckpoint(dirpath=tmp_path, every_n_train_steps=3, save_top_k=-1)
    fit(make(), 3, [first, checkpoint], enable_checkpointing=True)
    resumed, data = RecordBatches(), make()
    module = RLModule("embedded:tiny-adder", max_new_tokens=40, optimizer=partial(torch.optim.AdamW, lr=1e-4))
    trainer = L.Trainer(max_steps=7, accelerator="cpu", devices=1, logger=False, enable_progress_bar=False,
                        enable_model_summary=False, limit_val_batches=0, enable_checkpointing=False, callbacks=[resumed])
    trainer.fit(module, datamodule=data, ckpt_path=str(tmp_path / "epoch=0-step=3.ckpt"))
    # step 3 ends inside the first round (4 steps): the rest of it comes from the checkpoint
    assert [s[:2] for s in first.seen + resumed.seen] == [s[:2] for s in straight.seen]
    assert data.rounds_done == 2
