"""The ``lit-cancel`` command: ``LightningCLI`` with the project's modules and links."""

import argparse
import importlib
import sys
import tempfile
from pathlib import Path

import torch
from lightning.pytorch import LightningDataModule, LightningModule
from lightning.pytorch.callbacks import ProgressBar
from lightning.pytorch.cli import LightningCLI
from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

from lit_cancel import audit


class LitCancelCLI(LightningCLI):
    """``LightningCLI`` in subclass mode.

    Before ``fit`` starts from scratch (no ``--ckpt_path``), it validates once, so the held-out
    accuracy of the starting policy is logged at step 0. ``--trainer.enable_progress_bar=false``
    drops a progress bar that the config lists among the callbacks.
    """

    def before_instantiate_classes(self) -> None:
        trainer = (self.config[self.subcommand] if self.subcommand else self.config).trainer
        if trainer.enable_progress_bar is False and isinstance(trainer.callbacks, list):
            # Lightning refuses a progress bar callback with enable_progress_bar=False
            trainer.callbacks = [c for c in trainer.callbacks if not issubclass(_class(c.class_path), ProgressBar)]

    def before_fit(self) -> None:
        if self.config.fit.get("ckpt_path") is None:
            self.trainer.validate(self.model, datamodule=self.datamodule, verbose=False)


def _class(class_path: str) -> type:
    module, _, name = class_path.rpartition(".")
    return getattr(importlib.import_module(module), name)


def run_cli(args: list[str] | None = None) -> LitCancelCLI:
    """Runs the command line and returns it; ``args`` replaces ``sys.argv[1:]`` (as in tests)."""
    return LitCancelCLI(
        LightningModule,
        LightningDataModule,
        subclass_mode_model=True,
        subclass_mode_data=True,
        save_config_kwargs={"overwrite": True},
        # validation metrics updated under inference mode by the validation before fit could not
        # be updated again by fit's validation, which runs under no_grad
        trainer_defaults={"inference_mode": False},
        args=args,
    )


def _load_model_state(checkpoint: Path) -> dict[str, torch.Tensor]:
    """The model's state dict from a checkpoint file, or from the folder a sharded (FSDP2) run writes."""
    if checkpoint.is_file():
        return torch.load(checkpoint, map_location="cpu", weights_only=False)["state_dict"]
    with tempfile.TemporaryDirectory() as scratch:
        gathered = Path(scratch) / "gathered.ckpt"
        dcp_to_torch_save(checkpoint, gathered)
        return torch.load(gathered, map_location="cpu", weights_only=False)["state_dict"]


def export(argv: list[str]) -> None:
    """``lit-cancel export``: a training checkpoint to a Hugging Face folder, LoRA adapters merged."""
    parser = argparse.ArgumentParser(prog="lit-cancel export", description=export.__doc__)
    parser.add_argument("--config", required=True, help="the run's config (the model part is used)")
    parser.add_argument("--ckpt_path", required=True, help="a checkpoint the run wrote: a file, or a sharded folder")
    parser.add_argument("--output_dir", required=True, help="folder for save_pretrained")
    args = parser.parse_args(argv)
    checkpoint = Path(args.ckpt_path)
    if not checkpoint.exists():
        raise SystemExit(f"lit-cancel export: --ckpt_path {args.ckpt_path!r} does not exist")
    cli = LitCancelCLI(
        LightningModule, LightningDataModule, subclass_mode_model=True, subclass_mode_data=True, run=False,
        args=["--config", args.config, "--trainer.logger=false"],
    )
    state = _load_model_state(checkpoint)
    missing, unexpected = cli.model.load_state_dict(state, strict=cli.model.lora is None)
    if unexpected:
        raise SystemExit(f"lit-cancel export: {args.ckpt_path!r} does not fit the model of {args.config!r}: {unexpected[:5]}")
    cli.model.export(args.output_dir)
    print(f"saved {args.output_dir}")


def main() -> None:
    """The ``lit-cancel`` console script: LightningCLI's subcommands, ``audit-objective`` and ``export``."""
    if sys.argv[1:2] == ["audit-objective"]:
        sys.exit(audit.main(sys.argv[2:]))
    if sys.argv[1:2] == ["export"]:
        export(sys.argv[2:])
        return
    run_cli()


if __name__ == "__main__":
    main()
