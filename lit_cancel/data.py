"""DataModules: held-out prompts for validation, and rollout rounds cut into mini-batches for RL."""

import time

import lightning as L
import torch
from torch.utils.data import DataLoader, IterableDataset

from lit_cancel.batch import RolloutBatch
from lit_cancel.hub import load_tokenizer
from lit_cancel.tasks import Record, Task


class RewardError(RuntimeError):
    """A task's reward function raised on a completion."""


class TaskDataModule(L.LightningDataModule):
    """A task's held-out prompts, tokenised, and the task's reward.

    Args:
        task: where prompts come from and how completions are rewarded.
        tokenizer_path: folder of the tokenizer; the CLI links it to ``model.init_args.model_path``.
        val_batch_size: held-out prompts per validation batch.
    """

    def __init__(self, task: Task, tokenizer_path: str = "embedded:tiny-adder", val_batch_size: int = 200):
        super().__init__()
        if val_batch_size < 1:
            raise ValueError(f"val_batch_size must be >= 1, got {val_batch_size}")
        self.task, self.tokenizer_path, self.val_batch_size = task, tokenizer_path, val_batch_size
        self.tokenizer = load_tokenizer(tokenizer_path)

    def encode_prompts(self, records: list[Record]) -> dict:
        """Left-padded prompt ids and mask of ``records``."""
        encoded = self.tokenizer([r["prompt"] for r in records], return_tensors="pt", padding=True)
        return {"input_ids": encoded["input_ids"], "attention_mask": encoded["attention_mask"], "records": records}

    def val_dataloader(self) -> DataLoader:
        return DataLoader(self.task.val_records(), batch_size=self.val_batch_size, collate_fn=self.encode_prompts)

    def score(self, records: list[Record], completions: list[str]) -> torch.Tensor:
        """Rewards of ``completions[i]`` for ``records[i]``; a reward function that raises is reported with its input."""
        rewards = []
        for record, completion in zip(records, completions, strict=True):
            try:
                rewards.append(float(self.task.reward(record, completion)))
            except Exception as error:
                raise RewardError(
                    f"{type(self.task).__name__}.reward raised {type(error).__name__}: {error} "
                    f"on prompt {record['prompt']!r} and completion {completion!r}"
                ) from error
        return torch.tensor(rewards)


class _NextMiniBatch:
    """Placeholder yielded by the train dataloader; the datamodule replaces it with a real mini-batch."""


class _Placeholders(IterableDataset):
    def __iter__(self):
        while True:
            yield _NextMiniBatch()


