import argparse
import importlib
import os
import re
import subprocess
import sys
import warnings
from pathlib import Path

import pytest
import torch
from conftest import checksum_reward
from lightning.pytorch import LightningDataModule, LightningModule, Trainer
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
from transformers import AutoModelForCausalLM

from lit_cancel import float32_products
from lit_cancel.run import commands
from lit_cancel.run.checkpointing import COMPLETE_MARKER
from lit_cancel.run.cli import LitCancelCLI
from lit_cancel.run.cli import run_cli as main
from lit_cancel.run.flags import spelled_as_defined, spelled_as_flags

CONFIGS = Path(__file__).parents[2] / "configs"


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
    # 10 steps: the periodic health callbacks of the quickstart measure every 10th step. The KL at shared contexts
    # needs a group whose 4 members all start alike, the flip counts a group with mixed rewards: at temperature 0.7
    # step 0 had both at each of 10 seeds tried; at 1.0 the shared contexts were missing at 7 of 7 (0.2: no mixed group)
    cli = main(quick_args(tmp_path, 10, "--trainer.val_check_interval=10", "--model.init_args.temperature=0.7"))
    logged = scalars(cli.trainer.logger.log_dir)
    for name in [
        "rollout/reward_mean", "rollout/accuracy", "rollout/completion_len", "rollout/frac_zero_std_groups",
        "loss/policy", "loss/kl", "health/entropy", "perf/rollout_tokens_per_s", "val/accuracy", "val/greedy_accuracy",
        # the quickstart's health callbacks
        "health/entropy_mean", "health/learning_tax", "health/shared_kl", "health/drift_logprob_change",
        "health/drift_preference_entropy", "health/flip_boosted_positive", "health/flip_suppressed_negative",
    ]:
        assert name in logged, name
    assert [step for step, _ in logged["val/accuracy"]] == [0, 10]  # before training and after step 10, as the bar shows
    assert len(logged["rollout/reward_mean"]) == 10
    assert 0 < logged["health/entropy"][0][1] < torch.log(torch.tensor(99.0))


def test_resume_from_checkpoint_continues_the_same_run(tmp_path):
    interrupted = main(quick_args(tmp_path / "a", 2))
    checkpoint = Path(interrupted.trainer.logger.log_dir) / "checkpoints" / "last.ckpt"
    start = torch.load(checkpoint, weights_only=False)["state_dict"]
    resumed = main(quick_args(tmp_path / "a", 4, f"--ckpt_path={checkpoint}"))
    straight = main(quick_args(tmp_path / "b", 4))
    assert resumed.trainer.global_step == straight.trainer.global_step == 4
    assert resumed.datamodule.rounds_done == straight.datamodule.rounds_done == 4
    moved = False
    for (name, a), b in zip(resumed.model.state_dict().items(), straight.model.state_dict().values()):
        assert torch.allclose(a, b, atol=1e-6), name  # same rollouts, same updates
        moved |= not torch.equal(a, start[name])
    assert moved


def test_the_addition_task_takes_a_reward_fn_from_a_yaml_config(tmp_path):
    reward = tmp_path / "reward.yaml"
    reward.write_text("data:\n  init_args:\n    task:\n      init_args:\n        reward_fn: conftest.checksum_reward\n")
    parsed = LitCancelCLI(LightningModule, LightningDataModule, subclass_mode_model=True, subclass_mode_data=True, run=False,
                              args=["--config", str(CONFIGS / "quickstart.yaml"), "--config", str(reward)])
    task = parsed.datamodule.task
    record = task.train_records()[0]
    solution = task.solutions(record)[0]
    assert task.reward_fn is checksum_reward and task.reward(record, solution) == checksum_reward(record, solution)
    assert task.correct(record, solution) and not task.correct(record, solution[:-1] + "x")


