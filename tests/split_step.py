"""One optimizer step on fixed rollouts; saves the gradient it applied (run by test_splitting.py).

    python tests/split_step.py OUT.pt --devices 2 --accumulate 1 --objectives grpo dapo

With ``--devices 2`` Lightning's DDP launcher starts a second process running this script. The
rollouts depend only on the prompt, so every way of splitting the round sees the same data.
"""

import argparse
import os

import lightning as L
import torch

from lit_cancel import PRESETS, AdditionTask, Generation, RLModule, RolloutDataModule


class FixedRollouts(RLModule):
    """Completions chosen by the prompt alone: two correct solutions and two wrong ones of other lengths."""

    def rollout(self, input_ids, attention_mask, num_samples=1, greedy=False):
        texts = []
        for prompt in self.tokenizer.batch_decode(input_ids, skip_special_tokens=True):
            a, b = (int(x) for x in prompt.rstrip("=").split("+"))
            right = self.trainer.datamodule.task.solutions({"a": a, "b": b, "answer": str(a + b)})
            texts += [right[0], right[0][:5], right[-1], right[0][:-1] + "9" + "," + right[0][:9]][:num_samples]
        completions = [self.tokenizer(t, add_special_tokens=False)["input_ids"] + [self.tokenizer.eos_token_id] for t in texts]
        width = max(map(len, completions))
        tokens = torch.full((len(texts), width), self.tokenizer.pad_token_id)
        completion_mask = torch.zeros((len(texts), width), dtype=torch.long)
        for row, ids in enumerate(completions):
            tokens[row, : len(ids)], completion_mask[row, : len(ids)] = torch.tensor(ids), 1
        prompts = input_ids.repeat_interleave(num_samples, 0)
        return Generation(
            input_ids=torch.cat([prompts, tokens.to(prompts.device)], 1),
            attention_mask=torch.cat([attention_mask.repeat_interleave(num_samples, 0), completion_mask.to(prompts.device)], 1),
            completion_mask=completion_mask.to(prompts.device), prompt_length=input_ids.shape[1], texts=texts,
        )


class SaveGradient(L.Callback):
    def __init__(self):
        self.gradient = None

    def on_before_optimizer_step(self, trainer, pl_module, optimizer):
        self.gradient = torch.cat([p.grad.flatten() for p in pl_module.policy.parameters()]).clone()


def step_gradient(objective: str, devices: int, accumulate: int) -> torch.Tensor:
    module = FixedRollouts("embedded:tiny-adder", objective=PRESETS[objective]())
    data = RolloutDataModule(AdditionTask(num_digits=3, train_size=64, val_size=4), prompts_per_round=8, group_size=4)
    saver = SaveGradient()
    trainer = L.Trainer(
        max_steps=1, accelerator="cpu", devices=devices, strategy="ddp" if devices > 1 else "auto",
        accumulate_grad_batches=accumulate, logger=False, enable_checkpointing=False, enable_progress_bar=False,
        enable_model_summary=False, limit_val_batches=0, callbacks=[saver],
    )
    trainer.fit(module, datamodule=data)
    return saver.gradient


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("out")
    parser.add_argument("--devices", type=int, default=1)
    parser.add_argument("--accumulate", type=int, default=1)
    parser.add_argument("--objectives", nargs="+", required=True)
    args = parser.parse_args()
    gradients = {name: step_gradient(name, args.devices, args.accumulate) for name in args.objectives}
    if int(os.environ.get("LOCAL_RANK", 0)) == 0:
        torch.save(gradients, args.out)


if __name__ == "__main__":
    main()
