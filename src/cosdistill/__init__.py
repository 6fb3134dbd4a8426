"""cosdistill: the fused linear cosine-distillation loss (hard cross-entropy + soft cosine on logits)."""

from ._weight_cache import StaleWeightError
from .api import FusedLinearCosineDistillLoss, fused_linear_cosine_distill

__all__ = ["FusedLinearCosineDistillLoss", "StaleWeightError", "fused_linear_cosine_distill"]
__version__ = "0.1.0"
