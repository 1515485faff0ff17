"""The decode loop's KV cache kept from one call to the next: an agent's turns, each continuing the contexts of the last.

Each turn continues every running episode from its own tokens: the prompt, the turns sampled so far, the environment's
replies. Without a kept cache every turn prefills every context again. :class:`KeptCache` keeps, after a call, each
row's keys and values as the loop wrote them (a row's tokens are its context and its completion up to the stop token,
which is in the cache if the loop wrote it before the row left the batch), and at the next call starts each new row
from the kept row that shares the longest prefix with it: only the tokens after that prefix are prefilled (the
environment's reply, and the turn's last token if the loop had not written it). Rows are matched by their tokens, not
by their place: episodes that ended are gone from the next call, and a row that matches none is prefilled whole.

Kept keys already carry their positions (rotary embeddings): row ``i``'s ``r_i`` reused keys go, in order, to the last
``r_i`` columns before the new tokens, the new tokens are left-padded after them, and the positions come from the
attention mask as everywhere else (``r_i`` kept columns count as ``r_i`` tokens), so the new tokens continue from
``r_i``. The masked pad columns between the two parts change nothing. Keeping and reusing are a few batched copies per
layer and call: rows are kept with their pad columns, as the loop wrote them, and gathered by index.
"""

from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch
from torch import Tensor, nn
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


