"""During a run: the last step is saved, signals are told truthfully, checkpoints are written atomically, one run keeps one folder."""

import errno
import fcntl
import io
import os
import re
import signal
import socket
import stat
import subprocess
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import lightning as L
import pytest
import torch
import yaml
from jsonargparse import Namespace
from lightning.pytorch.loggers import TensorBoardLogger
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

from lit_cancel.engines import server_process
from lit_cancel.engines.server_process import RUN_FOLDER_VARIABLE, start_server, stop_server
from lit_cancel.engines.server_watchdog import group_alive
from lit_cancel.run import commands
from lit_cancel.run.checkpointing import _host
from lit_cancel.run.cli import run_cli
from lit_cancel.run.folders import LOCK_FILE, RunFolderLock, reserve_logger_version, reserve_version


def write_config(folder: Path, max_steps: int = 2, **checkpoint_args) -> Path:
    """A config of a few quick steps: the embedded model, 2 prompts x 4 rollouts of 8 tokens, no validation, a ModelCheckpoint."""
    checkpoint = {"save_last": True, "every_n_train_steps": 1, "save_on_train_epoch_end": True, "save_on_exception": True, **checkpoint_args}
    config = {
        "seed_everything": 0,
        "trainer": {
            "max_steps": max_steps, "accelerator": "cpu", "devices": 1, "check_val_every_n_epoch": None, "val_check_interval": 1000,
            "num_sanity_val_steps": 0, "limit_val_batches": 0, "log_every_n_steps": 1, "enable_progress_bar": False,
            "enable_model_summary": False,
            "logger": {"class_path": "lightning.pytorch.loggers.TensorBoardLogger", "init_args": {"save_dir": str(folder / "runs"), "name": "tiny"}},
            "callbacks": [{"class_path": "lightning.pytorch.callbacks.ModelCheckpoint", "init_args": checkpoint}],
        },
        "model": {"class_path": "lit_cancel.RLModule", "init_args": {"max_new_tokens": 8, "val_samples": 1}},
        "data": {
            "class_path": "lit_cancel.RolloutDataModule",
            "init_args": {"prompts_per_round": 2, "group_size": 4, "val_batch_size": 4, "task": {
                "class_path": "lit_cancel.AdditionTask", "init_args": {"num_digits": 3, "train_size": 64, "val_size": 4}}},
        },
    }
    path = folder / "tiny.yaml"
    path.write_text(yaml.safe_dump(config))
    return path


def checkpoints(folder: Path, version: int = 0) -> Path:
    return folder / "runs" / "tiny" / f"version_{version}" / "checkpoints"


def saved_step(path: Path) -> int:
    return torch.load(path, map_location="cpu", weights_only=False)["global_step"]


def console(monkeypatch, capsys, *args: str) -> tuple[int, list[str]]:
    """The exit status and stderr lines of the ``lit-cancel`` console script run with ``args``."""
    monkeypatch.setattr(sys, "argv", ["lit-cancel", *args])
    monkeypatch.delenv(commands.DEBUG_VARIABLE, raising=False)
    with pytest.raises(SystemExit) as exit:
        commands.main()
    return exit.value.code, capsys.readouterr().err.strip().splitlines()


def test_last_ckpt_holds_the_final_step_between_checkpoint_intervals(tmp_path):
    run_cli(["fit", "--config", str(write_config(tmp_path, max_steps=7, every_n_train_steps=5))])
    assert saved_step(checkpoints(tmp_path) / "last.ckpt") == 7
    assert sorted(path.name for path in checkpoints(tmp_path).iterdir()) == ["epoch=0-step=5.ckpt", "last.ckpt"]
    umask = os.umask(0)
    os.umask(umask)
    assert stat.S_IMODE((checkpoints(tmp_path) / "last.ckpt").stat().st_mode) == 0o666 & ~umask  # as open() creates files


def default_interrupt() -> None:
    """Ctrl-C raises KeyboardInterrupt in the child even where this process ignores it (a shell's background job)."""
    signal.signal(signal.SIGINT, signal.SIG_DFL)


@pytest.mark.parametrize(("stop", "name"), [(signal.SIGTERM, "SIGTERM"), (signal.SIGUSR1, "SIGUSR1"),
                                            (signal.SIGINT, r"Ctrl-C \(SIGINT\)")])
