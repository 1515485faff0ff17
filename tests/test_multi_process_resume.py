"""Resuming runs of 2 CPU processes (gloo): each process goes on with its own rollouts."""

import subprocess
import sys
from pathlib import Path

import pytest
import torch

from lit_cancel import AdditionTask, RLModule, RolloutDataModule
from lit_cancel.batch import RolloutBatch
from lit_cancel.cli import ConfigError, run_cli

SCRIPT = Path(__file__).parent / "resume_ranks.py"
CONFIG = Path(__file__).parents[1] / "configs" / "quickstart.yaml"


def run(strategy: str, folder: Path, max_steps: int, *extra: str, check: bool = True) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, str(SCRIPT), strategy, str(folder), str(max_steps), *extra],
                          check=check, capture_output=True, text=True, timeout=300)


def saved(checkpoint: Path) -> dict:
    """What a checkpoint holds besides the weights: a file, or a sharded folder's meta.pt."""
    return torch.load(checkpoint / "meta.pt" if checkpoint.is_dir() else checkpoint, weights_only=False)


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
