"""lit_cancel: critic-free RL fine-tuning of language models whose token gradients cancel within a group."""

from lit_cancel.batch import RolloutBatch
from lit_cancel.data import RewardError, RolloutDataModule, TaskDataModule
from lit_cancel.module import Generation, PolicyModule, RLModule
from lit_cancel.objectives import GRPO, Objective, ObjectiveOutput, group_advantages
from lit_cancel.sft import SFTDataModule, SFTModule
from lit_cancel.tasks import AdditionTask, MathWordTask, Task

__all__ = [
    "AdditionTask",
    "GRPO",
    "Generation",
    "MathWordTask",
    "Objective",
    "ObjectiveOutput",
    "PolicyModule",
    "RLModule",
    "RewardError",
    "RolloutBatch",
    "RolloutDataModule",
    "SFTDataModule",
    "SFTModule",
    "Task",
    "TaskDataModule",
    "group_advantages",
]
