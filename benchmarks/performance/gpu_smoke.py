"""Checks a GPU machine before a long job: the GPU tests, then a short run of the 0.5 B vLLM recipe, and a table.

    python benchmarks/performance/gpu_smoke.py --model-path /models/Qwen2.5-0.5B-Instruct [--train-file F --val-file F]
    python benchmarks/performance/gpu_smoke.py --dry-run          # prints the steps and exits (any machine)

1. ``pytest -m gpu``: vLLM on the GPU, a LoRA push, sleep mode, the CUDA generators, exact resume, FSDP2
   on every GPU (tests/test_gpu.py; skipped tests are reported, any failure stops here).
2. ``lit-cancel fit --config configs/qwen2.5-0.5b-gsm8k-vllm.yaml`` for ``--steps`` steps (20) on the model
   folder given, on GSM8K files given or on synthetic word problems it writes; one validation batch before it.
3. A table read back from the run's TensorBoard files and from each process's memory counters: peak memory
   per GPU, rollout and training tokens/s, weight-sync seconds per push.

Further options go to ``lit-cancel fit`` (e.g. ``--trainer.devices=4`` with another ``--config``).
"""

import argparse
import json
import os
import shlex
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import lightning as L

ROOT = Path(__file__).resolve().parents[2]
STATS_DIR = "LIT_CANCEL_SMOKE_DIR"


class SmokeStats(L.Callback):
    """Each process's peak GPU memory and its training tokens and seconds, written to ``$LIT_CANCEL_SMOKE_DIR/rank<N>.json``.

    Training time runs from the start of a batch (its rollouts are sampled before, when the batch is fetched)
    to its end: forward, backward and, on the last micro-batch of a step, the optimizer step.
    """

    def __init__(self):
        self.tokens, self.seconds, self.device_used, self._started = 0, 0.0, 0, None

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx) -> None:
        self._note_device()  # rollouts just ran (vLLM asleep again under sleep mode)
        self._started = time.perf_counter()

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        import torch

        if torch.cuda.is_available():
            torch.cuda.synchronize()
        self.seconds += time.perf_counter() - self._started
        self.tokens += int(batch.attention_mask.sum())
        self._note_device()

    def _note_device(self) -> None:
        import torch

        if torch.cuda.is_available():
            free, total = torch.cuda.mem_get_info()
            self.device_used = max(self.device_used, total - free)

    def on_fit_end(self, trainer, pl_module) -> None:
        import torch

        folder = os.environ.get(STATS_DIR)
        if not folder:
            return
        cuda = torch.cuda.is_available()
        stats = {
            "rank": trainer.global_rank,
            "device": torch.cuda.get_device_name() if cuda else "cpu",
            "peak_torch_gib": torch.cuda.max_memory_reserved() / 2**30 if cuda else 0.0,
            "peak_device_gib": self.device_used / 2**30,
            "train_tokens": self.tokens,
            "train_seconds": self.seconds,
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


def scalars(log_dir: Path, tag: str) -> list[float]:
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    events = EventAccumulator(str(log_dir))
    events.Reload()
    return [event.value for event in events.Scalars(tag)] if tag in events.Tags()["scalars"] else []


def table(log_dir: Path, stats_dir: Path, wall: float) -> str:
    rollout = scalars(log_dir, "perf/rollout_tokens_per_s")
    syncs = scalars(log_dir, "perf/weight_sync_s")
    ranks = [json.loads(p.read_text()) for p in sorted(stats_dir.glob("rank*.json"))]
    rows = [("wall time, start-up and validation included", f"{wall:.0f} s")]
    for rank in ranks:
        rows.append((f"GPU {rank['rank']} ({rank['device']}) peak memory: training (torch) / device in use",
                     f"{rank['peak_torch_gib']:.1f} / {rank['peak_device_gib']:.1f} GiB"))
    if rollout:
        rows.append(("rollout tokens/s (completion tokens, median of steps)", f"{statistics.median(rollout):,.0f}"))
    tokens, seconds = sum(r["train_tokens"] for r in ranks), max((r["train_seconds"] for r in ranks), default=0.0)
    if seconds:
        rows.append(("training tokens/s (prompt and completion, all GPUs)", f"{tokens / seconds:,.0f}"))
    pushes = [s for s in syncs if s > 0]  # vLLM starts at the validation before fit, whose push is not logged
    if pushes:
        rows.append((f"weight sync per push (median / max of {len(pushes)})", f"{statistics.median(pushes):.2f} / {max(pushes):.2f} s"))
    width = max(len(name) for name, _ in rows)
    return "\n".join(f"{name:<{width}}  {value}" for name, value in rows)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model-path", default="/models/Qwen2.5-0.5B-Instruct", help="local Hugging Face model folder")
    parser.add_argument("--train-file", help="GSM8K-style jsonl; default: synthetic word problems written for the run")
    parser.add_argument("--val-file", help="held-out jsonl; default: the train file (or the synthetic one)")
    parser.add_argument("--config", default="configs/qwen2.5-0.5b-gsm8k-vllm.yaml")
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--skip-tests", action="store_true", help="leave out pytest -m gpu")
    parser.add_argument("--dry-run", action="store_true", help="print the steps and exit")
    args, extra = parser.parse_known_args()

    if args.dry_run:
        work = Path(tempfile.gettempdir(), "lit-cancel-gpu-smoke-XXXX")
    else:
        work = Path(tempfile.mkdtemp(prefix="lit-cancel-gpu-smoke-"))
    train_file = args.train_file or str(work / "train.jsonl")
    val_file = args.val_file or train_file
    tests = [sys.executable, "-m", "pytest", "-m", "gpu", "-q", "-rs", "-p", "no:cacheprovider"]
    fit = [
        "lit-cancel", "fit", "--config", args.config, f"--trainer.max_steps={args.steps}", "--trainer.limit_val_batches=1",
        f"--trainer.logger.init_args.save_dir={work}", "--trainer.callbacks+=gpu_smoke.SmokeStats",
        f"--model.init_args.model_path={args.model_path}",
        f"--data.init_args.task.init_args.train_file={train_file}", f"--data.init_args.task.init_args.val_file={val_file}",
        *extra,
    ]
    steps = [] if args.skip_tests else [("1. GPU tests", tests)]
    steps.append((f"{len(steps) + 1}. a {args.steps}-step run of {args.config}", fit))
    if args.dry_run:
        if not args.train_file:
            print(f"would write synthetic word problems to {train_file}")
        for name, command in steps:
            print(f"{name}: {shlex.join(command)}")
        print(f"{len(steps) + 1}. a table: peak memory per GPU, rollout and training tokens/s, weight-sync seconds")
        return 0

    if not args.train_file:
        synthetic_word_problems(Path(train_file), rows=400, seed=0)
    python_path = os.pathsep.join(filter(None, [str(Path(__file__).parent), os.environ.get("PYTHONPATH")]))  # for SmokeStats
    env = {**os.environ, STATS_DIR: str(work), "PYTHONPATH": python_path}
    wall = 0.0
    for name, command in steps:
        print(f"{name}: {shlex.join(command)}", flush=True)
        started = time.perf_counter()
        result = subprocess.run(command, cwd=ROOT, env=env)
        wall = time.perf_counter() - started
        if result.returncode:
            print(f"{name} failed (exit {result.returncode}); fix that before a long job")
            return result.returncode
    (log_dir,) = sorted(work.glob("*/version_*"))[-1:]
    print()
    print(table(log_dir, work, wall))
    print(f"\nthe run's files (TensorBoard events, checkpoint): {work}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
