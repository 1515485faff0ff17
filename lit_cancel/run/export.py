"""``lit-cancel export``: a training checkpoint (a file, or the folder a sharded run writes) to a Hugging Face folder."""

import argparse
import tempfile
import warnings
from pathlib import Path

import torch
from lightning.pytorch import LightningDataModule, LightningModule
from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

from lit_cancel.run.checks import check_checkpoint, checkpoint_parameter_names
from lit_cancel.run.cli import LitCancelCLI
from lit_cancel.run.errors import ConfigError
from lit_cancel.run.folders import try_writing_in


def _load_model_state(checkpoint: Path) -> dict[str, torch.Tensor]:
    """The model's state dict from a checkpoint file, or from the folder a sharded (FSDP2) run writes."""
    if checkpoint.is_file():
        return torch.load(checkpoint, map_location="cpu", weights_only=False)["state_dict"]
    with tempfile.TemporaryDirectory() as scratch:
        gathered = Path(scratch) / "gathered.ckpt"
        dcp_to_torch_save(checkpoint, gathered)
        return torch.load(gathered, map_location="cpu", weights_only=False)["state_dict"]


def check_output_dir(folder: Path, overwrite: bool) -> None:
    """Raises ConfigError when ``export`` could not write ``folder``, or would write among files already there."""
    if folder.exists() and not folder.is_dir():
        raise ConfigError(f"--output_dir {folder} is a file, not a folder: name a new or empty folder")
    if folder.is_dir() and any(folder.iterdir()) and not overwrite:
        raise ConfigError(f"--output_dir {folder} is not empty: name a new or empty folder, or add --overwrite to write over its files")
    try:
        try_writing_in(folder)
    except OSError as error:
        raise ConfigError(f"--output_dir {folder}: cannot write in it ({error.strerror}: {error.filename})") from error


def parser() -> argparse.ArgumentParser:
    """The options of ``lit-cancel export``."""
    options = argparse.ArgumentParser(prog="lit-cancel export", description=main.__doc__)
    options.add_argument("--config", required=True, help="the run's config (the model part is used)")
    options.add_argument("--ckpt_path", required=True, help="a checkpoint the run wrote: a file, or a sharded folder")
    options.add_argument("--output_dir", required=True, help="folder for save_pretrained: new, or empty")
    options.add_argument("--overwrite", action="store_true", help="write into an --output_dir that already holds files")
    return options


def main(argv: list[str]) -> int:
    """``lit-cancel export``: a training checkpoint to a Hugging Face folder, LoRA adapters merged."""
    args = parser().parse_args(argv)
    check_output_dir(Path(args.output_dir), args.overwrite)
    checkpoint_parameter_names(args.ckpt_path)
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="LightningCLI's args parameter")  # sys.argv is export's own
        cli = LitCancelCLI(
            LightningModule, LightningDataModule, subclass_mode_model=True, subclass_mode_data=True, run=False,
            auto_configure_optimizers=False, args=["--config", args.config, "--trainer.logger=false"],
        )
    check_checkpoint(args.ckpt_path, lora=cli.model.lora is not None)
    state = _load_model_state(Path(args.ckpt_path))
    missing, unexpected = cli.model.load_state_dict(state, strict=cli.model.lora is None)
    if unexpected:
        raise ConfigError(f"--ckpt_path {args.ckpt_path} does not fit the model of {args.config}: {unexpected[:5]}")
    cli.model.export(args.output_dir)
    print(f"saved {args.output_dir}")
    return 0
