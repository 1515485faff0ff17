"""Parts that only the experiments use, loaded by class path (``lab.parts.X``; ``lab.runs`` puts benchmarks/ on
``PYTHONPATH``; commands stored before the package name ``experiment_parts.X``, which re-exports these). They plug
into the library's own hooks: an objective's ``trust_region`` (a stop-gradient weight per token), a datamodule's
``plan``, a trainer callback.

* ``SharedPositionNoise``: mean-one log-normal weights per member on the positions its whole group shares
  (E8: the expected gradient is unchanged, the credits there no longer cancel);
* ``AdvantageSign``: trains on the rollouts of one sign of advantage only (E8, E9);
* ``SignSorted``: positives and negatives in different mini-batches, the opposite of ``RewardBalanced`` (E9);
* ``ScaffoldProbe``: how sure the policy is of the scaffold, and how often rollouts write it exactly (E8);
* ``FirstTurnAgreement``: how often a group's episodes open with the same turn, and how much of the policy's text a
  whole group shares (E11's manipulation check).
* ``FinalFirstTurn``: how often a whole group's episodes end at their first turn (E12's forced arms).
"""

from typing import Literal

import lightning.pytorch as pl
import torch
from lightning.pytorch.callbacks import Callback
from torch import Tensor
from typing_extensions import override

from lit_cancel.batch import RolloutBatch
from lit_cancel.objectives.audit import shared_positions
from lit_cancel.objectives.trust_regions import TrustRegion
from lit_cancel.rounds.plans import MiniBatchPlan
from lit_cancel.tasks import SCAFFOLD_TEXT


def completion_ids(batch: RolloutBatch) -> Tensor:
    return batch.input_ids[:, batch.prompt_length :]


@torch.no_grad()
def scaffold_probabilities(module: "pl.LightningModule", prompts: list[str], scaffold: str) -> Tensor:
    """``[N, S]`` probability of each scaffold token, teacher-forced after each prompt (a ``PolicyModule``)."""
    tokenizer = module.tokenizer
    prompt = tokenizer(prompts, return_tensors="pt", padding=True, add_special_tokens=False)
    scaffold_ids = torch.tensor(tokenizer(scaffold, add_special_tokens=False)["input_ids"]).expand(len(prompts), -1)
    input_ids = torch.cat([prompt["input_ids"], scaffold_ids], 1).to(module.device)
    attention_mask = torch.cat([prompt["attention_mask"], torch.ones_like(scaffold_ids)], 1).to(module.device)
    return module.token_logprobs(input_ids, attention_mask, prompt["input_ids"].shape[1]).float().exp()


class SharedPositionNoise(TrustRegion):
    """Weights ``z_i = exp(sigma g_i - sigma^2 / 2)``, ``g_i ~ N(0, 1)`` i.i.d. per member, on its group's shared positions.

    ``E[z_i] = 1`` and ``z`` is drawn independently of the rollouts, so the expected gradient is the
    objective's own; but ``sum_i z_i A_i`` is no longer 0 at a shared position, so the credits there
    stop cancelling. Elsewhere the weight is 1. Draws come from a generator of their own (seeded by
    ``seed`` and a call counter), so the rollouts' random stream is the same as without the noise.

    Args:
        sigma: standard deviation of ``log z``.
        seed: seed of the weights' generator.
    """

    def __init__(self, sigma: float = 1.0, seed: int = 0):
        if sigma <= 0:
            raise ValueError(f"SharedPositionNoise: sigma must be > 0, got {sigma}")
        self.sigma, self.seed, self.calls = sigma, seed, 0

    def __call__(self, log_ratio: Tensor, mask: Tensor, batch: RolloutBatch) -> Tensor:
        generator = torch.Generator().manual_seed(self.seed * 1_000_003 + self.calls)
        self.calls += 1
        noise = (self.sigma * torch.randn(len(mask), 1, generator=generator) - self.sigma**2 / 2).exp().to(mask)
        shared = shared_positions(completion_ids(batch).cpu(), mask.cpu(), batch.group_ids.cpu()).to(mask.device)
        return torch.where(shared, noise, torch.ones_like(mask)) * mask


