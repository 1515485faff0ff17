"""The engines that run the policy in the trainer's process: :class:`DecodeLoop` (the default) and :class:`HFGenerate`.

The decode loop samples completions with a KV cache: one prefill per prompt, shared by its samples, and a plain loop.

``generate`` runs the prompt through the model once per returned sequence and spends a few
milliseconds per step on bookkeeping that a fixed sampling recipe does not need. The loop here
prefills each prompt once, repeats its cache for its samples, and drops finished rows from the
batch so that tokens after a stop token cost nothing. Its cache is written in place, in buffers that
double when full (only the rows still decoding move): ``generate``'s cache concatenates every layer's keys and values
at every step, a copy that grows with the sequence (10% of decoding time at 24 M parameters and
128 new tokens on a 2-core CPU). It applies ``generate``'s logits processors, in the same order, so greedy decoding
gives the same tokens, and draws from the same distribution (:mod:`lit_cancel.engines.draw`). Through an agent's
turns it keeps its cache (:mod:`lit_cancel.engines.kept_cache`): each turn prefills only what the episodes added.

Models whose ``model_type`` is not in :data:`DECODE_LOOP_MODEL_TYPES`, and generation options
outside :data:`DECODE_LOOP_OPTIONS`, are left to ``generate``.
"""

import inspect
import time
from collections.abc import Sequence
from functools import partial

import torch
from torch import Tensor, nn
from transformers import GenerationConfig, LogitsProcessorList
from transformers.cache_utils import Cache, DynamicCache, DynamicLayer
from transformers.generation.logits_process import (
    MinPLogitsWarper,
    SuppressTokensLogitsProcessor,
    TemperatureLogitsWarper,
    TopKLogitsWarper,
    TopPLogitsWarper,
)

from lit_cancel.engines.base import PolicyWeights, RolloutEngine, Sampled, SampleRequest
from lit_cancel.engines.draw import sample_tokens
from lit_cancel.engines.kept_cache import KeptCache, Prefill
from lit_cancel.host_memory import release_free_heap
from lit_cancel.onednn_linears import onednn_linears

DECODE_LOOP_MODEL_TYPES = frozenset({"qwen2", "qwen3", "llama", "mistral"})
DECODE_LOOP_OPTIONS = frozenset({"suppress_tokens", "top_k", "min_p"})
# a finished row leaves the batch once this share of the rows still decoding has finished
_COMPACT_SHARE = 0.25
# a layer's buffers of at least this many bytes, outgrown, send the heap's free pages back (host_memory.py)
_RELEASE_AFTER_GROWING = 8 * 2**20


def supports_decode_loop(model: nn.Module, generation_kwargs: dict) -> bool:
    """Whether :func:`sample_completions` can serve ``model`` with these extra generation options."""
    model_type = getattr(getattr(model, "config", None), "model_type", None)
    return model_type in DECODE_LOOP_MODEL_TYPES and set(generation_kwargs) <= DECODE_LOOP_OPTIONS


def logits_processors(generation_kwargs: dict, temperature: float, top_p: float, greedy: bool) -> LogitsProcessorList:
    """The processors ``generate`` builds for these options, in its order (processors, then sampling warpers)."""
    processors = LogitsProcessorList()
    if generation_kwargs.get("suppress_tokens") is not None:
        processors.append(SuppressTokensLogitsProcessor(generation_kwargs["suppress_tokens"]))
    if greedy:
        return processors
    if temperature != 1.0:
        processors.append(TemperatureLogitsWarper(temperature))
    if generation_kwargs.get("top_k"):
        processors.append(TopKLogitsWarper(generation_kwargs["top_k"]))
    if top_p < 1.0:
        processors.append(TopPLogitsWarper(top_p))
    if generation_kwargs.get("min_p") is not None:
        processors.append(MinPLogitsWarper(generation_kwargs["min_p"]))
    return processors


def _release_outgrown(buffers: tuple[Tensor, Tensor]) -> None:
    """Hands the heap's free pages back after a layer's buffers grew out of ``buffers``: the smaller buffers freed
    before are holes in the heap that the larger ones cannot reuse. A few MiB of holes cannot reach the trim's
    threshold, and the check walks the heap's free lists, so small buffers, and buffers on a GPU, skip it.

    A compiled decoder skips it: a call that torch.compile cannot trace breaks the graph inside the loop over the
    decoder's layers, and a graph break in a loop sends the whole decoder's pass back to eager Python. The training
    pass still hands the heap back after each chunk."""
    if torch.compiler.is_compiling():
        return
    if buffers[0].device.type == "cpu" and sum(buffer.nbytes for buffer in buffers) >= _RELEASE_AFTER_GROWING:
        release_free_heap()


