"""lit_cancel against TRL's GRPOTrainer on identical work: seconds per optimizer step and peak memory.

    pip install -e ".[bench]"        # installs trl
    python benchmarks/performance/vs_trl.py [--rows small,large,large-ckpt] [--steps 10] [--warmup 2] [--threads N]
    python benchmarks/performance/vs_trl.py --realistic   # EOS on: rows real-small-fp32, real-small-bf16, real-large-fp32/bf16
    python benchmarks/performance/vs_trl.py --sweep --steps 3 --warmup 1   # completion limits 128 to 2,048 tokens, two regimes

Each framework trains in its own process (its peak resident memory is that process's), one after
the other, on the same work, and the table gives lit_cancel's wall time per step as a share of TRL's.
Matched settings, both sides:

* the same randomly initialised Qwen2 (saved once, loaded by both) and the character tokenizer, CPU;
* float32 weights; the ``bf16`` rows train in bf16 autocast (TRL ``bf16=True``, lit_cancel ``precision="bf16-mixed"``),
  rollouts included, the others in float32;
* 8 prompts x 8 rollouts per step (group size 8), one rollout round per optimizer step, one update per round
  (TRL ``num_iterations=1``, ``steps_per_generation=1``; lit_cancel ``mini_batches_per_round=1``, ``epochs_per_round=1``);
* fixed-length rows: exactly ``C`` new tokens per rollout, EOS suppressed with ``generation_kwargs={"suppress_tokens": [EOS]}``;
  realistic rows (``real-...``): rollouts stop at EOS or after ``C`` tokens. The random model's 99-token vocabulary
  makes EOS a roughly geometric stop, so completion lengths have a long tail, as real ones do;
* sampling at temperature 1, ``top_p=1``, ``top_k=0``; TRL samples with Hugging Face ``generate``, lit_cancel with
  its decode loop (no vLLM on either side);
* the GRPO objective: TRL ``loss_type="grpo"`` (per-sequence token mean), ``scale_rewards="group"``,
  ``epsilon=0.2``, ``beta=0``; lit_cancel ``GRPO()`` (the same terms, no reference model);
* the same prompts (3-digit additions) and reward (``AdditionTask.reward``);
* AdamW, lr 1e-6, no weight decay, gradient norm clipped at 1.0 (TRL's default ``max_grad_norm``);
* activation checkpointing as the row says (TRL's ``GRPOConfig`` turns it on by default, lit_cancel off);
* the length sweep (``--sweep``): the 0.8 M model with checkpointing on (lit_cancel ``activation_checkpointing: chunks``),
  limits of 128 to 2,048 new tokens, each with lengths that vary (EOS's logit set for a mean length of 0.45 of the limit,
  about a fifth reaching it) and with every completion running to the limit (EOS suppressed);
* ``real-small-fp32-compiled`` (not in ``--realistic``): lit_cancel's decoder through ``torch.compile``
  (``RLModule(compile=True)``, opt-in), TRL as in ``real-small-fp32``; the warm-up steps hold the compilations.

Steps are timed from one optimizer step's end to the next (rollouts, rewards, training, optimizer
and framework overhead all included); the first ``--warmup`` steps are not counted. Each side records
the length of every completion of the timed steps (EOS included): the table gives its mean with a 95%
interval, and says when the two means differ by more than their noise.
"""

import argparse
import json
import math
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

import torch
from transformers import Qwen2Config, Qwen2ForCausalLM

from lit_cancel.tasks import AdditionTask
from lit_cancel.tokenizer import build_char_tokenizer


@dataclass(frozen=True)
class Row:
    hidden: int
    blocks: int
    mlp: int
    heads: int
    new_tokens: int
    checkpointing: bool | str  # TRL's gradient checkpointing on or off; a string: lit_cancel's activation_checkpointing mode
    eos: bool = False
    bf16: bool = False
    compiled: bool = False  # lit_cancel's RLModule(compile=True); TRL as in the row without it
    # EOS on, its logit set so that completions are on average this share of new_tokens long
    mean_share: float | None = None


