"""Forced branching (E10): rollouts of one prompt that share an uncertain preamble by construction; and (E12) agent
episodes of one prompt that share their first turn.

A group sampled the usual way shares only the tokens the policy is nearly sure of (a position is
shared by all ``G`` members with probability ``p^G``), so uncancelled credit there has almost no
gradient to act on (E8: 0.33 shared tokens per group). :class:`ForcedBranching` builds shared *and*
uncertain tokens: per prompt it samples ONE preamble of ``preamble_tokens`` tokens at the policy's
own temperature, then the group's ``n`` continuations of prompt + preamble. Each member's completion
is preamble + its continuation, so the preamble's tokens sit at the same positions in every member
and carry that member's credit. Each member is still an exact sample of the policy (preamble, then
continuation, is the chain rule); only the members of a group are no longer independent.

Loaded by class path, with ``benchmarks/study`` on ``PYTHONPATH`` (``benchmarks/study/experiments.py`` puts it there)::

    lit-cancel fit --config configs/scaffold.yaml \\
        --model.init_args.engine=forced_branching.ForcedBranching \\
        --model.init_args.engine.init_args.preamble_tokens=16

``python benchmarks/study/forced_branching.py --measure`` samples forced-branching groups from the shipped
model at a few knob settings and prints the preamble's mean token probability, the share of groups
with mixed rewards and the shared-prefix length (the design measurements of E10).
"""

import argparse
import dataclasses
import math
from collections.abc import Iterator
from contextlib import contextmanager

import torch
from lightning.pytorch.callbacks import Callback
from torch import Tensor

from lit_cancel.engines import DecodeLoop, PolicyWeights, RolloutEngine, Sampled, SampleRequest, SamplingOptions
from lit_cancel.logprobs import completion_logprobs
from lit_cancel.objectives.audit import shared_positions


class WrappingEngine(RolloutEngine):
    """An engine that samples through an inner one (:class:`~lit_cancel.DecodeLoop` when None) and passes the rest on:
    its device context, weight pushes, release and checks. One that samples ahead of the trainer is refused (the
    wrappers change how a round's calls are made, which needs the calls made on demand)."""

    def __init__(self, engine: RolloutEngine | None):
        self.engine = engine if engine is not None else DecodeLoop()
        if self.engine.max_staleness > 0:
            raise ValueError(f"{type(self).__name__}: the inner engine {type(self.engine).__name__} samples ahead (max_staleness > 0)")
        self.supported_options = self.engine.supported_options
        self.holds_weights = self.engine.holds_weights

    @contextmanager
    def context(self, device: torch.device) -> Iterator[None]:
        with self.engine.context(device):
            yield

    def sync(self, policy: PolicyWeights) -> float:
        return self.engine.sync(policy)

    def release(self) -> None:
        self.engine.release()

    def check(self, policy: PolicyWeights, options: SamplingOptions | None) -> None:
        self.engine.check(policy, options)


