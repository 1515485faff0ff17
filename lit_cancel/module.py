"""LightningModules: a policy that samples and is validated, and the RL module that trains it."""

import copy
from typing import Literal

import torch
from lightning.pytorch.cli import LRSchedulerCallable, OptimizerCallable
from lightning.pytorch.trainer.states import TrainerFn
from lightning.pytorch.utilities import rank_zero_info, rank_zero_warn
from torch import Tensor, nn
from torchmetrics import MeanMetric
from transformers import GenerationConfig

from lit_cancel.activation_checkpointing import AUTO, auto_checkpointing, mode_name, use_activation_checkpointing
from lit_cancel.batch import RolloutBatch
from lit_cancel.compile_choice import AUTO as COMPILE_AUTO
from lit_cancel.compile_choice import auto_compile
from lit_cancel.engines import DecodeLoop, RolloutEngine
from lit_cancel.float32_products import wants_float32_products
from lit_cancel.gradients import StepGradients, scales_gradients
from lit_cancel.host_memory import bound_kernel_cache
from lit_cancel.hub import load_causal_lm, load_tokenizer
from lit_cancel.logprobs import backward_by_chunk, completion_logprobs, next_token_logprobs
from lit_cancel.lora import LoRA
from lit_cancel.objectives import Objective
from lit_cancel.objectives.presets import GRPO
from lit_cancel.rounds.draw import record_names
from lit_cancel.rounds.failures import FailedEpisodes, FailureCount
from lit_cancel.rounds.sample import Generation, PolicySampling, encode_completions, named_rollout, padded, stop_token_ids
from lit_cancel.rounds.score import accuracy_terms
from lit_cancel.sharding import ModelRoot, is_sharded, shard, total_norm

_SET_ELSEWHERE = {
    "do_sample": "greedy or not is chosen per call", "max_new_tokens": "use max_new_tokens",
    "num_return_sequences": "the group size is the datamodule's", "temperature": "use temperature", "top_p": "use top_p",
    "pad_token_id": "the tokenizer's is used", "eos_token_id": "the model's stop tokens are used (stop_token_ids)",
}


def checked_generation_kwargs(generation_kwargs: dict) -> dict:
    """``generation_kwargs`` if every key is a ``GenerationConfig`` option not set by another module option; else ValueError."""
    defaults = GenerationConfig()
    for key in generation_kwargs:
        if key in _SET_ELSEWHERE:
            raise ValueError(f"generation_kwargs: {key!r} is set by the module ({_SET_ELSEWHERE[key]})")
        if not hasattr(defaults, key):
            raise ValueError(f"generation_kwargs: {key!r} is not a transformers GenerationConfig option")
    return dict(generation_kwargs)


def _base_model_logprobs(model: nn.Module, *args) -> tuple[Tensor, Tensor]:
    """Completion log-probs of a peft model with its adapters disabled."""
    with model.disable_adapter():
        return completion_logprobs(model, *args)


