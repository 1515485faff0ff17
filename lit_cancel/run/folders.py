"""One run, one folder: where a run's files go, which run ``--ckpt_path last`` means, and runs that would mix.

The functions read and change the parsed config of a ``lit-cancel`` subcommand (a jsonargparse
``Namespace``) before any class is instantiated, and raise ``ValueError`` with a one-line message
naming the option for a config that cannot be run safely.
"""

import errno
import fcntl
import importlib
import os
import re
import shutil
import socket
import tempfile
import time
from contextlib import suppress
from pathlib import Path

import torch
from jsonargparse import Namespace
from lightning.fabric.utilities.cloud_io import _is_local_file_protocol
from lightning.fabric.utilities.load import _METADATA_FILENAME
from lightning.fabric.utilities.rank_zero import _get_rank, rank_zero_info
from lightning.pytorch.callbacks import ModelCheckpoint
from lightning.pytorch.loggers import CSVLogger, TensorBoardLogger

from lit_cancel.engines.server_process import RUN_FOLDER_VARIABLE, stop_servers_left_by
from lit_cancel.run.checkpointing import incomplete_folder

PLAIN_MODEL_CHECKPOINT = "lightning.pytorch.callbacks.ModelCheckpoint"
RUN_CHECKPOINT = "lit_cancel.RunCheckpoint"
OVERWRITE_OPTION = "--overwrite true"
# held (flock) by a fit while it runs, in each folder it writes; it names the process. The lock goes with the process,
# kill -9 included, so a file left behind holds nothing.
LOCK_FILE = ".lit-cancel.lock"


def prepare_run(config: Namespace, subcommand: str) -> list[Path]:
    """Readies the config of ``fit`` or ``validate`` for a run that keeps to its own folder.

    A plain ``ModelCheckpoint`` becomes :class:`~lit_cancel.run.checkpointing.RunCheckpoint` (same arguments);
    output folders must be writable; ``--ckpt_path last`` becomes the newest ``last.ckpt`` of the config's
    runs; a checkpoint's run folder is continued (its logger version); a new ``fit`` may not start in a
    folder that holds a run's checkpoints unless ``overwrite`` is set, which makes its checkpoints replace
    the files of the same name.

    A new ``fit`` whose logger picks its version (``version: null``) gets its ``version_N`` folder now
    (:func:`reserve_version`), so that runs started together in one folder get one each; the folders
    made for it are returned, innermost first, for a caller whose run does not go through to remove
    (:func:`remove_reserved_folders`).
    """
    for callback in _checkpoint_callbacks(config).values():
        if callback.class_path == PLAIN_MODEL_CHECKPOINT:
            callback.class_path = RUN_CHECKPOINT
    check_writable(config)
    if config.get("ckpt_path") == "last":
        config.ckpt_path = newest_last_checkpoint(config)
    if config.get("ckpt_path"):
        continue_run_folder(config, config.ckpt_path)
        return []
    if subcommand != "fit":
        return []
    if config.get("overwrite"):
        for callback in _checkpoint_callbacks(config).values():
            callback.init_args.enable_version_counter = False
    else:
        refuse_used_folder(config)
    return reserve_logger_version(config)


