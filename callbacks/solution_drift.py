r"""Solution probability drift: how the policy's probabilities of known correct solutions move."""

from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from typing import Any, Literal, Protocol, runtime_checkable

import lightning.pytorch as pl
import torch
from lightning.pytorch.callbacks import Callback
from lightning.pytorch.utilities import rank_zero_warn
from torch import Tensor
from typing_extensions import override

# A prompt or a solution: text, or token ids for a policy without a tokenizer.
TextOrIds = str | list[int]


@runtime_checkable
class SequenceLogprobs(Protocol):
    """The LightningModule method that SolutionProbabilityDriftMonitor calls to score the probes."""

    def sequence_logprobs(self, prompts: Sequence[TextOrIds], completions: Sequence[TextOrIds]) -> Tensor:
        """``[N]``: the log-probability of each completion after its prompt, summed over the completion's tokens.

        Prompts and completions come as the probes hold them: strings, or lists of token ids.
        Whether an end-of-sequence token counts is the module's choice; count it when the
        solutions are whole answers, and the same way at every call.
        """
        ...


@contextmanager
def measuring(trainer: "pl.Trainer", pl_module: "pl.LightningModule") -> Iterator[None]:
    """An extra forward pass of the policy: no grad, every submodule in eval mode (each restored after),
    the trainer's precision context. Dropout is off, so the pass measures the policy, not noise."""
    modes = [(module, module.training) for module in pl_module.modules()]
    pl_module.eval()
    try:
        with torch.no_grad(), trainer.precision_plugin.forward_context():
            yield
    finally:
        for module, training in modes:
            module.training = training


def _is_sequence(value: Any) -> bool:
    return isinstance(value, str) or (isinstance(value, list) and bool(value) and all(isinstance(token, int) for token in value))


