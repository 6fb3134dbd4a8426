"""cosdistill: fused linear distillation losses through two LM heads (hard cross-entropy plus a soft term: cosine
similarity, or the generalized Jensen-Shannon divergence), never holding all logits."""

from ._student_metrics import StudentMetrics
from ._teacher_fp8 import Fp8TeacherWeight, quantize_teacher_weight
from ._weight_cache import StaleWeightError
from .api import FusedLinearCosineDistillLoss, FusedLinearJSDLoss, fused_linear_cosine_distill, fused_linear_jsd

__all__ = ["Fp8TeacherWeight", "FusedLinearCosineDistillLoss", "FusedLinearJSDLoss", "StaleWeightError",
           "StudentMetrics", "fused_linear_cosine_distill", "fused_linear_jsd", "quantize_teacher_weight"]
__version__ = "0.1.0"
