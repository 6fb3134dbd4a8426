"""cosdistill: the fused linear cosine-distillation loss (hard cross-entropy + soft cosine on logits)."""

from .api import FusedLinearCosineDistillLoss, fused_linear_cosine_distill
from .weight_cache import StaleWeightError

__all__ = ["FusedLinearCosineDistillLoss", "StaleWeightError", "fused_linear_cosine_distill"]
__version__ = "0.1.0"
