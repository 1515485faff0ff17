"""The decode loop's KV cache kept from one call to the next: an agent's turns, each continuing the contexts of the last.

Each turn continues every running episode from its own tokens: the prompt, the turns sampled so far, the environment's
replies. Without a kept cache every turn prefills every context again. :class:`KeptCache` keeps, after a call, each
row's keys and values at its tokens (pads left out; a sampled stop token is in it if the loop wrote it), and at the next
call starts each new row from the kept row that shares the longest prefix with it: only the tokens after that prefix
are prefilled (the environment's reply, and the turn's last token if the loop had not written it). Rows are matched by
their tokens, not by their place: episodes that ended are gone from the next call, and a row that matches none is
prefilled whole.

Kept keys already carry their positions (rotary embeddings): row ``i``'s kept keys go to the last ``r_i`` columns
before the new tokens, the new tokens are left-padded after them, and the positions come from the attention mask as
everywhere else (``r_i`` kept columns count as ``r_i`` tokens), so the new tokens continue from ``r_i``. The masked pad
columns between the two parts change nothing.
"""

from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch
from torch import Tensor
from transformers.cache_utils import Cache

from lit_cancel.logprobs import position_ids_from_mask


@dataclass
class Prefill:
    """What the decode loop runs first.

    Attributes:
        cache: holds the kept keys and values, ``[B, ., R, .]`` per layer (empty when nothing was reused).
        input_ids: ``[B, M]`` the tokens to prefill, left-padded.
        attention_mask: ``[B, R + M]`` the cache's columns, then ``input_ids``'.
        position_ids: ``[B, M]``.
        reused_tokens: context tokens read from the kept cache instead of prefilled.
    """

    cache: Cache
    input_ids: Tensor
    attention_mask: Tensor
    position_ids: Tensor
    reused_tokens: int = 0

    @classmethod
    def whole(cls, new_cache: Callable[[int], Cache], input_ids: Tensor, attention_mask: Tensor, max_new_tokens: int) -> "Prefill":
        """Every token of ``input_ids`` prefilled, into ``new_cache(capacity)``."""
        return cls(new_cache(input_ids.shape[1] + max_new_tokens), input_ids, attention_mask, position_ids_from_mask(attention_mask))


@dataclass
class KeptRow:
    """One row's tokens and, per layer, its keys and values at them (``[heads, len(tokens), head_dim]``)."""

    tokens: Tensor
    keys: list[Tensor]
    values: list[Tensor]