class ForcedBranching(WrappingEngine):
    """One sampled preamble per prompt, then ``n`` continuations of it: groups that share ``preamble_tokens`` tokens.

    ``sample(prompts, n)`` makes two calls of the inner engine: one sample of ``preamble_tokens`` tokens
    per prompt, then ``n`` samples of prompt + preamble with the rest of ``max_new_tokens``. Rows are
    prompt (left-padded as given) + preamble + continuation, right-padded with the pad id after the stop
    token, as every engine returns them; a completion is never longer than ``max_new_tokens``.

    A preamble that reaches a stop token before ``preamble_tokens`` is the whole completion of all ``n``
    members: the policy ended its answer there, so nothing is continued (sampling past a stop token
    would train on text the policy never writes, and resampling or suppressing the stop would change
    the distribution). Such a group is ``n`` identical completions with equal rewards, so its
    advantages are 0; ``rollout/preamble_stopped`` logs the share of prompts it happened to.

    Validation (``val/accuracy``, ``val/greedy_accuracy``) is sampled by the inner engine as usual
    unless ``branch_validation``: a branched sample is still an exact sample of the policy, so the
    expected accuracy is the same, but the ``n`` samples of a prompt are correlated, which widens the
    estimate's spread and breaks comparability with the other experiments' validation. Greedy
    decoding and single samples always go to the inner engine (branching changes nothing there).

    Validation requests are those the module makes while its trainer validates (``SampleRequest.validation``); a direct
    ``module.rollout`` call branches.

    Logged with each round (``Sampled.stats``): ``rollout/preamble_p``, the mean probability under
    the policy of the preamble tokens up to their stop token (the policy's own temperature), and
    ``rollout/preamble_stopped``.

    Like :class:`~lit_cancel.DecodeLoop` it runs the policy itself, so it reports no sampling log-probs;
    an inner engine that does report them gets them passed on (preamble, then continuation).

    Args:
        preamble_tokens: tokens of the shared preamble (``K``); below the module's ``max_new_tokens``.
        engine: the inner engine; :class:`~lit_cancel.DecodeLoop` when None. One that samples ahead
            of the trainer (``max_staleness`` above 0) is refused.
        branch_validation: branch validation samples too.
        measure: compute ``rollout/preamble_p`` (one extra forward pass over prompt + preamble, no grad).
    """

    def __init__(
        self, preamble_tokens: int = 16, engine: RolloutEngine | None = None, branch_validation: bool = False, measure: bool = True,
    ):
        if preamble_tokens < 1:
            raise ValueError(f"ForcedBranching: preamble_tokens must be >= 1, got {preamble_tokens}")
        super().__init__(engine)
        self.preamble_tokens, self.branch_validation, self.measure = preamble_tokens, branch_validation, measure
        # how many sampled calls branched and how many went to the inner engine as they were (tests read them)
        self.branched_calls = self.plain_calls = 0

    def check(self, policy: PolicyWeights, options: SamplingOptions | None) -> None:
        if options is not None and self.preamble_tokens >= options.max_new_tokens:
            raise ValueError(
                f"model.init_args.engine.init_args.preamble_tokens: {self.preamble_tokens} leaves no room for a continuation "
                f"within max_new_tokens {options.max_new_tokens}; make it smaller"
            )
        super().check(policy, options)

    def sample(self, policy: PolicyWeights, request: SampleRequest) -> Sampled:
        num_samples, options = request.num_samples, request.options
        if request.greedy or num_samples < 2 or (request.validation and not self.branch_validation):
            self.plain_calls += 1
            return self.engine.sample(policy, request)
        self.check(policy, options)
        self.branched_calls += 1
        input_ids, attention_mask = request.input_ids, request.attention_mask
        rows, prompt_length = input_ids.shape
        width, budget = self.preamble_tokens, options.max_new_tokens - self.preamble_tokens
        pad, device = options.pad_token_id, input_ids.device
        stops = torch.tensor(list(options.stop_token_ids), dtype=input_ids.dtype, device=device)

        preamble_options = dataclasses.replace(options, max_new_tokens=width)
        first = self.engine.sample(policy, SampleRequest(input_ids, attention_mask, 1, preamble_options, validation=request.validation))
        preamble = torch.full((rows, width), pad, dtype=input_ids.dtype, device=device)
        drawn = first.sequences[:, prompt_length:]
        preamble[:, : drawn.shape[1]] = drawn
        is_stop = torch.isin(preamble, stops)
        stopped = is_stop.any(1)
        # a stop token ends the preamble; what the inner engine wrote after it is padding
        preamble_mask = (is_stop.long().cumsum(1) - is_stop.long()) == 0
        preamble = preamble.masked_fill(~preamble_mask, pad)
        going = torch.nonzero(~stopped).squeeze(1)

        continued, continued_logprobs, sync_seconds = None, None, first.sync_seconds
        stats: dict[str, float] = {}
        if len(going):
            prefix = torch.cat([input_ids[going], preamble[going]], 1)
            prefix_mask = torch.cat([attention_mask[going], torch.ones_like(preamble[going])], 1)
            rest = SampleRequest(prefix, prefix_mask, num_samples, dataclasses.replace(options, max_new_tokens=budget),
                                 validation=request.validation)
            second = self.engine.sample(policy, rest)
            continued, continued_logprobs = second.sequences[:, prefix.shape[1] :], second.logprobs
            sync_seconds += second.sync_seconds
            stats |= {k: v for k, v in second.stats.items()}

        longest = 0 if continued is None else continued.shape[1]
        sequences = torch.full((rows * num_samples, prompt_length + width + longest), pad, dtype=input_ids.dtype, device=device)
        sequences[:, :prompt_length] = input_ids.repeat_interleave(num_samples, 0)
        sequences[:, prompt_length : prompt_length + width] = preamble.repeat_interleave(num_samples, 0)
        member_rows = (going.unsqueeze(1) * num_samples + torch.arange(num_samples, device=device)).reshape(-1)
        if continued is not None:
            sequences[member_rows, prompt_length + width :] = continued

        logprobs = None
        if first.logprobs is not None and (continued is None or continued_logprobs is not None):
            first_logprobs = torch.zeros(rows, width, dtype=first.logprobs.dtype, device=device)
            first_logprobs[:, : first.logprobs.shape[1]] = first.logprobs
            logprobs = torch.zeros(sequences.shape[0], width + longest, dtype=first.logprobs.dtype, device=device)
            logprobs[:, :width] = first_logprobs.masked_fill(~preamble_mask, 0.0).repeat_interleave(num_samples, 0)
            if continued is not None:
                logprobs[member_rows, width:] = continued_logprobs

        if self.measure:
            full_mask = torch.cat([attention_mask, preamble_mask.long()], 1)
            token_logprobs = policy.root(
                completion_logprobs, torch.cat([input_ids, preamble], 1), full_mask, prompt_length, options.temperature
            )[0]
            stats["rollout/preamble_p"] = float((token_logprobs.float().exp() * preamble_mask).sum() / preamble_mask.sum())
        stats["rollout/preamble_stopped"] = float(stopped.float().mean())
        return Sampled(sequences, logprobs, sync_seconds, None, stats)