SMALL, LARGE = (128, 3, 512, 4), (512, 8, 1280, 8)
ROWS = {
    "small": Row(*SMALL, 48, False),
    "small-ckpt": Row(*SMALL, 48, True),
    "large": Row(*LARGE, 128, False),
    "large-ckpt": Row(*LARGE, 128, True),
    "real-small-fp32": Row(*SMALL, 128, False, eos=True),
    "real-small-bf16": Row(*SMALL, 128, False, eos=True, bf16=True),
    "real-large-fp32": Row(*LARGE, 256, True, eos=True),
    "real-large-bf16": Row(*LARGE, 256, True, eos=True, bf16=True),
    "real-small-fp32-compiled": Row(*SMALL, 128, False, eos=True, compiled=True),
}
REALISTIC = [name for name, row in ROWS.items() if row.eos and not row.compiled]
# the length sweep: the small model, checkpointing on (TRL's default; lit_cancel by chunk, which keeps the least for a
# model of 3 blocks: docs/gpu.md), each limit in two regimes: lengths that vary
# (EOS's logit set for a mean length of 0.45 of the limit: a nearly geometric stop, about a fifth of completions reach it)
# and completions that all run to the limit (EOS suppressed)
SWEEP_LENGTHS = (128, 256, 512, 1024, 2048)
SWEEP = {}
for length in SWEEP_LENGTHS:
    SWEEP[f"varying-{length}"] = Row(*SMALL, length, "chunks", eos=True, mean_share=0.45)
    SWEEP[f"to-limit-{length}"] = Row(*SMALL, length, "chunks")
ROWS |= SWEEP
PROMPTS, GROUP, LR, SEED = 8, 8, 1e-6, 0


def write_model(folder: Path, row: Row) -> int:
    """Saves a random Qwen2 and the character tokenizer to ``folder``; returns the parameter count."""
    tokenizer = build_char_tokenizer()
    config = Qwen2Config(
        vocab_size=len(tokenizer), hidden_size=row.hidden, intermediate_size=row.mlp, num_hidden_layers=row.blocks,
        num_attention_heads=row.heads, num_key_value_heads=row.heads, max_position_embeddings=4096, tie_word_embeddings=True,
        eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id,
    )
    torch.manual_seed(SEED)
    model = Qwen2ForCausalLM(config)
    if row.mean_share is not None:
        set_mean_length(model, tokenizer, row.new_tokens, row.mean_share * row.new_tokens)
    model.save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    return sum(p.numel() for p in model.parameters())


@torch.no_grad()
def set_mean_length(model: Qwen2ForCausalLM, tokenizer, limit: int, mean_length: float) -> None:
    """Points the (tied) embedding of EOS along the mean final hidden state, scaled so that completions of up to ``limit``
    tokens sampled at T = 1 are ``mean_length`` long on average, EOS included.

    EOS never precedes another token, so its embedding changes no context that a completion's next token is drawn
    in: one batch sampled with EOS suppressed holds the contexts, and each row's expected length
    ``sum_t prod_{s<t} (1 - p_s)`` follows from EOS's probability ``p_s`` at its positions, for any scale.
    """
    from lit_cancel.engines.decode_loop import logits_processors, sample_completions
    from lit_cancel.logprobs import position_ids_from_mask

    eos = tokenizer.eos_token_id
    prompts = tokenizer([r["prompt"] for r in AdditionTask(num_digits=3).train_records()[:PROMPTS]], return_tensors="pt", padding=True)
    torch.manual_seed(SEED)
    sequences = sample_completions(
        model, prompts["input_ids"], prompts["attention_mask"], GROUP, limit, [], tokenizer.pad_token_id,
        logits_processors({"suppress_tokens": [eos]}, 1.0, 1.0, greedy=False),
    )
    prompt_length = prompts["input_ids"].shape[1]
    mask = torch.cat([prompts["attention_mask"].repeat_interleave(GROUP, 0), torch.ones_like(sequences[:, prompt_length:])], 1)
    hidden = model.model(
        input_ids=sequences, attention_mask=mask, position_ids=position_ids_from_mask(mask),
    ).last_hidden_state[:, prompt_length - 1 : -1]
    weights = model.get_output_embeddings().weight
    others = torch.logsumexp(hidden @ torch.cat([weights[:eos], weights[eos + 1 :]]).T, dim=-1)
    direction = hidden.flatten(0, 1).mean(0)
    along = hidden @ (direction / direction.norm())

    def expected_length(scale: float) -> float:
        stop = torch.sigmoid(scale * along - others)  # EOS's probability at each position
        survival = torch.cumprod(1 - stop, dim=1)
        return (1 + survival[:, :-1].sum(1)).mean().item()

    low, high = -100.0, 100.0  # the expected length falls as the scale grows
    for _ in range(60):
        middle = (low + high) / 2
        low, high = (middle, high) if expected_length(middle) > mean_length else (low, middle)
    weights[eos] = (low + high) / 2 * direction / direction.norm()


def generation_kwargs(row: Row) -> dict:
    return {} if row.eos else {"suppress_tokens": [build_char_tokenizer().eos_token_id]}


