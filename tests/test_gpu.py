"""The CUDA paths: vLLM colocated on a GPU, sleep mode, FSDP2 on every visible GPU, exact resume, CUDA generators.

Every test here is marked ``gpu`` and skipped without a CUDA GPU (the vLLM ones also without vLLM):

    pytest -m gpu                      # before a long job; benchmarks/performance/gpu_smoke.py runs it, then a short real run

vLLM changes the process it runs in (see tests/engines/test_vllm_engine.py), so run them in their own pytest process;
each test with a sleep-mode engine runs in a process of its own (``in_own_process``).
"""

import copy
import functools
import importlib.util
import json
import os
import subprocess
import sys
from functools import partial
from pathlib import Path

import lightning as L
import pytest
import torch
from conftest import save_tiny_model

from lit_cancel import AdditionTask, LoRA, RLModule, RolloutDataModule
from lit_cancel.rounds.sample import encode_prompts

ROOT = Path(__file__).parents[1]
CONFIGS = ROOT / "configs"
HAS_CUDA = torch.cuda.is_available()
OWN_PROCESS = "LIT_CANCEL_GPU_TEST_IN_OWN_PROCESS"
pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not HAS_CUDA, reason="needs a CUDA GPU (torch.cuda.is_available() is False)")]
needs_vllm = pytest.mark.skipif(HAS_CUDA and importlib.util.find_spec("vllm") is None, reason="needs vLLM: pip install -e '.[vllm]'")
needs_two_gpus = pytest.mark.skipif(HAS_CUDA and torch.cuda.device_count() < 2, reason="FSDP2 needs at least 2 GPUs")

PROMPTS = ["12+34=", "105+207=", "999+1=", "450+450="]
# a small KV cache, so several engines fit in one test process beside the training's memory
KV_CACHE = 256 * 2**20
# the engine samples in bfloat16 (its default on a GPU), the trainer computes log-probs in float32 weights under
# bf16 autocast (bf16-mixed): bfloat16 keeps 8 significant bits, so logits of magnitude ~10 are rounded by ~0.04 on
# either side and the per-token log-probs differ by a few hundredths on average, rarely by more than a few tenths
BF16_MEAN_TOLERANCE, BF16_MAX_TOLERANCE = 0.05, 0.5


def in_own_process(test):
    """Runs ``test`` in a pytest process of its own: vLLM allows one sleep-mode memory pool (its CuMemAllocator) per
    process, so a second sleep-mode engine in the same process fails."""

    @functools.wraps(test)
    def run(*args, **kwargs):
        if os.environ.get(OWN_PROCESS) == test.__name__:
            return test(*args, **kwargs)
        command = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", f"{__file__}::{test.__name__}"]
        result = subprocess.run(command, capture_output=True, text=True, timeout=900, cwd=ROOT,
                                env={**os.environ, OWN_PROCESS: test.__name__})
        assert result.returncode == 0, (result.stdout + result.stderr)[-4000:]

    run.runs_in_own_process = True
    return run


def gpu_module(engine=None, **kwargs) -> RLModule:
    module = RLModule("embedded:tiny-adder", engine=engine, max_new_tokens=40, **kwargs)
    return module.to("cuda")


def vllm_engine(**kwargs):
    from lit_cancel import VLLMEngine

    return VLLMEngine(**{"kv_cache_memory_bytes": KV_CACHE, "enforce_eager": True, "sleep": False, **kwargs})


def prompts(module: RLModule) -> tuple[torch.Tensor, torch.Tensor]:
    encoded = encode_prompts(module.tokenizer, [{"prompt": text} for text in PROMPTS])
    return encoded["input_ids"].cuda(), encoded["attention_mask"].cuda()


def bf16_gap(module: RLModule, generation) -> tuple[float, float]:
    """Mean and largest |sampler log-prob - trainer log-prob| over the completion tokens, the trainer under bf16 autocast."""
    with torch.autocast("cuda", dtype=torch.bfloat16):
        trainer = module.token_logprobs(generation.input_ids, generation.attention_mask, generation.prompt_length)
    gap = (trainer - generation.sampler_logprobs).abs() * generation.completion_mask
    return float(gap.sum() / generation.completion_mask.sum()), float(gap.max())


def completions(tokens: torch.Tensor, prompt_length: int, eos: int) -> list[list[int]]:
    """Each row's completion up to and including its first EOS."""
    rows = []
    for row in tokens[:, prompt_length:].tolist():
        rows.append(row[: row.index(eos) + 1] if eos in row else row)
    return rows


