"""Checks a GPU machine before a long job: every check in its own process with a time limit, each reported.

    python benchmarks/performance/gpu_smoke.py                  # every check, then a table
    python benchmarks/performance/gpu_smoke.py --model-path /models/Qwen2.5-0.5B-Instruct [--train-file F --val-file F]
    python benchmarks/performance/gpu_smoke.py --only shipped qwen -- --model.init_args.activation_checkpointing=blocks+chunks
    python benchmarks/performance/gpu_smoke.py --dry-run        # prints the checks and exits (any machine)

The checks:

1. every test of ``pytest -m gpu`` (tests/test_gpu.py), each in a pytest process of its own: vLLM allows one
   sleep-mode memory pool per process, and a test that hangs or crashes must not take the others with it;
2. ``shipped``: a short run of configs/quickstart.yaml on the GPU (the shipped model, the health callbacks on);
3. ``qwen``: a short run of the 0.5 B recipe (configs/qwen2.5-0.5b-gsm8k-vllm.yaml where vLLM is installed, else
   configs/qwen2.5-0.5b-gsm8k.yaml with the decode loop) on the model folder given, or on a model of
   Qwen2.5-0.5B-Instruct's shape (494 M parameters, 151,936-token vocabulary) with random weights and the
   shipped character tokenizer; on the GSM8K files given or on synthetic word problems.

A failed or timed-out check is reported and the next one runs. The table gives each check's outcome and time,
and for the runs: peak memory, seconds per step, rollout and training tokens/s, seconds per weight push.
Options after ``--`` go to the ``qwen`` run's ``lit-cancel fit``.
"""

import argparse
import importlib.util
import json
import os
import shlex
import statistics
import subprocess
import sys
import tempfile
import time
import xml.etree.ElementTree as ElementTree
from dataclasses import dataclass, field
from pathlib import Path

import lightning as L

ROOT = Path(__file__).resolve().parents[2]
STATS_DIR = "LIT_CANCEL_SMOKE_DIR"
QWEN2_5_0_5B = dict(  # Qwen/Qwen2.5-0.5B-Instruct's config.json
    vocab_size=151936, hidden_size=896, intermediate_size=4864, num_hidden_layers=24, num_attention_heads=14,
    num_key_value_heads=2, max_position_embeddings=32768, rope_theta=1000000.0, rms_norm_eps=1e-6, tie_word_embeddings=True,
)


class SmokeStats(L.Callback):
    """Each process's memory and times, written to ``$LIT_CANCEL_SMOKE_DIR/rank<N>.json`` at the end of fit.

    Training time runs from the start of a batch (its rollouts were sampled when the batch was fetched) to its
    end: forward, backward and, on the last micro-batch of a step, the optimizer step. Training's peak is torch's
    peak allocation inside those windows, so an engine's memory held outside them (vLLM's) is not counted as
    training's; the device's peak in use (all processes, all allocators) is read at the windows' edges. The file is
    written again after every optimizer step, so a run stopped at its time limit still reports the steps it made.
    """

    def __init__(self):
        self.tokens, self.seconds, self.train_peak, self.device_used = 0, 0.0, 0, 0
        self.step_ends: list[float] = []
        self._started = None

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx) -> None:
        import torch

        self._note_device()  # rollouts just ran (vLLM asleep again under sleep mode)
        if torch.cuda.is_available():
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()
        self._started = time.perf_counter()

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        import torch

        if torch.cuda.is_available():
            torch.cuda.synchronize()
            self.train_peak = max(self.train_peak, torch.cuda.max_memory_allocated())
        now = time.perf_counter()
        self.seconds += now - self._started
        self.tokens += int(batch.attention_mask.sum())
        self._note_device()
        if (batch_idx + 1) % trainer.accumulate_grad_batches == 0:
            self.step_ends.append(now)
            self._write(trainer)

    def _note_device(self) -> None:
        import torch

        if torch.cuda.is_available():
            free, total = torch.cuda.mem_get_info()
            self.device_used = max(self.device_used, total - free)

    def on_fit_end(self, trainer, pl_module) -> None:
        self._write(trainer)

    def _write(self, trainer) -> None:
        import torch

        folder = os.environ.get(STATS_DIR)
        if not folder:
            return
        cuda = torch.cuda.is_available()
        stats = {
            "rank": trainer.global_rank,
            "device": torch.cuda.get_device_name() if cuda else "cpu",
            "device_gib": torch.cuda.mem_get_info()[1] / 2**30 if cuda else 0.0,
            "train_peak_gib": self.train_peak / 2**30,
            "peak_device_gib": self.device_used / 2**30,
            "train_tokens": self.tokens,
            "train_seconds": self.seconds,
            "step_seconds": [b - a for a, b in zip(self.step_ends, self.step_ends[1:])],
        }
        Path(folder, f"rank{trainer.global_rank}.json").write_text(json.dumps(stats))


