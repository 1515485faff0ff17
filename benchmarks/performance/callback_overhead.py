"""Time spent in each health callback per optimizer step of the quickstart, at the quickstart's frequencies.

    python benchmarks/performance/callback_overhead.py [--steps 60]

Every hook of each callback is timed inside one run, so the ratios come from the same steps.
Validation is off. A step's time is the wall time between the starts of consecutive steps, rollout
sampling included (one round per step in the quickstart).
"""

import argparse
import statistics
import tempfile
import time
from functools import wraps
from pathlib import Path

import lightning as L

from lit_cancel.run.cli import LitCancelCLI

HOOKS = ("on_train_start", "on_train_batch_start", "on_before_optimizer_step", "on_train_batch_end")


class StepClock(L.Callback):
    def __init__(self):
        self.starts = []

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
        self.starts.append(time.perf_counter())

    def on_train_end(self, trainer, pl_module):
        self.starts.append(time.perf_counter())


def timed(callback: L.Callback, spent: list[float]) -> None:
    for name in HOOKS:
        hook = getattr(callback, name)

        @wraps(hook)
        def wrapper(*args, _hook=hook, **kwargs):
            started = time.perf_counter()
            result = _hook(*args, **kwargs)
            spent.append(time.perf_counter() - started)
            return result

        setattr(callback, name, wrapper)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=60)
    args = parser.parse_args()
    folder = tempfile.mkdtemp()  # the run's TensorBoard files: the loggers' writes are part of a step
    cli = LitCancelCLI(
        L.LightningModule, L.LightningDataModule, subclass_mode_model=True, subclass_mode_data=True, run=False,
        trainer_defaults={"inference_mode": False}, auto_configure_optimizers=False,
        args=["--config", str(Path(__file__).parents[2] / "configs" / "quickstart.yaml"),
              f"--trainer.max_steps={args.steps}", "--trainer.limit_val_batches=0",
              "--trainer.enable_progress_bar=false", f"--trainer.logger.init_args.save_dir={folder}",
              f"--trainer.default_root_dir={folder}"],
    )
    spent = {}
    for callback in cli.trainer.callbacks:
        if type(callback).__module__.startswith("lit_cancel.callbacks"):
            spent[type(callback).__name__] = []
            timed(callback, spent[type(callback).__name__])
    clock = StepClock()
    cli.trainer.callbacks.append(clock)
    cli.trainer.fit(cli.model, datamodule=cli.datamodule)

    steps = [b - a for a, b in zip(clock.starts, clock.starts[1:])]
    total_callbacks = sum(sum(times) for times in spent.values())
    step_mean = statistics.mean(steps)
    bare_mean = step_mean - total_callbacks / len(steps)
    print(f"{len(steps)} quickstart steps; step time median {1000 * statistics.median(steps):.0f} ms, "
          f"mean {1000 * step_mean:.0f} ms of which {1000 * bare_mean:.0f} ms without the callbacks\n")
    print(f"{'callback':<34}{'ms per step (mean)':>20}{'share of step':>16}")
    for name, times in spent.items():
        per_step = sum(times) / len(steps)
        print(f"{name:<34}{1000 * per_step:>20.1f}{100 * per_step / bare_mean:>15.1f}%")
    per_step = total_callbacks / len(steps)
    print(f"{'all ' + str(len(spent)):<34}{1000 * per_step:>20.1f}{100 * per_step / bare_mean:>15.1f}%")


if __name__ == "__main__":
    main()
