"""E12, agreement at a fixed policy: the forced shared first turn (forced_branching.ForcedFirstTurn), the count of groups
that end there, and the runs its pre-registration declares."""

import os
import subprocess
import sys
from functools import partial
from pathlib import Path

import lightning as L
import pytest
import torch
import yaml
from forced_branching import ForcedFirstTurn
from lab import runs
from lab.parts import FinalFirstTurn, first_turn_agreement, groups_ending_at_first_turn
from test_e11 import ANSWER, ANSWER_MASK, CALL, CALL_MASK, Logged, episodes

from lit_cancel import GRPO, RLModule, RolloutDataModule
from lit_cancel.agents import ToolAdditionTask
from lit_cancel.engines import RolloutEngine, Sampled, SampleRequest, SamplingOptions
from lit_cancel.rounds.sample import encode_prompts

ROOT = Path(__file__).resolve().parents[2]
STUDY = ROOT / "benchmarks" / "study"

OPTIONS = SamplingOptions(temperature=1.0, top_p=1.0, max_new_tokens=3, stop_token_ids=(2,), pad_token_id=0)


class Recorder(RolloutEngine):
    """An inner engine that writes, after each row, its index in the call and the call's number, and keeps the requests."""

    def __init__(self):
        self.requests: list[SampleRequest] = []
        self.released = 0

    def sample(self, policy, request: SampleRequest) -> Sampled:
        self.requests.append(request)
        rows = request.input_ids.shape[0] * request.num_samples
        written = torch.stack([torch.arange(rows) + 10, torch.full((rows,), len(self.requests))], 1)
        sequences = torch.cat([request.input_ids.repeat_interleave(request.num_samples, 0), written], 1)
        return Sampled(sequences, logprobs=-torch.arange(rows * 2, dtype=torch.float).view(rows, 2), steps=torch.arange(rows))

    def release(self) -> None:
        self.released += 1


def request(contexts: list[list[int]], **options) -> SampleRequest:
    ids = torch.tensor(contexts)
    return SampleRequest(ids, torch.ones_like(ids), 1, OPTIONS, **options)


GROUPS = [[5, 6], [5, 6], [5, 6], [7, 8], [7, 8], [7, 8]]  # two groups of three episodes at their first turn


def test_the_first_turn_is_one_draw_from_each_groups_first_row_given_to_every_row_of_the_group():
    inner = Recorder()
    engine = ForcedFirstTurn(group_size=3, engine=inner)
    sampled = engine.sample(None, request(GROUPS, keep=True))
    asked = inner.requests[0]
    # one sample of each group's first row, with the options as given: the policy's own sampler, one draw per group
    assert asked.input_ids.tolist() == [[5, 6], [7, 8]] and asked.num_samples == 1
    assert asked.options == OPTIONS and not asked.validation and not asked.greedy and asked.keep
    assert sampled.sequences.tolist() == [[5, 6, 10, 1]] * 3 + [[7, 8, 11, 1]] * 3
    assert sampled.logprobs.tolist() == [[0.0, -1.0]] * 3 + [[-2.0, -3.0]] * 3
    assert sampled.steps.tolist() == [0, 0, 0, 1, 1, 1]
    assert engine.forced_calls == 1 and engine.plain_calls == 0


def test_later_turns_validation_and_greedy_calls_are_the_inner_engines_and_a_release_starts_a_new_first_turn():
    inner = Recorder()
    engine = ForcedFirstTurn(group_size=3, engine=inner)
    validation = request(GROUPS, validation=True)
    greedy = request(GROUPS, greedy=True)
    assert engine.sample(None, validation).sequences.shape[0] == 6  # neither forced nor counted as the first turn
    engine.sample(None, greedy)
    engine.sample(None, request(GROUPS))  # the round's first turn
    later = request([[5, 6, 10, 1, 9], [5, 6, 10, 1, 9]])  # the turns that follow: any rows, as they are
    assert engine.sample(None, later).sequences[:, 5].tolist() == [10, 11]
    assert inner.requests[0] is validation and inner.requests[1] is greedy and inner.requests[3] is later
    assert inner.requests[2].input_ids.shape[0] == 2
    engine.release()
    assert inner.released == 1
    engine.sample(None, request(GROUPS))
    assert inner.requests[4].input_ids.shape[0] == 2  # forced again
    assert (engine.forced_calls, engine.plain_calls) == (2, 3)


