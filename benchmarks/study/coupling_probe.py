"""E6, paper B's masked-update probe: how far one token's update moves another token.

    python benchmarks/study/coupling_probe.py --seed 0          # prints one seed's table
    python benchmarks/study/experiments.py --only E6 --seeds 5  # stores each seed's JSON and writes the report

The policy is ``embedded:tiny-scaffold`` on ScaffoldedAdditionTask (scaffold 12, spread 8), loaded
through ``RLModule`` as a run loads it. It samples 16 prompts x 8 rollouts; every completion token
``j`` gets its probability ``p_j`` under that policy. A pair ``(k, j)`` of tokens from two different
rollouts is probed by one SGD step (lr 0.1, no momentum, as paper B's App. D.2) that raises
``log p_k`` alone, with ``j``'s own gradient masked out (``j``'s rollout is not in the step), and
reading ``Δ log p_j`` after it; beside it, the first-order coupling ``⟨∇ log p_j, ∇ log p_k⟩``
(the change per unit learning rate of an infinitesimal step) and its cosine. Pairs are drawn in
three classes:

* identical tokens, both predicted with low confidence (``p < 0.5``);
* identical tokens, both predicted with high confidence (``p >= 0.5``);
* different tokens, both predicted with low confidence.

Paper B says the interaction is strongest for the first class. A pair is one token's update, not
a whole batch's, so each ``Δ`` is that one coupling; the parameters are restored after each pair.
On a model this small an lr-0.1 step is far from infinitesimal, which is why the first-order
coupling is reported too.
"""

import argparse
import statistics

import torch

from lit_cancel import RLModule, ScaffoldedAdditionTask

MODEL, SCAFFOLD, SPREAD = "embedded:tiny-scaffold", 12, 8
PROMPTS, GROUP, LR, THRESHOLD = 16, 8, 0.1, 0.5
CLASSES = ("identical_low", "identical_high", "different_low")


def eligible_pairs(tokens: torch.Tensor, rows: torch.Tensor, confidence: torch.Tensor) -> dict[str, torch.Tensor]:
    """``[N, 2]`` indices ``(k, j)`` into the flat completion tokens, per class; ``k`` and ``j`` in different rollouts."""
    same_token = tokens[:, None] == tokens[None, :]
    other_row = rows[:, None] != rows[None, :]
    low = confidence < THRESHOLD
    both_low, both_high = low[:, None] & low[None, :], ~low[:, None] & ~low[None, :]
    masks = {"identical_low": same_token & both_low, "identical_high": same_token & both_high, "different_low": ~same_token & both_low}
    return {name: torch.nonzero(mask & other_row) for name, mask in masks.items()}


def probe(seed: int, pairs_per_class: int = 60) -> dict:
    """One seed: per class, the mean (and mean absolute) ``Δ log p_j``, first-order coupling and cosine over its pairs."""
    torch.manual_seed(seed)
    module = RLModule(MODEL, max_new_tokens=96).eval()
    task = ScaffoldedAdditionTask(scaffold=SCAFFOLD, spread=SPREAD)
    generator = torch.Generator().manual_seed(seed)
    records = task.train_records()
    chosen = [records[i] for i in torch.randperm(len(records), generator=generator)[:PROMPTS].tolist()]
    prompts = module.tokenizer([r["prompt"] for r in chosen], return_tensors="pt", padding=True)
    rollouts = module.rollout(prompts["input_ids"], prompts["attention_mask"], num_samples=GROUP)
    prompt_length, mask = rollouts.prompt_length, rollouts.completion_mask.bool()
    logprobs = module.token_logprobs(rollouts.input_ids, rollouts.attention_mask, prompt_length)
    row_of, column_of = torch.nonzero(mask, as_tuple=True)
    tokens = rollouts.input_ids[:, prompt_length:][mask]
    pairs = eligible_pairs(tokens, row_of, logprobs[mask].exp())

    parameters = [p for p in module.parameters() if p.requires_grad]
    saved = [p.detach().clone() for p in parameters]

    def token_logprob(index: int) -> torch.Tensor:
        row = row_of[index]
        ids, attention = rollouts.input_ids[row : row + 1], rollouts.attention_mask[row : row + 1]
        return module.completion_logprobs(module.policy, ids, attention, prompt_length)[0][0, column_of[index]]

    def gradient(index: int) -> torch.Tensor:
        return torch.cat([g.reshape(-1) for g in torch.autograd.grad(token_logprob(index), parameters)])

    results = {}
    for name in CLASSES:
        candidates = pairs[name]
        draw = candidates[torch.randperm(len(candidates), generator=generator)[:pairs_per_class]]
        measured: dict[str, list[float]] = {"change": [], "kernel": [], "cosine": []}
        for k, j in draw.tolist():
            gradient_k, gradient_j = gradient(k), gradient(j)
            with torch.no_grad():
                before = token_logprob(j)
                offset = 0
                for parameter in parameters:  # plain SGD ascent on log p_k: p += lr * grad
                    parameter.add_(gradient_k[offset : offset + parameter.numel()].view_as(parameter), alpha=LR)
                    offset += parameter.numel()
                measured["change"].append(float(token_logprob(j) - before))
                for parameter, value in zip(parameters, saved):
                    parameter.copy_(value)
            kernel = float(gradient_j @ gradient_k)
            measured["kernel"].append(kernel)
            measured["cosine"].append(kernel / float(gradient_j.norm() * gradient_k.norm()))
        results[name] = {"pairs": len(draw), "eligible": len(candidates)}
        for quantity, values in measured.items():
            results[name][f"mean_{quantity}"] = statistics.fmean(values) if values else float("nan")
            results[name][f"mean_abs_{quantity}"] = statistics.fmean(abs(v) for v in values) if values else float("nan")
    return {"experiment": "E6", "seed": seed, "model": MODEL, "scaffold": SCAFFOLD, "spread": SPREAD, "lr": LR,
            "threshold": THRESHOLD, "rollouts": PROMPTS * GROUP, "classes": results}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--pairs", type=int, default=60, help="pairs probed per class")
    args = parser.parse_args()
    result = probe(args.seed, args.pairs)
    print("| pair class | pairs (eligible) | Δ log p_j (lr 0.1) | abs | first-order ⟨∇j, ∇k⟩ | abs | cosine |")
    print("|---|---|---|---|---|---|---|")
    for name, n in result["classes"].items():
        print(f"| {name} | {n['pairs']} ({n['eligible']}) | {n['mean_change']:.4f} | {n['mean_abs_change']:.4f} "
              f"| {n['mean_kernel']:.4f} | {n['mean_abs_kernel']:.4f} | {n['mean_cosine']:.4f} |")


if __name__ == "__main__":
    main()
