"""The sample stage: a draw's completions, from the policy's engine, sampled when the round asks for them or ahead of it.

A task's ``rollout`` asks the policy (a :class:`RolloutPolicy`) for completions; what the engine samples becomes a
:class:`Generation`: token ids cut at their first stop token, masks, texts and the sampler's log-probs. Rollouts sampled
ahead of the trainer, in a background thread, see the policy as an :class:`AheadPolicy`.
"""

import copy
import functools
import inspect
import random
import threading
import time
from abc import ABC, abstractmethod
from collections.abc import Callable, Sequence
from concurrent.futures import Future
from contextlib import AbstractContextManager
from dataclasses import dataclass, field, replace
from typing import Protocol

import torch
from torch import Tensor, nn
from transformers import PreTrainedTokenizerBase

from lit_cancel.engines import PolicyWeights, RolloutEngine, Sampled, SampleRequest, SamplingOptions
from lit_cancel.host_memory import release_free_heap
from lit_cancel.objectives import Objective
from lit_cancel.rounds.failures import Failure
from lit_cancel.sharding import ModelRoot, gathered


def stop_token_ids(model: nn.Module, tokenizer: PreTrainedTokenizerBase) -> list[int]:
    """The tokens that end a completion: the tokenizer's EOS, then every ``eos_token_id`` of the model's generation
    config (an id or a list: Qwen2.5-Instruct's lists ``<|im_end|>``, which is also its tokenizer's EOS, and
    ``<|endoftext|>``), each once."""
    declared = getattr(getattr(model, "generation_config", None), "eos_token_id", None)
    declared = [declared] if isinstance(declared, int) else list(declared or [])
    return list(dict.fromkeys(int(token) for token in [tokenizer.eos_token_id, *declared] if token is not None))


@dataclass
class Generation:
    """Completions sampled for a batch of prompts; row ``i * n + k`` is sample ``k`` of prompt ``i``.

    Attributes:
        input_ids: ``[B * n, P + C]`` prompts (left-padded) followed by completions (right-padded).
        attention_mask: ``[B * n, P + C]``.
        completion_mask: ``[B * n, C]``, one up to and including the first stop token.
        prompt_length: ``P``.
        texts: decoded completions, special tokens and the stop token removed.
        sampler_logprobs: ``[B * n, C]`` each sampled token's log-prob under the engine that sampled it,
            0 after the completion; None when the engine is the policy itself.
        sync_seconds: seconds spent pushing weights to the engine before sampling.
        sampler_steps: ``[B * n]`` the optimizer step of the weights that sampled each row (an engine on separate
            servers reports it); None when the engine samples with the current weights.
        stats: the engine's own ``rollout/...`` and ``perf/...`` statistics of the call.
        rewards: ``[B * n]`` rewards the rollouts already have (an agent's environment scored its episode), NaN where
            the task's reward scores the text; None when none has one.
        failures: ``[B * n]`` why each agent's episode failed, None where it ran (:mod:`lit_cancel.rounds.failures`); a
            failed row has no policy token in ``completion_mask``. None for rollouts that cannot fail (single completions).
    """

    input_ids: Tensor
    attention_mask: Tensor
    completion_mask: Tensor
    prompt_length: int
    texts: list[str]
    sampler_logprobs: Tensor | None = None
    sync_seconds: float = 0.0
    sampler_steps: Tensor | None = None
    stats: dict[str, float] = field(default_factory=dict)
    rewards: Tensor | None = None
    failures: list[Failure | None] | None = None

    def to(self, device: torch.device) -> "Generation":
        """The same completions with their tensors on ``device``."""
        moved = {name: getattr(self, name).to(device) for name in ("input_ids", "attention_mask", "completion_mask", "sampler_logprobs",
                                                                   "sampler_steps", "rewards") if getattr(self, name) is not None}
        return replace(self, **moved)

    @classmethod
    def from_sampled(
        cls, sampled: Sampled, attention_mask: Tensor, num_samples: int, tokenizer: PreTrainedTokenizerBase, sync_seconds: float,
        stop_token_ids: Sequence[int],
    ) -> "Generation":
        """The completions of ``sampled`` cut after their first token of ``stop_token_ids`` (padding after it), with
        their masks and texts."""
        prompt_length = attention_mask.shape[1]
        completions = sampled.sequences[:, prompt_length:]
        is_stop = torch.isin(completions, torch.tensor(list(stop_token_ids), device=completions.device))
        # one up to and including the first stop token
        completion_mask = (is_stop.long().cumsum(1) - is_stop.long()) == 0
        completions = completions.masked_fill(~completion_mask, tokenizer.pad_token_id)
        prompt_mask = attention_mask.repeat_interleave(num_samples, dim=0)
        sampler_logprobs = None if sampled.logprobs is None else sampled.logprobs.masked_fill(~completion_mask, 0.0)
        return cls(
            input_ids=torch.cat([sampled.sequences[:, :prompt_length], completions], dim=1),
            attention_mask=torch.cat([prompt_mask, completion_mask.long()], dim=1),
            completion_mask=completion_mask.long(),
            prompt_length=prompt_length,
            # a stop token the generation config declares need not be a special token
            texts=tokenizer.batch_decode(completions.masked_fill(is_stop, tokenizer.pad_token_id), skip_special_tokens=True),
            sampler_logprobs=sampler_logprobs,
            sync_seconds=sync_seconds,
            sampler_steps=sampled.steps,
            stats=sampled.stats,
        )


