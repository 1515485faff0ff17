"""lit_cancel against TRL's GRPOTrainer on identical work: seconds per optimizer step and peak memory.

    pip install -e ".[bench]"        # installs trl
    python benchmarks/vs_trl.py [--rows small,large,large-ckpt] [--steps 10] [--warmup 2] [--threads N]

Each framework trains in its own process (its peak resident memory is that process's), one after
the other, on the same work, and the table gives lit_cancel's wall time per step as a share of TRL's.
Matched settings, both sides:

* the same randomly initialised Qwen2 (saved once, loaded by both) and the character tokenizer, float32, CPU;
* 8 prompts x 8 rollouts per step (group size 8), one rollout round per optimizer step, one update per round
  (TRL ``num_iterations=1``, ``steps_per_generation=1``; lit_cancel ``mini_batches_per_round=1``, ``epochs_per_round=1``);
* exactly ``C`` new tokens per rollout: EOS suppressed with ``generation_kwargs={"suppress_tokens": [EOS]}``;
* sampling at temperature 1, ``top_p=1``, ``top_k=0``; TRL samples with Hugging Face ``generate`` (no vLLM);
* the GRPO objective: TRL ``loss_type="grpo"`` (per-sequence token mean), ``scale_rewards="group"``,
  ``epsilon=0.2``, ``beta=0``; lit_cancel ``GRPO()`` (the same terms, no reference model);
* the same prompts (3-digit additions) and reward (``AdditionTask.reward``);
* AdamW, lr 1e-6, no weight decay, gradient norm clipped at 1.0 (TRL's default ``max_grad_norm``);
* activation checkpointing as the row says (TRL's ``GRPOConfig`` turns it on by default, lit_cancel off).

Steps are timed from one optimizer step's end to the next (rollouts, rewards, training, optimizer
and framework overhead all included); the first ``--warmup`` steps are not counted.
"""

import argparse
import json
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch
from transformers import Qwen2Config, Qwen2ForCausalLM

from lit_cancel.tasks import AdditionTask
from lit_cancel.tokenizer import build_char_tokenizer

# name: (hidden, blocks, MLP width, heads, new tokens per rollout, activation checkpointing on both sides)
ROWS = {
    "small": (128, 3, 512, 4, 48, False),
    "small-ckpt": (128, 3, 512, 4, 48, True),
    "large": (512, 8, 1280, 8, 128, False),
    "large-ckpt": (512, 8, 1280, 8, 128, True),
}
PROMPTS, GROUP, LR, SEED = 8, 8, 1e-6, 0


def write_model(folder: Path, hidden: int, blocks: int, mlp: int, heads: int) -> int:
    """Saves a random Qwen2 and the character tokenizer to ``folder``; returns the parameter count."""
    tokenizer = build_char_tokenizer()
    config = Qwen2Config(
        vocab_size=len(tokenizer), hidden_size=hidden, intermediate_size=mlp, num_hidden_layers=blocks,
        num_attention_heads=heads, num_key_value_heads=heads, max_position_embeddings=512, tie_word_embeddings=True,
        eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id,
    )
    torch.manual_seed(SEED)
    model = Qwen2ForCausalLM(config)
    model.save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    return sum(p.numel() for p in model.parameters())


def run_trl(folder: str, new_tokens: int, checkpointing: bool, steps: int) -> list[float]:
    from datasets import Dataset
    from transformers import TrainerCallback
    from trl import GRPOConfig, GRPOTrainer

    task = AdditionTask(num_digits=3)
    records = task.train_records()
    dataset = Dataset.from_list([{"prompt": r["prompt"], "answer": r["answer"]} for r in records])

    def reward(completions, answer, **kwargs):
        return [task.reward({"answer": a}, c) for a, c in zip(answer, completions)]

    ends = []

    class StepEnds(TrainerCallback):
        def on_step_end(self, args, state, control, **kwargs):
            ends.append(time.perf_counter())

    tokenizer = build_char_tokenizer()
    config = GRPOConfig(
        output_dir=str(Path(folder) / "trl"), max_steps=steps, per_device_train_batch_size=PROMPTS * GROUP,
        num_generations=GROUP, max_completion_length=new_tokens, temperature=1.0, top_p=1.0, top_k=0,
        generation_kwargs={"suppress_tokens": [tokenizer.eos_token_id]}, loss_type="grpo", scale_rewards="group",
        epsilon=0.2, beta=0.0, num_iterations=1, learning_rate=LR, weight_decay=0.0, max_grad_norm=1.0,
        gradient_checkpointing=checkpointing, use_cpu=True, bf16=False, report_to="none", save_strategy="no",
        seed=SEED, logging_steps=1, dataloader_num_workers=0,
    )
    trainer = GRPOTrainer(model=folder, reward_funcs=reward, args=config, train_dataset=dataset,
                          processing_class=tokenizer, callbacks=[StepEnds()])
    trainer.train()
    return ends