def test_real_model_path_trains_from_local_folder_and_jsonl(tmp_path, tiny_model_path, gsm8k_file):
    cli = main([
        "fit", "--config", str(CONFIGS / "gsm8k-local.yaml"),
        "--trainer.max_steps=2", "--trainer.accelerator=cpu", "--trainer.enable_progress_bar=false",
        f"--trainer.logger.init_args.save_dir={tmp_path}",
        f"--model.init_args.model_path={tiny_model_path}", "--model.init_args.max_new_tokens=8",
        f"--data.init_args.task.init_args.train_file={gsm8k_file}", "--data.init_args.task.init_args.val_size=2",
        "--data.init_args.prompts_per_round=2", "--data.init_args.group_size=4",
        "--data.init_args.task.init_args.reward_fn=conftest.checksum_reward", "--model.init_args.optimizer.init_args.lr=0.01",
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
    message = startup_error(quick_args(tmp_path, 2, "--model.init_args.learning_rate=0.1"), capsys)
    assert "model.init_args.learning_rate: lit_cancel.RLModule has no option 'learning_rate'" in message


def test_unknown_key_in_config_file_fails_at_start(tmp_path, capsys):
    config = tmp_path / "bad.yaml"
    config.write_text((CONFIGS / "quickstart.yaml").read_text().replace("group_size: 8", "group_size: 8\n    groupsize: 4"))
    message = startup_error(["fit", "--config", str(config)], capsys)
    assert "data.init_args.groupsize: lit_cancel.RolloutDataModule has no option 'groupsize'" in message


def test_missing_model_path_fails_at_start(tmp_path, capsys):
    message = startup_error(quick_args(tmp_path, 2, f"--model.init_args.model_path={tmp_path / 'no-model'}"), capsys)
    assert "no-model' does not exist; expected a local Hugging Face model folder" in message


def test_group_size_below_two_fails_at_start(tmp_path, capsys):
    assert "group_size must be >= 2" in startup_error(quick_args(tmp_path, 2, "--data.init_args.group_size=1"), capsys)


def test_sizes_that_do_not_divide_fail_at_start(tmp_path, capsys):
    message = startup_error(quick_args(tmp_path, 2, "--data.init_args.mini_batches_per_round=3"), capsys)
    assert "the 4 groups of a round (per process) must divide into mini_batches_per_round (3)" in message


def console_error(monkeypatch, capsys, *args: str) -> list[str]:
    """The stderr lines of the ``lit-cancel`` console script refusing ``args`` (exit status 2)."""
    monkeypatch.setattr(sys, "argv", ["lit-cancel", *args])
    monkeypatch.delenv(commands.DEBUG_VARIABLE, raising=False)
    with pytest.raises(SystemExit) as exit:
        commands.main()
    assert exit.value.code == 2
    return capsys.readouterr().err.strip().splitlines()


@pytest.mark.parametrize(
    "args, message",
    [
        (["--model.init_args.model_path=no-model"], "error: model_path='no-model' does not exist; expected a local Hugging Face model folder"),
        (["--model.init_args.model_path={tmp_path}"], "has no config.json; expected a local Hugging Face model folder"),
        (["--model.init_args.objective.class_path=lit_cancel.GRPOO"],
         "error: model.init_args.objective (lit_cancel.GRPOO): module 'lit_cancel' has no attribute 'GRPOO'"),
        (["--model.init_args.objective.init_args.clip=0.1"], "error: model.init_args.objective.init_args.clip: lit_cancel.GRPO has no option 'clip'"),
        (["--trainer.max_steps=two"], "error: trainer.max_steps: Expected a <class 'int'>. Got value: two"),
        (["--optimizer=torch.optim.SGD", "--optimizer.lr=1000"], "the optimizer and its schedule are options of the module: model.init_args.optimizer"),
    ],
)
def test_startup_mistake_ends_with_its_own_message(tmp_path, monkeypatch, capsys, args, message):
    lines = console_error(monkeypatch, capsys, *quick_args(tmp_path, 2, *(a.format(tmp_path=tmp_path) for a in args)))
    assert message in lines[-1]
    assert lines[-2] == "lit-cancel: nothing was run (LIT_CANCEL_DEBUG=1 shows the traceback)"
    assert not any("Traceback" in line or "jsonargparse" in line for line in lines)


def test_debug_variable_shows_the_traceback(tmp_path, monkeypatch):
    monkeypatch.setattr(sys, "argv", ["lit-cancel", *quick_args(tmp_path, 2, "--model.init_args.model_path=no-model")])
    monkeypatch.setenv(commands.DEBUG_VARIABLE, "1")
    with pytest.raises(commands.ConfigError) as refusal:
        commands.main()
    assert isinstance(refusal.value.__cause__.__cause__, FileNotFoundError)


def test_top_level_optimizer_in_a_config_file_is_refused(tmp_path, monkeypatch, capsys):
    config = tmp_path / "optimizer.yaml"
    config.write_text("optimizer:\n  class_path: torch.optim.SGD\n  init_args:\n    lr: 1000\n")
    lines = console_error(monkeypatch, capsys, *quick_args(tmp_path, 2, f"--config={config}"))
    assert "'optimizer.init_args.lr'; the optimizer and its schedule are options of the module" in lines[-1]


def test_test_subcommand_is_not_offered(monkeypatch, capsys):
    lines = console_error(monkeypatch, capsys, "test", "--config", str(CONFIGS / "quickstart.yaml"))
    assert lines[-1] == ("error: unknown command 'test': the commands are fit, validate, export, audit-objective, serve and diagnose "
                         "(lit-cancel COMMAND --help lists its options)")


def test_no_command_names_every_command(monkeypatch, capsys):
    assert console_error(monkeypatch, capsys) == [
        "lit-cancel: nothing was run (LIT_CANCEL_DEBUG=1 shows the traceback)",
        "error: lit-cancel needs a command: fit, validate, export, audit-objective, serve or diagnose (lit-cancel COMMAND --help lists its options)",
    ]


@pytest.mark.parametrize(
    "text, problem",
    [
        ("", "is empty: a config is a YAML mapping of options, like configs/quickstart.yaml"),
        ("# only a comment\n", "is empty: a config is a YAML mapping of options, like configs/quickstart.yaml"),
        ("- a\n- b\n", "holds a YAML list, not a mapping of options (option: value lines, like configs/quickstart.yaml)"),
        ("fit\n", "holds a YAML str, not a mapping of options (option: value lines, like configs/quickstart.yaml)"),
    ],
)
def test_a_config_file_that_is_not_a_mapping_is_named(tmp_path, monkeypatch, capsys, text, problem):
    config = tmp_path / "config.yaml"
    config.write_text(text)
    assert console_error(monkeypatch, capsys, "fit", "--config", str(config))[-1] == f"error: {config} {problem}"


@pytest.mark.parametrize(
    "argv, spelled",
    [
        (["--overwrite"], ["--overwrite"]),
        (["--overwrite", "true", "--x", "1"], ["--overwrite", "--x", "1"]),
        (["--overwrite=True"], ["--overwrite"]),
        (["--overwrite", "false", "run"], ["run"]),
        (["--overwrite=no"], []),
        (["--overwrite", "runs/a"], ["--overwrite", "runs/a"]),
        (["--json", "yes"], ["--json", "yes"]),
    ],
)
def test_on_off_options_take_fits_spelling(argv, spelled):
    assert spelled_as_flags(argv, {"--overwrite"}) == spelled


@pytest.mark.parametrize(
    "module, argv, spelled",
    [
        ("lit_cancel.callbacks.doctor.command", ["runs/a_b", "--at_step", "5", "--json", "true"], ["runs/a_b", "--at-step", "5", "--json"]),
        ("lit_cancel.callbacks.doctor.command", ["--json", "runs/x", "--at_step=7"], ["--json", "runs/x", "--at-step=7"]),
        ("lit_cancel.run.export", ["--output-dir", "out", "--ckpt-path=x.ckpt", "--overwrite", "false"], ["--output_dir", "out", "--ckpt_path=x.ckpt"]),
        ("lit_cancel.objectives.audit", ["GRPO", "--trust_region", "TokenRatioMask"], ["GRPO", "--trust-region", "TokenRatioMask"]),
    ],
)
def test_every_command_takes_either_spelling_of_its_options(module, argv, spelled):
    assert spelled_as_defined(argv, importlib.import_module(module).parser()) == spelled


def test_an_on_off_option_with_another_value_is_named():
    with pytest.raises(argparse.ArgumentTypeError, match="--overwrite: expected true or false, got 'maybe'"):
        spelled_as_flags(["--overwrite=maybe"], {"--overwrite"})


def test_data_sizes_are_checked_before_the_first_validation(tmp_path, monkeypatch, capsys):
    validations = []
    monkeypatch.setattr(Trainer, "validate", lambda *args, **kwargs: validations.append(args))
    lines = console_error(monkeypatch, capsys, *quick_args(tmp_path, 2, "--data.init_args.task.init_args.train_size=3"))
    assert lines[-1] == "error: the task has 3 training prompts, fewer than prompts_per_round=4"
    assert validations == []


@pytest.mark.parametrize(
    "third_row, problem",
    [
        (lambda row: row[:-1], "line 3 is not valid JSON (Expecting ',' delimiter at column 100); expected one JSON object per line"),
        (lambda row: "[1, 2]", "line 3 is a JSON array, not an object; expected JSON objects with the fields 'question' and 'answer'"),
    ],
    ids=["closing-brace-missing", "array"],
)
def test_a_bad_row_of_a_jsonl_file_is_named_once_by_its_line(tmp_path, lit_cancel_script, tiny_model_path, gsm8k_file, third_row, problem):
    rows = Path(gsm8k_file).read_text().splitlines()
    rows[2] = third_row(rows[2])
    broken = tmp_path / "broken.jsonl"
    broken.write_text("\n".join(rows) + "\n")
    environment = {k: v for k, v in os.environ.items() if k != commands.DEBUG_VARIABLE}
    result = subprocess.run(
        [lit_cancel_script, "fit", "--config", str(CONFIGS / "gsm8k-local.yaml"), f"--model.init_args.model_path={tiny_model_path}",
         f"--data.init_args.task.init_args.train_file={broken}"], capture_output=True, text=True, env=environment, cwd=tmp_path,
    )
    assert result.returncode == 2, result.stderr[-2000:]
    # datasets' own message, which counts rows from 0, is not printed besides the project's
    assert [line for line in result.stderr.splitlines() if "broken.jsonl" in line] == [f"error: MathWordTask: data file '{broken}' {problem}"]


def test_help_lists_every_command(lit_cancel_script):
    help_text = subprocess.run([lit_cancel_script, "--help"], capture_output=True, text=True, check=True).stdout
    assert " ".join(help_text.split()).startswith("usage: lit-cancel [-h] {fit,validate,export,audit-objective,serve,diagnose} ...")
    listed = re.findall(r"^    (\S+)", help_text.partition("\ncommands:\n")[2], flags=re.MULTILINE)  # each command, with what it does
    assert listed == ["fit", "validate", "export", "audit-objective", "serve", "diagnose"]
    assert "predict" not in help_text


def test_console_script_prints_only_a_short_error(tmp_path):
    environment = {k: v for k, v in os.environ.items() if k != commands.DEBUG_VARIABLE}
    result = subprocess.run(
        ["lit-cancel", *quick_args(tmp_path, 2, "--model.init_args.learning_rate=0.1")], capture_output=True, text=True, env=environment,
    )
    assert result.returncode == 2
    lines = result.stderr.strip().splitlines()
    assert len(lines) <= 3, result.stderr
    assert lines[-1].startswith("error: model.init_args.learning_rate: lit_cancel.RLModule has no option 'learning_rate'")


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    """``last.ckpt`` of a one-step whole-model run and of a one-step LoRA run."""
    folder = tmp_path_factory.mktemp("runs")
    written = {}
    for config in ["quickstart", "lora"]:
        args = quick_args(folder, 1, "--trainer.val_check_interval=1")
        args[2] = str(CONFIGS / f"{config}.yaml")
        run = main(args)
        written[config] = Path(run.trainer.logger.log_dir) / "checkpoints" / "last.ckpt"
    return written


def test_checkpoint_of_the_other_kind_is_named(tmp_path, monkeypatch, capsys, checkpoints):
    lora, whole = checkpoints["lora"], checkpoints["quickstart"]
    fit_whole = quick_args(tmp_path, 2, f"--ckpt_path={lora}")
    assert console_error(monkeypatch, capsys, *fit_whole)[-1] == (
        f"error: --ckpt_path {lora} is a LoRA checkpoint (adapters only), but the config trains the whole model: "
        "use a config with model.init_args.lora as the run had it (like configs/lora.yaml)"
    )
    fit_lora = quick_args(tmp_path, 2, f"--ckpt_path={whole}")
    fit_lora[2] = str(CONFIGS / "lora.yaml")
    assert console_error(monkeypatch, capsys, *fit_lora)[-1].startswith(
        f"error: --ckpt_path {whole} is a whole-model checkpoint, but the config trains LoRA adapters"
    )
    export = ["export", "--config", str(CONFIGS / "quickstart.yaml"), f"--ckpt_path={lora}", f"--output_dir={tmp_path / 'out'}"]
    assert "is a LoRA checkpoint (adapters only)" in console_error(monkeypatch, capsys, *export)[-1]
    assert not (tmp_path / "out").exists()


def test_sharded_checkpoint_folder_is_read_for_its_kind(tmp_path, monkeypatch, capsys, checkpoints):
    from torch.distributed.checkpoint.format_utils import torch_save_to_dcp

    torch_save_to_dcp(checkpoints["lora"], tmp_path / "sharded.ckpt")
    (tmp_path / "sharded.ckpt" / COMPLETE_MARKER).touch()  # as RunCheckpoint marks a folder once every process wrote
    validate = ["validate", "--config", str(CONFIGS / "quickstart.yaml"), f"--ckpt_path={tmp_path / 'sharded.ckpt'}"]
    assert "sharded.ckpt is a LoRA checkpoint (adapters only)" in console_error(monkeypatch, capsys, *validate)[-1]


@pytest.mark.parametrize(
    "content, reason",
    [(b"", "empty file"), (bytes(range(256)) * 8, "not a file written by torch.save"), (None, "no state_dict: not written by a Lightning Trainer")],
)
def test_file_that_is_not_a_checkpoint_is_named(tmp_path, monkeypatch, capsys, content, reason):
    path = tmp_path / "broken.ckpt"
    if content is None:
        torch.save({"weights": torch.zeros(2)}, path)
    else:
        path.write_bytes(content)
    expected = f"error: not a lit_cancel checkpoint: {path} ({reason})"
    assert console_error(monkeypatch, capsys, *quick_args(tmp_path, 2, f"--ckpt_path={path}"))[-1] == expected
    export = ["export", "--config", str(CONFIGS / "quickstart.yaml"), f"--ckpt_path={path}", f"--output_dir={tmp_path / 'out'}"]
    assert console_error(monkeypatch, capsys, *export)[-1] == expected


def test_export_refuses_a_file_or_a_folder_with_files_unless_overwrite(tmp_path, monkeypatch, capsys, checkpoints):
    export = ["export", "--config", str(CONFIGS / "quickstart.yaml"), f"--ckpt_path={checkpoints['quickstart']}"]
    a_file = tmp_path / "model.bin"
    a_file.write_text("kept")
    assert console_error(monkeypatch, capsys, *export, f"--output_dir={a_file}") == [
        "lit-cancel: nothing was run (LIT_CANCEL_DEBUG=1 shows the traceback)",
        f"error: --output_dir {a_file} is a file, not a folder: name a new or empty folder",
    ]
    assert a_file.read_text() == "kept"
    used = tmp_path / "used"
    used.mkdir()
    (used / "notes.txt").write_text("kept")
    assert console_error(monkeypatch, capsys, *export, f"--output_dir={used}")[-1] == (
        f"error: --output_dir {used} is not empty: name a new or empty folder, or add --overwrite to write over its files"
    )
    assert sorted(p.name for p in used.iterdir()) == ["notes.txt"]
    assert console_error(monkeypatch, capsys, *export, f"--output_dir={used}", "--overwrite=false")[-1].endswith("or add --overwrite to write over its files")
    monkeypatch.setattr(sys, "argv", ["lit-cancel", *export, f"--output_dir={used}", "--overwrite", "true"])  # fit's spelling
    with pytest.raises(SystemExit) as exit:
        commands.main()
    assert exit.value.code == 0
    assert (used / "config.json").is_file() and (used / "notes.txt").read_text() == "kept"
    assert AutoModelForCausalLM.from_pretrained(used).num_parameters() > 0


@pytest.mark.parametrize("command", ["fit", "validate"])
def test_compile_under_a_sharding_strategy_is_refused_before_any_process_starts(tmp_path, monkeypatch, capsys, command):
    args = quick_args(tmp_path, 2, "--model.init_args.compile=true")
    args[0], args[2] = command, str(CONFIGS / "quickstart-fsdp2-cpu.yaml")
    if command == "validate":
        args = [a for a in args if not a.startswith("--trainer.max_steps")]
    assert console_error(monkeypatch, capsys, *args)[-1] == (
        "error: model.init_args.compile: true does not work with trainer.strategy ModelParallelStrategy, which shards the model "
        "(a sharded decoder is not compiled): set model.init_args.compile: false, or compile without sharding (strategy auto or ddp)"
    )


@pytest.mark.parametrize("strategy", ["--trainer.strategy=fsdp", "--trainer.strategy=fsdp_cpu_offload",
                                      "--trainer.strategy.class_path=lightning.pytorch.strategies.FSDPStrategy"])
def test_lightnings_fsdp_v1_strategy_is_refused_before_the_trainer_is_built(tmp_path, monkeypatch, capsys, strategy):
    # on a CPU, Lightning's Trainer would refuse it first, saying that FSDP needs a GPU
    assert console_error(monkeypatch, capsys, *quick_args(tmp_path, 2, strategy))[-1] == (
        "error: trainer.strategy FSDPStrategy is Lightning's FSDP (v1), which lit_cancel does not support: shard with FSDP2, "
        "class_path: lightning.pytorch.strategies.ModelParallelStrategy with init_args data_parallel_size: the number of processes "
        "and tensor_parallel_size: 1 (as configs/qwen2.5-1.5b-gsm8k-fsdp.yaml does)"
    )
    assert list(tmp_path.iterdir()) == []  # no run folder was made


@pytest.mark.parametrize("native, warned", [(False, True), (True, False)])
def test_bf16_on_a_cpu_without_bf16_instructions_says_it_is_slower_and_what_to_use(tmp_path, monkeypatch, native, warned):
    monkeypatch.setattr(float32_products, "cpu_has_native_bf16", lambda: native)
    args = ["validate", "--config", str(CONFIGS / "quickstart.yaml"), "--trainer.precision=bf16-mixed", "--trainer.enable_progress_bar=false",
            f"--trainer.logger.init_args.save_dir={tmp_path}", "--data.init_args.task.init_args.val_size=2", "--model.init_args.val_samples=1"]
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        main(args)
    slow = [str(w.message) for w in caught if "bfloat16 instructions" in str(w.message)]
    assert slow == ([
        "trainer.precision bf16-mixed on a CPU without bfloat16 instructions (no AVX-512 BF16 or AMX): its matrix products are "
        "computed in float32, but attention is emulated and every cast costs time, so the run will be slower than in float32; "
        "use trainer.precision 32-true"
    ] if warned else [])


@pytest.mark.slow
def test_a_run_and_its_resume_print_nothing_the_user_cannot_act_on(tmp_path, lit_cancel_script):
    environment = {k: v for k, v in os.environ.items() if k != commands.DEBUG_VARIABLE}
    last = tmp_path / "quickstart" / "version_0" / "checkpoints" / "last.ckpt"
    for resume in ([], ["--trainer.max_steps=3", f"--ckpt_path={last}"]):
        args = quick_args(tmp_path, 2, *resume)
        result = subprocess.run([lit_cancel_script, *args], capture_output=True, text=True, env=environment)
        assert result.returncode == 0, result.stderr
        output = result.stdout + result.stderr
        for noise in ["LeafSpec", "past_key_values", "Tip:", "Warning", "warning", "deprecated", "exists and is not empty"]:
            assert noise not in output, output
    assert torch.load(last, weights_only=False)["global_step"] == 3


def test_warnings_are_printed_on_one_line(tmp_path):
    environment = {k: v for k, v in os.environ.items() if k != commands.DEBUG_VARIABLE}
    script = ("import sys, warnings; from lit_cancel.run import commands; sys.argv = ['lit-cancel', 'fit']; "
              "commands.run_cli = lambda: [warnings.warn('round 3: every reward is equal'), warnings.warn('old', FutureWarning)]; commands.main()")
    result = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, env=environment, cwd=tmp_path)
    assert (result.returncode, result.stderr) == (0, "warning: round 3: every reward is equal\nwarning (FutureWarning): old\n")


def test_validate_prints_the_held_out_metrics_whatever_the_round_sizes_of_the_checkpoint(tmp_path, capsys, checkpoints):
    # the checkpoint's run had rounds of 4 prompts x 4, the config's are 16 x 8: a resume would refuse, validate samples no rounds
    run = main(["validate", "--config", str(CONFIGS / "quickstart.yaml"), f"--ckpt_path={checkpoints['quickstart']}",
                "--trainer.enable_progress_bar=false", f"--trainer.logger.init_args.save_dir={tmp_path}",
                "--data.init_args.task.init_args.val_size=4", "--model.init_args.val_samples=2"])
    printed = dict(line.split() for line in capsys.readouterr().out.strip().splitlines()[-2:])
    assert set(printed) == {"val/accuracy", "val/greedy_accuracy"}
    for name, value in printed.items():
        assert float(value) == pytest.approx(float(run.trainer.callback_metrics[name]), abs=5e-5)
