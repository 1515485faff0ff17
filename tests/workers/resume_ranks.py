"""A 2-process run that records, per process, the rollouts of every micro-batch it trains on (run by test_sharded_resume.py).

    python tests/workers/resume_ranks.py {ddp,fsdp2} FOLDER MAX_STEPS [--ckpt_path PATH] [--fail_writing_last {kill,full_disk}]

``fsdp2`` is ModelParallelStrategy writing sharded checkpoint folders. Checkpoints go to FOLDER/checkpoints; process r
writes FOLDER/seen-MAX_STEPS-rank{r}.pt: a list of (optimizer step, the micro-batch's input_ids). With
``--fail_writing_last``, once process 1 has written its shard of ``last.ckpt`` (before the checkpoint's metadata):
``kill``: it dies (``os._exit``), and Lightning kills process 0; ``full_disk``: it raises ENOSPC.
"""

import argparse
import os
from functools import partial
from pathlib import Path

import lightning as L
import torch
import torch.distributed as dist
from lightning.pytorch.strategies import ModelParallelStrategy
from torch.distributed.checkpoint import FileSystemWriter

from lit_cancel import AdditionTask, RewardBalanced, RLModule, RolloutDataModule, RunCheckpoint


class RecordRollouts(L.Callback):
    def __init__(self):
        self.seen = []

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
        self.seen.append((trainer.global_step, batch.input_ids.tolist()))


def fail_writing_last(how: str) -> None:
    write_data = FileSystemWriter.write_data

    def write_then_fail(self, plan, planner):
        written = write_data(self, plan, planner)
        if "last.ckpt" in str(self.path) and dist.get_rank() == 1:
            if how == "kill":
                os._exit(1)
            raise OSError(28, "No space left on device")
        return written

    FileSystemWriter.write_data = write_then_fail


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("strategy", choices=["ddp", "fsdp2"])
    parser.add_argument("folder", type=Path)
    parser.add_argument("max_steps", type=int)
    parser.add_argument("--ckpt_path")
    parser.add_argument("--fail_writing_last", choices=["kill", "full_disk"])
    args = parser.parse_args()
    if args.fail_writing_last:
        fail_writing_last(args.fail_writing_last)
    record = RecordRollouts()
    module = RLModule("embedded:tiny-adder", max_new_tokens=40, optimizer=partial(torch.optim.AdamW, lr=1e-3))
    # a round: 2 steps of 2 micro-batches per process; RewardBalanced carries rollouts from round to round
    data = RolloutDataModule(AdditionTask(num_digits=3, train_size=64, val_size=4), prompts_per_round=8, group_size=4,
                             mini_batches_per_round=2, plan=RewardBalanced(0.5, max_wait_rounds=2), seed=3)
    sharded = ModelParallelStrategy(data_parallel_size=2, tensor_parallel_size=1, save_distributed_checkpoint=True)
    trainer = L.Trainer(
        max_steps=args.max_steps, accelerator="cpu", devices=2, strategy=sharded if args.strategy == "fsdp2" else "ddp",
        accumulate_grad_batches=2, logger=False, enable_progress_bar=False, enable_model_summary=False, limit_val_batches=0,
        callbacks=[record, RunCheckpoint(dirpath=args.folder / "checkpoints")],
    )
    trainer.fit(module, datamodule=data, ckpt_path=args.ckpt_path)
    torch.save(record.seen, args.folder / f"seen-{args.max_steps}-rank{trainer.global_rank}.pt")


if __name__ == "__main__":
    main()
