"""The cosine loss's fused row step in Triton: the twin of ``_row_step.py`` (read that first).

One program per token row. ``_row_stats`` streams the row's student and teacher logits once and keeps
per-lane running statistics (max and sum of exp for the softmax, s.t, |s|^2, |t|^2);
``_row_losses_and_grad`` turns the row's statistics into its losses and, when gradients are wanted,
streams the logits again and overwrites the student logits with d loss / d s. One process runs both
in one kernel (``row_step_triton``); a vocabulary split over ranks runs them as two kernels with the
statistics combined across ranks in between (``row_stats_triton``, ``row_grad_triton``).
"""

import torch
import triton
import triton.language as tl

from .._row_step import NUM_STATS, RowStepConstants, RowStepImpl
from . import TRITON_OPTIONS
from .triton_common import (
    FLOAT32_MAX,
    INTERPRET,
    LOG2E,
    SMALLEST_PLAIN_SUM,
    block_size_for,
    cap_flags,
    check_layout,
    common_args,
    lift_args,
    lift_for,
    load_logits,
    logit_args,
    one_if_none,
    row_and_label,
    through_softcap,
)

# H200 sweeps (docs/design.md, The row step). STAGES: each hot loop's loads go through
# shared memory STAGES - 1 blocks ahead (cp.async; 1: plain loads into registers).
DEFAULT_BLOCK = 2048
DEFAULT_WARPS = 8
DEFAULT_STAGES = 6  # pipelined loads: faster than plain ones (docs/design.md, The row step)
LOSS_ONLY_BLOCK = 2048  # the no-grad launch
LOSS_ONLY_WARPS = 8
LOSS_ONLY_STAGES = 4


@triton.jit
def _exp(x):
    """e^x in one SFU instruction (ex2.approx.ftz): results below fp32's normal range (1e-38) flush to
    0, which no sum of exps and no stored gradient sees; plain tl.exp spends three more instructions
    per logit keeping them. The interpreter cannot run PTX."""
    if INTERPRET:
        return tl.exp(x)
    else:
        return tl.inline_asm_elementwise("ex2.approx.ftz.f32 $0, $1;", "=f,f", [x * LOG2E], dtype=tl.float32,
                                         is_pure=True, pack=1)


@triton.jit
def _unit_scaled_sums(student_row, teacher_row, vocab_student, vocab_teacher, student_scale, teacher_scale,
                      student_cap, teacher_cap, STUDENT_CAP: tl.constexpr, TEACHER_CAP: tl.constexpr,
                      BLOCK: tl.constexpr):
    """s.t, |s|^2, |t|^2 of s / max|s| and t / max|t|: two more passes, only for rows whose plain sums
    overflowed fp32 (logits near the dtype's largest value) or are too small (_plain_sums_unusable). An inf logit
    makes them NaN, as it should."""
    offsets = tl.arange(0, BLOCK)
    student_abs_max = tl.zeros([BLOCK], tl.float32)
    teacher_abs_max = tl.zeros([BLOCK], tl.float32)
    for start in range(0, vocab_teacher, BLOCK):
        cols = start + offsets
        s = load_logits(student_row, cols, cols < vocab_student, student_scale, student_cap, STUDENT_CAP)
        t = load_logits(teacher_row, cols, cols < vocab_teacher, teacher_scale, teacher_cap, TEACHER_CAP)
        student_abs_max = tl.maximum(student_abs_max, tl.abs(s))
        teacher_abs_max = tl.maximum(teacher_abs_max, tl.abs(t))
    student_unit = tl.max(student_abs_max, axis=0)
    teacher_unit = tl.max(teacher_abs_max, axis=0)
    student_unit = tl.where(student_unit > 0, student_unit, 1.0)
    teacher_unit = tl.where(teacher_unit > 0, teacher_unit, 1.0)
    dot = tl.zeros([BLOCK], tl.float32)
    sum_sq_student = tl.zeros([BLOCK], tl.float32)
    sum_sq_teacher = tl.zeros([BLOCK], tl.float32)
    for start in range(0, vocab_teacher, BLOCK):
        cols = start + offsets
        s = load_logits(student_row, cols, cols < vocab_student, student_scale, student_cap, STUDENT_CAP) / student_unit
        t = load_logits(teacher_row, cols, cols < vocab_teacher, teacher_scale, teacher_cap, TEACHER_CAP) / teacher_unit
        dot += s * t  # s is 0 past the student's vocabulary
        sum_sq_student += s * s
        sum_sq_teacher += t * t
    return (tl.sum(dot, axis=0), tl.sum(sum_sq_student, axis=0), tl.sum(sum_sq_teacher, axis=0),
            student_unit, teacher_unit)