@needs_vllm
def test_vllm_on_a_gpu_samples_in_bfloat16_and_its_log_probs_agree_with_the_trainers_after_each_sync():
    module = gpu_module(vllm_engine(), temperature=0.8)
    for version in range(2):
        if version:  # what an optimizer step does: new weights, pushed before the next rollout
            with torch.no_grad():
                for parameter in module.policy.parameters():
                    parameter.add_(torch.randn_like(parameter) * 0.05 * parameter.abs().mean().clamp(min=0.02))
            module.weights_version += 1
        torch.manual_seed(version)
        with torch.autocast("cuda", dtype=torch.bfloat16):  # as bf16-mixed's forward context: the engine turns it off
            generation = module.rollout(*prompts(module), num_samples=4)
        assert generation.sync_seconds > 0
        mean_gap, max_gap = bf16_gap(module, generation)
        assert mean_gap < BF16_MEAN_TOLERANCE and max_gap < BF16_MAX_TOLERANCE, (mean_gap, max_gap)
    assert module.engine.llm.model_config.dtype == torch.bfloat16  # float32 parameters, the engine in bfloat16


@needs_vllm
def test_a_lora_push_makes_the_engines_greedy_output_the_merged_models():
    module = gpu_module(vllm_engine(dtype="float32"), lora=LoRA(rank=2))
    with torch.no_grad():  # lora_B starts at zero: make the adapters change the outputs
        for name, parameter in module.policy.named_parameters():
            if "lora_B" in name:
                parameter.add_(torch.randn_like(parameter) * 0.5)
    ids, mask = prompts(module)
    engine_output = module.rollout(ids, mask, greedy=True)
    merged = copy.deepcopy(module.policy.model).merge_and_unload().eval()
    tokenizer = module.tokenizer
    with torch.no_grad():
        merged_output = merged.generate(input_ids=ids, attention_mask=mask, do_sample=False, max_new_tokens=module.max_new_tokens,
                                        pad_token_id=tokenizer.pad_token_id, eos_token_id=tokenizer.eos_token_id)
    eos = tokenizer.eos_token_id
    assert completions(engine_output.input_ids, ids.shape[1], eos) == completions(merged_output, ids.shape[1], eos)


def test_a_weight_push_holds_one_weight_at_a_time_on_the_gpu(tmp_path):
    """merged_weights casts (and under FSDP2 gathers) one weight at a time: the push's peak is about its largest
    weight, not the model (a dict of every weight would add the whole model in bfloat16)."""
    from transformers import AutoModelForCausalLM

    from lit_cancel.engines.vllm_common import merged_weights

    model = AutoModelForCausalLM.from_pretrained(save_tiny_model(tmp_path / "model", hidden=512, layers=8)).cuda()
    sizes = [p.numel() * 2 for p in model.parameters()]
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    before = torch.cuda.memory_allocated()
    pushed = 0
    for _, weight in merged_weights(model, torch.bfloat16):
        pushed += weight.numel() * weight.element_size()
        del weight
    peak = torch.cuda.max_memory_allocated() - before
    assert pushed >= sum(sizes)
    assert peak <= 2 * max(sizes) + 2**20, (peak, max(sizes), sum(sizes))


@needs_vllm
@in_own_process
def test_sleep_mode_gives_the_kv_cache_back_between_rollouts_and_keeps_it_released_during_a_push():
    kv_cache = 4 * 2**30
    module = gpu_module(vllm_engine(kv_cache_memory_bytes=kv_cache, sleep=True), temperature=0.8)
    engine = module.engine
    torch.manual_seed(0)
    module.rollout(*prompts(module), num_samples=2)
    assert engine.asleep == {"weights", "kv_cache"} and engine.weights_discarded  # after every rollout: sleep level 2
    free_asleep = torch.cuda.mem_get_info()[0]
    free_at_push, collective_rpc = [], engine.llm.collective_rpc

    def recording(method, *args, **kwargs):
        if method == "reload_weights":
            free_at_push.append(torch.cuda.mem_get_info()[0])
        return collective_rpc(method, *args, **kwargs)

    engine.llm.collective_rpc = recording
    module.weights_version += 1
    torch.manual_seed(1)
    synced = module.rollout(*prompts(module), num_samples=2)
    # the discarded weights were pushed again: the rotary tables (buffers, not pushed) came back with them
    mean_gap, max_gap = bf16_gap(module, synced)
    assert mean_gap < BF16_MEAN_TOLERANCE and max_gap < BF16_MAX_TOLERANCE, (mean_gap, max_gap)
    engine._wake()
    free_awake = torch.cuda.mem_get_info()[0]
    assert free_asleep - free_awake > 0.9 * kv_cache, (free_asleep, free_awake)
    assert free_at_push[0] - free_awake > 0.9 * kv_cache, (free_at_push, free_awake)  # the push woke the weights alone


