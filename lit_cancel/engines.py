"""Rollout engines: what samples completions for the policy module.

One interface: left-padded prompts in; the prompts followed by sampled completions (and, where the
engine reports them, each sampled token's log-probability under the sampler) out; ``sync`` after
the policy's weights changed. ``PolicyModule`` calls the engine for rollouts and for validation.

* :class:`DecodeLoop` (the default): lit_cancel's decode loop (:mod:`lit_cancel.decoding`), where
  the model and the generation options allow it, else Hugging Face ``generate``.
* :class:`HFGenerate`: Hugging Face ``generate``.
* :class:`lit_cancel.vllm_engine.VLLMEngine`: a vLLM engine in the training process.

The first two run the policy itself: their samples come from exactly the weights being trained,
so they report no sampling log-probs and need no sync. An engine that keeps its own copy of the
weights reports its sampling log-probs, so the objective can measure and correct the mismatch
(see :mod:`lit_cancel.objectives.corrections`).
"""

from abc import ABC, abstractmethod
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field

import torch
from torch import Tensor, nn
from transformers import GenerationConfig

from lit_cancel.decoding import logits_processors, sample_completions, supports_decode_loop


@dataclass
class Sampled:
    """What an engine returns for ``B`` prompts and ``n`` samples each; row ``i * n + k`` is sample ``k`` of prompt ``i``.

    Attributes:
        sequences: ``[B * n, P + C]`` the prompts as given (left-padded to ``P``), then the completions,
            right-padded with the tokenizer's pad id after their stop token.
        logprobs: ``[B * n, C]`` log-probability of each sampled token under the sampler's distribution
            (after temperature, top-k, top-p), 0 after the completion; None when the sampler is the policy itself.
        sync_seconds: seconds spent pushing the policy's weights to the engine before sampling.
        steps: ``[B * n]`` the optimizer step of the weights that sampled each row, for an engine whose weights may
            lag the trainer's (:class:`~lit_cancel.VLLMServerEngine`); None: the current weights.
        stats: the engine's own statistics of the call (``perf/...``, ``rollout/...``), logged with the round's.
    """

    sequences: Tensor
    logprobs: Tensor | None = None
    sync_seconds: float = 0.0
    steps: Tensor | None = None
    stats: dict[str, float] = field(default_factory=dict)


class RolloutEngine(ABC):
    """Samples completions of left-padded prompts for a :class:`~lit_cancel.PolicyModule`.

    Attributes:
        supported_options: the ``generation_kwargs`` the engine honours; None: every ``GenerationConfig`` option.
        holds_weights: the engine keeps its own copy of the weights, in its own dtype (vLLM): it syncs and samples
            with autocast off (:meth:`context`). False: it runs the policy, in the trainer's precision context.
        max_staleness: rounds of rollouts the engine may sample ahead of the trainer, with weights up to that many
            rounds old (:meth:`prefetch`); 0: every round is sampled by the weights it trains.
    """

    supported_options: frozenset[str] | None = None
    holds_weights: bool = False
    max_staleness: int = 0

    @contextmanager
    def context(self, module) -> Iterator[None]:
        """What ``PolicyModule.rollout`` syncs and samples in. An engine that runs the policy keeps the trainer's
        precision context (autocast under ``bf16-mixed``), the one old log-probs and the training step see, so the
        first importance ratio of a step is exactly 1; an engine that holds its own weights gets autocast turned off
        on the CPU and the module's device, so that it runs in its own dtype (and a LoRA merge for its push in the
        weights' dtype)."""
        if not self.holds_weights:
            yield
            return
        with torch.autocast("cpu", enabled=False), torch.autocast(module.device.type, enabled=False):
            yield

    @abstractmethod
    def sample(self, module, input_ids: Tensor, attention_mask: Tensor, num_samples: int, greedy: bool) -> Sampled:
        """``num_samples`` completions of each prompt, with the module's sampling options, each ending at its first
        token of ``module.stop_token_ids`` (kept) or after ``max_new_tokens``.

        Args:
            module: the policy module: its ``policy`` (a :class:`~lit_cancel.sharding.ModelRoot`),
                ``tokenizer``, ``stop_token_ids``, ``temperature``, ``top_p``, ``max_new_tokens`` and ``generation_kwargs``.
            input_ids: ``[B, P]`` left-padded prompts.
            attention_mask: ``[B, P]``.
            num_samples: completions per prompt.
            greedy: the most likely token at every step instead of sampling.
        """

    def sync(self, module) -> float:
        """Makes the engine sample from the module's current weights; returns the seconds it took."""
        return 0.0

    def prefetch(self, module, input_ids: Tensor, attention_mask: Tensor, num_samples: int, seed: int, oldest_step: int) -> None:
        """Starts sampling, in the background, what :meth:`sample` will be asked for next under ``torch.manual_seed(seed)``,
        with weights of optimizer step ``oldest_step`` or later. Called only when :attr:`max_staleness` is above 0."""
        raise NotImplementedError(f"{type(self).__name__} samples on demand: its max_staleness is 0")

    def check(self, module) -> None:
        """Raises ValueError, in one line naming the option to change, when the engine cannot serve the module as
        configured; the CLI calls it at start-up, before the engine starts. Nothing to check by default."""
        return None


class HFGenerate(RolloutEngine):
    """Hugging Face ``generate`` on the policy, with the module's options and ``generation_kwargs``."""

    def sample(self, module, input_ids: Tensor, attention_mask: Tensor, num_samples: int, greedy: bool) -> Sampled:
        sampling = {} if greedy else {"temperature": module.temperature, "top_p": module.top_p, "top_k": 0}
        config = GenerationConfig(
            do_sample=not greedy,
            max_new_tokens=module.max_new_tokens,
            num_return_sequences=num_samples,
            pad_token_id=module.tokenizer.pad_token_id,
            eos_token_id=list(module.stop_token_ids),
            **{**sampling, **module.generation_kwargs},
        )
        sequences = module.policy(_generate, input_ids=input_ids, attention_mask=attention_mask, generation_config=config)
        return Sampled(sequences)


def _generate(model: nn.Module, **kwargs) -> Tensor:
    return model.generate(**kwargs)


class DecodeLoop(HFGenerate):
    """lit_cancel's decode loop (one prefill per prompt, a cache written in place, finished rows dropped).

    Models outside :data:`~lit_cancel.decoding.DECODE_LOOP_MODEL_TYPES`, generation options outside
    :data:`~lit_cancel.decoding.DECODE_LOOP_OPTIONS` are sampled with ``generate`` instead; greedy
    decoding gives the same tokens either way.
    """

    def sample(self, module, input_ids: Tensor, attention_mask: Tensor, num_samples: int, greedy: bool) -> Sampled:
        if not supports_decode_loop(module.policy.model, module.generation_kwargs):
            return super().sample(module, input_ids, attention_mask, num_samples, greedy)
        processors = logits_processors(module.generation_kwargs, module.temperature, module.top_p, greedy)
        sequences = module.policy(
            sample_completions, input_ids, attention_mask, num_samples, module.max_new_tokens,
            module.stop_token_ids, module.tokenizer.pad_token_id, processors, greedy,
        )
        return Sampled(sequences)
