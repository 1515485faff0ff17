"""Two processes over gloo fit with ``compile: auto`` and ``activation_checkpointing: auto``, process 1 measuring
its own answers as the opposite of process 0's; saves each process's choices (run by test_activation_checkpointing.py).

    python tests/workers/auto_choices.py OUT

Writes ``OUT-rank0.pt`` and ``OUT-rank1.pt``: the module's choices when training starts, the checkpointing that
process 0 measured, and whether each process's decoder is compiled and its blocks are checkpointed.
"""

import argparse
import os

import lightning as L
import torch
from lightning.pytorch.strategies import DDPStrategy

import lit_cancel.module
from lit_cancel import AdditionTask, RLModule, RolloutDataModule
from lit_cancel.activation_checkpointing import MODES, CheckpointingChoice
from lit_cancel.compile_choice import CompileChoice

RANK = int(os.environ.get("LOCAL_RANK", 0))
measured_on_rank0 = []


def disagreeing_checkpointing(module, trainer, *shape_and_facts):
    """Process 0's own measurement; on process 1 a mode other than the one process 0 measures."""
    choice = real_checkpointing(module, trainer, *shape_and_facts)
    if RANK == 0:
        measured_on_rank0.append(choice.mode)
        return choice
    return CheckpointingChoice(next(mode for mode in MODES if mode != choice.mode), "process 1's own measurement")


def disagreeing_compile(module, trainer):
    return CompileChoice(RANK == 1, f"process {RANK}'s own measurement")


real_checkpointing = lit_cancel.module.auto_checkpointing
lit_cancel.module.auto_checkpointing = disagreeing_checkpointing
lit_cancel.module.auto_compile = disagreeing_compile


class Choices(L.Callback):
    def on_train_start(self, trainer, pl_module):
        model = pl_module.policy.model
        self.seen = {
            "compile": pl_module.compile,
            "activation_checkpointing": pl_module.activation_checkpointing,
            "recompute_chunks": pl_module.recompute_chunks,
            "blocks_checkpointed": model.is_activation_checkpointing,
            "decoder_compiled": getattr(model.get_decoder(), "_compiled_call_impl", None) is not None,
        }


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("out")
    args = parser.parse_args()
    module = RLModule("embedded:tiny-adder", compile="auto", activation_checkpointing="auto", max_new_tokens=8)
    data = RolloutDataModule(AdditionTask(num_digits=3, train_size=32, val_size=4), prompts_per_round=4, group_size=2)
    choices = Choices()
    trainer = L.Trainer(
        max_steps=1, accelerator="cpu", devices=2, strategy=DDPStrategy(process_group_backend="gloo"), logger=False,
        enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False, limit_val_batches=0,
        callbacks=[choices],
    )
    trainer.fit(module, datamodule=data)
    torch.save({**choices.seen, "measured_on_rank0": measured_on_rank0}, f"{args.out}-rank{RANK}.pt")


if __name__ == "__main__":
    main()
