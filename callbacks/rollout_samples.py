r"""Rollout samples: a few prompts, completions, rewards and advantages of a training step, as TensorBoard text."""

import re
from typing import Any

import lightning.pytorch as pl
import torch
from lightning.pytorch.callbacks import Callback
from lightning.pytorch.loggers import TensorBoardLogger
from lightning.pytorch.utilities import rank_zero_warn
from torch import Tensor
from typing_extensions import override

KEYS = ("input_ids", "prompt_length", "completion_mask", "rewards", "advantages")

# characters that Markdown (or a table's cell borders) would interpret
_MARKDOWN_SPECIAL = re.compile(r"([\\`*_\[\]|])")
# around the environment's spans of a multi-turn episode: no Markdown meaning, and rarely in a model's text
ENVIRONMENT_SPAN = "⟦env: {}⟧"
# before an episode whose environment failed, with its cause
FAILED_SPAN = "⟦failed: {}⟧"


def markdown_cell(text: str) -> str:
    """``text`` as it should appear, literally, in one cell of a Markdown table."""
    return _MARKDOWN_SPECIAL.sub(r"\\\1", text).replace("\n", "<br>")


def episode_text(tokenizer: Any, ids: Tensor, policy: Tensor, context: Tensor) -> str:
    """The tokens ``ids`` where ``context`` is 1, decoded span by span: the policy's (``policy`` 1) as they are, the
    environment's (``policy`` 0) as :data:`ENVIRONMENT_SPAN`, but for those that decode to nothing (padding that a
    single-turn ``attention_mask`` covers)."""
    sources, lengths = torch.unique_consecutive(policy[context.bool()].bool(), return_counts=True)
    pieces = []
    for span, from_policy in zip(ids[context.bool()].split(lengths.tolist()), sources.tolist()):
        text = tokenizer.decode(span, skip_special_tokens=True)
        if from_policy or text:
            pieces.append(text if from_policy else ENVIRONMENT_SPAN.format(text))
    return "".join(pieces)