def test_a_signal_saves_the_step_it_stopped_at_and_exits_with_128_plus_its_number(tmp_path, stop, name):
    config = write_config(tmp_path, max_steps=100_000)
    environment = {k: v for k, v in os.environ.items() if k != commands.DEBUG_VARIABLE}
    with open(tmp_path / "stderr.txt", "w") as errors:
        run = subprocess.Popen([sys.executable, "-m", "lit_cancel", "fit", "--config", str(config)], env=environment, cwd=tmp_path,
                               stdout=subprocess.DEVNULL, stderr=errors, preexec_fn=default_interrupt)
        last = checkpoints(tmp_path) / "last.ckpt"
        deadline = time.monotonic() + 900  # a guard against a hang: the signal waits for a saved step, however long a busy machine takes
        while not last.exists() and run.poll() is None and time.monotonic() < deadline:
            time.sleep(0.2)
        run.send_signal(stop)
        run.wait(timeout=120)
    stderr = (tmp_path / "stderr.txt").read_text()
    assert run.returncode == 128 + stop, stderr[-2000:]
    line = stderr.strip().splitlines()[-1]
    said = re.fullmatch(rf"lit-cancel: stopped by {name} at step (\d+); resume with --ckpt_path (.+)", line)
    assert said, line
    assert Path(said[2]).resolve() == last.resolve()
    assert saved_step(last) == int(said[1]) >= 1


class CtrlCAtStep2(L.Callback):
    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
        if trainer.global_step == 2:
            raise KeyboardInterrupt


def test_ctrl_c_saves_the_step_it_stopped_at_and_exits_with_130(tmp_path, monkeypatch, capsys):
    handler = signal.getsignal(signal.SIGINT)
    config = str(write_config(tmp_path, max_steps=5, every_n_train_steps=100))
    code, lines = console(monkeypatch, capsys, "fit", "--config", config, "--trainer.callbacks+=test_run_safety.CtrlCAtStep2")
    last = checkpoints(tmp_path) / "last.ckpt"
    assert (code, lines[-1]) == (130, f"lit-cancel: stopped by Ctrl-C (SIGINT) at step 2; resume with --ckpt_path {last}")
    assert saved_step(last) == 2  # written as the run stopped: the checkpoint interval is 100 steps
    assert signal.getsignal(signal.SIGINT) is handler  # Lightning ignores SIGINT after a Ctrl-C; the handler is back


def test_ctrl_c_before_the_run_starts_says_there_is_nothing_to_resume(tmp_path, monkeypatch, capsys):
    def load_causal_lm(*args, **kwargs):
        raise KeyboardInterrupt

    monkeypatch.setattr("lit_cancel.module.load_causal_lm", load_causal_lm)
    code, lines = console(monkeypatch, capsys, "fit", "--config", str(write_config(tmp_path)))
    assert (code, lines[-1]) == (130, "lit-cancel: stopped by Ctrl-C (SIGINT) before the run started: nothing to resume")


def test_ctrl_c_while_the_command_loads_is_one_line(tmp_path):
    """SIGINT while torch and Lightning are imported, before any of the command runs: the documented line, exit 130."""
    # 'loading' is printed as console.main starts importing the command line, inside the block that must catch Ctrl-C
    script = (
        "import builtins, sys\n"
        "from lit_cancel.run import console\n"
        "load = builtins.__import__\n"
        "def announced(name, *args, **kwargs):\n"
        "    if name == 'lit_cancel.run.commands':\n"
        "        print('loading', flush=True)\n"
        "    return load(name, *args, **kwargs)\n"
        "builtins.__import__ = announced\n"
        "sys.argv = ['lit-cancel', 'fit', '--help']\n"
        "console.main()\n"
    )
    environment = {k: v for k, v in os.environ.items() if k != commands.DEBUG_VARIABLE}
    run = subprocess.Popen([sys.executable, "-c", script], env=environment, cwd=tmp_path, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                           text=True, preexec_fn=default_interrupt)
    assert run.stdout.readline() == "loading\n"
    run.send_signal(signal.SIGINT)
    stdout, stderr = run.communicate(timeout=120)
    assert (run.returncode, stderr) == (130, "lit-cancel: stopped by Ctrl-C (SIGINT) before the run started: nothing to resume\n")
    assert "usage" not in stdout  # the import was interrupted: --help never ran


@pytest.mark.parametrize("command", [["diagnose", "runs"], ["audit-objective", "GRPO"]])
def test_ctrl_c_in_another_command_is_one_line(monkeypatch, capsys, command):
    def interrupted(*args, **kwargs):
        raise KeyboardInterrupt

    monkeypatch.setattr("lit_cancel.callbacks.doctor.command.main", interrupted)
    monkeypatch.setattr("lit_cancel.objectives.audit.main", interrupted)
    code, lines = console(monkeypatch, capsys, *command)
    assert (code, lines) == (130, [f"lit-cancel {command[0]}: stopped by Ctrl-C (SIGINT)"])


