"""The fused row step as one Triton kernel: the twin of ``row_step.row_step_torch`` (read that first).

One program per token row. Pass 1 streams the row's student and teacher logits once and keeps
per-lane running statistics (max and sum of exp for the softmax, s.t, |s|^2, |t|^2); pass 2, only
when gradients are wanted, streams them again and overwrites the student logits with d loss / d s.
"""

import torch
import triton
import triton.language as tl

from .row_step import COSINE_EPS, RowStepScales

DEFAULT_BLOCK = 1024  # H200 sweep, benchmarks/NOTES.md
DEFAULT_WARPS = 4


@triton.jit
def _softcap(x, cap):
    """cap * tanh(x / cap), with tanh written through exp of a non-positive number (no overflow)."""
    decay = tl.exp(-2.0 * tl.abs(x) / cap)
    tanh_abs = (1.0 - decay) / (1.0 + decay)
    return cap * tl.where(x >= 0, tanh_abs, -tanh_abs)


@triton.jit
def _row_step_kernel(
    student_ptr,
    student_row_stride,
    teacher_ptr,
    teacher_row_stride,
    labels_ptr,
    losses_ptr,
    vocab_student,
    vocab_teacher,
    ignore_index,
    weight_hard,
    weight_soft,
    beta,
    inv_temp_sq,
    eps,
    student_cap,
    teacher_cap,
    student_scale,
    teacher_scale,
    STUDENT_CAP: tl.constexpr,
    TEACHER_CAP: tl.constexpr,
    WRITE_GRAD: tl.constexpr,
    BLOCK: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    student_row = student_ptr + row * student_row_stride
    teacher_row = teacher_ptr + row * teacher_row_stride
    label = tl.load(labels_ptr + row).to(tl.int64)
    valid = (label != ignore_index) & (label >= 0) & (label < vocab_student)
    offsets = tl.arange(0, BLOCK)

    # Pass 1: lane-wise running statistics over the shared vocabulary [0, Vs).
    run_max = tl.full([BLOCK], float("-inf"), tl.float32)
    run_sum_exp = tl.zeros([BLOCK], tl.float32)
    dot = tl.zeros([BLOCK], tl.float32)
    sum_sq_student = tl.zeros([BLOCK], tl.float32)
    sum_sq_teacher = tl.zeros([BLOCK], tl.float32)
    for start in range(0, vocab_student, BLOCK):
        cols = start + offsets
        in_row = cols < vocab_student
        s = tl.load(student_row + cols, mask=in_row, other=0.0).to(tl.float32) * student_scale
        t = tl.load(teacher_row + cols, mask=in_row, other=0.0).to(tl.float32) * teacher_scale
        if STUDENT_CAP:
            s = _softcap(s, student_cap)
        if TEACHER_CAP:
            t = _softcap(t, teacher_cap)
        s_for_max = tl.where(in_row, s, float("-inf"))
        new_max = tl.maximum(run_max, s_for_max)
        # A lane that has seen only padding keeps max = -inf; keep its sum at 0 instead of NaN.
        shift = tl.where(new_max != float("-inf"), new_max, 0.0)
        run_sum_exp = run_sum_exp * tl.exp(run_max - shift) + tl.exp(s_for_max - shift)
        run_max = new_max
        dot += s * t
        sum_sq_student += s * s
        sum_sq_teacher += t * t
    # The teacher's extra vocabulary [Vs, Vt) meets the student's zero padding: only |t|^2 grows.
    for start in range(vocab_student, vocab_teacher, BLOCK):
        cols = start + offsets
        t = tl.load(teacher_row + cols, mask=cols < vocab_teacher, other=0.0).to(tl.float32) * teacher_scale
        if TEACHER_CAP:
            t = _softcap(t, teacher_cap)
        sum_sq_teacher += t * t

    row_max = tl.max(run_max, axis=0)
    logsumexp = row_max + tl.log(tl.sum(run_sum_exp * tl.exp(run_max - row_max), axis=0))
    target_logit = tl.load(student_row + tl.where(valid, label, 0)).to(tl.float32) * student_scale
    if STUDENT_CAP:
        target_logit = _softcap(target_logit, student_cap)

    norm_student = tl.sqrt(tl.sum(sum_sq_student, axis=0) * inv_temp_sq)
    norm_teacher = tl.sqrt(tl.sum(sum_sq_teacher, axis=0) * inv_temp_sq)
    clamped_student = tl.maximum(norm_student, eps)
    clamped_teacher = tl.maximum(norm_teacher, eps)
    cos = tl.sum(dot, axis=0) * inv_temp_sq / (clamped_student * clamped_teacher)

    hard_loss = tl.where(valid, logsumexp - target_logit, 0.0)
    soft_loss = tl.where(valid, beta * (1.0 - cos), 0.0)
    tl.store(losses_ptr + row * 2, hard_loss)
    tl.store(losses_ptr + row * 2 + 1, soft_loss)

    if WRITE_GRAD:
        # d L / d s = weight_hard * (softmax - onehot) - weight_soft * beta * d cos / d s, and
        # d cos / d s = coef_teacher * t - coef_student * s (see row_step.cosine_terms).
        coef_teacher = inv_temp_sq / (clamped_student * clamped_teacher)
        coef_student = tl.where(
            norm_student >= eps, cos * inv_temp_sq / (clamped_student * clamped_student), 0.0
        )
        soft_scale = weight_soft * beta
        for start in range(0, vocab_student, BLOCK):
            cols = start + offsets
            in_row = cols < vocab_student
            s = tl.load(student_row + cols, mask=in_row, other=0.0).to(tl.float32) * student_scale
            t = tl.load(teacher_row + cols, mask=in_row, other=0.0).to(tl.float32) * teacher_scale
            if STUDENT_CAP:
                s = _softcap(s, student_cap)
            if TEACHER_CAP:
                t = _softcap(t, teacher_cap)
            prob = tl.exp(s - logsumexp)
            grad = weight_hard * (prob - tl.where(cols == label, 1.0, 0.0))
            grad -= soft_scale * (coef_teacher * t - coef_student * s)
            if STUDENT_CAP:
                grad *= 1.0 - (s / student_cap) * (s / student_cap)  # d(c tanh(z / c)) / dz
            grad *= student_scale
            grad = tl.where(valid, grad, 0.0)
            tl.store(student_row + cols, grad.to(student_ptr.dtype.element_ty), mask=in_row)


def row_step_triton(
    student_logits: torch.Tensor,
    teacher_logits: torch.Tensor,
    labels: torch.Tensor,
    scales: RowStepScales,
    token_losses: torch.Tensor,
    write_grad: bool,
    block_size: int | None = None,
    num_warps: int = DEFAULT_WARPS,
) -> None:
    rows, vocab_student = student_logits.shape
    if rows == 0:
        return
    if student_logits.stride(1) != 1 or teacher_logits.stride(1) != 1:
        raise ValueError("row_step_triton needs logits with unit stride along the vocabulary")
    if not (labels.is_contiguous() and token_losses.is_contiguous()):
        raise ValueError("row_step_triton needs contiguous labels and token_losses")
    block = block_size or max(32 * num_warps, min(DEFAULT_BLOCK, triton.next_power_of_2(vocab_student)))
    _row_step_kernel[(rows,)](
        student_logits,
        student_logits.stride(0),
        teacher_logits,
        teacher_logits.stride(0),
        labels,
        token_losses,
        vocab_student,
        teacher_logits.shape[1],
        scales.ignore_index,
        scales.weight_hard,
        scales.weight_soft,
        scales.beta,
        1.0 / (scales.temperature * scales.temperature),
        COSINE_EPS,
        scales.student_softcap or 1.0,
        scales.teacher_softcap or 1.0,
        scales.student_logit_scale,
        scales.teacher_logit_scale,
        STUDENT_CAP=scales.student_softcap is not None,
        TEACHER_CAP=scales.teacher_softcap is not None,
        WRITE_GRAD=write_grad,
        BLOCK=block,
        num_warps=num_warps,
    )
