import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from lit_cancel.callbacks import learning_tax as tax_callback
from lit_cancel.callbacks import token_flip

from lit_cancel import GRPO, PRESETS, ConstantLength, DFPOMin, DrGRPO, NoClip, PolicyGradient, SequenceMean
from lit_cancel.objectives.audit import SCENARIOS, audit, credits, learning_tax, main, scenario_batch, scenario_rollouts, shared_positions
from lit_cancel.objectives.corrections import CORRECTIONS

LIT_CANCEL = str(Path(sys.executable).parent / "lit-cancel")


class MyConstantObjective(PolicyGradient):
    """A user's objective: token ratios, no clip, a constant normaliser (cancels)."""

    def __init__(self):
        super().__init__(clip=NoClip(), normaliser=ConstantLength(32))


class MyLengthNormalisedObjective(PolicyGradient):
    """A user's objective with GRPO's per-sequence normaliser (does not cancel on unequal lengths)."""

    def __init__(self):
        super().__init__(normaliser=SequenceMean())


class GRPOReportingDrGRPOCredits(GRPO):
    """GRPO's loss, but the credits it reports are Dr. GRPO's (which cancel)."""

    def __call__(self, logprobs, batch):
        out = super().__call__(logprobs, batch)
        out.credits = DrGRPO()(logprobs.detach(), batch).credits
        return out


class NeedsArguments(PolicyGradient):
    def __init__(self, width: int):
        super().__init__(normaliser=ConstantLength(width))


class RegularisedDFPO(DFPOMin):
    def __init__(self):
        super().__init__(kl_coef=0.05)


def test_shared_positions_are_the_groups_common_prefix():
    tokens = torch.tensor([[5, 6, 7, 8], [5, 6, 9, 8], [5, 6, 7, 1], [4, 4, 4, 4], [4, 4, 4, 0], [3, 3, 3, 3]])
    mask = torch.tensor([[1, 1, 1, 1], [1, 1, 1, 1], [1, 1, 1, 0], [1, 1, 1, 1], [1, 1, 0, 0], [1, 1, 1, 1]])
    groups = torch.tensor([0, 0, 0, 1, 1, 2])
    # group 0 shares [5, 6]; group 1 shares [4, 4] (its second member ends after two tokens);
    # group 2 has a single member in the batch: nothing to compare, nothing shared
    expected = [[1, 1, 0, 0], [1, 1, 0, 0], [1, 1, 0, 0], [1, 1, 0, 0], [1, 1, 0, 0], [0, 0, 0, 0]]
    for implementation in (shared_positions, tax_callback.shared_positions, token_flip.shared_positions):
        assert implementation(tokens, mask, groups).long().tolist() == expected


def test_a_row_with_no_token_to_credit_is_no_member_of_its_group():
    # group 0's row 1 failed with tokens in its context that differ at once; group 1 keeps one member that ran
    tokens = torch.tensor([[5, 6, 7, 8], [9, 9, 9, 9], [5, 6, 7, 1], [4, 4, 4, 4], [4, 4, 0, 0]])
    mask = torch.tensor([[1, 1, 1, 1], [0, 0, 0, 0], [1, 1, 1, 0], [1, 1, 1, 1], [0, 0, 0, 0]])
    context = torch.tensor([[1, 1, 1, 1], [1, 1, 1, 1], [1, 1, 1, 0], [1, 1, 1, 1], [1, 1, 0, 0]])
    groups = torch.tensor([0, 0, 0, 1, 1])
    expected = [[1, 1, 1, 0], [0, 0, 0, 0], [1, 1, 1, 0], [0, 0, 0, 0], [0, 0, 0, 0]]
    for implementation in (shared_positions, tax_callback.shared_positions, token_flip.shared_positions):
        assert implementation(tokens, mask, groups, context).long().tolist() == expected


def test_the_callbacks_copies_compute_the_cores_numbers():
    generator = torch.Generator().manual_seed(0)
    for _ in range(20):
        groups = torch.randint(0, 4, (12,), generator=generator)
        tokens = torch.randint(0, 3, (12, 6), generator=generator)  # 3 symbols: long shared prefixes are common
        mask = (torch.arange(6) < torch.randint(1, 7, (12, 1), generator=generator)).long()
        mask[torch.rand(12, generator=generator) < 0.2] = 0  # failed episodes' rows
        credits = torch.randn(12, 6, generator=generator) * mask
        shared = shared_positions(tokens, mask, groups)
        assert torch.equal(tax_callback.shared_positions(tokens, mask, groups), shared)
        assert torch.equal(token_flip.shared_positions(tokens, mask, groups), shared)
        uncancelled, total = tax_callback.uncancelled_credit(credits, tokens, mask, groups)
        assert float(uncancelled / total) == pytest.approx(learning_tax(credits, tokens, mask, groups), rel=1e-6)


