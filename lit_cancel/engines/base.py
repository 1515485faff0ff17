"""What every rollout engine is: a typed request in, sampled completions out.

An engine gets a :class:`SampleRequest` (left-padded prompts, samples per prompt, greedy or not, and the run's
:class:`SamplingOptions`) and the :class:`PolicyWeights` it samples with (the model, through its root, the tokenizer, the
optimizer steps taken); it returns :class:`Sampled`: the prompts followed by the completions and, where the engine
reports them, each sampled token's log-probability under the sampler. :meth:`RolloutEngine.sync` makes an engine that
keeps its own copy of the weights take the current ones.

* :class:`~lit_cancel.engines.decode_loop.DecodeLoop` (the default): lit_cancel's decode loop, where the model and the
  generation options allow it, else Hugging Face ``generate``;
  :class:`~lit_cancel.engines.decode_loop.HFGenerate`: Hugging Face ``generate``.
* :class:`~lit_cancel.engines.vllm_colocated.VLLMEngine`: a vLLM engine in the training process.
* :class:`~lit_cancel.engines.vllm_servers.VLLMServerEngine`: vLLM servers, the weights pushed to them.

The first two run the policy itself: their samples come from exactly the weights being trained,
so they report no sampling log-probs and need no sync. An engine that keeps its own copy of the
weights reports its sampling log-probs, so the objective can measure and correct the mismatch
(see :mod:`lit_cancel.objectives.corrections`).
"""

import threading
from abc import ABC, abstractmethod
from collections.abc import Callable, Iterator
from concurrent.futures import Future
from contextlib import contextmanager
from dataclasses import dataclass, field

import torch
from torch import Tensor, nn
from transformers import PreTrainedTokenizerBase

from lit_cancel.sharding import ModelRoot


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


@dataclass(frozen=True)
class SamplingOptions:
    """How an engine samples, the same at every call of a run: the policy module's options.

    Attributes:
        temperature: the sampling temperature.
        top_p: nucleus sampling threshold.
        max_new_tokens: the longest completion.
        stop_token_ids: a completion ends at its first of these tokens, which it keeps.
        pad_token_id: what follows a completion's stop token in its row.
        generation_kwargs: further ``GenerationConfig`` options, those the engine honours
            (:attr:`RolloutEngine.supported_options`).
    """

    temperature: float
    top_p: float
    max_new_tokens: int
    stop_token_ids: tuple[int, ...]
    pad_token_id: int
    generation_kwargs: dict = field(default_factory=dict)


@dataclass(frozen=True)
class SampleRequest:
    """``num_samples`` completions of each prompt, the rows of ``input_ids``.

    Attributes:
        input_ids: ``[B, P]`` left-padded prompts.
        attention_mask: ``[B, P]``.
        num_samples: completions per prompt.
        options: how to sample.
        greedy: the most likely token at every step instead of sampling.
        validation: the completions are a validation's (inside Lightning's validation loop), not a training round's;
            the engine is told when that validation ends (:meth:`RolloutEngine.release`).
        keep: more calls on the same weights follow at once (an agent's next turns): the engine may keep what it holds
            until :meth:`RolloutEngine.release`, called after the last of them.
    """

    input_ids: Tensor
    attention_mask: Tensor
    num_samples: int
    options: SamplingOptions
    greedy: bool = False
    validation: bool = False
    keep: bool = False


@dataclass(frozen=True)
class PolicyWeights:
    """The policy as an engine sees it.

    Attributes:
        root: the policy's :class:`~lit_cancel.sharding.ModelRoot`; an engine that runs the model calls it through the
            root (``root(fn, *args)``), which sharding needs.
        tokenizer: the policy's tokenizer, written beside a copy of the weights that an engine loads.
        step: the optimizer steps the weights have taken (the version an engine labels them with).
        device: where the policy's parameters are.
    """

    root: ModelRoot
    tokenizer: PreTrainedTokenizerBase
    step: int
    device: torch.device

    @property
    def model(self) -> nn.Module:
        """The Hugging Face (or peft) model."""
        return self.root.model

    @property
    def base_model(self) -> nn.Module:
        """The Hugging Face model without its LoRA adapters' wrapper: the configuration an engine starts from."""
        model = self.root.model
        return model.get_base_model() if hasattr(model, "get_base_model") else model


