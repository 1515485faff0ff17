"""Runs the README's quickstart command and prints its wall time and held-out accuracy, start to end.

    python benchmarks/performance/quickstart.py [--config configs/quickstart.yaml] [extra lit-cancel options...]

The run's TensorBoard event files are read back, so the table shows what a user sees in TensorBoard.
"""

import argparse
import subprocess
import tempfile
import time
from pathlib import Path

from tensorboard.backend.event_processing.event_accumulator import EventAccumulator


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--config", default="configs/quickstart.yaml")
    args, extra = parser.parse_known_args()
    with tempfile.TemporaryDirectory() as save_dir:
        command = ["lit-cancel", "fit", "--config", args.config, f"--trainer.logger.init_args.save_dir={save_dir}", *extra]
        started = time.perf_counter()
        subprocess.run(command, check=True, stdout=subprocess.DEVNULL)
        wall = time.perf_counter() - started
        (log_dir,) = Path(save_dir).glob("*/version_*")
        events = EventAccumulator(str(log_dir))
        events.Reload()
        rows = {tag: events.Scalars(tag) for tag in ("val/accuracy", "val/greedy_accuracy")}
    print(f"command: {' '.join(command[:4])} {' '.join(extra)}")
    print(f"wall time: {wall:.0f} s\n")
    print(f"{'metric':<22}{'start':>8}{'end':>8}{'change':>9}")
    for tag, values in rows.items():
        start, end = values[0].value, values[-1].value
        print(f"{tag:<22}{start:>8.3f}{end:>8.3f}{100 * (end - start):>+8.1f} pt")
    steps = [e.step for e in rows["val/accuracy"]]
    print(f"\nval/accuracy by step: {', '.join(f'{s}: {e.value:.3f}' for s, e in zip(steps, rows['val/accuracy']))}")


if __name__ == "__main__":
    main()