def synthetic_word_problems(path: Path, rows: int, seed: int) -> None:
    """GSM8K-shaped rows ('question', 'answer' ending in '#### n') for a run without the data set."""
    lines = []
    for index in range(rows):
        a, b, c = 3 + (index * 7 + seed) % 40, 2 + (index * 11 + seed) % 25, 1 + (index * 5 + seed) % 9
        question = f"A shop has {a} boxes of {c} pens and sells {b} pens. How many pens are left?"
        answer = f"There are {a}*{c}={a * c} pens; {a * c}-{b}={a * c - b} are left.\n#### {a * c - b}"
        lines.append(json.dumps({"question": question, "answer": answer}))
    path.write_text("\n".join(lines) + "\n")


def save_random_qwen(folder: Path, **shape) -> str:
    """A Qwen2 model of ``shape`` with random weights (bfloat16 on disk) and the shipped character tokenizer."""
    import torch
    from transformers import AutoTokenizer, Qwen2Config, Qwen2ForCausalLM

    tokenizer = AutoTokenizer.from_pretrained(ROOT / "lit_cancel" / "assets" / "tiny-adder")
    config = Qwen2Config(**shape, eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id)
    torch.manual_seed(0)
    Qwen2ForCausalLM(config).to(torch.bfloat16).save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    return str(folder)


def scalars(log_dir: Path, tag: str) -> list[float]:
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    events = EventAccumulator(str(log_dir))
    events.Reload()
    return [event.value for event in events.Scalars(tag)] if tag in events.Tags()["scalars"] else []


def run_rows(work: Path) -> list[tuple[str, str]]:
    """What a run check measured: from its TensorBoard files and each process's SmokeStats file."""
    log_dirs = sorted(work.glob("*/version_*"))
    ranks = [json.loads(p.read_text()) for p in sorted(work.glob("rank*.json"))]
    rows = []
    for rank in ranks:
        rows.append((f"GPU {rank['rank']} ({rank['device']}, {rank['device_gib']:.0f} GiB): training's peak / device in use",
                     f"{rank['train_peak_gib']:.2f} / {rank['peak_device_gib']:.2f} GiB"))
    steps = ranks[0]["step_seconds"] if ranks else []
    if steps:
        rows.append((f"seconds per step, rollouts included (median of {len(steps)})", f"{statistics.median(steps):.2f}"))
    if log_dirs:
        rollout = scalars(log_dirs[-1], "perf/rollout_tokens_per_s")
        if rollout:
            rows.append(("rollout tokens/s (completion tokens, median of steps)", f"{statistics.median(rollout):,.0f}"))
        pushes = [s for s in scalars(log_dirs[-1], "perf/weight_sync_s") if s > 0]
        if pushes:
            rows.append((f"weight sync per push (median / max of {len(pushes)})", f"{statistics.median(pushes):.2f} / {max(pushes):.2f} s"))
    tokens, seconds = sum(r["train_tokens"] for r in ranks), max((r["train_seconds"] for r in ranks), default=0.0)
    if seconds:
        rows.append(("training tokens/s (prompt and completion, all GPUs)", f"{tokens / seconds:,.0f}"))
    return rows


