"""The fused row step in plain torch: the executable spec of the loss and of its gradient.

For one chunk of tokens it takes the student logits s [n, Vs] and the teacher logits t [n, Vt]
(Vt >= Vs; s is treated as zero-padded to Vt), and

* with a logit scale (Cohere style), multiplies s by a_s and t by a_t; then, with softcapping
  (Gemma-2 style), replaces s by c_s * tanh(s / c_s) and t by c_t * tanh(t / c_t); both before
  anything below (the gradient then carries the factors a_s and 1 - tanh^2);
* writes each token's unnormalised hard and soft loss into ``token_losses`` [n, 2]:
      hard_i = logsumexp(s_i) - s_i[label_i]
      soft_i = beta * (1 - cos(s_i / T, t_i / T))
  with cos(a, b) = a.b / (max(|a|, eps) * max(|b|, eps)), eps = 1e-8, as in
  torch.nn.functional.cosine_similarity; ignored tokens get 0;
* if ``write_grad``, overwrites s in place with d L / d s, where L is the chunk's unnormalised loss
      L = weight_hard * sum_i hard_i + weight_soft * sum_i soft_i.
  The chunk loop applies 1 / N in the gradient GEMMs, so N need not be known here and fp16
  gradients stay far from underflow.

Labels outside [0, Vs) that are not ignore_index are treated as ignored here (the API raises on them).

``row_step_triton.py`` is the same step as one Triton kernel; tests hold the two equal.
"""

from dataclasses import dataclass

import torch

COSINE_EPS = 1e-8


@dataclass(frozen=True)
class RowStepScales:
    """Per-call constants of the row step."""

    weight_hard: float
    weight_soft: float
    beta: float
    temperature: float
    ignore_index: int
    student_softcap: float | None = None  # logits -> c * tanh(logits / c)
    teacher_softcap: float | None = None
    student_logit_scale: float = 1.0  # logits -> a * logits, before the softcap
    teacher_logit_scale: float = 1.0


def scale_and_softcap(logits: torch.Tensor, scale: float, cap: float | None) -> torch.Tensor:
    logits = logits * scale
    return logits if cap is None else cap * torch.tanh(logits / cap)


def cosine_terms(dot, sum_sq_student, sum_sq_teacher, scales: RowStepScales):
    """cos(s/T, t/T) and the two coefficients of its gradient, from the raw row sums.

    d cos / d s = (t * coef_teacher - s * coef_student), both coefficients already divided by T^2.
    The student norm is clamped at eps like cosine_similarity, and where the clamp is active the norm
    is a constant, so its derivative term drops out.
    """
    inv_t2 = 1.0 / (scales.temperature * scales.temperature)
    norm_student = torch.sqrt(sum_sq_student * inv_t2)
    norm_teacher = torch.sqrt(sum_sq_teacher * inv_t2)
    clamped_student = norm_student.clamp_min(COSINE_EPS)
    clamped_teacher = norm_teacher.clamp_min(COSINE_EPS)
    cos = dot * inv_t2 / (clamped_student * clamped_teacher)
    coef_teacher = inv_t2 / (clamped_student * clamped_teacher)
    coef_student = torch.where(
        norm_student >= COSINE_EPS, cos * inv_t2 / (clamped_student * clamped_student), 0.0
    )
    return cos, coef_teacher, coef_student


def row_step_torch(
    student_logits: torch.Tensor,
    teacher_logits: torch.Tensor,
    labels: torch.Tensor,
    scales: RowStepScales,
    token_losses: torch.Tensor,
    write_grad: bool,
) -> None:
    vocab_student = student_logits.shape[1]
    s = scale_and_softcap(student_logits.float(), scales.student_logit_scale, scales.student_softcap)
    t = scale_and_softcap(teacher_logits.float(), scales.teacher_logit_scale, scales.teacher_softcap)
    t_shared = t[:, :vocab_student]  # the student's zero padding adds nothing to s.t or |s|^2

    valid = (labels != scales.ignore_index) & (labels >= 0) & (labels < vocab_student)
    safe_labels = torch.where(valid, labels, 0).long()

    logsumexp = torch.logsumexp(s, dim=1)
    target_logit = s.gather(1, safe_labels[:, None])[:, 0]
    dot = (s * t_shared).sum(1)
    cos, coef_teacher, coef_student = cosine_terms(
        dot, (s * s).sum(1), (t * t).sum(1), scales
    )

    token_losses[:, 0] = torch.where(valid, logsumexp - target_logit, 0.0)
    token_losses[:, 1] = torch.where(valid, scales.beta * (1.0 - cos), 0.0)
    if not write_grad:
        return

    grad = torch.exp(s - logsumexp[:, None])
    grad.scatter_add_(1, safe_labels[:, None], torch.full_like(grad[:, :1], -1.0))
    grad *= scales.weight_hard
    soft_scale = scales.weight_soft * scales.beta
    grad -= soft_scale * (coef_teacher[:, None] * t_shared - coef_student[:, None] * s)
    if scales.student_softcap is not None:
        grad *= 1.0 - (s / scales.student_softcap) ** 2  # d(c tanh(z / c)) / dz
    grad *= scales.student_logit_scale
    grad = torch.where(valid[:, None], grad, 0.0)
    student_logits.copy_(grad)
