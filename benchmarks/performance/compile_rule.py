"""What ``compile: true`` saves a step and costs to compile, against what ``compile: auto`` models (``lit_cancel.compile_choice``).

    python benchmarks/performance/compile_rule.py [--rows real-small-fp32:12,real-large-fp32:4] [--threads 2]

For each ``vs_trl.py`` row (``name:steps``), fits the row eager and then compiled for its steps after the first, each
under ``profile_step.py``'s timers and the fit's wall clock, compiling into an empty cache (a first run's cost: later
runs of the same model and shapes load part of it from torch's cache on disk), and measures the row's narrow model as
``compile: auto`` does at start-up. Prints per row: the median step eager and compiled and what compiling saved of
decoding and of the training passes; compilation's cost (the compiled fit's time beyond its steps at their median,
less the same for the eager fit); the narrow model's time decoding a step's tokens (the completion limit); its
one-block decoding step's share of the model's (``MIN_DISPATCH_SHARE`` lies between rows where compiling paid and where
it did not); the step's saving over that time (the rule's ``SAVED_SHARE``); the cost per block and kind of pass
compiled (rollouts and training: ``SECONDS_PER_BLOCK``); and the steps after which compiling pays, measured and as
the rule predicts it.
"""

import argparse
import os
import statistics
import tempfile
import time

import torch
from profile_step import profile  # benchmarks/performance is on the path when run as a script
from vs_trl import ROWS

from lit_cancel.compile_choice import MIN_DISPATCH_SHARE, SAVED_SHARE, SECONDS_PER_BLOCK, measure_overhead

TRAINING_PARTS = ("old/ref log-probs", "training forward", "backward")
KINDS = 2  # the rows run no validation: rollouts and training passes are compiled


def median(steps: list[dict], parts: tuple[str, ...]) -> float:
    return statistics.median(sum(step.get(part, 0.0) for part in parts) for step in steps)


def timed_fit(row, steps: int, compiled: bool):
    with tempfile.TemporaryDirectory() as scratch, tempfile.TemporaryDirectory() as cache:
        os.environ["TORCHINDUCTOR_CACHE_DIR"] = cache
        started = time.perf_counter()
        run = profile(scratch, row, steps, 0, compile=compiled)
        return run, time.perf_counter() - started


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rows", default="real-small-fp32:12,real-large-fp32:4", help="rows, each name:steps")
    parser.add_argument("--threads", type=int, default=2)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    print(f"{torch.get_num_threads()} threads; the rule: one block's share at least {MIN_DISPATCH_SHARE:.0%}, {SAVED_SHARE} of the "
          f"narrow model's decoding saved, {SECONDS_PER_BLOCK} s a block and kind of pass\n")
    print("| row | blocks | eager s/step | compiled s/step | saved: decoding / training (ms) | compilation (s) | narrow model "
          "decoding a step (ms) | one block's share | step's saving / narrow decoding | s a block and kind | pays after "
          "(measured / rule) |")
    print("|---|---|---|---|---|---|---|---|---|---|---|")
    for spec in args.rows.split(","):
        name, steps = spec.split(":")
        row = ROWS[name]
        eager, eager_wall = timed_fit(row, int(steps), False)
        compiled, compiled_wall = timed_fit(row, int(steps), True)
        fitted = int(steps) + 1  # the first step is not timed by the profile: the fit's wall clock holds it
        step_eager, step_compiled = median(eager.steps, ("total",)), median(compiled.steps, ("total",))
        compilation = (compiled_wall - fitted * step_compiled) - (eager_wall - fitted * step_eager)
        decode_saved = median(eager.steps, ("prefill", "decode")) - median(compiled.steps, ("prefill", "decode"))
        training_saved = median(eager.steps, TRAINING_PARTS) - median(compiled.steps, TRAINING_PARTS)

        config = eager.module.policy.model.config
        rows = len(eager.rounds[0].completion_tokens)  # a step is a round here: one mini-batch, one epoch
        overhead = measure_overhead(config, rows, torch.device("cpu"))
        narrow_decode = overhead.decode_step * row.new_tokens  # the completion limit, as compile: auto counts it
        saving = step_eager - step_compiled
        pays = f"{compilation / saving:.0f}" if saving > 0 else "never"
        cost = SECONDS_PER_BLOCK * config.num_hidden_layers * KINDS
        predicted = f"{cost / (SAVED_SHARE * narrow_decode):.0f}" if overhead.dispatch_share >= MIN_DISPATCH_SHARE else "never"
        print(f"| {name} | {config.num_hidden_layers} | {step_eager:.3f} | {step_compiled:.3f} | {decode_saved * 1e3:.0f} / "
              f"{training_saved * 1e3:.0f} | {compilation:.1f} | {narrow_decode * 1e3:.0f} | {overhead.dispatch_share:.0%} | "
              f"{saving / narrow_decode:.2f} | {compilation / (config.num_hidden_layers * KINDS):.1f} | {pays} / {predicted} |")


if __name__ == "__main__":
    main()
