"""``LightningCLI`` with the project's modules and checks: what ``lit-cancel fit`` and ``lit-cancel validate`` run.

A mistake found before training starts (an unknown option, a file that is missing or unreadable,
a checkpoint of the wrong kind, sizes that do not fit, an environment that fails to build, or whose episodes fail past
``max_failed_share`` in the validation before training) raises :class:`~lit_cancel.run.errors.ConfigError`; a reward
error, a failure budget spent (``max_failed_rounds`` bad rounds in a row), a run of non-finite steps or an I/O error
during the run raises :class:`~lit_cancel.run.errors.RunError` naming the step and the checkpoint of the last good step.
"""

import argparse
import importlib
import re
import sys
import warnings
from pathlib import Path

from lightning.pytorch import LightningDataModule, LightningModule
from lightning.pytorch.accelerators import CPUAccelerator
from lightning.pytorch.callbacks import ProgressBar
from lightning.pytorch.cli import LightningCLI
from lightning.pytorch.utilities import rank_zero_info, rank_zero_warn

from lit_cancel.agents.environment import EnvironmentFailure
from lit_cancel.data import RolloutDataModule
from lit_cancel.float32_products import emulates_bf16
from lit_cancel.gradients import scales_gradients
from lit_cancel.rounds.failures import FailedEpisodes
from lit_cancel.rounds.score import RewardError, check_reward
from lit_cancel.run.checkpointing import stops_reported
from lit_cancel.run.checks import check_checkpoint
from lit_cancel.run.errors import ConfigError, RunError, config_file_problem, explain
from lit_cancel.run.folders import RunFolderLock, checkpoint_metadata, prepare_run, remove_reserved_folders
from lit_cancel.run.log_errors import log_write_error, report_log_write_errors
from lit_cancel.run.precision import AUTO, Trainer, auto_precision
from lit_cancel.sharding import check_strategy, shards

# ckpt_path values that Lightning resolves itself rather than reading a path
_LIGHTNING_CKPT_NAMES = ("last", "best", "hpc", "registry")
# errors that stop a started run for a reason the user can act on; any other keeps its traceback
_RUN_ERRORS = (RewardError, EnvironmentFailure, FailedEpisodes, FloatingPointError, OSError)
# argparse's own pattern misses exponents, so "--lr -1e-4" would read "-1e-4" as an option
_NEGATIVE_NUMBER = re.compile(r"^-(\d+\.?\d*|\.\d+)([eE][-+]?\d+)?$")


def last_checkpoint_written(trainer) -> str | None:
    """The newest ``last_model_path`` among the trainer's ModelCheckpoint callbacks that exists on disk."""
    paths = [Path(c.last_model_path) for c in trainer.checkpoint_callbacks if getattr(c, "last_model_path", "")]
    written = [path for path in paths if path.exists()]
    return str(max(written, key=lambda path: path.stat().st_mtime)) if written else None


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
            trainer = getattr(self, "trainer", None)
            remove_reserved_folders(self.reserved_folders, trained=trainer is not None and trainer.global_step > 0)
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
        if subcommand == "fit" and self.config.fit.trainer.get("max_steps") == 0:
            raise ConfigError("trainer.max_steps must be >= 1 (the optimizer steps to train), got 0")
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
            if isinstance(error, EnvironmentFailure | FailedEpisodes) and subcommand == "validate":
                raise ConfigError(str(error)) from error  # validate trains nothing: the environment is bad input
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

    def check_task(self) -> None:
        """The task's own start-up check (:meth:`~lit_cancel.Task.check_startup`: an agent task builds one environment),
        so that a factory that raises (a tool without a docstring, two tools of one name) fails before the run."""
        task = getattr(self.datamodule, "task", None)
        if task is not None:
            try:
                task.check_startup()
            except ValueError as error:
                raise ConfigError(str(error)) from error

    def check_trainer(self) -> None:
        """Refuses what the module cannot do under the trainer's strategy, before the strategy launches its processes;
        warns of a precision that would make the run slow on this machine."""
        strategy = type(self.trainer.strategy).__name__
        precision = str(self.trainer.precision)
        if emulates_bf16(precision, isinstance(self.trainer.accelerator, CPUAccelerator)):
            rank_zero_warn(
                f"trainer.precision {precision} on a CPU without bfloat16 instructions (no AVX-512 BF16 or AMX): its matrix "
                "products are computed in float32, but attention is emulated and every cast costs time, so the run will be "
                "slower than in float32; use trainer.precision 32-true"
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
                engine.check(self.model.policy_weights(), self.model.sampling_options())
            except ValueError as error:
                raise ConfigError(str(error)) from error

    def before_validate(self) -> None:
        self.check_trainer()
        self.check_task()
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
        if (self.config.fit.get("model.init_args.optimizer.init_args.fused") and self.trainer.gradient_clip_val
                and scales_gradients(self.trainer)):
            raise ConfigError(
                f"model.init_args.optimizer.init_args.fused: true does not work with trainer.precision {self.trainer.precision} "
                f"and trainer.gradient_clip_val {self.trainer.gradient_clip_val:g}: a fused optimizer unscales the float16 "
                "gradient scaler's gradients itself, after they would be clipped; set fused false, precision bf16-mixed or "
                "gradient_clip_val null")
        self.check_trainer()
        self.check_task()
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
            try:
                self.trainer.validate(self.model, datamodule=self.datamodule, verbose=False)
            except (EnvironmentFailure, FailedEpisodes) as error:  # nothing has trained yet
                raise ConfigError(str(error)) from error


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
        args=args,
    )