def in_background(function: Callable, *args) -> Future:
    """``function(*args)`` in a daemon thread: a trainer that stops does not wait for it (a server's answer, an episode)."""
    future: Future = Future()

    def run() -> None:
        try:
            future.set_result(function(*args))
        except BaseException as error:  # noqa: BLE001 - handed to the thread that reads the result
            future.set_exception(error)

    threading.Thread(target=run, daemon=True).start()
    return future


class RolloutEngine(ABC):
    """Samples completions of left-padded prompts for a :class:`~lit_cancel.PolicyModule`.

    Attributes:
        supported_options: the ``generation_kwargs`` the engine honours; None: every ``GenerationConfig`` option.
        holds_weights: the engine keeps its own copy of the weights, in its own dtype (vLLM): it syncs and samples
            with autocast off (:meth:`context`). False: it runs the policy, in the trainer's precision context.
        max_staleness: rounds of rollouts the engine may sample ahead of the trainer, with weights up to that many
            rounds old (:meth:`prefetch`); 0: every round is sampled by the weights it trains.
        can_sample_ahead: the engine implements :meth:`sample_ahead`, so that, sampling ahead, it takes the calls of a
            rollout that asks for several (an agent's turns), not only a draw's single completions (:meth:`prefetch`).
    """

    supported_options: frozenset[str] | None = None
    holds_weights: bool = False
    max_staleness: int = 0
    can_sample_ahead: bool = False

    @contextmanager
    def context(self, device: torch.device) -> Iterator[None]:
        """What ``PolicyModule.rollout`` syncs and samples in. An engine that runs the policy keeps the trainer's
        precision context (autocast under ``bf16-mixed``), the one old log-probs and the training step see, so the
        first importance ratio of a step is exactly 1; an engine that holds its own weights gets autocast turned off
        on the CPU and the policy's ``device``, so that it runs in its own dtype (and a LoRA merge for its push in the
        weights' dtype)."""
        if not self.holds_weights:
            yield
            return
        with torch.autocast("cpu", enabled=False), torch.autocast(device.type, enabled=False):
            yield

    @abstractmethod
    def sample(self, policy: PolicyWeights, request: SampleRequest) -> Sampled:
        """``request.num_samples`` completions of each prompt, sampled as ``request.options`` says, each ending at its
        first stop token (kept) or after ``max_new_tokens``."""

    def sync(self, policy: PolicyWeights) -> float:
        """Makes the engine sample from the policy's current weights; returns the seconds it took."""
        return 0.0

    def release(self) -> None:
        """Called when a series of calls ends that let the engine keep what it holds between them (a validation's,
        ``request.validation``; an agent's turns, ``request.keep``), before training goes on: the engine releases it
        here. Nothing by default."""
        return None

    def prefetch(self, policy: PolicyWeights, request: SampleRequest, seed: int, oldest_step: int) -> None:
        """Starts sampling, in the background, what :meth:`sample` will be asked for next under ``torch.manual_seed(seed)``,
        with weights of optimizer step ``oldest_step`` or later. Called only when :attr:`max_staleness` is above 0."""
        raise NotImplementedError(f"{type(self).__name__} samples on demand: its max_staleness is 0")

    def sample_ahead(self, request: SampleRequest, oldest_step: int, first_seed: int) -> Sampled:
        """Samples ``request`` now, from a background thread, with the weights the engine holds once they are of optimizer
        step ``oldest_step`` or later (it waits for them, never pushes), each row's step in ``steps``; prompt ``i`` is
        seeded ``first_seed + i * num_samples``. The producer calls it for each turn of an agent's episodes sampled ahead
        of the trainer (the engine's :meth:`prefetch` samples single completions ahead)."""
        raise NotImplementedError(f"{type(self).__name__} samples on demand: its max_staleness is 0")

    def check(self, policy: PolicyWeights, options: SamplingOptions | None) -> None:
        """Raises ValueError, in one line naming the option to change, when the engine cannot serve the policy as
        configured; the CLI calls it at start-up, before the engine starts (an engine may call it again as it starts, with
        ``options`` None). Nothing to check by default."""
        return None