class PolicyModule(StepGradients, PolicySampling):
    """A Hugging Face causal LM with sampling and held-out accuracy; the base of the training modules.

    Validation batches are dicts with ``input_ids``, ``attention_mask`` (left-padded prompts) and
    ``records``; the datamodule's ``task`` judges the completions. Logged at ``global_step`` (the steps
    done, as the progress bar shows them): ``val/accuracy`` (share of ``val_samples`` samples per
    prompt at ``temperature`` that are correct by the task's ``correct``, or their mean reward where
    the task cannot tell) and ``val/greedy_accuracy`` (greedy pass@1, likewise); where the task's rollouts are an agent's
    episodes, ``val/failed_episodes`` (the share whose environment failed, left out of both accuracies). Where more fail
    than the datamodule's ``max_failed_share`` in a validation outside ``fit`` (the one before training, ``lit-cancel
    validate``), it raises :class:`~lit_cancel.rounds.failures.FailedEpisodes`.

    The Hugging Face model is ``self.policy.model``; ``self.policy`` is a :class:`ModelRoot`, and
    every use of the model goes through it (``self.policy(fn, *args)``) so that sharding works.
    Completions end at the first of ``self.stop_token_ids``: the tokenizer's EOS and every
    ``eos_token_id`` of the model's generation config (:func:`~lit_cancel.rounds.sample.stop_token_ids`). How it samples
    with its engine (``rollout``, the engine's sync) is :class:`~lit_cancel.rounds.sample.PolicySampling`'s.

    Args:
        model_path: local Hugging Face model folder, or ``embedded:tiny-adder``.
        optimizer: optimizer factory, e.g. ``torch.optim.AdamW`` with its ``lr``.
        lr_scheduler: optional scheduler factory, stepped every optimizer step.
        temperature: sampling temperature, for rollouts and for the log-probs of the objective.
        top_p: nucleus sampling threshold (1.0 samples from the full distribution).
        max_new_tokens: longest completion.
        val_samples: samples per held-out prompt for ``val/accuracy``.
        logprob_chunk_size: token positions whose logits are materialised at once.
        max_tokens_per_chunk: every log-prob pass (the training step's, old and reference log-probs,
            the callbacks' extra passes) runs the decoder on the rows sorted by completion length, in
            chunks of at most this many tokens (rows x the chunk's longest row), without the padding
            of longer rows, and the LM head on completion tokens only. The log-probs and the gradient
            are those of the whole micro-batch, and the objective still sees it whole. 1024 was the
            fastest budget on a 2-core CPU at 0.8 M and 24 M parameters (benchmarks/README.md);
            None runs each batch at once, padding included.
        pack_sequences: run each chunk as one row of its sequences laid end to end, positions starting
            again at each, without any padding. With ``attn_implementation="flash_attention_2"`` the
            attention stays within each sequence; SDPA and eager attention (CPU) mask a block-diagonal
            attention over the whole chunk, so there the length-sorted chunks (False) are faster.
        dtype: parameter dtype to load (``float32``, ``bfloat16``); None keeps the checkpoint's.
        attn_implementation: the model's attention as Hugging Face names it (``sdpa``, ``eager``,
            ``flash_attention_2`` with ``flash-attn`` on an NVIDIA GPU); None: Hugging Face's default.
        from_scratch: build the architecture from the folder's ``config.json`` with random weights.
        lora: train LoRA adapters (peft) instead of the whole model.
        activation_checkpointing: recompute activations in the backward pass instead of keeping them.
            ``"blocks"`` (or True): each transformer block's (Hugging Face gradient checkpointing); what is
            kept grows with the micro-batch's tokens times the blocks (a block's input per token and block).
            ``"chunks"``: each chunk's whole decoder pass (needs ``max_tokens_per_chunk``); what is kept is
            one final state per completion token, and the recomputation holds one chunk's activations of
            every block at a time: the least memory for models of few blocks. ``"blocks+chunks"``: both, at
            the cost of one more forward pass; it keeps what ``"chunks"`` keeps, and the recomputation holds
            one chunk's block inputs and one block's activations: the least memory for long completions on
            large models (docs/gpu.md gives the bytes per token); where the steps send each chunk's gradient back at
            once (``RLModule.sends_chunks_back``), ``"chunks"`` recomputes nothing. False: none. ``"auto"``: of the modes whose
            training pass fits half the memory at hand, the one with the least modelled time x expected peak,
            chosen when fitting starts and stated in the log with that peak (:mod:`lit_cancel.activation_checkpointing`).
        generation_kwargs: further ``GenerationConfig`` options for sampling, e.g.
            ``{"suppress_tokens": [EOS_ID], "min_p": 0.05}``; the objective's log-probs do not see them.
        engine: what samples rollouts and validation completions (:mod:`lit_cancel.engines`);
            :class:`~lit_cancel.DecodeLoop` when None. ``lit_cancel.VLLMEngine`` samples with vLLM.
        compile: ``torch.compile`` the model's decoder (``dynamic=True``), which every decoding step and log-prob pass
            runs; pays in long runs of small models. Needs a C++ compiler on a CPU; not with a sharding strategy.
            ``"auto"``: compiled when the run's ``max_steps`` save more than compiling costs, as modelled when fitting
            starts and stated in the log (:mod:`lit_cancel.compile_choice`).
    """

    def __init__(
        self,
        model_path: str = "embedded:tiny-adder",
        optimizer: OptimizerCallable = torch.optim.AdamW,
        lr_scheduler: LRSchedulerCallable | None = None,
        temperature: float = 1.0,
        top_p: float = 1.0,
        max_new_tokens: int = 64,
        val_samples: int = 4,
        logprob_chunk_size: int = 1024,
        max_tokens_per_chunk: int | None = 1024,
        pack_sequences: bool = False,
        dtype: Literal["float32", "bfloat16", "float16"] | None = None,
        attn_implementation: str | None = None,
        from_scratch: bool = False,
        lora: LoRA | None = None,
        activation_checkpointing: bool | Literal["blocks", "chunks", "blocks+chunks", "auto"] = False,
        generation_kwargs: dict | None = None,
        engine: RolloutEngine | None = None,
        compile: bool | Literal["auto"] = False,
    ):
        super().__init__()
        bound_kernel_cache()
        self.generation_kwargs = checked_generation_kwargs(generation_kwargs or {})
        self.engine = engine if engine is not None else DecodeLoop()
        supported = self.engine.supported_options
        if supported is not None and (refused := sorted(set(self.generation_kwargs) - supported)):
            raise ValueError(
                f"generation_kwargs: {type(self.engine).__name__} cannot honour {', '.join(map(repr, refused))}; it takes "
                f"{', '.join(sorted(supported))} (and the module's temperature, top_p and max_new_tokens)"
            )
        # optimizer steps and checkpoint loads change the weights; the engine is synced when it is behind
        self.weights_version, self.engine_version = 0, None
        self.loaded_step = 0
        check_settings(temperature, top_p, max_new_tokens, val_samples, logprob_chunk_size, max_tokens_per_chunk, pack_sequences,
                       activation_checkpointing, compile)
        self.optimizer_factory, self.scheduler_factory = optimizer, lr_scheduler
        self.temperature, self.top_p, self.max_new_tokens = temperature, top_p, max_new_tokens
        self.val_samples, self.logprob_chunk_size = val_samples, logprob_chunk_size
        self.max_tokens_per_chunk, self.pack_sequences = max_tokens_per_chunk, pack_sequences
        self.compile = compile  # "auto" until setup chooses
        self.tokenizer = load_tokenizer(model_path, option="model_path")
        # from_pretrained returns eval mode; rollout() switches to eval itself
        model = load_causal_lm(model_path, from_scratch=from_scratch, dtype=dtype, attn_implementation=attn_implementation).train()
        self.stop_token_ids = stop_token_ids(model, self.tokenizer)
        self.activation_checkpointing = activation_checkpointing  # "auto" until fit's setup chooses
        self.recompute_chunks = use_activation_checkpointing(model, activation_checkpointing)
        if lora is not None:
            model = lora.apply(model)
            # checkpoints hold the adapters only; the base weights come from model_path
            self.strict_loading = False
        # every use of the model runs inside the root's forward, which FSDP needs (see sharding.py)
        self.policy = ModelRoot(model)
        self.lora = lora
        self.val_accuracy, self.val_greedy_accuracy = MeanMetric(), MeanMetric()
        self.val_failures = FailureCount()  # the episodes of the validation in progress that failed

    def chunks_sent_back_in_fit(self) -> bool:
        """Whether this fit's training steps send each chunk's gradient back as soon as its forward ends (none here)."""
        return False

    def optimizer_step(self, *args, **kwargs) -> None:
        super().optimizer_step(*args, **kwargs)
        self.weights_version += 1

    def completion_logprobs(self, root: ModelRoot, input_ids: Tensor, attention_mask: Tensor, prompt_length: int) -> tuple[Tensor, Tensor]:
        """``(logprobs, entropy)`` of the completion tokens under ``root``'s model at the sampling temperature."""
        return root(
            completion_logprobs, input_ids, attention_mask, prompt_length, self.temperature, self.logprob_chunk_size,
            self.max_tokens_per_chunk, self.pack_sequences, self.recompute_chunks,
        )

    def setup(self, stage: str) -> None:
        """Chooses ``compile: auto``'s and ``activation_checkpointing: auto``'s answers when fitting starts; on a CPU without
        bfloat16 instructions, a ``bf16`` precision's products are computed in float32 (:mod:`lit_cancel.float32_products`)."""
        # a validation before fitting runs eager; every process takes process 0's choices, though each measures its own
        if self.compile == COMPILE_AUTO and stage == "fit":
            choice = self.trainer.strategy.broadcast(auto_compile(self, self.trainer))
            self.compile = choice.compile
            rank_zero_info(f"model.init_args.compile auto: {str(choice.compile).lower()} ({choice.reason})")
        precision = str(self.trainer.precision)
        widen = wants_float32_products(precision, self.trainer.strategy.root_device, self.compile is True)
        if widen and not self.policy.float32_products:  # said once, though validate and fit each set the module up
            rank_zero_info(f"trainer.precision {precision}: this CPU has no bfloat16 instructions, so each bfloat16 matrix product is "
                           "computed in float32 from the same bfloat16 values and rounded back, several times faster than "
                           "its emulation")
        for root in self.modules():
            if isinstance(root, ModelRoot):
                root.float32_products = widen
        if stage == "fit" and self.activation_checkpointing == AUTO:
            shape = self.trainer.datamodule.micro_batch_shape(self.max_new_tokens)
            choice = self.trainer.strategy.broadcast(auto_checkpointing(self, self.trainer, *shape, self.chunks_sent_back_in_fit()))
            self.activation_checkpointing = choice.mode
            self.recompute_chunks = use_activation_checkpointing(self.policy.model, choice.mode)
            rank_zero_info(f"model.init_args.activation_checkpointing auto: {mode_name(choice.mode)} ({choice.reason})")

    def configure_model(self) -> None:
        """Shards the policy block by block under ``ModelParallelStrategy`` (FSDP2; ``FSDPStrategy`` is refused); compiles
        its decoder with ``compile``."""
        self.policy = shard(self.policy, self.trainer.strategy, str(self.trainer.precision))
        if self.compile is True and compile_decoder(self.policy):  # once, though each of validate and fit configures the model
            rank_zero_info("model.init_args.compile: the decoder is compiled at its first pass of each kind (rollout, training, "
                           "validation); on a CPU each can take a minute before the run goes on at full speed")

    def validation_step(self, batch: dict, batch_idx: int) -> None:
        records, size = batch["records"], len(batch["records"])
        task = self.trainer.datamodule.task
        rollout = named_rollout(task.rollout, record_names(task, "val", batch["indices"]))
        greedy = rollout(self, records, batch["input_ids"], batch["attention_mask"], greedy=True)
        self.update_accuracy(self.val_greedy_accuracy, task, records, greedy)
        sampled = rollout(self, records, batch["input_ids"], batch["attention_mask"], num_samples=self.val_samples)
        self.update_accuracy(self.val_accuracy, task, [r for r in records for _ in range(self.val_samples)], sampled)
        # the loggers get the values in on_validation_epoch_end, at the step the training scalars and the bar show
        self.log("val/accuracy", self.val_accuracy, batch_size=size * self.val_samples, logger=False)
        self.log("val/greedy_accuracy", self.val_greedy_accuracy, batch_size=size, logger=False)

    def update_accuracy(self, metric: MeanMetric, task, records: list[dict], generation: Generation) -> None:
        """Adds ``generation``'s accuracy terms to ``metric``, of the rows whose episode ran: a failed episode is counted in
        ``val/failed_episodes`` instead (where the task's rollouts are episodes)."""
        if generation.failures is None:
            metric.update(accuracy_terms(task, records, generation.texts, generation.rewards))
            return
        self.val_failures.add(generation.failures)
        ran = [row for row, failure in enumerate(generation.failures) if failure is None]
        if ran:
            given = None if generation.rewards is None else generation.rewards[ran]
            metric.update(accuracy_terms(task, [records[row] for row in ran], [generation.texts[row] for row in ran], given))

    def on_validation_epoch_start(self) -> None:
        self.val_failures = FailureCount()

    def on_validation_epoch_end(self) -> None:
        # Lightning would log a validation within fit at the steps done before the step that triggered it
        if self.trainer.sanity_checking:
            return
        values = {"val/accuracy": float(self.val_accuracy.compute()), "val/greedy_accuracy": float(self.val_greedy_accuracy.compute())}
        if self.val_failures.episodes:  # episodes, which may fail
            failures = self.val_failures.summed(lambda counts: self.trainer.strategy.reduce(counts, reduce_op="sum"), self.device)
            values["val/failed_episodes"] = failures.share
            self.log("val/failed_episodes", failures.share, logger=False)
            budget = getattr(self.trainer.datamodule, "failure_budget", None)
            # the validation before training, and lit-cancel validate: episodes that fail past the budget are bad input
            if budget is not None and self.trainer.state.fn == TrainerFn.VALIDATING and budget.exceeded(failures):
                raise FailedEpisodes(budget.validation_message(failures))
        # a validation of a checkpoint outside fit has global_step 0: it belongs at the checkpoint's step
        step = max(self.global_step, self.loaded_step)
        if self.trainer.is_global_zero:
            for logger in self.trainer.loggers:
                logger.log_metrics(values, step=step)

    def on_validation_end(self) -> None:
        self.engine.release()

    def on_save_checkpoint(self, checkpoint: dict) -> None:
        if self.lora is not None:
            trained = {name for name, p in self.named_parameters() if p.requires_grad}
            checkpoint["state_dict"] = {k: v for k, v in checkpoint["state_dict"].items() if k in trained}

    def on_load_checkpoint(self, checkpoint: dict) -> None:
        # the weights about to be loaded are not the engine's
        self.weights_version += 1
        self.loaded_step = checkpoint.get("global_step", 0)

    def export(self, output_dir: str) -> None:
        """Saves the policy as a Hugging Face folder (adapters merged into the weights) with its tokenizer.

        With LoRA the merge happens in place: afterwards this module's policy is the merged model.
        """
        if is_sharded(self.policy):
            raise RuntimeError(
                "export() needs the whole policy, but it is sharded in this process; export the run's checkpoint: "
                "lit-cancel export --config CONFIG --ckpt_path CHECKPOINT --output_dir DIR"
            )
        model = self.policy.model
        if self.lora is not None:
            model = self.policy.model = model.merge_and_unload()
        model.save_pretrained(output_dir)
        self.tokenizer.save_pretrained(output_dir)

    def configure_optimizers(self):
        optimizer = self.optimizer_factory(p for p in self.parameters() if p.requires_grad)
        if self.scheduler_factory is None:
            return optimizer
        return {"optimizer": optimizer, "lr_scheduler": {"scheduler": self.scheduler_factory(optimizer), "interval": "step"}}


