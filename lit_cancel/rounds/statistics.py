"""The statistics stage: what a round's rollouts logged (``rollout/...``, ``perf/...``), and warnings of what keeps a round
from teaching the policy anything, from its first round on (the run doctor, ``lit_cancel.callbacks.RunDoctor``, judges
trends once a run has logged a few steps)."""

import math
from collections.abc import Iterable, Sequence

import torch
from lightning.pytorch.utilities import rank_zero_warn
from torch import Tensor

from lit_cancel.batch import RolloutBatch
from lit_cancel.rounds.failures import varied_groups
from lit_cancel.sharding import total_norm


def round_stats(
    sampled: RolloutBatch, kept: int, group_size: int, seconds: float, sync_seconds: float, stop_token_ids: Sequence[int]
) -> dict[str, float]:
    """``rollout/...`` statistics of every rollout sampled in a round, of which the first ``kept`` are trained.

    ``seconds`` were spent sampling, ``sync_seconds`` pushing the policy's weights to the engine; a
    completion whose last token is not one of ``stop_token_ids`` was cut at ``max_new_tokens`` (an agent's episode
    whose last turn was cut, at its turn or episode token limit). A statistic of
    no rollout is left out: ``rollout/reward_truncated`` of a round without a cut completion,
    ``rollout/reward_finished`` of one where every completion was cut, ``rollout/reward_correct_corr``
    of one whose rewards or correctness are all equal or whose task cannot tell correctness.

    A failed episode's row (inert, :mod:`lit_cancel.rounds.failures`) is left out of every statistic of the rollouts
    (rewards, accuracy, lengths, cuts), unless every row failed, and a group without two members that ran has no reward
    difference; the failures themselves are counted apart (``rollout/failed_episodes``).
    """
    ran = ~sampled.failed
    # a round of nothing but failed episodes: its rows, rewards 0, stand in so that every statistic has a value
    counted = ran if ran.any() else torch.ones_like(ran)
    flat = sampled.rewards.float()
    lengths = sampled.completion_mask.sum(1).float()
    completions = sampled.input_ids[:, sampled.prompt_length :]
    stops = torch.tensor(list(stop_token_ids), device=completions.device)
    # a completion ends at its last policy token: in an agent's episode, the last turn's, whatever earlier turns did
    policy = sampled.completion_mask.bool()
    last = torch.where(policy, torch.arange(policy.shape[1], device=policy.device), -1).max(1).values
    ended = (last >= 0) & torch.isin(completions.gather(1, last.clamp(min=0).unsqueeze(1)).squeeze(1), stops)
    told = sampled.correct if sampled.correct is not None else torch.full_like(flat, math.nan)
    correct = torch.where(told.isnan(), (flat > 0).float(), told.float())
    flat, lengths, ended, told, correct = flat[counted], lengths[counted], ended[counted], told[counted], correct[counted]
    varied = varied_groups(sampled.rewards.view(-1, group_size), ran.view(-1, group_size))
    stats = {
        "rollout/reward_mean": flat.mean().item(),
        "rollout/accuracy": correct.mean().item(),
        "rollout/completion_len": lengths.mean().item(),
        "rollout/frac_truncated": (~ended).float().mean().item(),
        "rollout/frac_zero_std_groups": (~varied).float().mean().item(),
        "rollout/dropped_groups": float(len(sampled) - kept) / group_size,
        "perf/rollout_tokens_per_s": lengths.sum().item() / max(seconds, 1e-9),
        "perf/weight_sync_s": sync_seconds,
    }
    if ended.any():
        stats["rollout/reward_finished"] = flat[ended].mean().item()
    if not ended.all():
        stats["rollout/reward_truncated"] = flat[~ended].mean().item()
    known = ~told.isnan()
    if (correlation := pearson(flat[known], told[known].float())) is not None:
        stats["rollout/reward_correct_corr"] = correlation
    return stats


def pearson(x: Tensor, y: Tensor) -> float | None:
    """The Pearson correlation of ``x`` and ``y``; None when either holds one value only (or nothing)."""
    if len(x) < 2 or (x == x[0]).all() or (y == y[0]).all():
        return None
    return torch.corrcoef(torch.stack([x, y]).double())[0, 1].item()


# a condition under which a run cannot learn is warned about at its first round and every this many rounds while it lasts
WARN_EVERY_N_ROUNDS = 10
# the weight norm is "exploding" above this multiple of its value at the first round
EXPLODING_WEIGHT_NORM = 10.0


class CannotLearnWarnings:
    """Counts, per condition, the rounds it has lasted; remembers the weight norm of the first round."""

    def __init__(self) -> None:
        self.rounds: dict[str, int] = {}
        self.start_weight_norm: float | None = None

    def warn(self, parameters: Iterable[Tensor], max_new_tokens: int, stats: dict[str, float], round_number: int) -> None:
        """Warns, on rank 0, of what keeps this round from teaching the policy anything: every completion cut at
        ``max_new_tokens``, no reward variance in any group, a norm of the trained ``parameters`` that is not finite or
        above ``EXPLODING_WEIGHT_NORM`` times its value at the first round. Each is warned at its first round and every
        ``WARN_EVERY_N_ROUNDS`` rounds while it lasts."""
        weight_norm = float(total_norm([p.detach() for p in parameters if p.requires_grad]))
        if self.start_weight_norm is None:
            self.start_weight_norm = weight_norm
        lasting = f"(warned every {WARN_EVERY_N_ROUNDS} rounds while it lasts)"
        if not math.isfinite(weight_norm):
            weights = f"round {round_number}: the weight norm is {weight_norm}; lower the learning rate {lasting}"
        elif weight_norm > EXPLODING_WEIGHT_NORM * self.start_weight_norm:
            weights = (
                f"round {round_number}: the weight norm is {weight_norm:.4g}, more than {EXPLODING_WEIGHT_NORM:g} times its "
                f"{self.start_weight_norm:.4g} at the first round (exploding); lower the learning rate or the weight decay {lasting}"
            )
        else:
            weights = None
        truncated = (
            f"round {round_number}: every completion reached max_new_tokens={max_new_tokens} without an "
            f"end-of-sequence token, so every reward scores a cut-off answer; raise model.init_args.max_new_tokens {lasting}"
        )
        failed = stats.get("rollout/failed_episodes", 0.0)
        no_signal = (
            f"round {round_number}: every group's rewards are equal (mean reward {stats['rollout/reward_mean']:g}), so every "
            f"advantage is 0 and the policy gets no learning signal; check the task's reward on the rollouts {lasting}"
        ) if failed < 1 else (
            f"round {round_number}: every episode failed (rollout/failed_episodes), so no episode trains; check the "
            f"environment {lasting}"
        )
        conditions = {
            "truncated": truncated if stats["rollout/frac_truncated"] == 1 else None,
            "no_signal": no_signal if stats["rollout/frac_zero_std_groups"] == 1 else None,
            "weights": weights,
        }
        for name, message in conditions.items():
            self.rounds[name] = self.rounds.get(name, 0) + 1 if message else 0
            if message and self.rounds[name] % WARN_EVERY_N_ROUNDS == 1:
                rank_zero_warn(message)
