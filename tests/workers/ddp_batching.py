"""Two optimizer steps under 2-process DDP; each process saves what its micro-batches held (run by test_batching_ddp.py).

    python tests/workers/ddp_batching.py OUT_PREFIX
"""

import sys
from functools import partial

import lightning as L
import torch

from lit_cancel import AdditionTask, RLModule, RolloutDataModule, Shuffled


class Record(L.Callback):
    def __init__(self):
        self.seen = []

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
        self.seen.append({
            "group_ids": batch.group_ids.tolist(),
            "tokens": int(batch.completion_mask.sum()),
            "step_tokens": batch.step_tokens,
            "step_sequences": batch.step_sequences,
            "rows": len(batch),
        })


def main(prefix: str) -> None:
    record = Record()
    module = RLModule("embedded:tiny-adder", max_new_tokens=40, optimizer=partial(torch.optim.AdamW, lr=1e-4))
    data = RolloutDataModule(AdditionTask(num_digits=3, train_size=64, val_size=4), prompts_per_round=8, group_size=4,
                             mini_batches_per_round=2, plan=Shuffled(), dynamic_sampling=True, max_prompt_draws=3)
    trainer = L.Trainer(
        max_steps=2, accelerator="cpu", devices=2, strategy="ddp", accumulate_grad_batches=2, logger=False,
        enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False, limit_val_batches=0,
        callbacks=[record],
    )
    trainer.fit(module, datamodule=data)
    torch.save(record.seen, f"{prefix}-rank{trainer.global_rank}.pt")


if __name__ == "__main__":
    main(sys.argv[1])