def test_a_failed_write_keeps_the_previous_last_ckpt_and_stops_in_one_line(tmp_path, monkeypatch, capsys):
    fsync, last_writes = os.fsync, []

    def disk_full_at_the_second_last_ckpt(descriptor):
        if ".last.ckpt." in os.readlink(f"/proc/self/fd/{descriptor}"):  # the temporary file of last.ckpt, fully written
            last_writes.append(descriptor)
            if len(last_writes) == 2:
                raise OSError(28, "No space left on device")
        fsync(descriptor)

    monkeypatch.setattr(os, "fsync", disk_full_at_the_second_last_ckpt)
    code, lines = console(monkeypatch, capsys, "fit", "--config", str(write_config(tmp_path, max_steps=5)))
    folder = checkpoints(tmp_path)
    assert code == 1
    assert lines[-1] == (f"lit-cancel: could not write a checkpoint in {folder}: [Errno 28] No space left on device; "
                         f"stopped at step 2, last good checkpoint: {folder / 'epoch=0-step=2.ckpt'} (step 2)")
    assert saved_step(folder / "last.ckpt") == 1
    assert sorted(path.name for path in folder.iterdir()) == ["epoch=0-step=2.ckpt", "last.ckpt"]  # no partial or temporary file


def kill_9_during_a_write(path: Path) -> int:
    """Runs AtomicCheckpointIO's write of ``path`` in a process killed with SIGKILL mid-write; returns its PID."""
    writer = (f"import os, time\nfrom lit_cancel.run.checkpointing import AtomicCheckpointIO\nos.fsync = lambda descriptor: time.sleep(600)\n"
              f"AtomicCheckpointIO().save_checkpoint({{'step': 1}}, {str(path)!r})\n")
    run = subprocess.Popen([sys.executable, "-c", writer])
    deadline = time.monotonic() + 900  # a guard against a hang: the kill waits for the write to begin, however long the imports take
    while not list(path.parent.glob(f".{path.name}.*.tmp")) and run.poll() is None and time.monotonic() < deadline:
        time.sleep(0.1)
    run.kill()
    run.wait()
    return run.pid


def test_a_write_killed_midway_leaves_a_temporary_file_that_the_next_run_removes_unless_its_writer_lives(tmp_path):
    folder = tmp_path / "fixed"
    folder.mkdir()
    pid = kill_9_during_a_write(folder / "last.ckpt")
    host = _host()  # the host name, with any character unfit for a file name replaced
    [killed] = [path.name for path in folder.iterdir()]
    assert re.fullmatch(rf"\.last\.ckpt\.{pid}@{re.escape(host)}\.[a-z0-9_]{{8}}\.tmp", killed)
    kept = [f".last.ckpt.{os.getpid()}@{host}.abcd1234.tmp",  # a live writer: another run writing in the folder
            f".last.ckpt.{pid}@elsewhere.abcd1234.tmp",  # another host's process, whose life cannot be told from here
            ".last.ckpt.abcd1234.tmp", "notes.txt"]  # not a temporary file with its writer
    for name in kept:
        (folder / name).write_text("")
    run_cli(["fit", "--config", str(write_config(tmp_path, max_steps=1, dirpath=str(folder)))])
    assert sorted(path.name for path in folder.iterdir()) == sorted(["epoch=0-step=1.ckpt", "last.ckpt", *kept])


class FailingDisk:
    """Writes under ``folder`` fail with ``error`` once ``failing`` is set: ENOSPC (a full disk; a write's error names
    no file) or EROFS (a folder made read-only; the error names the file). Root ignores a folder's permissions, and
    a test cannot count on mounting a small or read-only file system: the failures are those of ``io.open`` (with
    which TensorBoard's event-writing thread appends) and ``os.open`` (with which a checkpoint's temporary file is
    made) for writing."""

    def __init__(self, monkeypatch, folder: Path, error: int):
        self.folder, self.error, self.failing, self.failures = str(folder), error, False, 0
        io_open, os_open = io.open, os.open

        def open_for_io(file, mode="r", *args, **kwargs):
            if set(mode) & set("wax+"):
                self.check(file)
            return io_open(file, mode, *args, **kwargs)

        def open_for_os(path, flags, *args, **kwargs):
            if flags & (os.O_WRONLY | os.O_RDWR | os.O_CREAT):
                self.check(path)
            return os_open(path, flags, *args, **kwargs)

        monkeypatch.setattr(io, "open", open_for_io)
        monkeypatch.setattr(os, "open", open_for_os)

    def check(self, path) -> None:
        if self.failing and isinstance(path, str | bytes | os.PathLike) and os.fsdecode(path).startswith(self.folder):
            self.failures += 1
            raise OSError(self.error, os.strerror(self.error), *([path] if self.error == errno.EROFS else []))

    def wait_for_a_failure(self) -> None:
        """Until TensorBoard's thread has tried to write (it fails then, and the run hears of it at its next log call)."""
        deadline = time.monotonic() + 300  # a guard against a hang: a busy machine can hold the thread back long
        while not self.failures and time.monotonic() < deadline:
            time.sleep(0.05)


