"""``lit-cancel audit-objective``: does an objective's credit cancel on tokens a whole group shares?

It runs the objective on constructed groups and measures the learning tax: the share of the
update's absolute credit that lands, uncancelled, on positions every member of a group shares
(same prefix, same next token)::

    tax = sum_groups sum_shared |sum_i c_it| / sum_all |c_it|

At a shared position every member has the same context and token, so the same log-probability
and ratio; the scenarios respect that. Ratios on members' own tokens vary; the shared positions'
common ratio stays inside a 0.2 clip range, where every PPO-style clip treats members alike (outside
it, any clip selects one sign of advantage: see the tests).
"""

import argparse
import importlib
import sys
from collections.abc import Callable

import torch
from torch import Tensor

from lit_cancel.batch import RolloutBatch
from lit_cancel.callbacks.learning_tax import shared_positions
from lit_cancel.objectives import Objective
from lit_cancel.presets import PRESETS


def learning_tax(credits: Tensor, tokens: Tensor, mask: Tensor, group_ids: Tensor) -> float:
    """The share of absolute credit left uncancelled on positions a whole group shares."""
    shared = shared_positions(tokens, mask, group_ids)
    total = credits.abs().sum()
    if total == 0:
        return 0.0
    uncancelled = torch.zeros((), dtype=credits.dtype)
    for group in group_ids.unique():
        rows = group_ids == group
        uncancelled += (credits[rows] * shared[rows]).sum(0).abs().sum()
    return float(uncancelled / total)


def _group(lengths: list[int], rewards: list[float], own_log_ratio: float, shared_log_ratio: float, seed: int):
    """Two groups with a shared 4-token prefix, members of the given lengths, and log-probs to match."""
    generator = torch.Generator().manual_seed(seed)
    rows, width, prefix = 2 * len(lengths), max(lengths), 4
    tokens = torch.randint(10, 90, (rows, width), generator=generator)
    tokens[: len(lengths), :prefix] = torch.tensor([3, 4, 5, 6])
    tokens[len(lengths) :, :prefix] = torch.tensor([7, 8, 9, 6])
    tokens[:, prefix] = torch.arange(rows) + 10  # members diverge after the prefix
    mask = (torch.arange(width) < torch.tensor(lengths * 2).unsqueeze(1)).long()
    old = -torch.rand(rows, width, generator=generator) * 2
    old[: len(lengths), :prefix], old[len(lengths) :, :prefix] = old[0, :prefix], old[len(lengths), :prefix]
    log_ratio = (torch.rand(rows, width, generator=generator) * 2 - 1) * own_log_ratio
    log_ratio[:, :prefix] = shared_log_ratio
    reward = torch.tensor(rewards * 2).view(2, -1)
    return tokens, mask, reward, old, old + log_ratio


SCENARIOS: dict[str, dict] = {
    "on-policy, equal lengths": dict(lengths=[9, 9, 9, 9], own_log_ratio=0.0, shared_log_ratio=0.0),
    "on-policy, unequal lengths": dict(lengths=[6, 9, 12, 7], own_log_ratio=0.0, shared_log_ratio=0.0),
    "off-policy, inside the clip range": dict(lengths=[6, 9, 12, 7], own_log_ratio=0.15, shared_log_ratio=0.1),
    "own tokens outside the clip range": dict(lengths=[6, 9, 12, 7], own_log_ratio=0.8, shared_log_ratio=-0.1),
}


def audit(objective: Objective, tolerance: float = 1e-6) -> dict[str, float]:
    """The learning tax of ``objective`` in each scenario."""
    taxes = {}
    for seed, (name, scenario) in enumerate(SCENARIOS.items()):
        tokens, mask, rewards, old, current = _group(rewards=[1.0, 0.0, 1.0, 0.0], seed=seed, **scenario)
        group_ids = torch.arange(2).repeat_interleave(rewards.shape[1])
        batch = RolloutBatch(
            input_ids=torch.cat([torch.ones(len(tokens), 1, dtype=torch.long), tokens], 1),
            attention_mask=torch.cat([torch.ones(len(tokens), 1, dtype=torch.long), mask], 1),
            completion_mask=mask, prompt_length=1, rewards=rewards.view(-1),
            advantages=objective.advantages(rewards).view(-1), group_ids=group_ids, old_logprobs=old,
            ref_logprobs=old.clone(), step_sequences=float(len(tokens)), step_tokens=float(mask.sum()),
        )
        credits = objective(current.clone().requires_grad_(), batch).credits
        taxes[name] = learning_tax(credits, tokens, mask, group_ids)
    return taxes


def load_objective(name_or_class_path: str) -> Objective:
    """A preset by name (``dfpo_min``) or any objective class by import path (``pkg.module.Class``), default arguments."""
    if name_or_class_path in PRESETS:
        return PRESETS[name_or_class_path]()
    module_name, _, class_name = name_or_class_path.rpartition(".")
    try:
        factory: Callable[[], Objective] = getattr(importlib.import_module(module_name), class_name)
    except (ImportError, AttributeError, ValueError) as error:
        raise SystemExit(
            f"audit-objective: {name_or_class_path!r} is neither a preset ({', '.join(PRESETS)}) "
            f"nor an importable class path: {error}"
        ) from error
    objective = factory()
    if not isinstance(objective, Objective):
        raise SystemExit(f"audit-objective: {name_or_class_path!r} is not a lit_cancel.Objective")
    return objective


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(
        prog="lit-cancel audit-objective",
        description="Measures the learning tax of an objective on constructed groups; exit 0 when it cancels everywhere.",
    )
    parser.add_argument("objective", help=f"a preset ({', '.join(PRESETS)}) or a class path such as my_pkg.objectives.MyObjective")
    parser.add_argument("--tolerance", type=float, default=1e-6, help="largest tax that counts as cancelling")
    args = parser.parse_args(argv)
    taxes = audit(load_objective(args.objective), args.tolerance)
    print(f"learning tax of {args.objective} (uncancelled share of |credit| on positions every group member shares)")
    for name, tax in taxes.items():
        print(f"  {name:<36} {tax:10.6f}  {'cancels' if tax <= args.tolerance else 'DOES NOT CANCEL'}")
    cancels = all(tax <= args.tolerance for tax in taxes.values())
    print("result: cancels in every scenario" if cancels else "result: does not cancel")
    return 0 if cancels else 1


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
