"""Checkpoints that keep the tail of a run: the final step, the step a signal stopped at, written atomically."""

import io
import os
import re
import secrets
import shutil
import signal
import socket
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager, suppress
from functools import partial
from typing import Any
from weakref import proxy

import lightning.pytorch as pl
import torch
from lightning.fabric.plugins import TorchCheckpointIO
from lightning.fabric.utilities.cloud_io import _is_local_file_protocol
from lightning.fabric.utilities.load import _METADATA_FILENAME
from lightning.fabric.utilities.types import _PATH
from lightning.pytorch.callbacks import ModelCheckpoint
from lightning.pytorch.strategies import ModelParallelStrategy, Strategy
from lightning.pytorch.trainer.states import TrainerFn
from lightning.pytorch.utilities.exceptions import SIGTERMException
from lightning.pytorch.utilities.rank_zero import rank_zero_info
from torch.distributed.checkpoint.api import CheckpointException
from typing_extensions import override

# signals that stop a run after its current step: what Slurm and Kubernetes send to pre-empt a job,
# and what Slurm sends ahead of the time limit (``--signal=USR1@90``, Lightning's requeue signal)
STOP_SIGNALS = (signal.SIGTERM, signal.SIGUSR1)
# the file that makes a sharded checkpoint folder whole: written once every process has written its part
COMPLETE_MARKER = "COMPLETE"


class RunStopped(Exception):
    """A run that stopped before its end. ``str(stop)`` is the one line to show, ``exit_code`` the process's status."""

    def __init__(self, message: str, exit_code: int) -> None:
        super().__init__(message)
        self.exit_code = exit_code


def _plain(error: OSError) -> OSError:
    """``error`` without its file name: a message names the folder once, not a temporary file."""
    return OSError(error.errno, error.strerror) if error.filename else error


def _kept(last_good: tuple[str, int] | None) -> str:
    return f"last good checkpoint: {last_good[0]} (step {last_good[1]})" if last_good else "no checkpoint was written before"


class CheckpointWriteError(RunStopped):
    """A checkpoint could not be written; the files written before are untouched.

    ``step`` is the step whose checkpoint failed, where the run stops. The message is ``failure`` (the folder and
    the OS error), the step, and ``kept`` (the last good checkpoint).
    """

    def __init__(self, folder: str, error: OSError, last_good: tuple[str, int] | None, step: int | None = None) -> None:
        self.failure, self.kept, self.step = f"could not write a checkpoint in {folder}: {_plain(error)}", _kept(last_good), step
        stopped = f"stopped at step {step}, " if step is not None else ""
        super().__init__(f"{self.failure}; {stopped}{self.kept}", exit_code=1)


def _new_file_mode() -> int:
    """The permissions ``open()`` gives a new file under the process's umask."""
    umask = os.umask(0)
    os.umask(umask)
    return 0o666 & ~umask


# AtomicCheckpointIO's temporary files: ".{target}.{PID}@{host}.{8 random characters}.tmp" (a host name has no "@")
_TEMPORARY_FILE = re.compile(r"\.(?P<target>.+)\.(?P<pid>\d+)@(?P<host>[A-Za-z0-9._-]+)\.[a-z0-9_]{8}\.tmp")


def _host() -> str:
    """This machine's name as it goes in a file name."""
    return re.sub(r"[^A-Za-z0-9.-]", "_", socket.gethostname()) or "localhost"


