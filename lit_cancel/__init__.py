"""lit_cancel: critic-free RL fine-tuning of language models whose token gradients cancel within a group.

Names are imported on first use (PEP 562), so ``from lit_cancel.callbacks import ...`` loads the
callbacks alone, without the models, peft or the datamodules.
"""

import importlib
from typing import Any

# each public name and the module that defines it
_EXPORTS = {
    "AdvantageEstimator": "lit_cancel.objectives.advantages",
    "BatchNormalised": "lit_cancel.objectives.advantages",
    "GroupNormalised": "lit_cancel.objectives.advantages",
    "LeaveOneOut": "lit_cancel.objectives.advantages",
    "MeanCentred": "lit_cancel.objectives.advantages",
    "RolloutBatch": "lit_cancel.batch",
    "AtomicCheckpointIO": "lit_cancel.run.checkpointing",
    "CheckpointWriteError": "lit_cancel.run.checkpointing",
    "LogWriteError": "lit_cancel.run.log_errors",
    "RunCheckpoint": "lit_cancel.run.checkpointing",
    "RunStopped": "lit_cancel.run.checkpointing",
    "AsymmetricClip": "lit_cancel.objectives.clipping",
    "Clip": "lit_cancel.objectives.clipping",
    "DualClip": "lit_cancel.objectives.clipping",
    "NoClip": "lit_cancel.objectives.clipping",
    "SymmetricClip": "lit_cancel.objectives.clipping",
    "GroupMin": "lit_cancel.objectives.corrections",
    "MismatchCorrection": "lit_cancel.objectives.corrections",
    "SequenceMask": "lit_cancel.objectives.corrections",
    "SequenceTruncate": "lit_cancel.objectives.corrections",
    "TokenMask": "lit_cancel.objectives.corrections",
    "TokenTruncate": "lit_cancel.objectives.corrections",
    "DecodeLoop": "lit_cancel.engines",
    "HFGenerate": "lit_cancel.engines",
    "RolloutEngine": "lit_cancel.engines",
    "VLLMEngine": "lit_cancel.engines.vllm_colocated",
    "VLLMServerEngine": "lit_cancel.engines.vllm_servers",
    "RewardError": "lit_cancel.rollouts",
    "RolloutDataModule": "lit_cancel.data",
    "TaskDataModule": "lit_cancel.data",
    "AdvOrthogonal": "lit_cancel.objectives.group_transforms",
    "GroupTransform": "lit_cancel.objectives.group_transforms",
    "MinReplace": "lit_cancel.objectives.group_transforms",
    "LoRA": "lit_cancel.lora",
    "Generation": "lit_cancel.generation",
    "PolicyModule": "lit_cancel.module",
    "RLModule": "lit_cancel.module",
    "ConstantLength": "lit_cancel.objectives.normalisers",
    "Normaliser": "lit_cancel.objectives.normalisers",
    "SequenceMean": "lit_cancel.objectives.normalisers",
    "TokenMean": "lit_cancel.objectives.normalisers",
    "Objective": "lit_cancel.objectives.policy_gradient",
    "ObjectiveOutput": "lit_cancel.objectives.policy_gradient",
    "PolicyGradient": "lit_cancel.objectives.policy_gradient",
    "MiniBatchPlan": "lit_cancel.plans",
    "QueryPreserved": "lit_cancel.plans",
    "RewardBalanced": "lit_cancel.plans",
    "Shuffled": "lit_cancel.plans",
    "DAPO": "lit_cancel.objectives.presets",
    "DFPOMin": "lit_cancel.objectives.presets",
    "DFPOMinTR": "lit_cancel.objectives.presets",
    "DFPOOrth": "lit_cancel.objectives.presets",
    "DrGRPO": "lit_cancel.objectives.presets",
    "GRPO": "lit_cancel.objectives.presets",
    "GSPO": "lit_cancel.objectives.presets",
    "PRESETS": "lit_cancel.objectives.presets",
    "RLOO": "lit_cancel.objectives.presets",
    "GroupRatioDrop": "lit_cancel.objectives.trust_regions",
    "TokenRatioMask": "lit_cancel.objectives.trust_regions",
    "TokenRatioWeight": "lit_cancel.objectives.trust_regions",
    "TrustRegion": "lit_cancel.objectives.trust_regions",
    "SFTDataModule": "lit_cancel.sft",
    "SFTModule": "lit_cancel.sft",
    "ModelRoot": "lit_cancel.sharding",
    "StepProgressBar": "lit_cancel.run.progress",
    "MathVerifyReward": "lit_cancel.rewards",
    "AdditionTask": "lit_cancel.tasks",
    "ScaffoldedAdditionTask": "lit_cancel.tasks",
    "MathWordTask": "lit_cancel.tasks",
    "Task": "lit_cancel.tasks",
}

__all__ = sorted(_EXPORTS)


def __getattr__(name: str) -> Any:
    if name not in _EXPORTS:
        raise AttributeError(f"module 'lit_cancel' has no attribute {name!r}")
    value = getattr(importlib.import_module(_EXPORTS[name]), name)
    globals()[name] = value  # later lookups skip this function
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(__all__))
