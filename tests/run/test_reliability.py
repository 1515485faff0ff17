"""A run never poisons its weights, never loses its last steps, and refuses inputs it cannot use."""

import math
import os
import signal
import subprocess
import sys
from functools import partial
from pathlib import Path

import lightning as L
import pytest
import torch

from lit_cancel import GRPO, AdditionTask, DFPOMin, RLModule, RolloutDataModule, Shuffled
from lit_cancel.batch import RolloutBatch
from lit_cancel.rounds.score import RewardError, score
from lit_cancel.run.cli import run_cli
from lit_cancel.run.errors import ConfigError

CONFIGS = Path(__file__).parents[2] / "configs"


def small_task(**kwargs):
    return AdditionTask(num_digits=3, train_size=64, val_size=8, seed=0, **kwargs)


def make_trainer(max_steps: int, callbacks=(), **kwargs):
    return L.Trainer(
        max_steps=max_steps, accelerator="cpu", devices=1, logger=False, enable_checkpointing=False,
        enable_progress_bar=False, enable_model_summary=False, limit_val_batches=0, callbacks=list(callbacks), **kwargs,
    )


class FixedReward(AdditionTask):
    """The addition task with a reward function that returns ``value`` for every completion."""

    def __init__(self, value):
        super().__init__(num_digits=3, train_size=64, val_size=8, seed=0)
        self.value = value

    def reward(self, record, completion):
        return self.value


@pytest.mark.parametrize("value", [float("nan"), float("inf"), "1.0", None])
def test_a_reward_that_is_not_a_finite_number_stops_the_run_before_any_step(value):
    module = RLModule("embedded:tiny-adder", max_new_tokens=40)
    before = {k: v.clone() for k, v in module.state_dict().items()}
    data = RolloutDataModule(FixedReward(value), prompts_per_round=2, group_size=2)
    with pytest.raises(RewardError) as raised:
        make_trainer(2).fit(module, datamodule=data)
    message = str(raised.value)
    assert "FixedReward.reward returned" in message and repr(value) in message and "on prompt '" in message
    assert "and completion '" in message
    for name, tensor in module.state_dict().items():
        assert torch.equal(tensor, before[name]), name


@pytest.mark.parametrize("value", [True, 1, 0.25])
def test_bools_ints_and_floats_are_rewards(value):
    task = FixedReward(value)
    assert score(task, task.train_records()[:2], ["x", "y"]).tolist() == [float(value)] * 2


class PoisonedGRPO(GRPO):
    """GRPO whose loss is NaN at the optimizer steps in ``poisoned``."""

    def __init__(self, poisoned: tuple[int, ...]):
        super().__init__()
        self.poisoned, self.step = set(poisoned), 0

    def __call__(self, logprobs, batch):
        out = super().__call__(logprobs, batch)
        if self.step in self.poisoned:
            out.loss = out.loss * float("nan")
        self.step += 1
        return out


class WeightsAroundSteps(L.Callback):
    """The trainable weights before and after every optimizer step."""

    def __init__(self):
        self.before, self.after = [], []

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
        self.before.append(torch.cat([p.detach().flatten().clone() for p in pl_module.parameters()]))

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        self.after.append(torch.cat([p.detach().flatten().clone() for p in pl_module.parameters()]))


def test_a_non_finite_loss_skips_the_step_and_leaves_the_weights_alone():
    module = RLModule("embedded:tiny-adder", max_new_tokens=40, objective=PoisonedGRPO(poisoned=(1,)),
                      optimizer=partial(torch.optim.AdamW, lr=1e-3))
    weights = WeightsAroundSteps()
    data = RolloutDataModule(small_task(), prompts_per_round=2, group_size=4)
    with pytest.warns(UserWarning, match="step 1: the loss is not finite; the optimizer step is skipped"):
        make_trainer(3, [weights], gradient_clip_val=1.0).fit(module, datamodule=data)
    assert torch.equal(weights.after[1], weights.before[1])  # the poisoned step changed nothing
    assert not torch.equal(weights.after[0], weights.before[0]) and not torch.equal(weights.after[2], weights.before[2])
    assert torch.isfinite(weights.after[2]).all()
    assert module.skipped_steps == 1 and module.skipped_in_a_row == 0
    assert module.trainer.global_step == 3


