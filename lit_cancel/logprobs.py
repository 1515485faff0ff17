"""Per-token log-probabilities and entropies of completion tokens, computed in chunks.

The language-model head is applied to a few positions at a time, so float32 logits for the whole
``batch x time x vocabulary`` never exist at once. Under autograd each chunk is checkpointed: its
logits are recomputed in the backward pass instead of being kept.

With a token budget (``max_tokens_per_chunk``) the decoder too runs in chunks: rows sorted by
completion length, each chunk cut to its own longest row, and the head sees completion tokens only.
With ``recompute_chunks`` each chunk's decoder pass is checkpointed too: the backward pass recomputes
one chunk at a time, so what autograd keeps grows with the budget and the completion tokens' final
states, not with every block's activations over the whole batch.
With ``pack=True`` each chunk is instead one row of its sequences laid end to end, positions starting
again at each, which Hugging Face attention reads as separate sequences (flash-attention attends within
each sequence only; SDPA and eager mask a block-diagonal attention over the whole chunk).
Where the loss's credits are known before the pass (an on-policy step of a loss whose credits do not depend on the
log-prob values), :func:`backward_by_chunk` sends each chunk's gradient back as soon as its forward ends: one chunk's
activations at a time, as with ``recompute_chunks``, without the recomputation.

Every decoder input is widened to a multiple of ``WIDTH_MULTIPLE`` tokens on the right (padding, or in a packed
row a filler sequence of its own), which no real token attends to. Kernel caches are keyed by matrix shape
(oneDNN compiles and keeps a kernel per shape for bfloat16 products on a CPU; cuBLAS and ``torch.compile`` choose
per shape on a GPU), and completion lengths change every step: widths in steps of 8 make the same few dozen
shapes recur instead of new ones piling up.
"""

from collections.abc import Callable

import torch
import torch.distributed as dist
from torch import Tensor, nn
from torch.utils.checkpoint import checkpoint

from lit_cancel.host_memory import release_free_heap
from lit_cancel.sharding import is_sharded

WIDTH_MULTIPLE = 8


def position_ids_from_mask(attention_mask: Tensor) -> Tensor:
    """Positions that skip left padding, as Hugging Face ``generate`` assigns them."""
    return (attention_mask.long().cumsum(-1) - 1).clamp(min=0)


def unpadded_span(attention_mask: Tensor, prompt_length: int) -> tuple[int, int]:
    """``(start, end)``: every row of ``attention_mask`` pads the columns before ``start`` and from ``end`` on.

    ``start <= prompt_length <= end``: cutting to ``[start, end)`` keeps every prompt and completion
    token, and the positions from :func:`position_ids_from_mask` of every kept token.
    """
    columns = attention_mask.bool().any(0).nonzero().squeeze(1).tolist()
    if not columns:
        return prompt_length, prompt_length
    return min(columns[0], prompt_length), max(columns[-1] + 1, prompt_length)


