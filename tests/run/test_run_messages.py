"""What a run says when it stops, refuses to start, or cannot learn: one-line messages, exit codes, warnings, TensorBoard."""

import errno
import json
import os
import re
import subprocess
import sys
from functools import partial
from pathlib import Path

import lightning as L
import pytest
import torch
import yaml
from lightning.pytorch import Trainer
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
from test_reliability import quick_args
from test_run_safety import console, saved_step
from transformers import AutoTokenizer

from lit_cancel import GRPO, AdditionTask, RLModule, RolloutDataModule
from lit_cancel.rounds.statistics import WARN_EVERY_N_ROUNDS
from lit_cancel.run import commands

CONFIGS = Path(__file__).parents[2] / "configs"
STOPPED_AT = "lit-cancel: the run stopped at step {} (LIT_CANCEL_DEBUG=1 shows the traceback)"
NOTHING_RUN = "lit-cancel: nothing was run (LIT_CANCEL_DEBUG=1 shows the traceback)"


class FailsInRound2(AdditionTask):
    """Addition whose reward raises from its 10th call: the start-up check and round 1 (2 x 4 rollouts) pass."""

    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        self.calls = 0

    def reward(self, record, completion):
        self.calls += 1
        if self.calls >= 10:
            raise KeyError("score")
        return super().reward(record, completion)


class NaNLossFromStep1(GRPO):
    def __init__(self):
        super().__init__()
        self.calls = 0

    def __call__(self, logprobs, batch):
        out = super().__call__(logprobs, batch)
        self.calls += 1
        if self.calls > 1:
            out.loss = out.loss * float("nan")
        return out


class DiskFullAtStep2(L.Callback):
    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
        if trainer.global_step == 2:
            raise OSError(errno.ENOSPC, "No space left on device", "runs/scratch")


def test_a_reward_error_during_the_run_prints_the_step_the_cause_and_the_last_checkpoint_last(tmp_path):
    environment = {k: v for k, v in os.environ.items() if k != commands.DEBUG_VARIABLE}
    environment["PYTHONPATH"] = str(Path(__file__).parent)
    result = subprocess.run(
        [sys.executable, "-m", "lit_cancel", *quick_args(tmp_path, 4, "--data.init_args.task.class_path=test_run_messages.FailsInRound2")],
        capture_output=True, text=True, env=environment,
    )
    assert result.returncode == 1, result.stderr[-2000:]
    assert "Traceback" not in result.stderr
    last_ckpt = tmp_path / "quickstart" / "version_0" / "checkpoints" / "last.ckpt"
    lines = result.stderr.strip().splitlines()
    assert lines[-3] == STOPPED_AT.format(1)
    assert lines[-2].startswith("error: FailsInRound2.reward raised KeyError: 'score' on prompt '")
    assert lines[-1] == f"the last good step is in {last_ckpt}"
    assert saved_step(str(last_ckpt)) == 1


@pytest.mark.parametrize(
    ("extra", "step", "error"),
    [
        (["--model.init_args.objective=test_run_messages.NaNLossFromStep1", "--model.init_args.max_skipped_steps=1"], 1,
         "error: the loss was not finite in 1 optimizer steps in a row (the last at step 1); the weights are those of the last "
         "finite step. Lower the learning rate (now 0.0002, model.init_args.optimizer.init_args.lr)"),
        (["--trainer.callbacks+=test_run_messages.DiskFullAtStep2"], 2, "error: [Errno 28] No space left on device: 'runs/scratch'"),
    ],
    ids=["non-finite", "io-error"],
)
def test_a_run_that_stops_says_so_in_three_lines_with_exit_status_1(tmp_path, monkeypatch, capsys, extra, step, error):
    status, lines = console(monkeypatch, capsys, *quick_args(tmp_path, 4, *extra))
    last_ckpt = tmp_path / "quickstart" / "version_0" / "checkpoints" / "last.ckpt"
    assert status == 1
    assert lines[-3:] == [STOPPED_AT.format(step), error, f"the last good step is in {last_ckpt}"]
    assert saved_step(str(last_ckpt)) == step