def encode_completions(tokenizer: PreTrainedTokenizerBase, texts: list[str]) -> tuple[Tensor, Tensor]:
    """``(ids, mask)``, each ``[N, C]``: every text's tokens followed by EOS, right-padded."""
    pieces = [tokenizer(text, add_special_tokens=False)["input_ids"] + [tokenizer.eos_token_id] for text in texts]
    return padded(pieces, tokenizer.pad_token_id, left=False)


def padded(pieces: list[list[int]], pad_id: int, left: bool) -> tuple[Tensor, Tensor]:
    """``(ids, mask)``, each ``[N, W]``: token-id sequences padded on the left (prompts) or the right."""
    width = max(map(len, pieces))
    ids = torch.full((len(pieces), width), pad_id)
    mask = torch.zeros((len(pieces), width), dtype=torch.long)
    for row, piece in enumerate(pieces):
        columns = slice(width - len(piece), width) if left else slice(0, len(piece))
        ids[row, columns], mask[row, columns] = torch.tensor(piece, dtype=torch.long), 1
    return ids, mask


class RolloutPolicy(Protocol):
    """What the producer needs of the policy it samples (:class:`~lit_cancel.RLModule` is one): its tokenizer, stop
    tokens, engine and device, the objective whose advantage estimator turns each group's rewards into advantages, and
    the calls below."""

    tokenizer: PreTrainedTokenizerBase
    stop_token_ids: list[int]
    engine: RolloutEngine
    device: torch.device
    objective: Objective

    def sampling_options(self) -> SamplingOptions:
        """How the engine samples."""

    def policy_weights(self) -> PolicyWeights:
        """The policy as the engine sees it."""

    def precision_context(self) -> AbstractContextManager:
        """The trainer's precision context, in which rollouts and their log-probs are computed as the training step's."""

    def rollout(self, input_ids: Tensor, attention_mask: Tensor, num_samples: int = 1, greedy: bool = False,
                max_new_tokens: int | None = None, keep_engine: bool = False) -> Generation:
        """Completions of left-padded prompts, sampled by the engine with the current weights, each at most
        ``max_new_tokens`` long (the policy's own limit when None; an agent's episode sets each turn's); ``keep_engine``:
        more calls follow at once (an agent's turns), released by :meth:`release_engine` after the last."""

    def release_engine(self) -> None:
        """Lets the engine release what it kept through calls made with ``keep_engine``."""

    def sync_engine(self) -> float:
        """Gives the engine the current weights where it holds older ones; returns the seconds it took."""

    def score_rollouts(self, generation: Generation, with_old_logprobs: bool) -> tuple[Tensor | None, Tensor | None]:
        """``(old_logprobs, ref_logprobs)`` of fresh completions; None where the objective needs none."""


class RolloutsStopped(RuntimeError):
    """Rollouts sampled ahead were stopped: the producer no longer wants them."""


