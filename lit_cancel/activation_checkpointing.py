"""``activation_checkpointing: auto``: of the checkpointing modes whose training pass fits the memory at hand, the one
that costs least time x memory.

The modes, fastest first: none, ``blocks``, ``chunks``, ``blocks+chunks`` (``RLModule``'s docstring says what each
keeps). What autograd keeps per token is measured once at start-up, on cuts of the model's config to one and two
blocks (random weights, a vocabulary of 256: the head's logits are recomputed chunk by chunk in every mode), on a
CPU in the trainer's precision, over sequences of 32, 64 and 128 tokens (the three separate what grows with the
row's length: an attention matrix that is kept), as :func:`kept_by` counts it (the distinct storages autograd keeps,
the weights aside). On a GPU, flash attention keeps no matrix: the estimate is then an upper bound. A
training pass over ``T`` tokens (the micro-batch's rows times the longest prompt and the completion limit), in
chunks of ``C`` tokens, of a model of ``B`` blocks then keeps about

* none: ``T x B x`` a block's activations per token;
* ``blocks``: ``T x B x`` a block's input per token, and one block's activations of a chunk while it is recomputed;
* ``chunks``: ``T x`` a final state, and every block's activations of a chunk while it is recomputed;
* ``blocks+chunks``: ``T x`` a final state, a chunk's block inputs and one block's activations of a chunk.

A mode that keeps more is faster only by the forwards it does not recompute. Every mode recomputes the head's logits
chunk by chunk; ``blocks`` and ``chunks`` recompute the blocks' forward once more, ``blocks+chunks`` twice, except
where the training steps send each chunk's gradient back as soon as its forward ends (an on-policy run of one process
whose objective's credits do not depend on the log-prob values, ``RLModule.sends_chunks_back``): then the chunk modes
recompute no chunk, and ``chunks`` keeps one chunk's activations at the time of no checkpointing. With the
blocks' share ``b`` of a forward's FLOPs (the rest is the head, applied at completion positions only), a training pass
takes, in forwards, ``3 + (1 - b)`` with no checkpointing, ``b`` more with ``blocks`` or ``chunks`` and ``2b`` more with
both. Of the modes whose estimate is within half the memory at hand (the CPU's available memory; on a GPU its free
memory) less the gradients and AdamW's two moments (the other half is left to the rollouts' KV cache, the allocator and
the rest of the process), the one with the least time x expected peak is chosen: the peak is what the process holds
when fitting starts, the gradients and moments, and the pass. A mode that saves a quarter of the pass's time is taken
only if it raises the peak by less than a third: the memory a run holds is paid for as long as it runs, and the pass
is only part of a step. Where no mode fits, the leanest.
"""

from collections.abc import Callable
from dataclasses import dataclass
from functools import partial

import torch
from transformers import AutoModelForCausalLM, PretrainedConfig

from lit_cancel.host_memory import resident_bytes
from lit_cancel.hub import cut_config
from lit_cancel.logprobs import completion_logprobs

AUTO = "auto"
MODES = (False, "blocks", "chunks", "blocks+chunks")
# the share of the memory at hand a training pass may keep
SHARE = 0.5
# the parameters' copies an optimizer step adds to the weights: their gradients and AdamW's two moments
OPTIMIZER_COPIES = 3
# forwards of the blocks each mode recomputes in the backward pass
RECOMPUTED_BLOCK_PASSES = {False: 0, "blocks": 1, "chunks": 1, "blocks+chunks": 2}


@dataclass(frozen=True)
class KeptPerToken:
    """Bytes autograd keeps per token: a block's activations (no checkpointing), of which ``attention`` more for each
    token of the row (an attention kernel that keeps its matrix, as SDPA on a CPU does under bfloat16 autocast), a
    block's input (``blocks``) and the final state the head reads (``chunks``)."""

    activations: float
    attention: float
    block_input: float
    final_state: float

    def activations_in_rows_of(self, row_tokens: int) -> float:
        return self.activations + self.attention * row_tokens


@dataclass(frozen=True)
class CheckpointingChoice:
    """An ``activation_checkpointing`` mode and why it was chosen."""

    mode: bool | str
    reason: str


def use_activation_checkpointing(model: torch.nn.Module, mode: bool | str) -> bool:
    """Turns on Hugging Face's checkpointing of each block for the modes that have it; whether ``mode`` recomputes
    chunks. Does nothing for ``"auto"``, which is resolved when fitting starts."""
    if mode in (True, "blocks", "blocks+chunks"):
        if hasattr(model, "activation_checkpointing_enable"):  # transformers 5.24 deprecates the older name
            model.activation_checkpointing_enable(activation_checkpointing_kwargs={"use_reentrant": False})
        else:
            model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    return mode in ("chunks", "blocks+chunks")