class ForcedFirstTurn(WrappingEngine):
    """One sampled first turn per group of agent episodes, given to all of them (E12): groups that agree on their first
    turn by construction.

    An agent's episodes are sampled turn by turn (``lit_cancel.agents.episodes.run_episodes``), one call of the engine
    per turn with one sample per running episode, a group's ``group_size`` episodes in consecutive rows and identical at
    the first turn (the prompt and the environment's opening). At a training round's first turn this engine samples one
    completion from the first row of each group and gives it to every row of the group; each episode then reads its
    environment's reply and continues on its own. A forced episode is still an exact sample of the policy (first turn,
    then the rest, is the chain rule); only the members of a group are no longer independent.

    The first turn is the first training call after the engine was released (``run_episodes`` releases it after the
    last turn of a round's episodes); every later turn, every validation call and every greedy call goes to the inner
    engine as it is, so validation measures what the plain engine would.

    Args:
        group_size: episodes per group (the datamodule's ``group_size``): consecutive rows of ``group_size`` are forced
            together.
        engine: the inner engine; :class:`~lit_cancel.DecodeLoop` when None. One that samples ahead of the trainer is
            refused (its rounds are not sampled turn by turn on demand).
    """

    def __init__(self, group_size: int = 8, engine: RolloutEngine | None = None):
        if group_size < 2:
            raise ValueError(f"ForcedFirstTurn: group_size must be >= 2, got {group_size}")
        super().__init__(engine)
        self.group_size = group_size
        self.first_turn_next = True
        # how many calls were forced and how many went to the inner engine as they were (tests read them)
        self.forced_calls = self.plain_calls = 0

    def release(self) -> None:
        self.first_turn_next = True
        super().release()

    def sample(self, policy: PolicyWeights, request: SampleRequest) -> Sampled:
        if request.validation or request.greedy or not self.first_turn_next:
            self.plain_calls += 1
            return self.engine.sample(policy, request)
        self.first_turn_next = False
        if request.num_samples != 1:
            raise ValueError(f"ForcedFirstTurn forces the first turn of agent episodes, sampled one per row; this call asks "
                             f"for {request.num_samples} samples per prompt (a single-turn task): use ForcedBranching")
        rows, size = request.input_ids.shape[0], self.group_size
        if rows % size:
            raise ValueError(f"ForcedFirstTurn: {rows} episodes at the first turn do not split into groups of {size}; "
                             f"set group_size to the datamodule's")
        for group in range(rows // size):
            first = group * size
            for row in range(first + 1, first + size):
                if not (torch.equal(request.input_ids[row], request.input_ids[first])
                        and torch.equal(request.attention_mask[row], request.attention_mask[first])):
                    raise ValueError(f"ForcedFirstTurn: group {group}'s episodes open differently (row {row} is not row "
                                     f"{first}, token for token); only identical contexts are forced together")
        self.forced_calls += 1
        leaders = SampleRequest(request.input_ids[::size], request.attention_mask[::size], 1, request.options,
                                validation=False, keep=request.keep)
        sampled = self.engine.sample(policy, leaders)
        return dataclasses.replace(
            sampled,
            sequences=sampled.sequences.repeat_interleave(size, 0),
            logprobs=None if sampled.logprobs is None else sampled.logprobs.repeat_interleave(size, 0),
            steps=None if sampled.steps is None else sampled.steps.repeat_interleave(size, 0),
        )


class GroupSharedTokens(Callback):
    """Logs ``rollout/group_shared_tokens``: the mean length of the prefix a rollout's whole group shares in each training
    micro-batch (the positions where credits cancel, or where ``SharedPositionNoise`` acts); ``ScaffoldProbe`` logs it only
    with a scaffold."""

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx: int) -> None:
        completions = batch.input_ids[:, batch.prompt_length :]
        shared = shared_positions(completions.cpu(), batch.completion_mask.cpu(), batch.group_ids.cpu())
        pl_module.log("rollout/group_shared_tokens", shared.sum(1).float().mean(), on_step=True, on_epoch=False)


