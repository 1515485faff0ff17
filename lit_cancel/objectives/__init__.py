"""The objectives of the GRPO family, each composed from small parts, and the audit that measures their learning tax.

* :mod:`.policy_gradient`: :class:`Objective`, its output (loss and per-token credits) and :class:`PolicyGradient`,
  the composition of the parts;
* the parts: :mod:`.advantages`, :mod:`.clipping`, :mod:`.normalisers`, :mod:`.group_transforms`, :mod:`.trust_regions`,
  :mod:`.corrections` (sampler-mismatch corrections);
* :mod:`.presets`: ``GRPO``, ``DrGRPO``, ``DAPO``, ``GSPO``, ``DFPOMin``, ``DFPOOrth``, ``DFPOMinTR``, ``RLOO``;
* :mod:`.audit`: ``lit-cancel audit-objective``, an objective's credits checked against autograd and its tax measured.
"""

from lit_cancel.objectives.policy_gradient import Objective, ObjectiveOutput, PolicyGradient

__all__ = ["Objective", "ObjectiveOutput", "PolicyGradient"]