def test_rows_that_differ_within_a_group_and_calls_that_are_not_agent_turns_are_refused():
    different = [row[:] for row in GROUPS]
    different[4] = [7, 9]
    with pytest.raises(ValueError, match=r"group 1's episodes open differently \(row 4 is not row 3"):
        ForcedFirstTurn(group_size=3, engine=Recorder()).sample(None, request(different))
    with pytest.raises(ValueError, match="do not split into groups of 4"):
        ForcedFirstTurn(group_size=4, engine=Recorder()).sample(None, request(GROUPS))
    several = SampleRequest(torch.tensor([[5, 6]]), torch.ones(1, 2, dtype=torch.long), 8, OPTIONS)
    with pytest.raises(ValueError, match="8 samples per prompt"):
        ForcedFirstTurn(group_size=8, engine=Recorder()).sample(None, several)
    with pytest.raises(ValueError, match="group_size must be >= 2"):
        ForcedFirstTurn(group_size=1)

    class Ahead(Recorder):
        max_staleness = 1

    with pytest.raises(ValueError, match="samples ahead"):
        ForcedFirstTurn(engine=Ahead())


def test_groups_whose_every_episode_ends_at_its_first_turn_are_counted_and_logged():
    # group 0 answers at once in every episode, group 1 calls the tool in one of two, group 2 is one episode (not counted)
    batch = episodes([ANSWER, ANSWER, ANSWER, CALL, ANSWER], [ANSWER_MASK] * 3 + [CALL_MASK, ANSWER_MASK], [0, 0, 1, 1, 2])
    assert groups_ending_at_first_turn(batch) == (2.0, 1.0)
    module = Logged()
    FinalFirstTurn().on_train_batch_end(None, module, None, batch, 0)
    assert module.values == {"rollout/forced_final_first_turn": 0.5}


class Rounds(L.Callback):
    def __init__(self):
        self.batches = []

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
        self.batches.append(batch)


def test_a_forced_run_trains_on_groups_whose_episodes_all_open_with_one_sampled_turn():
    torch.manual_seed(0)
    engine = ForcedFirstTurn(group_size=4)
    module = RLModule("embedded:tiny-agent", max_new_tokens=23, objective=GRPO(), engine=engine,
                      optimizer=partial(torch.optim.AdamW, lr=1e-3))
    data = RolloutDataModule(ToolAdditionTask(train_size=64, val_size=4), prompts_per_round=4, group_size=4,
                             mini_batches_per_round=1, seed=3)
    seen = Rounds()
    trainer = L.Trainer(max_steps=2, accelerator="cpu", devices=1, logger=False, enable_progress_bar=False,
                        enable_model_summary=False, enable_checkpointing=False, limit_val_batches=0, callbacks=[seen])
    trainer.fit(module, datamodule=data)
    assert engine.forced_calls == 2  # one first turn per round, each round's later turns plain
    assert engine.plain_calls >= 2, "the tool-calling warm start takes more than one turn"
    first_turns = set()
    for batch in seen.batches:
        groups, agreeing = first_turn_agreement(batch)
        assert groups == agreeing == 4
        first_turns |= {tuple(row) for row in batch.input_ids[:, batch.prompt_length:][batch.completion_mask[:, 0].bool(), :3].tolist()}
    assert len(first_turns) > 1, "first turns are sampled, not one fixed text"
    # the unforced engine's groups on the same prompts do not all agree: the forcing is what made them
    independent = RLModule("embedded:tiny-agent", max_new_tokens=23)
    task = ToolAdditionTask(train_size=64, val_size=4)
    records = [record for record in task.train_records()[:8] for _ in range(4)]
    prompts = encode_prompts(independent.tokenizer, records)
    torch.manual_seed(0)
    generation = task.rollout(independent, records, prompts["input_ids"], prompts["attention_mask"], num_samples=1)
    sampled = episodes_of(generation, groups=8, size=4)
    assert first_turn_agreement(sampled)[1] < 8


