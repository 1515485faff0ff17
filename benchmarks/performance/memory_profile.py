"""Where a lit_cancel step's memory goes as completions get longer: peak resident memory per phase of one step.

    python benchmarks/performance/memory_profile.py [--row real-small-fp32] [--lengths 256 512 1024 2048] [--steps 2]
                                        [--eos] [--threads N] [-- MODULE_OPTION=VALUE ...]

Each length runs in a fresh process on the model of a ``benchmarks/performance/vs_trl.py`` row (its size, precision and
checkpointing), with exactly that many new tokens per rollout (EOS suppressed; ``--eos`` lets rollouts stop at
EOS). A thread reads the process's resident memory every millisecond and keeps the largest value seen in each
phase of the last step: rollout (prefill and decoding), old and reference log-probs, the training forward, the
backward pass, the optimizer step. "Before the step" is the memory at the end of the previous step (weights,
optimizer state, the allocator's cache); a phase's growth is its peak above that. "Seconds" is the step's wall time,
from the previous step's end (the first step's from the start of training).
"""

import argparse
import json
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import replace
from pathlib import Path

import torch
from lightning.pytorch.callbacks import Callback
from vs_trl import ROWS, fit_lit_cancel, lit_cancel_module, write_model  # benchmarks/ is on the path when run as a script

from lit_cancel.host_memory import resident_bytes

PHASES = ["rollout", "old/ref log-probs", "training forward", "backward", "optimizer"]


def resident_mib() -> float:
    return resident_bytes() / 2**20


class PhaseMemory:
    """The peak resident memory of each phase, sampled by a background thread."""

    def __init__(self, interval: float = 0.001):
        self.phase: str | None = None
        self.peaks: dict[str, float] = {}
        self.interval = interval
        self.running = True
        self.thread = threading.Thread(target=self._sample, daemon=True)
        self.thread.start()

    def _sample(self) -> None:
        while self.running:
            phase = self.phase
            if phase is not None:
                self.peaks[phase] = max(self.peaks.get(phase, 0.0), resident_mib())
            time.sleep(self.interval)

    def enter(self, phase: str | None) -> None:
        if phase is not None:  # the boundary itself counts towards the phase it opens
            self.peaks[phase] = max(self.peaks.get(phase, 0.0), resident_mib())
        self.phase = phase

    def wrapped(self, phase: str, fn):
        def wrapper(*args, **kwargs):
            self.enter(phase)
            try:
                return fn(*args, **kwargs)
            finally:
                self.enter(None)
        return wrapper


class PhaseBoundaries(Callback):
    """Marks backward and optimizer with Lightning's hooks; starts a fresh record at each step."""

    def __init__(self, memory: PhaseMemory):
        self.memory = memory
        self.steps: list[dict[str, float]] = []

    def on_train_start(self, trainer, pl_module):
        self.memory.peaks = {"before": resident_mib()}
        self.started = time.perf_counter()

    def on_before_backward(self, trainer, pl_module, loss):
        self.memory.enter("backward")

    def on_after_backward(self, trainer, pl_module):
        self.memory.enter(None)

    def on_before_optimizer_step(self, trainer, pl_module, optimizer):
        self.memory.enter("optimizer")

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        self.memory.enter(None)
        ended = time.perf_counter()
        self.steps.append({"before the step": self.memory.peaks.pop("before", 0.0), **self.memory.peaks,
                           "seconds": ended - self.started})
        self.memory.peaks = {"before": resident_mib()}
        self.started = ended


def child(row_name: str, length: int, eos: bool, steps: int, options: dict) -> dict:
    row = replace(ROWS[row_name], new_tokens=length, eos=eos)
    memory = PhaseMemory()
    boundaries = PhaseBoundaries(memory)
    with tempfile.TemporaryDirectory() as scratch:
        write_model(Path(scratch), row)
        module = lit_cancel_module(scratch, row, **options)
        module.rollout = memory.wrapped("rollout", module.rollout)
        module.score_rollouts = memory.wrapped("old/ref log-probs", module.score_rollouts)
        module.training_step = memory.wrapped("training forward", module.training_step)
        lengths = []

        class Lengths(Callback):
            def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
                lengths.append(batch.completion_mask.sum(1).float().mean().item())

        fit_lit_cancel(module, scratch, row, steps, [boundaries, Lengths()])
    memory.running = False
    return {"steps": boundaries.steps, "lengths": lengths}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--row", default="real-small-fp32", choices=list(ROWS))
    parser.add_argument("--lengths", type=int, nargs="+", default=[256, 512, 1024, 2048])
    parser.add_argument("--steps", type=int, default=2, help="steps per run; the last one is reported")
    parser.add_argument("--eos", action="store_true", help="rollouts stop at EOS (default: exactly LENGTH new tokens)")
    parser.add_argument("--threads", type=int, help="torch threads (default: torch's choice)")
    parser.add_argument("options", nargs="*", help="RLModule options as NAME=VALUE (a Python literal), e.g. max_tokens_per_chunk=512")
    parser.add_argument("--child", type=int, help=argparse.SUPPRESS)
    args = parser.parse_args()
    options = {name: eval(value, {}) for name, value in (option.split("=", 1) for option in args.options)}
    if args.threads:
        torch.set_num_threads(args.threads)
    if args.child:
        print("RESULT " + json.dumps(child(args.row, args.child, args.eos, args.steps, options)))
        return
    row = ROWS[args.row]
    settings = {"activation_checkpointing": row.checkpointing, **options}
    print(f"the {args.row} row's model ({'bf16' if row.bf16 else 'fp32'}), {'EOS or ' if args.eos else 'exactly '}LENGTH new tokens, "
          f"8 prompts x 8 rollouts, {args.threads or torch.get_num_threads()} threads, "
          f"{', '.join(f'{name}={value!r}' for name, value in settings.items())}; peak RSS (MiB) per phase of each step\n")
    print("| completion tokens | step | seconds | mean length | before the step | " + " | ".join(PHASES)
          + " | step peak | growth over the step |")
    print("|---" * (len(PHASES) + 7) + "|")
    for length in args.lengths:
        command = [sys.executable, __file__, "--row", args.row, "--child", str(length), "--steps", str(args.steps),
                   *(["--eos"] if args.eos else []), *(["--threads", str(args.threads)] if args.threads else []), *args.options]
        done = subprocess.run(command, capture_output=True, text=True)
        lines = [line for line in done.stdout.splitlines() if line.startswith("RESULT ")]
        if done.returncode or not lines:
            raise RuntimeError(f"length {length} failed:\n{done.stderr[-3000:]}")
        result = json.loads(lines[-1][len("RESULT "):])
        for step, (phases, mean_length) in enumerate(zip(result["steps"], result["lengths"]), 1):
            peak = max(phases.get(phase, 0.0) for phase in PHASES)
            cells = " | ".join(f"{phases[phase]:,.0f}" if phase in phases else "–" for phase in PHASES)
            print(f"| {length:,} | {step} | {phases['seconds']:.1f} | {mean_length:.0f} | {phases['before the step']:,.0f} "
                  f"| {cells} | {peak:,.0f} "
                  f"| {peak - phases['before the step']:,.0f} |", flush=True)


if __name__ == "__main__":
    main()
