"""E8's warm start: the supervised scaffold recipe cut short, so that the scaffold is not yet saturated.

    python benchmarks/study/scaffold_warmstart.py --steps 60 100 150    # trains what is missing, measures each
    python benchmarks/study/scaffold_warmstart.py --steps 100 --scaffold 24 --spread 8

Each warm start is ``lit-cancel fit --config configs/sft-scaffold.yaml`` with ``max_steps`` (and the
one-cycle schedule's ``total_steps``) set to N, saved to ``benchmarks/study/results/E8/warmstart-N/``
(not in git: the command regenerates it). For each it measures, on the first 50 held-out problems
of the RL setting, the mean probability of the scaffold's tokens (teacher-forced after the prompt),
the mean of each problem's least sure scaffold token, and over 8 samples per problem the sampled
accuracy and the share of samples that write the scaffold exactly. The table goes to
``benchmarks/study/results/E8/warmstart.json``. (The shipped ``embedded:tiny-scaffold`` is 400 steps.)
"""

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

import torch
from lab.parts import scaffold_probabilities

ROOT = Path(__file__).resolve().parents[2]
E8 = Path(__file__).resolve().parent / "results" / "E8"


def warmstart_dir(steps: int) -> Path:
    return E8 / f"warmstart-{steps}"


def train(steps: int) -> None:
    with tempfile.TemporaryDirectory() as save_dir:
        subprocess.run([
            "lit-cancel", "fit", "--config", "configs/sft-scaffold.yaml", f"--trainer.max_steps={steps}",
            f"--trainer.val_check_interval={steps}", f"--model.init_args.lr_scheduler.init_args.total_steps={steps}",
            f"--model.init_args.output_dir={warmstart_dir(steps)}", f"--trainer.logger.init_args.save_dir={save_dir}",
            "--trainer.enable_progress_bar=false", "--model.init_args.val_samples=1",
        ], cwd=ROOT, check=True, stdout=subprocess.DEVNULL)


@torch.no_grad()
def measure(model_path: str, scaffold: int, spread: int, problems: int = 50, samples: int = 8, seed: int = 0) -> dict[str, float]:
    from lit_cancel import RLModule, ScaffoldedAdditionTask
    from lit_cancel.tasks import SCAFFOLD_TEXT

    torch.manual_seed(seed)
    module = RLModule(model_path=model_path, max_new_tokens=96).eval()
    task = ScaffoldedAdditionTask(scaffold=scaffold, spread=spread, num_digits=3, train_size=20000, val_size=200, seed=0)
    records = task.val_records()[:problems]
    text = SCAFFOLD_TEXT[:scaffold]
    probabilities = scaffold_probabilities(module, [r["prompt"] for r in records], text)
    prompt = module.tokenizer([r["prompt"] for r in records], return_tensors="pt", padding=True, add_special_tokens=False)
    generation = module.rollout(prompt["input_ids"], prompt["attention_mask"], num_samples=samples)
    rewards = [task.reward(records[i // samples], completion) for i, completion in enumerate(generation.texts)]
    return {
        "scaffold_p": round(float(probabilities.mean()), 4),
        "scaffold_p_min": round(float(probabilities.min(1).values.mean()), 4),
        "sampled_accuracy": round(sum(r > 0 for r in rewards) / len(rewards), 4),
        "scaffold_exact": round(sum(t.startswith(text) for t in generation.texts) / len(generation.texts), 4),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, nargs="+", default=[100])
    parser.add_argument("--scaffold", type=int, default=24)
    parser.add_argument("--spread", type=int, default=8)
    args = parser.parse_args()
    table_path = E8 / "warmstart.json"
    table = json.loads(table_path.read_text()) if table_path.exists() else {}
    print(f"{'warm start':<22} {'scaffold p':>10} {'least sure':>10} {'accuracy':>9} {'exact scaffold':>15}")
    for steps in [400, *args.steps]:
        model_path = "embedded:tiny-scaffold" if steps == 400 else str(warmstart_dir(steps))
        if steps != 400 and not warmstart_dir(steps).exists():
            train(steps)
        row = measure(model_path, args.scaffold, args.spread)
        table[f"{steps}-s{args.scaffold}v{args.spread}"] = row
        print(f"{steps:>4} steps, s{args.scaffold}v{args.spread:<8} {row['scaffold_p']:>10.3f} {row['scaffold_p_min']:>10.3f} "
              f"{row['sampled_accuracy']:>9.3f} {row['scaffold_exact']:>15.3f}", flush=True)
    E8.mkdir(parents=True, exist_ok=True)
    table_path.write_text(json.dumps(table, indent=1))


if __name__ == "__main__":
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    sys.exit(main())
