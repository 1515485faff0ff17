"""Optimizer steps on fixed rollouts; saves the first step's gradient and the parameters at the end
(run by test_splitting.py and test_sharding.py).

    python tests/workers/split_step.py OUT.pt --devices 2 --strategy fsdp2 --steps 3 --objectives GRPO DAPO

With ``--devices 2`` Lightning's launcher starts a second process running this script; ``ddp``
replicates the model, ``fsdp2`` shards it with ``ModelParallelStrategy``. The rollouts depend only
on the prompt, so every way of splitting the round sees the same data.
"""

import argparse
import functools
import os

import lightning as L
import torch
from lightning.pytorch.strategies import ModelParallelStrategy
from torch.distributed.tensor import DTensor

from lit_cancel import PRESETS, AdditionTask, Generation, RLModule, RolloutDataModule
from lit_cancel.rounds.sample import encode_completions
from lit_cancel.sharding import transformer_blocks


class FixedRollouts(RLModule):
    """Completions chosen by the prompt alone: two correct solutions and two wrong ones of other lengths."""

    def rollout(self, input_ids, attention_mask, num_samples=1, greedy=False):
        texts = []
        for prompt in self.tokenizer.batch_decode(input_ids, skip_special_tokens=True):
            a, b = (int(x) for x in prompt.rstrip("=").split("+"))
            right = self.trainer.datamodule.task.solutions({"a": a, "b": b, "answer": str(a + b)})
            texts += [right[0], right[0][:5], right[-1], right[0][:-1] + "9" + "," + right[0][:9]][:num_samples]
        tokens, completion_mask = encode_completions(self.tokenizer, texts)
        prompts = input_ids.repeat_interleave(num_samples, 0)
        return Generation(
            input_ids=torch.cat([prompts, tokens.to(prompts.device)], 1),
            attention_mask=torch.cat([attention_mask.repeat_interleave(num_samples, 0), completion_mask.to(prompts.device)], 1),
            completion_mask=completion_mask.to(prompts.device), prompt_length=input_ids.shape[1], texts=texts,
        )


def flat(tensors) -> torch.Tensor:
    """One vector of whole tensors; sharded ones are gathered (a collective: every process calls it)."""
    return torch.cat([(t.full_tensor() if isinstance(t, DTensor) else t).detach().flatten() for t in tensors]).clone()


class SaveGradient(L.Callback):
    def __init__(self):
        self.gradient = None

    def on_before_optimizer_step(self, trainer, pl_module, optimizer):
        if self.gradient is None:
            self.gradient = flat(p.grad for p in pl_module.policy.parameters())


class GatheredDtypes(L.Callback):
    """The dtypes a transformer block's parameters have inside its forward (FSDP2 gathers them there), and the
    sharded parameters' and their gradients' dtypes at the first optimizer step."""

    def __init__(self):
        self.in_forward, self.sharded, self.gradients = set(), None, None

    def setup(self, trainer, pl_module, stage):
        block = transformer_blocks(pl_module.policy)[0]  # before configure_model shards it: fully_shard keeps the module
        block.register_forward_hook(lambda module, args, output: self.in_forward.update(p.dtype for p in module.parameters()))

    def on_before_optimizer_step(self, trainer, pl_module, optimizer):
        if self.sharded is None:
            self.sharded = {p.dtype for p in pl_module.policy.parameters()}
            self.gradients = {p.grad.dtype for p in pl_module.policy.parameters()}


class GreedyBeforeTraining(L.Callback):
    """Greedy completions of the same prompts on every process, the second process stopping after 8 tokens:
    under sharding the processes then run different numbers of decoding steps."""

    def __init__(self):
        self.texts = None

    def on_train_start(self, trainer, pl_module):
        prompts = pl_module.tokenizer(["12+345=", "999+1=", "505+505="], return_tensors="pt", padding=True)
        pl_module.max_new_tokens = 40 if trainer.global_rank == 0 else 8
        self.texts = RLModule.rollout(pl_module, prompts["input_ids"], prompts["attention_mask"], greedy=True).texts


def train(
    objective: str, devices: int, strategy: str, accumulate: int, steps: int, kl_coef: float,
    precision: str = "32-true", dtype: str | None = None, max_tokens_per_chunk: int | None = None,
    activation_checkpointing: bool | str = False,
) -> dict:
    # plain SGD: Adam's normalisation would turn float rounding in near-zero gradients into lr-sized steps
    optimizer = functools.partial(torch.optim.SGD, lr=0.1)
    module = FixedRollouts(
        "embedded:tiny-adder", objective=PRESETS[objective](kl_coef=kl_coef), optimizer=optimizer, dtype=dtype,
        max_tokens_per_chunk=max_tokens_per_chunk, activation_checkpointing=activation_checkpointing,
    )
    data = RolloutDataModule(AdditionTask(num_digits=3, train_size=64, val_size=4), prompts_per_round=8, group_size=4)
    saver, greedy, dtypes = SaveGradient(), GreedyBeforeTraining(), GatheredDtypes()
    strategies = {"auto": "auto", "ddp": "ddp", "fsdp2": ModelParallelStrategy(data_parallel_size=devices, tensor_parallel_size=1)}
    trainer = L.Trainer(
        max_steps=steps, accelerator="cpu", devices=devices, strategy=strategies[strategy], precision=precision,
        accumulate_grad_batches=accumulate, logger=False, enable_checkpointing=False, enable_progress_bar=False,
        enable_model_summary=False, limit_val_batches=0, callbacks=[saver, greedy, dtypes],
    )
    trainer.fit(module, datamodule=data)
    local = sum((p.to_local() if isinstance(p, DTensor) else p).numel() for p in module.policy.parameters())
    return {
        "gradient": saver.gradient,
        "parameters": flat(module.policy.parameters()),
        "local_parameters": local,
        "dtypes": {p.dtype for p in module.parameters()},
        "in_forward": dtypes.in_forward,
        "sharded": dtypes.sharded,
        "gradients": dtypes.gradients,
        "greedy": greedy.texts,
    }


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("out")
    parser.add_argument("--devices", type=int, default=1)
    parser.add_argument("--strategy", choices=["auto", "ddp", "fsdp2"], default="auto")
    parser.add_argument("--accumulate", type=int, default=1)
    parser.add_argument("--steps", type=int, default=1)
    parser.add_argument("--kl-coef", type=float, default=0.0)
    parser.add_argument("--objectives", nargs="+", required=True)
    parser.add_argument("--precision", default="32-true")
    # one per process, the last for the rest: processes can run different numbers of decoder chunks
    parser.add_argument("--max-tokens-per-chunk", type=int, nargs="+")
    parser.add_argument("--activation-checkpointing", default=False, help="the module's activation_checkpointing mode")
    args = parser.parse_args()
    rank = int(os.environ.get("LOCAL_RANK", 0))
    budget = args.max_tokens_per_chunk[min(rank, len(args.max_tokens_per_chunk) - 1)] if args.max_tokens_per_chunk else None
    results = {
        name: train(name, args.devices, args.strategy, args.accumulate, args.steps, args.kl_coef, args.precision,
                    max_tokens_per_chunk=budget, activation_checkpointing=args.activation_checkpointing)
        for name in args.objectives
    }
    if rank == 0:
        torch.save(results, args.out)


if __name__ == "__main__":
    main()