class KeptCache:
    """The rows of the last call that kept its cache, matched against the next call's rows.

    Valid for the weights that wrote it: the engine makes a new one when the optimizer step changes, and drops it at a
    call without ``keep``, at :meth:`~lit_cancel.engines.RolloutEngine.sync` and at
    :meth:`~lit_cancel.engines.RolloutEngine.release`.

    Args:
        step: the optimizer step of the weights whose keys and values it holds.

    Attributes:
        tokens: ``[N, T]`` each kept row's tokens, -1 after its last; None before the first call ends.
        columns: ``[N, T]`` the column of :attr:`keys` and :attr:`values` that holds each of them.
        keys: per layer, ``[N, heads, L, head_dim]``; values likewise.
        reused_tokens: context tokens the last call read from the kept cache instead of prefilling.
    """

    def __init__(self, step: int):
        self.step = step
        self.tokens = self.columns = None
        self.keys: list[Tensor] = []
        self.values: list[Tensor] = []
        self.reused_tokens = 0
        self._chunks: list[tuple[Tensor, Tensor, list[Tensor], list[Tensor]]] = []

    def prefill(self, new_cache: Callable[[int], Cache], input_ids: Tensor, attention_mask: Tensor, num_samples: int,
                max_new_tokens: int, stop_token_ids: Sequence[int], pad_token_id: int) -> Prefill:
        """The prefill of ``input_ids`` (left-padded), each row started from its longest match among the kept rows, into
        ``new_cache(capacity)``; readies :meth:`keep` for this call's ``num_samples`` completions of each row."""
        context_columns, lengths = valid_columns(attention_mask.bool())
        contexts = input_ids.gather(1, context_columns).masked_fill(~below(lengths, context_columns.shape[1]), -2)
        best, reused = self._longest_matches(contexts, lengths)
        kept_width = int(reused.max()) if len(reused) else 0
        if kept_width == 0:
            prefill = Prefill.whole(new_cache, input_ids, attention_mask, max_new_tokens)
            layout = input_ids
        else:
            # row i's r_i reused tokens in the last r_i of the kept_width columns, its new tokens in the last of new_width
            kept_from = torch.arange(kept_width, device=input_ids.device) - (kept_width - reused)[:, None]
            from_cache = kept_from >= 0
            columns = self.columns[best].gather(1, kept_from.clamp(min=0))
            new = lengths - reused
            new_width = int(new.max())
            new_from = torch.arange(new_width, device=input_ids.device) - (new_width - new)[:, None]
            prefilled = new_from >= 0
            new_ids = contexts.gather(1, (new_from + reused[:, None]).clamp(min=0)).masked_fill(~prefilled, pad_token_id)
            mask = torch.cat([from_cache, prefilled], 1).to(attention_mask.dtype)
            cache = new_cache(kept_width + new_width + max_new_tokens)
            for layer, keys, values in zip(cache.layers, self.keys, self.values):
                # [B, width] indices into [N, heads, L, head_dim]: [B, width, heads, head_dim]
                layer.update(keys[best[:, None], :, columns].transpose(1, 2), values[best[:, None], :, columns].transpose(1, 2))
            prefill = Prefill(cache, new_ids, mask, position_ids_from_mask(mask)[:, kept_width:], int(reused.sum()))
            layout = torch.cat([self.tokens[best].gather(1, kept_from.clamp(min=0)), new_ids], 1)
        self._layout, self._prefill_mask = layout, prefill.attention_mask.bool()
        self._num_samples, self._prompt_length = num_samples, input_ids.shape[1]
        self._stops = torch.tensor(list(stop_token_ids), dtype=input_ids.dtype, device=input_ids.device)
        self.reused_tokens = prefill.reused_tokens
        self.tokens = self.columns = None  # copied into the new cache: the call keeps its own rows
        self.keys, self.values, self._chunks = [], [], []
        return prefill

    def keep(self, cache: Cache, batch_rows: Tensor, sequence_rows: Tensor, sequences: Tensor) -> None:
        """Keeps rows ``batch_rows`` of ``cache``, rows ``sequence_rows`` of the call's ``sequences``, before they leave
        the batch or the call ends: their keys and values, and which of their columns hold their context's tokens and
        the completion tokens the loop wrote, up to the first stop token."""
        prefilled = self._prefill_mask.shape[1]
        written = cache.layers[0].get_seq_length() - prefilled
        completions = sequences[sequence_rows, self._prompt_length : self._prompt_length + written]
        stopped = torch.isin(completions, self._stops).long()
        counts = (stopped.cumsum(1) - stopped == 0).sum(1)  # up to the first stop token, which is kept
        prompt_rows = sequence_rows // self._num_samples
        valid = torch.cat([self._prefill_mask[prompt_rows], below(counts, written)], 1)
        tokens = torch.cat([self._layout[prompt_rows], completions], 1)
        self._chunks.append((valid, tokens, [layer.keys[batch_rows] for layer in cache.layers],
                             [layer.values[batch_rows] for layer in cache.layers]))

    def end_call(self, cache: Cache, sequence_rows: Tensor, sequences: Tensor) -> None:
        """Keeps the rows still in ``cache`` (rows ``sequence_rows`` of ``sequences``) as the call ends; the rows kept
        during the call become the ones the next call matches against."""
        self.keep(cache, torch.arange(len(sequence_rows), device=sequence_rows.device), sequence_rows, sequences)
        width = max(chunk[0].shape[1] for chunk in self._chunks)
        valid = torch.cat([nn.functional.pad(chunk[0], (0, width - chunk[0].shape[1])) for chunk in self._chunks])
        tokens = torch.cat([nn.functional.pad(chunk[1], (0, width - chunk[1].shape[1])) for chunk in self._chunks])
        for part, index in ((self.keys, 2), (self.values, 3)):
            part[:] = [torch.cat([nn.functional.pad(chunk[index][layer], (0, 0, 0, width - chunk[index][layer].shape[2]))
                                  for chunk in self._chunks]) for layer in range(len(cache.layers))]
        self._chunks = []
        self.columns, counts = valid_columns(valid)
        self.columns = self.columns[:, : int(counts.max())]
        self.tokens = tokens.gather(1, self.columns).masked_fill(~below(counts, self.columns.shape[1]), -1)

    def _longest_matches(self, contexts: Tensor, lengths: Tensor) -> tuple[Tensor, Tensor]:
        """For each row of ``contexts`` (left-aligned, ``lengths`` long), the kept row sharing the longest prefix with it,
        and how many of its tokens to reuse: at most all but the context's last, whose logits the prefill must give."""
        best, reused = torch.zeros_like(lengths), torch.zeros_like(lengths)
        if self.tokens is None:
            return best, reused
        width = min(contexts.shape[1], self.tokens.shape[1])
        for row in range(len(contexts)):
            shared = (self.tokens[:, :width] == contexts[row, :width]).long().cumprod(1).sum(1)
            best[row] = shared.argmax()
            reused[row] = shared[best[row]]
        return best, torch.minimum(reused, lengths - 1).clamp(min=0)


def valid_columns(valid: Tensor) -> tuple[Tensor, Tensor]:
    """``([B, W] columns, [B] counts)``: each row's true columns of ``valid`` ``[B, W]`` first, in order, then the rest."""
    return torch.sort((~valid).to(torch.uint8), dim=1, stable=True).indices, valid.sum(1)


def below(counts: Tensor, width: int) -> Tensor:
    """``[B, width]``: true in the first ``counts[i]`` columns of row ``i``."""
    return torch.arange(width, device=counts.device) < counts[:, None]