@triton.jit
def _row_stats(student_row, teacher_row, in_shard, column, vocab_student, vocab_teacher, student_scale,
               teacher_scale, student_cap, teacher_cap, STUDENT_CAP: tl.constexpr, TEACHER_CAP: tl.constexpr,
               UNIT_SCALED: tl.constexpr, BLOCK: tl.constexpr, STAGES: tl.constexpr):
    """The row's ROW_STATS (_row_step.py): plain sums (scales 1), or with UNIT_SCALED sums of s / max|s|
    and t / max|t| (two more passes, for rows whose plain sums overflow fp32)."""
    offsets = tl.arange(0, BLOCK)
    run_max = tl.full([BLOCK], float("-inf"), tl.float32)
    run_sum_exp = tl.zeros([BLOCK], tl.float32)
    dot = tl.zeros([BLOCK], tl.float32)
    sum_sq_student = tl.zeros([BLOCK], tl.float32)
    sum_sq_teacher = tl.zeros([BLOCK], tl.float32)
    whole_blocks_stop = vocab_student - vocab_student % BLOCK
    # no masks: the hot loop; its loads prefetched STAGES - 1 blocks ahead
    for start in tl.range(0, whole_blocks_stop, BLOCK, num_stages=STAGES):
        cols = start + offsets
        s = load_logits(student_row, cols, None, student_scale, student_cap, STUDENT_CAP, MASKED=False)
        t = load_logits(teacher_row, cols, None, teacher_scale, teacher_cap, TEACHER_CAP, MASKED=False)
        new_max = tl.maximum(run_max, s)  # an inf or NaN logit makes the sums below overflow: the RESCUE launch
        run_sum_exp = run_sum_exp * _exp(run_max - new_max) + _exp(s - new_max)
        run_max = new_max
        dot += s * t
        sum_sq_student += s * s
        sum_sq_teacher += t * t
    for start in range(whole_blocks_stop, vocab_student, BLOCK):  # the last, partial block
        cols = start + offsets
        in_row = cols < vocab_student
        s = load_logits(student_row, cols, in_row, student_scale, student_cap, STUDENT_CAP)
        t = load_logits(teacher_row, cols, in_row, teacher_scale, teacher_cap, TEACHER_CAP)
        s_for_max = tl.where(in_row, s, float("-inf"))
        new_max = tl.maximum(run_max, s_for_max)
        # A lane that has seen only padding keeps max = -inf; keep its sum at 0 instead of NaN.
        shift = tl.where(new_max != float("-inf"), new_max, 0.0)
        run_sum_exp = run_sum_exp * _exp(run_max - shift) + _exp(s_for_max - shift)
        run_max = new_max
        dot += s * t
        sum_sq_student += s * s
        sum_sq_teacher += t * t
    # The teacher's extra vocabulary [Vs, Vt) meets the student's zero padding: only |t|^2 grows.
    for start in range(vocab_student, vocab_teacher, BLOCK):
        cols = start + offsets
        t = load_logits(teacher_row, cols, cols < vocab_teacher, teacher_scale, teacher_cap, TEACHER_CAP)
        sum_sq_teacher += t * t

    row_max = tl.max(run_max, axis=0)
    row_shift = tl.where(row_max != float("-inf"), row_max, 0.0)  # a shard with no student columns
    sum_exp = tl.sum(run_sum_exp * tl.exp(run_max - row_shift), axis=0)
    target_logit = load_logits(student_row, column, in_shard, student_scale, student_cap, STUDENT_CAP)

    dot = tl.sum(dot, axis=0)
    sum_sq_student = tl.sum(sum_sq_student, axis=0)
    sum_sq_teacher = tl.sum(sum_sq_teacher, axis=0)
    student_unit = tl.full([], 1.0, tl.float32)
    teacher_unit = tl.full([], 1.0, tl.float32)
    if UNIT_SCALED:
        dot, sum_sq_student, sum_sq_teacher, student_unit, teacher_unit = _unit_scaled_sums(
            student_row, teacher_row, vocab_student, vocab_teacher, student_scale, teacher_scale,
            student_cap, teacher_cap, STUDENT_CAP, TEACHER_CAP, BLOCK,
        )
    return row_max, sum_exp, target_logit, dot, sum_sq_student, sum_sq_teacher, student_unit, teacher_unit


