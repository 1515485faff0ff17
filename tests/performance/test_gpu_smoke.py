"""benchmarks/performance/gpu_smoke.py on a CPU: its dry run names every check, each check runs alone and is reported, and the\nword problems it writes are a GSM8K file."""

import inspect
import os
import subprocess
import sys
import time
from pathlib import Path

PERFORMANCE = Path(__file__).resolve().parents[2] / "benchmarks" / "performance"


def test_the_dry_run_names_each_check_with_its_time_limit_and_the_qwen_run_on_the_model_given(tmp_path):
    result = subprocess.run([sys.executable, str(PERFORMANCE / "gpu_smoke.py"), "--dry-run", "--model-path", "/models/m",
                             "--work-dir", str(tmp_path), "--run-timeout", "123", "--", "--trainer.precision=32-true"],
                            capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stderr
    lines = result.stdout.splitlines()
    assert lines[0].startswith("each test of pytest -m gpu tests/test_gpu.py, in its own process")
    shipped, qwen = lines[1:]
    assert shipped.startswith("shipped (at most 123 s): ") and "--config configs/quickstart.yaml --trainer.max_steps=10" in shipped
    assert qwen.startswith("qwen (at most 123 s): ") and "--model.init_args.model_path=/models/m" in qwen
    assert qwen.endswith("--trainer.precision=32-true")  # options after -- go to the qwen run, last, so they win


def test_every_gpu_test_is_its_own_check_run_alone():
    from gpu_smoke import gpu_tests

    checks = gpu_tests(timeout=60, work=Path("/tmp"))
    names = [c.name for c in checks]
    assert "test_sleep_mode_gives_the_kv_cache_back_between_rollouts_and_keeps_it_released_during_a_push" in names
    assert len(names) == len(set(names)) >= 8
    for check in checks:
        node = check.command[-1]
        assert node == f"tests/test_gpu.py::{check.name}" and check.timeout == 60  # one test per pytest process


def test_a_failed_a_skipped_and_a_hung_check_are_each_reported_and_the_next_check_still_runs(tmp_path):
    from gpu_smoke import Check, run_check

    (tmp_path / "test_cases.py").write_text(
        "import pytest\n"
        "def test_fails():\n    assert 1 == 2, 'one is not two'\n"
        "def test_skips():\n    pytest.skip('needs vLLM')\n"
        "def test_passes():\n    pass\n"
    )
    checks = []
    for name in ("test_fails", "test_skips", "test_passes"):
        junit = tmp_path / f"{name}.xml"
        command = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", f"--junitxml={junit}", f"{tmp_path}/test_cases.py::{name}"]
        checks.append(Check(name, command, 120, junit=junit))
    checks.insert(1, Check("hangs", [sys.executable, "-c", "import time; time.sleep(60)"], 1))
    with open(tmp_path / "log", "w") as log:
        for check in checks:
            run_check(check, {**os.environ}, log)
    outcomes = {c.name: c.outcome for c in checks}
    assert outcomes["test_fails"].startswith("failed: AssertionError: one is not two")
    assert outcomes["hangs"] == "timed out after 1 s" and 1 <= checks[1].seconds < 60  # killed at its limit, not waited for
    assert outcomes["test_skips"].startswith("skipped: needs vLLM")
    assert outcomes["test_passes"] == "passed"


def test_the_synthetic_word_problems_load_as_a_math_word_task_with_their_answers_rewarded(tmp_path):
    from gpu_smoke import synthetic_word_problems

    from lit_cancel import MathWordTask

    path = tmp_path / "train.jsonl"
    synthetic_word_problems(path, rows=20, seed=0)
    task = MathWordTask(train_file=str(path), val_file=str(path))
    records = task.train_records()
    assert len(records) == 20
    assert all(task.reward(r, f"so the answer is {r['answer']}") == 1.0 for r in records)


def test_every_gpu_test_with_a_sleep_mode_engine_runs_in_a_process_of_its_own():
    """vLLM allows one sleep-mode memory pool per process: a second sleep-mode engine in one pytest process fails."""
    import test_gpu

    tests = [value for name, value in vars(test_gpu).items() if name.startswith("test_") and callable(value)]
    sleeping = [test for test in tests if "sleep=True" in inspect.getsource(test)]
    assert len(sleeping) >= 4
    for test in sleeping:
        in_source = 'subprocess.run([sys.executable, "-c", script]' in inspect.getsource(test)  # runs its own script
        assert getattr(test, "runs_in_own_process", False) or in_source, test.__name__


def time_limit_counted_from(started: Path):
    """``subprocess.run`` whose time limit counts from when the process creates ``started``, not from its start, so that a
    process's imports (seconds of them on a busy machine) cannot use up its limit before it does what a test waits for."""

    def run(command, *, timeout, **options):
        with subprocess.Popen(command, **options) as process:
            while not started.exists() and process.poll() is None:
                time.sleep(0.05)
            try:
                return subprocess.CompletedProcess(command, process.wait(timeout=timeout))
            except subprocess.TimeoutExpired:
                process.kill()  # as subprocess.run does; leaving the with block waits for the process to end
                raise

    return run


def test_a_run_stopped_at_its_time_limit_still_reports_the_steps_it_made(tmp_path, monkeypatch):
    """SmokeStats writes its file at each optimizer step, not only at the end of fit, and a timed-out run's rows are read."""
    from types import SimpleNamespace

    import gpu_smoke
    import torch
    from gpu_smoke import STATS_DIR, Check, SmokeStats, run_check

    work, made_two_steps = tmp_path / "run", tmp_path / "made two steps"
    work.mkdir()
    # a run that makes two optimizer steps of two micro-batches each, says so, and then hangs until its time limit
    script = (
        "import os, sys, time, torch\n"
        f"sys.path.insert(0, {str(PERFORMANCE)!r})\n"
        "from types import SimpleNamespace\n"
        "from gpu_smoke import SmokeStats\n"
        "stats, trainer = SmokeStats(), SimpleNamespace(accumulate_grad_batches=2, global_rank=0)\n"
        "batch = SimpleNamespace(attention_mask=torch.ones(3, 5))\n"
        "for index in range(4):\n"
        "    stats.on_train_batch_start(trainer, None, batch, index)\n"
        "    time.sleep(0.05)\n"
        "    stats.on_train_batch_end(trainer, None, None, batch, index)\n"
        f"open({str(made_two_steps)!r}, 'w').close()\n"
        "time.sleep(3600)\n"
    )
    check = Check("hangs after two steps", [sys.executable, "-c", script], 1, work=work)
    with monkeypatch.context() as patched, open(tmp_path / "log", "w") as log:
        patched.setattr(gpu_smoke.subprocess, "run", time_limit_counted_from(made_two_steps))
        run_check(check, {**os.environ, STATS_DIR: str(work)}, log)
    rows = dict(check.rows)
    assert check.outcome == "timed out after 1 s", (tmp_path / "log").read_text()[-2000:]
    assert rows["seconds per step, rollouts included (median of 1)"]  # two step ends: one whole step between them
    assert rows["training tokens/s (prompt and completion, all GPUs)"]  # 4 micro-batches of 15 tokens over ~0.2 s

    stats, trainer = SmokeStats(), SimpleNamespace(accumulate_grad_batches=2, global_rank=0)
    batch = SimpleNamespace(attention_mask=torch.ones(2, 4))
    monkeypatch.setenv(STATS_DIR, str(tmp_path))
    stats.on_train_batch_start(trainer, None, batch, 0)
    stats.on_train_batch_end(trainer, None, None, batch, 0)
    assert not (tmp_path / "rank0.json").exists()  # mid-step: nothing written yet
    stats.on_train_batch_start(trainer, None, batch, 1)
    stats.on_train_batch_end(trainer, None, None, batch, 1)
    assert '"train_tokens": 16' in (tmp_path / "rank0.json").read_text()