DISK: FailingDisk | None = None


def test_a_full_disk_at_the_first_checkpoint_is_told_in_one_line_when_the_logs_cannot_be_flushed_either(tmp_path, monkeypatch, capsys):
    fsync, finalize = os.fsync, TensorBoardLogger.finalize

    def disk_full_at_checkpoints(descriptor):
        if ".ckpt." in os.readlink(f"/proc/self/fd/{descriptor}"):  # a checkpoint's temporary file
            raise OSError(errno.ENOSPC, "No space left on device")
        fsync(descriptor)

    def flush_on_a_full_disk(self, status):
        # TensorBoard's event-writing thread failed on the same disk: the flush at the end raises its error
        if status == "failed":
            raise OSError(errno.ENOSPC, "No space left on device")
        finalize(self, status)

    monkeypatch.setattr(os, "fsync", disk_full_at_checkpoints)
    monkeypatch.setattr(TensorBoardLogger, "finalize", flush_on_a_full_disk)
    code, lines = console(monkeypatch, capsys, "fit", "--config", str(write_config(tmp_path, max_steps=3)))
    folder = checkpoints(tmp_path)
    assert code == 1
    assert lines[-1] == (f"lit-cancel: could not write a checkpoint in {folder}: [Errno 28] No space left on device; "
                         "stopped at step 1, no checkpoint was written before")
    assert list(folder.iterdir()) == []  # no partial or temporary file


class DiskFullAfterStep2(L.Callback):
    """The disk is full from the end of step 2, before the first checkpoint (step 3); step 3 starts once TensorBoard's
    thread has failed to write the scalars of step 2."""

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        DISK.failing = trainer.global_step >= 2

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
        if trainer.global_step == 2:
            DISK.wait_for_a_failure()


def test_a_disk_full_before_the_first_checkpoint_stops_the_run_in_one_line_at_the_logs(tmp_path, monkeypatch, capsys):
    global DISK
    DISK = FailingDisk(monkeypatch, tmp_path / "runs", errno.ENOSPC)
    config = str(write_config(tmp_path, max_steps=5, every_n_train_steps=3))
    code, lines = console(monkeypatch, capsys, "fit", "--config", config, "--trainer.callbacks+=test_run_safety.DiskFullAfterStep2",
                          "--trainer.callbacks+=lightning.pytorch.callbacks.LearningRateMonitor")
    folder = checkpoints(tmp_path)
    assert code == 1
    assert lines[-1] == (f"lit-cancel: could not write the logs in {folder.parent}: [Errno 28] No space left on device; "
                         "stopped at step 2, no checkpoint was written before")
    assert not any("Traceback" in line for line in lines)  # nor that of TensorBoard's thread
    assert list(folder.iterdir()) == []  # the checkpoint of step 2 tried on the way out left no file
    assert scalar_steps(folder.parent, "rollout/reward_mean") == [0]  # the scalars of step 1 (logged at 0) are whole


class ReadOnlyFromStep3(L.Callback):
    """The folder is made read-only as step 3 starts (the learning rate of step 3 is logged then); step 3 ends
    once TensorBoard's thread has failed to write it, when the logs are in the folder."""

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
        DISK.failing = trainer.global_step >= 2

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        if trainer.global_step == 3 and DISK.folder.endswith("runs"):
            DISK.wait_for_a_failure()


