"""``configs/quickstart-fsdp2-cpu.yaml`` end to end: 2 processes, FSDP2, checkpoint, resume and export."""

import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
from torch.distributed.checkpoint.format_utils import torch_save_to_dcp
from transformers import AutoModelForCausalLM

from lit_cancel import RLModule
from lit_cancel.run import export
from lit_cancel.run.checkpointing import COMPLETE_MARKER

CONFIG = Path(__file__).parents[1] / "configs" / "quickstart-fsdp2-cpu.yaml"
LIT_CANCEL = shutil.which("lit-cancel") or str(Path(sys.executable).parent / "lit-cancel")


def fit(save_dir, max_steps: int, *extra: str) -> None:
    subprocess.run(
        [LIT_CANCEL, "fit", "--config", str(CONFIG), f"--trainer.max_steps={max_steps}", "--trainer.val_check_interval=2",
         "--trainer.enable_progress_bar=false", f"--trainer.logger.init_args.save_dir={save_dir}",
         "--data.init_args.prompts_per_round=4", "--data.init_args.group_size=4",
         "--data.init_args.task.init_args.val_size=8", "--model.init_args.val_samples=2", *extra],
        check=True, capture_output=True, timeout=600,
    )


@pytest.mark.slow
def test_fsdp2_quickstart_trains_checkpoints_resumes_and_exports(tmp_path):
    fit(tmp_path / "a", 2)
    run = tmp_path / "a" / "quickstart-fsdp2-cpu" / "version_0"
    events = EventAccumulator(str(run))
    events.Reload()
    logged = events.Tags()["scalars"]
    for name in ["loss/policy", "rollout/reward_mean", "val/accuracy", "health/entropy_mean", "health/learning_tax"]:
        assert name in logged, name
    assert len(events.Scalars("rollout/reward_mean")) == 2

    # one file with the whole model, gathered from the shards, under the unsharded names
    checkpoint = run / "checkpoints" / "last.ckpt"
    state = torch.load(checkpoint, weights_only=False)
    assert state["global_step"] == 2
    initial = RLModule().state_dict()
    assert state["state_dict"].keys() == initial.keys()
    assert all(state["state_dict"][k].shape == v.shape for k, v in initial.items())
    assert any(not torch.equal(state["state_dict"][k], v) for k, v in initial.items())

    # resumed into the shards (model, AdamW state, rollout counters): the same run as one without a stop
    fit(tmp_path / "a", 4, f"--ckpt_path={checkpoint}")
    fit(tmp_path / "b", 4)
    resumed = torch.load(checkpoint, weights_only=False)  # the run goes on in its own folder
    straight = torch.load(tmp_path / "b" / "quickstart-fsdp2-cpu" / "version_0" / "checkpoints" / "last.ckpt", weights_only=False)
    assert resumed["global_step"] == straight["global_step"] == 4
    for name, tensor in straight["state_dict"].items():
        assert torch.equal(resumed["state_dict"][name], tensor), name  # measured: bit-identical

    out = tmp_path / "exported"
    subprocess.run([LIT_CANCEL, "export", "--config", str(CONFIG), f"--ckpt_path={checkpoint}", f"--output_dir={out}"],
                   check=True, capture_output=True, timeout=300)
    exported = AutoModelForCausalLM.from_pretrained(out)
    for name, tensor in exported.state_dict().items():
        assert torch.equal(tensor, resumed["state_dict"][f"policy.model.{name}"]), name


def test_tensor_parallel_fails_at_start_naming_the_option(tmp_path):
    result = subprocess.run(
        [LIT_CANCEL, "fit", "--config", str(CONFIG), f"--trainer.logger.init_args.save_dir={tmp_path}",
         "--trainer.strategy.init_args.data_parallel_size=1", "--trainer.strategy.init_args.tensor_parallel_size=2"],
        capture_output=True, text=True, timeout=300,
    )
    assert result.returncode != 0
    assert "tensor_parallel_size is 2; lit_cancel shards by data parallelism only" in result.stderr
    assert not list(tmp_path.rglob("*.ckpt"))


def test_export_reads_a_sharded_checkpoint_folder(tmp_path):
    state = {name: torch.randn_like(tensor) for name, tensor in RLModule().state_dict().items()}
    state["policy.model.lm_head.weight"] = state["policy.model.model.embed_tokens.weight"]  # tied
    torch.save({"state_dict": state}, tmp_path / "whole.ckpt")
    torch_save_to_dcp(tmp_path / "whole.ckpt", tmp_path / "sharded.ckpt")  # the folder layout of a sharded save
    (tmp_path / "sharded.ckpt" / COMPLETE_MARKER).touch()  # as RunCheckpoint marks a folder once every process wrote its part
    export.main(["--config", str(CONFIG), f"--ckpt_path={tmp_path / 'sharded.ckpt'}", f"--output_dir={tmp_path / 'out'}"])
    exported = AutoModelForCausalLM.from_pretrained(tmp_path / "out")
    for name, tensor in exported.state_dict().items():
        assert torch.equal(tensor, state[f"policy.model.{name}"]), name


@pytest.mark.slow
def test_lora_under_fsdp2_in_bf16_mixed_trains_and_saves_adapters_only(tmp_path):
    lora = Path(__file__).parents[1] / "configs" / "lora.yaml"
    subprocess.run(
        [LIT_CANCEL, "fit", "--config", str(lora), "--trainer.devices=2",
         "--trainer.strategy=lightning.pytorch.strategies.ModelParallelStrategy",
         "--trainer.strategy.init_args.data_parallel_size=2", "--trainer.strategy.init_args.tensor_parallel_size=1",
         "--trainer.strategy.init_args.save_distributed_checkpoint=false", "--trainer.precision=bf16-mixed", "--trainer.max_steps=2",
         "--trainer.val_check_interval=2", "--trainer.enable_progress_bar=false", f"--trainer.logger.init_args.save_dir={tmp_path}",
         "--data.init_args.prompts_per_round=4", "--data.init_args.group_size=4",
         "--data.init_args.task.init_args.val_size=8", "--model.init_args.val_samples=2"],
        check=True, capture_output=True, timeout=600,
    )
    state = torch.load(tmp_path / "lora" / "version_0" / "checkpoints" / "last.ckpt", weights_only=False)["state_dict"]
    assert state and all("lora_" in name for name in state)
    # B starts at zero; two steps of the sharded adapters moved it
    assert all(tensor.abs().sum() > 0 for name, tensor in state.items() if "lora_B" in name)