def _alive(pid: int) -> bool:
    """Whether a process of this number runs on this machine (another user's counts)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def _temporary_name(path: _PATH) -> str:
    """A temporary sibling of ``path`` named as ``_TEMPORARY_FILE`` reads it."""
    folder, name = os.path.split(os.path.abspath(path))
    return os.path.join(folder, f".{name}.{os.getpid()}@{_host()}.{secrets.token_hex(4)}.tmp")


def _fsync(path: _PATH) -> None:
    descriptor = os.open(path, os.O_RDONLY)
    try:
        os.fsync(descriptor)
    finally:
        os.close(descriptor)


def remove_abandoned_temporary_files(folder: _PATH) -> list[str]:
    """Removes the temporary files that :class:`AtomicCheckpointIO` left in ``folder`` when its process was killed
    mid-write (``kill -9``, the out-of-memory killer), and the temporary folders of sharded checkpoints
    (:class:`RunCheckpoint`): those whose writer (process 0) ran on this host and is no longer alive. The file of
    a live writer (another run writing in the folder) and those written from other hosts are kept, and so is a
    folder marked complete (its writer was killed between marking it and renaming it: rename it to use it).
    Returns the paths removed.
    """
    removed, host = [], _host()
    with suppress(FileNotFoundError, NotADirectoryError):
        for entry in os.scandir(folder):
            named = _TEMPORARY_FILE.fullmatch(entry.name)
            if not named or named["host"] != host or int(named["pid"]) <= 0 or _alive(int(named["pid"])):
                continue
            if entry.is_dir(follow_symlinks=False):
                if not os.path.exists(os.path.join(entry.path, COMPLETE_MARKER)):
                    shutil.rmtree(entry.path, ignore_errors=True)  # another process of this run may remove it too
                    removed += [] if os.path.lexists(entry.path) else [entry.path]
                continue
            with suppress(FileNotFoundError):  # another process of this run removed it first
                os.remove(entry.path)
                removed.append(entry.path)
    return removed


def writes_folders(strategy: Strategy) -> bool:
    """Whether ``strategy`` saves a checkpoint as a folder that every process writes a part of (FSDP2's sharded one)."""
    return isinstance(strategy, ModelParallelStrategy) and strategy._save_distributed_checkpoint


def incomplete_folder(path: _PATH) -> str | None:
    """Why the sharded checkpoint folder ``path`` cannot be loaded, when it lacks ``COMPLETE_MARKER``; None when whole.

    A folder without it is refused, even one written before the marker was: a run stopped while writing a folder
    leaves it with ``.metadata`` and ``meta.pt``, those of the checkpoint it was replacing when Lightning wrote over
    it in place, so Lightning's own files do not tell a whole folder. Whoever knows one is whole makes the marker.
    """
    if os.path.isfile(os.path.join(path, COMPLETE_MARKER)):
        return None
    return (
        f"{path} is an incomplete sharded checkpoint: it has no {COMPLETE_MARKER} file, which is written once every "
        f"process has written its part (the run stopped while writing it); resume from another checkpoint, or, if you "
        f"know the folder is whole (written before checkpoints were marked complete), create {os.path.join(path, COMPLETE_MARKER)}"
    )


def complete_folder(temporary: _PATH, path: _PATH, step: int) -> None:
    """Marks the sharded checkpoint folder ``temporary`` complete and renames it to ``path``; what ``path`` held
    before (a folder or a file) is set aside and removed only once the new folder is in its place."""
    _fsync(os.path.join(temporary, _METADATA_FILENAME))  # DCP flushes its own files, not Lightning's meta.pt
    with open(os.path.join(temporary, COMPLETE_MARKER), "w") as marker:
        marker.write(f"every process wrote its part of step {step}\n")
        marker.flush()
        os.fsync(marker.fileno())
    _fsync(temporary)
    previous = _temporary_name(path) if os.path.lexists(path) else None
    if previous:
        os.rename(path, previous)
    try:
        os.rename(temporary, path)
    except OSError:
        if previous:
            os.rename(previous, path)
        raise
    _fsync(os.path.dirname(os.path.abspath(path)))
    if previous and os.path.isdir(previous):
        with suppress(OSError):
            os.remove(os.path.join(previous, COMPLETE_MARKER))  # first: a half-removed folder is never taken as whole
        shutil.rmtree(previous, ignore_errors=True)
    elif previous:
        with suppress(OSError):
            os.remove(previous)


class AtomicCheckpointIO(TorchCheckpointIO):
    """``TorchCheckpointIO`` that never leaves a partial file: it writes a temporary file in the target's folder,
    flushes it to disk and renames it over the target, so a failed write (a full disk, a lost mount) leaves the
    previous checkpoint of that name as it was and no new file behind. The temporary file's name holds the
    writer's PID and host (``.last.ckpt.4242@node7.x1b2c3d4.tmp``), so that a file left by a killed writer can
    be told from one being written (:func:`remove_abandoned_temporary_files`). Remote (fsspec) paths are
    written as ``TorchCheckpointIO`` writes them.

    Example::

        trainer = Trainer(plugins=[AtomicCheckpointIO()])
    """

    @override
    def save_checkpoint(self, checkpoint: dict[str, Any], path: _PATH, storage_options: Any | None = None) -> None:
        if storage_options is not None or not _is_local_file_protocol(path):
            return super().save_checkpoint(checkpoint, path, storage_options)
        # serialized in memory first, as TorchCheckpointIO does: torch.save writing to a full disk raises a
        # RuntimeError without the OS error, a plain write raises the OSError itself
        serialized = io.BytesIO()
        torch.save(checkpoint, serialized)
        folder = os.path.dirname(os.path.abspath(path))
        os.makedirs(folder, exist_ok=True)
        writer = f"{os.getpid()}@{_host()}"
        descriptor, temporary = tempfile.mkstemp(prefix=f".{os.path.basename(path)}.{writer}.", suffix=".tmp", dir=folder)
        try:
            with os.fdopen(descriptor, "wb") as file:
                os.fchmod(file.fileno(), _new_file_mode())  # mkstemp's 0o600 would hide checkpoints from the user's group
                file.write(serialized.getbuffer())
                file.flush()
                os.fsync(file.fileno())
            os.replace(temporary, path)
        except BaseException:
            with suppress(FileNotFoundError):
                os.remove(temporary)
            raise
        _fsync(folder)  # the rename itself is durable only once the folder is flushed


class RunCheckpoint(ModelCheckpoint):
    """``ModelCheckpoint`` that never loses the tail of a run.

    With ``save_last`` (on by default), ``last.ckpt`` holds the final optimizer step when fit ends, whatever
    ``max_steps`` and the checkpoint and validation intervals are, and the step at which a run failed or was
    stopped. SIGTERM and SIGUSR1 stop the run after its current step, Ctrl-C (SIGINT) at once (``lit-cancel``
    then exits with 128 + the signal's number and names the checkpoint to resume from). Files are written
    atomically (:class:`AtomicCheckpointIO`, unless the trainer has a checkpoint plugin of its own), a write
    that fails stops the run with :class:`CheckpointWriteError`, and the temporary files of writers killed
    mid-write are removed from the folder at setup (:func:`remove_abandoned_temporary_files`). A sharded
    checkpoint (``ModelParallelStrategy(save_distributed_checkpoint=True)``), a folder that every process writes a
    part of, is written into a temporary folder, marked complete once all have written and renamed into its place
    (:meth:`_save_folder`); ``lit-cancel`` refuses a folder without the mark (:func:`incomplete_folder`). Each checkpoint
    records its run's folder (``checkpoint["run"]``), which ``lit-cancel fit --ckpt_path`` continues. The
    ``lit-cancel`` command uses this class for a config's ``lightning.pytorch.callbacks.ModelCheckpoint``.

    Args:
        save_last: keep ``last.ckpt`` (``True``, the default) or not (``False``, ``None``); ``"link"`` is
            refused, because a link to a top-k file need not hold the final step.
        save_on_exception: on an error, also write a checkpoint under ``filename`` (as ``ModelCheckpoint``).
        **kwargs: the other arguments of ``ModelCheckpoint``.

    Example::

        trainer = Trainer(max_steps=27, callbacks=[RunCheckpoint(every_n_train_steps=25)])
        trainer.fit(model)  # last.ckpt holds step 27
    """

    def __init__(self, save_last: bool | None = True, save_on_exception: bool = True, **kwargs: Any) -> None:
        if save_last == "link":
            raise ValueError("save_last='link' is not offered: a link to a top-k file need not hold the final step; use save_last=True")
        super().__init__(save_last=save_last, save_on_exception=save_on_exception, **kwargs)
        self.latest: tuple[str, int] | None = None
        self.stop_signal: signal.Signals | None = None
        self.write_error: CheckpointWriteError | None = None
        self._training_started = False
        self._step_in_last = 0

    @override
    def setup(self, trainer: "pl.Trainer", pl_module: "pl.LightningModule", stage: str) -> None:
        super().setup(trainer, pl_module, stage)
        if type(trainer.strategy.checkpoint_io) is TorchCheckpointIO:
            trainer.strategy.checkpoint_io = AtomicCheckpointIO()
        if self.dirpath and _is_local_file_protocol(self.dirpath):
            for path in remove_abandoned_temporary_files(self.dirpath):
                rank_zero_info(f"removed {path}: the unfinished checkpoint of a process that no longer runs")

    @override
    def on_train_start(self, trainer: "pl.Trainer", pl_module: "pl.LightningModule") -> None:
        super().on_train_start(trainer, pl_module)
        self._training_started = True
        if trainer.ckpt_path is not None:
            self.latest = (trainer.ckpt_path, trainer.global_step)
            if self.last_model_path and os.path.abspath(trainer.ckpt_path) == os.path.abspath(self.last_model_path):
                self._step_in_last = trainer.global_step
        # Lightning has installed its handlers by now (they set trainer.received_sigterm for SIGTERM, and requeue
        # a Slurm job on its signal); this one runs before them, and Lightning puts the originals back at teardown
        for number in STOP_SIGNALS:
            signal.signal(number, partial(self._stop_after_this_step, trainer, signal.getsignal(number)))

    def _stop_after_this_step(self, trainer: "pl.Trainer", previous: Any, number: int, frame: Any) -> None:
        self.stop_signal = signal.Signals(number)
        # the loops raise SIGTERMException at the end of the current step when this flag is set
        trainer._signal_connector.received_sigterm = True
        if callable(previous):
            previous(number, frame)

    @override
    def on_train_end(self, trainer: "pl.Trainer", pl_module: "pl.LightningModule") -> None:
        self._save_last_of_this_step(trainer)

    @override
    def on_exception(self, trainer: "pl.Trainer", pl_module: "pl.LightningModule", exception: BaseException) -> None:
        # before training starts the weights may be half-restored; a write that failed would fail again
        if not self._training_started or isinstance(exception, CheckpointWriteError) or trainer.state.fn != TrainerFn.FITTING:
            return
        try:
            if self.save_on_exception and self._last_global_step_saved != trainer.global_step:
                self._save_checkpoint(trainer, self.format_checkpoint_name(self._monitor_candidates(trainer)))
            self._save_last_of_this_step(trainer)
        except CheckpointWriteError as error:
            self.write_error = error  # lit-cancel reports it with what stopped the run

    def _save_last_of_this_step(self, trainer: "pl.Trainer") -> None:
        if self.save_last and not trainer.fast_dev_run and trainer.global_step > self._step_in_last:
            self._save_last_checkpoint(trainer, self._monitor_candidates(trainer))

    @override
    def _save_checkpoint(self, trainer: "pl.Trainer", filepath: str) -> None:
        try:
            if writes_folders(trainer.strategy):
                self._save_folder(trainer, filepath)
            else:
                super()._save_checkpoint(trainer, filepath)
        except (OSError, CheckpointException) as error:
            # torch.distributed.checkpoint raises on every process what any of them met, wrapped
            failures = [failure for failure, _ in error.failures.values()] if isinstance(error, CheckpointException) else [error]
            cause = next((failure for failure in failures if isinstance(failure, OSError)), None)
            if cause is None:
                raise
            raise CheckpointWriteError(os.path.dirname(filepath) or ".", cause, self.latest, trainer.global_step) from error
        self.latest = (filepath, trainer.global_step)
        if filepath == self.last_model_path:
            self._step_in_last = trainer.global_step

    def _save_folder(self, trainer: "pl.Trainer", filepath: str) -> None:
        """``ModelCheckpoint._save_checkpoint`` for a checkpoint that every process writes a part of: into a temporary
        sibling folder, which process 0 marks complete (:data:`COMPLETE_MARKER`) once all have written, then renames
        to ``filepath`` (:func:`complete_folder`)."""
        # every process names one; the strategy writes into process 0's (ModelParallelStrategy.save_checkpoint broadcasts it)
        temporary = _temporary_name(filepath)
        try:
            trainer.save_checkpoint(temporary, self.save_weights_only)  # it ends at a barrier: every part is written
            failure = None
            if trainer.is_global_zero:
                try:
                    complete_folder(temporary, filepath, trainer.global_step)
                except OSError as error:
                    failure = error
            failure = trainer.strategy.broadcast(failure)  # every process stops, not only process 0
            if failure is not None:
                raise failure
        except BaseException:
            if trainer.is_global_zero:
                shutil.rmtree(temporary, ignore_errors=True)
            raise
        # the rest of ModelCheckpoint._save_checkpoint, once the folder is in its place
        self._last_global_step_saved, self._last_checkpoint_saved = trainer.global_step, filepath
        if trainer.is_global_zero:
            for logger in trainer.loggers:
                logger.after_save_checkpoint(proxy(self))

    @override
    def on_load_checkpoint(self, trainer: "pl.Trainer", pl_module: "pl.LightningModule", checkpoint: dict[str, Any]) -> None:
        if trainer.state.fn == TrainerFn.VALIDATING:
            # Lightning restores the loops for fit only: a validation of a step-N checkpoint would log at step 0
            trainer.fit_loop.epoch_loop._batches_that_stepped = checkpoint.get("global_step", 0)

    @override
    def on_save_checkpoint(self, trainer: "pl.Trainer", pl_module: "pl.LightningModule", checkpoint: dict[str, Any]) -> None:
        if trainer.loggers:
            logger = trainer.loggers[0]
            checkpoint["run"] = {"save_dir": logger.save_dir, "name": logger.name, "version": logger.version,
                                 "log_dir": getattr(logger, "log_dir", None)}


# how a stop is named in its message: Ctrl-C sends SIGINT, which Python raises as KeyboardInterrupt
_SIGNAL_NAMES = {signal.SIGINT: "Ctrl-C (SIGINT)"}


def stop_report(trainer: "pl.Trainer", number: signal.Signals | None = None) -> RunStopped:
    """What stopped a run on a signal: the signal, the step, and the checkpoint to resume from.

    ``number`` is the signal; by default the one :class:`RunCheckpoint` caught (SIGTERM when none did).
    """
    checkpoint = next((c for c in trainer.checkpoint_callbacks if isinstance(c, RunCheckpoint)), None)
    if number is None:
        number = checkpoint.stop_signal if checkpoint and checkpoint.stop_signal else signal.SIGTERM
    name, step, exit_code = _SIGNAL_NAMES.get(number, number.name), trainer.global_step, 128 + number
    if trainer.state.fn is None:
        return RunStopped(f"stopped by {name} before the run started: nothing to resume", exit_code=exit_code)
    if trainer.state.fn != TrainerFn.FITTING:
        return RunStopped(f"stopped by {name} during {trainer.state.fn.value}: nothing to resume", exit_code=exit_code)
    stopped = f"stopped by {name} at step {step}"
    if checkpoint and checkpoint.write_error:
        return RunStopped(f"{stopped}; {checkpoint.write_error.failure}; {checkpoint.write_error.kept}", exit_code=exit_code)
    if checkpoint and checkpoint.latest and checkpoint.latest[1] == step:
        return RunStopped(f"{stopped}; resume with --ckpt_path {checkpoint.latest[0]}", exit_code=exit_code)
    if step == 0:
        return RunStopped(f"{stopped}, before the first step: nothing to resume", exit_code=exit_code)
    return RunStopped(f"{stopped}; no checkpoint holds it: the run keeps no last.ckpt (save_last)", exit_code=exit_code)


@contextmanager
def stops_reported(trainer: "pl.Trainer") -> Iterator[None]:
    """Turns the ends of a run stopped by a signal into :class:`RunStopped`: Lightning's ``SIGTERMException`` (which
    would exit with status 0), and its ``sys.exit(1)`` after Ctrl-C (a ``KeyboardInterrupt``, once the callbacks'
    ``on_exception`` has saved the step). Lightning ignores SIGINT from a Ctrl-C on; the handler before is put back.
    """
    interrupt_handler = signal.getsignal(signal.SIGINT)
    try:
        yield
    except SIGTERMException as stop:
        raise stop_report(trainer) from stop
    except SystemExit as stop:
        if not isinstance(stop.__context__, KeyboardInterrupt):
            raise
        signal.signal(signal.SIGINT, interrupt_handler)
        raise stop_report(trainer, signal.SIGINT) from stop.__context__
    except KeyboardInterrupt as stop:  # outside Lightning's loops (the checks before fit)
        raise stop_report(trainer, signal.SIGINT) from stop