class RunFolderLock:
    """The lock a ``fit`` holds on its run's folder (its logger's ``version_N`` folder, else its checkpoint folder), so that
    a second process that would write into it (a second resume of the same ``last.ckpt``) is refused.

    Only a run's first process locks (see :func:`_first_process`); :meth:`release` unlocks (at the end of the run).
    """

    def __init__(self) -> None:
        self.held: dict[Path, int] = {}

    def take(self, config: Namespace) -> None:
        """Locks the folder of the run of ``config``; ValueError naming the folder and the live run that holds it. Then
        stops a vLLM server that an earlier run of the folder launched and left running (its trainer was killed, and the
        server's watchdog too), and says so; the folder is the run's :data:`RUN_FOLDER_VARIABLE`."""
        if not _first_process():
            return
        for option, folder in _written_folders(config).items():
            folder.mkdir(parents=True, exist_ok=True)
            path = folder / LOCK_FILE
            descriptor = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
            try:
                fcntl.flock(descriptor, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                holder = path.read_text().strip() or "another process"
                os.close(descriptor)
                self.release()
                raise ValueError(
                    f"{option}: {folder} is in use by a run that is still going ({holder}); let it finish or stop it, "
                    "or start a new run (without --ckpt_path) in a folder of its own"
                ) from None
            os.ftruncate(descriptor, 0)
            os.write(descriptor, f"pid {os.getpid()} on {socket.gethostname()}, since {time.strftime('%Y-%m-%d %H:%M:%S')}".encode())
            self.held[folder] = descriptor
            if stopped := stop_servers_left_by(folder):
                rank_zero_info(stopped)
            os.environ[RUN_FOLDER_VARIABLE] = str(folder.resolve())

    def release(self, remove_files: bool = False) -> None:
        """Unlocks every folder held; ``remove_files`` also removes the lock files (for folders about to be removed)."""
        for folder, descriptor in self.held.items():
            if remove_files:
                (folder / LOCK_FILE).unlink(missing_ok=True)
            os.close(descriptor)
        if self.held:
            os.environ.pop(RUN_FOLDER_VARIABLE, None)
        self.held = {}


def _first_process() -> bool:
    """Whether this is a run's first process: global rank 0 (or none yet) on the first node."""
    # a node's first process has LOCAL_RANK 0 or none; NODE_RANK (GROUP_RANK under torchrun) tells the first node's
    return _get_rank() in (None, 0) and int(os.environ.get("NODE_RANK", os.environ.get("GROUP_RANK", 0))) == 0


def _written_folders(config: Namespace) -> dict[str, Path]:
    """The folder that holds a run of ``config``, by the option that sets it: its logger's local ``version_N`` folder
    where the version is known, else its first checkpoint folder (none when it has neither)."""
    logger = _logger(config)
    if logger is not None and logger.version is not None and _is_local_file_protocol(str(logger.save_dir or ".")):
        return {"trainer.logger.init_args.version": _runs_folder(logger) / _version_folder(logger.version)}
    folders = {option: folder for option, folder in _checkpoint_folders(config, None).items() if _is_local_file_protocol(str(folder))}
    return dict(list(folders.items())[:1])


def _checkpoint_callbacks(config: Namespace) -> dict[str, Namespace]:
    """The config's ModelCheckpoint callbacks by option name (``trainer.callbacks[0]``)."""
    callbacks = config.trainer.get("callbacks") or []
    found = {}
    for index, callback in enumerate(callbacks if isinstance(callbacks, list) else [callbacks]):
        module, _, name = callback.class_path.rpartition(".")
        if issubclass(getattr(importlib.import_module(module), name), ModelCheckpoint):
            found[f"trainer.callbacks[{index}]"] = callback
    return found


def _logger(config: Namespace) -> Namespace | None:
    """The init_args of the config's first logger when it names its folder (``save_dir``, ``name``, ``version``)."""
    logger = config.trainer.get("logger")
    logger = logger[0] if isinstance(logger, list) and logger else logger
    init_args = logger.get("init_args") if isinstance(logger, Namespace) else None
    if init_args is not None and all(key in init_args for key in ("save_dir", "name", "version")):
        return init_args
    return None


def _versioned_logger(config: Namespace) -> Namespace | None:
    """The init_args of the config's first logger when it keeps each run in a local ``save_dir/name/version_N``
    folder (TensorBoardLogger, CSVLogger) and picks N itself (``version: null``)."""
    logger = config.trainer.get("logger")
    logger = logger[0] if isinstance(logger, list) and logger else logger
    init_args = _logger(config)
    if init_args is None or init_args.version is not None or not _is_local_file_protocol(str(init_args.save_dir or ".")):
        return None
    module, _, name = logger.class_path.rpartition(".")
    return init_args if issubclass(getattr(importlib.import_module(module), name), (TensorBoardLogger, CSVLogger)) else None


def reserve_version(runs: Path) -> int:
    """Creates the next ``version_N`` folder in ``runs`` (as the logger numbers them: one above the highest) and
    returns N. ``os.mkdir`` creates a folder for one process only: a run that finds it made by another run started
    at the same time takes the next number."""
    runs.mkdir(parents=True, exist_ok=True)
    numbers = [int(found[1]) for path in runs.iterdir() if (found := re.fullmatch(r"version_(\d+)", path.name)) and path.is_dir()]
    version = max(numbers, default=-1) + 1
    while True:
        try:
            (runs / f"version_{version}").mkdir()
            return version
        except FileExistsError:
            version += 1
        except FileNotFoundError:  # a refused run removed the empty folder it had made
            runs.mkdir(parents=True, exist_ok=True)


def reserve_logger_version(config: Namespace) -> list[Path]:
    """Sets the version of a logger that would pick it (see :func:`_versioned_logger`) to a ``version_N`` folder
    reserved for this run, and returns the folders it made, innermost first. Only the first process of a run reserves: the processes that
    Lightning starts for the other ranks take its folder from ``LIT_CANCEL_RUN_FOLDER``; those started otherwise
    (``torchrun``, Slurm, or on another node: ``NODE_RANK`` above 0) keep ``version: null``, and Lightning gives them
    rank 0's folder where it counts."""
    logger = _versioned_logger(config)
    if logger is None:
        return []
    runs = _runs_folder(logger)
    if not _first_process():
        # a process that Lightning started for another rank has the first one's environment
        reserved = Path(os.environ.get(RUN_FOLDER_VARIABLE) or ".")
        if (number := re.fullmatch(r"version_(\d+)", reserved.name)) and reserved.parent == runs.resolve():
            logger.version = int(number[1])
        return []
    made = [folder for folder in [runs, *runs.parents] if not folder.exists()]
    try:
        logger.version = reserve_version(runs)
    except OSError as error:
        raise ValueError(f"trainer.logger.init_args.save_dir: cannot create a run folder in {runs} ({error.strerror})") from error
    folder = runs / _version_folder(logger.version)
    os.environ[RUN_FOLDER_VARIABLE] = str(folder.resolve())
    return [folder, *made]


def remove_reserved_folders(reserved: list[Path], trained: bool) -> None:
    """Removes the folders :func:`reserve_logger_version` made for a new run that did not go through (``reserved``,
    innermost first): its ``version_N`` folder when empty, or, when the run stopped before it ``trained`` a step, with
    the files it wrote there (its config, the logs of the validation before fit) unless one is a checkpoint; then each
    folder made above it that is empty. The files of other runs are never in these folders but in folders above them,
    which go only when empty."""
    if not reserved:
        return
    run, *above = reserved
    if not trained and not any(run.rglob("*.ckpt")):
        shutil.rmtree(run, ignore_errors=True)
    for folder in [run, *above]:
        with suppress(OSError):
            folder.rmdir()  # only when empty


def _runs_folder(logger: Namespace) -> Path:
    """The folder of the runs of a config: ``save_dir/name``, holding one ``version_N`` folder per run."""
    return Path(logger.save_dir or ".") / (logger.name or "")


def _version_folder(version: int | str) -> str:
    return version if isinstance(version, str) else f"version_{version}"


def _checkpoint_folders(config: Namespace, version: int | str | None) -> dict[str, Path]:
    """The folders the config's checkpoints go to, by the option that sets each; with the logger's ``version``."""
    logger, folders = _logger(config), {}
    for option, callback in _checkpoint_callbacks(config).items():
        if callback.init_args.get("dirpath"):
            folders[f"{option}.init_args.dirpath"] = Path(callback.init_args.dirpath)
        elif logger is not None and version is not None:
            folders["trainer.logger.init_args.version"] = _runs_folder(logger) / _version_folder(version) / "checkpoints"
        elif config.trainer.get("logger") is False:
            folders["trainer.default_root_dir"] = Path(config.trainer.get("default_root_dir") or ".") / "checkpoints"
    return folders


def _last_checkpoints(folder: Path) -> list[Path]:
    return [path for path in folder.glob("last*.ckpt") if re.fullmatch(r"last(-v\d+)?\.ckpt", path.name)]


def check_writable(config: Namespace) -> None:
    """Raises ValueError naming the option of an output folder that cannot be written (or created)."""
    logger = _logger(config)
    folders = {f"{option}.init_args.dirpath": Path(callback.init_args.dirpath)
               for option, callback in _checkpoint_callbacks(config).items() if callback.init_args.get("dirpath")}
    if logger is not None:
        folders["trainer.logger.init_args.save_dir"] = Path(logger.save_dir or ".")
    elif config.trainer.get("default_root_dir"):
        folders["trainer.default_root_dir"] = Path(config.trainer.default_root_dir)
    for option, folder in folders.items():
        try:
            try_writing_in(folder)
        except OSError as error:
            raise ValueError(f"{option}: cannot write in {folder} ({error.strerror}: {error.filename})") from error


def try_writing_in(folder: Path) -> None:
    """Raises OSError (``filename``: the folder tried) unless a file can be made in ``folder`` or, when it does not
    exist yet, in the nearest folder above it that does. Permissions alone would not do: root ignores them."""
    existing = folder
    while not existing.exists() and existing != existing.parent:
        existing = existing.parent
    try:
        if not existing.is_dir():
            raise NotADirectoryError(errno.ENOTDIR, os.strerror(errno.ENOTDIR))
        with tempfile.TemporaryFile(dir=existing):
            pass
    except OSError as error:
        kernel = _file_system(existing)
        reason = f"new files cannot be made on a {kernel} file system" if kernel in _KERNEL_FILE_SYSTEMS else error.strerror
        raise OSError(error.errno, reason, str(existing)) from error


# file systems through which the kernel shows its state: they refuse new files, with errors that do not say so
_KERNEL_FILE_SYSTEMS = {"proc", "sysfs", "devtmpfs", "devpts", "cgroup", "cgroup2", "debugfs", "tracefs", "securityfs", "configfs",
                        "pstore", "bpf", "fusectl", "mqueue", "hugetlbfs", "efivarfs"}


def _file_system(folder: Path) -> str | None:
    """The type of the file system ``folder`` is on (from ``/proc/self/mounts``), or None where that cannot be read."""
    try:
        mounts = [line.split() for line in Path("/proc/self/mounts").read_text().splitlines()]
    except OSError:
        return None
    folder = folder.resolve()
    covering = [(Path(fields[1]), fields[2]) for fields in mounts if len(fields) > 2 and folder.is_relative_to(fields[1])]
    return max(covering, key=lambda mount: len(mount[0].parts))[1] if covering else None


def newest_last_checkpoint(config: Namespace) -> str:
    """The checkpoint ``--ckpt_path last`` resumes: the newest ``last.ckpt`` among the config's runs, or the newest whole
    checkpoint of another name when it is newer (a run killed while it wrote ``last.ckpt`` keeps its step checkpoint);
    ValueError when there is none."""
    logger, searched = _logger(config), {}
    for callback in _checkpoint_callbacks(config).values():
        if callback.init_args.get("dirpath"):
            searched[str(callback.init_args.dirpath)] = [Path(callback.init_args.dirpath)]
        elif logger is not None:
            runs = _runs_folder(logger)
            searched[str(runs / "*" / "checkpoints")] = sorted(runs.glob("*/checkpoints"))
        elif config.trainer.get("logger") is False:
            folder = Path(config.trainer.get("default_root_dir") or ".") / "checkpoints"
            searched[str(folder)] = [folder]
    folders = [folder for listed in searched.values() for folder in listed]
    lasts = [path for folder in folders for path in _last_checkpoints(folder)]
    whole = [path for folder in folders for path in _whole_checkpoints(folder)]
    if not whole:
        where = " or ".join(searched) or "no checkpoint folder: the config has no ModelCheckpoint"
        raise ValueError(f"--ckpt_path last: no earlier run of this config to resume (no checkpoint in {where})")
    newest = max(whole, key=lambda path: (path.stat().st_mtime, path in lasts))
    if newest not in lasts:
        rank_zero_info(f"--ckpt_path last: resuming {newest}, the newest whole checkpoint of this config's runs"
                       + (f", which is newer than {max(lasts, key=lambda path: path.stat().st_mtime)}" if lasts else " (no last.ckpt)"))
    return str(newest)


def _whole_checkpoints(folder: Path) -> list[Path]:
    """The checkpoints in ``folder`` that a run finished writing: ``.ckpt`` files (each is written under a temporary
    name, then renamed), and sharded ``.ckpt`` folders marked complete."""
    return [path for path in folder.glob("*.ckpt")
            if not path.name.startswith(".") and (path.is_file() or (path.is_dir() and incomplete_folder(path) is None))]


def checkpoint_metadata(checkpoint: Path) -> dict:
    """What a checkpoint holds besides the weights: a file (memory-mapped), or a sharded folder's ``meta.pt``; empty
    when it is not readable as one."""
    source = checkpoint / _METADATA_FILENAME if checkpoint.is_dir() else checkpoint
    try:
        saved = torch.load(source, map_location="cpu", mmap=True, weights_only=True)
    except Exception:
        return {}  # a file that is not a checkpoint is refused, with its reason, by the --ckpt_path check
    return saved if isinstance(saved, dict) else {}


def continue_run_folder(config: Namespace, ckpt_path: str) -> None:
    """Sets the logger's version to that of the run that wrote ``ckpt_path`` when it is a run of this config."""
    logger = _logger(config)
    if logger is None or logger.version is not None:
        return
    checkpoint = Path(ckpt_path).resolve()
    runs = _runs_folder(logger).resolve()
    if checkpoint.parent.name == "checkpoints" and checkpoint.parent.parent.parent == runs:
        folder = checkpoint.parent.parent.name
        number = re.fullmatch(r"version_(\d+)", folder)
        logger.version = int(number[1]) if number else folder
        return
    saved = checkpoint_metadata(checkpoint).get("run", {})
    if saved.get("version") is not None and (Path(saved["save_dir"] or ".") / (saved["name"] or "")).resolve() == runs:
        logger.version = saved["version"]


def refuse_used_folder(config: Namespace) -> None:
    """Raises ValueError when a new run's checkpoints would go to a folder that holds another run's ``last.ckpt``."""
    logger = _logger(config)
    for option, folder in _checkpoint_folders(config, logger.version if logger is not None else None).items():
        if held := _last_checkpoints(folder):
            newest = max(held, key=lambda path: path.stat().st_mtime)
            raise ValueError(
                f"{option}: {folder} already holds a run ({newest.name}); resume it with --ckpt_path {newest}, "
                f"or start over in it with {OVERWRITE_OPTION}"
            )
