"""Agent rollout time per round with the decode loop's KV cache kept across turns, and with every turn prefilled whole.

    python benchmarks/performance/agent_turns.py [--repeats 7] [--prompts 16] [--group-size 8] [--threads N]

The agent quickstart's settings (configs/quickstart-agent.yaml): ``embedded:tiny-agent``, 5-digit ``ToolAdditionTask``
episodes of at most 3 turns, 23 tokens a turn, temperature 1, 16 prompts of 8 episodes a round. Each repeat runs one
round's episodes with each engine, in alternating order, under the same seed; the table shows the medians of wall and
CPU seconds (the process's, less sensitive to other work on a shared machine), and the tokens prefilled and read from
the kept cache per round.
"""

import argparse
import dataclasses
import statistics
import time

import torch

from lit_cancel import RLModule
from lit_cancel.agents import ToolAdditionTask
from lit_cancel.engines import DecodeLoop
from lit_cancel.rounds.sample import encode_prompts


class PrefillEachTurn(DecodeLoop):
    """The decode loop without its kept cache: every turn prefills each episode's whole context."""

    def sample(self, policy, request):
        sampled = super().sample(policy, dataclasses.replace(request, keep=False))
        sampled.stats = {"perf/prefill_tokens": float(request.attention_mask.sum()), "perf/kv_reused_tokens": 0.0}
        return sampled


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--prompts", type=int, default=16)
    parser.add_argument("--group-size", type=int, default=8)
    parser.add_argument("--threads", type=int, default=torch.get_num_threads())
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    task = ToolAdditionTask(num_digits=5, train_size=20000, val_size=200, max_turns=3, seed=0)
    engines = {"kept cache": DecodeLoop(), "prefill each turn": PrefillEachTurn()}
    modules = {name: RLModule("embedded:tiny-agent", temperature=1.0, top_p=1.0, max_new_tokens=23, engine=engine).eval()
               for name, engine in engines.items()}
    seconds = {name: [] for name in engines}
    cpu_seconds = {name: [] for name in engines}
    stats = {}
    for repeat in range(args.repeats + 1):  # the first is a warm-up
        records = task.train_records()[repeat * args.prompts : (repeat + 1) * args.prompts]
        for name in (list(engines) if repeat % 2 else list(engines)[::-1]):
            module = modules[name]
            encoded = encode_prompts(module.tokenizer, records)
            torch.manual_seed(repeat)
            started, started_cpu = time.perf_counter(), time.process_time()
            generation = task.rollout(module, records, encoded["input_ids"], encoded["attention_mask"], num_samples=args.group_size)
            if repeat:
                seconds[name].append(time.perf_counter() - started)
                cpu_seconds[name].append(time.process_time() - started_cpu)
                stats.setdefault(name, []).append(generation.stats)

    print(f"{args.prompts} prompts x {args.group_size} episodes a round, {args.repeats} repeats, "
          f"{torch.get_num_threads()} threads\n")
    print(f"{'engine':<20}{'wall s/round':>14}{'min':>8}{'max':>8}{'CPU s/round':>13}{'turns':>7}{'prefilled':>11}{'from cache':>12}")
    for name, times in seconds.items():
        rounds = stats[name]
        turns = statistics.mean(s["rollout/turns"] for s in rounds)
        prefilled = statistics.mean(s["perf/prefill_tokens"] for s in rounds)
        reused = statistics.mean(s["perf/kv_reused_tokens"] for s in rounds)
        print(f"{name:<20}{statistics.median(times):>14.3f}{min(times):>8.3f}{max(times):>8.3f}"
              f"{statistics.median(cpu_seconds[name]):>13.3f}{turns:>7.2f}{prefilled:>11.0f}{reused:>12.0f}")
    for label, values in (("wall", seconds), ("CPU", cpu_seconds)):
        ratio = statistics.median(values["prefill each turn"]) / statistics.median(values["kept cache"])
        print(f"{label} time, prefill each turn / kept cache: {ratio:.2f}x")


if __name__ == "__main__":
    main()
