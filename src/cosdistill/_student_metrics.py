"""The student's per-token metrics that trainers log beside the loss (TRL's ``entropy`` and ``mean_token_accuracy``),
taken from each chunk's student logits before the row step overwrites them with their gradient: no logits are
kept, and each chunk's are read once more. ``StudentMetrics`` asks a call for them and holds them after it;
``student_metrics_torch`` is the spec and the CPU path, kernels/student_metrics.py its Triton twin."""

import dataclasses
import math
import numbers

import torch

from ._row_step import RowStepConstants, as_the_loss_sees_them, label_columns

SPEC_DTYPE = torch.float64
MIN_TEMPERATURE = 1e-38  # log2(e) / 1e-38 is within float32's range, log2(e) / 4e-39 is not


@dataclasses.dataclass
class StudentMetrics:
    """Pass one as ``student_metrics=`` to a fused loss call; the call fills in, per token, in the labels' shape:

    - ``entropy``: the student's entropy in nats, of softmax(s / temperature) over its own vocabulary, s its logits
      as the loss sees them (times its logit scale, then softcapped); 0 where the token is ignored. float32.
    - ``top1``: whether the label is the student's largest logit (the first of equal ones, as torch.argmax);
      False where the token is ignored. Not defined for a row holding a NaN logit, whose entropy is NaN.
    - ``counted``: whether the token counts (its label is not ignore_index).

    Their sums over the counted tokens, divided by their number, are TRL's ``entropy`` and ``mean_token_accuracy``.
    ``temperature`` is the metrics' own, not the loss's. Through ``cosdistill.hf.distill_loss`` the tensors are
    ``[n]``, over the positions that have a target (those the fused loss runs on). Not with a vocabulary split (a
    ValueError). Under torch.compile the call that asks for them runs eagerly (a graph break; fullgraph=True
    raises)."""

    temperature: float = 1.0
    entropy: torch.Tensor | None = None
    top1: torch.Tensor | None = None
    counted: torch.Tensor | None = None

    def __post_init__(self):
        self.check()

    def check(self) -> None:
        """Raise for a temperature that is not a positive finite number of at least MIN_TEMPERATURE (when made, and at
        each call that takes it)."""
        if (isinstance(self.temperature, bool) or not isinstance(self.temperature, numbers.Real)
                or not math.isfinite(self.temperature) or self.temperature < MIN_TEMPERATURE):
            raise ValueError(f"StudentMetrics' temperature must be a positive finite number, got {self.temperature!r} "
                             f"(at least {MIN_TEMPERATURE:g}: the kernel's log2(e) / temperature must be a float32)")


def student_metrics_torch(student_logits, labels, constants: RowStepConstants, temperature: float, out) -> None:
    """out [n, 2] float32: each row's entropy in nats (0 where ignored) and 1.0 where its label is its first largest
    logit (0 elsewhere and where ignored), computed in float64."""
    valid, _, column = label_columns(labels, student_logits.shape[1], constants)
    s, _ = as_the_loss_sees_them(student_logits, None, constants, SPEC_DTYPE)
    entropy = torch.special.entr(torch.softmax(s / temperature, dim=1)).sum(1)
    top1 = valid & (s.argmax(1) == column)
    out[:, 0] = torch.where(valid, entropy, 0.0)
    out[:, 1] = top1
