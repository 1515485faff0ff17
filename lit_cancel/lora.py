"""LoRA adapters on the policy through peft."""

from dataclasses import dataclass, field

from peft import LoraConfig, PeftModel, get_peft_model
from transformers import PreTrainedModel


@dataclass
class LoRA:
    """Low-rank adapters on the policy; only they are trained and saved in checkpoints.

    With a KL term, the reference log-probs come from the same model with its adapters disabled,
    so no second copy of the base model is held.
    """

    rank: int = 8
    """Rank ``r`` of each adapter."""
    alpha: float = 16.0
    """Scaling numerator: the adapter's update is multiplied by ``alpha / rank``."""
    dropout: float = 0.0
    """Dropout on the adapters' input."""
    target_modules: list[str] = field(default_factory=lambda: ["q_proj", "k_proj", "v_proj", "o_proj"])
    """Names of the linear layers that get adapters (Qwen2/Llama attention projections by default)."""

    def __post_init__(self) -> None:
        if self.rank < 1 or self.alpha <= 0 or not 0 <= self.dropout < 1 or not self.target_modules:
            raise ValueError(
                f"LoRA: need rank >= 1, alpha > 0, 0 <= dropout < 1 and some target_modules, got {self}"
            )

    def apply(self, model: PreTrainedModel) -> PeftModel:
        config = LoraConfig(
            r=self.rank, lora_alpha=self.alpha, lora_dropout=self.dropout, target_modules=self.target_modules,
            task_type="CAUSAL_LM",
        )
        try:
            return get_peft_model(model, config)
        except ValueError as error:
            names = sorted({name.rsplit(".", 1)[-1] for name, _ in model.named_modules() if name})
            raise ValueError(f"LoRA: target_modules={self.target_modules} do not match the model's layers ({names}): {error}") from error
