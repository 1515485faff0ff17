"""``lit-cancel audit-objective``: does an objective's credit cancel on tokens a whole group shares?

It runs the objective on constructed groups and measures the learning tax: the share of the
update's absolute credit that lands, uncancelled, on positions every member of a group shares
(same prefix, same next token)::

    tax = sum_groups sum_shared |sum_i c_it| / sum_all |c_it|

The credits are the loss's own, ``-d loss / d logprobs`` from autograd; the audit also checks that
the credits the objective reports (``ObjectiveOutput.credits``, which instruments read) match them.
The tax of the policy-gradient part (the objective with ``kl_coef`` and ``entropy_coef`` at 0) is
reported apart from the total: a KL or entropy term is a regulariser, not meant to cancel.

At a shared position every member has the same context and token, so the same log-probability
and ratio, under the trainer and under the sampler alike; the scenarios respect that, but for
``stale, two versions``. One scenario has rollouts from a sampler whose log-probs differ from the trainer's (as vLLM's
do), where an objective's mismatch correction acts (``--correction``). Ratios on members' own tokens
vary. In the off-policy scenarios the shared positions' common ratio lies first inside a 0.2 range,
then outside it: there a PPO-style clip keeps the gradient of one sign of advantage and drops the
other, so it stops cancelling, while a trust region that depends on the ratio alone
(:mod:`lit_cancel.objectives.trust_regions`) drops every member alike and keeps cancelling.

The two stale scenarios have rollouts from an asynchronous sampler some weights versions behind the
trainer (decoupled PPO: the sampler's log-probs are the behaviour policy's, ``old_logprobs`` the
proximal ones the trainer recomputes, and the correction weighs one against the other), off-policy
as well. In ``stale, one version`` one version sampled a whole group: a token-level correction is
the same for every member at a shared position and keeps cancelling. ``stale, two versions`` has
the same rollouts, but alternate members come from a second version: their sampler log-probs at a
shared position differ, and even a token-level correction stops cancelling. That is the batching's
doing, not the objective's, so that scenario is reported but not judged (:data:`UNJUDGED`): groups
must be atomic in time, all of a prompt's samples from one weights version.

The two multi-turn scenarios hold episodes: the policy's turns and the environment's observations in
one row, the observations in the context (``attention_mask``) but out of ``completion_mask``, so out
of every credit. In ``multi-turn, shared first turn`` every member of a group has the same first
turn and the same observation, then a second turn of its own, of unequal lengths: the shared prefix
runs on through the observation, and the first turn's credits must cancel. ``multi-turn, unequal
lengths`` has off-policy episodes of unequal lengths, each observation in its member's own place. A
per-sequence normaliser counts each member's policy tokens, unequal in both, and stops cancelling.
"""

import argparse
import copy
import difflib
import importlib
import os
import sys
from dataclasses import dataclass

import torch
from torch import Tensor

from lit_cancel.batch import RolloutBatch
from lit_cancel.objectives.advantages import member_advantages
from lit_cancel.objectives.corrections import CORRECTIONS
from lit_cancel.objectives.policy_gradient import Objective
from lit_cancel.objectives.presets import PRESETS
from lit_cancel.objectives.trust_regions import TRUST_REGIONS
from lit_cancel.rounds.failures import FAILURE_CAUSES

# the names presets had before they took their class names
OLD_NAMES = {
    "grpo": "GRPO", "dr_grpo": "DrGRPO", "dapo": "DAPO", "gspo": "GSPO", "dfpo_min": "DFPOMin", "dfpo_orth": "DFPOOrth", "rloo": "RLOO",
}
# reported credits may differ from autograd's by this share of the largest credit (float32 rounding)
CREDIT_RTOL = 1e-4


