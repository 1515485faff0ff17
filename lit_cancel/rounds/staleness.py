"""How far sampling may run ahead of training: the one reader of the engine's ``max_staleness``, and its checks.

An engine that samples ahead of the trainer (``max_staleness`` above 0: :class:`~lit_cancel.VLLMServerEngine`) is asked
for the next draws while the trainer trains, each to be sampled by weights no older than the bound allows (the engine's
admission control waits for them); the rows that reach training are checked against the bound, and so, at start-up, is
whether the engine can sample the task's rollouts ahead at all.
"""

from lit_cancel.batch import RolloutBatch
from lit_cancel.engines import RolloutEngine
from lit_cancel.tasks import Task


class Staleness:
    """A run's bound on staleness: rollouts are trained at most ``max_staleness`` rounds after the round of the weights
    that sampled them, ``max_staleness`` being the engine's (0, every round sampled by the weights it trains, for an
    engine that samples on demand).

    Args:
        engine: the policy's engine.
        steps_per_round: optimizer steps each round trains (staleness is counted in rounds).
    """

    def __init__(self, engine: RolloutEngine, steps_per_round: int) -> None:
        self.engine, self.max_staleness, self.steps_per_round = engine, engine.max_staleness, steps_per_round

    def later_draws(self, draw: int) -> range:
        """The draws the engine is asked for while draw ``draw`` is sampled and trained: the next ``max_staleness``."""
        return range(draw + 1, draw + 1 + self.max_staleness)

    def oldest_step(self, step: int, rounds_ahead: int) -> int:
        """The oldest optimizer step whose weights may sample a draw trained in a round at most ``rounds_ahead`` rounds
        after the one that starts at step ``step`` (a round takes one draw or more)."""
        return max(step + (rounds_ahead - self.max_staleness) * self.steps_per_round, 0)

    def check(self, batch: RolloutBatch, step: int) -> dict[str, float]:
        """``rollout/staleness`` (mean) and ``rollout/staleness_max``: rounds between the weights that sampled ``batch``'s
        rows and the round that trains them, which starts at optimizer step ``step``; nothing for rollouts sampled by
        the weights being trained. A row more than ``max_staleness`` rounds behind raises RuntimeError: the engine's
        admission control should have kept it from being sampled."""
        if batch.sampler_steps is None:
            return {}
        behind = (step - batch.sampler_steps.float()) / self.steps_per_round
        if behind.max() > self.max_staleness or behind.min() < 0:
            raise RuntimeError(
                f"rollouts sampled by the weights of steps {sorted(set(batch.sampler_steps.tolist()))} reached the round that "
                f"starts at step {step}, outside the {self.max_staleness} rounds of staleness allowed"
            )
        return {"rollout/staleness": behind.mean().item(), "rollout/staleness_max": behind.max().item()}

    def check_task(self, task: Task) -> None:
        """Raises ValueError when the engine samples ahead of the trainer but cannot sample ``task``'s rollouts ahead: a
        task whose rollout calls the engine several times (an agent's turns) is run ahead in the background, each call
        sampled by the weights the engine then holds (:meth:`~lit_cancel.engines.RolloutEngine.sample_ahead`)."""
        engine = self.engine
        if self.max_staleness > 0 and not task.rollout_in_one_call and not engine.can_sample_ahead:
            raise ValueError(
                f"{type(task).__name__} runs episodes turn by turn, which {type(engine).__name__} cannot sample ahead of the "
                f"trainer (model.init_args.engine has max_staleness={self.max_staleness}); set max_staleness: 0, or use "
                "lit_cancel.VLLMServerEngine"
            )
