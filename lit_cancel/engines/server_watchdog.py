"""A server's process group, stopped as a whole, and the watchdog that stops it once the trainer that started it is gone.

:func:`~lit_cancel.engines.server_process.start_server` starts a watchdog beside each server, as::

    python -I server_watchdog.py TRAINER_PID GROUP GRACE [FOLDER]

A trainer killed with SIGKILL (by the OOM killer, or a scheduler's hard kill) cannot stop its server, and a vLLM server's
processes (its API process, engine core and workers, in a process group of their own) outlive it. The watchdog is the
trainer's child in a session of its own, so a signal to the trainer's process group does not reach it. Twice a second it
checks that its parent is still the trainer (a process whose parent ended has another one; a thread of the trainer that
ends changes nothing); once it is not, it stops every process of the server's group ``GROUP`` (SIGTERM, then SIGKILL to
those left after ``GRACE`` seconds) and removes ``FOLDER``, the server's own temporary folder. It ends by itself once the
group has no process left. It imports the standard library only: it starts in a moment and holds a few MB.
"""

import contextlib
import os
import shutil
import signal
import sys
import time
from collections.abc import Callable
from pathlib import Path

# how often the watchdog checks that the trainer is there
CHECK_EVERY = 0.5
# a killed process ends when it is next scheduled, not when kill() returns: on a busy CPU that takes a moment
_SECONDS_TO_DIE_OF_SIGKILL = 10.0


def group_alive(group: int) -> bool:
    """Whether a process of the process group ``group`` runs (zombies waiting to be reaped do not count)."""
    for stat in Path("/proc").glob("[0-9]*/stat"):
        with contextlib.suppress(OSError, IndexError, ValueError):
            fields = stat.read_text().rpartition(")")[2].split()  # after the command's name, which may hold spaces
            if int(fields[2]) == group and fields[0] != "Z":
                return True
    return False


def signal_group(group: int, signal_number: int) -> None:
    with contextlib.suppress(ProcessLookupError):
        os.killpg(group, signal_number)


def stop_group(group: int, grace: float, running: Callable[[], bool] = lambda: False) -> None:
    """Stops every process of the process group ``group``: SIGTERM, then SIGKILL to those left after ``grace`` seconds.
    Returns once none runs and ``running()`` is false (or SIGKILL was given time to work)."""
    signal_group(group, signal.SIGTERM)
    if not _wait_until_stopped(group, grace, running):
        signal_group(group, signal.SIGKILL)
        _wait_until_stopped(group, _SECONDS_TO_DIE_OF_SIGKILL, running)


def _wait_until_stopped(group: int, seconds: float, running: Callable[[], bool]) -> bool:
    """Whether every process of ``group`` ended, and ``running()`` became false, within ``seconds``."""
    deadline = time.monotonic() + seconds
    while running() or group_alive(group):
        if time.monotonic() > deadline:
            return False
        time.sleep(0.1)
    return True


def _group_exists(group: int) -> bool:
    """Whether the process group ``group`` has a process, zombies included (a cheaper test than :func:`group_alive`)."""
    try:
        os.killpg(group, 0)
    except ProcessLookupError:
        return False
    return True


def watch(trainer: int, group: int, grace: float, folder: str | None) -> None:
    """Waits until the trainer is gone, then stops the server's group and removes its folder (see the module)."""
    while os.getppid() == trainer:
        if not _group_exists(group):
            return
        time.sleep(CHECK_EVERY)
    print(f"lit-cancel's watchdog: the trainer (pid {trainer}) is gone; stopping its server (process group {group})",
          file=sys.stderr, flush=True)
    stop_group(group, grace)
    if folder:
        shutil.rmtree(folder, ignore_errors=True)


if __name__ == "__main__":
    watch(int(sys.argv[1]), int(sys.argv[2]), float(sys.argv[3]), sys.argv[4] if len(sys.argv) > 4 else None)