def check_settings(temperature: float, top_p: float, max_new_tokens: int, val_samples: int, logprob_chunk_size: int,
                   max_tokens_per_chunk: int | None, pack_sequences: bool, activation_checkpointing: bool | str,
                   compile: bool | str = False) -> None:
    """Raises ValueError, naming the setting, for a :class:`PolicyModule` setting out of its range or one that needs another."""
    if compile not in (True, False, COMPILE_AUTO):
        raise ValueError(f"compile must be true, false or 'auto', got {compile!r}")
    if temperature <= 0:
        raise ValueError(f"temperature must be > 0, got {temperature}")
    if not 0 < top_p <= 1:
        raise ValueError(f"top_p must be in (0, 1], got {top_p}")
    if max_new_tokens < 1 or val_samples < 1 or logprob_chunk_size < 1:
        raise ValueError(
            f"max_new_tokens, val_samples and logprob_chunk_size must be >= 1, got {max_new_tokens}, {val_samples}, {logprob_chunk_size}"
        )
    if max_tokens_per_chunk is not None and max_tokens_per_chunk < 1:
        raise ValueError(f"max_tokens_per_chunk must be >= 1 or None, got {max_tokens_per_chunk}")
    if pack_sequences and max_tokens_per_chunk is None:
        raise ValueError("pack_sequences needs max_tokens_per_chunk: the most tokens in one packed row")
    if activation_checkpointing not in (False, True, "blocks", "chunks", "blocks+chunks", AUTO):
        raise ValueError(
            "activation_checkpointing must be false, true, 'blocks', 'chunks', 'blocks+chunks' or 'auto', "
            f"got {activation_checkpointing!r}"
        )
    if activation_checkpointing in ("chunks", "blocks+chunks") and max_tokens_per_chunk is None:
        raise ValueError(
            f"activation_checkpointing {activation_checkpointing!r} recomputes chunks of max_tokens_per_chunk, which is null"
        )


