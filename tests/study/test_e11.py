"""E11, cancellation across turns: the runs its pre-registration declares, its warm starts, and its manipulation check."""

import pytest
import torch
from lab import runs
from lab.parts import FirstTurnAgreement, first_turn_agreement

from lit_cancel.batch import RolloutBatch

STOP, ENV, PAD = 2, 9, 0


def episodes(completions: list[list[int]], masks: list[list[int]], group_ids: list[int]) -> RolloutBatch:
    """Episodes after a one-token prompt; the policy's tokens have mask 1, the environment's (``ENV``) 0 and attention 1,
    padding (``PAD``) 0 in both."""
    tokens, mask = torch.tensor(completions), torch.tensor(masks)
    attention = ((mask == 1) | (tokens == ENV)).long()
    rows = len(completions)
    return RolloutBatch(
        input_ids=torch.cat([torch.ones(rows, 1, dtype=torch.long), tokens], 1),
        attention_mask=torch.cat([torch.ones(rows, 1, dtype=torch.long), attention], 1),
        completion_mask=mask, prompt_length=1, rewards=torch.zeros(rows), advantages=torch.zeros(rows),
        group_ids=torch.tensor(group_ids),
    )


CALL, CALL_MASK = [7, 8, STOP, ENV, 4, STOP], [1, 1, 1, 0, 1, 1]
ANSWER, ANSWER_MASK = [4, STOP, PAD, PAD, PAD, PAD], [1, 1, 0, 0, 0, 0]


def mixed_batch() -> RolloutBatch:
    """Group 0: three episodes that call the tool alike, one answers differently after the reply; group 1: one answers at
    once, one calls; group 2: one episode alone."""
    return episodes(
        [CALL, [7, 8, STOP, ENV, 5, STOP], CALL, ANSWER, CALL, ANSWER],
        [CALL_MASK, CALL_MASK, CALL_MASK, ANSWER_MASK, CALL_MASK, ANSWER_MASK],
        [0, 0, 0, 1, 1, 2],
    )


def test_a_group_agrees_when_every_first_turn_is_the_same_and_a_group_of_one_is_not_counted():
    assert first_turn_agreement(mixed_batch()) == (2.0, 1.0)  # group 0 agrees (later turns may differ), group 1 does not


def test_a_first_turn_that_goes_on_past_anothers_end_is_another_turn():
    batch = episodes([[7, STOP, ENV, 4], [7, STOP, 5, STOP]], [[1, 1, 0, 1], [1, 1, 1, 1]], [0, 0])
    assert first_turn_agreement(batch) == (1.0, 0.0)


class Logged:
    def __init__(self) -> None:
        self.values: dict[str, float] = {}

    def log(self, name: str, value: float, **_: object) -> None:
        self.values[name] = float(value)


def test_the_callback_logs_the_agreement_and_the_share_of_policy_tokens_the_whole_group_shares():
    module = Logged()
    FirstTurnAgreement().on_train_batch_end(None, module, None, mixed_batch(), 0)
    # shared: group 0's first turn (3 policy tokens per episode, the reply is context), nothing in groups 1 and 2;
    # policy tokens: 3 x 5 + (2 + 5) + 2 = 24
    assert module.values == {"rollout/first_turn_agreement": 0.5, "rollout/shared_policy_tokens": pytest.approx(9 / 24)}