def run_lit_cancel(folder: str, new_tokens: int, checkpointing: bool, steps: int) -> list[float]:
    import lightning as L
    from lightning.pytorch.callbacks import Callback

    from lit_cancel import GRPO, RLModule, RolloutDataModule

    ends = []

    class StepEnds(Callback):
        def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
            ends.append(time.perf_counter())

    tokenizer = build_char_tokenizer()
    module = RLModule(
        folder, objective=GRPO(clip_eps=0.2), temperature=1.0, top_p=1.0, max_new_tokens=new_tokens,
        activation_checkpointing=checkpointing, generation_kwargs={"suppress_tokens": [tokenizer.eos_token_id]},
        optimizer=lambda params: torch.optim.AdamW(params, lr=LR, weight_decay=0.0),
    )
    data = RolloutDataModule(AdditionTask(num_digits=3), prompts_per_round=PROMPTS, group_size=GROUP, seed=SEED)
    trainer = L.Trainer(
        max_steps=steps, accelerator="cpu", logger=False, enable_checkpointing=False, enable_progress_bar=False,
        enable_model_summary=False, limit_val_batches=0, num_sanity_val_steps=0, gradient_clip_val=1.0,
        callbacks=[StepEnds()], default_root_dir=folder,
    )
    trainer.fit(module, data)
    return ends


def child(framework: str, folder: str, new_tokens: int, checkpointing: bool, steps: int, threads: int | None) -> None:
    if threads:
        torch.set_num_threads(threads)
    ends = (run_trl if framework == "trl" else run_lit_cancel)(folder, new_tokens, checkpointing, steps)
    peak_mib = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    print("RESULT " + json.dumps({"ends": ends, "peak_mib": peak_mib}))


def measure(framework: str, folder: str, new_tokens: int, checkpointing: bool, args: argparse.Namespace) -> tuple[float, float]:
    """Median seconds per step after the warm-up, and peak RSS in MiB, of one framework in a fresh process."""
    command = [sys.executable, __file__, "--child", framework, "--folder", folder, "--new-tokens", str(new_tokens),
               "--steps", str(args.steps + args.warmup + 1)]
    command += (["--checkpointing"] if checkpointing else []) + (["--threads", str(args.threads)] if args.threads else [])
    done = subprocess.run(command, capture_output=True, text=True)
    lines = [line for line in done.stdout.splitlines() if line.startswith("RESULT ")]
    if done.returncode or not lines:
        raise RuntimeError(f"{framework} run failed:\n{done.stderr[-3000:]}")
    result = json.loads(lines[-1][len("RESULT "):])
    intervals = [b - a for a, b in zip(result["ends"], result["ends"][1:])][args.warmup:]
    return statistics.median(intervals), result["peak_mib"]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rows", default="small,large,large-ckpt", help=f"comma-separated, of {', '.join(ROWS)}")
    parser.add_argument("--steps", type=int, default=10, help="timed steps per framework (median)")
    parser.add_argument("--warmup", type=int, default=2, help="steps not timed")
    parser.add_argument("--threads", type=int, help="torch threads in each run (default: torch's choice)")
    parser.add_argument("--child", choices=["trl", "lit_cancel"], help=argparse.SUPPRESS)
    parser.add_argument("--folder", help=argparse.SUPPRESS)
    parser.add_argument("--new-tokens", type=int, help=argparse.SUPPRESS)
    parser.add_argument("--checkpointing", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        child(args.child, args.folder, args.new_tokens, args.checkpointing, args.steps, args.threads)
        return
    try:
        import trl
    except ImportError:
        print("benchmarks/vs_trl.py compares with TRL, which is not installed: pip install -e \".[bench]\"")
        return
    rows = args.rows.split(",")
    unknown = [row for row in rows if row not in ROWS]
    if unknown:
        parser.error(f"--rows: unknown {unknown}; choose from {list(ROWS)}")
    print(f"TRL {trl.__version__} GRPOTrainer vs lit_cancel, CPU, {args.threads or torch.get_num_threads()} threads; {PROMPTS} prompts x "
          f"{GROUP} rollouts per step, EOS suppressed, T=1, top_p=1, top_k=0, GRPO (TRL loss_type=grpo, scale_rewards=group, "
          f"epsilon=0.2), beta=0, one update per round, AdamW lr {LR:g}, grad-norm clip 1.0; median of {args.steps} steps "
          f"after {args.warmup} warm-up\n")
    print("| work per step | TRL s/step | lit_cancel s/step | ratio | TRL peak RSS | lit_cancel peak RSS |")
    print("|---|---|---|---|---|---|")
    for row in rows:
        hidden, blocks, mlp, heads, new_tokens, checkpointing = ROWS[row]
        with tempfile.TemporaryDirectory() as scratch:
            params = write_model(Path(scratch), hidden, blocks, mlp, heads)
            trl_s, trl_mib = measure("trl", scratch, new_tokens, checkpointing, args)
            lit_s, lit_mib = measure("lit_cancel", scratch, new_tokens, checkpointing, args)
        label = f"{params / 1e6:.1f} M params, {new_tokens} tokens, activation checkpointing {'on' if checkpointing else 'off'}"
        print(f"| {label} | {trl_s:.3f} | {lit_s:.3f} | {lit_s / trl_s:.2f}x | {trl_mib:,.0f} MiB | {lit_mib:,.0f} MiB |", flush=True)


if __name__ == "__main__":
    main()
