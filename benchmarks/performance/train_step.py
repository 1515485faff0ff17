"""Training-step throughput, peak memory and MFU of a real-model recipe, with random weights of its architecture.

    python benchmarks/performance/train_step.py [--config configs/qwen2.5-0.5b-gsm8k.yaml] [--steps 6] [--layers 24]

Nothing is downloaded: the Qwen2.5-0.5B architecture (hidden 896, 24 blocks, 14 query and 2 key-value
heads, MLP 4864, vocabulary 151 936, tied embeddings) is written to a temporary folder with the
character tokenizer, the recipe runs with ``from_scratch: true`` on synthetic word problems, and a
callback times each micro-batch's forward and backward (rollouts excluded; they are timed by the
module as ``perf/rollout_tokens_per_s``). Model FLOPs per trained token follow the PaLM appendix:
``6 N + 12 L d T`` (N parameters, L blocks, width d, sequence length T); activation recomputation
is not counted. MFU divides by the accelerator's dense bf16 peak (``--peak-tflops``, or looked up
for H100/H200/A100). ``--layers``, ``--accelerator cpu`` and ``--precision 32-true`` shrink it to a
CPU smoke run.
"""

import argparse
import json
import statistics
import tempfile
import time
from pathlib import Path

import lightning as L
import torch

from lit_cancel.run.cli import run_cli
from lit_cancel.tokenizer import build_char_tokenizer

QWEN25_05B = {
    "architectures": ["Qwen2ForCausalLM"], "model_type": "qwen2", "hidden_size": 896, "intermediate_size": 4864,
    "num_hidden_layers": 24, "num_attention_heads": 14, "num_key_value_heads": 2, "vocab_size": 151936,
    "max_position_embeddings": 32768, "rope_theta": 1000000.0, "rms_norm_eps": 1e-6, "tie_word_embeddings": True,
    "hidden_act": "silu",
}
PEAK_BF16_TFLOPS = {"H100": 989.0, "H200": 989.0, "A100": 312.0}


class StepTimer(L.Callback):
    """Wall time and trained tokens of every micro-batch's forward and backward."""

    def __init__(self):
        self.seconds: list[float] = []
        self.tokens: list[int] = []
        self.lengths: list[int] = []
        self.started = 0.0

    def _sync(self, pl_module) -> None:
        if pl_module.device.type == "cuda":
            torch.cuda.synchronize()

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
        self._sync(pl_module)
        self.started = time.perf_counter()

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        self._sync(pl_module)
        self.seconds.append(time.perf_counter() - self.started)
        self.tokens.append(int(batch.attention_mask.sum()))
        self.lengths.append(batch.input_ids.shape[1])


def write_model(folder: Path, layers: int) -> None:
    tokenizer = build_char_tokenizer()
    config = {**QWEN25_05B, "num_hidden_layers": layers, "eos_token_id": tokenizer.eos_token_id,
              "pad_token_id": tokenizer.pad_token_id}
    (folder / "config.json").write_text(json.dumps(config))
    tokenizer.save_pretrained(folder)


def write_problems(path: Path, rows: int = 256) -> None:
    lines = [json.dumps({"question": f"What is {a} plus {3 * a + 7}?", "answer": f"#### {4 * a + 7}"}) for a in range(rows)]
    path.write_text("\n".join(lines) + "\n")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--config", default="configs/qwen2.5-0.5b-gsm8k.yaml")
    parser.add_argument("--steps", type=int, default=6, help="optimizer steps; the first is warm-up and not counted")
    parser.add_argument("--layers", type=int, default=24, help="transformer blocks (24 is the real depth)")
    parser.add_argument("--max-new-tokens", type=int, default=256)
    parser.add_argument("--accelerator", default="cuda")
    parser.add_argument("--precision", default="bf16-mixed")
    parser.add_argument("--peak-tflops", type=float, help="dense bf16 peak of the accelerator")
    args, extra = parser.parse_known_args()
    with tempfile.TemporaryDirectory() as scratch:
        folder = Path(scratch)
        write_model(folder, args.layers)
        write_problems(folder / "problems.jsonl")
        cli = run_cli([
            "fit", "--config", args.config, f"--trainer.max_steps={args.steps}", f"--trainer.accelerator={args.accelerator}",
            f"--trainer.precision={args.precision}", "--trainer.limit_val_batches=0", "--trainer.logger=false",
            f"--trainer.default_root_dir={folder}",
            "--trainer.enable_checkpointing=false", "--trainer.enable_progress_bar=false",
            '--trainer.callbacks=[{"class_path": "__main__.StepTimer"}]',
            f"--model.init_args.model_path={folder}", "--model.init_args.from_scratch=true",
            f"--model.init_args.max_new_tokens={args.max_new_tokens}",
            f"--data.init_args.task.init_args.train_file={folder / 'problems.jsonl'}",
            f"--data.init_args.task.init_args.val_file={folder / 'problems.jsonl'}", *extra,
        ])
    module, trainer = cli.model, cli.trainer
    (timer,) = [callback for callback in trainer.callbacks if isinstance(callback, StepTimer)]
    per_step = trainer.accumulate_grad_batches
    first = per_step  # the first optimizer step warms up kernels and the allocator
    seconds, tokens, lengths = timer.seconds[first:], timer.tokens[first:], timer.lengths[first:]
    step_seconds = [sum(seconds[i : i + per_step]) for i in range(0, len(seconds), per_step)]
    step_tokens = [sum(tokens[i : i + per_step]) for i in range(0, len(tokens), per_step)]
    n_params = sum(p.numel() for p in module.policy.parameters())
    hidden, blocks = QWEN25_05B["hidden_size"], args.layers
    flops = sum(t * (6 * n_params + 12 * blocks * hidden * length) for t, length in zip(tokens, lengths))
    tflops = flops / sum(seconds) / 1e12
    device = torch.cuda.get_device_name() if args.accelerator == "cuda" else "cpu"
    peak = args.peak_tflops or next((v for k, v in PEAK_BF16_TFLOPS.items() if k in device), None)
    memory = f"{torch.cuda.max_memory_allocated() / 2**30:.1f} GiB" if args.accelerator == "cuda" else "n/a (CPU)"
    rollout = trainer.callback_metrics.get("perf/rollout_tokens_per_s")

    print(f"{args.config} with random weights: {n_params / 1e6:.0f} M parameters, {blocks} blocks, on {device}")
    print(f"{len(step_seconds)} optimizer steps timed (after 1 warm-up), {per_step} micro-batches each\n")
    rows = [
        ("trained tokens per step (median)", f"{statistics.median(step_tokens):.0f}"),
        ("training step time (median)", f"{statistics.median(step_seconds):.3f} s"),
        ("training tokens/s", f"{sum(tokens) / sum(seconds):.0f}"),
        ("rollout tokens/s (last step)", f"{float(rollout):.0f}" if rollout is not None else "n/a"),
        ("peak memory allocated", memory),
        ("model TFLOP/s (6N + 12LdT)", f"{tflops:.1f}"),
        ("training-step MFU", f"{100 * tflops / peak:.1f}% of {peak:.0f} TFLOP/s" if peak else "n/a (no peak given)"),
    ]
    for name, value in rows:
        print(f"{name:<36}{value:>28}")


if __name__ == "__main__":
    main()