@triton.jit
def _plain_sums_unusable(dot, sum_sq_student, sum_sq_teacher, teacher_row, vocab_student):
    """Whether the plain sums overflowed fp32 (or met an inf / NaN logit), or a sum of squares is so small that
    its squares may be lost, all of them where it is 0: the unit-scaled sums take such rows, after which a sum of
    0 means logits of 0. A vocabulary split's shard without student columns has no student squares to lose."""
    total = sum_sq_student + sum_sq_teacher + tl.abs(dot)
    too_small = (sum_sq_student < SMALLEST_PLAIN_SUM) & (vocab_student > 0)
    if teacher_row is not None:  # else the Gram path's products give |t|^2 (_teacher_gram.py)
        too_small |= sum_sq_teacher < SMALLEST_PLAIN_SUM
    return (total > FLOAT32_MAX) | (total != total) | too_small


@triton.jit
def _row_losses(losses_row, valid, row_max, sum_exp, target_logit, dot, sum_sq_student, sum_sq_teacher, student_unit,
                teacher_unit, beta, norm_clamp, usable):
    """Stores the row's hard and soft losses (NaN if not ``usable``: the RESCUE launch redoes the row) and
    returns what the gradient's coefficients need (_row_step.cosine_terms)."""
    log_sum_exp = tl.log(sum_exp)  # kept apart from row_max, see _row_step.row_grad_torch
    norm_student = tl.sqrt(sum_sq_student)  # T cancels but in the clamp, norm_clamp = eps T (_row_step.cosine_terms)
    norm_teacher = tl.sqrt(sum_sq_teacher)
    student_eps = norm_clamp / student_unit
    clamped_student = tl.maximum(norm_student, student_eps)
    clamped_teacher = tl.maximum(norm_teacher, norm_clamp / teacher_unit)
    cos = dot / clamped_student / clamped_teacher

    hard_loss = tl.where(valid, (row_max - target_logit) + log_sum_exp, 0.0)
    tl.store(losses_row, tl.where(usable, hard_loss, float("nan")))
    tl.store(losses_row + 1, tl.where(usable, tl.where(valid, beta * (1.0 - cos), 0.0), float("nan")))
    return log_sum_exp, norm_student, student_eps, clamped_student, clamped_teacher, cos


@triton.jit
def _grad_coefficients(sum_sq_student, sum_sq_teacher, student_unit, teacher_unit, norm_student, student_eps,
                       clamped_student, clamped_teacher, cos, weight_hard, weight_soft, beta,
                       student_scale, lift_row, LIFT: tl.constexpr):
    """The row's d L / d s per logit is prob_coef * softmax + teacher_coef * t + student_coef * s, less
    prob_coef at the label (row_grad_torch); with LIFT, times the row's power of two, stored at
    ``lift_row`` (_row_step.row_lift_bound, lift_for)."""
    # d L / d s = weight_hard * (softmax - onehot) - weight_soft * beta * d cos / d s, and
    # d cos / d s = coef_teacher * t - coef_student * s.
    coef_teacher = 1.0 / (clamped_student * clamped_teacher) / student_unit / teacher_unit
    coef_teacher = tl.where((coef_teacher > FLOAT32_MAX) & (sum_sq_teacher == 0), 0.0, coef_teacher)  # cosine_terms
    coef_student = tl.where(
        norm_student >= student_eps,
        cos / (clamped_student * clamped_student) / student_unit / student_unit,
        0.0,
    )
    soft_scale = weight_soft * beta
    grad_factor = one_if_none(student_scale)
    if LIFT:
        bound = tl.abs(weight_hard) + tl.abs(soft_scale) * (
            coef_teacher * teacher_unit * tl.sqrt(sum_sq_teacher)
            + tl.abs(coef_student) * student_unit * tl.sqrt(sum_sq_student))
        lift = lift_for(bound * tl.abs(grad_factor))
        tl.store(lift_row, lift)
        grad_factor *= lift
    return weight_hard * grad_factor, -soft_scale * coef_teacher * grad_factor, soft_scale * coef_student * grad_factor