def test_the_debug_variable_raises_the_run_error_with_its_cause(tmp_path, monkeypatch):
    monkeypatch.setattr(sys, "argv", ["lit-cancel", *quick_args(tmp_path, 4, "--trainer.callbacks+=test_run_messages.DiskFullAtStep2")])
    monkeypatch.setenv(commands.DEBUG_VARIABLE, "1")
    with pytest.raises(commands.RunError) as stopped:
        commands.main()
    assert isinstance(stopped.value.__cause__, OSError) and stopped.value.step == 2


class OneArgumentReward(AdditionTask):
    def reward(self, completion):
        return 1.0


@pytest.fixture
def validations(monkeypatch) -> list:
    """The calls of Trainer.validate and Trainer.fit: none means the command refused before training or validating."""
    calls = []
    monkeypatch.setattr(Trainer, "validate", lambda *args, **kwargs: calls.append("validate"))
    monkeypatch.setattr(Trainer, "fit", lambda *args, **kwargs: calls.append("fit"))
    return calls


def test_a_reward_with_the_wrong_signature_fails_before_any_step(tmp_path, monkeypatch, capsys, validations):
    status, lines = console(monkeypatch, capsys, *quick_args(tmp_path, 2, "--data.init_args.task.class_path=test_run_messages.OneArgumentReward"))
    assert (status, validations) == (2, [])
    assert lines[-2] == NOTHING_RUN
    assert re.fullmatch(
        r"error: OneArgumentReward.reward raised TypeError: OneArgumentReward.reward\(\) takes 2 positional arguments but 3 were "
        r"given on prompt '\d{3}\+\d{3}=' and completion '' \(checked at start-up: a task's reward is called as "
        r"reward\(record, completion\) and returns a number\)", lines[-1],
    )


@pytest.mark.parametrize(
    ("option", "shown"),
    [(["--model.init_args.optimizer.init_args.lr", "-1e-4"], "-0.0001"), (["--model.init_args.optimizer.init_args.lr=0"], "0")],
    ids=["negative-space-separated", "zero"],
)
def test_a_learning_rate_at_or_below_zero_is_refused_at_start_up(tmp_path, monkeypatch, capsys, validations, option, shown):
    status, lines = console(monkeypatch, capsys, *quick_args(tmp_path, 2, *option))
    assert (status, validations) == (2, [])
    assert lines[-1] == f"error: model.init_args.optimizer.init_args.lr must be > 0, got {shown}"


def test_a_fused_optimizer_under_a_float16_scaler_with_clipping_is_refused_at_start_up(tmp_path, monkeypatch, capsys, validations):
    """A float16 gradient scaler (a GPU's 16-mixed; here Lightning's plugin made on a CPU) leaves the unscaling to a fused
    optimizer, after clipping; under bf16-mixed the module clips (tests/run/test_precision.py)."""
    fused = "--model.init_args.optimizer.init_args.fused=true"
    scaled = ["--trainer.plugins=lightning.pytorch.plugins.precision.MixedPrecision", "--trainer.plugins.precision=16-mixed",
              "--trainer.plugins.device=cpu"]
    status, lines = console(monkeypatch, capsys, *quick_args(tmp_path, 2, fused, *scaled))
    assert (status, validations) == (2, [])
    assert lines[-1] == (
        "error: model.init_args.optimizer.init_args.fused: true does not work with trainer.precision 16-mixed and "
        "trainer.gradient_clip_val 1: a fused optimizer unscales the float16 gradient scaler's gradients itself, after they "
        "would be clipped; set fused false, precision bf16-mixed or gradient_clip_val null"
    )
    monkeypatch.setattr(sys, "argv", ["lit-cancel", *quick_args(tmp_path / "bf16", 2, fused, "--trainer.precision=bf16-mixed")])
    commands.main()
    assert "fit" in validations


def test_a_mistyped_objective_is_one_line_naming_the_presets(tmp_path, monkeypatch, capsys):
    status, lines = console(monkeypatch, capsys, *quick_args(tmp_path, 2, "--model.init_args.objective=lit_cancel.GRPOO"))
    assert status == 2
    assert lines == [NOTHING_RUN, (
        "error: model.init_args.objective (lit_cancel.GRPOO): module 'lit_cancel' has no attribute 'GRPOO'; the presets: "
        "lit_cancel.GRPO, lit_cancel.DrGRPO, lit_cancel.DAPO, lit_cancel.GSPO, lit_cancel.DFPOMin, lit_cancel.DFPOOrth, lit_cancel.DFPOMinTR, lit_cancel.RLOO"
    )]


