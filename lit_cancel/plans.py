"""The mini-batch plans' former module, kept so that a config naming a plan by it (``lit_cancel.plans.QueryPreserved``)
still loads; the plans are in :mod:`lit_cancel.rounds.plans`, and public as ``lit_cancel.QueryPreserved``, ..."""

from lit_cancel.rounds.plans import MiniBatchPlan, QueryPreserved, RewardBalanced, Shuffled

__all__ = ["MiniBatchPlan", "QueryPreserved", "RewardBalanced", "Shuffled"]