def shared_positions(
    tokens: Tensor, mask: Tensor, group_ids: Tensor, context_mask: Tensor | None = None, prompts: Tensor | None = None
) -> Tensor:
    """``[B, C]`` mask of the completion positions whose prefix and token every member of the row's group shares.

    A group's shared positions are its longest common prefix over the context, ``context_mask``
    (``mask`` when None; a multi-turn episode's environment tokens are context, not ``mask``): the
    members agree where all of them hold a context token, the same, from the same source. Only the
    prefix's ``mask`` positions are marked. A row with no token in ``mask`` (a failed episode's) is no member of its
    group. Groups with fewer than two members have none, nor do groups whose members' ``prompts`` (``[B, P]``, where
    given) differ.
    """
    context = mask if context_mask is None else context_mask
    shared = torch.zeros_like(tokens, dtype=torch.bool)
    for group in group_ids.unique():
        rows = (group_ids == group) & mask.bool().any(1)
        if rows.sum() < 2:
            continue
        members, credited = tokens[rows], mask[rows].bool()
        agrees = (members == members[0]).all(0) & (credited == credited[0]).all(0) & context[rows].bool().all(0)
        if prompts is not None and not (prompts[rows] == prompts[rows][0]).all():
            continue
        shared[rows] = agrees.long().cumprod(0).bool() & credited
    return shared


def learning_tax(credits: Tensor, tokens: Tensor, mask: Tensor, group_ids: Tensor, context_mask: Tensor | None = None,
                 prompts: Tensor | None = None) -> float:
    """The share of absolute credit left uncancelled on positions a whole group shares (``context_mask`` and ``prompts``
    as in :func:`shared_positions`)."""
    shared = shared_positions(tokens, mask, group_ids, context_mask, prompts)
    total = credits.abs().sum()
    if total == 0:
        return 0.0
    uncancelled = torch.zeros((), dtype=credits.dtype)
    for group in group_ids.unique():
        rows = group_ids == group
        uncancelled += (credits[rows] * shared[rows]).sum(0).abs().sum()
    return float(uncancelled / total)


def _group(
    lengths: list[int], rewards: list[float], own_log_ratio: float, shared_log_ratio: float, seed: int, sampler_gap: float = 0.0,
    versions: int = 1, prefix: int = 4, observations: list[tuple[int, int]] | None = None, failed: tuple[int, ...] = (),
):
    """Two groups with a shared ``prefix``-token prefix, members of the given lengths, and log-probs to match.

    Returns tokens, mask, rewards, the trainer's old and current log-probs, the sampler's (``old``
    minus up to ``sampler_gap``; None when it is 0), and the context. With ``versions`` > 1 the
    members were sampled by that many weights versions in turn (member ``k`` by version
    ``k % versions``), each with its own gap, so at a shared position the sampler's log-prob differs
    between members. With ``observations``, member ``k`` is a multi-turn episode with the
    environment's tokens at ``(start, length)`` = ``observations[k]``: in the context, out of the mask. Member ``k`` of
    ``failed`` is an episode that failed: its tokens in the context, none in the mask.
    """
    generator = torch.Generator().manual_seed(seed)
    rows, width = 2 * len(lengths), max(lengths)
    tokens = torch.randint(10, 90, (rows, width), generator=generator)
    tokens[: len(lengths), :prefix], tokens[len(lengths) :, :prefix] = tokens[0, :prefix], tokens[len(lengths), :prefix]
    tokens[:, prefix] = torch.arange(rows) + 10  # members diverge after the prefix
    context = (torch.arange(width) < torch.tensor(lengths * 2).unsqueeze(1)).long()
    mask = context.clone()
    for member, (start, length) in enumerate(observations or []):
        mask[member :: len(lengths), start : start + length] = 0
    for member in failed:
        mask[member :: len(lengths)] = 0
    old = -torch.rand(rows, width, generator=generator) * 2
    old[: len(lengths), :prefix], old[len(lengths) :, :prefix] = old[0, :prefix], old[len(lengths), :prefix]
    log_ratio = (torch.rand(rows, width, generator=generator) * 2 - 1) * own_log_ratio
    log_ratio[:, :prefix] = shared_log_ratio
    reward = torch.tensor(rewards * 2).view(2, -1)
    sampler = None
    if sampler_gap:
        sampler = old.clone()
        version = torch.arange(rows) % len(lengths) % versions
        for v in range(versions):
            gap = (torch.rand(rows, width, generator=generator) * 2 - 1) * sampler_gap
            gap[: len(lengths), :prefix], gap[len(lengths) :, :prefix] = gap[0, :prefix], gap[len(lengths), :prefix]
            sampler[version == v] -= gap[version == v]
    return tokens, mask, reward, old, old + log_ratio, sampler, context