@pytest.mark.parametrize("read_only", ["run folder", "checkpoint folder"])
def test_a_folder_made_read_only_mid_run_stops_it_in_one_line_naming_the_step_and_the_last_good_checkpoint(
    tmp_path, monkeypatch, capsys, read_only
):
    global DISK
    fixed = {"dirpath": str(tmp_path / "fixed")} if read_only == "checkpoint folder" else {}
    folder = tmp_path / "fixed" if fixed else checkpoints(tmp_path)
    DISK = FailingDisk(monkeypatch, folder if fixed else tmp_path / "runs", errno.EROFS)
    config = str(write_config(tmp_path, max_steps=6, every_n_train_steps=2, **fixed))
    code, lines = console(monkeypatch, capsys, "fit", "--config", config, "--trainer.callbacks+=test_run_safety.ReadOnlyFromStep3",
                          "--trainer.callbacks+=lightning.pytorch.callbacks.LearningRateMonitor")
    kept = f"last good checkpoint: {folder / 'last.ckpt'} (step 2)"
    assert code == 1
    if fixed:  # the logs are written; the checkpoint of step 4 is not
        failed = f"could not write a checkpoint in {folder}: [Errno 30] Read-only file system; stopped at step 4"
    else:  # the learning rate at step 3 is not written; nor is the checkpoint the run then tries for step 3
        failed = f"could not write the logs in {folder.parent}: [Errno 30] Read-only file system; stopped at step 3"
    assert lines[-1] == f"lit-cancel: {failed}, {kept}"
    assert not any("Traceback" in line for line in lines)
    assert saved_step(folder / "last.ckpt") == 2
    assert sorted(path.name for path in folder.iterdir()) == ["epoch=0-step=2.ckpt", "last.ckpt"]


def test_a_read_only_output_folder_is_refused_before_the_model_loads(tmp_path, monkeypatch, capsys):
    def load_causal_lm(*args, **kwargs):
        raise AssertionError("the model was loaded")

    monkeypatch.setattr("lit_cancel.module.load_causal_lm", load_causal_lm)
    if os.geteuid() == 0:
        pytest.skip("root writes in a folder without write permission")
    read_only = tmp_path / "read-only"
    read_only.mkdir()
    read_only.chmod(0o555)
    save_dir = read_only / "runs"
    code, lines = console(monkeypatch, capsys, "fit", "--config", str(write_config(tmp_path)), f"--trainer.logger.init_args.save_dir={save_dir}")
    assert code == 2
    assert lines[-1] == f"error: trainer.logger.init_args.save_dir: cannot write in {save_dir} (Permission denied: {read_only})"


@pytest.mark.parametrize("kernel, file_system", [("/proc", "proc"), ("/sys", "sysfs")])
def test_an_output_folder_on_a_kernel_file_system_is_refused_as_such(tmp_path, monkeypatch, capsys, kernel, file_system):
    if f" {kernel} {file_system} " not in Path("/proc/self/mounts").read_text():
        pytest.skip(f"{kernel} is not a {file_system} file system here")
    monkeypatch.setattr("lit_cancel.module.load_causal_lm", lambda *args, **kwargs: pytest.fail("the model was loaded"))
    save_dir = Path(kernel) / "runs"
    code, lines = console(monkeypatch, capsys, "fit", "--config", str(write_config(tmp_path)), f"--trainer.logger.init_args.save_dir={save_dir}")
    assert (code, lines[-1]) == (2, f"error: trainer.logger.init_args.save_dir: cannot write in {save_dir} "
                                    f"(new files cannot be made on a {file_system} file system: {kernel})")


def scalar_steps(log_dir: Path, tag: str) -> list[int]:
    events = EventAccumulator(str(log_dir))
    events.Reload()
    return [event.step for event in events.Scalars(tag)]


def test_resume_and_validate_continue_the_run_folder_and_its_curves(tmp_path):
    config = str(write_config(tmp_path))
    run_cli(["fit", "--config", config])
    last = checkpoints(tmp_path) / "last.ckpt"
    resumed = run_cli(["fit", "--config", config, "--trainer.max_steps=4", f"--ckpt_path={last}"])
    assert resumed.trainer.logger.log_dir == str(tmp_path / "runs" / "tiny" / "version_0")
    run_cli(["validate", "--config", config, "--trainer.limit_val_batches=1", f"--ckpt_path={last}"])
    assert sorted(path.name for path in (tmp_path / "runs" / "tiny").iterdir()) == ["version_0"]
    assert saved_step(last) == 4
    assert scalar_steps(last.parents[1], "rollout/reward_mean") == [0, 1, 2, 3]
    assert scalar_steps(last.parents[1], "val/accuracy") == [4]  # at the checkpoint's step, on the run's curve


