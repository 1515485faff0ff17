"""Resuming runs of 2 CPU processes (gloo): each process goes on with its own rollouts; a sharded checkpoint folder
is marked complete once every process has written its part, a folder without the mark is refused, and a write that
fails or is killed leaves the previous ``last.ckpt`` as it was."""

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from torch.distributed.checkpoint.format_utils import dcp_to_torch_save, torch_save_to_dcp

from lit_cancel import AdditionTask, RLModule, RolloutDataModule
from lit_cancel.batch import RolloutBatch
from lit_cancel.run import export
from lit_cancel.run.checkpointing import COMPLETE_MARKER, _host, complete_folder, remove_abandoned_temporary_files
from lit_cancel.run.checks import check_checkpoint
from lit_cancel.run.cli import run_cli
from lit_cancel.run.errors import ConfigError

SCRIPT = Path(__file__).parents[1] / "workers" / "resume_ranks.py"
CONFIG = Path(__file__).parents[2] / "configs" / "quickstart.yaml"
SHARDED_CONFIG = CONFIG.with_name("quickstart-fsdp2-cpu.yaml")


def run(strategy: str, folder: Path, max_steps: int, *extra: str, check: bool = True) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, str(SCRIPT), strategy, str(folder), str(max_steps), *extra],
                          check=check, capture_output=True, text=True, timeout=300)


def saved(checkpoint: Path) -> dict:
    """What a checkpoint holds besides the weights: a file, or a sharded folder's meta.pt."""
    return torch.load(checkpoint / "meta.pt" if checkpoint.is_dir() else checkpoint, weights_only=False)


def contents(folder: Path) -> dict[str, bytes]:
    return {path.name: path.read_bytes() for path in folder.iterdir()}


@pytest.mark.slow
@pytest.mark.parametrize("strategy", ["ddp", "fsdp2"])
def test_each_process_resumed_mid_round_trains_on_the_rollouts_of_an_uninterrupted_run(tmp_path, strategy):
    run(strategy, tmp_path / "straight", 4)
    run(strategy, tmp_path / "stopped", 1)
    checkpoint = tmp_path / "stopped" / "checkpoints" / "last.ckpt"
    # a round is 2 steps of 2 micro-batches per process: at step 1 each process has its second step's 2 unspent
    assert [len(own["pending"]) for own in saved(checkpoint)["RolloutDataModule"]["processes"]] == [2, 2]
    run(strategy, tmp_path / "stopped", 4, f"--ckpt_path={checkpoint}")
    straight = [torch.load(tmp_path / "straight" / f"seen-4-rank{rank}.pt") for rank in (0, 1)]
    assert straight[0] != straight[1]  # each process trains on its own rollouts
    for rank in (0, 1):
        assert [step for step, _ in straight[rank]] == [0, 0, 1, 1, 2, 2, 3, 3]
        stopped = torch.load(tmp_path / "stopped" / f"seen-1-rank{rank}.pt")
        resumed = torch.load(tmp_path / "stopped" / f"seen-4-rank{rank}.pt")
        assert stopped + resumed == straight[rank], rank  # the same micro-batches in the same order: none twice, none lost


@pytest.mark.slow
def test_a_sharded_write_that_fails_or_is_killed_leaves_the_previous_last_ckpt_whole(tmp_path):
    run("fsdp2", tmp_path, 1)
    folder = tmp_path / "checkpoints"
    last = folder / "last.ckpt"
    before = contents(last)
    assert COMPLETE_MARKER in before and saved(last)["global_step"] == 1

    # process 1's disk fills once its shard is written: every process stops, and says so
    full = run("fsdp2", tmp_path, 2, f"--ckpt_path={last}", "--fail_writing_last=full_disk", check=False)
    assert full.returncode != 0
    assert (f"could not write a checkpoint in {folder}: [Errno 28] No space left on device; stopped at step 2, "
            f"last good checkpoint: {folder / 'epoch=0-step=2.ckpt'} (step 2)") in full.stderr
    assert contents(last) == before
    assert sorted(path.name for path in folder.iterdir()) == ["epoch=0-step=2.ckpt", "last.ckpt"]  # no temporary folder

    # process 1 dies once its shard is written; Lightning kills process 0 (without the temporary folder, the shards
    # would have been written over the previous last.ckpt, beside its .metadata and meta.pt)
    killed = run("fsdp2", tmp_path, 2, f"--ckpt_path={last}", "--fail_writing_last=kill", check=False)
    assert killed.returncode != 0
    assert contents(last) == before
    check_checkpoint(str(last), lora=False)
    dcp_to_torch_save(last, tmp_path / "gathered.ckpt")  # the shards load
    assert torch.load(tmp_path / "gathered.ckpt", weights_only=False)["state_dict"].keys() == RLModule().state_dict().keys()


def sharded_folder(tmp_path: Path) -> Path:
    torch.save({"state_dict": RLModule().state_dict()}, tmp_path / "whole.ckpt")
    torch_save_to_dcp(tmp_path / "whole.ckpt", tmp_path / "last.ckpt")  # the layout of a sharded save
    return tmp_path / "last.ckpt"


