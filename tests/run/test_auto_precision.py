"""``trainer.precision: auto``: the choice follows the measured speed on a CPU, for the configured model's shape; the CPU flags."""

import logging
import re
from pathlib import Path

import pytest
from transformers import AutoConfig

from lit_cancel.hub import resolve_model_path
from lit_cancel.run import precision
from lit_cancel.run.cli import run_cli

CONFIGS = Path(__file__).resolve().parents[2] / "configs"


@pytest.mark.parametrize("speedup, chosen", [(2.0, "bf16-mixed"), (1.05, "32-true"), (0.6, "32-true")])
def test_auto_on_a_cpu_follows_the_speedup_measured_at_the_models_shape(monkeypatch, speedup, chosen):
    measured = []
    monkeypatch.setattr(precision, "cpu_bf16_speedup", lambda config: measured.append(config.to_dict()) or speedup)
    choice = precision.auto_precision("embedded:tiny-adder", "cpu")
    config = AutoConfig.from_pretrained(resolve_model_path("embedded:tiny-adder"))
    assert measured == [config.to_dict()]
    assert choice.precision == chosen
    assert f"{speedup:.2f}x" in choice.reason and f"({config.hidden_size} wide, {config.vocab_size} tokens)" in choice.reason


def test_the_command_line_replaces_auto_by_the_measured_choice_and_says_so(tmp_path, caplog):
    args = ["validate", "--config", str(CONFIGS / "quickstart.yaml"), "--trainer.precision=auto", "--trainer.enable_progress_bar=false",
            f"--trainer.logger.init_args.save_dir={tmp_path}", "--data.init_args.task.init_args.val_size=2", "--model.init_args.val_samples=1"]
    with caplog.at_level(logging.INFO):
        cli = run_cli(args)
    (said,) = [record.getMessage() for record in caplog.records if record.getMessage().startswith("trainer.precision auto:")]
    speedup = float(re.search(r"autocast at ([0-9.]+)x float32's speed", said)[1])
    expected = "bf16-mixed" if speedup >= precision.MIN_CPU_SPEEDUP else "32-true"
    assert said.startswith(f"trainer.precision auto: {expected} (")
    assert cli.trainer.precision == expected and cli.config.validate.trainer.precision == expected


def test_a_trainer_built_in_python_asks_for_the_choice_itself():
    with pytest.raises(ValueError, match=r"auto_precision\(model_path\)\.precision"):
        precision.Trainer(precision="auto")
