"""Warnings of what keeps a round from teaching the policy anything, from its first round on (the run doctor,
``lit_cancel.callbacks.RunDoctor``, judges trends once a run has logged a few steps)."""

import math
from collections.abc import Iterable

from lightning.pytorch.utilities import rank_zero_warn
from torch import Tensor

from lit_cancel.sharding import total_norm

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
        no_signal = (
            f"round {round_number}: every group's rewards are equal (mean reward {stats['rollout/reward_mean']:g}), so every "
            f"advantage is 0 and the policy gets no learning signal; check the task's reward on the rollouts {lasting}"
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