def test_ckpt_path_last_resumes_the_latest_run_of_the_config(tmp_path, monkeypatch, capsys):
    config = str(write_config(tmp_path))
    code, lines = console(monkeypatch, capsys, "fit", "--config", config, "--ckpt_path=last")
    assert code == 2
    assert lines[-1] == f"error: --ckpt_path last: no earlier run of this config to resume (no checkpoint in {tmp_path / 'runs' / 'tiny' / '*' / 'checkpoints'})"
    run_cli(["fit", "--config", config])
    run_cli(["fit", "--config", config, "--trainer.max_steps=1"])  # version_1, the newest
    resumed = run_cli(["fit", "--config", config, "--trainer.max_steps=3", "--ckpt_path=last"])
    assert resumed.trainer.ckpt_path == str(checkpoints(tmp_path, version=1) / "last.ckpt")
    assert saved_step(checkpoints(tmp_path, version=1) / "last.ckpt") == 3
    assert sorted(path.name for path in (tmp_path / "runs" / "tiny").iterdir()) == ["version_0", "version_1"]


@pytest.mark.parametrize("last_ckpt", ["lost in its first write", "older"])
def test_ckpt_path_last_takes_the_newest_whole_checkpoint_when_last_ckpt_is_missing_or_older(tmp_path, caplog, last_ckpt):
    config = str(write_config(tmp_path))
    run_cli(["fit", "--config", config])
    folder = checkpoints(tmp_path)
    if last_ckpt == "older":  # killed while it wrote last.ckpt at step 2: the step-1 one is kept
        older = (folder / "epoch=0-step=2.ckpt").stat().st_mtime - 60
        os.utime(folder / "last.ckpt", (older, older))
        expected = f"which is newer than {folder / 'last.ckpt'}"
    else:  # what kill -9 leaves during the first write of last.ckpt: its temporary file
        (folder / "last.ckpt").rename(folder / f".last.ckpt.999999@{_host()}.abcdefgh.tmp")
        expected = "(no last.ckpt)"
    resumed = run_cli(["fit", "--config", config, "--trainer.max_steps=3", "--ckpt_path=last"])
    assert resumed.trainer.ckpt_path == str(folder / "epoch=0-step=2.ckpt")
    assert saved_step(folder / "last.ckpt") == 3
    assert f"--ckpt_path last: resuming {folder / 'epoch=0-step=2.ckpt'}, the newest whole checkpoint of this config's runs" in caplog.text
    assert expected in caplog.text


