"""Where the time of one lit_cancel GRPO step goes, on the work of ``benchmarks/performance/vs_trl.py``.

    python benchmarks/performance/profile_step.py [--row small] [--steps 10] [--decode-loop true|false] [--max-tokens-per-chunk N]
                                      [--compile] [--pack-sequences] [--threads N]

Wraps the module's parts with timers inside a normal ``Trainer.fit`` and prints the median
milliseconds per step of each: rollout prefill and decode (model forwards over whole prompts, and
everything else in sampling), reward, advantages, old/reference log-probs, the training forward
(``training_step``), backward, optimizer (clipping, step, zero_grad) and the rest (Lightning,
batching, logging). ``--decode-loop false`` samples with Hugging Face ``generate`` instead. Where the training step
sends each chunk's gradient back as its forward ends (``RLModule.sends_chunks_back``), "training forward" holds the
backward of every chunk but the last, and "backward" that last chunk's.
"""

import argparse
import resource
import statistics
import tempfile
import time
from collections import defaultdict
from dataclasses import dataclass
from pathlib import Path

import torch
from lightning.pytorch.callbacks import Callback
from vs_trl import ROWS, Row, fit_lit_cancel, lit_cancel_module, write_model  # benchmarks/ is on the path when run as a script

import lit_cancel.rounds.score
from lit_cancel import DecodeLoop, HFGenerate

PARTS = ["prefill", "decode", "reward", "advantages", "old/ref log-probs", "training forward", "backward", "optimizer", "other"]


@dataclass(frozen=True)
class RoundShape:
    """A round's rows: each one's prompt tokens and completion tokens (EOS included), and how many prompts were
    prefilled (once per prompt, before its group's rows are copied from it)."""

    prompt_tokens: list[int]
    completion_tokens: list[int]
    prompts: int


class Stopwatch:
    """Seconds per part, accumulated over the current step."""

    def __init__(self):
        self.current: dict[str, float] = defaultdict(float)
        self.steps: list[dict[str, float]] = []
        self.rounds: list[RoundShape] = []

    def timed(self, part: str, fn):
        def wrapper(*args, **kwargs):
            started = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                self.current[part] += time.perf_counter() - started
        return wrapper


class StepParts(Callback):
    """Times backward and optimizer with Lightning's hooks, and closes each step's record."""

    def __init__(self, watch: Stopwatch):
        self.watch, self.last_end, self.mark = watch, None, 0.0

    def on_before_backward(self, trainer, pl_module, loss):
        self.mark = time.perf_counter()

    def on_after_backward(self, trainer, pl_module):
        self.watch.current["backward"] += time.perf_counter() - self.mark

    def on_before_optimizer_step(self, trainer, pl_module, optimizer):
        self.mark = time.perf_counter()

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        now = time.perf_counter()
        self.watch.current["optimizer"] += now - self.mark
        if self.last_end is not None:
            parts = dict(self.watch.current)
            parts["decode"] = parts.get("rollout", 0.0) - parts.get("prefill", 0.0)
            parts["total"] = now - self.last_end
            parts["other"] = parts["total"] - sum(parts.get(p, 0.0) for p in PARTS[:-1])
            self.watch.steps.append(parts)
            prompt_tokens = batch.attention_mask[:, :batch.prompt_length].sum(1)
            self.watch.rounds.append(RoundShape(prompt_tokens.tolist(), batch.completion_mask.sum(1).tolist(),
                                                len(batch.group_ids.unique())))
        self.watch.current = defaultdict(float)
        self.last_end = now


@dataclass
class Profiled:
    """A profiled run: the parameter count, the module, and each timed step's seconds by part (``"total"`` the whole
    step) and the shape of the round it trained on."""

    params: int
    module: object
    steps: list[dict[str, float]]
    rounds: list[RoundShape]


def profile(scratch: str, row: Row, steps: int, warmup: int, **options) -> Profiled:
    """Fits ``row``'s model (saved to ``scratch``) for ``warmup + steps`` timed steps with each part of the module timed;
    ``options`` go to the module (:func:`lit_cancel_module`). The warm-up steps are dropped."""
    watch = Stopwatch()
    params = write_model(Path(scratch), row)
    module = lit_cancel_module(scratch, row, **options)
    model = module.policy.model
    in_rollout = []

    def prefill_start(_, args, kwargs):
        ids = kwargs.get("input_ids", args[0] if args else None)
        in_rollout.append(time.perf_counter() if in_rollout_flag and ids is not None and ids.shape[1] > 1 else None)

    def prefill_end(*_):
        started = in_rollout.pop()
        if started is not None:
            watch.current["prefill"] += time.perf_counter() - started

    in_rollout_flag = False
    rollout = module.rollout

    def flagged_rollout(*a, **k):
        nonlocal in_rollout_flag
        in_rollout_flag = True
        try:
            return rollout(*a, **k)
        finally:
            in_rollout_flag = False

    model.register_forward_pre_hook(prefill_start, with_kwargs=True)
    model.register_forward_hook(prefill_end)
    module.rollout = watch.timed("rollout", flagged_rollout)
    module.score_rollouts = watch.timed("old/ref log-probs", module.score_rollouts)
    module.training_step = watch.timed("training forward", module.training_step)
    module.objective.advantages = watch.timed("advantages", module.objective.advantages)
    lit_cancel.rounds.score.score = watch.timed("reward", lit_cancel.rounds.score.score)
    fit_lit_cancel(module, scratch, row, steps + warmup + 1, [StepParts(watch)])
    return Profiled(params, module, watch.steps[warmup:], watch.rounds[warmup:])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--row", default="small", choices=list(ROWS))
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--decode-loop", default="true", choices=["true", "false"])
    parser.add_argument("--max-tokens-per-chunk", type=int, help="the module's max_tokens_per_chunk (default: the module's; 0: None)")
    parser.add_argument("--compile", action="store_true", help="RLModule(compile=True): the decoder through torch.compile")
    parser.add_argument("--pack-sequences", action="store_true", help="RLModule(pack_sequences=True): packed log-prob chunks")
    parser.add_argument("--threads", type=int, help="torch threads (default: torch's choice)")
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    row = ROWS[args.row]
    with tempfile.TemporaryDirectory() as scratch:
        run = profile(
            scratch, row, args.steps, args.warmup, engine=DecodeLoop() if args.decode_loop == "true" else HFGenerate(),
            compile=args.compile, pack_sequences=args.pack_sequences,
            **({} if args.max_tokens_per_chunk is None else {"max_tokens_per_chunk": args.max_tokens_per_chunk or None}),
        )
    steps, module = run.steps, run.module
    total = statistics.median(s["total"] for s in steps)
    sampler = "decode loop" if args.decode_loop == "true" else "HF generate"
    print(f"{run.params / 1e6:.1f} M params, {'EOS or ' if row.eos else ''}{row.new_tokens} tokens, {'bf16' if row.bf16 else 'fp32'}, "
          f"checkpointing {'on' if row.checkpointing else 'off'}, {sampler}, max_tokens_per_chunk {module.max_tokens_per_chunk}"
          f"{', compiled' if args.compile else ''}{', packed' if args.pack_sequences else ''}: "
          f"median of {len(steps)} steps, {total * 1000:.0f} ms per step, {torch.get_num_threads()} threads, "
          f"peak RSS {resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024:,.0f} MiB\n")
    print("| part | ms per step | share |")
    print("|---|---|---|")
    for part in PARTS:
        ms = statistics.median(s.get(part, 0.0) for s in steps) * 1000
        print(f"| {part} | {ms:.0f} | {ms / total / 10:.0f}% |")


if __name__ == "__main__":
    main()
