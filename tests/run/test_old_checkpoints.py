"""Checkpoints written before lit_cancel's modules moved into sub-packages (objectives/, engines/, run/) still resume.

``fixtures/checkpoint-before-subpackages.ckpt`` was written by lit_cancel at commit 49ae945: ``lit-cancel fit`` of
:func:`old_config` for one optimizer step of a round of two, so it holds a mini-batch still to train, and its rollout state
names the objective and the plan by the modules they were then defined in (``lit_cancel.presets.DFPOMin``,
``lit_cancel.plans.QueryPreserved``).
"""

from pathlib import Path

import torch
import yaml

from lit_cancel.run.cli import run_cli

OLD_CHECKPOINT = Path(__file__).parents[1] / "fixtures" / "checkpoint-before-subpackages.ckpt"


def old_config(folder: Path, model_path: str) -> Path:
    """The config the fixture was written with, its model and run folder moved to ``folder``."""
    config = {
        "seed_everything": 0,
        "trainer": {
            "max_steps": 1, "accelerator": "cpu", "devices": 1, "check_val_every_n_epoch": None, "val_check_interval": 1000,
            "num_sanity_val_steps": 0, "limit_val_batches": 0, "log_every_n_steps": 1, "enable_progress_bar": False,
            "enable_model_summary": False,
            "logger": {"class_path": "lightning.pytorch.loggers.TensorBoardLogger", "init_args": {"save_dir": str(folder / "runs"), "name": "old"}},
            "callbacks": [{"class_path": "lit_cancel.RunCheckpoint", "init_args": {"every_n_train_steps": 1}}],
        },
        "model": {"class_path": "lit_cancel.RLModule", "init_args": {"model_path": model_path, "max_new_tokens": 8, "val_samples": 1,
                  "objective": {"class_path": "lit_cancel.DFPOMin"}}},
        "data": {"class_path": "lit_cancel.RolloutDataModule", "init_args": {
            "prompts_per_round": 2, "group_size": 4, "mini_batches_per_round": 2, "val_batch_size": 4,
            "plan": {"class_path": "lit_cancel.QueryPreserved"},
            "task": {"class_path": "lit_cancel.AdditionTask", "init_args": {"num_digits": 3, "train_size": 64, "val_size": 4}}}},
    }
    path = folder / "old.yaml"
    path.write_text(yaml.safe_dump(config))
    return path


def test_a_checkpoint_written_before_the_sub_packages_resumes_mid_round(tmp_path, tiny_model_path):
    saved = torch.load(OLD_CHECKPOINT, map_location="cpu", weights_only=True)
    assert saved["RolloutDataModule"]["run_shape"]["model.init_args.objective"] == "lit_cancel.presets.DFPOMin"
    (pending,) = saved["RolloutDataModule"]["processes"][0]["pending"]
    cli = run_cli(["fit", "--config", str(old_config(tmp_path, tiny_model_path)), "--trainer.max_steps=2", f"--ckpt_path={OLD_CHECKPOINT}"])
    assert cli.trainer.global_step == 2
    assert cli.datamodule.rounds_done == 1  # step 2 trained the mini-batch the checkpoint held, without sampling a new round
    assert cli.datamodule.pending == []
    trained = cli.datamodule.in_flight[-1][1]
    assert torch.equal(trained.input_ids, pending["input_ids"])