class KeptCache:
    """The rows of the last call that kept its cache, and what the call in progress keeps (:meth:`keep`).

    Valid for the weights that wrote it: the engine makes a new one when the optimizer step changes, and drops it at a
    call without ``keep``, at :meth:`~lit_cancel.engines.RolloutEngine.sync` and at
    :meth:`~lit_cancel.engines.RolloutEngine.release`.

    Args:
        step: the optimizer step of the weights whose keys and values it holds.
    """

    def __init__(self, step: int):
        self.step = step
        self.rows: list[KeptRow] = []
        self.reused_tokens = 0  # context tokens the last call read from the kept cache instead of prefilling
        self._kept_tokens = None  # [rows, longest] the kept rows' tokens, -1 after each row's end, to match against

    def prefill(self, new_cache: Callable[[int], Cache], input_ids: Tensor, attention_mask: Tensor, num_samples: int,
                max_new_tokens: int, stop_token_ids: Sequence[int], pad_token_id: int) -> Prefill:
        """The prefill of ``input_ids`` (left-padded), each row started from its longest match among the kept rows, into
        ``new_cache(capacity)``; readies :meth:`keep` for this call's ``num_samples`` completions of each row."""
        contexts = [ids[mask.bool()] for ids, mask in zip(input_ids, attention_mask)]
        matches = [self._longest_match(context) for context in contexts]
        reused = [count for _, count in matches]
        if max(reused, default=0) == 0:
            prefill = Prefill.whole(new_cache, input_ids, attention_mask, max_new_tokens)
        else:
            kept_width = max(reused)
            new_width = max(len(context) - count for context, count in zip(contexts, reused))
            new_ids = input_ids.new_full((len(contexts), new_width), pad_token_id)
            mask = attention_mask.new_zeros(len(contexts), kept_width + new_width)
            for row, (context, count) in enumerate(zip(contexts, reused)):
                new_ids[row, new_width - (len(context) - count) :] = context[count:]
                mask[row, kept_width - count : kept_width] = 1
                mask[row, kept_width + new_width - (len(context) - count) :] = 1
            cache = new_cache(kept_width + new_width + max_new_tokens)
            for index, layer in enumerate(cache.layers):
                layer.update(*(right_aligned([getattr(row, part)[index] if row else None for row, _ in matches], reused, kept_width)
                               for part in ("keys", "values")))
            prefill = Prefill(cache, new_ids, mask, position_ids_from_mask(mask)[:, kept_width:], sum(reused))
        self._contexts, self._num_samples, self._prompt_length = contexts, num_samples, input_ids.shape[1]
        self._stops = torch.tensor(list(stop_token_ids), dtype=input_ids.dtype, device=input_ids.device)
        self._prefill_columns = [row_mask.bool().nonzero().squeeze(1) for row_mask in prefill.attention_mask]
        self._prefilled = prefill.attention_mask.shape[1]
        self._pending: list[KeptRow] = []
        self.reused_tokens = prefill.reused_tokens
        self.rows, self._kept_tokens = [], None  # copied into the new cache: the call keeps its own rows
        return prefill

    def keep(self, cache: Cache, batch_rows: Tensor, sequence_rows: Tensor, sequences: Tensor) -> None:
        """Keeps rows ``batch_rows`` of ``cache``, rows ``sequence_rows`` of the call's ``sequences``, before they leave
        the batch or the call ends: their context's tokens and the completion tokens the loop wrote, up to the first
        stop token."""
        written = cache.layers[0].get_seq_length() - self._prefilled
        for row, sequence_row in zip(batch_rows.tolist(), sequence_rows.tolist()):
            completion = sequences[sequence_row, self._prompt_length : self._prompt_length + written]
            stops = torch.isin(completion, self._stops).nonzero()
            count = int(stops[0]) + 1 if len(stops) else len(completion)
            prompt_row = sequence_row // self._num_samples
            columns = torch.cat([self._prefill_columns[prompt_row], self._prefilled + torch.arange(count, device=completion.device)])
            self._pending.append(KeptRow(
                torch.cat([self._contexts[prompt_row], completion[:count]]),
                [layer.keys[row][:, columns] for layer in cache.layers],
                [layer.values[row][:, columns] for layer in cache.layers],
            ))

    def end_call(self, cache: Cache, sequence_rows: Tensor, sequences: Tensor) -> None:
        """Keeps the rows still in ``cache`` (rows ``sequence_rows`` of ``sequences``) as the call ends; the rows kept
        during the call become the ones the next call matches against."""
        self.keep(cache, torch.arange(len(sequence_rows)), sequence_rows, sequences)
        self.rows, self._pending = self._pending, []
        self._kept_tokens = None
        if self.rows:
            longest = max(len(row.tokens) for row in self.rows)
            self._kept_tokens = self.rows[0].tokens.new_full((len(self.rows), longest), -1)
            for index, row in enumerate(self.rows):
                self._kept_tokens[index, : len(row.tokens)] = row.tokens

    def _longest_match(self, context: Tensor) -> tuple[KeptRow | None, int]:
        """The kept row sharing the longest prefix with ``context``, and how many of its tokens to reuse: at most all
        but ``context``'s last, whose logits the prefill must give."""
        if self._kept_tokens is None or len(context) < 2:
            return None, 0
        width = min(len(context), self._kept_tokens.shape[1])
        shared = (self._kept_tokens[:, :width] == context[:width]).long().cumprod(1).sum(1)
        best = int(shared.argmax())
        count = min(int(shared[best]), len(context) - 1)
        return (self.rows[best], count) if count else (None, 0)


def right_aligned(parts: list[Tensor | None], counts: list[int], width: int) -> Tensor:
    """``[B, heads, width, head_dim]``: row ``i``'s first ``counts[i]`` positions of ``parts[i]`` (``[heads, ., head_dim]``)
    in its last columns, zeros before them."""
    template = next(part for part in parts if part is not None)
    out = template.new_zeros(len(parts), template.shape[0], width, template.shape[-1])
    for row, (part, count) in enumerate(zip(parts, counts)):
        if count:
            out[row, :, width - count :] = part[:, :count]
    return out
