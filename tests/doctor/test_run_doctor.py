"""RunDoctor in a foreign Lightning module: it reads what the module logs and what other callbacks log straight to
the loggers, measures the update ratio, warns once per finding, writes the findings to TensorBoard, can stop a run,
and keeps what it read in the checkpoint."""

import math
import statistics
import warnings

import lightning as L
import pytest
import torch
from lightning.pytorch.loggers import TensorBoardLogger
from lit_cancel.callbacks import RunDoctor
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
from torch import nn


class Regression(L.LightningModule):
    """A linear regression that also logs a share of truncated completions, ``truncated`` at every step."""

    def __init__(self, truncated: float = 0.0, lr: float = 0.05):
        super().__init__()
        self.layer = nn.Linear(4, 1)
        self.truncated, self.lr, self.max_new_tokens = truncated, lr, 16

    def training_step(self, batch, batch_idx):
        x, y = batch
        loss = nn.functional.mse_loss(self.layer(x), y)
        self.log("rollout/frac_truncated", self.truncated)
        return loss

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=self.lr)

    def train_dataloader(self):
        generator = torch.Generator().manual_seed(0)
        x = torch.randn(64, 4, generator=generator)
        return torch.utils.data.DataLoader(list(zip(x, x.sum(1, keepdim=True))), batch_size=8)


class ReportsEntropy(L.Callback):
    """Logs ``health/entropy`` straight to the loggers, as lit_cancel's monitors do: 1.0, then 0.01 from step 10."""

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        for logger in trainer.loggers:
            logger.log_metrics({"health/entropy": 1.0 if trainer.global_step < 10 else 0.01}, step=trainer.global_step)


def fit(tmp_path, module, doctor, steps=30, callbacks=()):
    trainer = L.Trainer(
        max_steps=steps, accelerator="cpu", logger=TensorBoardLogger(tmp_path, name="run"), callbacks=[doctor, *callbacks],
        enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False, log_every_n_steps=1,
    )
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        trainer.fit(module)
    return trainer, [str(w.message) for w in caught if "RunDoctor" in str(w.message)]


def test_a_finding_is_warned_once_and_written_to_tensorboard(tmp_path):
    doctor = RunDoctor(every_n_steps=5)
    trainer, warned = fit(tmp_path, Regression(truncated=0.6), doctor)
    assert [f.rule for f in doctor.findings] == ["truncation"]
    assert len(warned) == 1 and warned[0].startswith("RunDoctor at step 10: [severe] Completions are cut off")
    assert "(now 16) to about 32" in warned[0]  # max_new_tokens, read from the module
    assert doctor.reported == {"truncation": 10}
    events = EventAccumulator(trainer.logger.log_dir)
    events.Reload()
    texts = [e.tensor_proto.string_val[0].decode() for e in events.Tensors("doctor/findings/text_summary")]
    # at step 5 the rules whose series are logged have 6 of the 10 points they judge from
    assert texts == [texts[0], texts[-1]] and texts[0] == "Too early to tell: no cause found yet, but truncation, learning_rate_too_low have too few points to judge."
    assert "Completions are cut off" in texts[-1]


def test_a_check_before_the_rules_have_their_points_is_too_early_not_healthy(tmp_path):
    trainer, warned = fit(tmp_path, Regression(truncated=0.0), RunDoctor(every_n_steps=5), steps=12)
    events = EventAccumulator(trainer.logger.log_dir)
    events.Reload()
    texts = [e.tensor_proto.string_val[0].decode() for e in events.Tensors("doctor/findings/text_summary")]
    assert texts == [  # 6 points of each series at step 5, 11 at step 10
        "Too early to tell: no cause found yet, but truncation, learning_rate_too_low have too few points to judge.",
        "No finding: nothing the rules know of is holding the run back.",
    ]
    assert warned == []


