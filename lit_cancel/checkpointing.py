"""``activation_checkpointing: auto``: the fastest checkpointing mode whose training pass fits the memory at hand.

The modes, fastest first: none, ``blocks``, ``chunks``, ``blocks+chunks`` (``RLModule``'s docstring says what each
keeps). What autograd keeps per token is measured once at start-up, on cuts of the model's config to one and two
blocks (random weights, float32, a vocabulary of 256: the head's logits are recomputed chunk by chunk in every
mode), as ``benchmarks/performance/memory_per_token.py`` counts it, less the weights that layers keep. A training
pass over ``T`` tokens (the micro-batch's rows times the longest prompt and the completion limit), in chunks of ``C``
tokens, of a model of ``B`` blocks then keeps about

* none: ``T x B x`` a block's activations per token;
* ``blocks``: ``T x B x`` a block's input per token, and one block's activations of a chunk while it is recomputed;
* ``chunks``: ``T x`` a final state, and every block's activations of a chunk while it is recomputed;
* ``blocks+chunks``: ``T x`` a final state, a chunk's block inputs and one block's activations of a chunk.

The first mode whose estimate is within half the memory at hand (the CPU's available memory; on a GPU its free
memory), less the gradients and AdamW's two moments, is chosen: the other half is left to the rollouts' KV cache,
the allocator and the rest of the process. Where none is, the leanest.
"""

import copy
from dataclasses import dataclass

import torch
from transformers import AutoModelForCausalLM, PretrainedConfig

from lit_cancel.logprobs import completion_logprobs

AUTO = "auto"
MODES = (False, "blocks", "chunks", "blocks+chunks")
# the share of the memory at hand a training pass may keep
SHARE = 0.5
# the parameters' copies an optimizer step adds to the weights: their gradients and AdamW's two moments
OPTIMIZER_COPIES = 3


@dataclass(frozen=True)
class KeptPerToken:
    """Bytes autograd keeps per token: a block's activations (no checkpointing), a block's input (``blocks``) and
    the final state the head reads (``chunks``)."""

    activations: float
    block_input: float
    final_state: float


@dataclass(frozen=True)
class CheckpointingChoice:
    """An ``activation_checkpointing`` mode and why it was chosen."""

    mode: bool | str
    reason: str


def mode_name(mode: bool | str) -> str:
    return "none" if mode is False else str(mode)


def kept_per_token(config: PretrainedConfig, tokens: int = 64) -> KeptPerToken:
    """:class:`KeptPerToken` of a model of ``config``'s shape, measured on one sequence of ``tokens`` tokens."""
    measured = {}
    with torch.random.fork_rng(devices=[]):
        for blocks in (1, 2):
            cut = copy.deepcopy(config)
            cut.num_hidden_layers, cut.vocab_size = blocks, 256
            if getattr(cut, "layer_types", None):
                cut.layer_types = cut.layer_types[:blocks]
            model = AutoModelForCausalLM.from_config(cut, dtype=torch.float32).train()
            ids = torch.randint(cut.vocab_size, (1, tokens))
            saved = {"none": _kept_bytes(model, ids, recompute=False)}
            model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
            saved["blocks"] = _kept_bytes(model, ids, recompute=False)
            model.gradient_checkpointing_disable()
            saved["chunks"] = _kept_bytes(model, ids, recompute=True)
            measured[blocks] = saved
    completion = tokens // 2
    return KeptPerToken(
        activations=(measured[2]["none"] - measured[1]["none"]) / tokens,
        block_input=(measured[2]["blocks"] - measured[1]["blocks"]) / tokens,
        final_state=measured[2]["chunks"] / completion,
    )


def _kept_bytes(model: torch.nn.Module, ids: torch.Tensor, recompute: bool) -> int:
    """Bytes of the distinct storages autograd keeps for the backward pass of one log-prob pass over ``ids``, its
    second half the completion, but for the parameters (which a layer keeps, and which are there anyway)."""
    weights = {parameter.untyped_storage().data_ptr() for parameter in model.parameters()}
    kept: dict[int, int] = {}

    def pack(tensor):
        storage = tensor.untyped_storage()
        if storage.data_ptr() not in weights:
            kept[storage.data_ptr()] = storage.nbytes()
        return tensor

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda tensor: tensor):
        completion_logprobs(model, ids, torch.ones_like(ids), ids.shape[1] // 2, max_tokens_per_chunk=ids.shape[1],
                            recompute_chunks=recompute)
    return sum(kept.values())