@triton.jit
def _row_losses_and_grad(
    student_row, teacher_row, losses_row, valid, in_shard, column, vocab_student,
    row_max, sum_exp, target_logit, dot, sum_sq_student, sum_sq_teacher, student_unit, teacher_unit,
    weight_hard, weight_soft, beta, norm_clamp, student_scale, teacher_scale, student_cap, teacher_cap,
    usable, lift_row, STUDENT_CAP: tl.constexpr, TEACHER_CAP: tl.constexpr, WRITE_GRAD: tl.constexpr,
    LIFT: tl.constexpr, BLOCK: tl.constexpr, STAGES: tl.constexpr,
):
    """Losses and (if WRITE_GRAD) d L / d s from the row's statistics, the label's entry stored apart after
    the loop, times the softcap's derivative. If not ``usable`` the losses become NaN and the logits are
    left alone, for the RESCUE launch."""
    log_sum_exp, norm_student, student_eps, clamped_student, clamped_teacher, cos = _row_losses(
        losses_row, valid, row_max, sum_exp, target_logit, dot, sum_sq_student, sum_sq_teacher, student_unit,
        teacher_unit, beta, norm_clamp, usable)
    if WRITE_GRAD:
        prob_coef, teacher_coef, student_coef = _grad_coefficients(
            sum_sq_student, sum_sq_teacher, student_unit, teacher_unit, norm_student, student_eps, clamped_student,
            clamped_teacher, cos, weight_hard, weight_soft, beta, student_scale, lift_row, LIFT)
        offsets = tl.arange(0, BLOCK)
        whole_blocks_stop = vocab_student - vocab_student % BLOCK
        if usable & valid:
            for start in tl.range(0, whole_blocks_stop, BLOCK, num_stages=STAGES):
                _write_grad_block(student_row, teacher_row, start + offsets, vocab_student, row_max, log_sum_exp,
                                  prob_coef, teacher_coef, student_coef, student_scale, teacher_scale, student_cap,
                                  teacher_cap, STUDENT_CAP, TEACHER_CAP, MASKED=False)
            for start in range(whole_blocks_stop, vocab_student, BLOCK):  # the last, partial block
                _write_grad_block(student_row, teacher_row, start + offsets, vocab_student, row_max, log_sum_exp,
                                  prob_coef, teacher_coef, student_coef, student_scale, teacher_scale, student_cap,
                                  teacher_cap, STUDENT_CAP, TEACHER_CAP, MASKED=True)
            if in_shard:
                t_label = load_logits(teacher_row, column, in_shard, teacher_scale, teacher_cap, TEACHER_CAP)
                label_grad = _grad_block(target_logit, t_label, row_max, log_sum_exp, prob_coef, teacher_coef,
                                         student_coef, student_cap, STUDENT_CAP, ONE_HOT=True)
                tl.debug_barrier()  # after every thread's store of the row's blocks
                tl.store(student_row + column, label_grad.to(student_row.dtype.element_ty))
        elif usable:  # an ignored token: no gradient
            for start in range(0, vocab_student, BLOCK):
                cols = start + offsets
                tl.store(student_row + cols, tl.zeros([BLOCK], student_row.dtype.element_ty), mask=cols < vocab_student)