def test_a_sharded_folder_without_its_marker_is_refused_at_start_up_in_one_line(tmp_path, lit_cancel_script):
    folder = sharded_folder(tmp_path)
    expected = (f"{folder} is an incomplete sharded checkpoint: it has no COMPLETE file, which is written once every process "
                f"has written its part (the run stopped while writing it); resume from another checkpoint, or, if you know "
                f"the folder is whole (written before checkpoints were marked complete), create {folder / 'COMPLETE'}")
    refused = subprocess.run([lit_cancel_script, "fit", "--config", str(SHARDED_CONFIG), f"--ckpt_path={folder}",
                              f"--trainer.logger.init_args.save_dir={tmp_path / 'runs'}"], capture_output=True, text=True, timeout=300)
    assert refused.returncode == 2
    assert refused.stderr.splitlines()[-1] == f"error: {expected}"
    with pytest.raises(ConfigError) as refused_export:
        export.main(["--config", str(SHARDED_CONFIG), f"--ckpt_path={folder}", f"--output_dir={tmp_path / 'hf'}"])
    assert str(refused_export.value) == expected
    (folder / COMPLETE_MARKER).touch()  # marked by whoever knows it is whole
    check_checkpoint(str(folder), lora=False)


def test_a_completed_folder_replaces_the_previous_checkpoint_only_once_it_is_in_place(tmp_path, monkeypatch):
    previous, new = tmp_path / "last.ckpt", tmp_path / ".last.ckpt.1@host.abcd1234.tmp"
    for folder, step in ((previous, 1), (new, 2)):
        folder.mkdir()
        torch.save({"global_step": step}, folder / "meta.pt")
    complete_folder(new, previous, step=2)
    assert sorted(path.name for path in tmp_path.iterdir()) == ["last.ckpt"]  # the previous one set aside, then removed
    assert saved(previous)["global_step"] == 2 and (previous / COMPLETE_MARKER).is_file()

    # a rename that fails puts the previous checkpoint back
    (tmp_path / "again").mkdir()
    torch.save({"global_step": 3}, tmp_path / "again" / "meta.pt")
    rename = os.rename

    def rename_fails_into_place(source, target):
        if Path(source).name == "again":
            raise OSError(28, "No space left on device")
        rename(source, target)

    monkeypatch.setattr(os, "rename", rename_fails_into_place)
    with pytest.raises(OSError):
        complete_folder(tmp_path / "again", previous, step=3)
    assert saved(previous)["global_step"] == 2 and (previous / COMPLETE_MARKER).is_file()


def test_temporary_folders_of_dead_writers_are_removed_unless_marked_complete(tmp_path):
    finished = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True)
    dead, host = int(finished.stdout), _host()
    names = {"unfinished": f".last.ckpt.{dead}@{host}.abcd1234.tmp", "complete": f".last.ckpt.{dead}@{host}.efgh5678.tmp",
             "live": f".last.ckpt.{os.getpid()}@{host}.abcd1234.tmp"}
    for name in names.values():
        (tmp_path / name).mkdir()
        (tmp_path / name / "__0_0.distcp").write_bytes(b"shard")
    (tmp_path / names["complete"] / COMPLETE_MARKER).touch()  # killed between marking it and renaming it
    assert remove_abandoned_temporary_files(tmp_path) == [str(tmp_path / names["unfinished"])]
    assert sorted(path.name for path in tmp_path.iterdir()) == sorted([names["complete"], names["live"]])


def batch(rows: int) -> dict:
    """The saved state of a micro-batch of ``rows`` rollouts."""
    return RolloutBatch(
        input_ids=torch.ones(rows, 3, dtype=torch.long), attention_mask=torch.ones(rows, 3, dtype=torch.long),
        completion_mask=torch.ones(rows, 2, dtype=torch.long), prompt_length=1, rewards=torch.zeros(rows),
        advantages=torch.zeros(rows), group_ids=torch.zeros(rows, dtype=torch.long), step_sequences=rows, step_tokens=2 * rows,
    ).to_state()


def test_unspent_rollouts_of_another_number_of_processes_are_refused_naming_both_counts():
    data = RolloutDataModule(AdditionTask(num_digits=2, train_size=100, val_size=5), group_size=2)
    two = {"run_shape": {}, "rounds_done": 3, "prompt_draws": 3,
           "processes": [{"pending": [batch(2)], "waiting": None}, {"pending": [batch(4)], "waiting": None}]}
    with pytest.raises(ValueError, match=r"^the checkpoint holds the unspent rollouts of 2 processes in the middle of a round "
                                         r"and this run has 1: resume on 2 \(trainer.devices x trainer.num_nodes\)"):
        data.load_state_dict(two)
    # at the end of a round nothing is unspent: the counters go on on any number of processes
    data.load_state_dict(two | {"processes": [{"pending": [], "waiting": None}] * 2})
    assert (data.rounds_done, data.pending, data.waiting) == (3, [], None)
    # a checkpoint written before the state was kept per process holds one process's
    data.load_state_dict({"run_shape": {}, "rounds_done": 4, "prompt_draws": 5, "pending": [batch(2)], "waiting": batch(1)})
    assert (data.rounds_done, len(data.pending[0]), len(data.waiting)) == (4, 2, 1)


def test_a_resume_on_another_number_of_processes_mid_round_is_refused_at_start_up(tmp_path):
    """A one-process checkpoint with rollouts unspent, resumed on 2 processes: refused before they start."""
    rollouts = {"run_shape": {}, "rounds_done": 1, "prompt_draws": 1, "processes": [{"pending": [batch(2)], "waiting": None}]}
    torch.save({"state_dict": RLModule().state_dict(), "global_step": 1, "RolloutDataModule": rollouts}, tmp_path / "step1.ckpt")
    with pytest.raises(ConfigError, match=r"^the checkpoint holds the unspent rollouts of 1 process in the middle of a round "
                                          r"and this run has 2: resume on 1 "):
        run_cli(["fit", "--config", str(CONFIG), f"--trainer.logger.init_args.save_dir={tmp_path}",
                 "--trainer.devices=2", "--trainer.strategy=ddp", f"--ckpt_path={tmp_path / 'step1.ckpt'}"])