def attention_dtype(states: Tensor) -> torch.dtype:
    """The dtype attention reads ``states`` in: autocast's where it is on for their device, else their own. Under
    bfloat16 autocast the keys leave the rotary embedding in float32, and attention (an autocast operation) would
    cast the whole cache to bfloat16 at every token; stored in it, the cache holds the same numbers in half the bytes."""
    device = states.device.type
    if states.is_floating_point() and torch.is_autocast_enabled(device):
        return torch.get_autocast_dtype(device)
    return states.dtype


class PreallocatedLayer(DynamicLayer):
    """One attention layer's keys and values in buffers written in place, doubled when full, up to ``capacity`` positions.

    The model sees the filled part, ``buffer[:, :, :length]``, exactly what :class:`DynamicLayer`
    would return after concatenating; no step copies what earlier steps wrote, except when the
    buffers double: then the rows still decoding move to the new ones. Rows that finish leave the
    batch along the way, so the cache never holds every row at the longest length (with EOS on, at
    24 M parameters and 256 new tokens, the step's peak memory fell from 2,225 to 1,871 MiB).
    """

    def __init__(self, capacity: int):
        super().__init__()
        self.capacity = capacity
        self.length = 0

    def lazy_initialization(self, key_states: Tensor, value_states: Tensor) -> None:
        self.dtype, self.device = attention_dtype(key_states), key_states.device
        self.key_buffer = key_states.new_empty(*key_states.shape[:2], 0, key_states.shape[-1], dtype=self.dtype)
        self.value_buffer = value_states.new_empty(*value_states.shape[:2], 0, value_states.shape[-1],
                                                   dtype=attention_dtype(value_states))
        self.is_initialized = True

    def update(self, key_states: Tensor, value_states: Tensor, *args, **kwargs) -> tuple[Tensor, Tensor]:
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        end = self.length + key_states.shape[-2]
        if end > self.capacity:
            raise RuntimeError(f"PreallocatedLayer holds {self.capacity} positions; position {end} was written")
        if end > self.key_buffer.shape[2]:
            self._grow(min(self.capacity, max(end, 2 * self.key_buffer.shape[2])))
        self.key_buffer[:, :, self.length : end] = key_states
        self.value_buffer[:, :, self.length : end] = value_states
        self.length = end
        self._expose()
        return self.keys, self.values

    def _grow(self, positions: int) -> None:
        buffers = []
        for old in (self.key_buffer, self.value_buffer):
            new = old.new_empty(*old.shape[:2], positions, old.shape[-1])
            new[:, :, : self.length] = old[:, :, : self.length]
            buffers.append(new)
        outgrown = self.key_buffer, self.value_buffer
        self.key_buffer, self.value_buffer = buffers
        _release_outgrown(outgrown)

    def _expose(self) -> None:
        self.keys, self.values = self.key_buffer[:, :, : self.length], self.value_buffer[:, :, : self.length]

    def get_seq_length(self) -> int:
        return self.length

    def batch_repeat_interleave(self, repeats: int) -> None:
        self.key_buffer = self.key_buffer.repeat_interleave(repeats, dim=0)
        self.value_buffer = self.value_buffer.repeat_interleave(repeats, dim=0)
        self._expose()

    def batch_select_indices(self, indices: Tensor) -> None:
        # the kept rows' filled positions move to the front, in place: a gathered copy of the whole buffers
        # would hold both at once
        rows = len(indices)
        for buffer in (self.key_buffer, self.value_buffer):
            buffer[:rows, :, : self.length] = buffer[indices, :, : self.length]
        self.key_buffer, self.value_buffer = self.key_buffer[:rows], self.value_buffer[:rows]
        self._expose()


def preallocated_cache(model: nn.Module, capacity: int) -> Cache:
    """A cache of :class:`PreallocatedLayer` for each of ``model``'s decoder layers."""
    layers = model.config.get_text_config(decoder=True).num_hidden_layers
    return Cache(layers=[PreallocatedLayer(capacity) for _ in range(layers)])