def training_pass_bytes(mode: bool | str, kept: KeptPerToken, blocks: int, tokens: int, chunk_tokens: int | None) -> float:
    """Bytes a training pass over ``tokens`` tokens in chunks of ``chunk_tokens`` (None: one pass) keeps at its peak."""
    chunk = min(chunk_tokens or tokens, tokens)
    if mode is False:
        return tokens * blocks * kept.activations
    if mode == "blocks":
        return tokens * blocks * kept.block_input + chunk * kept.activations
    if mode == "chunks":
        return tokens * kept.final_state + chunk * blocks * kept.activations
    return tokens * kept.final_state + chunk * (blocks * kept.block_input + kept.activations)


def choose_checkpointing(kept: KeptPerToken, blocks: int, tokens: int, chunk_tokens: int | None,
                         memory_at_hand: int, parameter_bytes: int) -> CheckpointingChoice:
    """The fastest mode whose training pass keeps at most :data:`SHARE` of ``memory_at_hand`` less the optimizer's
    copies of ``parameter_bytes``; the leanest where none does. The chunk modes only with ``chunk_tokens``."""
    modes = MODES if chunk_tokens else MODES[:2]
    estimates = {mode: training_pass_bytes(mode, kept, blocks, tokens, chunk_tokens) for mode in modes}
    budget = SHARE * memory_at_hand - OPTIMIZER_COPIES * parameter_bytes
    fitting = [mode for mode in modes if estimates[mode] <= budget]
    mode = fitting[0] if fitting else min(modes, key=estimates.__getitem__)
    kept_by_mode = ", ".join(f"{mode_name(m)} {estimates[m] / 2**30:.2f}" for m in modes)
    reason = (f"a training pass of {tokens:,} tokens keeps about {kept_by_mode} GiB; {budget / 2**30:.2f} GiB at hand for it "
              f"({SHARE:.0%} of {memory_at_hand / 2**30:.1f} GiB, less gradients and optimizer state)")
    return CheckpointingChoice(mode, reason if fitting else reason + "; none fits, the leanest is used")


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


def auto_checkpointing(module, trainer) -> CheckpointingChoice:
    """The mode for ``module``'s fit under ``trainer``: its micro-batch from the datamodule's round (rows per process
    and micro-batch; tokens per row: the longest of the first 1,000 training prompts and the completion limit)."""
    from lit_cancel.data import new_tokens_limit

    data = trainer.datamodule
    if not all(hasattr(data, name) for name in ("task", "prompts_per_round", "group_size", "mini_batches_per_round")):
        raise ValueError("model.init_args.activation_checkpointing auto sizes the micro-batch from a RolloutDataModule's "
                         "round (prompts_per_round, group_size, mini_batches_per_round); set a mode instead")
    rows = max(1, data.prompts_per_round // trainer.world_size * data.group_size // data.mini_batches_per_round
               // trainer.accumulate_grad_batches)
    prompts = [record["prompt"] for record in data.task.train_records()[:1000]]
    longest_prompt = max((len(ids) for ids in module.tokenizer(prompts)["input_ids"]), default=0)
    tokens = rows * (longest_prompt + new_tokens_limit(data.task, module)[0])
    model = module.policy.model
    at_hand = memory_at_hand(trainer.strategy.root_device)
    if at_hand is None:
        return CheckpointingChoice("blocks", "the memory at hand is unknown on this machine")
    parameter_bytes = sum(p.numel() * p.element_size() for p in model.parameters() if p.requires_grad)
    return choose_checkpointing(kept_per_token(model.config), model.config.num_hidden_layers, tokens,
                                module.max_tokens_per_chunk, at_hand, parameter_bytes)
