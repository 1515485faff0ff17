"""benchmarks/performance/gpu_smoke.py on a CPU: its dry run names every step, and the word problems it writes are a GSM8K file."""

import subprocess
import sys
from pathlib import Path

PERFORMANCE = Path(__file__).resolve().parents[2] / "benchmarks" / "performance"


def test_the_dry_run_names_the_gpu_tests_the_short_run_and_the_table_and_exits_0():
    result = subprocess.run([sys.executable, str(PERFORMANCE / "gpu_smoke.py"), "--dry-run", "--model-path", "/models/m"],
                            capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr
    out = result.stdout
    assert "pytest -m gpu" in out
    assert "lit-cancel fit --config configs/qwen2.5-0.5b-gsm8k-vllm.yaml --trainer.max_steps=20" in out
    assert "--model.init_args.model_path=/models/m" in out and "synthetic word problems" in out
    assert "peak memory per GPU" in out and "weight-sync" in out


def test_the_synthetic_word_problems_load_as_a_math_word_task_with_their_answers_rewarded(tmp_path):
    from gpu_smoke import synthetic_word_problems

    from lit_cancel import MathWordTask

    path = tmp_path / "train.jsonl"
    synthetic_word_problems(path, rows=20, seed=0)
    task = MathWordTask(train_file=str(path), val_file=str(path))
    records = task.train_records()
    assert len(records) == 20
    assert all(task.reward(r, f"so the answer is {r['answer']}") == 1.0 for r in records)