def cache_keyword(model: nn.Module) -> str:
    """The name ``model.forward`` takes its KV cache by: ``cache`` from transformers 5.24 on (which deprecates the
    older ``past_key_values`` with a warning on every call), ``past_key_values`` before."""
    base = model.get_base_model() if hasattr(model, "get_base_model") else model  # a peft model passes it on
    return "cache" if "cache" in inspect.signature(base.forward).parameters else "past_key_values"


@torch.no_grad()
def greedy_decoding_seconds(model: nn.Module, prompts: Tensor, steps: int) -> float:
    """Seconds ``model`` takes for ``steps`` greedy decoding steps of ``prompts``' rows, after prefilling them (untimed)
    into a fresh Hugging Face cache: how the choices made at start-up time a model's decoding."""
    keyword = cache_keyword(model)
    cache = DynamicCache(config=model.config)
    out = model(input_ids=prompts, use_cache=True, **{keyword: cache})
    started = time.perf_counter()
    for _ in range(steps):
        out = model(input_ids=out.logits[:, -1:].argmax(-1), use_cache=True, **{keyword: cache})
    return time.perf_counter() - started


@torch.no_grad()
def sample_completions(
    model: nn.Module,
    input_ids: Tensor,
    attention_mask: Tensor,
    num_samples: int,
    max_new_tokens: int,
    stop_token_ids: Sequence[int],
    pad_token_id: int,
    processors: LogitsProcessorList,
    greedy: bool = False,
    kept: KeptCache | None = None,
) -> Tensor:
    """``[B * n, P + C]`` prompts followed by sampled completions, as ``generate(num_return_sequences=n)`` returns them.

    Row ``i * n + k`` is sample ``k`` of prompt ``i``; after its first stop token a row holds ``pad_token_id``;
    ``C <= max_new_tokens`` is the longest completion.

    Args:
        model: a Hugging Face causal LM whose forward takes ``position_ids``, a cache (:func:`cache_keyword`) and
            ``logits_to_keep``.
        input_ids: ``[B, P]`` left-padded prompts.
        attention_mask: ``[B, P]``.
        num_samples: completions per prompt (``n``).
        max_new_tokens: longest completion.
        stop_token_ids: the tokens that end a completion (the first one sampled is kept).
        pad_token_id: written after the stop token.
        processors: applied to each step's logits (see :func:`logits_processors`).
        greedy: take the most likely token instead of sampling.
        kept: the cache kept from the last call, whose rows the prompts may continue; it keeps this call's rows in turn.
    """
    batch, prompt_length = input_ids.shape
    rows = batch * num_samples
    new_cache = partial(preallocated_cache, model)
    if kept is None:
        prefill = Prefill.whole(new_cache, input_ids, attention_mask, max_new_tokens)
    else:
        prefill = kept.prefill(new_cache, input_ids, attention_mask, num_samples, max_new_tokens, stop_token_ids, pad_token_id)
    # without left padding every mask is all ones: the model's causal masking alone is the same, and cheaper
    padded = not bool(prefill.attention_mask.all())
    cache = prefill.cache
    with_cache = {cache_keyword(model): cache, "use_cache": True}
    logits = model(
        input_ids=prefill.input_ids, attention_mask=prefill.attention_mask if padded else None, position_ids=prefill.position_ids,
        logits_to_keep=1, **with_cache,
    ).logits[:, -1]
    cache.batch_repeat_interleave(num_samples)
    logits = logits.repeat_interleave(num_samples, dim=0)
    mask = prefill.attention_mask.repeat_interleave(num_samples, dim=0)
    position = prefill.position_ids[:, -1:].repeat_interleave(num_samples, dim=0)
    sequences = torch.full((rows, prompt_length + max_new_tokens), pad_token_id, dtype=input_ids.dtype, device=input_ids.device)
    sequences[:, :prompt_length] = input_ids.repeat_interleave(num_samples, dim=0)
    stops = torch.tensor(list(stop_token_ids), dtype=input_ids.dtype, device=input_ids.device)
    active = torch.arange(rows, device=input_ids.device)  # the rows of `sequences` still in the batch
    finished = torch.zeros(rows, dtype=torch.bool, device=input_ids.device)  # per row of the batch
    length = prompt_length
    for step in range(max_new_tokens):
        so_far = sequences[:, :length] if len(active) == rows else sequences[active, :length]
        scores = processors(so_far, logits.float())
        tokens = scores.argmax(-1) if greedy else sample_tokens(scores)
        tokens = tokens.masked_fill(finished, pad_token_id)
        sequences[active, length] = tokens
        length += 1
        finished = finished | torch.isin(tokens, stops)
        done = int(finished.sum())
        if done == len(active) or step == max_new_tokens - 1:
            break
        if done >= _COMPACT_SHARE * len(active):
            keep = torch.nonzero(~finished).squeeze(1)
            if kept is not None:
                leaving = torch.nonzero(finished).squeeze(1)
                kept.keep(cache, leaving, active[leaving], sequences)
            cache.batch_select_indices(keep)
            active, tokens, mask, position = active[keep], tokens[keep], mask[keep], position[keep]
            finished = finished[keep]
        if padded:
            mask = torch.cat([mask, torch.ones_like(mask[:, :1])], dim=1)
        position = position + 1
        logits = model(
            input_ids=tokens[:, None], attention_mask=mask if padded else None, position_ids=position, **with_cache,
        ).logits[:, -1]
    if kept is not None:
        kept.end_call(cache, active, sequences)
    return sequences[:, :length]