class RolloutSamplesLogger(Callback):
    r"""Writes the first rollouts of a training step as a Markdown table to TensorBoard's Text tab.

    Every ``every_n_steps`` optimizer steps, the first ``num_samples`` rows of the step's first
    micro-batch are decoded and written under the tag ``tag`` at the step of that step's scalars
    (``trainer.global_step`` when the micro-batch starts, once per optimizer step, whatever the
    epoch length and ``accumulate_grad_batches``), so the samples sit next to the reward curve. The table has one row per rollout: prompt,
    completion, reward and advantage. The completion of a multi-turn episode is the whole episode:
    the policy's turns as they are, each of the environment's observations in its place, marked
    ``⟦env: ...⟧`` (plain text to Markdown), e.g. ``guess 50⟦env: higher⟧guess 75``. Writes happen
    on rank 0 only, through the trainer's :class:`~lightning.pytorch.loggers.TensorBoardLogger`;
    without one, the callback warns once and does nothing.

    Contract: each key of ``input_ids`` (``[B, P + C]``, prompts left-padded to ``prompt_length``
    then completions), ``prompt_length`` (``P``), ``completion_mask`` (``[B, C]``, 1 on the policy's
    completion tokens), ``rewards`` and ``advantages`` (``[B]``) is read from the dict that
    ``training_step`` returns, else from the batch (a dict or an object with those attributes); so
    is ``attention_mask`` (``[B, P + C]``), when there is one: after ``P`` it is 1 on the
    environment's tokens of an episode too (without it the completion is the ``completion_mask``
    tokens alone). So is ``failures``, when there is one (``[B]``, why each row's episode failed, e.g.
    ``"step_raised"``, None where it ran; lit_cancel's batch has it): a failed episode's row has no policy token to
    credit, so its completion is what it holds in its context, after ``⟦failed: CAUSE⟧``. The LightningModule has a
    Hugging Face ``tokenizer``; prompts, turns and observations are decoded with special tokens (padding, EOS) removed.

    Args:
        every_n_steps: how often to write samples, in optimizer steps (step 0 included).
        num_samples: rollouts per table (fewer when the micro-batch is smaller).
        tag: the TensorBoard text tag.

    Example::

        trainer = Trainer(callbacks=[RolloutSamplesLogger(every_n_steps=25, num_samples=8)])
    """

    def __init__(self, every_n_steps: int = 25, num_samples: int = 8, tag: str = "rollouts/samples") -> None:
        super().__init__()
        if every_n_steps < 1 or num_samples < 1:
            raise ValueError(
                f"RolloutSamplesLogger: every_n_steps and num_samples must be >= 1, got {every_n_steps} and {num_samples}"
            )
        if not tag:
            raise ValueError("RolloutSamplesLogger: tag must be a non-empty string")
        self.every_n_steps, self.num_samples, self.tag = every_n_steps, num_samples, tag
        self.tensorboard: TensorBoardLogger | None = None
        self.logged_steps: list[int] = []
        self._step = 0

    @override
    def setup(self, trainer: "pl.Trainer", pl_module: "pl.LightningModule", stage: str) -> None:
        if getattr(pl_module, "tokenizer", None) is None:
            raise ValueError(
                f"RolloutSamplesLogger: the LightningModule {type(pl_module).__name__} has no `tokenizer` to decode rollouts with"
            )
        self.tensorboard = next((logger for logger in trainer.loggers if isinstance(logger, TensorBoardLogger)), None)
        if self.tensorboard is None:
            rank_zero_warn("RolloutSamplesLogger: the trainer has no TensorBoardLogger; rollout samples will not be written")

    @override
    def on_train_batch_start(self, trainer: "pl.Trainer", pl_module: "pl.LightningModule", batch: Any, batch_idx: int) -> None:
        # the optimizer step this micro-batch belongs to: batch_idx restarts every epoch, and an epoch's
        # last step may have fewer micro-batches than accumulate_grad_batches
        self._step = trainer.global_step

    @override
    def on_train_batch_end(self, trainer: "pl.Trainer", pl_module: "pl.LightningModule", outputs: Any, batch: Any, batch_idx: int) -> None:
        step = self._step
        if self.tensorboard is None or not trainer.is_global_zero or step % self.every_n_steps or step in self.logged_steps[-1:]:
            return
        self.tensorboard.experiment.add_text(self.tag, self.table(pl_module.tokenizer, outputs, batch), global_step=step)
        self.logged_steps.append(step)

    def table(self, tokenizer: Any, outputs: Any, batch: Any) -> str:
        """The Markdown table of the first ``num_samples`` rollouts of a micro-batch."""
        values = {key: _lookup(key, outputs, batch) for key in KEYS}
        prompt_length = int(values["prompt_length"])
        attention = _lookup("attention_mask", outputs, batch, required=False)
        failures = _lookup("failures", outputs, batch, required=False)
        context = values["completion_mask"] if attention is None else attention[:, prompt_length:]
        lines = ["| prompt | completion | reward | advantage |", "|---|---|---|---|"]
        for row in range(min(self.num_samples, len(values["rewards"]))):
            ids = values["input_ids"][row]
            prompt = tokenizer.decode(ids[:prompt_length], skip_special_tokens=True)
            if failures is not None and failures[row] is not None:
                held = tokenizer.decode(ids[prompt_length:][context[row].bool()], skip_special_tokens=True)
                completion = FAILED_SPAN.format(failures[row]) + held
            else:
                completion = episode_text(tokenizer, ids[prompt_length:], values["completion_mask"][row], context[row])
            reward, advantage = float(values["rewards"][row]), float(values["advantages"][row])
            lines.append(f"| {markdown_cell(prompt)} | {markdown_cell(completion)} | {reward:.4g} | {advantage:+.4g} |")
        return "\n".join(lines)


def _lookup(key: str, outputs: Any, batch: Any, required: bool = True) -> Any:
    if isinstance(outputs, dict) and key in outputs:
        return outputs[key]
    if isinstance(batch, dict) and key in batch:
        return batch[key]
    if hasattr(batch, key):
        return getattr(batch, key)
    if not required:
        return None
    raise KeyError(f"RolloutSamplesLogger: neither the training_step output nor the batch has {key!r} (needs {', '.join(KEYS)})")