def lock_is_held(folder: Path) -> bool:
    """Whether a process other than this open file holds the lock of a run folder."""
    descriptor = os.open(folder / LOCK_FILE, os.O_RDWR)
    try:
        fcntl.flock(descriptor, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        return True
    finally:
        os.close(descriptor)
    return False


class RecordsTheRunFolderLock(L.Callback):
    held: list[tuple[bool, str]] = []

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
        folder = Path(trainer.logger.log_dir)
        RecordsTheRunFolderLock.held.append((lock_is_held(folder), (folder / LOCK_FILE).read_text()))


def test_a_fit_holds_its_run_folder_and_a_second_resume_of_it_is_refused(tmp_path, monkeypatch, capsys):
    config = str(write_config(tmp_path))
    RecordsTheRunFolderLock.held = []
    run_cli(["fit", "--config", config, "--trainer.callbacks+=test_run_safety.RecordsTheRunFolderLock"])
    folder, last = checkpoints(tmp_path).parent, checkpoints(tmp_path) / "last.ckpt"
    assert [held for held, _ in RecordsTheRunFolderLock.held] == [True, True]
    assert RecordsTheRunFolderLock.held[0][1].startswith(f"pid {os.getpid()} on {socket.gethostname()}, since ")
    assert not lock_is_held(folder)  # released when the run ended
    holder = subprocess.Popen(  # a run resumed from the same last.ckpt, still going
        [sys.executable, "-c", "import fcntl, os, sys, time; d = os.open(sys.argv[1], os.O_RDWR); fcntl.flock(d, fcntl.LOCK_EX); "
         "os.ftruncate(d, 0); os.write(d, b'pid 4242 on elsewhere, since 2026-01-02 03:04:05'); print('held', flush=True); time.sleep(120)",
         str(folder / LOCK_FILE)], stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout.readline() == "held\n"
        code, lines = console(monkeypatch, capsys, "fit", "--config", config, "--trainer.max_steps=3", f"--ckpt_path={last}")
        assert (code, lines[-1]) == (2, f"error: trainer.logger.init_args.version: {folder} is in use by a run that is still going (pid 4242 "
                                        "on elsewhere, since 2026-01-02 03:04:05); let it finish or stop it, or start a new run (without "
                                        "--ckpt_path) in a folder of its own")
        assert saved_step(last) == 2
    finally:
        holder.kill()
        holder.wait()
    run_cli(["fit", "--config", config, "--trainer.max_steps=3", f"--ckpt_path={last}"])  # the lock went with its process
    assert saved_step(last) == 3


@pytest.mark.parametrize("shared", ["version", "dirpath"])
def test_a_new_run_in_a_folder_that_holds_one_is_refused_unless_overwrite(tmp_path, monkeypatch, capsys, shared):
    fixed = {"dirpath": str(tmp_path / "fixed")} if shared == "dirpath" else {}
    config = str(write_config(tmp_path, **fixed))
    args = ["fit", "--config", config, "--trainer.logger.init_args.version=0"] if shared == "version" else ["fit", "--config", config]
    run_cli(args)
    folder = tmp_path / "fixed" if shared == "dirpath" else checkpoints(tmp_path)
    option = "trainer.callbacks[0].init_args.dirpath" if shared == "dirpath" else "trainer.logger.init_args.version"
    code, lines = console(monkeypatch, capsys, *args, "--trainer.max_steps=3")
    assert code == 2
    assert lines[-1] == (f"error: {option}: {folder} already holds a run (last.ckpt); resume it with --ckpt_path {folder / 'last.ckpt'}, "
                         "or start over in it with --overwrite true")
    assert saved_step(folder / "last.ckpt") == 2
    run_cli([*args, "--trainer.max_steps=3", "--overwrite=true"])
    assert saved_step(folder / "last.ckpt") == 3
    assert "last-v1.ckpt" not in {path.name for path in folder.iterdir()}


def test_runs_that_list_the_folder_at_the_same_time_reserve_a_version_each(tmp_path, monkeypatch):
    runs = tmp_path / "runs" / "tiny"
    (runs / "version_3").mkdir(parents=True)
    assert reserve_version(runs) == 4
    monkeypatch.setattr(Path, "iterdir", lambda self: iter([]))  # each finds the folder as it was before any reserved
    start = threading.Barrier(8)

    def reserve() -> int:
        start.wait()
        return reserve_version(runs)

    with ThreadPoolExecutor(8) as pool:
        versions = list(pool.map(lambda _: reserve(), range(8)))
    assert sorted(versions) == [0, 1, 2, 5, 6, 7, 8, 9]  # 3 and 4 were taken


def test_a_fit_started_with_another_gets_its_own_version_folder(tmp_path, monkeypatch):
    config = str(write_config(tmp_path, max_steps=1))
    first = run_cli(["fit", "--config", config])
    # a run started at the same time as the first finds no version folder yet, and Lightning would pick version 0
    monkeypatch.setattr(TensorBoardLogger, "_get_next_version", lambda self: 0)
    second = run_cli(["fit", "--config", config])
    assert [first.trainer.logger.log_dir, second.trainer.logger.log_dir] == [str(checkpoints(tmp_path, v).parent) for v in (0, 1)]
    for version in (0, 1):
        assert sorted(path.name for path in checkpoints(tmp_path, version).iterdir()) == ["epoch=0-step=1.ckpt", "last.ckpt"]
        assert len(list(checkpoints(tmp_path, version).parent.glob("events.out.tfevents.*"))) == 2  # validation, fit


def test_a_fit_refused_before_it_runs_leaves_no_version_folder(tmp_path, monkeypatch, capsys):
    code, lines = console(monkeypatch, capsys, "fit", "--config", str(write_config(tmp_path)), "--data.init_args.prompts_per_round=1000")
    assert code == 2 and "fewer than prompts_per_round=1000" in lines[-1]
    assert list((tmp_path / "runs" / "tiny").glob("version_*")) == []


def test_max_steps_0_is_refused_at_start_up(tmp_path, monkeypatch, capsys):
    code, lines = console(monkeypatch, capsys, "fit", "--config", str(write_config(tmp_path)), "--trainer.max_steps=0")
    assert (code, lines[-1]) == (2, "error: trainer.max_steps must be >= 1 (the optimizer steps to train), got 0")
    assert not (tmp_path / "runs").exists()


class CtrlCInTheFirstValidation(L.Callback):
    def on_validation_batch_start(self, trainer, pl_module, batch, batch_idx, dataloader_idx=0):
        raise KeyboardInterrupt


def test_a_run_stopped_before_its_first_step_leaves_no_folder_and_keeps_the_earlier_runs(tmp_path, monkeypatch, capsys):
    config = str(write_config(tmp_path, max_steps=1))
    stopped = ["fit", "--config", config, "--trainer.limit_val_batches=1.0", "--trainer.callbacks+=test_run_safety.CtrlCInTheFirstValidation"]
    nothing_to_resume = (130, "lit-cancel: stopped by Ctrl-C (SIGINT) during validate: nothing to resume")
    code, lines = console(monkeypatch, capsys, *stopped)
    assert (code, lines[-1]) == nothing_to_resume
    assert list(tmp_path.iterdir()) == [tmp_path / "tiny.yaml"]  # runs/tiny/version_0 and the folders made above it
    run_cli(["fit", "--config", config])
    earlier = sorted((tmp_path / "runs").rglob("*"))
    assert checkpoints(tmp_path) / "last.ckpt" in earlier
    code, lines = console(monkeypatch, capsys, *stopped)  # in version_1, beside the earlier run
    assert (code, lines[-1]) == nothing_to_resume
    assert sorted((tmp_path / "runs").rglob("*")) == earlier


def test_only_the_first_process_of_a_run_reserves_its_version_and_the_others_take_it(tmp_path, monkeypatch):
    def config() -> Namespace:
        logger = Namespace(class_path="lightning.pytorch.loggers.TensorBoardLogger",
                           init_args=Namespace(save_dir=str(tmp_path / "runs"), name="tiny", version=None))
        return Namespace(trainer=Namespace(logger=logger, callbacks=[]))

    (tmp_path / "runs" / "tiny" / "version_0").mkdir(parents=True)
    monkeypatch.delenv("LIT_CANCEL_RUN_FOLDER", raising=False)
    first, other, started_otherwise = config(), config(), config()
    monkeypatch.setenv("LOCAL_RANK", "1")  # as Lightning, torchrun and Slurm start the processes of the other ranks
    assert reserve_logger_version(started_otherwise) == [] and started_otherwise.trainer.logger.init_args.version is None
    monkeypatch.setenv("LOCAL_RANK", "0")
    assert reserve_logger_version(first) == [tmp_path / "runs" / "tiny" / "version_1"]  # the folders above it were there
    monkeypatch.setenv("LOCAL_RANK", "1")  # Lightning starts them with the first process's environment
    assert reserve_logger_version(other) == [] and other.trainer.logger.init_args.version == 1
    # the first process of a second node, started there by hand (as Lightning's docs for a cluster say), without the
    # first process's environment
    monkeypatch.setenv("LOCAL_RANK", "0")
    monkeypatch.setenv("NODE_RANK", "1")
    monkeypatch.delenv("LIT_CANCEL_RUN_FOLDER")
    other_node = config()
    assert reserve_logger_version(other_node) == [] and other_node.trainer.logger.init_args.version is None
    assert sorted(path.name for path in (tmp_path / "runs" / "tiny").iterdir()) == ["version_0", "version_1"]


def test_a_run_of_a_folder_stops_the_server_an_earlier_run_of_it_launched_and_left_running_and_says_so(tmp_path, monkeypatch, caplog):
    folder = tmp_path / "runs" / "tiny" / "version_0"
    folder.mkdir(parents=True)
    # a server with a child in its group (vLLM's engine core), printing once it started the child
    command = [sys.executable, "-c", "import subprocess, sys, time; subprocess.Popen([sys.executable, '-c', 'import time; "
               "time.sleep(300)']); print('started', flush=True); time.sleep(300)"]
    servers = {}
    for run in (folder, tmp_path / "runs" / "tiny" / "version_1"):  # one launched by a run of this folder, one by another's
        monkeypatch.setenv(RUN_FOLDER_VARIABLE, str(run.resolve()))
        servers[run] = start_server(command, None, str(tmp_path / f"{run.name}.log"))
    monkeypatch.delenv(RUN_FOLDER_VARIABLE)
    left, other = servers.values()
    watchdog = server_process._watchdogs.pop(left.pid)  # killed with its trainer: nothing stopped the server
    watchdog.kill()
    watchdog.wait()
    logger = Namespace(class_path="lightning.pytorch.loggers.TensorBoardLogger",
                       init_args=Namespace(save_dir=str(tmp_path / "runs"), name="tiny", version=0))
    lock = RunFolderLock()
    try:
        deadline = time.monotonic() + 60
        while not all((tmp_path / f"{run.name}.log").read_text() == "started\n" for run in servers):
            assert time.monotonic() < deadline
            time.sleep(0.1)
        lock.take(Namespace(trainer=Namespace(logger=logger, callbacks=[])))
        assert not group_alive(left.pid) and group_alive(other.pid)
        assert (f"stopped a vLLM server that an earlier run of {folder} launched and left running (2 processes, process group "
                f"{left.pid})") in caplog.text
        assert os.environ[RUN_FOLDER_VARIABLE] == str(folder.resolve())  # the mark of the server this run may launch
    finally:
        lock.release()
        for server in servers.values():
            stop_server(server, grace=0)
    assert RUN_FOLDER_VARIABLE not in os.environ
