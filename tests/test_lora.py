from functools import partial
from pathlib import Path

import lightning as L
import pytest
import torch
from transformers import AutoModelForCausalLM

from lit_cancel import GRPO, AdditionTask, LoRA, RLModule, RolloutDataModule
from lit_cancel.logprobs import completion_logprobs

CONFIGS = Path(__file__).parents[1] / "configs"


def lora_module(kl_coef: float = 0.1) -> RLModule:
    return RLModule("embedded:tiny-adder", objective=GRPO(kl_coef=kl_coef), max_new_tokens=40, lora=LoRA(rank=4),
                    optimizer=partial(torch.optim.AdamW, lr=1e-2))


def train(module: RLModule, steps: int, tmp_path) -> L.Trainer:
    data = RolloutDataModule(AdditionTask(num_digits=3, train_size=64, val_size=4), prompts_per_round=8, group_size=4)
    trainer = L.Trainer(max_steps=steps, accelerator="cpu", devices=1, logger=False, enable_checkpointing=False,
                        enable_progress_bar=False, enable_model_summary=False, limit_val_batches=0, default_root_dir=tmp_path)
    trainer.fit(module, datamodule=data)
    return trainer


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    module = lora_module()
    before = {name: p.detach().clone() for name, p in module.policy.named_parameters()}
    trainer = train(module, 3, tmp_path_factory.mktemp("lora"))
    return module, before, trainer


def test_only_adapter_parameters_change(trained):
    module, before, _ = trained
    assert module.reference is None  # the reference is the policy with its adapters disabled
    changed = {name for name, p in module.policy.named_parameters() if not torch.equal(p, before[name])}
    assert changed and all("lora_" in name for name in changed)
    assert all(p.requires_grad == ("lora_" in name) for name, p in module.policy.named_parameters())


def test_reference_logprobs_are_the_base_models(trained):
    module, _, _ = trained
    base = AutoModelForCausalLM.from_pretrained(module.policy.model.peft_config["default"].base_model_name_or_path)
    ids = torch.tensor([[5, 6, 7, 8, 9, 10, 11, 12], [13, 5, 6, 7, 8, 9, 10, 11]])
    mask = torch.ones_like(ids)
    reference = module.reference_logprobs(ids, mask, 4)
    expected, _ = completion_logprobs(base, ids, mask, 4)
    assert torch.allclose(reference, expected, atol=1e-5)
    assert not torch.allclose(module.token_logprobs(ids, mask, 4), expected, atol=1e-3)  # the adapters moved the policy


def test_checkpoint_holds_only_the_adapters_and_export_reloads(trained, tmp_path):
    module, _, trainer = trained
    trainer.save_checkpoint(tmp_path / "lora.ckpt")
    state = torch.load(tmp_path / "lora.ckpt", weights_only=False)["state_dict"]
    assert state and all("lora_" in key for key in state)
    restored = lora_module()
    restored.load_state_dict(state, strict=False)
    ids = torch.tensor([[5, 6, 7, 8, 9, 10, 11, 12]])
    mask = torch.ones_like(ids)
    trained_logprobs = module.token_logprobs(ids, mask, 4)
    assert torch.allclose(restored.token_logprobs(ids, mask, 4), trained_logprobs, atol=1e-6)
    restored.export(str(tmp_path / "merged"))
    merged = AutoModelForCausalLM.from_pretrained(tmp_path / "merged")
    assert not any("lora" in name for name, _ in merged.named_parameters())
    assert torch.allclose(completion_logprobs(merged, ids, mask, 4)[0], trained_logprobs, atol=1e-4)


def test_export_command_merges_a_lora_run(tmp_path, lit_cancel_script):
    import subprocess

    run = [lit_cancel_script, "fit", "--config", str(CONFIGS / "lora.yaml"), "--trainer.max_steps=2",
           "--trainer.val_check_interval=2", f"--trainer.logger.init_args.save_dir={tmp_path}",
           "--data.init_args.task.init_args.val_size=4", "--model.init_args.val_samples=1", "--trainer.enable_progress_bar=false"]
    subprocess.run(run, check=True, capture_output=True, timeout=300)
    (checkpoint,) = tmp_path.glob("lora/version_0/checkpoints/last.ckpt")
    result = subprocess.run([lit_cancel_script, "export", "--config", str(CONFIGS / "lora.yaml"), "--ckpt_path", str(checkpoint),
                             "--output_dir", str(tmp_path / "hf")], capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr[-2000:]
    model = AutoModelForCausalLM.from_pretrained(tmp_path / "hf")
    assert model.config.model_type == "qwen2" and not any("lora" in n for n, _ in model.named_parameters())


def test_lora_options_are_checked():
    with pytest.raises(ValueError, match="need rank >= 1"):
        LoRA(rank=0)
    with pytest.raises(ValueError, match="do not match the model's layers"):
        RLModule("embedded:tiny-adder", lora=LoRA(target_modules=["no_such_proj"]))