def test_a_yaml_syntax_error_names_the_config_file_and_line(tmp_path, monkeypatch, capsys):
    config = tmp_path / "broken.yaml"
    config.write_text("trainer:\n  max_steps: 3\n   bad: [1\n")
    status, lines = console(monkeypatch, capsys, "fit", "--config", str(config))
    assert status == 2
    assert lines[-1] == f"error: {config} line 3 column 7: mapping values are not allowed here"


def gsm8k_args(model_path: str, train_file: Path, *extra: str) -> list[str]:
    return [
        "fit", "--config", str(CONFIGS / "gsm8k-local.yaml"), f"--model.init_args.model_path={model_path}",
        f"--data.init_args.task.init_args.train_file={train_file}", "--data.init_args.task.init_args.val_size=1",
        "--data.init_args.prompts_per_round=2", *extra,
    ]


def gsm8k_rows(count: int) -> list[str]:
    return [json.dumps({"question": f"Tom has {i} apples. How many?", "answer": f"#### {i}"}) for i in range(count)]


def test_a_byte_that_is_not_utf8_is_named_with_its_file_line_and_column(tmp_path, monkeypatch, capsys, tiny_model_path):
    data = tmp_path / "data.jsonl"
    rows = gsm8k_rows(4)
    data.write_bytes(f"{rows[0]}\n{rows[1]}\n".encode() + b'{"question": "caf\xe9?", "answer": "#### 1"}\n' + f"{rows[3]}\n".encode())
    status, lines = console(monkeypatch, capsys, *gsm8k_args(tiny_model_path, data))
    assert status == 2
    assert lines[-1] == f"error: MathWordTask: data file '{data}' line 3 is not UTF-8 (byte 0xe9 at column 18); save the file as UTF-8"


def test_a_prompt_longer_than_the_context_is_refused_at_start_up_naming_its_line(tmp_path, monkeypatch, capsys, tiny_model_path, validations):
    data = tmp_path / "data.jsonl"
    rows = gsm8k_rows(4)
    long_question = "Tom has many apples. " * 40
    rows[2] = json.dumps({"question": long_question, "answer": "#### 1"})
    data.write_text(rows[0] + "\n\n" + "\n".join(rows[1:]) + "\n")  # the long row is on line 4
    length = len(AutoTokenizer.from_pretrained(tiny_model_path)(f"Question: {long_question}\nAnswer:")["input_ids"])
    status, lines = console(monkeypatch, capsys, *gsm8k_args(tiny_model_path, data, "--model.init_args.max_new_tokens=64"))
    assert (status, validations) == (2, [])
    assert lines[-1] == (
        f"error: the longest train prompt ('{data}' line 4, {length} tokens) does not fit the model's context: "
        "max_position_embeddings=512 minus max_new_tokens=64 leaves 448; shorten or drop the long prompts, "
        "or lower model.init_args.max_new_tokens"
    )


class ZeroReward(AdditionTask):
    def reward(self, record, completion):
        return 0.0


def cannot_learn_warnings(record) -> list[str]:
    return [str(w.message) for w in record if str(w.message).startswith("round ")]


def make_trainer(max_steps: int, callbacks=(), **kwargs) -> L.Trainer:
    return L.Trainer(
        max_steps=max_steps, accelerator="cpu", devices=1, logger=False, enable_checkpointing=False, enable_progress_bar=False,
        enable_model_summary=False, limit_val_batches=0, callbacks=list(callbacks), **kwargs,
    )


def test_a_run_that_cannot_learn_warns_at_its_first_round_and_every_n_rounds_while_it_lasts():
    task = ZeroReward(num_digits=3, train_size=64, val_size=4)
    module = RLModule("embedded:tiny-adder", max_new_tokens=2)
    with pytest.warns(UserWarning) as record:
        make_trainer(WARN_EVERY_N_ROUNDS + 2).fit(module, datamodule=RolloutDataModule(task, prompts_per_round=2, group_size=2))
    lasting = f"(warned every {WARN_EVERY_N_ROUNDS} rounds while it lasts)"
    expected = []
    for round_number in (1, WARN_EVERY_N_ROUNDS + 1):
        expected += [
            f"round {round_number}: every completion reached max_new_tokens=2 without an end-of-sequence token, so every reward "
            f"scores a cut-off answer; raise model.init_args.max_new_tokens {lasting}",
            f"round {round_number}: every group's rewards are equal (mean reward 0), so every advantage is 0 and the policy gets "
            f"no learning signal; check the task's reward on the rollouts {lasting}",
        ]
    assert cannot_learn_warnings(record) == expected