def run_trl(folder: str, row: Row, steps: int) -> tuple[list[float], list[list[int]]]:
    from datasets import Dataset
    from transformers import TrainerCallback
    from trl import GRPOConfig, GRPOTrainer

    task = AdditionTask(num_digits=3)
    records = task.train_records()
    dataset = Dataset.from_list([{"prompt": r["prompt"], "answer": r["answer"]} for r in records])
    ends, lengths = [], []

    def reward(completions, answer, completion_ids, **kwargs):
        lengths.append([len(ids) for ids in completion_ids])  # the closing EOS included
        return [task.reward({"answer": a}, c) for a, c in zip(answer, completions)]

    class StepEnds(TrainerCallback):
        def on_step_end(self, args, state, control, **kwargs):
            ends.append(time.perf_counter())

    config = GRPOConfig(
        output_dir=str(Path(folder) / "trl"), max_steps=steps, per_device_train_batch_size=PROMPTS * GROUP,
        num_generations=GROUP, max_completion_length=row.new_tokens, temperature=1.0, top_p=1.0, top_k=0,
        generation_kwargs=generation_kwargs(row), loss_type="grpo", scale_rewards="group",
        epsilon=0.2, beta=0.0, num_iterations=1, learning_rate=LR, weight_decay=0.0, max_grad_norm=1.0,
        gradient_checkpointing=bool(row.checkpointing), use_cpu=True, bf16=row.bf16, report_to="none", save_strategy="no",
        seed=SEED, logging_steps=1, dataloader_num_workers=0,
    )
    trainer = GRPOTrainer(model=folder, reward_funcs=reward, args=config, train_dataset=dataset,
                          processing_class=build_char_tokenizer(), callbacks=[StepEnds()])
    trainer.train()
    return ends, lengths


def lit_cancel_module(folder: str, row: Row, **options):
    """The ``RLModule`` of a row: GRPO, sampling at T = 1, AdamW without weight decay; ``options`` override."""
    from lit_cancel import GRPO, RLModule

    settings = dict(
        objective=GRPO(clip_eps=0.2), temperature=1.0, top_p=1.0, max_new_tokens=row.new_tokens,
        activation_checkpointing=row.checkpointing, generation_kwargs=generation_kwargs(row), compile=row.compiled,
        optimizer=lambda params: torch.optim.AdamW(params, lr=LR, weight_decay=0.0),
    )
    return RLModule(folder, **{**settings, **options})


def fit_lit_cancel(module, folder: str, row: Row, steps: int, callbacks: list) -> None:
    """``Trainer.fit`` of ``module`` on the row's prompts for ``steps`` optimizer steps, in the row's precision."""
    import lightning as L

    from lit_cancel import RolloutDataModule

    data = RolloutDataModule(AdditionTask(num_digits=3), prompts_per_round=PROMPTS, group_size=GROUP, seed=SEED)
    trainer = L.Trainer(
        max_steps=steps, accelerator="cpu", precision="bf16-mixed" if row.bf16 else "32-true", logger=False,
        enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False, limit_val_batches=0,
        num_sanity_val_steps=0, gradient_clip_val=1.0, callbacks=callbacks, default_root_dir=folder,
    )
    trainer.fit(module, data)


def run_lit_cancel(folder: str, row: Row, steps: int) -> tuple[list[float], list[list[int]]]:
    from lightning.pytorch.callbacks import Callback

    ends, lengths = [], []

    class StepEnds(Callback):
        def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
            ends.append(time.perf_counter())
            lengths.append(batch.completion_mask.sum(1).tolist())

    fit_lit_cancel(lit_cancel_module(folder, row), folder, row, steps, [StepEnds()])
    return ends, lengths


def child(framework: str, folder: str, row: str, steps: int, threads: int | None) -> None:
    if threads:
        torch.set_num_threads(threads)
    ends, lengths = (run_trl if framework == "trl" else run_lit_cancel)(folder, ROWS[row], steps)
    peak_mib = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    print("RESULT " + json.dumps({"ends": ends, "lengths": lengths, "peak_mib": peak_mib}))


@dataclass
class Measured:
    seconds: float  # median per step
    peak_mib: float
    lengths: list[int]  # every completion of the timed steps

    @property
    def mean_length(self) -> float:
        return statistics.fmean(self.lengths)

    @property
    def length_se(self) -> float:
        return statistics.stdev(self.lengths) / math.sqrt(len(self.lengths))

    def limit_share(self, limit: int) -> float:
        """The share of completions that reached ``limit`` tokens (cut there, or ending at EOS exactly there)."""
        return sum(n >= limit for n in self.lengths) / len(self.lengths)

    @property
    def tokens_per_s(self) -> float:
        return self.mean_length * PROMPTS * GROUP / self.seconds


