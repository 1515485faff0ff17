import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import yaml
from lit_cancel.callbacks.doctor import command as diagnose
from lit_cancel.callbacks.doctor import diagnoses
from lit_cancel.callbacks.doctor.diagnoses import SERIES, SETTINGS, Rule, mean, register
from lit_cancel.callbacks.doctor.history import LIT_CANCEL_SETTINGS, TAGS, TRL_SETTINGS, RunReadError, read_run
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
from torch.utils.tensorboard import SummaryWriter

from lit_cancel.run import commands

CONFIGS = Path(__file__).parents[2] / "configs"

# tags as each framework writes them (read in TRL 1.16's grpo_trainer.py and verl's metric_utils.py, core_algos.py,
# dp_actor.py, ray_trainer.py), and the canonical series each must become; None: must not become any
TRL_TAGS = {
    "train/reward": "rollout/reward_mean",
    "train/reward_std": None,
    "train/frac_reward_zero_std": "rollout/frac_zero_std_groups",
    "train/completions/mean_length": "rollout/completion_len",
    "train/completions/clipped_ratio": "rollout/frac_truncated",
    "train/kl": "loss/kl",
    "train/entropy": "health/entropy",
    "train/clip_ratio/low_mean": "objective/clip_frac_low",
    "train/clip_ratio/high_mean": "objective/clip_frac_high",
    "train/clip_ratio/region_mean": "objective/clip_frac",
    "train/grad_norm": "health/grad_norm",
    "train/learning_rate": "lr",
    "train/sampling/sampling_logp_difference/mean": "rollout/logprob_mismatch",
    "eval/reward": None,
}
VERL_TAGS = {
    "critic/score/mean": "rollout/reward_mean",
    "critic/rewards/mean": None,  # the score less the in-reward KL penalty
    "response_length/mean": "rollout/completion_len",
    "response_length/clip_ratio": "rollout/frac_truncated",
    "actor/entropy": "health/entropy",
    "actor/pg_clipfrac": "objective/clip_frac",
    "actor/pg_clipfrac_lower": None,  # the dual clip's share
    "actor/ppo_kl": "objective/approx_kl",
    "actor/kl_loss": None,  # scaled by the batch split
    "actor/reward_kl_penalty": "loss/kl",
    "actor/grad_norm": "health/grad_norm",
    "actor/lr": "lr",
    "training/rollout_probs_diff_mean": None,  # a difference of probabilities
    "training/global_step": None,
}


def write_run(folder: Path, tags, steps, text: dict | None = None) -> None:
    """Event files with ``value(tag index, step) = index + step / 4`` (exact in float32) for each of ``tags``."""
    writer = SummaryWriter(str(folder))
    for step in steps:
        for index, tag in enumerate(tags):
            writer.add_scalar(tag, index + step / 4, step)
    for tag, value in (text or {}).items():
        writer.add_text(tag, value)
    writer.close()


@pytest.mark.parametrize(("framework", "written", "steps"), [("trl", TRL_TAGS, [2, 4, 6]), ("verl", VERL_TAGS, [1, 2, 3])])
def test_framework_tags_become_canonical_series(tmp_path, framework, written, steps):
    arguments = {"temperature": 0.7, "max_completion_length": 256, "beta": 0.04, "num_generations": 8}
    write_run(tmp_path, written, steps, {"args": json.dumps(arguments)} if framework == "trl" else None)
    history = read_run(tmp_path)
    assert history.framework == framework
    for index, (tag, name) in enumerate(written.items()):
        if name is not None:
            assert history.steps(name) == tuple(steps), tag
            assert history.values(name) == pytest.approx([index + step / 4 for step in steps]), tag
    mapped = {name for name in written.values() if name}
    assert [name for name in SERIES if name in history] == [name for name in SERIES if name in mapped]  # no other
    assert history.values("train/reward_std" if framework == "trl" else "actor/kl_loss")  # kept under its own name
    expected_settings = {"temperature": 0.7, "max_new_tokens": 256, "kl_coef": 0.04} if framework == "trl" else {}
    assert history.settings == pytest.approx(expected_settings)


def test_tables_name_only_canonical_series_and_settings():
    assert all(set(table.values()) <= set(SERIES) for table in TAGS.values())
    assert set(LIT_CANCEL_SETTINGS.values()) | set(TRL_SETTINGS.values()) <= set(SETTINGS)