class PreambleDrift(Callback):
    """Accumulated drift where forced branching shares: ``KL(start || now)`` of the next-token distributions at
    the positions that predict a preamble's tokens, on fixed probe contexts.

    ``health/shared_kl`` (``LearningTaxMonitor``) is the movement of one optimizer step at the step's own shared
    contexts; a random walk that uncancelled credit drives shows in what the steps add up to instead. At the
    start of training this callback takes the first ``num_problems`` held-out prompts and one preamble of each,
    sampled by the policy at its temperature in a forked random state seeded by ``seed`` (so the training's
    sample stream is untouched, and every run from the same model probes the same contexts), and keeps the
    policy's next-token distributions at the ``preamble_tokens`` positions that predict the preamble (up to its
    stop token). Every ``every_n_steps`` optimizer steps it logs, on the same contexts:

    * ``probe/preamble_kl``: mean ``KL(start || now)``;
    * ``probe/preamble_entropy``: mean entropy of the next-token distribution now;
    * ``probe/preamble_p``: mean probability now of the probe preambles' tokens.

    Args:
        preamble_tokens: positions probed per preamble; None: the module's ``ForcedBranching`` engine's.
        num_problems: held-out prompts probed.
        every_n_steps: how often to probe, in optimizer steps.
        seed: seed of the probe preambles.
    """

    def __init__(self, preamble_tokens: int | None = None, num_problems: int = 32, every_n_steps: int = 5, seed: int = 0):
        if num_problems < 1 or every_n_steps < 1 or (preamble_tokens is not None and preamble_tokens < 1):
            raise ValueError(f"PreambleDrift: preamble_tokens, num_problems and every_n_steps must be >= 1, got "
                             f"{preamble_tokens}, {num_problems}, {every_n_steps}")
        self.preamble_tokens, self.num_problems, self.every_n_steps, self.seed = preamble_tokens, num_problems, every_n_steps, seed
        self.contexts: tuple[Tensor, Tensor, Tensor, Tensor] | None = None
        self.start: Tensor | None = None
        self.history: list[tuple[int, dict[str, float]]] = []

    def _distributions(self, trainer, pl_module) -> Tensor:
        from lit_cancel.callbacks.learning_tax import measuring

        input_ids, attention_mask, positions, _ = self.contexts
        with measuring(trainer, pl_module):
            return pl_module.next_token_logprobs(input_ids, attention_mask, positions).float()

    def on_train_start(self, trainer, pl_module) -> None:
        from lit_cancel.rounds.sample import encode_prompts

        tokens = self.preamble_tokens
        if tokens is None:
            if not isinstance(pl_module.engine, ForcedBranching):
                raise ValueError("PreambleDrift: give preamble_tokens, or use the ForcedBranching engine")
            tokens = pl_module.engine.preamble_tokens
        records = trainer.datamodule.task.val_records()[: self.num_problems]
        prompts = encode_prompts(pl_module.tokenizer, records)
        devices = [pl_module.device] if pl_module.device.type == "cuda" else []
        with torch.random.fork_rng(devices=devices), trainer.precision_plugin.forward_context():
            torch.manual_seed(self.seed)
            generation = pl_module.rollout(prompts["input_ids"].to(pl_module.device), prompts["attention_mask"].to(pl_module.device), 1)
        width = generation.prompt_length + tokens
        input_ids = generation.input_ids[:, :width]
        attention_mask = generation.attention_mask[:, :width]
        present = generation.completion_mask[:, :tokens].bool()
        if present.shape[1] < tokens:
            present = torch.nn.functional.pad(present, (0, tokens - present.shape[1]))
        rows, columns = torch.nonzero(present, as_tuple=True)
        # the distribution of completion token j is predicted at sequence position P + j - 1
        positions = torch.stack([rows, columns + generation.prompt_length - 1], 1)
        targets = input_ids[rows, columns + generation.prompt_length]
        self.contexts = (input_ids, attention_mask, positions, targets)
        self.start = self._distributions(trainer, pl_module)

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx: int) -> None:
        step = trainer.global_step
        if self.start is None or step % self.every_n_steps != 0 or (self.history and self.history[-1][0] == step):
            return
        now = self._distributions(trainer, pl_module)
        targets = self.contexts[3]
        kl = (self.start.exp() * (self.start - now)).sum(-1).mean()
        entropy = -(now.exp() * now).sum(-1).mean()
        probability = now.gather(1, targets.unsqueeze(1)).exp().mean()
        values = {"probe/preamble_kl": float(kl), "probe/preamble_entropy": float(entropy), "probe/preamble_p": float(probability)}
        self.history.append((step, values))
        for logger in trainer.loggers:
            logger.log_metrics(values, step=step)