class HFGenerate(RolloutEngine):
    """Hugging Face ``generate`` on the policy, with the module's options and ``generation_kwargs``."""

    def sample(self, policy: PolicyWeights, request: SampleRequest) -> Sampled:
        options = request.options
        sampling = {} if request.greedy else {"temperature": options.temperature, "top_p": options.top_p, "top_k": 0}
        config = GenerationConfig(
            do_sample=not request.greedy,
            max_new_tokens=options.max_new_tokens,
            num_return_sequences=request.num_samples,
            pad_token_id=options.pad_token_id,
            eos_token_id=list(options.stop_token_ids),
            **{**sampling, **options.generation_kwargs},
        )
        sequences = policy.root(_generate, input_ids=request.input_ids, attention_mask=request.attention_mask, generation_config=config)
        return Sampled(sequences)


def _generate(model: nn.Module, **kwargs) -> Tensor:
    return model.generate(**kwargs)


def _sample_with_onednn_linears(model: nn.Module, *args) -> Tensor:
    """:func:`sample_completions` with the model's large float32 products through oneDNN on a CPU (:mod:`lit_cancel.onednn_linears`)."""
    with torch.no_grad(), onednn_linears(model):
        return sample_completions(model, *args)


class DecodeLoop(HFGenerate):
    """lit_cancel's decode loop (one prefill per prompt, a cache written in place, finished rows dropped).

    Through calls made with ``request.keep`` (an agent's turns) it keeps its KV cache (:class:`KeptCache`): each call
    prefills only what its rows add to the last call's. It drops the cache at :meth:`release`, at :meth:`sync`, at a
    call without ``keep`` and when the policy's optimizer step changes.

    Models outside :data:`DECODE_LOOP_MODEL_TYPES`, generation options outside :data:`DECODE_LOOP_OPTIONS` are sampled
    with ``generate`` instead; greedy decoding gives the same tokens either way.
    """

    kept: KeptCache | None = None

    def sample(self, policy: PolicyWeights, request: SampleRequest) -> Sampled:
        options = request.options
        if not supports_decode_loop(policy.model, options.generation_kwargs):
            return super().sample(policy, request)
        if not request.keep:
            self.kept = None
        elif self.kept is None or self.kept.step != policy.step:
            self.kept = KeptCache(policy.step)
        processors = logits_processors(options.generation_kwargs, options.temperature, options.top_p, request.greedy)
        sequences = policy.root(
            _sample_with_onednn_linears, request.input_ids, request.attention_mask, request.num_samples, options.max_new_tokens,
            options.stop_token_ids, options.pad_token_id, processors, request.greedy, self.kept,
        )
        if self.kept is None:
            return Sampled(sequences)
        prefilled = int(request.attention_mask.sum()) - self.kept.reused_tokens
        return Sampled(sequences, stats={"perf/prefill_tokens": float(prefilled), "perf/kv_reused_tokens": float(self.kept.reused_tokens)})

    def sync(self, policy: PolicyWeights) -> float:
        self.kept = None
        return 0.0

    def release(self) -> None:
        self.kept = None
