"""The shipped recipes: every key documented, and the real-model ones start and train with a stand-in model."""

import re
from pathlib import Path

import pytest
from lightning.pytorch import LightningDataModule, LightningModule
from lightning.pytorch.strategies import ModelParallelStrategy

from lit_cancel import DrGRPO
from lit_cancel.cli import LitCancelCLI, run_cli

CONFIGS = Path(__file__).parents[1] / "configs"


@pytest.mark.parametrize("config", sorted(CONFIGS.glob("*.yaml")), ids=lambda p: p.name)
def test_every_key_is_commented(config):
    for number, line in enumerate(config.read_text().splitlines(), 1):
        if re.match(r"\s*(- )?[A-Za-z_]\w*:", line) and "#" not in line:
            key = line.split(":")[0].strip(" -")
            # keys that open a section or name a class explain themselves
            assert key in {
                "trainer", "model", "data", "init_args", "class_path", "logger", "callbacks", "strategy", "objective",
                "optimizer", "lr_scheduler", "task", "lora", "plan",
            }, f"{config.name}:{number} {line!r}"


def real_model_args(config: str, tmp_path, model_path: str, data_file: str) -> list[str]:
    """A real-model recipe on the CPU with a stand-in model and data file, shrunk to fit a test."""
    return [
        "--config", str(CONFIGS / config), "--trainer.accelerator=cpu", "--trainer.enable_progress_bar=false",
        f"--trainer.logger.init_args.save_dir={tmp_path}",
        f"--model.init_args.model_path={model_path}", "--model.init_args.max_new_tokens=8",
        f"--data.init_args.task.init_args.train_file={data_file}", f"--data.init_args.task.init_args.val_file={data_file}",
        "--data.init_args.prompts_per_round=4", "--data.init_args.group_size=2",
    ]


def test_single_gpu_recipe_trains_in_bf16_mixed(tmp_path, tiny_model_path, gsm8k_file):
    args = real_model_args("qwen2.5-0.5b-gsm8k.yaml", tmp_path, tiny_model_path, gsm8k_file)
    cli = run_cli(["fit", *args, "--trainer.max_steps=2", "--data.init_args.task.init_args.reward_fn=test_cli.checksum_reward"])
    assert cli.trainer.global_step == 2
    assert cli.trainer.precision == "bf16-mixed"
    assert isinstance(cli.model.objective, DrGRPO) and cli.model.reference is None
    assert cli.model.policy.model.is_gradient_checkpointing
    # 4 prompts x 2 completions in 4 micro-batches of 2 sequences per step
    assert cli.trainer.accumulate_grad_batches == 4


def test_multi_gpu_recipe_shards_over_every_process(tmp_path, tiny_model_path, gsm8k_file):
    args = real_model_args("qwen2.5-1.5b-gsm8k-fsdp.yaml", tmp_path, tiny_model_path, gsm8k_file)
    cli = LitCancelCLI(LightningModule, LightningDataModule, subclass_mode_model=True, subclass_mode_data=True, run=False, args=args)
    strategy = cli.trainer.strategy
    assert isinstance(strategy, ModelParallelStrategy)
    assert strategy._data_parallel_size == cli.trainer.num_devices == 4 and strategy._tensor_parallel_size == 1