SCENARIOS: dict[str, dict] = {
    "on-policy, equal lengths": dict(lengths=[9, 9, 9, 9], own_log_ratio=0.0, shared_log_ratio=0.0),
    "on-policy, unequal lengths": dict(lengths=[6, 9, 12, 7], own_log_ratio=0.0, shared_log_ratio=0.0),
    "off-policy, inside the clip range": dict(lengths=[6, 9, 12, 7], own_log_ratio=0.15, shared_log_ratio=0.1),
    "own tokens outside the clip range": dict(lengths=[6, 9, 12, 7], own_log_ratio=0.8, shared_log_ratio=-0.1),
    "shared tokens outside the clip range": dict(lengths=[6, 9, 12, 7], own_log_ratio=0.15, shared_log_ratio=0.3),
    "sampler mismatch, equal lengths": dict(lengths=[9, 9, 9, 9], own_log_ratio=0.0, shared_log_ratio=0.0, sampler_gap=0.3),
    # an asynchronous sampler some weights versions behind: its log-probs differ from the trainer's old (proximal) ones
    # by up to 2 nats a token, past TokenTruncate's default bound (exp(2) > 3), and the step is off-policy too; with two
    # versions, members 1 and 3 (reward 0) come from the second: neither version's advantages sum to zero on their own
    "stale, one version": dict(lengths=[9, 9, 9, 9], own_log_ratio=0.15, shared_log_ratio=0.1, sampler_gap=2.0),
    "stale, two versions": dict(lengths=[9, 9, 9, 9], own_log_ratio=0.15, shared_log_ratio=0.1, sampler_gap=2.0, versions=2),
    # episodes: a first turn of 3 tokens and an observation of 3 that the whole group shares, then second turns of 2 to 8
    "multi-turn, shared first turn": dict(
        lengths=[8, 14, 10, 12], own_log_ratio=0.0, shared_log_ratio=0.0, prefix=6, observations=[(3, 3)] * 4
    ),
    # episodes of 8 to 15 policy tokens, each observation in its member's own place, off-policy on every token
    "multi-turn, unequal lengths": dict(
        lengths=[10, 18, 12, 20], own_log_ratio=0.15, shared_log_ratio=0.1, observations=[(6, 2), (8, 4), (5, 3), (9, 5)]
    ),
    # member 3 (reward 0) of each group failed: its row stays, inert; the group trains its other three members, off-policy
    "failed episode, one member": dict(lengths=[6, 9, 12, 7], own_log_ratio=0.15, shared_log_ratio=0.1, failed=(3,)),
}
UNJUDGED = {"stale, two versions": "stale, one version"}
"""Scenarios reported but left out of the verdict, each with the judged scenario it differs from only in how the rollouts
were batched: what breaks there is the batching's doing, not the objective's."""


def scenario_rollouts(name: str) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor, Tensor | None, Tensor]:
    """``_group``'s rollouts for scenario ``name``, seeded by its place in :data:`SCENARIOS` (an unjudged one by its counterpart's)."""
    seed = list(SCENARIOS).index(UNJUDGED.get(name, name))
    return _group(rewards=[1.0, 0.0, 1.0, 0.0], seed=seed, **SCENARIOS[name])


@dataclass
class ScenarioAudit:
    """What the audit found in one scenario.

    Attributes:
        tax: learning tax of the whole objective's autograd credits.
        policy_tax: learning tax of the policy-gradient part (``kl_coef`` and ``entropy_coef`` at 0).
        credit_mismatch: largest ``|reported - autograd|`` credit, as a share of the largest autograd credit.
        mismatch_at: ``(row, position)`` of that mismatch.
        reported: the reported credit there; autograd: autograd's.
        judged: whether the scenario counts towards the verdict (not those in :data:`UNJUDGED`).
    """

    tax: float
    policy_tax: float
    credit_mismatch: float
    mismatch_at: tuple[int, int]
    reported: float
    autograd: float
    judged: bool = True


def credits(objective: Objective, logprobs: Tensor, batch: RolloutBatch) -> tuple[Tensor, Tensor]:
    """``(reported, autograd)``: ``ObjectiveOutput.credits`` and ``-d loss / d logprobs``."""
    logprobs = logprobs.clone().requires_grad_()
    out = objective(logprobs, batch)
    (gradient,) = torch.autograd.grad(out.loss, logprobs, allow_unused=True)
    autograd = torch.zeros_like(logprobs) if gradient is None else -gradient
    return out.credits.detach(), autograd.detach()