def test_the_callbacks_copies_compute_the_cores_numbers_on_episodes():
    """Episodes: the context runs to each row's length, the policy's tokens are the context less random holes."""
    generator = torch.Generator().manual_seed(1)
    for _ in range(20):
        groups = torch.randint(0, 4, (12,), generator=generator)
        tokens = torch.randint(0, 2, (12, 8), generator=generator)
        context = (torch.arange(8) < torch.randint(1, 9, (12, 1), generator=generator)).long()
        mask = context * (torch.rand(12, 8, generator=generator) < 0.7)
        credits = torch.randn(12, 8, generator=generator) * mask
        shared = shared_positions(tokens, mask, groups, context)
        assert not (shared & ~mask.bool()).any()
        assert torch.equal(tax_callback.shared_positions(tokens, mask, groups, context), shared)
        assert torch.equal(token_flip.shared_positions(tokens, mask, groups, context), shared)
        uncancelled, total = tax_callback.uncancelled_credit(credits, tokens, mask, groups, context)
        assert float(uncancelled / total) == pytest.approx(learning_tax(credits, tokens, mask, groups, context), rel=1e-6)


def test_learning_tax_by_hand():
    tokens = torch.tensor([[5, 6, 7], [5, 6, 9]])
    mask = torch.ones(2, 3, dtype=torch.long)
    groups = torch.tensor([0, 0])
    # shared positions 0 and 1: |0.5 - 0.5| + |0.5 - 0.25| = 0.25 of a total |credit| of 0.5+0.5+1+0.5+0.25+1 = 3.75
    credits = torch.tensor([[0.5, 0.5, 1.0], [-0.5, -0.25, -1.0]])
    assert learning_tax(credits, tokens, mask, groups) == pytest.approx(0.25 / 3.75)
    assert learning_tax(torch.zeros(2, 3), tokens, mask, groups) == 0.0


def test_a_group_with_a_failed_episode_trains_its_other_members_and_dfpo_still_cancels():
    name = "failed episode, one member"
    _, mask, _, _, _, _, context = scenario_rollouts(name)
    assert (mask[[3, 7]] == 0).all() and (context[[3, 7]].sum(1) == 7).all()  # its tokens in the context, none credited
    for preset in ("DFPOMin", "DFPOOrth", "DFPOMinTR", "DrGRPO", "DAPO", "RLOO"):
        assert abs(audit(PRESETS[preset]())[name].policy_tax) < 1e-6, preset
    # GRPO's 1/|y_i| still differs among the three members that train: the tax it pays anyway
    assert audit(PRESETS["GRPO"]())[name].policy_tax == pytest.approx(0.029166, abs=1e-6)
    # the rule against a zero-reward fallback: advantages over all four rows leave the members' sum at 1/2 a group
    objective = DFPOMin()
    batch, current = scenario_batch(objective, name)
    rollouts = (batch.input_ids[:, 1:], batch.completion_mask, batch.group_ids, batch.attention_mask[:, 1:])
    assert batch.advantages.view(2, 4)[:, :3].sum(1).abs().max() < 1e-6 and (batch.advantages.view(2, 4)[:, 3] == 0).all()
    batch.advantages = objective.advantages(batch.rewards.view(2, 4)).view(-1) * batch.completion_mask.any(1)
    assert learning_tax(credits(objective, current, batch)[1], *rollouts) > 0.1


@pytest.mark.parametrize(
    ("name", "exit_code"),
    [("DFPOMin", 0), ("DFPOOrth", 0), ("DFPOMinTR", 0), ("DrGRPO", 1), ("DAPO", 1), ("RLOO", 1), ("GRPO", 1), ("GSPO", 1),
     ("dfpo_min", 0), ("gspo", 1)],
)
def test_audit_exit_codes_of_presets(name, exit_code, capsys):
    assert main([name]) == exit_code
    printed = capsys.readouterr().out
    assert all(scenario in printed for scenario in SCENARIOS)


def test_audit_names_the_scenarios_that_break():
    grpo = audit(PRESETS["GRPO"]())
    assert grpo["on-policy, equal lengths"].tax < 1e-6 < grpo["on-policy, unequal lengths"].tax
    gspo = audit(PRESETS["GSPO"]())
    assert gspo["off-policy, inside the clip range"].tax > 0.1
    # a clip keeps cancelling while the shared ratio is inside its range, and stops once it leaves it
    dr_grpo = audit(PRESETS["DrGRPO"]())
    assert max(dr_grpo[name].tax for name in SCENARIOS if name != "shared tokens outside the clip range") < 1e-7
    assert dr_grpo["shared tokens outside the clip range"].tax > 0.1


