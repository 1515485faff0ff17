"""Checks of the checkpoint a command is given, before any model is built: that it is a lit_cancel checkpoint (a file,
or the folder a sharded run writes), and of the kind the config trains (LoRA adapters or the whole model)."""

import zipfile
from pathlib import Path

import torch
from torch.distributed.checkpoint import FileSystemReader

from lit_cancel.run import checkpointing
from lit_cancel.run.errors import ConfigError


def checkpoint_parameter_names(path: str) -> list[str]:
    """The parameter names in a lit_cancel checkpoint: a ``.ckpt`` file or the folder a sharded run writes.

    Raises ConfigError saying why when ``path`` is not such a checkpoint. A file is memory-mapped, not read.
    """

    def refuse(reason: str) -> ConfigError:
        return ConfigError(f"not a lit_cancel checkpoint: {path} ({reason})")

    location = Path(path)
    if not location.exists():
        raise refuse("no such file or folder")
    if location.is_dir():
        if not (location / ".metadata").is_file():
            raise refuse("a folder without the .metadata file of a sharded checkpoint")
        if incomplete := checkpointing.incomplete_folder(location):
            raise ConfigError(incomplete)
        try:
            keys = FileSystemReader(location).read_metadata().state_dict_metadata
        except Exception as error:
            raise refuse(f"its .metadata is unreadable: {error}") from error
        names = [key.removeprefix("state_dict.") for key in keys if key.startswith("state_dict.")]
    else:
        if location.stat().st_size == 0:
            raise refuse("empty file")
        if not zipfile.is_zipfile(location):
            raise refuse("not a file written by torch.save")
        try:
            checkpoint = torch.load(location, map_location="cpu", mmap=True, weights_only=True)
        except Exception as error:
            raise refuse(f"torch.load failed: {str(error).partition(chr(10))[0]}") from error
        state = checkpoint.get("state_dict") if isinstance(checkpoint, dict) else None
        if not isinstance(state, dict):
            raise refuse("no state_dict: not written by a Lightning Trainer")
        names = list(state)
    if not any(name.startswith("policy.") for name in names):
        raise refuse("no policy.* weights in its state_dict")
    return names


def check_checkpoint(path: str, lora: bool, option: str = "--ckpt_path") -> None:
    """Raises ConfigError unless ``path`` is a lit_cancel checkpoint of the kind the config trains (LoRA or whole model)."""
    holds_adapters = any(".lora_A." in name or ".lora_B." in name for name in checkpoint_parameter_names(path))
    if holds_adapters and not lora:
        raise ConfigError(
            f"{option} {path} is a LoRA checkpoint (adapters only), but the config trains the whole model: "
            "use a config with model.init_args.lora as the run had it (like configs/lora.yaml)"
        )
    if lora and not holds_adapters:
        raise ConfigError(
            f"{option} {path} is a whole-model checkpoint, but the config trains LoRA adapters: "
            "use a config without model.init_args.lora (like configs/quickstart.yaml)"
        )