@dataclass
class Check:
    name: str
    command: list[str]
    timeout: float
    work: Path | None = None  # a run's folder: its TensorBoard files and SmokeStats
    junit: Path | None = None  # a test's report
    outcome: str = "not run"
    seconds: float = 0.0
    rows: list[tuple[str, str]] = field(default_factory=list)


def gpu_tests(timeout: float, work: Path) -> list[Check]:
    """One check per test that ``pytest -m gpu`` collects, each run alone."""
    collect = [sys.executable, "-m", "pytest", "-m", "gpu", "--collect-only", "-q", "-p", "no:cacheprovider", "tests/test_gpu.py"]
    listed = subprocess.run(collect, cwd=ROOT, capture_output=True, text=True, timeout=300)
    ids = [line for line in listed.stdout.splitlines() if "::" in line]
    if not ids:
        return [Check("collect tests/test_gpu.py", [], timeout, outcome="failed: " + (listed.stdout + listed.stderr)[-300:])]
    checks = []
    for node in ids:
        junit = work / f"{node.split('::')[-1]}.xml"
        command = [sys.executable, "-m", "pytest", "-q", "-rs", "-p", "no:cacheprovider", f"--junitxml={junit}", node]
        checks.append(Check(node.split("::")[-1], command, timeout, junit=junit))
    return checks


def test_outcome(junit: Path, returncode: int) -> str:
    if not junit.exists():
        return f"failed (exit {returncode}, no report)"
    case = ElementTree.parse(junit).getroot().find(".//testcase")
    for kind in ("failure", "error", "skipped"):
        found = case.find(kind) if case is not None else None
        if found is not None:
            label = "skipped" if kind == "skipped" else "failed"
            return f"{label}: {(found.get('message') or '').splitlines()[0][:160] if found.get('message') else kind}"
    return "passed" if returncode == 0 else f"failed (exit {returncode})"