@triton.jit
def _write_grad_block(student_row, teacher_row, cols, vocab_student, row_max, log_sum_exp, prob_coef, teacher_coef,
                      student_coef, student_scale, teacher_scale, student_cap, teacher_cap, STUDENT_CAP: tl.constexpr,
                      TEACHER_CAP: tl.constexpr, MASKED: tl.constexpr):
    """Overwrites one block of the row's student logits with d L / d s (MASKED: the last, partial block)."""
    in_row = cols < vocab_student
    s = load_logits(student_row, cols, in_row, student_scale, student_cap, STUDENT_CAP, MASKED)
    t = load_logits(teacher_row, cols, in_row, teacher_scale, teacher_cap, TEACHER_CAP, MASKED)
    grad = _grad_block(s, t, row_max, log_sum_exp, prob_coef, teacher_coef, student_coef, student_cap, STUDENT_CAP)
    if MASKED:
        tl.store(student_row + cols, grad.to(student_row.dtype.element_ty), mask=in_row)
    else:
        tl.store(student_row + cols, grad.to(student_row.dtype.element_ty))


@triton.jit
def _grad_block(s, t, row_max, log_sum_exp, prob_coef, teacher_coef, student_coef, student_cap,
                STUDENT_CAP: tl.constexpr, ONE_HOT: tl.constexpr = False):
    """d L / d s from the transformed logits and the row's coefficients (_row_losses_and_grad); with
    ONE_HOT, the label's entry (one logit, at full precision)."""
    if ONE_HOT:
        grad = prob_coef * (tl.exp((s - row_max) - log_sum_exp) - 1.0)
    else:
        grad = prob_coef * _exp((s - row_max) - log_sum_exp)
    grad += teacher_coef * t + student_coef * s
    return through_softcap(grad, s, student_cap, STUDENT_CAP)


@triton.jit
def _row_step_kernel(
    student_ptr, student_row_stride, teacher_ptr, teacher_row_stride, labels_ptr, losses_ptr, lifts_ptr,
    vocab_student, vocab_teacher, ignore_index, vocab_start, vocab_student_total,
    weight_hard, weight_soft, beta, norm_clamp, student_cap, teacher_cap, student_scale, teacher_scale,
    STUDENT_CAP: tl.constexpr, TEACHER_CAP: tl.constexpr, WRITE_GRAD: tl.constexpr, LIFT: tl.constexpr,
    RESCUE: tl.constexpr, BLOCK: tl.constexpr, STAGES: tl.constexpr,
):
    """Launched twice. First (RESCUE False) every row with plain sums; a row whose sums are unusable
    (_plain_sums_unusable) gets NaN losses and keeps its logits. Then (RESCUE True) only those rows, with
    unit-scaled sums. A branch
    for them inside the first launch slowed every row (docs/design.md, The row step)."""
    row = tl.program_id(0).to(tl.int64)
    losses_row = losses_ptr + row * 2
    if RESCUE:
        left = tl.load(losses_row)
        todo = left != left
    else:
        todo = True
    if todo:
        student_row, valid, in_shard, column = row_and_label(
            row, student_ptr, student_row_stride, labels_ptr, ignore_index, vocab_start, vocab_student,
            vocab_student_total,
        )
        teacher_row = teacher_ptr  # None: no teacher logits (the Gram path)
        if teacher_ptr is not None:
            teacher_row = teacher_ptr + row * teacher_row_stride
        row_max, sum_exp, target_logit, dot, sum_sq_student, sum_sq_teacher, student_unit, teacher_unit = _row_stats(
            student_row, teacher_row, in_shard, column, vocab_student, vocab_teacher, student_scale, teacher_scale,
            student_cap, teacher_cap, STUDENT_CAP, TEACHER_CAP, RESCUE, BLOCK, STAGES,
        )
        if RESCUE:  # an inf or NaN logit still overflows: its NaN loss and gradient are the answer
            usable = tl.full([], 1, tl.int1)
        else:
            usable = _plain_sums_unusable(dot, sum_sq_student, sum_sq_teacher, teacher_row, vocab_student) == 0
        _row_losses_and_grad(
            student_row, teacher_row, losses_row, valid, in_shard, column, vocab_student,
            row_max, sum_exp, target_logit, dot, sum_sq_student, sum_sq_teacher, student_unit, teacher_unit,
            weight_hard, weight_soft, beta, norm_clamp, student_scale, teacher_scale, student_cap, teacher_cap,
            usable, lifts_ptr + row, STUDENT_CAP, TEACHER_CAP, WRITE_GRAD, LIFT, BLOCK, STAGES,
        )


