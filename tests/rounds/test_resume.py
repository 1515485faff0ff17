"""Whether a checkpoint's rollout state goes on in this run: its options, named by their public class paths, and the
processes holding unspent rollouts."""

import pytest

from lit_cancel import DFPOMin, QueryPreserved
from lit_cancel.rounds.resume import check_resume, class_path, public_class_path

SHAPE = {"data.init_args.group_size": 4, "data.init_args.plan": "lit_cancel.QueryPreserved", "model.init_args.objective": "lit_cancel.DFPOMin"}


def test_a_class_is_named_by_its_public_name_whichever_module_defined_it_when_the_checkpoint_was_written():
    assert class_path(QueryPreserved()) == "lit_cancel.QueryPreserved" and class_path(DFPOMin()) == "lit_cancel.DFPOMin"
    assert public_class_path("lit_cancel.plans.QueryPreserved") == public_class_path("lit_cancel.rounds.plans.QueryPreserved")
    assert public_class_path("lit_cancel.presets.DFPOMin") == "lit_cancel.DFPOMin"
    assert public_class_path("my_package.DFPOMin") == "my_package.DFPOMin"
    old = {**SHAPE, "data.init_args.plan": "lit_cancel.plans.QueryPreserved", "model.init_args.objective": "lit_cancel.presets.DFPOMin"}
    check_resume(old, SHAPE, [{"pending": [], "waiting": None}], world=1, allow_changes=False)


def test_a_changed_option_is_named_unless_changes_are_allowed():
    saved = {**SHAPE, "data.init_args.group_size": 8}
    with pytest.raises(ValueError, match=r"data.init_args.group_size 8 -> 4 \(resume with the checkpoint's settings"):
        check_resume(saved, SHAPE, [{}], world=1, allow_changes=False)
    check_resume(saved, SHAPE, [{}], world=1, allow_changes=True)


def test_unspent_rollouts_resume_on_as_many_processes_only():
    two = [{"pending": ["a mini-batch"], "waiting": None}, {"pending": [], "waiting": None}]
    with pytest.raises(ValueError, match="unspent rollouts of 2 processes in the middle of a round and this run has 1"):
        check_resume(SHAPE, SHAPE, two, world=1, allow_changes=False)
    check_resume(SHAPE, SHAPE, two, world=2, allow_changes=False)
    check_resume(SHAPE, SHAPE, [{"pending": [], "waiting": None}] * 2, world=1, allow_changes=False)