class SolutionProbabilityDriftMonitor(Callback):
    r"""Tracks the log-probability of a fixed probe set of correct solutions and the preference among equivalents.

    At fit start it fixes a probe set: prompts, each with one or more correct solutions (ideally
    several equivalent ones). Every ``every_n_steps`` optimizer steps (after steps 0, n, 2n, ...) it
    scores every solution and logs, against the values at the start, straight to the trainer's
    loggers at that step:

    * ``health/drift_logprob_change``: mean change of the solutions' log-probabilities;
    * ``health/drift_log_odds``: mean ``|log p(s_1) - log p(s_2)|`` between the first two solutions
      of each prompt that has two or more;
    * ``health/drift_preference_entropy``: mean entropy of ``softmax(log p(s_k))`` over each such
      prompt's solutions, and ``health/drift_preference_entropy_ratio`` to its start. A log-odds that
      keeps one sign drives this entropy to 0: the policy forgets equivalent solutions.

    Scoring runs without grad, in eval mode and in the trainer's precision context, at the start as
    after each step: a run that changes nothing (learning rate 0) logs a change of exactly 0. When
    the preference entropy ratio falls below ``min_entropy_ratio``, it warns once (again only after
    it has recovered), or stops the trainer on every process. The probes and their starting values
    are in the checkpoint, so a resumed run compares against the same start.

    Contract: ``probes`` is a list of ``{"prompt": p, "solutions": [s, ...]}`` where each ``p`` and
    ``s`` is a string or a list of token ids; when None, the datamodule provides them with
    ``drift_probes(num_probes)``. The LightningModule has
    ``sequence_logprobs(prompts, completions) -> [N]`` (``SequenceLogprobs``), which receives the
    prompts and solutions as the probes hold them; it is checked in ``setup``, and its output's shape
    at every call.

    Args:
        probes: the probe set, at least one probe; None asks ``trainer.datamodule.drift_probes(num_probes)`` at fit start.
        num_probes: how many probes to ask the datamodule for.
        every_n_steps: how often to score the probes, in optimizer steps.
        min_entropy_ratio: alert below this fraction of the starting preference entropy.
        action: ``"warn"`` or ``"stop"``.

    Example::

        probes = [{"prompt": "2+2=", "solutions": ["2+2=4|4", "2+2=4, so|4"]}]
        trainer = Trainer(callbacks=[SolutionProbabilityDriftMonitor(probes=probes, every_n_steps=20)])
    """

    def __init__(
        self,
        probes: list[dict] | None = None,
        num_probes: int = 32,
        every_n_steps: int = 10,
        min_entropy_ratio: float = 0.1,
        action: Literal["warn", "stop"] = "warn",
    ) -> None:
        super().__init__()
        if probes is not None:
            if not probes:
                raise ValueError(
                    "SolutionProbabilityDriftMonitor: probes is an empty list; give at least one probe, or None to ask the datamodule"
                )
            self._check_probes(probes, "probes")
        if num_probes < 1 or every_n_steps < 1:
            raise ValueError(
                f"SolutionProbabilityDriftMonitor: num_probes and every_n_steps must be >= 1, got {num_probes} and {every_n_steps}"
            )
        if not 0 < min_entropy_ratio < 1:
            raise ValueError(f"SolutionProbabilityDriftMonitor: min_entropy_ratio must be in (0, 1), got {min_entropy_ratio}")
        if action not in ("warn", "stop"):
            raise ValueError(f"SolutionProbabilityDriftMonitor: action must be 'warn' or 'stop', got {action!r}")
        self.probes, self.num_probes, self.every_n_steps = probes, num_probes, every_n_steps
        self.min_entropy_ratio, self.action = min_entropy_ratio, action
        self.start_logprobs: Tensor | None = None
        self.start_entropy: float | None = None
        self.last: dict[str, float] = {}
        self.forgetting = False
        self.alert_steps: list[int] = []
        self._step = 0

    @property
    @override
    def state_key(self) -> str:
        return self._generate_state_key(
            num_probes=self.num_probes, every_n_steps=self.every_n_steps, min_entropy_ratio=self.min_entropy_ratio, action=self.action
        )

    @staticmethod
    def _check_probes(probes: Any, source: str) -> None:
        for index, probe in enumerate(probes):
            solutions = probe.get("solutions") if isinstance(probe, dict) else None
            if not (_is_sequence(probe.get("prompt")) and isinstance(solutions, list) and solutions and all(map(_is_sequence, solutions))):
                raise ValueError(
                    f"SolutionProbabilityDriftMonitor: {source}[{index}] must be a dict with a 'prompt' and a non-empty "
                    f"'solutions' list, each a string or a list of token ids, got {probe!r}"
                )

    def _score(self, trainer: "pl.Trainer", pl_module: "pl.LightningModule") -> Tensor:
        prompts = [p["prompt"] for p in self.probes for _ in p["solutions"]]
        solutions = [s for p in self.probes for s in p["solutions"]]
        with measuring(trainer, pl_module):
            logprobs = pl_module.sequence_logprobs(prompts, solutions)
        if not isinstance(logprobs, Tensor) or list(logprobs.shape) != [len(solutions)]:
            got = list(logprobs.shape) if isinstance(logprobs, Tensor) else type(logprobs).__name__
            raise ValueError(
                f"SolutionProbabilityDriftMonitor needs sequence_logprobs(...) to return shape [N] = [{len(solutions)}], got {got}"
            )
        return logprobs.detach().float().cpu()

    def _preference(self, logprobs: Tensor) -> tuple[list[float], list[float]]:
        """Per prompt with two or more solutions: ``|log-odds|`` of the first two, and the preference entropy."""
        log_odds, entropies, start = [], [], 0
        for probe in self.probes:
            count = len(probe["solutions"])
            scores = logprobs[start : start + count]
            start += count
            if count >= 2:
                log_odds.append(float((scores[0] - scores[1]).abs()))
                preference = torch.softmax(scores, 0)
                entropies.append(float(-(preference * preference.clamp(min=1e-30).log()).sum()))
        return log_odds, entropies

    @override
    def setup(self, trainer: "pl.Trainer", pl_module: "pl.LightningModule", stage: str) -> None:
        if not isinstance(pl_module, SequenceLogprobs):
            raise TypeError(
                f"SolutionProbabilityDriftMonitor needs {type(pl_module).__name__}.sequence_logprobs(prompts, completions) -> [N]; "
                "it has none"
            )

    @override
    def on_train_start(self, trainer: "pl.Trainer", pl_module: "pl.LightningModule") -> None:
        if self.probes is None:
            datamodule = trainer.datamodule
            if not hasattr(datamodule, "drift_probes"):
                raise ValueError(
                    "SolutionProbabilityDriftMonitor: pass probes=[...] or use a datamodule with drift_probes(num_probes)"
                )
            self.probes = datamodule.drift_probes(self.num_probes)
            self._check_probes(self.probes, "drift_probes()")
        if self.start_logprobs is None:
            self.start_logprobs = self._score(trainer, pl_module)
            _, entropies = self._preference(self.start_logprobs)
            self.start_entropy = sum(entropies) / len(entropies) if entropies else None

    @override
    def on_train_batch_start(self, trainer: "pl.Trainer", pl_module: "pl.LightningModule", batch: Any, batch_idx: int) -> None:
        self._step = trainer.global_step

    @override
    def on_train_batch_end(self, trainer: "pl.Trainer", pl_module: "pl.LightningModule", outputs: Any, batch: Any, batch_idx: int) -> None:
        if trainer.global_step == self._step or self._step % self.every_n_steps:
            return
        logprobs = self._score(trainer, pl_module)
        log_odds, entropies = self._preference(logprobs)
        self.last = {"logprob_change": float((logprobs - self.start_logprobs).mean())}
        if log_odds:
            self.last["log_odds"] = sum(log_odds) / len(log_odds)
            self.last["preference_entropy"] = sum(entropies) / len(entropies)
            if self.start_entropy:
                self.last["preference_entropy_ratio"] = self.last["preference_entropy"] / self.start_entropy
        if trainer.is_global_zero:
            for logger in trainer.loggers:
                logger.log_metrics({f"health/drift_{name}": value for name, value in self.last.items()}, step=self._step)
        ratio = self.last.get("preference_entropy_ratio")
        forgetting = trainer.strategy.reduce_boolean_decision(ratio is not None and ratio < self.min_entropy_ratio, all=False)
        if forgetting and not self.forgetting:
            self.alert_steps.append(self._step)
            rank_zero_warn(
                f"SolutionProbabilityDriftMonitor at step {self._step}: preference entropy among equivalent "
                f"solutions is {ratio:.3f} of its start (min_entropy_ratio={self.min_entropy_ratio})"
            )
        self.forgetting = forgetting
        if forgetting and self.action == "stop":
            trainer.should_stop = True

    @override
    def state_dict(self) -> dict[str, Any]:
        return {"probes": self.probes, "start_logprobs": self.start_logprobs, "start_entropy": self.start_entropy}

    @override
    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self.probes, self.start_logprobs = state_dict["probes"], state_dict["start_logprobs"]
        self.start_entropy = state_dict["start_entropy"]