class ScaleWeightsAfterStep0(L.Callback):
    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        if trainer.global_step == 1:
            with torch.no_grad():
                for parameter in pl_module.parameters():
                    parameter.mul_(20)


def test_an_exploding_weight_norm_is_warned():
    module = RLModule("embedded:tiny-adder", max_new_tokens=40, optimizer=partial(torch.optim.SGD, lr=0.0))
    start = float(torch.nn.utils.get_total_norm([p.detach() for p in module.parameters()]))
    with pytest.warns(UserWarning) as record:
        make_trainer(2, [ScaleWeightsAfterStep0()]).fit(
            module, datamodule=RolloutDataModule(AdditionTask(num_digits=3, train_size=64, val_size=4), prompts_per_round=2, group_size=4)
        )
    exploding = [m for m in cannot_learn_warnings(record) if "weight norm" in m]
    assert exploding == [
        f"round 2: the weight norm is {20 * start:.4g}, more than 10 times its {start:.4g} at the first round (exploding); "
        f"lower the learning rate or the weight decay (warned every {WARN_EVERY_N_ROUNDS} rounds while it lasts)"
    ]


class GradientNorms(L.Callback):
    """The norm of the gradients as the optimizer step begins (before clipping), and the value logged for that step."""

    def __init__(self):
        self.computed, self.logged = [], []

    def on_before_optimizer_step(self, trainer, pl_module, optimizer):
        self.computed.append(float(torch.nn.utils.get_total_norm([p.grad for p in pl_module.parameters() if p.grad is not None])))

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        self.logged.append(float(trainer.callback_metrics["health/grad_norm"]))


def test_the_gradient_norm_is_logged_before_clipping():
    norms = GradientNorms()
    module = RLModule("embedded:tiny-adder", max_new_tokens=40)
    # 8 groups, so that a step whose every group has equal rewards (a zero gradient) is unlikely whatever the random stream
    make_trainer(2, [norms], gradient_clip_val=1e-6).fit(
        module, datamodule=RolloutDataModule(AdditionTask(num_digits=3, train_size=64, val_size=4), prompts_per_round=8, group_size=4)
    )
    assert len(norms.logged) == 2 and norms.logged == pytest.approx(norms.computed, rel=1e-6)
    assert min(norms.logged) > 1e-3  # far above the clipped norm


def scalars(log_dir) -> dict[str, list[tuple[int, float]]]:
    events = EventAccumulator(str(log_dir))
    events.Reload()
    return {tag: [(e.step, e.value) for e in events.Scalars(tag)] for tag in events.Tags()["scalars"]}


def test_the_quickstart_logs_the_learning_rate_and_the_gradient_norm_every_step(tmp_path):
    run = commands.run_cli(quick_args(tmp_path, 2))
    logged = scalars(run.trainer.logger.log_dir)
    assert logged["lr-AdamW"] == [(0, pytest.approx(2e-4)), (1, pytest.approx(2e-4))]
    assert [step for step, _ in logged["health/grad_norm"]] == [0, 1]


def test_validation_is_logged_at_the_step_the_bar_shows(tmp_path):
    run = commands.run_cli(quick_args(tmp_path, 3, "--trainer.limit_val_batches=1", "--trainer.val_check_interval=2"))
    logged = scalars(run.trainer.logger.log_dir)
    assert [step for step, _ in logged["val/accuracy"]] == [step for step, _ in logged["val/greedy_accuracy"]] == [0, 2]


@pytest.mark.parametrize("config", sorted(p.name for p in CONFIGS.glob("*.yaml")))
def test_every_rl_config_monitors_the_learning_rate_every_step(config):
    settings = yaml.safe_load((CONFIGS / config).read_text())
    if settings["model"]["class_path"] != "lit_cancel.RLModule":
        pytest.skip("not an RL config")
    monitors = [c for c in settings["trainer"]["callbacks"] if c["class_path"] == "lightning.pytorch.callbacks.LearningRateMonitor"]
    assert [m["init_args"]["logging_interval"] for m in monitors] == ["step"]
