"""Shuffled vs query-preserved vs reward-balanced mini-batches on the embedded task.

    python benchmarks/performance/batching.py [--seeds 0 1 2] [--steps 80] [--out benchmarks/performance/batching.png]

Each run is the quickstart (GRPO, 16 prompts x 8 rollouts per round, all four health callbacks) with 4 mini-batches per round
and 2 epochs over each round (so 8 optimizer steps per round, 7 of them off-policy), the same
number of optimizer steps for every plan. Prints final held-out accuracy (mean +- std over seeds)
and the first validated step at which each seed reached the threshold; writes a PNG of accuracy
against step and the curves as JSON beside it. Needs matplotlib (``pip install -e ".[bench]"``).
"""

import argparse
import json
import statistics
import subprocess
import tempfile
from pathlib import Path

from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

PLANS = {"shuffled": "lit_cancel.Shuffled", "query_preserved": "lit_cancel.QueryPreserved", "reward_balanced": "lit_cancel.RewardBalanced"}


def run(plan: str, seed: int, steps: int, val_every: int, lr: float, save_dir: str) -> list[tuple[int, float]]:
    name = f"{plan}-seed{seed}"
    subprocess.run([
        "lit-cancel", "fit", "--config", "configs/quickstart.yaml",
        f"--seed_everything={seed}", f"--data.init_args.seed={seed}", f"--data.init_args.plan={PLANS[plan]}",
        "--data.init_args.mini_batches_per_round=4", "--data.init_args.epochs_per_round=2",
        f"--trainer.max_steps={steps}", f"--trainer.val_check_interval={val_every}", "--model.init_args.val_samples=4",
        f"--model.init_args.optimizer.init_args.lr={lr}",
        "--trainer.enable_checkpointing=false", "--trainer.callbacks=[]", "--trainer.enable_progress_bar=false",
        f"--trainer.logger.init_args.save_dir={save_dir}", f"--trainer.logger.init_args.name={name}",
    ], check=True, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    (log_dir,) = Path(save_dir, name).glob("version_*")
    events = EventAccumulator(str(log_dir))
    events.Reload()
    # validation after optimizer step n is logged at step n - 1; the first is before training
    return [(e.step + (e.step > 0), e.value) for e in events.Scalars("val/accuracy")]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    parser.add_argument("--steps", type=int, default=80)
    parser.add_argument("--val-every", type=int, default=16)
    parser.add_argument("--threshold", type=float, default=0.70)
    parser.add_argument("--lr", type=float, default=5e-5, help="8 updates per round: a quarter of the quickstart's rate")
    parser.add_argument("--out", default="benchmarks/performance/batching.png")
    args = parser.parse_args()
    curves: dict[str, list[list[tuple[int, float]]]] = {}
    with tempfile.TemporaryDirectory() as save_dir:
        for plan in PLANS:
            curves[plan] = [run(plan, seed, args.steps, args.val_every, args.lr, save_dir) for seed in args.seeds]
            print(f"ran {plan}: {[round(c[-1][1], 3) for c in curves[plan]]}", flush=True)

    Path(args.out).with_suffix(".json").write_text(json.dumps(curves, indent=1))
    print(f"\n{len(args.seeds)} seeds, {args.steps} optimizer steps, lr {args.lr}, mu = 2, 4 mini-batches per round; "
          f"val/accuracy = mean reward of 4 samples per held-out problem (200 problems)\n")
    print(f"{'plan':<18}{'start':>8}{'final (mean +- std)':>22}   steps to {args.threshold} per seed")
    for plan, runs in curves.items():
        finals = [c[-1][1] for c in runs]
        reached = [next((step for step, value in c if value >= args.threshold), None) for c in runs]
        start = statistics.mean(c[0][1] for c in runs)
        print(f"{plan:<18}{start:>8.3f}{statistics.mean(finals):>14.3f} +- {statistics.stdev(finals):.3f}   "
              f"{', '.join('-' if r is None else str(r) for r in reached)}")

    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    figure, axis = plt.subplots(figsize=(7, 4))
    for (plan, runs), colour in zip(curves.items(), ["tab:red", "tab:blue", "tab:green"]):
        for index, curve in enumerate(runs):
            steps, values = zip(*curve)
            axis.plot(steps, values, color=colour, alpha=0.8, label=plan if index == 0 else None)
    axis.axhline(args.threshold, color="grey", linestyle=":", linewidth=1)
    axis.set_xlabel("optimizer step")
    axis.set_ylabel("held-out accuracy (sampled)")
    axis.set_title("Mini-batch plans, mu = 2, 4 mini-batches per round")
    axis.legend()
    figure.tight_layout()
    figure.savefig(args.out, dpi=120)
    print(f"\nplot: {args.out}; curves: {Path(args.out).with_suffix('.json')}")


if __name__ == "__main__":
    main()
