"""What a rollout engine's samples become: token ids cut at their first stop token, masks, texts and the sampler's log-probs."""

from collections.abc import Sequence
from dataclasses import dataclass, field, replace

import torch
from torch import Tensor, nn
from transformers import PreTrainedTokenizerBase

from lit_cancel.engines import Sampled


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