def policy_gradient_part(objective: Objective) -> Objective:
    """A copy of ``objective`` with its KL and entropy weights at 0, when it has them."""
    part = copy.copy(objective)
    for name in ("kl_coef", "entropy_coef"):
        if getattr(part, name, 0.0):
            setattr(part, name, 0.0)
    return part


def scenario_batch(objective: Objective, name: str) -> tuple[RolloutBatch, Tensor]:
    """Scenario ``name``'s rollouts as a batch, with ``objective``'s advantages, behind one prompt token; and the
    current log-probs."""
    tokens, mask, rewards, old, current, sampler, context = scenario_rollouts(name)
    prompt = torch.ones(len(tokens), 1, dtype=torch.long)
    # the group rule: a failed episode's row is no member; advantages over the others, and it counts in no normaliser
    members = mask.bool().any(1)
    batch = RolloutBatch(
        input_ids=torch.cat([prompt, tokens], 1), attention_mask=torch.cat([prompt, context], 1),
        completion_mask=mask, prompt_length=1, rewards=rewards.view(-1),
        advantages=member_advantages(objective.advantages, rewards, members.view(rewards.shape)).view(-1),
        group_ids=torch.arange(2).repeat_interleave(rewards.shape[1]), old_logprobs=old, ref_logprobs=old.clone(),
        sampler_logprobs=sampler, failure=(~members).long() * (FAILURE_CAUSES.index("step_raised") + 1),
        step_sequences=float(members.sum()), step_tokens=float(mask.sum()),
    )
    return batch, current


def audit(objective: Objective) -> dict[str, ScenarioAudit]:
    """The learning tax of ``objective`` in each scenario, and how well its reported credits match autograd's."""
    results = {}
    policy_part = policy_gradient_part(objective)
    for name in SCENARIOS:
        batch, current = scenario_batch(objective, name)
        rollouts = (batch.input_ids[:, 1:], batch.completion_mask, batch.group_ids, batch.attention_mask[:, 1:])
        reported, autograd = credits(objective, current, batch)
        gap = (reported - autograd).abs()
        worst = int(gap.argmax())
        row, position = divmod(worst, gap.shape[1])
        scale = float(autograd.abs().max())
        results[name] = ScenarioAudit(
            tax=learning_tax(autograd, *rollouts),
            policy_tax=learning_tax(credits(policy_part, current, batch)[1], *rollouts),
            credit_mismatch=float(gap.max()) / scale if scale > 0 else float(gap.max()),
            mismatch_at=(row, position), reported=float(reported[row, position]), autograd=float(autograd[row, position]),
            judged=name not in UNJUDGED,
        )
    return results


def nearest_preset(name: str) -> str | None:
    """The preset whose name, or old name, is closest to ``name`` (case aside), or None when none is close."""
    names = {preset.lower(): preset for preset in PRESETS} | OLD_NAMES
    close = difflib.get_close_matches(name.lower(), names, n=1)
    return names[close[0]] if close else None


def load_objective(name_or_class_path: str) -> Objective:
    """A preset by name (``DFPOMin``, or its old name ``dfpo_min``) or any objective class by import path, built with no arguments.

    Raises:
        ValueError: with a one-line reason when it cannot be found, imported or built.
    """
    name = OLD_NAMES.get(name_or_class_path, name_or_class_path)
    if name in PRESETS:
        factory = PRESETS[name]
    else:
        module_name, _, class_name = name_or_class_path.rpartition(".")
        nearest = nearest_preset(class_name) if module_name.partition(".")[0] in ("", "lit_cancel") else None
        did_you_mean = f"; did you mean {nearest}?" if nearest else ""
        if not module_name:
            raise ValueError(
                f"{name_or_class_path!r} is neither a preset ({', '.join(PRESETS)}) nor a class path such as "
                f"my_package.objectives.MyObjective{did_you_mean}"
            )
        try:
            factory = getattr(importlib.import_module(module_name), class_name)
        except (ImportError, AttributeError, ValueError) as error:
            raise ValueError(
                f"{name_or_class_path!r} is neither a preset ({', '.join(PRESETS)}) nor an importable class path: {error}{did_you_mean}"
            ) from error
    try:
        objective = factory()
    except TypeError as error:
        raise ValueError(
            f"{name_or_class_path!r} cannot be built without arguments ({error}); give its arguments defaults, "
            "or audit a subclass that sets them"
        ) from error
    if not isinstance(objective, Objective):
        raise ValueError(f"{name_or_class_path!r} is not a lit_cancel.Objective")
    return objective