def test_the_update_ratio_is_the_parameters_relative_change_per_step(tmp_path):
    doctor = RunDoctor(every_n_steps=5, update_sample=10**6)  # every parameter sampled
    module = Regression()
    before = [p.detach().clone() for p in module.parameters()]
    fit(tmp_path, module, doctor, steps=1)
    change = sum(float(((p.detach() - b) ** 2).sum()) for p, b in zip(module.parameters(), before))
    size = sum(float((b**2).sum()) for b in before)
    assert doctor.points["health/update_ratio"][1] == pytest.approx(math.sqrt(change / size), rel=1e-5)
    assert doctor.points["lr"][1] == 0.05


def test_a_learning_rate_too_low_is_raised_by_a_factor_sized_from_the_update_ratio(tmp_path):
    doctor = RunDoctor(every_n_steps=20)
    torch.manual_seed(0)
    fit(tmp_path, Regression(lr=1e-7), doctor, steps=20)
    (finding,) = doctor.findings
    ratio = statistics.median(list(doctor.points["health/update_ratio"].values())[10:])  # the last half
    factor = 1e-4 / ratio  # the policy moves in proportion to the learning rate: this many times more reaches 1e-4
    assert finding.rule == "learning_rate_too_low" and factor > 50  # 10x would leave it frozen
    shown = float(finding.remedy.split("raise the learning rate about ")[1].split("x")[0].replace(",", ""))
    assert 0.5 * factor < shown < 1.5 * factor  # to one figure


def test_a_policy_whose_updates_round_away_is_named(tmp_path):
    doctor = RunDoctor(every_n_steps=20)
    module = Regression(lr=1e-9)
    nn.init.constant_(module.layer.weight, 0.5)
    nn.init.constant_(module.layer.bias, 0.5)
    fit(tmp_path, module, doctor, steps=20)  # updates of about 1e-9, below half the last bit of 0.5 (3e-8)
    (finding,) = doctor.findings
    assert finding.rule == "learning_rate_too_low" and "did not change at all" in finding.cause
    assert "raise the learning rate (now 1e-09) at least 2,000x" in finding.remedy


def test_series_logged_straight_to_the_loggers_are_read(tmp_path):
    doctor = RunDoctor(every_n_steps=10, settings={"temperature": 0.5})
    fit(tmp_path, Regression(), doctor, steps=40, callbacks=[ReportsEntropy()])
    assert [f.rule for f in doctor.findings] == ["entropy_collapse"]
    assert "temperature 0.5" in doctor.findings[0].cause


def test_action_stop_ends_the_run_at_the_first_severe_finding(tmp_path):
    trainer, _ = fit(tmp_path, Regression(truncated=0.6), RunDoctor(every_n_steps=5, action="stop"), steps=100)
    assert trainer.global_step == 10
    trainer, _ = fit(tmp_path, Regression(truncated=0.3), RunDoctor(every_n_steps=5, action="stop"), steps=20)
    assert trainer.global_step == 20  # a warning does not stop it


def test_what_was_read_survives_a_checkpoint(tmp_path):
    doctor = RunDoctor(every_n_steps=5)
    fit(tmp_path, Regression(truncated=0.6), doctor, steps=12)
    restored = RunDoctor(every_n_steps=5)
    restored.load_state_dict(doctor.state_dict())
    assert restored.points == doctor.points and restored.reported == {"truncation": 10}


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"every_n_steps": 0}, "RunDoctor: every_n_steps must be >= 1, got 0"),
        ({"action": "halt"}, "RunDoctor: action must be 'warn' or 'stop', got 'halt'"),
        ({"rules": ["truncaton"]}, r"unknown diagnoses \['truncaton'\]"),
        ({"settings": {"temprature": 1.0}}, r"RunDoctor: unknown settings \['temprature'\]"),
    ],
)
def test_bad_arguments_fail_at_construction(kwargs, message):
    with pytest.raises(ValueError, match=message):
        RunDoctor(**kwargs)
