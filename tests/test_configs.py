"""The shipped recipes: every key documented, and the real-model ones start and train with a stand-in model."""

import importlib.util
import re
from pathlib import Path

import pytest
from conftest import checkpoints_blocks
from lightning.pytorch import LightningDataModule, LightningModule
from lightning.pytorch.strategies import ModelParallelStrategy

from lit_cancel import DrGRPO
from lit_cancel.run.cli import LitCancelCLI, run_cli

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
    # an agent recipe's task holds the task that reads the files
    task = "--data.init_args.task.init_args." + ("task.init_args." if "EnvironmentTask" in (CONFIGS / config).read_text() else "")
    return [
        "--config", str(CONFIGS / config), "--trainer.accelerator=cpu", "--trainer.enable_progress_bar=false",
        f"--trainer.logger.init_args.save_dir={tmp_path}",
        f"--model.init_args.model_path={model_path}", "--model.init_args.max_new_tokens=8",
        f"{task}train_file={data_file}", f"{task}val_file={data_file}",
        "--data.init_args.prompts_per_round=4", "--data.init_args.group_size=2",
    ]


def test_single_gpu_recipe_trains_in_bf16_mixed(tmp_path, tiny_model_path, gsm8k_file):
    args = real_model_args("qwen2.5-0.5b-gsm8k.yaml", tmp_path, tiny_model_path, gsm8k_file)
    cli = run_cli(["fit", *args, "--trainer.max_steps=2", "--data.init_args.task.init_args.reward_fn=conftest.checksum_reward"])
    assert cli.trainer.global_step == 2
    assert cli.trainer.precision == "bf16-mixed"
    assert isinstance(cli.model.objective, DrGRPO) and cli.model.reference is None
    assert checkpoints_blocks(cli.model.policy.model)
    # 4 prompts x 2 completions in 4 micro-batches of 2 sequences per step
    assert cli.trainer.accumulate_grad_batches == 4


def test_multi_gpu_recipe_shards_over_every_process(tmp_path, tiny_model_path, gsm8k_file):
    # the decode loop in place of the recipe's vLLM engine, which needs vLLM (the test below builds it where vLLM is)
    args = [*real_model_args("qwen2.5-1.5b-gsm8k-fsdp.yaml", tmp_path, tiny_model_path, gsm8k_file), "--model.init_args.engine=null"]
    cli = LitCancelCLI(LightningModule, LightningDataModule, subclass_mode_model=True, subclass_mode_data=True, run=False, args=args)
    strategy = cli.trainer.strategy
    assert isinstance(strategy, ModelParallelStrategy)
    assert strategy._data_parallel_size == cli.trainer.num_devices == 4 and strategy._tensor_parallel_size == 1


GPU_RECIPES = [*sorted(CONFIGS.glob("qwen2.5-*.yaml")), CONFIGS / "gsm8k-local.yaml"]


@pytest.mark.parametrize("config", GPU_RECIPES, ids=lambda p: p.name)
def test_every_gpu_recipe_parses_and_builds_on_a_cpu(config, tmp_path, tiny_model_path, gsm8k_file, capsys):
    """A misspelt key or class in a GPU recipe fails here, on a CPU, not at the start of a GPU job."""
    with pytest.raises(SystemExit) as printed:
        run_cli(["fit", "--config", str(config), "--print_config"])
    assert printed.value.code in (None, 0) and "class_path" in capsys.readouterr().out
    if "VLLMEngine" in config.read_text() and importlib.util.find_spec("vllm") is None:
        pytest.skip("building VLLMEngine needs vLLM (the keys were checked by --print_config)")
    cli = LitCancelCLI(LightningModule, LightningDataModule, subclass_mode_model=True, subclass_mode_data=True, run=False,
                       args=real_model_args(config.name, tmp_path, tiny_model_path, gsm8k_file))
    assert cli.model.policy.model.config.hidden_size == 32  # the stand-in model, from the recipe's model_path key
    assert cli.datamodule.prompts_per_round == 4 and cli.trainer.max_steps > 0