def test_e11_runs_the_preregistered_arms_warm_starts_and_seeds_whatever_seeds_asks():
    declared = runs.experiment_runs("E11", [0])
    assert len(declared) == 60 and declared == runs.experiment_runs("E11", list(range(40)))
    assert {(run.arm, run.setting, run.seed) for run in declared} == {
        (arm, setting, seed) for arm in ("GRPO", "DrGRPO", "DFPOMin") for setting in ("mixed-tool50", "agreeing-tool95")
        for seed in range(10)
    }
    run = next(r for r in declared if (r.arm, r.setting, r.seed) == ("DrGRPO", "agreeing-tool95", 3))
    command = run.command("<tmp>")
    assert command[:4] == ["lit-cancel", "fit", "--config", "configs/quickstart-agent.yaml"]
    assert "--seed_everything=3" in command and "--data.init_args.seed=3" in command
    assert run.overrides == (
        "--model.init_args.model_path=benchmarks/study/results/E11/warmstart-agreeing-tool95",
        "--model.init_args.objective=lit_cancel.DrGRPO", "--trainer.max_steps=40", "--trainer.val_check_interval=40",
        "--model.init_args.val_samples=4", "--model.init_args.optimizer.init_args.lr=0.0002",
        "--trainer.callbacks+=lab.parts.FirstTurnAgreement",
    )
    assert run.path == runs.RESULTS / "E11" / "DrGRPO-agreeing-tool95-seed3.json"


def test_the_two_warm_starts_are_one_recipe_that_differs_in_its_tool_share_alone():
    mixed, agreeing = (runs.sft_agent_command(runs.E11_TOOL_SHARES[name], runs.e11_warmstart(name), "<tmp>")
                       for name in ("mixed", "agreeing"))
    differ = [(a, b) for a, b in zip(mixed, agreeing) if a != b]
    assert len(mixed) == len(agreeing) and differ == [
        ("--data.init_args.task.init_args.tool_share=0.5", "--data.init_args.task.init_args.tool_share=0.95"),
        ("--model.init_args.output_dir=benchmarks/study/results/E11/warmstart-mixed-tool50",
         "--model.init_args.output_dir=benchmarks/study/results/E11/warmstart-agreeing-tool95"),
    ]
    assert mixed[3] == "configs/sft-agent.yaml"


def test_the_runner_trains_each_missing_warm_start_once_and_only_those_its_runs_name(tmp_path, monkeypatch):
    built = []
    monkeypatch.setattr(runs, "ROOT", tmp_path)
    monkeypatch.setattr(runs, "build_e11_warmstart", lambda warm_start, threads=None: built.append((warm_start, threads)))
    (tmp_path / runs.e11_warmstart("mixed")).mkdir(parents=True)
    commands = [" ".join(run.command("<tmp>")) for run in runs.experiment_runs("E11", [])]
    runs.ensure_warmstart(commands, threads=1)
    assert built == [("agreeing", 1)]
    built.clear()
    runs.ensure_warmstart([" ".join(run.command("<tmp>")) for run in runs.experiment_runs("E10C", [])])
    assert built == []


def test_a_warm_start_is_stored_with_its_command_provenance_and_the_hash_of_its_weights(tmp_path, monkeypatch):
    import hashlib
    import json

    called = []

    def fake_fit(command, threads=None):  # the recipe's run: it saves the weights into its output folder
        called.append((command, threads))
        folder = tmp_path / runs.e11_warmstart("agreeing")
        folder.mkdir(parents=True)
        (folder / "model.safetensors").write_bytes(b"weights")
        return {"val/accuracy": [[400, 0.5]]}, 12.34, " ".join(command)

    monkeypatch.setattr(runs, "ROOT", tmp_path)
    monkeypatch.setattr(runs, "fit", fake_fit)
    monkeypatch.setattr(runs, "provenance", lambda threads: {"commit": "abc", "threads": threads})
    runs.build_e11_warmstart("agreeing", threads=1)
    assert called == [(runs.sft_agent_command(0.95, runs.e11_warmstart("agreeing"), "<tmp>"), 1)]
    record = json.loads((tmp_path / f"{runs.e11_warmstart('agreeing')}.json").read_text())
    assert record["model_sha256"] == hashlib.sha256(b"weights").hexdigest() and record["tool_share"] == 0.95
    assert record["provenance"] == {"commit": "abc", "threads": 1} and record["wall_s"] == 12.3
    assert record["scalars"] == {"val/accuracy": [[400, 0.5]]} and "tool_share=0.95" in record["command"]