class Sampler(ABC):
    """A policy as a task's rollout calls it: :meth:`rollout` puts each call to the engine as a :class:`SampleRequest`
    and makes what comes back a :class:`Generation`; each kind of sampler says how a request is sampled (:meth:`sample`).

    Attributes:
        keeps_engine: calls made with ``keep_engine`` let the engine keep what it holds until :meth:`release_engine`.
    """

    tokenizer: PreTrainedTokenizerBase
    stop_token_ids: list[int]
    keeps_engine: bool = True

    @abstractmethod
    def sampling_options(self) -> SamplingOptions:
        """How the engine samples."""

    @abstractmethod
    def sample(self, request: SampleRequest) -> tuple[Sampled, float]:
        """The engine's samples of ``request``, and the seconds spent pushing the policy's weights to it first."""

    def validating(self) -> bool:
        """The calls are a validation's (:attr:`SampleRequest.validation`)."""
        return False

    def rollout(self, input_ids: Tensor, attention_mask: Tensor, num_samples: int = 1, greedy: bool = False,
                max_new_tokens: int | None = None, keep_engine: bool = False) -> Generation:
        """Samples ``num_samples`` completions of each left-padded prompt with the engine, each ending at its first stop token
        or after ``max_new_tokens`` (the policy's when None); with ``keep_engine`` more calls follow at once (an agent's
        turns), and the engine may keep what it holds until :meth:`release_engine`."""
        options = self.sampling_options()
        if max_new_tokens is not None:
            options = replace(options, max_new_tokens=max_new_tokens)
        request = SampleRequest(input_ids, attention_mask, num_samples, options, greedy, self.validating(),
                                keep_engine and self.keeps_engine)
        sampled, sync_seconds = self.sample(request)
        return Generation.from_sampled(sampled, attention_mask, num_samples, self.tokenizer, sync_seconds, self.stop_token_ids)

    def release_engine(self) -> None:
        """Lets the engine release what it kept through calls made with ``keep_engine``; nothing by default."""
        return None


class PolicySampling(Sampler):
    """How a :class:`~lit_cancel.PolicyModule` samples: its engine, given the module's current weights where it holds older
    ones, samples with the module's options, in the trainer's precision context; the engine keeps what it holds through a
    validation, and through the turns of an agent's episodes."""

    policy: ModelRoot
    engine: RolloutEngine
    temperature: float
    top_p: float
    max_new_tokens: int
    generation_kwargs: dict
    # optimizer steps and checkpoint loads change the weights (weights_version); the engine holds engine_version
    weights_version: int
    engine_version: int | None

    @torch.no_grad()
    def sample(self, request: SampleRequest) -> tuple[Sampled, float]:
        # the KV cache would otherwise come on top of the host memory the last training pass freed (host_memory.py)
        release_free_heap()
        was_training = self.policy.training
        self.policy.eval()
        policy = self.policy_weights()
        sync_seconds = self.sync_engine()
        with gathered(self.policy), self.engine.context(self.device):
            sampled = self.engine.sample(policy, request)
        self.policy.train(was_training)
        # an engine may push the weights again itself (VLLMEngine after a sleep that discarded them)
        return sampled, sync_seconds + sampled.sync_seconds

    def sync_engine(self) -> float:
        """Gives the engine the current weights where it holds older ones; the seconds it took. A rollout does it first;
        the producer also calls it before it collects rollouts sampled ahead, so that their engine gets each new version."""
        if self.engine_version == self.weights_version:
            return 0.0
        with self.engine.context(self.device):
            seconds = self.engine.sync(self.policy_weights())
        self.engine_version = self.weights_version
        return seconds

    def sampling_options(self) -> SamplingOptions:
        """How the engine samples: the module's temperature, top-p, completion length, stop tokens and generation options."""
        return SamplingOptions(
            self.temperature, self.top_p, self.max_new_tokens, tuple(self.stop_token_ids), self.tokenizer.pad_token_id,
            self.generation_kwargs,
        )

    def policy_weights(self) -> PolicyWeights:
        """The policy as the engine sees it: its model (through the root), tokenizer, optimizer steps and device."""
        return PolicyWeights(self.policy, self.tokenizer, self.global_step, self.device)

    def precision_context(self) -> AbstractContextManager:
        """The trainer's precision context (autocast under ``bf16-mixed``), in which rollouts and their log-probs are
        computed as the training step computes its own."""
        return self.trainer.precision_plugin.forward_context()

    def validating(self) -> bool:
        """Inside Lightning's validation loop, which ends with ``on_validation_end``."""
        return self._trainer is not None and (self.trainer.validating or self.trainer.sanity_checking)

    def release_engine(self) -> None:
        """Lets the engine release what it kept through calls made with ``keep_engine``; in a validation it keeps it until
        the validation ends."""
        if not self.validating():
            self.engine.release()