# ----------------------------------------------------------------------------------------------- design measurements
# (scaffold, spread, preamble_tokens): E10's choice is (0, 8, 8); docs/experiments.md's E10 table is this list at seed 1, 96 prompts
SETTINGS = [(0, 0, 8), (0, 0, 12), (0, 4, 8), (0, 4, 12), (0, 8, 8), (0, 8, 10), (0, 8, 12), (0, 8, 16), (0, 8, 24),
            (12, 8, 12), (12, 8, 16), (12, 8, 24), (24, 8, 24), (24, 8, 32)]


@torch.no_grad()
def measure(model_path: str, scaffold: int, spread: int, preamble_tokens: int, prompts: int = 96, group_size: int = 8,
            seed: int = 1, max_new_tokens: int = 96) -> dict[str, float]:
    """Forced-branching groups of ``prompts`` training problems, from ``model_path`` at the knob setting: the preamble's
    mean token probability, the share of groups with mixed rewards, the shared prefix, the completion lengths."""
    from lit_cancel import RLModule, ScaffoldedAdditionTask
    from lit_cancel.rounds.sample import encode_prompts
    from lit_cancel.rounds.score import correctness, score

    task = ScaffoldedAdditionTask(scaffold=scaffold, spread=spread, train_size=20000, val_size=200)
    engine = ForcedBranching(preamble_tokens)
    module = RLModule(model_path, max_new_tokens=max_new_tokens, engine=engine)
    records = task.train_records()[:prompts]
    encoded = encode_prompts(module.tokenizer, records)
    torch.manual_seed(seed)
    generation = module.rollout(encoded["input_ids"], encoded["attention_mask"], group_size)
    repeated = [r for r in records for _ in range(group_size)]
    rewards = score(task, repeated, generation.texts).view(prompts, group_size)
    correct = correctness(task, repeated, generation.texts).float()
    group_ids = torch.arange(prompts).repeat_interleave(group_size)
    completions = generation.input_ids[:, generation.prompt_length :]
    shared = shared_positions(completions, generation.completion_mask, group_ids).sum(1).float()
    lengths = generation.completion_mask.sum(1).float().view(prompts, group_size)
    return {
        "preamble_p": generation.stats["rollout/preamble_p"],
        "mixed_groups": float((rewards != rewards[:, :1]).any(1).float().mean()),
        "accuracy": float(correct.mean()),
        "shared_tokens": float(shared.mean()),
        "completion_len": float(lengths.mean()),
        "len_sd_within_group": float(lengths.std(1).mean()),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--measure", action="store_true", help="print the design measurements at a few settings")
    parser.add_argument("--model", default="embedded:tiny-scaffold")
    parser.add_argument("--prompts", type=int, default=96)
    parser.add_argument("--seed", type=int, default=1)
    args = parser.parse_args()
    if not args.measure:
        parser.print_help()
        return
    print("model | scaffold | spread | K | preamble p | mixed groups | accuracy | shared tokens | completion len | len sd in group")
    for scaffold, spread, tokens in SETTINGS:
        values = measure(args.model, scaffold, spread, tokens, prompts=args.prompts, seed=args.seed)
        print(f"{args.model} | {scaffold} | {spread} | {tokens} | " + " | ".join(
            "nan" if math.isnan(v) else f"{v:.3f}" for v in values.values()))


if __name__ == "__main__":
    main()