def test_a_shared_first_turn_and_observation_cancel_under_dfpo_and_not_under_grpos_normaliser():
    name = "multi-turn, shared first turn"
    tokens, mask, _, _, _, _, context = scenario_rollouts(name)
    # a first turn of 3 tokens, an observation of 3 (context, no credit), then second turns of 2, 8, 4 and 6 tokens
    assert mask[:4, :6].tolist() == [[1, 1, 1, 0, 0, 0]] * 4 and context.sum(1).tolist() == [8, 14, 10, 12] * 2
    shared = shared_positions(tokens, mask, torch.arange(2).repeat_interleave(4), context)
    assert shared.long().tolist() == [[1, 1, 1] + [0] * 11] * 8  # the prefix runs through the observation, which gets none
    assert shared_positions(tokens, context, torch.arange(2).repeat_interleave(4))[:, :6].all()
    for preset in ("DFPOMin", "DFPOOrth"):
        assert abs(audit(PRESETS[preset]())[name].policy_tax) < 1e-6, preset
    # GRPO: c_it = A_i / (8 |y_i|) with A_i = +-a and |y_i| = 5, 11, 7, 9 policy tokens; per group, 3 shared positions
    # each keep a |1/5 - 1/11 + 1/7 - 1/9| a / 8 of a total |credit| of 4 a / 8
    assert audit(PRESETS["GRPO"]())[name].policy_tax == pytest.approx(3 / 4 * (1 / 5 - 1 / 11 + 1 / 7 - 1 / 9), rel=1e-5)


def test_unequal_episodes_cancel_under_dfpo_and_not_under_grpos_normaliser():
    name = "multi-turn, unequal lengths"
    _, mask, _, _, _, _, context = scenario_rollouts(name)
    assert mask.sum(1).tolist() == [8, 14, 9, 15] * 2 and (context.sum(1) > mask.sum(1)).all()
    for preset in ("DFPOMin", "DFPOOrth"):
        assert abs(audit(PRESETS[preset]())[name].policy_tax) < 1e-6, preset
    assert audit(PRESETS["GRPO"]())[name].policy_tax > 0.05


@pytest.mark.parametrize("name", ["multi-turn, shared first turn", "multi-turn, unequal lengths"])
def test_no_preset_gives_the_environments_tokens_credit(name):
    for preset, make in PRESETS.items():
        objective = make()
        batch, current = scenario_batch(objective, name)
        environment = batch.attention_mask[:, 1:].bool() & ~batch.completion_mask.bool()
        assert environment.sum() > 0
        for credit in credits(objective, current, batch):
            assert (credit[environment] == 0).all() and (credit[batch.completion_mask.bool()] != 0).any(), preset


def stale_rollouts(name):
    """The scenario's shared-position mask and ``log pi_old - log pi_sampler``, as the audit builds them."""
    tokens, mask, _, old, _, sampler, _ = scenario_rollouts(name)
    return shared_positions(tokens, mask, torch.arange(2).repeat_interleave(4)), (old - sampler) * mask


def test_stale_scenarios_lag_past_the_token_bound_with_one_or_two_versions_per_group():
    bound = torch.tensor(3.0).log()  # TokenTruncate's default clip_max
    shared, one = stale_rollouts("stale, one version")
    assert (one[shared] > bound).any() and (one[~shared] > bound).any()  # the truncation acts, on shared tokens too
    for group in (slice(0, 4), slice(4, 8)):
        assert torch.equal(one[group, :4], one[group][:1, :4].expand(4, 4))  # one version: one sampler log-prob per position
    shared, two = stale_rollouts("stale, two versions")
    assert shared[:, :4].all() and (two[shared] > bound).any()
    assert torch.equal(two[0::2], one[0::2])  # the same rollouts, but members 1 and 3 of each group sampled by another version
    for group in (slice(0, 4), slice(4, 8)):
        members = two[group, :4]
        assert torch.equal(members[0], members[2]) and torch.equal(members[1], members[3])  # alternate members, two versions
        assert (members[0] - members[1]).abs().max() > 0.5


@pytest.mark.parametrize("correction", ["TokenTruncate", "TokenMask"])
def test_a_token_level_correction_cancels_on_stale_rollouts_of_one_version_and_not_of_two(correction, capsys):
    objective = PRESETS["DFPOMinTR"](correction=CORRECTIONS[correction]())
    results = audit(objective)
    assert results["stale, one version"].policy_tax < 1e-6
    assert results["stale, two versions"].policy_tax > 0.01 and not results["stale, two versions"].judged
    # the mixed-version scenario is reported, with its tax, but it is the batching's doing: the exit code stays 0
    assert main(["DFPOMinTR", "--correction", correction]) == 0
    printed = capsys.readouterr().out
    rows = {line.split("  ")[1]: line.split() for line in printed.splitlines() if line.startswith("  stale, ")}
    assert float(rows["stale, one version"][3]) < 1e-6 and rows["stale, one version"][-1] == "cancels"
    assert float(rows["stale, two versions"][3]) > 0.01 and rows["stale, two versions"][-3:] == ["cancel,", "not", "judged"]
    assert "keep each group atomic in time" in printed and "result: cancels in every judged scenario" in printed