def stop_activation_checkpointing(model: torch.nn.Module) -> None:
    if hasattr(model, "activation_checkpointing_disable"):
        model.activation_checkpointing_disable()
    else:
        model.gradient_checkpointing_disable()


def mode_name(mode: bool | str) -> str:
    return "none" if mode is False else str(mode)


def kept_per_token(config: PretrainedConfig, autocast: torch.dtype | None = None) -> KeptPerToken:
    """:class:`KeptPerToken` of a model of ``config``'s shape, measured on single sequences of 32, 64 and 128 tokens,
    under CPU autocast to ``autocast`` where given. A block keeps ``c + a T + q T^2`` bytes of a row of ``T`` tokens: the
    three lengths give ``a`` (``activations``) and ``q`` (``attention``); ``c`` does not grow with the tokens (autocast's
    copies of the weights) and is left out."""
    lengths = (32, 64, 128)
    measured = {}
    with torch.random.fork_rng(devices=[]), torch.autocast("cpu", dtype=autocast, enabled=autocast is not None):
        for blocks in (1, 2):
            cut = cut_config(config, blocks, vocab_size=256)
            model = AutoModelForCausalLM.from_config(cut, dtype=torch.float32).train()
            for tokens in lengths:
                ids = torch.randint(cut.vocab_size, (1, tokens))
                saved = {"none": _kept_bytes(model, ids, recompute=False)}
                use_activation_checkpointing(model, "blocks")
                saved["blocks"] = _kept_bytes(model, ids, recompute=False)
                stop_activation_checkpointing(model)
                saved["chunks"] = _kept_bytes(model, ids, recompute=True)
                measured[blocks, tokens] = saved

    def block(kind: str, tokens: int) -> int:
        return measured[2, tokens][kind] - measured[1, tokens][kind]

    short, middle, long = (block("none", tokens) for tokens in lengths)
    attention = ((long - middle) - 2 * (middle - short)) / 6144  # 128^2 - 64^2 - 2 (64^2 - 32^2)
    return KeptPerToken(
        activations=(middle - short - 3072 * attention) / 32,  # 64^2 - 32^2 = 3072
        attention=attention,
        block_input=(block("blocks", 128) - block("blocks", 64)) / 64,
        final_state=(measured[2, 128]["chunks"] - measured[2, 64]["chunks"]) / 32,  # the completion is half the sequence
    )


def kept_by(model: torch.nn.Module, log_prob_pass: Callable[[], object]) -> int:
    """Bytes of the distinct storages autograd keeps for the backward pass of ``log_prob_pass()``, but for ``model``'s
    parameters (which a layer keeps, and which are there anyway)."""
    weights = {parameter.untyped_storage().data_ptr() for parameter in model.parameters()}
    kept: dict[int, int] = {}

    def pack(tensor):
        storage = tensor.untyped_storage()
        if storage.data_ptr() not in weights:
            kept[storage.data_ptr()] = storage.nbytes()
        return tensor

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda tensor: tensor):
        log_prob_pass()
    return sum(kept.values())


def _kept_bytes(model: torch.nn.Module, ids: torch.Tensor, recompute: bool) -> int:
    """:func:`kept_by` a log-prob pass over ``ids``, its second half the completion, in one chunk."""
    return kept_by(model, partial(
        completion_logprobs, model, ids, torch.ones_like(ids), ids.shape[1] // 2, max_tokens_per_chunk=ids.shape[1],
        recompute_chunks=recompute,
    ))


def training_pass_bytes(mode: bool | str, kept: KeptPerToken, blocks: int, rows: int, row_tokens: int,
                        chunk_tokens: int | None) -> float:
    """Bytes a training pass over ``rows`` rows of ``row_tokens`` tokens in chunks of ``chunk_tokens`` (None: one pass;
    a row longer than a chunk is a chunk of its own) keeps at its peak."""
    tokens = rows * row_tokens
    chunk = min(max(chunk_tokens or tokens, row_tokens), tokens)
    activations = kept.activations_in_rows_of(row_tokens)
    if mode is False:
        return tokens * blocks * activations
    if mode == "blocks":
        return tokens * blocks * kept.block_input + chunk * activations
    if mode == "chunks":
        return tokens * kept.final_state + chunk * blocks * activations
    return tokens * kept.final_state + chunk * (blocks * kept.block_input + activations)


def pass_time(mode: bool | str, block_share: float, chunks_sent_back: bool = False) -> float:
    """A training pass's FLOPs in ``mode``, in forwards: forward, backward (two), the head's recomputation and the
    blocks' recomputations; ``block_share`` is the blocks' share of a forward. With ``chunks_sent_back`` the chunk modes
    recompute no chunk (:func:`lit_cancel.logprobs.backward_by_chunk`)."""
    recomputed = RECOMPUTED_BLOCK_PASSES[mode] - (chunks_sent_back and mode in ("chunks", "blocks+chunks"))
    return 3 + (1 - block_share) + recomputed * block_share