def measure(framework: str, folder: str, row: str, args: argparse.Namespace) -> Measured:
    """One framework in a fresh process: the median seconds per step after the warm-up, peak RSS and completion lengths."""
    command = [sys.executable, __file__, "--child", framework, "--folder", folder, "--row", row,
               "--steps", str(args.steps + args.warmup + 1)]
    command += ["--threads", str(args.threads)] if args.threads else []
    done = subprocess.run(command, capture_output=True, text=True)
    lines = [line for line in done.stdout.splitlines() if line.startswith("RESULT ")]
    if done.returncode or not lines:
        raise RuntimeError(f"{framework} run failed:\n{done.stderr[-3000:]}")
    result = json.loads(lines[-1][len("RESULT "):])
    intervals = [b - a for a, b in zip(result["ends"], result["ends"][1:])][args.warmup:]
    # step k's lengths are those of the rollouts it trained on; the timed intervals end at steps warmup+1 ...
    timed = result["lengths"][args.warmup + 1 : args.warmup + 1 + len(intervals)]
    return Measured(statistics.median(intervals), result["peak_mib"], [n for step in timed for n in step])


def length_cell(m: Measured) -> str:
    return f"{m.mean_length:.1f} ± {1.96 * m.length_se:.1f}"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rows", default="small,large,large-ckpt", help=f"comma-separated, of {', '.join(ROWS)}")
    parser.add_argument("--realistic", action="store_true", help=f"the rows {', '.join(REALISTIC)} (EOS on)")
    parser.add_argument("--sweep", action="store_true",
                        help=f"the length sweep: {', '.join(map(str, SWEEP_LENGTHS))} tokens, lengths varying and running to the limit")
    parser.add_argument("--steps", type=int, default=10, help="timed steps per framework (median)")
    parser.add_argument("--warmup", type=int, default=2, help="steps not timed")
    parser.add_argument("--threads", type=int, help="torch threads in each run (default: torch's choice)")
    parser.add_argument("--child", choices=["trl", "lit_cancel"], help=argparse.SUPPRESS)
    parser.add_argument("--folder", help=argparse.SUPPRESS)
    parser.add_argument("--row", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        child(args.child, args.folder, args.row, args.steps, args.threads)
        return
    try:
        import trl
    except ImportError:
        print("benchmarks/performance/vs_trl.py compares with TRL, which is not installed: pip install -e \".[bench]\"")
        return
    rows = REALISTIC if args.realistic else list(SWEEP) if args.sweep else args.rows.split(",")
    unknown = [row for row in rows if row not in ROWS]
    if unknown:
        parser.error(f"--rows: unknown {unknown}; choose from {list(ROWS)}")
    print(f"TRL {trl.__version__} GRPOTrainer vs lit_cancel, CPU, {args.threads or torch.get_num_threads()} threads; {PROMPTS} prompts x "
          f"{GROUP} rollouts per step, T=1, top_p=1, top_k=0, GRPO (TRL loss_type=grpo, scale_rewards=group, "
          f"epsilon=0.2), beta=0, one update per round, AdamW lr {LR:g}, grad-norm clip 1.0; median of {args.steps} steps "
          f"after {args.warmup} warm-up; completion length: mean ± 95% interval, EOS included\n")
    print("| work per step | TRL s/step | lit_cancel s/step | ratio | TRL tokens/s | lit_cancel tokens/s "
          "| TRL length | lit_cancel length | reached the limit (TRL / lit_cancel) | TRL peak RSS | lit_cancel peak RSS |")
    print("|---|---|---|---|---|---|---|---|---|---|---|")
    for name in rows:
        row = ROWS[name]
        with tempfile.TemporaryDirectory() as scratch:
            params = write_model(Path(scratch), row)
            trl_run, lit_run = measure("trl", scratch, name, args), measure("lit_cancel", scratch, name, args)
        stop = (f"EOS (mean {row.mean_share:g} of the limit) or " if row.mean_share else "EOS or ") if row.eos else "exactly "
        label = (f"{params / 1e6:.1f} M params, {stop}{row.new_tokens} tokens, {'bf16' if row.bf16 else 'fp32'}, "
                 f"checkpointing {'on' if row.checkpointing else 'off'}"
                 f"{f' (lit_cancel by {row.checkpointing})' if isinstance(row.checkpointing, str) else ''}"
                 f"{', lit_cancel compiled' if row.compiled else ''}")
        differ = abs(trl_run.mean_length - lit_run.mean_length) > 1.96 * math.hypot(trl_run.length_se, lit_run.length_se)
        print(f"| {label} | {trl_run.seconds:.3f} | {lit_run.seconds:.3f} | {lit_run.seconds / trl_run.seconds:.2f}x "
              f"| {trl_run.tokens_per_s:,.0f} | {lit_run.tokens_per_s:,.0f} | {length_cell(trl_run)} | {length_cell(lit_run)}"
              f"{' (lengths differ)' if differ else ''} "
              f"| {trl_run.limit_share(row.new_tokens):.0%} / {lit_run.limit_share(row.new_tokens):.0%} "
              f"| {trl_run.peak_mib:,.0f} MiB | {lit_run.peak_mib:,.0f} MiB |", flush=True)


if __name__ == "__main__":
    main()