def widened(width: int) -> int:
    """``width`` rounded up to a multiple of ``WIDTH_MULTIPLE``: the width the decoder is run on."""
    return -(-width // WIDTH_MULTIPLE) * WIDTH_MULTIPLE


def _decoder_states(decoder: nn.Module, ids: Tensor, mask: Tensor | None, positions: Tensor) -> Tensor:
    """The decoder's last hidden states of ``ids`` (``[B, W]``), run on the rows widened on the right to
    :func:`widened` ``(W)`` columns: padding where there is a ``mask``, else (a packed row) a filler sequence."""
    width = ids.shape[1]
    extra = widened(width) - width
    if extra:
        ids = nn.functional.pad(ids, (0, extra))
        filler_positions = torch.arange(extra, device=positions.device).expand(len(positions), extra)
        positions = torch.cat([positions, filler_positions], 1)
        mask = None if mask is None else nn.functional.pad(mask, (0, extra))
    hidden = decoder(input_ids=ids, attention_mask=mask, position_ids=positions, use_cache=False).last_hidden_state
    return hidden[:, :width]


def _chunk_stats(hidden: Tensor, head: nn.Module, targets: Tensor, temperature: float) -> tuple[Tensor, Tensor]:
    logits = head(hidden).float() / temperature
    log_norm = torch.logsumexp(logits, dim=-1)
    logprobs = logits.gather(-1, targets.unsqueeze(-1)).squeeze(-1) - log_norm
    with torch.no_grad():
        probs = torch.softmax(logits, dim=-1)
        entropy = log_norm - (probs * logits).sum(-1)
    return logprobs, entropy


def _head_stats(hidden: Tensor, head: nn.Module, targets: Tensor, temperature: float, chunk_size: int) -> tuple[Tensor, Tensor]:
    """``(logprobs, entropy)``, each ``[N]``, of ``targets`` (``[N]``) after the states ``hidden`` (``[N, H]``)."""
    logprobs, entropies = [], []
    # no target (every episode of a micro-batch failed at its start) is still one pass of the head, on nothing: the loss
    # stays a function of every parameter, with a zero gradient
    for start in range(0, max(targets.numel(), 1), chunk_size):
        piece = (hidden[start : start + chunk_size], head, targets[start : start + chunk_size], temperature)
        if torch.is_grad_enabled() and hidden.requires_grad:
            lp, ent = checkpoint(_chunk_stats, *piece, use_reentrant=False)
        else:
            lp, ent = _chunk_stats(*piece)
        logprobs.append(lp)
        entropies.append(ent)
    return torch.cat(logprobs), torch.cat(entropies)


def completion_logprobs(
    model: nn.Module,
    input_ids: Tensor,
    attention_mask: Tensor,
    prompt_length: int,
    temperature: float = 1.0,
    chunk_size: int = 1024,
    max_tokens_per_chunk: int | None = None,
    pack: bool = False,
    recompute_chunks: bool = False,
) -> tuple[Tensor, Tensor]:
    """Log-probabilities and entropies of the completion tokens ``input_ids[:, prompt_length:]``.

    Args:
        model: a Hugging Face causal LM (``get_decoder()`` and ``get_output_embeddings()``).
        input_ids: ``[B, P + C]``, prompts left-padded to ``P``, completions right-padded.
        attention_mask: ``[B, P + C]``, zero on padding.
        prompt_length: ``P``.
        temperature: logits are divided by it, as they were for sampling.
        chunk_size: number of token positions whose logits are materialised at once.
        max_tokens_per_chunk: when set, the decoder runs on the rows sorted by completion length, in
            chunks of at most this many tokens (rows x the chunk's widest row, rounded up to a multiple of
            ``WIDTH_MULTIPLE``; a longer row is a chunk of its own), each chunk without the padding that all
            its rows share but for that rounding, and the head on completion tokens only. The values, and
            their gradient, are those of the whole batch.
        pack: with ``max_tokens_per_chunk``, run each chunk (consecutive rows, at most that many tokens in
            all, with the rounding) as one row of packed sequences, without padding but for a filler sequence
            of up to ``WIDTH_MULTIPLE - 1`` tokens at its end.
        recompute_chunks: with ``max_tokens_per_chunk``, under autograd keep only each chunk's inputs and the
            final states of its completion tokens, and run the chunk's decoder pass again in the backward
            pass (activation checkpointing by chunk).

    Returns:
        ``(logprobs, entropy)``, each ``[B, C]`` float32. Entropy is detached. Values on padding
        positions are meaningless (zero with ``max_tokens_per_chunk``); mask them with the completion mask.
    """
    if max_tokens_per_chunk is not None:
        return _chunked_logprobs(
            model, input_ids, attention_mask, prompt_length, temperature, chunk_size, max_tokens_per_chunk, pack, recompute_chunks,
        )
    decoder, head = model.get_decoder(), model.get_output_embeddings()
    hidden = _decoder_states(decoder, input_ids, attention_mask, position_ids_from_mask(attention_mask))
    # the state at position t predicts token t + 1
    hidden = hidden[:, prompt_length - 1 : -1]
    targets = input_ids[:, prompt_length:]
    batch, length, width = hidden.shape
    logprobs, entropy = _head_stats(hidden.reshape(-1, width), head, targets.reshape(-1), temperature, chunk_size)
    # a copy, not a view: FSDP2 hooks the backward of a sharded root's output, and a view could be
    # modified in place behind the hook's back
    return logprobs.view(batch, length).clone(), entropy.view(batch, length)


def length_sorted_chunks(attention_mask: Tensor, prompt_length: int, max_tokens: int) -> list[Tensor]:
    """Row indices of ``attention_mask`` by decreasing completion length, in chunks of at most ``max_tokens``
    tokens: rows x (longest prompt + longest completion of the chunk, :func:`widened`). A row longer than
    ``max_tokens`` is a chunk of its own."""
    prompt_lengths = attention_mask[:, :prompt_length].sum(1).tolist()
    completion_lengths = attention_mask[:, prompt_length:].sum(1)
    order = torch.argsort(completion_lengths, descending=True, stable=True).tolist()
    completion_lengths = completion_lengths.tolist()
    chunks, current, widest_prompt, widest_completion = [], [], 0, 0
    for row in order:
        prompt, completion = max(widest_prompt, prompt_lengths[row]), max(widest_completion, completion_lengths[row])
        if current and (len(current) + 1) * widened(prompt + completion) > max_tokens:
            chunks.append(current)
            current, prompt, completion = [], prompt_lengths[row], completion_lengths[row]
        current.append(row)
        widest_prompt, widest_completion = prompt, completion
    if current:
        chunks.append(current)
    return [torch.tensor(rows, device=attention_mask.device) for rows in chunks]


def token_budget_chunks(attention_mask: Tensor, max_tokens: int) -> list[Tensor]:
    """Row indices of ``attention_mask`` in order, in chunks of at most ``max_tokens`` unpadded tokens, :func:`widened`
    (a longer row alone)."""
    chunks, current, tokens = [], [], 0
    for row, length in enumerate(attention_mask.sum(1).tolist()):
        if current and widened(tokens + length) > max_tokens:
            chunks.append(current)
            current, tokens = [], 0
        current.append(row)
        tokens += length
    if current:
        chunks.append(current)
    return [torch.tensor(rows, device=attention_mask.device) for rows in chunks]


def _split_to(chunks: list[Tensor], count: int) -> list[Tensor]:
    """``chunks`` with the largest halved until there are ``count``."""
    chunks = list(chunks)
    while len(chunks) < count:
        largest = max(range(len(chunks)), key=lambda i: len(chunks[i]))
        if len(chunks[largest]) < 2:
            raise RuntimeError(
                f"a sharded model runs the decoder once per chunk in every process, here {count} times, but this "
                f"process has {sum(map(len, chunks))} rows; give every process as many rows"
            )
        chunks[largest : largest + 1] = chunks[largest].tensor_split(2)
    return chunks


def _chunked_logprobs(
    model: nn.Module, input_ids: Tensor, attention_mask: Tensor, prompt_length: int, temperature: float, chunk_size: int,
    max_tokens_per_chunk: int, pack: bool, recompute_chunks: bool,
) -> tuple[Tensor, Tensor]:
    """:func:`completion_logprobs` with the decoder in chunks (length-sorted, or packed) and the head on completion
    tokens only."""
    decoder, head = model.get_decoder(), model.get_output_embeddings()
    chunks = _chunks(attention_mask, prompt_length, max_tokens_per_chunk, pack)
    if dist.is_initialized() and any(is_sharded(module) for module in model.modules()):
        # each decoder call gathers every block's shards, and its backward reduces them: all processes make as many calls
        count = torch.tensor(len(chunks), device=attention_mask.device)
        dist.all_reduce(count, op=dist.ReduceOp.MAX)
        chunks = _split_to(chunks, int(count))
    chunk_states = _packed_states if pack else _padded_states
    recompute = recompute_chunks and torch.is_grad_enabled() and any(p.requires_grad for p in decoder.parameters())
    states, targets, rows, columns = [], [], [], []
    for ids, mask, completion_start, tokens, (chunk_rows, chunk_columns) in _chunk_inputs(chunks, input_ids, attention_mask, prompt_length):
        if recompute:
            chunk_out = checkpoint(chunk_states, decoder, ids, mask, completion_start, use_reentrant=False)
        else:
            chunk_out = chunk_states(decoder, ids, mask, completion_start)
        if chunk_out.requires_grad:
            _release_between_chunks(chunk_out)
        states.append(chunk_out)
        targets.append(ids[:, completion_start:][tokens])
        rows.append(chunk_rows)
        columns.append(chunk_columns)
    logprobs, entropy = _head_stats(torch.cat(states), head, torch.cat(targets), temperature, chunk_size)
    # back to the rows' own order and columns, zero on padding
    where = (torch.cat(rows), torch.cat(columns))
    shape = (len(input_ids), input_ids.shape[1] - prompt_length)
    return logprobs.new_zeros(shape).index_put(where, logprobs), entropy.new_zeros(shape).index_put(where, entropy)


def _chunks(attention_mask: Tensor, prompt_length: int, max_tokens_per_chunk: int, pack: bool) -> list[Tensor]:
    if pack:
        return token_budget_chunks(attention_mask, max_tokens_per_chunk)
    return length_sorted_chunks(attention_mask, prompt_length, max_tokens_per_chunk)


def _chunk_inputs(chunks: list[Tensor], input_ids: Tensor, attention_mask: Tensor, prompt_length: int):
    """For each chunk (row indices), its rows cut to their unpadded span: ``(ids, mask, completion_start, tokens,
    where)``, where the completions start in them, their completion tokens' mask, and those tokens' (rows, columns) in
    the batch's ``[B, C]`` completions."""
    completion = attention_mask[:, prompt_length:].bool()
    for chunk in chunks:
        start, end = unpadded_span(attention_mask[chunk], prompt_length)
        tokens = completion[chunk, : end - prompt_length]
        chunk_rows, chunk_columns = tokens.nonzero(as_tuple=True)
        where = (chunk[chunk_rows], chunk_columns)
        yield input_ids[chunk, start:end], attention_mask[chunk, start:end], prompt_length - start, tokens, where


def backward_by_chunk(
    model: nn.Module, input_ids: Tensor, attention_mask: Tensor, prompt_length: int, credits: Tensor,
    backward: Callable[[Tensor], None], temperature: float = 1.0, chunk_size: int = 1024, max_tokens_per_chunk: int = 1024,
    pack: bool = False,
) -> tuple[Tensor, Tensor, Tensor]:
    """The training pass of a loss whose credits are known before it (``-d loss / d logprobs``, ``credits``, ``[B, C]``):
    the decoder runs in :func:`completion_logprobs`'s chunks, and each chunk's surrogate ``-sum(credits x logprobs)``,
    whose gradient is the loss's on that chunk's tokens, goes to ``backward`` before the next chunk's forward. The pass
    keeps one chunk's activations at a time and recomputes nothing.

    Returns ``(logprobs, entropy)`` (``[B, C]``, detached, zero on padding) and the last chunk's surrogate, with its graph,
    for the caller to send back itself."""
    decoder, head = model.get_decoder(), model.get_output_embeddings()
    chunks = _chunks(attention_mask, prompt_length, max_tokens_per_chunk, pack)
    chunk_states = _packed_states if pack else _padded_states
    logprobs = torch.zeros(len(input_ids), input_ids.shape[1] - prompt_length, device=input_ids.device)
    entropy = torch.zeros_like(logprobs)
    surrogate = None
    for ids, mask, completion_start, tokens, where in _chunk_inputs(chunks, input_ids, attention_mask, prompt_length):
        if surrogate is not None:
            backward(surrogate)
            release_free_heap()
        states = chunk_states(decoder, ids, mask, completion_start)
        chunk_logprobs, chunk_entropy = _head_stats(states, head, ids[:, completion_start:][tokens], temperature, chunk_size)
        logprobs.index_put_(where, chunk_logprobs.detach().float())
        entropy.index_put_(where, chunk_entropy.float())
        surrogate = -(credits[where] * chunk_logprobs).sum()
    return logprobs, entropy, surrogate


def _release_between_chunks(states: Tensor) -> None:
    """Hands the heap's free pages back now, after a chunk's decoder pass, and again before that pass's backward.

    A chunk's pass allocates and frees activations of a few MiB around the inputs that checkpointing keeps, so glibc's
    heap fragments: without this, the freed pages of every chunk stay in the process and a training pass holds
    several times the memory it uses (host_memory.py)."""
    release_free_heap()
    states.register_hook(_release_before_backward)


def _release_before_backward(grad: Tensor) -> None:
    release_free_heap()


def _padded_states(decoder: nn.Module, ids: Tensor, mask: Tensor, prompt_length: int) -> Tensor:
    """The decoder's states that predict the completion tokens of ``ids`` (``[B, P + C]``, completions from ``prompt_length``),
    in row-major order, from the rows as given (padding included)."""
    hidden = _decoder_states(decoder, ids, mask, position_ids_from_mask(mask))
    # the state at position t predicts token t + 1
    return hidden[:, prompt_length - 1 : -1][mask[:, prompt_length:].bool()]


def _packed_states(decoder: nn.Module, ids: Tensor, mask: Tensor, prompt_length: int) -> Tensor:
    """The decoder's states that predict the completion tokens of ``ids`` (``[B, P + C]``, completions from ``prompt_length``),
    in row-major order, from one row holding the rows' unpadded tokens end to end."""
    kept = mask.bool()
    hidden = _decoder_states(decoder, ids[kept][None], None, position_ids_from_mask(mask)[kept][None])[0]
    # each kept token's index in the packed row; the state of the token before a completion token predicts it
    index = kept.flatten().long().cumsum(0).view(kept.shape) - 1
    predicts = index[:, prompt_length:][kept[:, prompt_length:]] - 1
    return hidden[predicts]


def next_token_logprobs(model: nn.Module, input_ids: Tensor, attention_mask: Tensor, positions: Tensor, temperature: float = 1.0) -> Tensor:
    """``[N, V]`` log-distribution of the next token after each ``(row, position)`` of ``positions`` (``[N, 2]``)."""
    hidden = model.get_decoder()(
        input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids_from_mask(attention_mask), use_cache=False
    ).last_hidden_state
    logits = model.get_output_embeddings()(hidden[positions[:, 0], positions[:, 1]]).float() / temperature
    return torch.log_softmax(logits, dim=-1)
