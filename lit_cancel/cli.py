"""``lit-cancel``: ``LightningCLI`` with the project's modules and links; ``export``, ``audit-objective``, ``serve``, ``diagnose``.

A mistake found before training starts (an unknown option, a file that is missing or unreadable,
a checkpoint of the wrong kind, sizes that do not fit) ends the command with a short message naming
the option or file (exit status 2). A reward error, a run of non-finite steps or an I/O error during
the run ends it with a short message naming the step and the checkpoint of the last good step (exit
status 1). ``LIT_CANCEL_DEBUG=1`` shows the whole traceback instead.
"""

import argparse
import importlib
import logging
import os
import re
import signal
import sys
import threading
import warnings
import zipfile
from contextlib import suppress
from pathlib import Path

import torch
import yaml
from lightning.pytorch import LightningDataModule, LightningModule
from lightning.pytorch.accelerators import CPUAccelerator
from lightning.pytorch.callbacks import ProgressBar
from lightning.pytorch.cli import LightningCLI
from lightning.pytorch.utilities import rank_zero_info, rank_zero_warn
from torch.distributed.checkpoint import FileSystemReader

from lit_cancel import checkpointing
from lit_cancel.checkpointing import RunStopped, stops_reported
from lit_cancel.data import RolloutDataModule
from lit_cancel.log_errors import log_write_error, quiet_log_writer_threads, report_log_write_errors
from lit_cancel.objectives import Objective, audit, presets
from lit_cancel.precision import AUTO, Trainer, auto_precision, cpu_has_native_bf16
from lit_cancel.rollouts import RewardError, check_reward
from lit_cancel.runs import RunFolderLock, checkpoint_metadata, prepare_run
from lit_cancel.sharding import check_strategy, shards

DEBUG_VARIABLE = "LIT_CANCEL_DEBUG"
COMMANDS = ("fit", "validate", "export", "audit-objective", "serve", "diagnose")
OTHER_COMMANDS = (
    "other commands: 'lit-cancel export' writes a checkpoint as a Hugging Face folder (LoRA adapters merged); "
    "'lit-cancel audit-objective' measures the learning tax of an objective; 'lit-cancel serve' starts a vLLM rollout server "
    "for a config's model; 'lit-cancel diagnose' names why a run is not learning, from its TensorBoard files. "
    "Add --help to any of them for its options."
)
# ckpt_path values that Lightning resolves itself rather than reading a path
_LIGHTNING_CKPT_NAMES = ("last", "best", "hpc", "registry")


# errors whose message is clear without the exception's type (jsonargparse's own, the project's checks)
_MESSAGE_SAYS_ALL = (ValueError, TypeError, OSError, LookupError, ImportError, AttributeError, argparse.ArgumentError)
# errors that stop a started run for a reason the user can act on; any other keeps its traceback
_RUN_ERRORS = (RewardError, FloatingPointError, OSError)
# argparse's own pattern misses exponents, so "--lr -1e-4" would read "-1e-4" as an option
_NEGATIVE_NUMBER = re.compile(r"^-(\d+\.?\d*|\.\d+)([eE][-+]?\d+)?$")
_PRESETS = [name for name, value in vars(presets).items()
            if isinstance(value, type) and issubclass(value, Objective) and value.__module__ == presets.__name__ and name[0] != "_"]


class ConfigError(Exception):
    """A mistake in the command line, the config or the files it names, found before training starts."""


class RunError(Exception):
    """A reward error, a run of non-finite steps or an I/O error that stopped a run after it started.

    The message is the cause's; ``step`` is the optimizer steps done, ``checkpoint`` the path of the
    last checkpoint the run wrote (None when it wrote none).
    """

    def __init__(self, cause: BaseException, step: int, checkpoint: str | None):
        super().__init__(str(cause))
        self.step, self.checkpoint = step, checkpoint


