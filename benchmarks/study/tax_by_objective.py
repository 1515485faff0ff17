"""The quickstart with GRPO and with DFPO (min-replace): the learning tax each pays over training.

    python benchmarks/study/tax_by_objective.py [--steps 100] [--objectives GRPO DFPOMin]

Runs the quickstart (all four health callbacks on) once per objective and prints, from the
TensorBoard files, ``health/learning_tax`` (share of each update's credit left uncancelled on the
tokens a whole group shares) and ``health/shared_kl`` (KL at those contexts across a step) over
training, with the held-out accuracy at the start and the end.
"""

import argparse
import statistics
import subprocess
import tempfile
from pathlib import Path

from tensorboard.backend.event_processing.event_accumulator import EventAccumulator


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=100)
    parser.add_argument("--objectives", nargs="+", default=["GRPO", "DFPOMin"])
    args = parser.parse_args()
    rows = {}
    with tempfile.TemporaryDirectory() as save_dir:
        for objective in args.objectives:
            subprocess.run([
                "lit-cancel", "fit", "--config", "configs/quickstart.yaml", f"--model.init_args.objective=lit_cancel.{objective}",
                f"--trainer.max_steps={args.steps}", "--trainer.enable_progress_bar=false",
                f"--trainer.logger.init_args.save_dir={save_dir}", f"--trainer.logger.init_args.name={objective}",
            ], check=True, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
            (log_dir,) = Path(save_dir, objective).glob("version_*")
            events = EventAccumulator(str(log_dir))
            events.Reload()
            tags = ("health/learning_tax", "health/shared_kl", "val/accuracy")
            rows[objective] = {tag: [e.value for e in events.Scalars(tag)] for tag in tags}
    quarter = args.steps // 4
    print(f"quickstart, {args.steps} steps; learning tax = uncancelled share of |credit| on shared tokens, per step\n")
    print(f"{'objective':<10}" + "".join(f"{f'tax {q * quarter + 1}-{(q + 1) * quarter}':>14}" for q in range(4))
          + f"{'shared KL':>12}{'val start':>11}{'val end':>9}")
    for objective, series in rows.items():
        tax = series["health/learning_tax"]
        quarters = [statistics.mean(tax[q * quarter : (q + 1) * quarter]) for q in range(4)]
        print(f"{objective:<10}" + "".join(f"{value:>14.4f}" for value in quarters)
              + f"{statistics.mean(series['health/shared_kl']):>12.2e}{series['val/accuracy'][0]:>11.3f}{series['val/accuracy'][-1]:>9.3f}")


if __name__ == "__main__":
    main()