def test_a_learning_rate_that_diverges_stops_after_max_skipped_steps_with_advice():
    module = RLModule("embedded:tiny-adder", max_new_tokens=40, objective=PoisonedGRPO(poisoned=(1, 2, 3)),
                      max_skipped_steps=3)
    data = RolloutDataModule(small_task(), prompts_per_round=2, group_size=4)
    with pytest.warns(UserWarning, match="not finite"), pytest.raises(FloatingPointError, match="Lower the learning rate"):
        make_trainer(10).fit(module, datamodule=data)
    assert module.skipped_steps == 3 and module.trainer.global_step == 3  # the third skipped step raised


class InfiniteGradientGRPO(GRPO):
    """GRPO plus a term whose value is 0 but whose gradient is not finite (d sqrt(x) / dx at x = 0)."""

    def __call__(self, logprobs, batch):
        out = super().__call__(logprobs, batch)
        out.loss = out.loss + (logprobs.sum() * 0).abs().sqrt()
        return out


def test_a_finite_loss_with_a_non_finite_gradient_is_skipped_too():
    module = RLModule("embedded:tiny-adder", max_new_tokens=40, objective=InfiniteGradientGRPO(), max_skipped_steps=2)
    weights = WeightsAroundSteps()
    data = RolloutDataModule(small_task(), prompts_per_round=2, group_size=4)
    with pytest.warns(UserWarning, match="step 0: the gradient norm is not finite"), \
            pytest.raises(FloatingPointError, match="gradient norm was not finite in 2 optimizer steps in a row"):
        make_trainer(5, [weights]).fit(module, datamodule=data)
    assert len(weights.after) == 1 and torch.equal(weights.after[0], weights.before[0])


def test_an_objective_refuses_a_batch_without_the_step_counts():
    batch = RolloutBatch(
        input_ids=torch.ones(2, 5, dtype=torch.long), attention_mask=torch.ones(2, 5, dtype=torch.long),
        completion_mask=torch.ones(2, 3, dtype=torch.long), prompt_length=2, rewards=torch.tensor([1.0, 0.0]),
        advantages=torch.tensor([1.0, -1.0]), group_ids=torch.zeros(2, dtype=torch.long),
    )
    with pytest.raises(ValueError, match="set step_sequences=len.batch. and step_tokens="):
        GRPO()(torch.zeros(2, 3, requires_grad=True), batch)
    batch.step_sequences, batch.step_tokens = 2.0, 6.0
    assert torch.isfinite(GRPO()(torch.zeros(2, 3, requires_grad=True), batch).loss)


def test_a_group_transform_with_a_plan_that_splits_groups_is_refused_at_start_up():
    module = RLModule("embedded:tiny-adder", max_new_tokens=40, objective=DFPOMin())
    split = RolloutDataModule(small_task(), prompts_per_round=2, group_size=4, mini_batches_per_round=2, plan=Shuffled())
    with pytest.raises(ValueError, match="DFPOMin transforms the weights of each whole group, but the plan Shuffled"):
        make_trainer(1).fit(module, datamodule=split)
    # one step per round keeps each group whole even when shuffled
    whole = RolloutDataModule(small_task(), prompts_per_round=2, group_size=4, mini_batches_per_round=1, plan=Shuffled())
    make_trainer(1).fit(module, datamodule=whole)


def quick_args(save_dir, max_steps: int, *extra: str) -> list[str]:
    return [
        "fit", "--config", str(CONFIGS / "quickstart.yaml"),
        f"--trainer.max_steps={max_steps}", "--trainer.enable_progress_bar=false",
        f"--trainer.logger.init_args.save_dir={save_dir}",
        "--data.init_args.prompts_per_round=2", "--data.init_args.group_size=4",
        "--data.init_args.task.init_args.val_size=4", "--model.init_args.val_samples=1",
        "--trainer.limit_val_batches=0",
        *extra,
    ]


def last_checkpoint(save_dir, version: int = 0) -> dict:
    return torch.load(Path(save_dir) / "quickstart" / f"version_{version}" / "checkpoints" / "last.ckpt", weights_only=False)


def test_the_shipped_config_writes_last_ckpt_when_fit_ends_between_validations(tmp_path):
    run_cli(quick_args(tmp_path, 7, "--trainer.val_check_interval=5", "--trainer.limit_val_batches=1"))
    assert last_checkpoint(tmp_path)["global_step"] == 7