class RolloutDataModule(TaskDataModule):
    """Rollout rounds: prompts -> ``rollout()`` -> rewards -> group advantages -> mini-batches.

    A round draws ``prompts_per_round`` prompts (split evenly across processes), samples
    ``group_size`` completions of each with the LightningModule's ``rollout()``, scores them with
    the task's reward, computes advantages with the module's ``objective.advantages`` over each
    whole group, and cuts the round into ``mini_batches_per_round`` mini-batches of whole groups.
    Each mini-batch is one optimizer step, split into ``trainer.accumulate_grad_batches``
    micro-batches of whole groups; the next round is sampled when the last is spent.

    Lightning fetches one batch ahead of the training step, so the train dataloader yields
    placeholders and the round is sampled in ``on_before_batch_transfer``, which runs after the
    previous optimizer step: rollouts always come from the current policy. The round counter and
    the unspent mini-batches are in ``state_dict``, so a resumed run neither repeats nor skips rollouts.

    Args:
        task: where prompts come from and how completions are rewarded.
        tokenizer_path: folder of the tokenizer; the CLI links it to ``model.init_args.model_path``.
        prompts_per_round: prompts per round, summed over processes.
        group_size: completions sampled per prompt (``G``), at least 2.
        mini_batches_per_round: optimizer steps per round; must divide the prompts per process.
        val_batch_size: held-out prompts per validation batch.
        seed: seed of the prompt order and of the sampling.
    """

    def __init__(
        self,
        task: Task,
        tokenizer_path: str = "embedded:tiny-adder",
        prompts_per_round: int = 16,
        group_size: int = 8,
        mini_batches_per_round: int = 1,
        val_batch_size: int = 200,
        seed: int = 0,
    ):
        super().__init__(task, tokenizer_path, val_batch_size)
        if group_size < 2:
            raise ValueError(
                f"group_size must be >= 2 (advantages compare the completions of one prompt), got {group_size}"
            )
        if prompts_per_round < 1 or mini_batches_per_round < 1:
            raise ValueError(
                f"prompts_per_round and mini_batches_per_round must be >= 1, got {prompts_per_round} and {mini_batches_per_round}"
            )
        if prompts_per_round % mini_batches_per_round:
            raise ValueError(
                f"mini_batches_per_round={mini_batches_per_round} must divide prompts_per_round={prompts_per_round} "
                "(each mini-batch holds whole groups)"
            )
        self.prompts_per_round, self.group_size = prompts_per_round, group_size
        self.mini_batches_per_round, self.seed = mini_batches_per_round, seed
        self.rounds_done = 0
        self.pending: list[RolloutBatch] = []

    def setup(self, stage: str) -> None:
        world = self.trainer.world_size if self.trainer is not None else 1
        accumulation = self.trainer.accumulate_grad_batches if self.trainer is not None else 1
        if self.prompts_per_round % (world * self.mini_batches_per_round * accumulation):
            raise ValueError(
                f"prompts_per_round={self.prompts_per_round} must be divisible by the number of processes ({world}) "
                f"times mini_batches_per_round ({self.mini_batches_per_round}) times trainer.accumulate_grad_batches "
                f"({accumulation}): every micro-batch holds whole groups"
            )
        if stage == "fit" and len(self.task.train_records()) < self.prompts_per_round:
            raise ValueError(
                f"the task has {len(self.task.train_records())} training prompts, fewer than prompts_per_round={self.prompts_per_round}"
            )

    def train_dataloader(self) -> DataLoader:
        return DataLoader(_Placeholders(), batch_size=None)

    def on_before_batch_transfer(self, batch, dataloader_idx: int):
        if not isinstance(batch, _NextMiniBatch):
            return batch
        if not self.pending:
            self.pending = self.make_round()
            self.rounds_done += 1
        return self.pending.pop(0)

    def round_records(self, round_index: int, rank: int, world: int) -> list[Record]:
        """The prompts of ``round_index`` for process ``rank``: consecutive slices of seeded permutations."""
        records = self.task.train_records()
        per_rank = self.prompts_per_round // world
        first = round_index * self.prompts_per_round + rank * per_rank
        picked = []
        for position in range(first, first + per_rank):
            epoch, index = divmod(position, len(records))
            order = torch.randperm(len(records), generator=torch.Generator().manual_seed(self.seed + epoch))
            picked.append(records[order[index]])
        return picked

    def make_round(self) -> list[RolloutBatch]:
        """Samples one round with the current policy and cuts it into mini-batches."""
        module, trainer = self.trainer.lightning_module, self.trainer
        records = self.round_records(self.rounds_done, trainer.global_rank, trainer.world_size)
        prompts = self.encode_prompts(records)
        started = time.perf_counter()
        with torch.random.fork_rng(devices=[module.device] if module.device.type == "cuda" else []):
            torch.manual_seed(hash((self.seed, self.rounds_done, trainer.global_rank)) % 2**63)
            generation = module.rollout(
                prompts["input_ids"].to(module.device), prompts["attention_mask"].to(module.device), self.group_size
            )
        elapsed = time.perf_counter() - started
        rewards = self.score([r for r in records for _ in range(self.group_size)], generation.texts)
        grouped = rewards.view(len(records), self.group_size)
        advantages = module.objective.advantages(grouped).reshape(-1)
        old_logprobs, ref_logprobs = module.score_rollouts(generation, with_old_logprobs=self.mini_batches_per_round > 1)
        lengths = generation.completion_mask.sum(1).float()
        device = generation.input_ids.device
        round_batch = RolloutBatch(
            input_ids=generation.input_ids,
            attention_mask=generation.attention_mask,
            completion_mask=generation.completion_mask,
            prompt_length=generation.prompt_length,
            rewards=rewards.to(device),
            advantages=advantages.to(device),
            group_ids=torch.arange(len(records), device=device).repeat_interleave(self.group_size)
            + trainer.global_rank * len(records),
            old_logprobs=old_logprobs,
            ref_logprobs=ref_logprobs,
        )
        stats = {
            "rollout/reward_mean": rewards.mean().item(),
            "rollout/accuracy": (rewards > 0).float().mean().item(),
            "rollout/completion_len": lengths.mean().item(),
            "rollout/frac_zero_std_groups": (grouped.std(dim=1) == 0).float().mean().item(),
            "perf/rollout_tokens_per_s": lengths.sum().item() / max(elapsed, 1e-9),
        }
        return self.plan(round_batch, stats)

    def plan(self, round_batch: RolloutBatch, stats: dict[str, float]) -> list[RolloutBatch]:
        """Cuts a round into optimizer steps of whole groups, in the round's (already random) prompt order.

        Each step is split into ``trainer.accumulate_grad_batches`` micro-batches of whole groups.
        ``step_sequences`` and ``step_tokens`` count the whole step over all processes, divided by
        the number of micro-batches that Lightning and DDP average over, so that normalising by
        them gives the same gradient however the step is split.
        """
        accumulation, world = self.trainer.accumulate_grad_batches, self.trainer.world_size
        device = round_batch.input_ids.device
        rows_per_step = len(round_batch) // self.mini_batches_per_round
        tokens = round_batch.completion_mask.view(self.mini_batches_per_round, -1).sum(1).float()
        tokens = self.trainer.strategy.reduce(tokens, reduce_op="sum")
        micro_rows = rows_per_step // accumulation
        batches = []
        for start in range(0, len(round_batch), micro_rows):
            batch = round_batch.select(torch.arange(start, start + micro_rows, device=device))
            batch.step_sequences = rows_per_step / accumulation
            batch.step_tokens = float(tokens[start // rows_per_step]) / (world * accumulation)
            batches.append(batch)
        batches[0].stats = stats
        return batches

    def state_dict(self) -> dict:
        return {"rounds_done": self.rounds_done, "pending": [b.to_state() for b in self.pending]}

    def load_state_dict(self, state_dict: dict) -> None:
        self.rounds_done = state_dict["rounds_done"]
        self.pending = [RolloutBatch.from_state(s) for s in state_dict["pending"]]