def last_checkpoint_written(trainer) -> str | None:
    """The newest ``last_model_path`` among the trainer's ModelCheckpoint callbacks that exists on disk."""
    paths = [Path(c.last_model_path) for c in trainer.checkpoint_callbacks if getattr(c, "last_model_path", "")]
    written = [path for path in paths if path.exists()]
    return str(max(written, key=lambda path: path.stat().st_mtime)) if written else None


def config_file_problem(message: str, args: list[str]) -> str:
    """What is wrong with the config file behind a jsonargparse ``message`` that does not name it: a YAML error at its
    line and column (for ``"<unicode string>"``), or a file that is empty or not a mapping (for "Unexpected config")."""
    configs = [a.split("=", 1)[1] for a in args if a.startswith("--config=")]
    configs += [b for a, b in zip(args, args[1:]) if a == "--config"]
    for config in configs:
        try:
            options = yaml.safe_load(Path(config).read_text())
        except yaml.MarkedYAMLError as error:
            mark = error.problem_mark or error.context_mark
            return f"{config} line {mark.line + 1} column {mark.column + 1}: {error.problem or error.context}"
        except (OSError, yaml.YAMLError):
            continue
        if options is None:
            return f"{config} is empty: a config is a YAML mapping of options, like configs/quickstart.yaml"
        if not isinstance(options, dict):
            kind = "list" if isinstance(options, list) else type(options).__name__
            return f"{config} holds a YAML {kind}, not a mapping of options (option: value lines, like configs/quickstart.yaml)"
    return message


def explain(error: BaseException) -> str:
    """One message from jsonargparse's nested errors: the option's dotted path, then the innermost message."""
    path, last_class = [], None
    while True:
        first_line = str(error).partition("\n")[0]
        key = re.match(r'Parser key "([^"]+)":', first_line)
        class_path = re.fullmatch(r"Problem with given class_path '(.+)':", first_line)
        if key and path[-1:] != [key[1]]:
            path += ["init_args", key[1]] if last_class else [key[1]]
            last_class = None
        if class_path:
            last_class = class_path[1]
        cause = error.__cause__ or (None if error.__suppress_context__ else error.__context__)
        wraps = key or class_path or first_line.startswith("Does not validate against any of the Union subtypes")
        if cause is None or not (wraps or str(cause).partition("\n")[0] == first_line):
            break
        error = cause
    innermost = error
    message = str(innermost) if isinstance(innermost, _MESSAGE_SAYS_ALL) else f"{type(innermost).__name__}: {innermost}"
    if "Does not validate against any of the Union subtypes" in message and (
        given := re.search(r"Problem with given class_path '(.+)':\s*\n\s*(.+)", message)
    ):
        last_class, message = given[1], given[2]
    if unknown := re.fullmatch(r"Option '(.+)' is not accepted", message):
        option = ".".join(path + ["init_args", unknown[1]])
        listed = f" (lit-cancel fit --{path[0]}.help {last_class} lists them)" if len(path) == 1 else ""
        return f"{option}: {last_class} has no option {unknown[1]!r}{listed}"
    if path[-1:] == ["objective"] and last_class and re.search(r"has no attribute|No module named|not accessible", message):
        message += f"; the presets: {', '.join('lit_cancel.' + name for name in _PRESETS)}"
    if re.search(r"(--|')(optimizer|lr_scheduler)\b", message):
        message += "; the optimizer and its schedule are options of the module: model.init_args.optimizer and model.init_args.lr_scheduler"
    where = ".".join(path)
    if last_class:
        where = f"{where} ({last_class})" if where else last_class
    return f"{where}: {message}" if where else message


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