@pytest.mark.parametrize(("preset", "group_min_exit"), [("DFPOMinTR", 0), ("GRPO", 1)])  # GRPO: unequal lengths, clip
def test_a_sequence_level_correction_does_not_cancel_on_stale_rollouts_and_group_min_does(preset, group_min_exit, capsys):
    for correction in ("SequenceTruncate", "SequenceMask"):
        results = audit(PRESETS[preset](correction=CORRECTIONS[correction]()))
        assert results["stale, one version"].policy_tax > 0.01, correction
        assert results["sampler mismatch, equal lengths"].policy_tax > 0.01, correction
        group_min = audit(PRESETS[preset](correction=CORRECTIONS[f"GroupMin({correction})"]()))
        # one weight per group, whichever version sampled each member: both stale scenarios cancel
        assert max(group_min[name].policy_tax for name in ("stale, one version", "stale, two versions")) < 1e-6, correction
    assert main([preset, "--correction", "SequenceTruncate"]) == 1
    assert "atomic in time" not in capsys.readouterr().out  # it fails with one version too: not the batching's doing
    assert main([preset, "--correction", "GroupMin(SequenceTruncate)"]) == group_min_exit


def test_every_preset_reports_its_losss_credits():
    for name, preset in PRESETS.items():
        for result in audit(preset()).values():
            assert result.credit_mismatch < 1e-5, name


def test_credits_that_are_not_the_losss_fail_the_audit(capsys):
    results = audit(GRPOReportingDrGRPOCredits())
    assert max(result.credit_mismatch for result in results.values()) > 0.1
    assert results["on-policy, unequal lengths"].tax > 1e-3  # judged on autograd's credits: GRPO's
    assert main(["test_audit.GRPOReportingDrGRPOCredits"]) == 1
    printed = capsys.readouterr().out
    assert "reported credits are not -dloss/dlogprobs: largest mismatch" in printed and "DOES NOT CANCEL" in printed


def test_a_regulariser_is_reported_apart_from_the_policy_gradient(capsys):
    results = audit(RegularisedDFPO())
    off_policy = results["off-policy, inside the clip range"]
    assert off_policy.policy_tax < 1e-6 < 1e-3 < off_policy.tax
    assert main(["test_audit.RegularisedDFPO"]) == 0
    assert "regularisers that are not meant to cancel" in capsys.readouterr().out


def test_audit_takes_a_user_class_by_import_path():
    assert main(["test_audit.MyConstantObjective"]) == 0
    assert main(["test_audit.MyLengthNormalisedObjective"]) == 1


@pytest.mark.parametrize(
    ("name", "message"),
    [
        ("no_such_module.Objective", "neither a preset .* nor an importable class path: No module named 'no_such_module'\n"),
        ("GRPOO", r"'GRPOO' is neither a preset \(GRPO, .*\) nor a class path such as my_package.objectives.MyObjective; did you mean GRPO\?\n"),
        ("dfpo_mn", r"did you mean DFPOMin\?\n"),
        ("lit_cancel.DrGRP0", r"nor an importable class path: module 'lit_cancel' has no attribute 'DrGRP0'; did you mean DrGRPO\?\n"),
        ("Unrelated", r"'Unrelated' is neither a preset \(.*\) nor a class path such as my_package.objectives.MyObjective\n"),
        ("collections.OrderedDict", "is not a lit_cancel.Objective"),
        ("test_audit.NeedsArguments", r"cannot be built without arguments \(.*width.*\); give its arguments defaults"),
    ],
)
def test_audit_refuses_what_it_cannot_load_with_exit_2(name, message, capsys):
    assert main([name]) == 2
    error = capsys.readouterr().err
    assert error.count("\n") == 1 and error.startswith("audit-objective: ")
    assert re.search(message, error)


def test_console_command_exit_status_and_a_module_in_the_current_directory(tmp_path):
    (tmp_path / "my_objectives.py").write_text(
        "from lit_cancel import ConstantLength, NoClip, PolicyGradient\n\n\n"
        "class Mine(PolicyGradient):\n    def __init__(self):\n        super().__init__(clip=NoClip(), normaliser=ConstantLength(16))\n"
    )
    for name, code in [("DFPOOrth", 0), ("GSPO", 1), ("my_objectives.Mine", 0), ("my_objectives.Missing", 2)]:
        result = subprocess.run([LIT_CANCEL, "audit-objective", name], capture_output=True, text=True, timeout=600, cwd=tmp_path)
        assert result.returncode == code, result.stderr
        assert code == 2 or "learning tax of " + name in result.stdout