class AheadPolicy(Sampler):
    """The policy as a task's rollouts sampled ahead of the trainer, in a background thread, see it: each call is
    sampled by the engine with the weights it holds of optimizer step ``oldest_step`` or later, waiting for them but
    never pushing (:meth:`~lit_cancel.engines.RolloutEngine.sample_ahead`), each row's step recorded, nothing kept
    between calls; seeds come from ``rng``, not torch's generator, which training uses meanwhile. It decodes with its own
    copy of the tokenizer, and raises :class:`RolloutsStopped` at a call once ``stopping`` is set.
    """

    keeps_engine = False

    def __init__(self, policy: RolloutPolicy, oldest_step: int, rng: random.Random, stopping: threading.Event) -> None:
        self.engine, self.oldest_step, self.rng, self.stopping = policy.engine, oldest_step, rng, stopping
        self.tokenizer = copy.deepcopy(policy.tokenizer)
        self.stop_token_ids = list(policy.stop_token_ids)
        self.options = policy.sampling_options()

    def sampling_options(self) -> SamplingOptions:
        return self.options

    def sample(self, request: SampleRequest) -> tuple[Sampled, float]:
        if self.stopping.is_set():
            raise RolloutsStopped("the producer stopped the rollouts it sampled ahead")
        return self.engine.sample_ahead(request, self.oldest_step, self.rng.randrange(2**30)), 0.0


def encode_prompts(tokenizer: PreTrainedTokenizerBase, records: list[dict]) -> dict:
    """Left-padded prompt ids and mask of ``records``, and the records themselves."""
    encoded = tokenizer([r["prompt"] for r in records], return_tensors="pt", padding=True)
    return {"input_ids": encoded["input_ids"], "attention_mask": encoded["attention_mask"], "records": records}


def named_rollout(rollout: Callable[..., Generation], names: Sequence[str]) -> Callable[..., Generation]:
    """A task's ``rollout`` told how messages name its records (``names``, :func:`~lit_cancel.rounds.draw.record_names`),
    where it takes them: a ``rollout`` written without ``names`` is called as it was."""
    parameters = inspect.signature(rollout).parameters.values()
    if any(p.name == "names" or p.kind is inspect.Parameter.VAR_KEYWORD for p in parameters):
        return functools.partial(rollout, names=names)
    return rollout


def sample_groups(policy: RolloutPolicy, rollout: Callable[..., Generation], records: list[dict], group_size: int, seed: int,
                  sampled_ahead: Future | None = None) -> tuple[Generation, float]:
    """``group_size`` rollouts of each of ``records`` by ``rollout`` (the task's), and the seconds spent sampling them.

    Rows ``i * G .. i * G + G - 1`` are the group of ``records[i]``. Sampling is seeded by ``seed`` without touching the
    global random state, and runs in the trainer's precision context, as the training step does, so that the step's
    first importance ratios are exactly 1. ``sampled_ahead``: the draw's rollouts, sampled in the background
    (:meth:`~lit_cancel.rounds.producer.RolloutProducer.prefetch`); the seconds spent are those waited for them.
    """
    started = time.perf_counter()
    if sampled_ahead is not None:
        generation = sampled_ahead.result().to(policy.device)
    else:
        prompts = encode_prompts(policy.tokenizer, records)
        with torch.random.fork_rng(devices=[policy.device] if policy.device.type == "cuda" else []), policy.precision_context():
            torch.manual_seed(seed)
            generation = rollout(policy, records, prompts["input_ids"].to(policy.device), prompts["attention_mask"].to(policy.device),
                                 group_size)
    return generation, time.perf_counter() - started