class LitCancelCLI(LightningCLI):
    """``LightningCLI`` in subclass mode.

    The subcommands are ``fit`` and ``validate`` (the held-out evaluation); the optimizer is the
    module's ``optimizer`` argument only. Parse and instantiation errors, Lightning's FSDP (v1) strategy, a
    ``--ckpt_path`` that is not a checkpoint of the config's kind, data sizes that do not fit the trainer and
    an engine that cannot serve the module (:meth:`~lit_cancel.engines.RolloutEngine.check`) are raised as
    :class:`ConfigError`, all before training or the first validation starts. Before ``fit`` starts
    from scratch (no ``--ckpt_path``), it validates once, so the held-out accuracy of the starting
    policy is logged at step 0. ``--trainer.enable_progress_bar=false`` drops a progress bar that the
    config lists among the callbacks.
    """

    def __init__(self, *args, **kwargs) -> None:
        self.reserved_folders: list[Path] = []  # the folders prepare_run made for a new fit, innermost first
        self.run_folder_lock = RunFolderLock()  # held while fit runs
        kwargs.setdefault("trainer_class", Trainer)  # Lightning's, with trainer.precision: auto
        try:
            super().__init__(*args, **kwargs)
        except BaseException:
            self.run_folder_lock.release(remove_files=bool(self.reserved_folders))
            for folder in self.reserved_folders:
                with suppress(OSError):
                    folder.rmdir()  # only when empty: nothing was run in it
            raise
        self.run_folder_lock.release()

    @staticmethod
    def subcommands() -> dict[str, set[str]]:
        return {name: skip for name, skip in LightningCLI.subcommands().items() if name in ("fit", "validate")}

    def init_parser(self, **kwargs):
        # parse errors are raised, and main() prints them short
        kwargs.setdefault("exit_on_error", False)
        parser = super().init_parser(**kwargs)
        parser._negative_number_matcher = _NEGATIVE_NUMBER
        return parser

    def add_arguments_to_parser(self, parser) -> None:
        parser.add_argument("--overwrite", type=bool, default=False,
                            help="start a new run in a folder that already holds one; its checkpoints replace those of the same name")

    def before_instantiate_classes(self) -> None:
        config = self.config[self.subcommand] if self.subcommand else self.config
        trainer = config.trainer
        if trainer.enable_progress_bar is False and isinstance(trainer.callbacks, list):
            # Lightning refuses a progress bar callback with enable_progress_bar=False
            trainer.callbacks = [c for c in trainer.callbacks if not issubclass(_class(c.class_path), ProgressBar)]
        if trainer.precision == AUTO:
            # the saved config.yaml holds the choice, so a resumed or repeated run uses it again
            model_path = config.model.init_args.get("model_path")
            if model_path is None:
                raise ConfigError("trainer.precision auto is chosen for the model in model.init_args.model_path, which this model lacks")
            choice = auto_precision(model_path, str(trainer.accelerator))
            trainer.precision = choice.precision
            rank_zero_info(f"trainer.precision auto: {choice.precision} ({choice.reason})")

    def parse_arguments(self, parser, args) -> None:
        try:
            super().parse_arguments(parser, args)
        except argparse.ArgumentError as error:
            message = explain(error)
            if "<unicode string>" in message or message.startswith("Unexpected config"):
                message = config_file_problem(message, sys.argv[1:] if args is None else list(args))
            raise ConfigError(message) from error
        subcommand = self.config.get("subcommand")
        if subcommand:
            try:
                check_strategy(self.config[subcommand].trainer.strategy)  # before the Trainer, which refuses FSDP on a CPU
                self.reserved_folders = prepare_run(self.config[subcommand], subcommand)
                if subcommand == "fit":
                    self.run_folder_lock.take(self.config[subcommand])
            except ValueError as error:
                raise ConfigError(str(error)) from error
        ckpt_path = self.config[subcommand].get("ckpt_path") if subcommand else None
        if ckpt_path and not (ckpt_path.startswith(_LIGHTNING_CKPT_NAMES) and not Path(ckpt_path).exists()):
            check_checkpoint(ckpt_path, lora=self.config[subcommand].get("model.init_args.lora") is not None)

    def instantiate_classes(self) -> None:
        try:
            super().instantiate_classes()
        except Exception as error:
            raise ConfigError(explain(error)) from error
        report_log_write_errors(self.trainer)

    def _run_subcommand(self, subcommand: str) -> None:
        try:
            # a signal ends Lightning's loops with SIGTERMException, a SystemExit of status 0: main() tells it as it was
            with stops_reported(self.trainer), warnings.catch_warnings():
                if self.config[subcommand].get("ckpt_path") or self.config[subcommand].get("overwrite"):
                    # the folder holds the run's own checkpoints, or the user asked to write over them
                    warnings.filterwarnings("ignore", message=r"Checkpoint directory .* exists and is not empty")
                super()._run_subcommand(subcommand)
        except _RUN_ERRORS as error:
            if logs := log_write_error(self.trainer, error):
                raise logs from error
            raise RunError(error, self.trainer.global_step, last_checkpoint_written(self.trainer)) from error

    def check_reward(self) -> None:
        """One call of the task's reward and of its ``correct``, so that a reward function with the wrong signature fails
        before the run."""
        task = getattr(self.datamodule, "task", None)
        if task is not None:
            try:
                check_reward(task)
            except RewardError as error:
                raise ConfigError(str(error)) from error

    def check_trainer(self) -> None:
        """Refuses what the module cannot do under the trainer's strategy, before the strategy launches its processes;
        warns of a precision that would make the run slow on this machine."""
        strategy = type(self.trainer.strategy).__name__
        precision = str(self.trainer.precision)
        if precision.startswith("bf16") and isinstance(self.trainer.accelerator, CPUAccelerator) and cpu_has_native_bf16() is False:
            rank_zero_warn(
                f"trainer.precision {precision} on a CPU without bfloat16 instructions (no AVX-512 BF16 or AMX): every "
                "bfloat16 product is emulated, so the run will be slower than in float32; use trainer.precision 32-true"
            )
        if getattr(self.model, "compile", None) is True and shards(self.trainer.strategy):
            raise ConfigError(
                f"model.init_args.compile: true does not work with trainer.strategy {strategy}, which shards the model "
                "(a sharded decoder is not compiled): set model.init_args.compile: false, or compile without sharding "
                "(strategy auto or ddp)"
            )

    def check_engine(self) -> None:
        """The rollout engine's own check (a vLLM KV cache too small for max_model_len), so that it fails before the engine starts."""
        engine = getattr(self.model, "engine", None)
        if engine is not None:
            try:
                engine.check(self.model)
            except ValueError as error:
                raise ConfigError(str(error)) from error

    def before_validate(self) -> None:
        self.check_trainer()
        self.check_reward()
        self.check_engine()

    def after_validate(self) -> None:
        """Prints the held-out metrics (the module logs them to its loggers itself, at the checkpoint's step)."""
        metrics = {name: float(value) for name, value in self.trainer.callback_metrics.items() if name.startswith("val/")}
        if metrics and self.trainer.is_global_zero:
            width = max(map(len, metrics))
            print("\n".join(f"{name:<{width}}  {value:.4f}" for name, value in sorted(metrics.items())))

    def before_fit(self) -> None:
        lr = self.config.fit.get("model.init_args.optimizer.init_args.lr")
        if isinstance(lr, int | float) and lr <= 0:
            raise ConfigError(f"model.init_args.optimizer.init_args.lr must be > 0, got {lr:g}")
        self.check_trainer()
        self.check_reward()
        self.check_engine()
        ckpt_path = self.config.fit.get("ckpt_path")
        if isinstance(self.datamodule, RolloutDataModule):
            objective = getattr(self.model, "objective", None)
            try:
                self.datamodule.check_sizes(self.trainer.world_size, self.trainer.accumulate_grad_batches, fitting=True,
                                            objective=objective)
                self.datamodule.check_prompt_lengths(self.model)
                if ckpt_path and Path(ckpt_path).exists():
                    saved = checkpoint_metadata(Path(ckpt_path)).get(type(self.datamodule).__qualname__, {})
                    self.datamodule.check_resume(saved, objective, self.trainer.world_size)
            except ValueError as error:
                raise ConfigError(str(error)) from error
        if ckpt_path is None:
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
        # a top-level --optimizer would silently replace the module's
        auto_configure_optimizers=False,
        parser_kwargs={"epilog": OTHER_COMMANDS},
        args=args,
    )


