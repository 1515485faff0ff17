"""lit_cancel: critic-free RL fine-tuning of language models whose token gradients cancel within a group."""

from lit_cancel.advantages import BatchNormalised, GroupNormalised, LeaveOneOut, MeanCentred
from lit_cancel.batch import RolloutBatch
from lit_cancel.clipping import AsymmetricClip, DualClip, NoClip, SymmetricClip
from lit_cancel.data import RolloutDataModule, TaskDataModule
from lit_cancel.rollouts import RewardError
from lit_cancel.group_transforms import AdvOrthogonal, MinReplace
from lit_cancel.lora import LoRA
from lit_cancel.module import Generation, PolicyModule, RLModule
from lit_cancel.normalisers import ConstantLength, SequenceMean, TokenMean
from lit_cancel.objectives import Objective, ObjectiveOutput, PolicyGradient
from lit_cancel.plans import MiniBatchPlan, QueryPreserved, RewardBalanced, Shuffled
from lit_cancel.presets import DAPO, GRPO, GSPO, PRESETS, RLOO, DFPOMin, DFPOOrth, DrGRPO
from lit_cancel.progress import StepProgressBar
from lit_cancel.rewards import MathVerifyReward
from lit_cancel.sft import SFTDataModule, SFTModule
from lit_cancel.sharding import ModelRoot
from lit_cancel.tasks import AdditionTask, MathWordTask, Task

__all__ = [
    "AdditionTask",
    "AdvOrthogonal",
    "AsymmetricClip",
    "BatchNormalised",
    "ConstantLength",
    "DAPO",
    "DFPOMin",
    "DFPOOrth",
    "DrGRPO",
    "DualClip",
    "Generation",
    "GroupNormalised",
    "GRPO",
    "GSPO",
    "LeaveOneOut",
    "LoRA",
    "MathVerifyReward",
    "MathWordTask",
    "MeanCentred",
    "MiniBatchPlan",
    "MinReplace",
    "ModelRoot",
    "NoClip",
    "Objective",
    "ObjectiveOutput",
    "PolicyGradient",
    "PolicyModule",
    "PRESETS",
    "QueryPreserved",
    "RewardBalanced",
    "RewardError",
    "RLModule",
    "RLOO",
    "RolloutBatch",
    "RolloutDataModule",
    "SequenceMean",
    "SFTDataModule",
    "SFTModule",
    "Shuffled",
    "StepProgressBar",
    "SymmetricClip",
    "Task",
    "TaskDataModule",
    "TokenMean",
]