def test_lit_cancel_run_learning_rate_groups_and_a_resumed_run(tmp_path):
    # the first run logged steps 0-5 and stopped; the resumed one logs from step 3 on in a new file
    write_run(tmp_path, ["rollout/reward_mean", "lr-AdamW/pg1", "lr-AdamW/pg2", "perf/rollout_tokens_per_s"], range(6))
    writer = SummaryWriter(str(tmp_path))
    for step in range(3, 8):
        writer.add_scalar("rollout/reward_mean", 10 + step, step)
    writer.close()
    (tmp_path / "config.yaml").write_text(yaml.safe_dump({"model": {"init_args": {
        "temperature": 0.9, "max_new_tokens": 64, "objective": {"class_path": "lit_cancel.GRPO", "init_args": {"kl_coef": 0.0}},
        "engine": {"class_path": "lit_cancel.VLLMServerEngine", "init_args": {"max_staleness": 2}},
    }}}))
    history = read_run(tmp_path)
    assert history.framework == "lit_cancel"
    assert history.steps("rollout/reward_mean") == tuple(range(8))
    assert history.values("rollout/reward_mean") == (0, 0.25, 0.5, 13, 14, 15, 16, 17)
    assert history.values("lr") == tuple(1 + step / 4 for step in range(6))  # the first group's
    assert history.values("perf/rollout_tokens_per_s")  # its own name
    assert history.settings == {"temperature": 0.9, "max_new_tokens": 64, "kl_coef": 0.0, "max_staleness": 2}


def test_a_run_still_being_written(tmp_path):
    writer = SummaryWriter(str(tmp_path / "live"))
    for step in range(5):
        writer.add_scalar("rollout/reward_mean", step / 8, step)
    writer.flush()
    assert read_run(tmp_path / "live").steps("rollout/reward_mean") == tuple(range(5))
    for step in range(5, 9):
        writer.add_scalar("rollout/reward_mean", step / 8, step)
    writer.flush()
    assert read_run(tmp_path / "live").values("rollout/reward_mean") == tuple(step / 8 for step in range(9))
    # the writer is cut in the middle of its last record
    (events,) = (tmp_path / "live").iterdir()
    (tmp_path / "cut").mkdir()
    (tmp_path / "cut" / events.name).write_bytes(events.read_bytes()[:-5])
    assert read_run(tmp_path / "cut").steps("rollout/reward_mean") == tuple(range(8))
    writer.close()


class LowReward(Rule):
    name = "test_low_reward"
    needs = ("rollout/reward_mean",)
    rank = 50
    min_points = 4

    def check(self, history):
        last = history.values("rollout/reward_mean")[-1]
        if last < 0.5:
            return self.finding("severe", "The reward stays low.", f"last {last:.2f} < 0.5", "Raise it.", 1 - last, history)
        return None


class HighEntropy(Rule):
    name = "test_high_entropy"
    needs = ("health/entropy",)
    rank = 10
    min_points = 4

    def check(self, history):
        if mean(history.values("health/entropy")) > 1:
            return self.finding("warning", "The entropy is high.", "mean > 1", "Lower the temperature.", 0.5, history)
        return None


class NeedsMismatch(Rule):
    name = "test_mismatch"
    needs = ("rollout/logprob_mismatch",)

    def check(self, history):
        return None


@pytest.fixture
def test_rules(monkeypatch):
    """The diagnoses of this file alone."""
    monkeypatch.setattr(diagnoses, "RULES", {})
    for rule in (LowReward, HighEntropy, NeedsMismatch):
        register(rule)


@pytest.fixture
def learning_run(tmp_path):
    """Reward up from 0 to 0.35 over steps 0-7 (0.5 from step 8), entropy 2.0 throughout."""
    writer = SummaryWriter(str(tmp_path / "run"))
    for step in range(10):
        writer.add_scalar("rollout/reward_mean", step * 0.05 if step < 8 else 0.5, step)
        writer.add_scalar("health/entropy", 2.0, step)
    writer.close()
    return tmp_path / "run"