@needs_vllm
@in_own_process
def test_with_sleep_mode_a_rollout_with_no_sync_since_the_last_samples_from_the_pushed_weights_not_discarded_ones():
    module = gpu_module(vllm_engine(sleep=True), temperature=0.8)
    torch.manual_seed(0)
    module.rollout(*prompts(module), greedy=True)  # outside a validation the engine sleeps after every call
    torch.manual_seed(1)
    sampled = module.rollout(*prompts(module), num_samples=4)  # no optimizer step in between: no sync by the module
    assert sampled.sync_seconds > 0  # the engine pushed the weights its last sleep discarded
    mean_gap, max_gap = bf16_gap(module, sampled)
    assert mean_gap < BF16_MEAN_TOLERANCE and max_gap < BF16_MAX_TOLERANCE, (mean_gap, max_gap)


@needs_vllm
@in_own_process
def test_with_sleep_mode_a_validation_pushes_the_weights_once_and_samples_every_batch_from_them():
    module = gpu_module(vllm_engine(sleep=True), temperature=0.8, val_samples=2)
    engine, pushes, generations = module.engine, [], []
    engine.sync = lambda policy: pushes.append(policy.step) or type(engine).sync(engine, policy)
    rollout = module.rollout
    module.rollout = lambda *args, **kwargs: generations.append(rollout(*args, **kwargs)) or generations[-1]
    data = RolloutDataModule(AdditionTask(num_digits=3, train_size=16, val_size=8), prompts_per_round=4, group_size=2,
                             val_batch_size=4)
    trainer = L.Trainer(accelerator="cuda", devices=1, precision="bf16-mixed", logger=False, enable_progress_bar=False,
                        enable_model_summary=False)
    torch.manual_seed(0)
    trainer.validate(module, datamodule=data)
    assert len(generations) == 4 and len(pushes) == 1  # 2 batches of greedy then sampled completions, one push
    assert engine.asleep == {"weights", "kv_cache"} and engine.weights_discarded  # asleep again once it ended
    for sampled in generations[1::2]:  # sampled after the greedy call of their batch, with no sleep in between
        mean_gap, max_gap = bf16_gap(module, sampled)
        assert mean_gap < BF16_MEAN_TOLERANCE and max_gap < BF16_MAX_TOLERANCE, (mean_gap, max_gap)


@needs_vllm
def test_sleep_mode_runs_with_expandable_segments(tmp_path):
    # vLLM turns expandable segments off around its own memory pool (CuMemAllocator.use_memory_pool)
    script = (
        "import torch\n"
        "from test_gpu import BF16_MEAN_TOLERANCE, bf16_gap, gpu_module, prompts, vllm_engine\n"
        "module = gpu_module(vllm_engine(sleep=True), temperature=0.8)\n"
        "for version in range(2):\n"
        "    module.weights_version = version\n"
        "    torch.manual_seed(version)\n"
        "    generation = module.rollout(*prompts(module), num_samples=2)\n"
        "    assert bf16_gap(module, generation)[0] < BF16_MEAN_TOLERANCE, bf16_gap(module, generation)\n"
        "assert module.engine.asleep\n"
    )
    env = {**os.environ, "PYTORCH_CUDA_ALLOC_CONF": "expandable_segments:True",
           "PYTHONPATH": os.pathsep.join([str(ROOT), str(ROOT / "tests"), os.environ.get("PYTHONPATH", "")])}
    result = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=600, env=env, cwd=tmp_path)
    assert result.returncode == 0, result.stderr[-4000:]


@needs_vllm
def test_building_the_engine_keeps_the_runs_cuda_and_cpu_random_streams():
    module = gpu_module(vllm_engine())
    torch.manual_seed(123)  # seeds CUDA's generators too
    cuda_before, cpu_before = torch.cuda.get_rng_state_all(), torch.random.get_rng_state()
    module.engine.build(module)  # vLLM seeds every generator with its own seed (0)
    assert all(torch.equal(a, b) for a, b in zip(torch.cuda.get_rng_state_all(), cuda_before))
    assert torch.equal(torch.random.get_rng_state(), cpu_before)