def debugging() -> bool:
    """Whether ``LIT_CANCEL_DEBUG`` asks for whole tracebacks instead of the one-line reports."""
    return os.environ.get(DEBUG_VARIABLE, "") not in ("", "0")


def one_line_warning(message: Warning | str, category: type[Warning], filename: str, lineno: int, line: str | None = None) -> str:
    """A warning as the command prints it: ``warning: message`` on one line, without the file and the source line."""
    kind = "" if category is UserWarning else f" ({category.__name__})"
    return f"warning{kind}: {message}\n"


def quiet_dependencies() -> None:
    """Drops what the libraries under the command print on every run and that a user can do nothing about."""
    # Lightning 2.6 flattens every dataloader with torch's LeafSpec, which torch 2.13 deprecates in a FutureWarning
    warnings.filterwarnings("ignore", message=r"`isinstance\(treespec, LeafSpec\)` is deprecated", category=FutureWarning)
    # Lightning advertises its cloud services at every Trainer it builds
    logging.getLogger("lightning.pytorch.utilities.rank_zero").addFilter(lambda record: not record.getMessage().startswith("💡 Tip"))


def main() -> None:
    """The console script: LightningCLI's ``fit`` and ``validate``, ``export``, ``audit-objective``, ``serve``, ``diagnose``."""
    quiet_dependencies()
    command = sys.argv[1:2]
    excepthook, formatwarning = threading.excepthook, warnings.formatwarning
    if not debugging():
        threading.excepthook = quiet_log_writer_threads(excepthook)
        warnings.formatwarning = one_line_warning
    try:
        if not command:
            raise ConfigError(f"lit-cancel needs a command: {', '.join(COMMANDS[:-1])} or {COMMANDS[-1]} "
                              "(lit-cancel COMMAND --help lists its options)")
        if command[0] not in COMMANDS and command[0] not in ("-h", "--help"):
            raise ConfigError(f"unknown command {command[0]!r}: the commands are {', '.join(COMMANDS[:-1])} and {COMMANDS[-1]} "
                              "(lit-cancel COMMAND --help lists its options)")
        if command == ["audit-objective"]:
            sys.exit(audit.main(sys.argv[2:]))
        if command == ["diagnose"]:
            from lit_cancel import diagnose

            sys.exit(diagnose.main(sys.argv[2:]))
        if command == ["export"]:
            from lit_cancel.export import export

            export(sys.argv[2:])
            return
        if command == ["serve"]:
            from lit_cancel import vllm_server

            sys.exit(vllm_server.main(sys.argv[2:]))
        try:
            run_cli()
        except KeyboardInterrupt as stop:  # the run's own Ctrl-C is told by stops_reported: this one came before it
            raise RunStopped("stopped by Ctrl-C (SIGINT) before the run started: nothing to resume", 128 + signal.SIGINT) from stop
    except ConfigError as error:
        if debugging():
            raise
        sys.stderr.write(f"lit-cancel: nothing was run ({DEBUG_VARIABLE}=1 shows the traceback)\nerror: {error}\n")
        sys.exit(2)
    except RunError as error:
        if debugging():
            raise
        saved = f"the last good step is in {error.checkpoint}" if error.checkpoint else "no checkpoint was written"
        sys.stderr.write(
            f"lit-cancel: the run stopped at step {error.step} ({DEBUG_VARIABLE}=1 shows the traceback)\nerror: {error}\n{saved}\n"
        )
        sys.exit(1)
    except RunStopped as stop:
        if debugging():
            raise
        sys.stderr.write(f"lit-cancel: {stop}\n")
        sys.exit(stop.exit_code)
    except KeyboardInterrupt:  # export, audit-objective, diagnose: nothing of theirs needs saving
        if debugging():
            raise
        sys.stderr.write(f"lit-cancel {command[0]}: stopped by Ctrl-C (SIGINT)\n")
        sys.exit(128 + signal.SIGINT)
    finally:
        threading.excepthook, warnings.formatwarning = excepthook, formatwarning


if __name__ == "__main__":
    main()
