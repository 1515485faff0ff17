import subprocess

import pytest
import torch

from lit_cancel import PRESETS, ConstantLength, PolicyGradient, SequenceMean
from lit_cancel.audit import SCENARIOS, audit, learning_tax, main
from lit_cancel.callbacks.learning_tax import shared_positions


class MyConstantObjective(PolicyGradient):
    """A user's objective: token ratios with a constant normaliser (cancels)."""

    def __init__(self):
        super().__init__(normaliser=ConstantLength(32))


class MyLengthNormalisedObjective(PolicyGradient):
    """A user's objective with GRPO's per-sequence normaliser (does not cancel on unequal lengths)."""

    def __init__(self):
        super().__init__(normaliser=SequenceMean())


def test_shared_positions_are_the_groups_common_prefix():
    tokens = torch.tensor([[5, 6, 7, 8], [5, 6, 9, 8], [5, 6, 7, 1], [4, 4, 4, 4], [4, 4, 4, 0], [3, 3, 3, 3]])
    mask = torch.tensor([[1, 1, 1, 1], [1, 1, 1, 1], [1, 1, 1, 0], [1, 1, 1, 1], [1, 1, 0, 0], [1, 1, 1, 1]])
    groups = torch.tensor([0, 0, 0, 1, 1, 2])
    shared = shared_positions(tokens, mask, groups).long()
    # group 0 shares [5, 6]; group 1 shares [4, 4] (its second member ends after two tokens);
    # group 2 has a single member in the batch: nothing to compare, nothing shared
    assert shared.tolist() == [[1, 1, 0, 0], [1, 1, 0, 0], [1, 1, 0, 0], [1, 1, 0, 0], [1, 1, 0, 0], [0, 0, 0, 0]]


def test_learning_tax_by_hand():
    tokens = torch.tensor([[5, 6, 7], [5, 6, 9]])
    mask = torch.ones(2, 3, dtype=torch.long)
    groups = torch.tensor([0, 0])
    # shared positions 0 and 1: |0.5 - 0.5| + |0.5 - 0.25| = 0.25 of a total |credit| of 0.5+0.5+1+0.5+0.25+1 = 3.75
    credits = torch.tensor([[0.5, 0.5, 1.0], [-0.5, -0.25, -1.0]])
    assert learning_tax(credits, tokens, mask, groups) == pytest.approx(0.25 / 3.75)
    assert learning_tax(torch.zeros(2, 3), tokens, mask, groups) == 0.0


@pytest.mark.parametrize(("name", "exit_code"), [("dr_grpo", 0), ("dfpo_min", 0), ("dfpo_orth", 0), ("grpo", 1), ("gspo", 1)])
def test_audit_exit_codes_of_presets(name, exit_code, capsys):
    assert main([name]) == exit_code
    printed = capsys.readouterr().out
    assert all(scenario in printed for scenario in SCENARIOS)


def test_audit_names_the_scenarios_that_break():
    taxes = audit(PRESETS["grpo"]())
    assert taxes["on-policy, equal lengths"] < 1e-6 < taxes["on-policy, unequal lengths"]
    gspo = audit(PRESETS["gspo"]())
    assert gspo["off-policy, inside the clip range"] > 0.1


def test_audit_takes_a_user_class_by_import_path():
    assert main(["test_audit.MyConstantObjective"]) == 0
    assert main(["test_audit.MyLengthNormalisedObjective"]) == 1


def test_audit_refuses_what_it_cannot_load():
    with pytest.raises(SystemExit, match="neither a preset .* nor an importable class path"):
        main(["no_such_module.Objective"])
    with pytest.raises(SystemExit, match="is not a lit_cancel.Objective"):
        main(["collections.OrderedDict"])


def test_console_command_exit_status():
    for name, code in [("dfpo_orth", 0), ("gspo", 1)]:
        result = subprocess.run(["lit-cancel", "audit-objective", name], capture_output=True, text=True, timeout=120)
        assert result.returncode == code, result.stderr
        assert "learning tax of " + name in result.stdout