def run_check(check: Check, env: dict, log) -> None:
    print(f"== {check.name}: {shlex.join(check.command)}", file=log, flush=True)
    started = time.perf_counter()
    try:
        result = subprocess.run(check.command, cwd=ROOT, env={**env, STATS_DIR: str(check.work or "")}, stdout=log,
                                stderr=subprocess.STDOUT, timeout=check.timeout)
        returncode = result.returncode
    except subprocess.TimeoutExpired:
        returncode = None
    check.seconds = time.perf_counter() - started
    if returncode is None:
        check.outcome = f"timed out after {check.timeout:.0f} s"
    elif check.junit is not None:
        check.outcome = test_outcome(check.junit, returncode)
    else:
        check.outcome = "passed" if returncode == 0 else f"failed (exit {returncode})"
    if check.work is not None:
        check.rows = run_rows(check.work)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model-path", help="the qwen run's Hugging Face model folder; default: Qwen2.5-0.5B's shape, random weights")
    parser.add_argument("--train-file", help="GSM8K-style jsonl; default: synthetic word problems written for the run")
    parser.add_argument("--val-file", help="held-out jsonl, validated whole before the run; default: 16 synthetic word problems")
    parser.add_argument("--config", help="the qwen run's config; default: the vLLM recipe where vLLM is installed, else the decode loop's")
    parser.add_argument("--steps", type=int, default=10, help="optimizer steps of each run")
    parser.add_argument("--max-new-tokens", type=int, default=256, help="the qwen run's completion limit")
    parser.add_argument("--only", nargs="+", choices=["tests", "shipped", "qwen"], default=["tests", "shipped", "qwen"])
    parser.add_argument("--test-timeout", type=float, default=300, help="seconds for each test's process")
    parser.add_argument("--run-timeout", type=float, default=420, help="seconds for each run")
    parser.add_argument("--work-dir", help="folder for the runs, logs and reports; default: a new temporary folder")
    parser.add_argument("--accelerator", default="cuda", help="the runs' accelerator (cpu to try this script without a GPU)")
    parser.add_argument("--dry-run", action="store_true", help="print the checks and exit")
    args, extra = parser.parse_known_args()
    extra = [option for option in extra if option != "--"]

    work = Path(args.work_dir or tempfile.mkdtemp(prefix="lit-cancel-gpu-smoke-"))
    work.mkdir(parents=True, exist_ok=True)
    has_vllm = importlib.util.find_spec("vllm") is not None
    config = args.config or ("configs/qwen2.5-0.5b-gsm8k-vllm.yaml" if has_vllm else "configs/qwen2.5-0.5b-gsm8k.yaml")
    train_file = args.train_file or str(work / "train.jsonl")
    val_file = args.val_file or str(work / "val.jsonl")
    model_path = args.model_path or str(work / "qwen2.5-0.5b-shape")
    fit = [sys.executable, "-m", "lit_cancel", "fit"]
    # after --config, which they override
    run_options = [f"--trainer.max_steps={args.steps}", "--trainer.enable_progress_bar=false",
                   "--trainer.callbacks+=gpu_smoke.SmokeStats", f"--trainer.accelerator={args.accelerator}"]
    checks = gpu_tests(args.test_timeout, work) if "tests" in args.only and not args.dry_run else []
    if "tests" in args.only and args.dry_run:
        checks.append(Check("each test of pytest -m gpu tests/test_gpu.py, in its own process", [], args.test_timeout))
    if "shipped" in args.only:
        shipped = [*fit, "--config", "configs/quickstart.yaml", *run_options, f"--trainer.logger.init_args.save_dir={work / 'shipped'}"]
        checks.append(Check("shipped", shipped, args.run_timeout, work=work / "shipped"))
    if "qwen" in args.only:
        checks.append(Check("qwen", [
            *fit, "--config", config, *run_options, f"--trainer.logger.init_args.save_dir={work / 'qwen'}",
            f"--model.init_args.model_path={model_path}",
            f"--model.init_args.max_new_tokens={args.max_new_tokens}", "--data.init_args.val_batch_size=16",
            f"--data.init_args.task.init_args.train_file={train_file}", f"--data.init_args.task.init_args.val_file={val_file}", *extra,
        ], args.run_timeout, work=work / "qwen"))
    if args.dry_run:
        for check in checks:
            print(f"{check.name} (at most {check.timeout:.0f} s): {shlex.join(check.command)}")
        return 0

    if "qwen" in args.only:
        if not args.train_file:
            synthetic_word_problems(Path(train_file), rows=400, seed=0)
        if not args.val_file:  # one validation batch
            synthetic_word_problems(Path(val_file), rows=16, seed=1)
        if not args.model_path:
            save_random_qwen(Path(model_path), **QWEN2_5_0_5B)
    for check in checks:
        if check.work is not None:
            check.work.mkdir(parents=True, exist_ok=True)
    python_path = os.pathsep.join(filter(None, [str(Path(__file__).parent), os.environ.get("PYTHONPATH")]))  # for SmokeStats
    env = {**os.environ, "PYTHONPATH": python_path}
    with open(work / "checks.log", "w") as log:
        for check in checks:
            if not check.command:
                continue
            print(f"{check.name} ...", flush=True)
            run_check(check, env, log)
            print(f"{check.name}: {check.outcome} ({check.seconds:.0f} s)", flush=True)

    print()
    width = max(len(check.name) for check in checks)
    for check in checks:
        print(f"{check.name:<{width}}  {check.outcome}  ({check.seconds:.0f} s)")
        for name, value in check.rows:
            print(f"    {name}: {value}")
    summary = [{"check": c.name, "outcome": c.outcome, "seconds": round(c.seconds, 1), **dict(c.rows)} for c in checks]
    (work / "summary.json").write_text(json.dumps(summary, indent=1))
    print(f"\nlogs, reports and runs: {work}")
    return 0 if all(c.outcome == "passed" or c.outcome.startswith("skipped") for c in checks) else 1


if __name__ == "__main__":
    sys.exit(main())