def fit(module, steps, root, ckpt_path=None):
    data = RolloutDataModule(AdditionTask(num_digits=3, train_size=64, val_size=4), prompts_per_round=4, group_size=4)
    trainer = L.Trainer(
        max_steps=steps, accelerator="cuda", devices=1, precision="bf16-mixed", deterministic="warn", logger=False,
        enable_progress_bar=False, enable_model_summary=False, limit_val_batches=0, default_root_dir=root,
        callbacks=[L.pytorch.callbacks.ModelCheckpoint(dirpath=root, every_n_train_steps=1, save_top_k=-1)],
    )
    trainer.fit(module, datamodule=data, ckpt_path=ckpt_path)
    return trainer


def test_resuming_on_a_gpu_from_step_1_gives_the_uninterrupted_step_2_weights(tmp_path):
    make = partial(RLModule, "embedded:tiny-adder", max_new_tokens=16, optimizer=partial(torch.optim.AdamW, lr=1e-3))
    try:
        torch.manual_seed(0)
        uninterrupted = make()
        fit(uninterrupted, 2, tmp_path / "a")
        (step_1,) = (tmp_path / "a").glob("*step=1.ckpt")
        torch.manual_seed(1)  # another global state: the resumed run must not depend on it
        resumed = make()
        fit(resumed, 2, tmp_path / "b", ckpt_path=str(step_1))
    finally:
        torch.use_deterministic_algorithms(False)  # deterministic="warn" set it for the whole process
    expected, got = uninterrupted.state_dict(), resumed.state_dict()
    assert expected.keys() == got.keys()
    assert all(torch.equal(expected[name].cpu(), got[name].cpu()) for name in expected)


@needs_two_gpus
def test_the_fsdp2_recipe_trains_on_every_visible_gpu(tmp_path, lit_cancel_script):
    fsdp2_recipe(tmp_path, lit_cancel_script)


@needs_two_gpus
@needs_vllm
def test_the_fsdp2_recipe_with_vllm_runs_an_engine_on_each_processs_gpu(tmp_path, lit_cancel_script):
    # each process's engine on its own GPU (cuda:LOCAL_RANK), with sleep mode; the validation before training
    # samples each batch twice while the engine stays awake, and the first round after it pushes the weights again
    fsdp2_recipe(tmp_path, lit_cancel_script, "--model.init_args.engine=lit_cancel.VLLMEngine",
                 f"--model.init_args.engine.init_args.kv_cache_memory_bytes={KV_CACHE}")


def fsdp2_recipe(tmp_path, lit_cancel_script, *options: str) -> None:
    """Two steps of the FSDP2 recipe on every visible GPU, with a tiny model, and ``options``."""
    gpus = torch.cuda.device_count()
    model = save_tiny_model(tmp_path / "model", hidden=128)
    # the recipe's plan keeps groups whole: 2 prompts per process, one group per micro-batch (accumulate_grad_batches 2)
    gsm8k_file = tmp_path / "gsm8k.jsonl"
    gsm8k_file.write_text("".join(
        json.dumps({"question": f"Tom has {a} apples and buys 2 more. How many now?", "answer": f"{a}+2={a + 2}.\n#### {a + 2}"}) + "\n"
        for a in range(2 * gpus + 4)
    ))
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), str(ROOT / "tests"), os.environ.get("PYTHONPATH", "")])}
    result = subprocess.run(
        [lit_cancel_script, "fit", "--config", str(CONFIGS / "qwen2.5-1.5b-gsm8k-fsdp.yaml"), f"--trainer.devices={gpus}",
         f"--trainer.strategy.init_args.data_parallel_size={gpus}", "--trainer.max_steps=2", "--trainer.enable_progress_bar=false",
         f"--trainer.logger.init_args.save_dir={tmp_path}", f"--model.init_args.model_path={model}",
         "--model.init_args.max_new_tokens=8", f"--data.init_args.task.init_args.train_file={gsm8k_file}",
         f"--data.init_args.task.init_args.val_file={gsm8k_file}", f"--data.init_args.prompts_per_round={2 * gpus}",
         "--data.init_args.group_size=2", "--data.init_args.task.init_args.reward_fn=conftest.checksum_reward", *options],
        capture_output=True, text=True, timeout=900, env=env, cwd=tmp_path,
    )
    assert result.returncode == 0, result.stderr[-4000:]
    assert list(tmp_path.glob("**/last.ckpt")), "no last.ckpt written"
