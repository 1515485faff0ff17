from pathlib import Path

import pytest
import torch
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
from transformers import AutoModelForCausalLM

from lit_cancel.cli import run_cli as main

CONFIGS = Path(__file__).parents[1] / "configs"


def quick_args(tmp_path, max_steps: int, *extra: str) -> list[str]:
    """The quickstart config shrunk to a few steps and a small held-out set."""
    return [
        "fit", "--config", str(CONFIGS / "quickstart.yaml"),
        f"--trainer.max_steps={max_steps}", "--trainer.val_check_interval=2", "--trainer.enable_progress_bar=false",
        f"--trainer.logger.init_args.save_dir={tmp_path}",
        "--data.init_args.prompts_per_round=4", "--data.init_args.group_size=4",
        "--data.init_args.task.init_args.val_size=8", "--model.init_args.val_samples=2",
        *extra,
    ]


def scalars(log_dir) -> dict[str, list[tuple[int, float]]]:
    events = EventAccumulator(str(log_dir))
    events.Reload()
    return {tag: [(e.step, e.value) for e in events.Scalars(tag)] for tag in events.Tags()["scalars"]}


def test_fit_logs_the_documented_scalars(tmp_path):
    # 10 steps: the periodic health callbacks of the quickstart measure every 10th step
    cli = main(quick_args(tmp_path, 10, "--trainer.val_check_interval=10"))
    logged = scalars(cli.trainer.logger.log_dir)
    for name in [
        "rollout/reward_mean", "rollout/accuracy", "rollout/completion_len", "rollout/frac_zero_std_groups",
        "loss/policy", "loss/kl", "health/entropy", "perf/rollout_tokens_per_s", "val/accuracy", "val/greedy_accuracy",
        # the quickstart's health callbacks
        "health/entropy_mean", "health/learning_tax", "health/shared_kl", "health/drift_logprob_change",
        "health/drift_preference_entropy", "health/flip_boosted_positive", "health/flip_suppressed_negative",
    ]:
        assert name in logged, name
    assert [step for step, _ in logged["val/accuracy"]] == [0, 9]  # before training and after step 10
    assert len(logged["rollout/reward_mean"]) == 10
    assert 0 < logged["health/entropy"][0][1] < torch.log(torch.tensor(99.0))


def test_resume_from_checkpoint_continues_the_same_run(tmp_path):
    interrupted = main(quick_args(tmp_path / "a", 2))
    checkpoint = Path(interrupted.trainer.logger.log_dir) / "checkpoints" / "last.ckpt"
    assert checkpoint.is_file()
    resumed = main(quick_args(tmp_path / "a", 4, f"--ckpt_path={checkpoint}"))
    straight = main(quick_args(tmp_path / "b", 4))
    assert resumed.trainer.global_step == straight.trainer.global_step == 4
    assert resumed.datamodule.rounds_done == straight.datamodule.rounds_done == 4
    start = torch.load(checkpoint, weights_only=False)["state_dict"]
    moved = False
    for (name, a), b in zip(resumed.model.state_dict().items(), straight.model.state_dict().values()):
        assert torch.allclose(a, b, atol=1e-6), name  # same rollouts, same updates
        moved |= not torch.equal(a, start[name])
    assert moved


def checksum_reward(record: dict, completion: str) -> float:
    """A reward that differs between random completions, so an untrained model gets non-zero advantages."""
    return float(sum(map(ord, completion)) % 7)


def test_real_model_path_trains_from_local_folder_and_jsonl(tmp_path, tiny_model_path, gsm8k_file):
    cli = main([
        "fit", "--config", str(CONFIGS / "gsm8k-local.yaml"),
        "--trainer.max_steps=2", "--trainer.accelerator=cpu", "--trainer.enable_progress_bar=false",
        f"--trainer.logger.init_args.save_dir={tmp_path}",
        f"--model.init_args.model_path={tiny_model_path}", "--model.init_args.max_new_tokens=8",
        f"--data.init_args.task.init_args.train_file={gsm8k_file}", "--data.init_args.task.init_args.val_size=2",
        "--data.init_args.prompts_per_round=2", "--data.init_args.group_size=4",
        "--data.init_args.task.init_args.reward_fn=test_cli.checksum_reward", "--model.init_args.optimizer.init_args.lr=0.01",
    ])
    assert cli.trainer.global_step == 2
    assert cli.datamodule.tokenizer is cli.model.tokenizer  # one tokenizer, the policy's
    initial = AutoModelForCausalLM.from_pretrained(tiny_model_path)
    assert any(not torch.equal(p, q) for p, q in zip(cli.model.policy.parameters(), initial.parameters()))
    logged = scalars(cli.trainer.logger.log_dir)
    assert len(logged["rollout/reward_mean"]) == 2 and "val/accuracy" in logged


def startup_error(args: list[str], capsys) -> str:
    """What the command says when it refuses ``args`` before training: the exception and stderr."""
    with pytest.raises((SystemExit, Exception)) as refusal:
        main(args)
    return f"{refusal.value}\n{capsys.readouterr().err}"


def test_unknown_config_key_fails_at_start(tmp_path, capsys):
    assert "learning_rate" in startup_error(quick_args(tmp_path, 2, "--model.init_args.learning_rate=0.1"), capsys)


def test_unknown_key_in_config_file_fails_at_start(tmp_path, capsys):
    config = tmp_path / "bad.yaml"
    config.write_text((CONFIGS / "quickstart.yaml").read_text().replace("group_size: 8", "group_size: 8\n    groupsize: 4"))
    assert "groupsize" in startup_error(["fit", "--config", str(config)], capsys)


def test_missing_model_path_fails_at_start(tmp_path, capsys):
    message = startup_error(quick_args(tmp_path, 2, f"--model.init_args.model_path={tmp_path / 'no-model'}"), capsys)
    assert "no-model' does not exist; expected a local Hugging Face model folder" in message


def test_group_size_below_two_fails_at_start(tmp_path, capsys):
    assert "group_size must be >= 2" in startup_error(quick_args(tmp_path, 2, "--data.init_args.group_size=1"), capsys)


def test_sizes_that_do_not_divide_fail_at_start(tmp_path, capsys):
    message = startup_error(quick_args(tmp_path, 2, "--data.init_args.mini_batches_per_round=3"), capsys)
    assert "the 4 groups of a round (per process) must divide into mini_batches_per_round (3)" in message