@triton.jit
def _row_stats_kernel(
    student_ptr, student_row_stride, teacher_ptr, teacher_row_stride, labels_ptr, stats_ptr,
    vocab_student, vocab_teacher, ignore_index, vocab_start, vocab_student_total,
    student_cap, teacher_cap, student_scale, teacher_scale,
    STUDENT_CAP: tl.constexpr, TEACHER_CAP: tl.constexpr, NUM_STATS: tl.constexpr, BLOCK: tl.constexpr,
    STAGES: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    student_row, _, in_shard, column = row_and_label(
        row, student_ptr, student_row_stride, labels_ptr, ignore_index, vocab_start, vocab_student, vocab_student_total,
    )
    teacher_row = teacher_ptr  # None: no teacher logits (the Gram path)
    if teacher_ptr is not None:
        teacher_row = teacher_ptr + row * teacher_row_stride
    row_max, sum_exp, target_logit, dot, sum_sq_student, sum_sq_teacher, student_unit, teacher_unit = _row_stats(
        student_row, teacher_row, in_shard, column, vocab_student, vocab_teacher, student_scale, teacher_scale,
        student_cap, teacher_cap, STUDENT_CAP, TEACHER_CAP, False, BLOCK, STAGES,
    )
    if _plain_sums_unusable(dot, sum_sq_student, sum_sq_teacher, teacher_row, vocab_student):
        dot, sum_sq_student, sum_sq_teacher, student_unit, teacher_unit = _unit_scaled_sums(
            student_row, teacher_row, vocab_student, vocab_teacher, student_scale, teacher_scale,
            student_cap, teacher_cap, STUDENT_CAP, TEACHER_CAP, BLOCK,
        )
    stats_row = stats_ptr + row * NUM_STATS  # the order of _row_step.ROW_STATS
    tl.store(stats_row, row_max)
    tl.store(stats_row + 1, sum_exp)
    tl.store(stats_row + 2, target_logit)
    tl.store(stats_row + 3, dot)
    tl.store(stats_row + 4, sum_sq_student)
    tl.store(stats_row + 5, sum_sq_teacher)
    tl.store(stats_row + 6, student_unit)
    tl.store(stats_row + 7, teacher_unit)


@triton.jit
def _row_grad_kernel(
    student_ptr, student_row_stride, teacher_ptr, teacher_row_stride, labels_ptr, stats_ptr, losses_ptr, lifts_ptr,
    vocab_student, ignore_index, vocab_start, vocab_student_total,
    weight_hard, weight_soft, beta, norm_clamp, student_cap, teacher_cap, student_scale, teacher_scale,
    STUDENT_CAP: tl.constexpr, TEACHER_CAP: tl.constexpr, WRITE_GRAD: tl.constexpr, LIFT: tl.constexpr,
    NUM_STATS: tl.constexpr, BLOCK: tl.constexpr, STAGES: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    student_row, valid, in_shard, column = row_and_label(
        row, student_ptr, student_row_stride, labels_ptr, ignore_index, vocab_start, vocab_student, vocab_student_total,
    )
    teacher_row = teacher_ptr  # None: no teacher logits (the Gram path)
    if teacher_ptr is not None:
        teacher_row = teacher_ptr + row * teacher_row_stride
    stats_row = stats_ptr + row * NUM_STATS
    _row_losses_and_grad(
        student_row, teacher_row, losses_ptr + row * 2, valid, in_shard, column, vocab_student,
        tl.load(stats_row), tl.load(stats_row + 1), tl.load(stats_row + 2), tl.load(stats_row + 3),
        tl.load(stats_row + 4), tl.load(stats_row + 5), tl.load(stats_row + 6), tl.load(stats_row + 7),
        weight_hard, weight_soft, beta, norm_clamp, student_scale, teacher_scale, student_cap, teacher_cap,
        tl.full([], 1, tl.int1), lifts_ptr + row, STUDENT_CAP, TEACHER_CAP, WRITE_GRAD, LIFT, BLOCK, STAGES,
    )


def _loss_args(constants: RowStepConstants):
    return (constants.weight_hard, constants.weight_soft, constants.beta, constants.norm_clamp,
            *logit_args(constants))


def _teacher_args(teacher_logits, vocab_student):
    """(pointer, row stride, vocabulary): None, 0 and the student's vocabulary without teacher logits."""
    if teacher_logits is None:
        return None, 0, vocab_student
    return teacher_logits, teacher_logits.stride(0), teacher_logits.shape[1]


def row_step_triton(student_logits, teacher_logits, labels, constants: RowStepConstants, token_losses, write_grad,
                    grad_lifts=None, block_size=None, num_warps=None, num_stages=None, rescue_only=False) -> None:
    """``rescue_only``: only the RESCUE launch, for the rows another kernel left with NaN losses
    (row_step_cuda)."""
    rows, vocab_student = student_logits.shape
    if rows == 0:
        return
    check_layout(student_logits, teacher_logits, labels, token_losses, *([] if grad_lifts is None else [grad_lifts]))
    lifts, lift_flag = lift_args(grad_lifts, token_losses, write_grad)
    num_warps = num_warps or (DEFAULT_WARPS if write_grad else LOSS_ONLY_WARPS)
    block = block_size_for(vocab_student, block_size, num_warps, DEFAULT_BLOCK if write_grad else LOSS_ONLY_BLOCK)
    stages = num_stages or (DEFAULT_STAGES if write_grad else LOSS_ONLY_STAGES)
    for rescue in (True,) if rescue_only else (False, True):
        teacher, teacher_stride, vocab_teacher = _teacher_args(teacher_logits, vocab_student)
        _row_step_kernel[(rows,)](
            student_logits, student_logits.stride(0), teacher, teacher_stride, labels, token_losses,
            lifts, vocab_student, vocab_teacher, *common_args(vocab_student, constants), *_loss_args(constants),
            **cap_flags(constants), WRITE_GRAD=write_grad, **lift_flag, RESCUE=rescue, BLOCK=block,
            STAGES=stages, num_warps=num_warps, **TRITON_OPTIONS,
        )


def row_stats_triton(student_logits, teacher_logits, labels, constants: RowStepConstants, block_size=None,
                     num_warps=DEFAULT_WARPS, num_stages=DEFAULT_STAGES) -> torch.Tensor:
    rows, vocab_student = student_logits.shape
    stats = torch.empty(rows, NUM_STATS, dtype=torch.float32, device=student_logits.device)
    if rows == 0:
        return stats
    check_layout(student_logits, teacher_logits, labels)
    teacher, teacher_stride, vocab_teacher = _teacher_args(teacher_logits, vocab_student)
    _row_stats_kernel[(rows,)](
        student_logits, student_logits.stride(0), teacher, teacher_stride, labels, stats,
        vocab_student, vocab_teacher, *common_args(vocab_student, constants), *logit_args(constants),
        **cap_flags(constants), NUM_STATS=NUM_STATS, BLOCK=block_size_for(vocab_student, block_size, num_warps, DEFAULT_BLOCK),
        STAGES=num_stages, num_warps=num_warps, **TRITON_OPTIONS,
    )
    return stats


def row_grad_triton(student_logits, teacher_logits, labels, stats, constants: RowStepConstants, token_losses, write_grad,
                    grad_lifts=None, block_size=None, num_warps=DEFAULT_WARPS, num_stages=DEFAULT_STAGES) -> None:
    rows, vocab_student = student_logits.shape
    if rows == 0:
        return
    check_layout(student_logits, teacher_logits, labels, stats, token_losses,
                  *([] if grad_lifts is None else [grad_lifts]))
    lifts, lift_flag = lift_args(grad_lifts, token_losses, write_grad)
    teacher, teacher_stride, _ = _teacher_args(teacher_logits, vocab_student)
    _row_grad_kernel[(rows,)](
        student_logits, student_logits.stride(0), teacher, teacher_stride, labels, stats,
        token_losses, lifts, vocab_student, *common_args(vocab_student, constants), *_loss_args(constants),
        **cap_flags(constants), WRITE_GRAD=write_grad, **lift_flag, NUM_STATS=NUM_STATS,
        BLOCK=block_size_for(vocab_student, block_size, num_warps, DEFAULT_BLOCK), STAGES=num_stages, num_warps=num_warps,
        **TRITON_OPTIONS,
    )


COSINE_TRITON_ROW_STEP = RowStepImpl(row_step_triton, row_stats_triton, row_grad_triton)