INTERRUPT_AT_STEP_3 = """
import os, signal
import lightning as L

class InterruptAtStep3(L.Callback):
    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
        if trainer.global_step == 3:
            os.kill(os.getpid(), signal.SIGINT)  # what Ctrl-C sends
"""


@pytest.mark.slow
def test_ctrl_c_writes_last_ckpt_and_resuming_gives_the_uninterrupted_parameters(tmp_path):
    (tmp_path / "interrupt.py").write_text(INTERRUPT_AT_STEP_3)
    environment = {**os.environ, "PYTHONPATH": str(tmp_path)}
    command = [sys.executable, "-m", "lit_cancel"]
    interrupted = subprocess.run(
        command + quick_args(tmp_path / "a", 5, "--trainer.callbacks+=interrupt.InterruptAtStep3"),
        env=environment, capture_output=True, text=True, cwd=tmp_path,
        # Ctrl-C raises KeyboardInterrupt in the child even where this process ignores SIGINT (a shell's background job)
        preexec_fn=partial(signal.signal, signal.SIGINT, signal.SIG_DFL),
    )
    checkpoint = tmp_path / "a" / "quickstart" / "version_0" / "checkpoints" / "last.ckpt"
    assert interrupted.returncode == 130, interrupted.stderr[-2000:]  # 128 + SIGINT, as a shell reports Ctrl-C
    assert interrupted.stderr.strip().splitlines()[-1] == f"lit-cancel: stopped by Ctrl-C (SIGINT) at step 3; resume with --ckpt_path {checkpoint}"
    stopped = last_checkpoint(tmp_path / "a")
    assert stopped["global_step"] == 3
    run_cli(quick_args(tmp_path / "a", 5, f"--ckpt_path={checkpoint}"))
    run_cli(quick_args(tmp_path / "b", 5))
    resumed, straight = last_checkpoint(tmp_path / "a"), last_checkpoint(tmp_path / "b")  # the run continues in version_0
    assert resumed["global_step"] == straight["global_step"] == 5
    stopped = stopped["state_dict"]
    for name, tensor in straight["state_dict"].items():
        assert torch.allclose(resumed["state_dict"][name], tensor, atol=1e-6), name
    assert any(not torch.equal(stopped[name], tensor) for name, tensor in straight["state_dict"].items())


def test_resuming_with_other_round_sizes_names_each_changed_option(tmp_path):
    run_cli(quick_args(tmp_path, 2))
    checkpoint = tmp_path / "quickstart" / "version_0" / "checkpoints" / "last.ckpt"
    changed = ["--data.init_args.group_size=2", "--model.init_args.objective=lit_cancel.DrGRPO", f"--ckpt_path={checkpoint}"]
    with pytest.raises(ConfigError) as raised:  # before training starts: lit-cancel prints it in one line
        run_cli(quick_args(tmp_path, 4, *changed))
    message = str(raised.value)
    assert "data.init_args.group_size 4 -> 2" in message
    assert "model.init_args.objective 'lit_cancel.GRPO' -> 'lit_cancel.DrGRPO'" in message
    assert "prompts_per_round" not in message and "--data.init_args.allow_resume_changes true" in message
    resumed = run_cli(quick_args(tmp_path, 4, *changed, "--data.init_args.allow_resume_changes=true"))
    assert resumed.trainer.global_step == 4


def test_under_bf16_mixed_rollout_log_probs_match_the_training_step_exactly():
    """Old and reference log-probs come from the same precision as the step's own: ratio 1 and KL 0 at the start."""
    seen = []

    class Recording(GRPO):
        def __call__(self, logprobs, batch):
            out = super().__call__(logprobs, batch)
            seen.append({name: float(value) for name, value in out.metrics.items()})
            return out

    module = RLModule("embedded:tiny-adder", max_new_tokens=40, objective=Recording(kl_coef=0.1),
                      optimizer=partial(torch.optim.AdamW, lr=1e-4))
    data = RolloutDataModule(small_task(), prompts_per_round=2, group_size=4, epochs_per_round=2)
    make_trainer(2, precision="bf16-mixed").fit(module, datamodule=data)
    first = seen[0]
    assert first["objective/ratio_mean"] == 1.0 and first["objective/approx_kl"] == 0.0
    assert first["loss/kl"] == 0.0
    assert not math.isclose(seen[1]["objective/approx_kl"], 0.0)  # the second epoch is off-policy