def test_findings_most_likely_cause_first_and_exit_codes(test_rules, learning_run, capsys):
    assert diagnose.main([str(learning_run), "--at-step", "7"]) == 1
    report = " ".join(capsys.readouterr().out.split())
    assert "framework lit_cancel" in report and "steps 0-7 (8 logged)" in report
    # severe before warning, though its rank is higher
    assert report.index("most likely cause: The reward stays low.") < report.index("1. severe The reward stays low.")
    assert report.index("1. severe") < report.index("2. warning The entropy is high.")
    assert "remedy Raise it." in report and "evidence last 0.35 < 0.5" in report
    assert "test_mismatch (no rollout/logprob_mismatch)" in report
    assert diagnose.main([str(learning_run), "--at-step", "7", "--rules", "test_high_entropy", "--json"]) == 1
    summary = json.loads(capsys.readouterr().out)
    assert summary["findings"] == [HighEntropy().check(read_run(learning_run).upto(7)).to_dict()]
    assert summary["framework"] == "lit_cancel" and summary["steps"] == {"first": 0, "last": 7, "logged": 8}
    assert summary["series_found"] == ["rollout/reward_mean", "health/entropy"]
    assert set(summary["series_missing"]) == set(SERIES) - {"rollout/reward_mean", "health/entropy"}
    assert diagnose.main([str(learning_run), "--rules", "test_low_reward", "test_mismatch"]) == 0  # reward 0.5 at step 9
    assert "no finding: the 1 of 2 diagnoses that could run found no cause" in " ".join(capsys.readouterr().out.split())
    assert diagnose.main([str(learning_run), "--rules", "nonexistent"]) == 2
    assert capsys.readouterr().err.startswith("lit-cancel diagnose: --rules: unknown diagnoses ['nonexistent']")


def test_a_run_read_too_early_is_not_called_healthy(test_rules, learning_run, capsys):
    # 3 points at step 2: both rules whose series are logged need 4
    assert diagnose.main([str(learning_run), "--at-step", "2"]) == 3
    report = " ".join(capsys.readouterr().out.split())
    assert "too early to tell: 2 of 3 diagnoses have too few points yet to judge (they need 4; 3 steps logged)" in report
    assert diagnose.main([str(learning_run), "--at-step", "2", "--json"]) == 3
    summary = json.loads(capsys.readouterr().out)
    assert summary["verdict"] == "too_early" and summary["findings"] == [] and summary["rules_run"] == []
    assert summary["rules_waiting"] == {"test_low_reward": 4, "test_high_entropy": 4}
    # one rule judged and found nothing while another still waits: too early still
    writer = SummaryWriter(str(learning_run))
    for step in range(10):
        writer.add_scalar("rollout/logprob_mismatch", 0.0, step)
    writer.close()
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(NeedsMismatch, "min_points", 2)
        assert diagnose.main([str(learning_run), "--at-step", "2", "--rules", "test_mismatch", "test_low_reward"]) == 3
        assert "; the 1 that could run found no cause" in " ".join(capsys.readouterr().out.split())
        assert diagnose.main([str(learning_run), "--rules", "test_mismatch", "test_low_reward"]) == 0


def test_at_step_outside_the_run(test_rules, learning_run, capsys):
    assert diagnose.main([str(learning_run), "--at-step", "-5"]) == 2
    assert capsys.readouterr() == ("", "lit-cancel diagnose: --at-step: a step number >= 0 is expected, got -5\n")
    assert diagnose.main([str(learning_run), "--at-step", "1000"]) == 1
    report = " ".join(capsys.readouterr().out.split())
    assert "note: --at-step 1000 is past the run's last logged step, 9: the whole run is diagnosed" in report
    assert "steps 0-9 (10 logged)" in report
    assert diagnose.main([str(learning_run), "--at-step", "1000", "--json", "--rules", "test_low_reward"]) == 0  # 0.5 at step 9
    assert json.loads(capsys.readouterr().out)["at_step"] == 1000
    late = learning_run.parent / "late"
    write_run(late, ["rollout/reward_mean"], [5, 6])
    assert diagnose.main([str(late), "--at-step", "4"]) == 2
    assert capsys.readouterr().err == "lit-cancel diagnose: --at-step 4: the run's first logged step is 5: nothing to diagnose before it\n"


def test_a_run_without_a_series_any_diagnosis_reads_is_not_called_healthy(test_rules, learning_run, capsys):
    assert diagnose.main([str(learning_run), "--rules", "test_mismatch"]) == 2
    assert capsys.readouterr() == (
        "", f"lit-cancel diagnose: {learning_run}: no diagnosis could run: the run logs none of the series they read "
        "(rollout/logprob_mismatch)\n"
    )


@pytest.mark.parametrize(("as_json", "steps", "status"), [(False, 12, 0), (True, 5, 3)])
def test_the_exit_status_is_the_diagnosis_s_when_the_reader_of_the_output_is_gone(tmp_path, as_json, steps, status):
    """``lit-cancel diagnose RUN | head -1``: the reader closes the pipe after the first line; here before any."""
    writer = SummaryWriter(str(tmp_path))
    for step in range(steps):  # no truncation; 5 points are too few to judge
        writer.add_scalar("rollout/frac_truncated", 0.0, step)
    writer.close()
    reader, writer = os.pipe()
    os.close(reader)  # every write fails, as after head -1 has gone
    command = [sys.executable, "-m", "lit_cancel", "diagnose", str(tmp_path)] + (["--json"] if as_json else [])
    try:
        result = subprocess.run(command, stdout=writer, stderr=subprocess.PIPE, text=True, timeout=600)
    finally:
        os.close(writer)
    assert (result.returncode, result.stderr) == (status, "")


