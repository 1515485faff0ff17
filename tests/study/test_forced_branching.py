"""Forced branching (benchmarks/study/forced_branching.py, E10): groups that share a sampled preamble by construction,
its padding and stop-token rule, the learning tax such groups give, and validation left to the plain decode loop."""

import os
import subprocess
import sys
from pathlib import Path

import lightning as L
import pytest
import torch
from forced_branching import ForcedBranching, GroupSharedTokens, PreambleDrift
from lab.parts import SharedPositionNoise
from lit_cancel.callbacks.learning_tax import shared_positions as monitor_shared_positions

from lit_cancel import RLModule, RolloutDataModule, ScaffoldedAdditionTask
from lit_cancel.batch import RolloutBatch
from lit_cancel.engines import RolloutEngine, Sampled, SampleRequest, SamplingOptions
from lit_cancel.objectives.audit import credits, learning_tax
from lit_cancel.objectives.audit import shared_positions as audit_shared_positions
from lit_cancel.objectives.presets import PRESETS
from lit_cancel.rounds.sample import encode_prompts

ROOT = Path(__file__).resolve().parents[2]
STUDY = ROOT / "benchmarks" / "study"

K = 16
PAD, EOS = 0, 1


@pytest.fixture(scope="module")
def module():
    return RLModule("embedded:tiny-scaffold", max_new_tokens=96, engine=ForcedBranching(K))


@pytest.fixture(scope="module")
def task():
    return ScaffoldedAdditionTask(scaffold=0, spread=8, train_size=64, val_size=8)


@pytest.fixture(scope="module")
def generation(module, task):
    records = task.train_records()[:4]
    prompts = encode_prompts(module.tokenizer, records)
    torch.manual_seed(0)
    return module.rollout(prompts["input_ids"], prompts["attention_mask"], 6), records, prompts