def choose_checkpointing(kept: KeptPerToken, blocks: int, rows: int, row_tokens: int, chunk_tokens: int | None,
                         memory_at_hand: int, parameter_bytes: int, held_bytes: int = 0,
                         block_share: float = 1.0, chunks_sent_back: bool = False) -> CheckpointingChoice:
    """Of the modes whose training pass keeps at most :data:`SHARE` of ``memory_at_hand`` less the optimizer's copies
    of ``parameter_bytes``, the one with the least :func:`pass_time` x expected peak (``held_bytes``, what the process
    holds now, the optimizer's copies and the pass); the leanest where none fits. The chunk modes only with
    ``chunk_tokens``; ``chunks_sent_back``: they recompute no chunk."""
    modes = MODES if chunk_tokens else MODES[:2]
    estimates = {mode: training_pass_bytes(mode, kept, blocks, rows, row_tokens, chunk_tokens) for mode in modes}
    optimizer_bytes = OPTIMIZER_COPIES * parameter_bytes
    budget = SHARE * memory_at_hand - optimizer_bytes
    peaks = {mode: held_bytes + optimizer_bytes + estimates[mode] for mode in modes}
    costs = {mode: pass_time(mode, block_share, chunks_sent_back) * peaks[mode] for mode in modes}
    fitting = [mode for mode in modes if estimates[mode] <= budget]
    mode = min(fitting, key=costs.__getitem__) if fitting else min(modes, key=estimates.__getitem__)
    per_mode = ", ".join(f"{mode_name(m)} {estimates[m] / 2**30:.2f} GiB ({costs[m] / costs[mode]:.2f})" for m in modes)
    reason = (f"expected peak {peaks[mode] / 2**30:.2f} GiB: {held_bytes / 2**30:.2f} held now, {optimizer_bytes / 2**30:.2f} of "
              f"gradients and optimizer state, {estimates[mode] / 2**30:.2f} for a training pass of {rows} rows of {row_tokens:,} "
              f"tokens; the pass per mode (time x peak against this one's): {per_mode}; {budget / 2**30:.2f} GiB at hand for "
              f"the pass ({SHARE:.0%} of {memory_at_hand / 2**30:.1f} GiB, less gradients and optimizer state)")
    return CheckpointingChoice(mode, reason if fitting else reason + "; none fits, the leanest is used")


def block_share(model: torch.nn.Module, row_tokens: int, completion_tokens: int) -> float:
    """The blocks' share of the FLOPs of a forward over a row of ``row_tokens`` tokens whose last ``completion_tokens``
    meet the head: the blocks' matrices and causal attention at every token, the head at the completion's."""
    config = model.config
    head = model.get_output_embeddings().weight
    skipped = {id(model.get_input_embeddings().weight), id(head)}
    matrices = sum(p.numel() for p in model.parameters() if p.dim() == 2 and id(p) not in skipped)
    in_blocks = matrices * row_tokens + config.num_hidden_layers * config.hidden_size * row_tokens**2
    return in_blocks / (in_blocks + head.numel() * completion_tokens)


def memory_at_hand(device: torch.device) -> int | None:
    """Free memory of a GPU, the available memory of the machine on a CPU (/proc/meminfo); None where unknown."""
    if device.type == "cuda":
        return torch.cuda.mem_get_info(device)[0]
    try:
        with open("/proc/meminfo") as meminfo:
            for line in meminfo:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return None


def held_now(device: torch.device) -> int:
    """Bytes the process holds: on a GPU what tensors take of it, on a CPU its resident memory."""
    if device.type == "cuda":
        return torch.cuda.memory_allocated(device)
    try:
        return resident_bytes()
    except OSError:
        return 0


def auto_checkpointing(module, trainer, rows: int, row_tokens: int, chunks_sent_back: bool = False) -> CheckpointingChoice:
    """The mode for ``module``'s fit under ``trainer``, whose micro-batches hold ``rows`` rows of ``row_tokens`` tokens at
    most in each process (the datamodule tells: ``RolloutDataModule.micro_batch_shape``); ``chunks_sent_back``: its
    training steps send each chunk's gradient back at once (``RLModule.sends_chunks_back``)."""
    model = module.policy.model
    device = trainer.strategy.root_device
    at_hand = memory_at_hand(device)
    if at_hand is None:
        return CheckpointingChoice("blocks", "the memory at hand is unknown on this machine")
    parameter_bytes = sum(p.numel() * p.element_size() for p in model.parameters() if p.requires_grad)
    autocast = torch.bfloat16 if str(trainer.precision).startswith("bf16") else None
    return choose_checkpointing(
        kept_per_token(model.config, autocast), model.config.num_hidden_layers, rows, row_tokens, module.max_tokens_per_chunk,
        at_hand, parameter_bytes, held_now(device), block_share(model, row_tokens, min(module.max_new_tokens, row_tokens)),
        chunks_sent_back,
    )
