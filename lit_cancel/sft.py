"""Supervised warm-up: teaches a policy the task's format from reference solutions.

This is how the embedded tiny model was made (``configs/sft-tiny.yaml``): a partly correct policy,
so that RL rollout groups have mixed rewards.
"""

import functools
import random

import torch
from torch import nn
from torch.utils.data import DataLoader, Dataset

from lit_cancel.data import TaskDataModule
from lit_cancel.module import PolicyModule
from lit_cancel.sharding import is_sharded
from lit_cancel.tasks import Record, Task


class _Solutions(Dataset):
    """``(record, turns)``: a reference solution as one turn, or an agent task's demonstration episode."""

    def __init__(self, task: Task, seed: int):
        self.records, self.task, self.seed = task.train_records(), task, seed

    def __len__(self) -> int:
        return len(self.records)

    def __getitem__(self, index: int) -> tuple[Record, list[tuple[str, str]]]:
        record, rng = self.records[index], random.Random(self.seed * 1_000_003 + index)
        return record, self.task.demonstration(record, rng)


class SFTDataModule(TaskDataModule):
    """Prompt + reference solution pairs; the loss covers the solution and its EOS, not the prompt. For an
    :class:`~lit_cancel.agents.AgentTask`, its demonstration episodes (:meth:`~lit_cancel.Task.demonstration`): the loss
    covers each turn and its EOS, not the environment's observations (nor the text an environment's ``reset`` adds to
    the prompt, a pair whose turn is empty).

    Args:
        task: where prompts and their solutions come from.
        batch_size: examples per optimizer step.
        val_batch_size: held-out prompts per validation batch.
        seed: seed of the order and of the choice among equivalent solutions.
    """

    def __init__(self, task: Task, batch_size: int = 64, val_batch_size: int = 200, seed: int = 0):
        super().__init__(task, val_batch_size)
        if batch_size < 1:
            raise ValueError(f"batch_size must be >= 1, got {batch_size}")
        self.batch_size, self.seed = batch_size, seed

    def collate(self, examples: list[tuple[Record, list[tuple[str, str]]]]) -> dict:
        encode = functools.partial(self.tokenizer, add_special_tokens=False)
        eos, pad = self.tokenizer.eos_token_id, self.tokenizer.pad_token_id
        sequences, trained = [], []
        for record, turns in examples:
            sequence = encode(record["prompt"])["input_ids"]
            mask = [False] * len(sequence)
            for turn, observation in turns:
                # an empty turn is the environment's text alone: what an environment's reset adds to the prompt
                turn_ids = encode(turn)["input_ids"] + [eos] if turn else []
                observation_ids = encode(observation)["input_ids"] if observation else []
                sequence += turn_ids + observation_ids
                mask += [True] * len(turn_ids) + [False] * len(observation_ids)
            sequences.append(sequence)
            trained.append(mask)
        width = max(map(len, sequences))
        input_ids = torch.full((len(sequences), width), pad)
        labels = torch.full((len(sequences), width), -100)
        attention_mask = torch.zeros((len(sequences), width), dtype=torch.long)
        for row, (sequence, mask) in enumerate(zip(sequences, trained)):
            ids = torch.tensor(sequence)
            input_ids[row, : len(sequence)] = ids
            labels[row, : len(sequence)] = ids.masked_fill(~torch.tensor(mask), -100)
            attention_mask[row, : len(sequence)] = 1
        return {"input_ids": input_ids, "attention_mask": attention_mask, "labels": labels}

    def train_dataloader(self) -> DataLoader:
        generator = torch.Generator().manual_seed(self.seed)
        return DataLoader(
            _Solutions(self.task, self.seed), batch_size=self.batch_size, shuffle=True, drop_last=True,
            generator=generator, collate_fn=self.collate,
        )


def _language_model_loss(model: nn.Module, batch: dict) -> torch.Tensor:
    return model(**batch).loss


class SFTModule(PolicyModule):
    """Next-token cross-entropy on reference solutions; saves the policy as a Hugging Face folder at the end.

    Args:
        output_dir: where ``save_pretrained`` writes the model and tokenizer when training ends; None skips it.
        **kwargs: see :class:`PolicyModule` (``from_scratch=True`` starts from random weights).
    """

    def __init__(self, model_path: str = "embedded:tiny-adder", output_dir: str | None = None, **kwargs):
        super().__init__(model_path, **kwargs)
        self.output_dir = output_dir

    def training_step(self, batch: dict, batch_idx: int) -> torch.Tensor:
        loss = self.policy(_language_model_loss, batch)
        self.log("loss/sft", loss, prog_bar=True)
        return loss

    def on_fit_start(self) -> None:
        if self.output_dir is not None and is_sharded(self.policy):
            raise ValueError(
                "SFTModule: output_dir saves the whole policy at the end, but it is sharded; set output_dir: null "
                "and export the last checkpoint with lit-cancel export"
            )

    def on_train_end(self) -> None:
        if self.output_dir is not None and self.trainer.is_global_zero:
            self.export(self.output_dir)