class AdvantageSign(TrustRegion):
    """Keeps the credit of rollouts whose advantage has the given sign; the others train nothing.

    Args:
        keep: ``"positive"`` (``A > 0``) or ``"negative"`` (``A < 0``).
    """

    def __init__(self, keep: Literal["positive", "negative"] = "positive"):
        if keep not in ("positive", "negative"):
            raise ValueError(f"AdvantageSign: keep must be 'positive' or 'negative', got {keep!r}")
        self.keep = keep

    def __call__(self, log_ratio: Tensor, mask: Tensor, batch: RolloutBatch) -> Tensor:
        advantages = batch.advantages.to(mask.device).unsqueeze(1)
        kept = advantages > 0 if self.keep == "positive" else advantages < 0
        return kept.to(mask.dtype) * mask


class SignSorted(MiniBatchPlan):
    """Positives first, then rollouts with ``A = 0``, then negatives, cut into consecutive steps.

    The opposite of ``RewardBalanced``: most steps see one sign only, so a group's opposing credits
    on the tokens its members share meet in no step.
    """

    def split(self, batch: RolloutBatch, steps: int, generator: torch.Generator) -> list[Tensor]:
        advantages = batch.advantages.cpu()
        ordered = torch.cat([
            (rows := torch.nonzero(condition).squeeze(1))[torch.randperm(len(rows), generator=generator)]
            for condition in (advantages > 0, advantages == 0, advantages < 0)
        ])
        return list(ordered.chunk(steps))


class ScaffoldProbe(Callback):
    """Logs how sure the policy is of the scaffold and how often its rollouts write it exactly.

    * ``probe/scaffold_p``: mean probability of the scaffold's tokens, teacher-forced after the prompts
      of the first ``num_problems`` held-out problems (no grad), before training and every
      ``every_n_steps`` optimizer steps; also ``probe/scaffold_p_min``, the mean of each problem's least sure token;
    * ``rollout/scaffold_exact``: share of each training micro-batch's rollouts that begin with the scaffold;
    * ``rollout/group_shared_tokens``: mean length of the prefix a rollout's whole group shares (the positions
      where credits cancel, or where ``SharedPositionNoise`` acts).

    Args:
        every_n_steps: how often to probe, in optimizer steps.
        num_problems: held-out problems probed.
    """

    def __init__(self, every_n_steps: int = 10, num_problems: int = 32):
        if every_n_steps < 1 or num_problems < 1:
            raise ValueError(f"ScaffoldProbe: every_n_steps and num_problems must be >= 1, got {every_n_steps}, {num_problems}")
        self.every_n_steps, self.num_problems = every_n_steps, num_problems
        self.history: list[tuple[int, float]] = []

    def _scaffold(self, trainer: "pl.Trainer") -> str:
        task = trainer.datamodule.task
        (scaffold,) = task.scaffolds
        return SCAFFOLD_TEXT[:scaffold]

    def _probe(self, trainer: "pl.Trainer", pl_module: "pl.LightningModule") -> None:
        scaffold = self._scaffold(trainer)
        if not scaffold:
            return
        prompts = [record["prompt"] for record in trainer.datamodule.task.val_records()[: self.num_problems]]
        training = pl_module.training
        pl_module.eval()
        probabilities = scaffold_probabilities(pl_module, prompts, scaffold)
        pl_module.train(training)
        mean, least = float(probabilities.mean()), float(probabilities.min(1).values.mean())
        self.history.append((trainer.global_step, mean))
        for logger in trainer.loggers:
            logger.log_metrics({"probe/scaffold_p": mean, "probe/scaffold_p_min": least}, step=trainer.global_step)

    @override
    def on_train_start(self, trainer: "pl.Trainer", pl_module: "pl.LightningModule") -> None:
        self._probe(trainer, pl_module)

    @override
    def on_train_batch_end(self, trainer, pl_module, outputs, batch: RolloutBatch, batch_idx: int) -> None:
        scaffold = self._scaffold(trainer)
        if not scaffold:
            return
        texts = pl_module.tokenizer.batch_decode(completion_ids(batch), skip_special_tokens=True)
        exact = sum(text.startswith(scaffold) for text in texts) / max(len(texts), 1)
        shared = shared_positions(completion_ids(batch).cpu(), batch.completion_mask.cpu(), batch.group_ids.cpu())
        pl_module.log("rollout/scaffold_exact", exact, on_step=True, on_epoch=False)
        pl_module.log("rollout/group_shared_tokens", shared.sum(1).float().mean(), on_step=True, on_epoch=False)
        step = trainer.global_step
        if step % self.every_n_steps == 0 and (not self.history or self.history[-1][0] != step):
            self._probe(trainer, pl_module)



