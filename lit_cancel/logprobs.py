"""Per-token log-probabilities and entropies of completion tokens, computed in chunks.

The language-model head is applied to a few positions at a time, so float32 logits for the whole
``batch x time x vocabulary`` never exist at once. Under autograd each chunk is checkpointed: its
logits are recomputed in the backward pass instead of being kept.
"""

import torch
from torch import Tensor, nn
from torch.utils.checkpoint import checkpoint


def position_ids_from_mask(attention_mask: Tensor) -> Tensor:
    """Positions that skip left padding, as Hugging Face ``generate`` assigns them."""
    return (attention_mask.long().cumsum(-1) - 1).clamp(min=0)


def _chunk_stats(hidden: Tensor, head: nn.Module, targets: Tensor, temperature: float) -> tuple[Tensor, Tensor]:
    logits = head(hidden).float() / temperature
    log_norm = torch.logsumexp(logits, dim=-1)
    logprobs = logits.gather(-1, targets.unsqueeze(-1)).squeeze(-1) - log_norm
    with torch.no_grad():
        probs = torch.softmax(logits, dim=-1)
        entropy = log_norm - (probs * logits).sum(-1)
    return logprobs, entropy


def completion_logprobs(
    model: nn.Module,
    input_ids: Tensor,
    attention_mask: Tensor,
    prompt_length: int,
    temperature: float = 1.0,
    chunk_size: int = 1024,
) -> tuple[Tensor, Tensor]:
    """Log-probabilities and entropies of the completion tokens ``input_ids[:, prompt_length:]``.

    Args:
        model: a Hugging Face causal LM (``get_decoder()`` and ``get_output_embeddings()``).
        input_ids: ``[B, P + C]``, prompts left-padded to ``P``, completions right-padded.
        attention_mask: ``[B, P + C]``, zero on padding.
        prompt_length: ``P``.
        temperature: logits are divided by it, as they were for sampling.
        chunk_size: number of token positions whose logits are materialised at once.

    Returns:
        ``(logprobs, entropy)``, each ``[B, C]`` float32. Entropy is detached. Values on padding
        positions are meaningless; mask them with the completion mask.
    """
    decoder, head = model.get_decoder(), model.get_output_embeddings()
    hidden = decoder(
        input_ids=input_ids,
        attention_mask=attention_mask,
        position_ids=position_ids_from_mask(attention_mask),
        use_cache=False,
    ).last_hidden_state
    # the state at position t predicts token t + 1
    hidden = hidden[:, prompt_length - 1 : -1]
    targets = input_ids[:, prompt_length:]
    batch, length, width = hidden.shape
    flat_hidden, flat_targets = hidden.reshape(-1, width), targets.reshape(-1)
    logprobs, entropies = [], []
    for start in range(0, flat_targets.numel(), chunk_size):
        piece = (flat_hidden[start : start + chunk_size], head, flat_targets[start : start + chunk_size], temperature)
        if torch.is_grad_enabled() and flat_hidden.requires_grad:
            lp, ent = checkpoint(_chunk_stats, *piece, use_reentrant=False)
        else:
            lp, ent = _chunk_stats(*piece)
        logprobs.append(lp)
        entropies.append(ent)
    # a copy, not a view: FSDP2 hooks the backward of a sharded root's output, and a view could be
    # modified in place behind the hook's back
    return torch.cat(logprobs).view(batch, length).clone(), torch.cat(entropies).view(batch, length)


def next_token_logprobs(model: nn.Module, input_ids: Tensor, attention_mask: Tensor, positions: Tensor, temperature: float = 1.0) -> Tensor:
    """``[N, V]`` log-distribution of the next token after each ``(row, position)`` of ``positions`` (``[N, 2]``)."""
    hidden = model.get_decoder()(
        input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids_from_mask(attention_mask), use_cache=False
    ).last_hidden_state
    logits = model.get_output_embeddings()(hidden[positions[:, 0], positions[:, 1]]).float() / temperature
    return torch.log_softmax(logits, dim=-1)