def episodes_of(generation, groups: int, size: int):
    from lit_cancel.batch import RolloutBatch

    rows = groups * size
    return RolloutBatch(input_ids=generation.input_ids, attention_mask=generation.attention_mask,
                        completion_mask=generation.completion_mask, prompt_length=generation.prompt_length,
                        rewards=torch.zeros(rows), advantages=torch.zeros(rows),
                        group_ids=torch.arange(groups).repeat_interleave(size))


def test_e12_runs_the_preregistered_arms_seeds_and_warm_starts_and_its_pilot_four_inert_steps():
    declared = runs.experiment_runs("E12", [0])
    assert len(declared) == 114 and declared == runs.experiment_runs("E12", list(range(40)))
    counts = {}
    for run in declared:
        counts[(run.arm, run.setting)] = counts.get((run.arm, run.setting), 0) + 1
    assert counts == {(arm, setting): n for setting in ("mixed-tool50", "agreeing-tool95")
                      for arm, n in (("GRPO-forced", 26), ("GRPO-independent", 26), ("DFPOMin-forced", 5))}
    by_key = {(run.arm, run.setting, run.seed): run for run in declared}
    forced, independent = by_key[("GRPO-forced", "mixed-tool50", 212)], by_key[("GRPO-independent", "mixed-tool50", 212)]
    e11 = runs.e11_overrides("mixed", "GRPO")
    assert independent.overrides == e11 and independent.config == "configs/quickstart-agent.yaml"
    assert forced.overrides == (*e11, "--model.init_args.engine=forced_branching.ForcedFirstTurn",
                                "--model.init_args.engine.init_args.group_size=8", "--trainer.callbacks+=lab.parts.FinalFirstTurn")
    assert "--model.init_args.objective=lit_cancel.DFPOMin" in by_key[("DFPOMin-forced", "agreeing-tool95", 204)].overrides
    assert forced.path == runs.RESULTS / "E12" / "GRPO-forced-mixed-tool50-seed212.json"
    pilot = runs.experiment_runs("E12P", [])
    assert {(run.arm, run.setting, run.seed) for run in pilot} == {
        (arm, setting, 1000) for arm in ("GRPO-forced", "GRPO-independent") for setting in ("mixed-tool50", "agreeing-tool95")}
    assert all(run.overrides[-3:] == ("--trainer.max_steps=4", "--model.init_args.optimizer.init_args.lr=1e-12",
                                      "--trainer.limit_val_batches=0") for run in pilot)


def test_the_cli_builds_a_forced_run_of_the_pilot_with_its_engine_and_callbacks():
    run = next(r for r in runs.experiment_runs("E12P", []) if r.arm == "GRPO-forced")
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(STUDY), os.environ.get("PYTHONPATH")]))}
    command = [str(Path(sys.executable).parent / "lit-cancel"), *run.command("runs")[1:], "--print_config"]
    result = subprocess.run(command, cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr[-2000:]
    printed = yaml.safe_load(result.stdout)
    assert printed["model"]["init_args"]["engine"] == {
        "class_path": "forced_branching.ForcedFirstTurn", "init_args": {"group_size": 8, "engine": None}}
    assert printed["data"]["init_args"]["group_size"] == 8  # the groups the engine forces are the datamodule's
    assert printed["trainer"]["max_steps"] == 4 and printed["model"]["init_args"]["optimizer"]["init_args"]["lr"] == 1e-12
    assert {"lab.parts.FirstTurnAgreement", "lab.parts.FinalFirstTurn"} <= {
        callback["class_path"] for callback in printed["trainer"]["callbacks"]}
