"""Logs that cannot be written (a full disk, a folder made read-only) stop the run in one line naming the folder."""

import os
from functools import wraps
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
from lightning.pytorch.trainer.states import TrainerFn

from lit_cancel.run.checkpointing import RunCheckpoint, RunStopped, _kept, _plain


class LogWriteError(RunStopped):
    """A logger could not write its files (a full disk, a folder made read-only): the run stops at the step it was at.

    The message names the folder, the OS error, the step and the last good checkpoint, as the run's
    :class:`RunCheckpoint` holds it when the message is read: after the error, the run still tries to
    save the step it stopped at (its checkpoints may be on another disk).
    """

    def __init__(self, folder: str, error: OSError, trainer: "pl.Trainer") -> None:
        self.failure = f"could not write the logs in {folder}: {_plain(error)}"
        self.step, self.stage = trainer.global_step, trainer.state.fn
        self.checkpoint = next((c for c in trainer.checkpoint_callbacks if isinstance(c, RunCheckpoint)), None)
        super().__init__(self.failure, exit_code=1)

    def __str__(self) -> str:
        if self.stage != TrainerFn.FITTING:
            return f"{self.failure}; stopped during {self.stage.value if self.stage else 'start-up'}: nothing to resume"
        return f"{self.failure}; stopped at step {self.step}, {_kept(self.checkpoint.latest if self.checkpoint else None)}"


# the Logger methods that write files
_LOGGER_WRITES = ("log_metrics", "log_hyperparams", "log_graph", "save", "finalize", "after_save_checkpoint")


def os_error_in(error: BaseException) -> OSError | None:
    """The first ``OSError`` among ``error``, its cause and its context, and theirs (Lightning's TensorBoardLogger
    raises a ``ValueError`` "you tried to log ..." from an event file it cannot write)."""
    seen: set[int] = set()
    while error is not None and id(error) not in seen:
        if isinstance(error, OSError):
            return error
        seen.add(id(error))
        error = error.__cause__ or error.__context__
    return None


def log_folder(logger: Any, error: OSError | None = None) -> str:
    """The folder a logger writes in: that of the file ``error`` names, else the logger's ``log_dir`` or ``save_dir``."""
    if error is not None and error.filename:
        return os.path.dirname(os.fsdecode(error.filename)) or "."
    return str(getattr(logger, "log_dir", None) or getattr(logger, "save_dir", None) or type(logger).__name__)


def report_log_write_errors(trainer: "pl.Trainer") -> None:
    """Makes the trainer's loggers raise :class:`LogWriteError` when they cannot write (an ``OSError``, however
    wrapped), and keeps a logger's ``finalize("failed")``, called while an error stops the run, from replacing that
    error with its own failure to write (the same full disk, most often).

    A TensorBoard event file is written by a thread: its error reaches the run at the next log call.
    """
    for logger in trainer.loggers:
        for name in _LOGGER_WRITES:
            method = getattr(logger, name, None)
            if callable(method) and not hasattr(method, "_reports_write_errors"):
                setattr(logger, name, _reporting_write_errors(trainer, logger, name, method))


def _reporting_write_errors(trainer: "pl.Trainer", logger: Any, name: str, method: Any) -> Any:
    @wraps(method)
    def write(*args: Any, **kwargs: Any) -> Any:
        try:
            return method(*args, **kwargs)
        except Exception as error:
            cause = os_error_in(error)
            if cause is None or isinstance(error, RunStopped):
                raise
            if name == "finalize" and (args[0] if args else kwargs.get("status")) != "success":
                return None  # the error that stops the run is the one to tell; the logs end where they could be written
            raise LogWriteError(log_folder(logger, cause), cause, trainer) from error

    write._reports_write_errors = True
    return write


def log_write_error(trainer, error: BaseException) -> LogWriteError | None:
    """A LogWriteError for an OSError naming a file in a logger's folder (a callback writing to ``logger.experiment``)."""
    cause = os_error_in(error)
    if cause is None or not cause.filename:
        return None
    written = Path(os.fsdecode(cause.filename)).resolve()
    for logger in trainer.loggers:
        folder = getattr(logger, "log_dir", None)
        if folder and written.is_relative_to(Path(folder).resolve()):
            return LogWriteError(log_folder(logger, cause), cause, trainer)
    return None


def quiet_log_writer_threads(previous):
    """A ``threading.excepthook`` that does not print the traceback of TensorBoard's event-writing thread when it
    cannot write (a full disk): the run reports that error when it next logs."""

    def hook(args) -> None:
        if type(args.thread).__name__ == "_AsyncWriterThread" and issubclass(args.exc_type, OSError):
            return
        previous(args)

    return hook