def compile_decoder(root: ModelRoot) -> bool:
    """``torch.compile`` the decoder of ``root``'s model in place, for shapes that vary; False when it already was."""
    if is_sharded(root):
        raise ValueError("model.init_args.compile: a sharded model's decoder is not compiled; use compile: false with this strategy")
    decoder = root.model.get_decoder()
    if getattr(decoder, "_compiled_call_impl", None) is not None:
        return False
    # inductor's vectorised C++ kernels (torch 2.13) corrupted the heap with AVX-512 and gave NaN logits with AVX2
    # on a decoder that ran with and then without its KV cache; scalar kernels decoded no slower
    decoder.compile(dynamic=True, options={"cpp.vec_isa_ok": False})
    return True


class RLModule(PolicyModule):
    """Critic-free RL on rollout mini-batches: policy, optional reference model, and an objective.

    The training step receives a :class:`RolloutBatch` (built by ``RolloutDataModule``) and
    returns only what it computed: ``loss``; ``credits`` (``-d loss / d logprobs``, zero on
    padding), ``logprobs`` and ``entropy``, each ``[B, C]`` and detached. The callbacks in
    ``lit_cancel.callbacks`` read each key from these outputs first, then from the batch
    (``completion_mask``, ``advantages``, ``group_ids``, ``input_ids``, ``attention_mask``,
    ``prompt_length``). The methods ``token_logprobs``, ``next_token_logprobs`` and
    ``sequence_logprobs`` give them their extra forward passes.

    Every optimizer step logs ``health/grad_norm``, the global gradient norm before clipping. An
    optimizer step whose loss or gradient is not finite is skipped (the weights and the
    optimizer state stay as they were), counted in ``health/skipped_steps`` and named in a warning;
    after ``max_skipped_steps`` such steps in a row the run stops with an error.

    Args:
        objective: the objective; :class:`GRPO` when None. A reference model is built only when
            its ``kl_coef`` is above 0 (with ``lora``, the policy with its adapters disabled serves).
        max_skipped_steps: non-finite optimizer steps in a row after which the run stops.
        **kwargs: see :class:`PolicyModule`.
    """

    def __init__(
        self, model_path: str = "embedded:tiny-adder", objective: Objective | None = None, max_skipped_steps: int = 3, **kwargs
    ):
        super().__init__(model_path, **kwargs)
        if max_skipped_steps < 1:
            raise ValueError(f"max_skipped_steps must be >= 1, got {max_skipped_steps}")
        self.objective = objective if objective is not None else GRPO()
        self.max_skipped_steps = max_skipped_steps
        self.skipped_steps, self.skipped_in_a_row = 0, 0
        self.nonfinite_loss = torch.tensor(False)
        self.step_stat_names: set[str] = set()
        # with LoRA the reference is the policy with its adapters disabled, not a second copy
        self.reference = None
        if self.objective.kl_coef > 0 and self.lora is None:
            self.reference = copy.deepcopy(self.policy).eval().requires_grad_(False)

    def configure_model(self) -> None:
        super().configure_model()
        if self.reference is not None:
            self.reference = shard(self.reference, self.trainer.strategy, str(self.trainer.precision))
            if self.compile is True:
                compile_decoder(self.reference)

    @torch.no_grad()
    def score_rollouts(self, generation: Generation, with_old_logprobs: bool) -> tuple[Tensor | None, Tensor | None]:
        """``(old_logprobs, ref_logprobs)`` of freshly sampled completions; None where not needed."""
        args = (generation.input_ids, generation.attention_mask, generation.prompt_length)
        old = self.completion_logprobs(self.policy, *args)[0] if with_old_logprobs else None
        return old, self.reference_logprobs(*args) if self.objective.kl_coef > 0 else None

    @torch.no_grad()
    def reference_logprobs(self, input_ids: Tensor, attention_mask: Tensor, prompt_length: int) -> Tensor:
        """``[B, C]`` log-probs of the completion tokens under the reference model."""
        if self.reference is not None:
            return self.completion_logprobs(self.reference, input_ids, attention_mask, prompt_length)[0]
        return self.policy(
            _base_model_logprobs, input_ids, attention_mask, prompt_length, self.temperature, self.logprob_chunk_size,
            self.max_tokens_per_chunk, self.pack_sequences,
        )[0]

    @torch.no_grad()
    def token_logprobs(self, input_ids: Tensor, attention_mask: Tensor, prompt_length: int) -> Tensor:
        """``[B, C]`` log-probs of the completion tokens under the current policy."""
        return self.completion_logprobs(self.policy, input_ids, attention_mask, prompt_length)[0]

    @torch.no_grad()
    def next_token_logprobs(self, input_ids: Tensor, attention_mask: Tensor, positions: Tensor) -> Tensor:
        """``[N, V]`` log-distribution of the next token after each ``(row, position)`` of ``positions`` (``[N, 2]``)."""
        return self.policy(next_token_logprobs, input_ids, attention_mask, positions, self.temperature)

    @torch.no_grad()
    def sequence_logprobs(self, prompts: list[str] | list[list[int]], completions: list[str] | list[list[int]]) -> Tensor:
        """``[N]`` log-probability of each completion after its prompt, under the current policy.

        Strings are tokenised, and each completion string is closed with EOS, which counts: the
        probability of the completion as a whole answer. Token ids are scored as given (end a
        completion with ``tokenizer.eos_token_id`` to count its EOS).
        """
        if all(isinstance(text, str) for text in prompts):
            prompt = self.tokenizer(prompts, return_tensors="pt", padding=True, add_special_tokens=False)
            prompt_ids, prompt_mask = prompt["input_ids"], prompt["attention_mask"]
        else:
            prompt_ids, prompt_mask = padded([list(ids) for ids in prompts], self.tokenizer.pad_token_id, left=True)
        if all(isinstance(text, str) for text in completions):
            completion, mask = encode_completions(self.tokenizer, completions)
        else:
            completion, mask = padded([list(ids) for ids in completions], self.tokenizer.pad_token_id, left=False)
        input_ids = torch.cat([prompt_ids, completion], 1).to(self.device)
        attention_mask = torch.cat([prompt_mask, mask], 1).to(self.device)
        logprobs = self.token_logprobs(input_ids, attention_mask, prompt_ids.shape[1])
        return (logprobs * mask.to(self.device)).sum(1)

    def training_step(self, batch: RolloutBatch, batch_idx: int) -> dict:
        if self.sends_chunks_back(batch.old_logprobs is not None, batch.sampler_logprobs is not None):
            # the credits do not depend on the pass's log-probs: each chunk's gradient goes back as soon as it is known
            credits = self.objective(torch.zeros_like(batch.completion_mask, dtype=torch.float32), batch).credits
            logprobs, entropy, last_chunk = self.policy(
                backward_by_chunk, batch.input_ids, batch.attention_mask, batch.prompt_length, credits,
                self.chunk_backward, self.temperature, self.logprob_chunk_size, self.max_tokens_per_chunk, self.pack_sequences,
            )
            out = self.objective(logprobs, batch)
            # Lightning sends back the last chunk's gradient; the value is the loss's
            loss = last_chunk + (out.loss - last_chunk.detach())
        else:
            logprobs, entropy = self.completion_logprobs(
                self.policy, batch.input_ids, batch.attention_mask, batch.prompt_length
            )
            out = self.objective(logprobs, batch)
            loss = out.loss
        self.nonfinite_loss = self.nonfinite_loss | ~torch.isfinite(out.loss.detach())
        mask = batch.completion_mask
        size = len(batch)
        self.log_dict(out.metrics, batch_size=size)
        self.log("health/entropy", (entropy * mask).sum() / mask.sum().clamp(min=1), batch_size=size)
        if batch.stats:
            self.log_step_stats(batch.stats, size)
        return {"loss": loss, "credits": out.credits, "logprobs": logprobs.detach(), "entropy": entropy.detach()}

    def sends_chunks_back(self, old_logprobs: bool, sampler_logprobs: bool) -> bool:
        """Whether a training pass over a batch with (or without) old and sampler log-probs sends each chunk's gradient
        back as soon as its forward ends (:func:`~lit_cancel.logprobs.backward_by_chunk`): the decoder runs in chunks
        (``max_tokens_per_chunk``), the objective's credits do not depend on the pass's log-probs for such a batch, and
        one process trains without a gradient scaler (under DDP or sharding each backward would synchronise the
        gradients)."""
        trainer = self._trainer  # a training step called without one runs alone, unscaled
        return (
            self.max_tokens_per_chunk is not None
            and not self.objective.credits_need_values(old_logprobs, sampler_logprobs)
            and (trainer is None or trainer.world_size == 1 and not scales_gradients(trainer))
        )

    def chunks_sent_back_in_fit(self) -> bool:
        """:meth:`sends_chunks_back` for this fit's batches: on-policy rounds (no old log-probs recorded) from an engine
        that decodes with the module's own weights (no sampler log-probs)."""
        off_policy = getattr(getattr(self.trainer.datamodule, "producer", None), "with_old_logprobs", True)
        return self.sends_chunks_back(off_policy, self.engine.holds_weights)

    def chunk_backward(self, loss: Tensor) -> None:
        """A chunk's backward, scaled as Lightning scales the step's loss under gradient accumulation."""
        self.backward(loss if self._trainer is None else loss / self._trainer.accumulate_grad_batches)

    def log_step_stats(self, stats: dict[str, float], batch_size: int) -> None:
        """Logs the statistics of this optimizer step's rollouts (``RolloutBatch.stats``); one logged at an earlier step
        and absent from ``stats`` (``rollout/reward_truncated`` of a round without a cut completion) is not logged.

        Lightning hands a value logged in ``training_step`` to the loggers again at every later step until it is
        logged anew (lightning/pytorch/trainer/connectors/logger_connector/result.py, ``_ResultCollection.valid_items``
        and ``update_metrics``), so such a statistic would repeat an earlier round's value; its entry is dropped.
        """
        for name in self.step_stat_names - stats.keys():
            self.trainer._results.pop(f"training_step.{name}", None)
            self.trainer.callback_metrics.pop(name, None)
            self.trainer.logged_metrics.pop(name, None)
        self.step_stat_names = set(stats)
        self.log_dict(stats, batch_size=batch_size)

    def on_before_optimizer_step(self, optimizer: torch.optim.Optimizer) -> None:
        """Logs ``health/grad_norm`` (before clipping, which Lightning does after this hook) and skips a step whose loss or
        gradient is not finite: without gradients the optimizer leaves every parameter alone."""
        self.log("health/grad_norm", total_norm([p.grad for p in self.parameters() if p.grad is not None]))
        # sharded gradients are DTensors: each process checks its own shard, then the processes agree
        grads = [p.grad.to_local() if hasattr(p.grad, "to_local") else p.grad for p in self.parameters() if p.grad is not None]
        gradient_finite = torch.stack([torch.isfinite(g).all() for g in grads]).all() if grads else torch.tensor(True)
        flags = torch.stack([self.nonfinite_loss.to(self.device), ~gradient_finite.to(self.device)]).float()
        loss_bad, gradient_bad = (self.trainer.strategy.reduce(flags, reduce_op="sum") > 0).tolist()
        self.nonfinite_loss = torch.tensor(False)
        if loss_bad or gradient_bad:
            optimizer.zero_grad(set_to_none=True)
            self.skipped_steps += 1
            self.skipped_in_a_row += 1
            quantity = "loss" if loss_bad else "gradient norm"
            lr = optimizer.param_groups[0]["lr"]
            if self.skipped_in_a_row >= self.max_skipped_steps:
                raise FloatingPointError(
                    f"the {quantity} was not finite in {self.skipped_in_a_row} optimizer steps in a row (the last at step "
                    f"{self.global_step}); the weights are those of the last finite step. Lower the learning rate "
                    f"(now {lr:g}, model.init_args.optimizer.init_args.lr)"
                )
            rank_zero_warn(
                f"step {self.global_step}: the {quantity} is not finite; the optimizer step is skipped "
                f"({self.skipped_in_a_row} in a row, the run stops at {self.max_skipped_steps}; learning rate {lr:g})"
            )
        else:
            self.skipped_in_a_row = 0
        self.log("health/skipped_steps", float(self.skipped_steps))

    def on_save_checkpoint(self, checkpoint: dict) -> None:
        super().on_save_checkpoint(checkpoint)
        checkpoint["skipped_steps"] = self.skipped_steps

    def on_load_checkpoint(self, checkpoint: dict) -> None:
        super().on_load_checkpoint(checkpoint)
        self.skipped_steps = checkpoint.get("skipped_steps", 0)