def first_turn_agreement(batch: RolloutBatch) -> tuple[float, float]:
    """``(groups, agreeing)``: the groups with two or more members in ``batch``, and how many of them open every episode
    with the same first turn (the policy's tokens up to the first token it did not write: the environment's reply, or
    padding after an episode that ended in one turn)."""
    mask = batch.completion_mask.bool()
    first_turn = torch.where(mask.long().cumprod(1).bool(), completion_ids(batch), -1)
    _, group = torch.unique(batch.group_ids, return_inverse=True)
    groups = int(group.max()) + 1 if len(group) else 0
    rows = torch.arange(len(group), device=group.device)
    first_row = torch.full((groups,), len(group), device=group.device).scatter_reduce(0, group, rows, reduce="amin")
    same = (first_turn == first_turn[first_row[group]]).all(1).long()
    everyone = torch.ones(groups, dtype=torch.long, device=group.device).scatter_reduce(0, group, same, reduce="amin")
    several = torch.bincount(group, minlength=groups) > 1
    return float(several.sum()), float((everyone.bool() & several).sum())


class FirstTurnAgreement(Callback):
    """Logs how often a group's episodes open the same way, and how much of the policy's text its whole group shares.

    * ``rollout/first_turn_agreement``: the share of each training micro-batch's groups (those with two or more members
      in it) whose episodes all open with the same first turn, token for token (:func:`first_turn_agreement`);
    * ``rollout/shared_policy_tokens``: the share of the policy's tokens at positions the whole group shares, the
      environment's replies counted as context (``shared_positions``, the positions the learning tax measures).

    An environment cannot change an episode's first turn (it comes before the first reply), so the first is what the
    policy being trained sets; shared later turns follow from it.
    """

    @override
    def on_train_batch_end(self, trainer, pl_module, outputs, batch: RolloutBatch, batch_idx: int) -> None:
        groups, agreeing = first_turn_agreement(batch)
        completions, mask = completion_ids(batch).cpu(), batch.completion_mask.cpu()
        context = batch.attention_mask[:, batch.prompt_length :].cpu()
        prompts = batch.input_ids[:, : batch.prompt_length].cpu()
        shared = shared_positions(completions, mask, batch.group_ids.cpu(), context, prompts)
        pl_module.log("rollout/first_turn_agreement", agreeing / groups if groups else 0.0, on_step=True, on_epoch=False)
        pl_module.log("rollout/shared_policy_tokens", float(shared.sum() / mask.sum().clamp(min=1)), on_step=True, on_epoch=False)


def groups_ending_at_first_turn(batch: RolloutBatch) -> tuple[float, float]:
    """``(groups, ended)``: the groups with two or more members in ``batch``, and how many of them have every episode end
    at its first turn (no environment token after the prompt: the environment ended the episode at its first reply, or
    the turn was cut)."""
    after_prompt = batch.attention_mask[:, batch.prompt_length :].bool()
    from_environment = (after_prompt & ~batch.completion_mask.bool()).any(1).long()
    _, group = torch.unique(batch.group_ids, return_inverse=True)
    groups = int(group.max()) + 1 if len(group) else 0
    continued = torch.zeros(groups, dtype=torch.long, device=group.device).scatter_reduce(0, group, from_environment, reduce="amax")
    several = torch.bincount(group, minlength=groups) > 1
    return float(several.sum()), float((~continued.bool() & several).sum())


class FinalFirstTurn(Callback):
    """Logs ``rollout/forced_final_first_turn`` (E12's forced arms): the share of each training micro-batch's groups (those
    with two or more members in it) whose episodes all end at their first turn (:func:`groups_ending_at_first_turn`).

    Under ``forced_branching.ForcedFirstTurn`` a group shares its first turn; one that answers without calling the tool
    ends every episode of the group there, ``n`` identical episodes with equal rewards: a group with no advantage.
    """

    @override
    def on_train_batch_end(self, trainer, pl_module, outputs, batch: RolloutBatch, batch_idx: int) -> None:
        groups, ended = groups_ending_at_first_turn(batch)
        pl_module.log("rollout/forced_final_first_turn", ended / groups if groups else 0.0, on_step=True, on_epoch=False)