def groups(generation, size=6):
    return torch.arange(generation.input_ids.shape[0] // size).repeat_interleave(size)


def test_every_member_of_a_group_starts_with_the_same_sampled_preamble_and_the_continuations_differ(generation):
    generation, records, prompts = generation
    completions = generation.input_ids[:, generation.prompt_length :].view(4, 6, -1)
    assert generation.stats["rollout/preamble_stopped"] == 0.0
    assert (completions[:, :, :K] == completions[:, :1, :K]).all()
    # the continuations are sampled apart: no group is six copies of one completion
    for group in completions:
        assert len({tuple(row.tolist()) for row in group}) > 1
    # the preambles themselves differ between prompts (sampled, not a fixed text)
    assert len({tuple(group[0, :K].tolist()) for group in completions}) == 4


def test_rows_are_prompt_then_preamble_then_continuation_right_padded_after_the_stop_token(module, generation):
    generation, records, prompts = generation
    rows, width = generation.input_ids.shape
    assert rows == 4 * 6 and generation.prompt_length == prompts["input_ids"].shape[1]
    assert width - generation.prompt_length <= module.max_new_tokens
    assert (generation.input_ids[:, : generation.prompt_length] == prompts["input_ids"].repeat_interleave(6, 0)).all()
    mask = generation.completion_mask.bool()
    lengths = mask.sum(1)
    # ones, then zeros; each finished completion ends at its stop token and holds padding after it
    assert (mask == (torch.arange(mask.shape[1]) < lengths.unsqueeze(1))).all()
    completions = generation.input_ids[:, generation.prompt_length :]
    stops = torch.tensor(module.stop_token_ids)
    for row, length in enumerate(lengths.tolist()):
        assert torch.isin(completions[row, :length], stops).sum() <= 1
        assert (completions[row, length:] == module.tokenizer.pad_token_id).all()
    assert lengths.min() > K
    assert len(generation.texts) == rows


def test_the_shared_prefix_the_learning_tax_monitor_finds_covers_the_preamble(generation):
    generation, _, _ = generation
    completions = generation.input_ids[:, generation.prompt_length :]
    for shared_positions in (monitor_shared_positions, audit_shared_positions):
        shared = shared_positions(completions, generation.completion_mask, groups(generation))
        assert (shared.sum(1) >= K).all()
        assert shared[:, :K].all()


def rollout_batch(module, generation, rewards, objective):
    """The generation as a training batch, on-policy (old log-probs are the current ones)."""
    mask = generation.attention_mask
    logprobs = module.token_logprobs(generation.input_ids, mask, generation.prompt_length).detach()
    rewards = torch.tensor(rewards, dtype=torch.float)
    batch = RolloutBatch(
        input_ids=generation.input_ids, attention_mask=mask, completion_mask=generation.completion_mask,
        prompt_length=generation.prompt_length, rewards=rewards, advantages=objective.advantages(rewards.view(-1, 6)).reshape(-1),
        group_ids=groups(generation), old_logprobs=logprobs, ref_logprobs=None, sampler_logprobs=None,
        step_sequences=float(len(rewards)), step_tokens=float(generation.completion_mask.sum()),
    )
    return logprobs, batch


def tax(module, generation, objective):
    rewards = [1.0, 0.0, 0.0, 1.0, 1.0, 0.0] * 4
    logprobs, batch = rollout_batch(module, generation, rewards, objective)
    completions = generation.input_ids[:, generation.prompt_length :]
    return learning_tax(credits(objective, logprobs, batch)[1], completions, generation.completion_mask, groups(generation))


def test_dfpo_cancels_exactly_on_the_preamble_and_grpo_does_not_on_unequal_lengths(module, generation):
    generation, _, _ = generation
    lengths = generation.completion_mask.sum(1).view(4, 6)
    assert (lengths != lengths[:, :1]).any()  # a group whose members differ in length
    assert tax(module, generation, PRESETS["DFPOMin"]()) < 1e-6
    grpo = tax(module, generation, PRESETS["GRPO"]())
    assert grpo > 1e-4
    # E8's noise arm acts on the positions forced branching makes shared: DFPOMin stops cancelling there
    noisy = PRESETS["DFPOMin"]()
    noisy.trust_region = SharedPositionNoise(sigma=1.0, seed=0)
    assert tax(module, generation, noisy) > grpo


def test_the_noise_weights_sit_on_the_preamble_positions(module, generation):
    generation, _, _ = generation
    _, batch = rollout_batch(module, generation, [1.0, 0.0] * 12, PRESETS["DFPOMin"]())
    mask = generation.completion_mask.float()
    weights = SharedPositionNoise(sigma=1.0, seed=3)(torch.zeros_like(mask), mask, batch)
    assert (weights[:, :K] != 1).all()  # a log-normal draw is never exactly 1
    shared = audit_shared_positions(generation.input_ids[:, generation.prompt_length :], mask, groups(generation))
    assert (weights[~shared] == mask[~shared]).all()


class Scripted(RolloutEngine):
    """Returns fixed rows: call 1 (preambles, 1 sample) and call 2 (continuations) from the given token lists."""

    def __init__(self, preambles, continuations):
        self.calls, self.preambles, self.continuations = [], preambles, continuations

    def sample(self, policy, request) -> Sampled:
        budget = request.options.max_new_tokens
        self.calls.append((request.input_ids.clone(), request.attention_mask.clone(), request.num_samples, budget))
        pieces = self.preambles if len(self.calls) == 1 else self.continuations
        pieces = [p[:budget] for p in pieces]
        width = max(map(len, pieces))
        input_ids = request.input_ids
        rows = torch.full((len(pieces), input_ids.shape[1] + width), PAD)
        rows[:, : input_ids.shape[1]] = input_ids.repeat_interleave(request.num_samples, 0)
        for row, piece in enumerate(pieces):
            rows[row, input_ids.shape[1] : input_ids.shape[1] + len(piece)] = torch.tensor(piece)
        return Sampled(rows)


def options(max_new_tokens=10):
    return SamplingOptions(temperature=1.0, top_p=1.0, max_new_tokens=max_new_tokens, stop_token_ids=(EOS,), pad_token_id=PAD)


def test_a_preamble_that_stops_early_is_the_whole_completion_of_every_member():
    # prompt 0's preamble ends at its stop token; prompt 1's runs its 3 tokens and is continued twice
    inner = Scripted(preambles=[[5, EOS], [7, 8, 9]], continuations=[[20, 21, EOS], [30, EOS]])
    engine = ForcedBranching(3, engine=inner, measure=False)
    prompts = torch.tensor([[PAD, 3], [4, 4]])
    mask = torch.tensor([[0, 1], [1, 1]])
    request = SampleRequest(prompts, mask, 2, options())
    sampled = engine.sample(None, request)
    assert sampled.sequences.tolist() == [
        [PAD, 3, 5, EOS, PAD, PAD, PAD, PAD],
        [PAD, 3, 5, EOS, PAD, PAD, PAD, PAD],
        [4, 4, 7, 8, 9, 20, 21, EOS],
        [4, 4, 7, 8, 9, 30, EOS, PAD],
    ]
    assert sampled.logprobs is None and sampled.stats == {"rollout/preamble_stopped": 0.5}
    # the preamble call asks for 3 tokens of one sample; the continuation call gets prompt 1 + its preamble, the rest of
    # the budget and the group size; the request's own budget is left as it was
    (_, _, n1, budget1), (ids2, mask2, n2, budget2) = inner.calls
    assert (n1, budget1, n2, budget2) == (1, 3, 2, 7)
    assert ids2.tolist() == [[4, 4, 7, 8, 9]] and mask2.tolist() == [[1, 1, 1, 1, 1]]
    assert request.options.max_new_tokens == 10


def test_greedy_and_single_samples_go_to_the_inner_engine_and_the_budget_is_checked():
    inner = Scripted(preambles=[[5, EOS]] * 4, continuations=[])
    engine = ForcedBranching(3, engine=inner, measure=False)
    engine.sample(None, SampleRequest(torch.tensor([[3]]), torch.tensor([[1]]), 4, options(), greedy=True))
    assert engine.plain_calls == 1 and engine.branched_calls == 0 and inner.calls[0][2] == 4
    with pytest.raises(ValueError, match="preamble_tokens"):
        ForcedBranching(10).check(None, options(max_new_tokens=10))
    with pytest.raises(ValueError, match="preamble_tokens"):
        ForcedBranching(0)


def test_training_rollouts_branch_and_validation_samples_plainly(tmp_path):
    engine, drift = ForcedBranching(K), PreambleDrift(num_problems=4, every_n_steps=1)
    module = RLModule("embedded:tiny-scaffold", max_new_tokens=96, val_samples=2, engine=engine)
    data = RolloutDataModule(ScaffoldedAdditionTask(scaffold=0, spread=8, train_size=64, val_size=4), prompts_per_round=2,
                             group_size=4, val_batch_size=4)
    trainer = L.Trainer(
        max_steps=2, accelerator="cpu", devices=1, logger=False, enable_progress_bar=False, enable_model_summary=False,
        enable_checkpointing=False, default_root_dir=tmp_path, log_every_n_steps=1, val_check_interval=2,
        num_sanity_val_steps=0, check_val_every_n_epoch=None, callbacks=[GroupSharedTokens(), drift],
    )
    trainer.fit(module, datamodule=data)
    # two rounds branched; one validation after step 2: a greedy and a sampled call, both to the decode loop; and the
    # probe's one sample per prompt
    assert engine.branched_calls == 2 and engine.plain_calls == 3
    logged = trainer.logged_metrics
    assert 0.0 < float(logged["rollout/preamble_p"]) <= 1.0 and float(logged["rollout/preamble_stopped"]) == 0.0
    assert "val/accuracy" in trainer.callback_metrics
    assert float(logged["rollout/group_shared_tokens"]) >= K
    # the probe: 4 preambles of K tokens, measured after each step; the policy moved away from where it started
    assert len(drift.contexts[2]) == 4 * K and drift.start.shape == (4 * K, len(module.tokenizer))
    assert [step for step, _ in drift.history] == [1, 2]
    assert 0 < drift.history[0][1]["probe/preamble_kl"] and 0 < drift.history[1][1]["probe/preamble_p"] < 1


def test_the_cli_loads_the_engine_by_class_path():
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(STUDY), os.environ.get("PYTHONPATH")]))}
    script = Path(sys.executable).parent / "lit-cancel"
    result = subprocess.run(
        [str(script), "fit", "--config", "configs/scaffold.yaml", "--model.init_args.engine=forced_branching.ForcedBranching",
         "--model.init_args.engine.init_args.preamble_tokens=24", "--print_config"],
        cwd=ROOT, env=env, capture_output=True, text=True, timeout=300,
    )
    assert result.returncode == 0, result.stderr[-2000:]
    assert "forced_branching.ForcedBranching" in result.stdout and "preamble_tokens: 24" in result.stdout