def parser() -> argparse.ArgumentParser:
    """The options of ``lit-cancel audit-objective``."""
    options = argparse.ArgumentParser(
        prog="lit-cancel audit-objective",
        description="Measures the learning tax of an objective on constructed groups; exit 0 when its policy gradient "
        "cancels in every judged scenario and its reported credits are its loss's, 1 when not, 2 when it cannot be loaded or built.",
    )
    options.add_argument("objective", help=f"a preset ({', '.join(PRESETS)}) or a class path such as my_pkg.objectives.MyObjective")
    options.add_argument("--tolerance", type=float, default=1e-6, help="largest tax that counts as cancelling")
    options.add_argument(
        "--correction", choices=list(CORRECTIONS),
        help="audit the objective with this sampler-mismatch correction (default bounds); it acts in the sampler-mismatch and "
        "stale scenarios",
    )
    options.add_argument(
        "--trust-region", choices=list(TRUST_REGIONS),
        help="audit the objective with this trust region (default range); it acts in the off-policy scenarios",
    )
    return options


def main(argv: list[str]) -> int:
    """Exit 0 when the objective cancels in every judged scenario, 1 when not or when it reports wrong credits, 2 when unloadable."""
    args = parser().parse_args(argv)
    if os.getcwd() not in sys.path:
        sys.path.insert(0, os.getcwd())  # a module in the current directory, as `python -m` would find it
    try:
        objective = load_objective(args.objective)
    except ValueError as error:
        print(f"audit-objective: {error}", file=sys.stderr)
        return 2
    name = args.objective
    parts = (("correction", "mismatch correction", CORRECTIONS), ("trust_region", "trust region", TRUST_REGIONS))
    for attribute, description, registry in parts:
        chosen = getattr(args, attribute)
        if not chosen:
            continue
        if not hasattr(objective, attribute):
            print(f"audit-objective: {args.objective} takes no {description} (no '{attribute}' attribute)", file=sys.stderr)
            return 2
        setattr(objective, attribute, registry[chosen]())
        name += f" with {chosen}"
    results = audit(objective)
    print(f"learning tax of {name} (uncancelled share of |credit| on positions every group member shares)")
    print(f"  {'scenario':<36} {'policy gradient':>16} {'total':>10}")
    for name, result in results.items():
        verdict = "cancels" if result.policy_tax <= args.tolerance else "DOES NOT CANCEL"
        if not result.judged and verdict != "cancels":
            verdict = "does not cancel, not judged"
        print(f"  {name:<36} {result.policy_tax:16.6f} {result.tax:10.6f}  {verdict}")
    judged = [result for result in results.values() if result.judged]
    cancels = all(result.policy_tax <= args.tolerance for result in judged)
    if any(result.tax > args.tolerance for result in judged) and cancels:
        print("the total includes the KL and entropy terms, regularisers that are not meant to cancel")
    unjudged = [name for name, result in results.items() if not result.judged and result.policy_tax > args.tolerance]
    for name in unjudged:
        if results[UNJUDGED[name]].policy_tax <= args.tolerance:
            print(
                f"not judged: '{name}' differs from '{UNJUDGED[name]}' only in that its groups mix two weights versions: at a "
                "shared position the sampler's log-prob, and with it a per-token correction, differs by member;\n"
                "that is the batching's doing, not the objective's: keep each group atomic in time (all of a prompt's samples "
                "from one weights version)"
            )
    name, worst = max(results.items(), key=lambda item: item[1].credit_mismatch)
    credits_match = worst.credit_mismatch <= CREDIT_RTOL
    if not credits_match:
        row, position = worst.mismatch_at
        print(
            f"reported credits are not -dloss/dlogprobs: largest mismatch {worst.credit_mismatch:.3g} of the largest credit, "
            f"in '{name}' at row {row}, position {position} (reported {worst.reported:.6g}, autograd {worst.autograd:.6g}); "
            "the taxes above are autograd's"
        )
        print("result: reports credits that are not its loss's")
    else:
        everywhere = "in every judged scenario" if unjudged else "in every scenario"
        print(f"result: cancels {everywhere}" if cancels else "result: does not cancel")
    return 0 if cancels and credits_match else 1


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