def test_folders_that_cannot_be_read(tmp_path, capsys, monkeypatch):
    (tmp_path / "empty").mkdir()
    write_run(tmp_path / "unknown", ["accuracy", "loss"], [0, 1])
    write_run(tmp_path / "two" / "version_0", ["rollout/reward_mean"], [0])
    write_run(tmp_path / "two" / "version_1", ["rollout/reward_mean"], [0])
    (tmp_path / "only_a_file").mkdir()
    SummaryWriter(str(tmp_path / "only_a_file")).close()  # the version record, no scalar
    (tmp_path / "garbage").mkdir()
    (tmp_path / "garbage" / "events.out.tfevents.1.host").write_bytes(bytes(range(256)))
    expected = {
        "missing": ": no such folder",
        "empty": ": no TensorBoard event files (events.out.tfevents.*) in it or below it",
        "unknown": ": no scalar of lit_cancel, TRL or verl among its tags (accuracy, loss)",
        "two": ": the event files of 2 runs (version_0, version_1): name one of them",
        "only_a_file": ": its event files hold no scalars yet",
        "garbage": "/events.out.tfevents.1.host: cannot be read (not a TensorBoard event file, or its first record is corrupt)",
    }
    for folder, reason in expected.items():
        monkeypatch.setattr(sys, "argv", ["lit-cancel", "diagnose", str(tmp_path / folder)])
        with pytest.raises(SystemExit) as stop:
            commands.main()
        assert stop.value.code == 2
        assert capsys.readouterr().err == f"lit-cancel diagnose: {tmp_path / folder}{reason}\n"
    with pytest.raises(RunReadError):
        read_run(tmp_path / "empty")


def test_quickstart_run_folder(tmp_path, monkeypatch, capsys):
    run = commands.run_cli([
        "fit", "--config", str(CONFIGS / "quickstart.yaml"), "--trainer.max_steps=2", "--trainer.val_check_interval=2",
        "--trainer.enable_progress_bar=false", "--trainer.enable_model_summary=false",
        f"--trainer.logger.init_args.save_dir={tmp_path}", "--data.init_args.prompts_per_round=2",
        "--data.init_args.group_size=2", "--data.init_args.task.init_args.val_size=2", "--model.init_args.val_samples=1",
        "--model.init_args.max_new_tokens=12",
    ])
    log_dir = Path(run.trainer.logger.log_dir)
    history = read_run(tmp_path)  # the run's folder is found below save_dir
    assert history.framework == "lit_cancel"
    # no engine: no max_staleness; the failure budget of agent episodes is every RolloutDataModule's option
    assert history.settings == {"temperature": 1.0, "max_new_tokens": 12, "kl_coef": 0.0, "max_failed_share": 0.25}
    assert history.steps("lr") == (0, 1) and history.values("lr") == pytest.approx([2e-4] * 2)  # from lr-AdamW
    assert history.steps("val/accuracy") == (0, 2)  # before training (its own event file) and after step 2
    events = EventAccumulator(str(log_dir))
    events.Reload()
    for name in ["rollout/reward_mean", "health/entropy", "health/grad_norm", "objective/clip_frac_low", "loss/kl"]:
        assert history.values(name) == tuple(e.value for e in events.Scalars(name)), name
    monkeypatch.setattr(sys, "argv", ["lit-cancel", "diagnose", str(log_dir)])
    with pytest.raises(SystemExit) as stop:
        commands.main()
    assert stop.value.code == 3  # 3 points: too early for every rule
    report = " ".join(capsys.readouterr().out.split())
    assert "framework lit_cancel, 2 event files" in report and "too early to tell:" in report


def test_a_trl_run_with_a_constant_reward_is_not_said_to_be_partly_correct(tmp_path, capsys):
    writer = SummaryWriter(str(tmp_path))
    for step in range(1, 13):
        writer.add_scalar("train/reward", 0.5, step)
        writer.add_scalar("train/frac_reward_zero_std", 1.0, step)
    writer.close()
    assert diagnose.main([str(tmp_path), "--rules", "no_reward_difference", "--json"]) == 1
    summary = json.loads(capsys.readouterr().out)
    assert summary["framework"] == "trl"
    (finding,) = summary["findings"]
    assert finding["cause"].startswith("The mean reward is 0.5 at every step")
    assert "% are correct" not in finding["cause"] and "no rollout/accuracy is logged" in finding["evidence"]
