"""The fused row step in Triton: the twin of ``row_step.py`` (read that first).

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

from .row_step import COSINE_EPS, MAX_LIFT_EXPONENT, MAX_STORED_EXPONENT, NUM_STATS, RowStepImpl, RowStepScales

DEFAULT_BLOCK = 1024  # the per-row kernels (H200 sweeps, benchmarks/NOTES.md items 2 and 19)
RESCUE_WARPS = 4
DEFAULT_SLICE = 8192  # the sliced kernel (benchmarks/NOTES.md item 23)
DEFAULT_WARPS = 4
LOSS_ONLY_SLICE = 8192
LOSS_ONLY_WARPS = 4
FLOAT32_MAX: tl.constexpr = tl.constexpr(3.4028234663852886e38)  # a jit global must be a constexpr
FLOAT32_TINY: tl.constexpr = tl.constexpr(1.1754943508222875e-38)  # bound 0 (both weights 0): no log2(0)
MAX_LIFT: tl.constexpr = tl.constexpr(float(MAX_LIFT_EXPONENT))
MAX_STORED: tl.constexpr = tl.constexpr(float(MAX_STORED_EXPONENT))
NUM_PARTIALS: tl.constexpr = tl.constexpr(6)  # per slice: _span_partials


@triton.jit
def _softcap(x, cap):
    """cap * tanh(x / cap), with tanh written through exp of a non-positive number (no overflow)."""
    decay = tl.exp(-2.0 * tl.abs(x) / cap)
    tanh_abs = (1.0 - decay) / (1.0 + decay)
    return cap * tl.where(x >= 0, tanh_abs, -tanh_abs)


@triton.jit
def _load_logits(row, cols, mask, logit_scale, cap, CAP: tl.constexpr):
    """Logits as the loss sees them: fp32, times the logit scale, softcapped; 0 where masked."""
    x = tl.load(row + cols, mask=mask, other=0.0).to(tl.float32) * logit_scale
    if CAP:
        x = _softcap(x, cap)
    return x


@triton.jit
def _row_and_label(row, student_ptr, student_row_stride, teacher_ptr, teacher_row_stride, labels_ptr, ignore_index,
                   vocab_start, vocab_student, vocab_student_total):
    """The row's logits pointers and its label: whether it counts, and where it lies in this shard."""
    label = tl.load(labels_ptr + row).to(tl.int64)
    valid = (label != ignore_index) & (label >= 0) & (label < vocab_student_total)
    column = label - vocab_start
    in_shard = valid & (column >= 0) & (column < vocab_student)
    return student_ptr + row * student_row_stride, teacher_ptr + row * teacher_row_stride, valid, in_shard, column


@triton.jit
def _unit_scaled_sums(student_row, teacher_row, vocab_student, vocab_teacher, student_scale, teacher_scale,
                      student_cap, teacher_cap, STUDENT_CAP: tl.constexpr, TEACHER_CAP: tl.constexpr,
                      BLOCK: tl.constexpr):
    """s.t, |s|^2, |t|^2 of s / max|s| and t / max|t|: two more passes, only for rows whose plain sums
    overflowed fp32 (logits near the dtype's largest value). An inf logit makes them NaN, as it should."""
    offsets = tl.arange(0, BLOCK)
    student_abs_max = tl.zeros([BLOCK], tl.float32)
    teacher_abs_max = tl.zeros([BLOCK], tl.float32)
    for start in range(0, vocab_teacher, BLOCK):
        cols = start + offsets
        s = _load_logits(student_row, cols, cols < vocab_student, student_scale, student_cap, STUDENT_CAP)
        t = _load_logits(teacher_row, cols, cols < vocab_teacher, teacher_scale, teacher_cap, TEACHER_CAP)
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
        s = _load_logits(student_row, cols, cols < vocab_student, student_scale, student_cap, STUDENT_CAP) / student_unit
        t = _load_logits(teacher_row, cols, cols < vocab_teacher, teacher_scale, teacher_cap, TEACHER_CAP) / teacher_unit
        dot += s * t  # s is 0 past the student's vocabulary
        sum_sq_student += s * s
        sum_sq_teacher += t * t
    return (tl.sum(dot, axis=0), tl.sum(sum_sq_student, axis=0), tl.sum(sum_sq_teacher, axis=0),
            student_unit, teacher_unit)


@triton.jit
def _row_stats(student_row, teacher_row, in_shard, column, vocab_student, vocab_teacher, student_scale,
               teacher_scale, student_cap, teacher_cap, STUDENT_CAP: tl.constexpr, TEACHER_CAP: tl.constexpr,
               UNIT_SCALED: tl.constexpr, BLOCK: tl.constexpr):
    """The row's ROW_STATS (row_step.py): plain sums (scales 1), or with UNIT_SCALED sums of s / max|s|
    and t / max|t| (two more passes, for rows whose plain sums overflow fp32)."""
    offsets = tl.arange(0, BLOCK)
    run_max = tl.full([BLOCK], float("-inf"), tl.float32)
    run_sum_exp = tl.zeros([BLOCK], tl.float32)
    dot = tl.zeros([BLOCK], tl.float32)
    sum_sq_student = tl.zeros([BLOCK], tl.float32)
    sum_sq_teacher = tl.zeros([BLOCK], tl.float32)
    for start in range(0, vocab_student, BLOCK):
        cols = start + offsets
        in_row = cols < vocab_student
        s = _load_logits(student_row, cols, in_row, student_scale, student_cap, STUDENT_CAP)
        t = _load_logits(teacher_row, cols, in_row, teacher_scale, teacher_cap, TEACHER_CAP)
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
        t = _load_logits(teacher_row, cols, cols < vocab_teacher, teacher_scale, teacher_cap, TEACHER_CAP)
        sum_sq_teacher += t * t

    row_max = tl.max(run_max, axis=0)
    row_shift = tl.where(row_max != float("-inf"), row_max, 0.0)  # a shard with no student columns
    sum_exp = tl.sum(run_sum_exp * tl.exp(run_max - row_shift), axis=0)
    target_logit = _load_logits(student_row, column, in_shard, student_scale, student_cap, STUDENT_CAP)

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
def _overflowed(dot, sum_sq_student, sum_sq_teacher):
    """Whether the plain sums overflowed fp32 (or met an inf / NaN logit)."""
    total = sum_sq_student + sum_sq_teacher + tl.abs(dot)
    return (total > FLOAT32_MAX) | (total != total)


@triton.jit
def _row_losses_and_factors(
    valid, row_max, sum_exp, target_logit, dot, sum_sq_student, sum_sq_teacher, student_unit, teacher_unit,
    beta, inv_temp_sq, eps, weight_hard, weight_soft, student_scale, LIFT: tl.constexpr,
):
    """From the row's statistics: its losses, log(sum_exp), the two coefficients of d cos / d s
    (row_step.cosine_terms), and the factor the gradient is stored times: the logit scale, and with
    LIFT the row's power of two (row_step.row_lift_bound, lift_for), returned apart as well."""
    log_sum_exp = tl.log(sum_exp)  # kept apart from row_max, see row_step.row_grad_torch
    norm_student = tl.sqrt(sum_sq_student * inv_temp_sq)
    norm_teacher = tl.sqrt(sum_sq_teacher * inv_temp_sq)
    student_eps = eps / student_unit
    clamped_student = tl.maximum(norm_student, student_eps)
    clamped_teacher = tl.maximum(norm_teacher, eps / teacher_unit)
    cos = dot * inv_temp_sq / clamped_student / clamped_teacher
    hard_loss = tl.where(valid, (row_max - target_logit) + log_sum_exp, 0.0)
    soft_loss = tl.where(valid, beta * (1.0 - cos), 0.0)

    # d L / d s = weight_hard * (softmax - onehot) - weight_soft * beta * d cos / d s, and
    # d cos / d s = coef_teacher * t - coef_student * s.
    coef_teacher = inv_temp_sq / (clamped_student * clamped_teacher) / student_unit / teacher_unit
    coef_student = tl.where(
        norm_student >= student_eps,
        cos * inv_temp_sq / (clamped_student * clamped_student) / student_unit / student_unit,
        0.0,
    )
    grad_factor = student_scale
    lift = tl.full([], 1.0, tl.float32)
    if LIFT:
        bound = tl.abs(weight_hard) + tl.abs(weight_soft * beta) * (
            coef_teacher * teacher_unit * tl.sqrt(sum_sq_teacher)
            + tl.abs(coef_student) * student_unit * tl.sqrt(sum_sq_student))
        bound = tl.maximum(bound * tl.abs(student_scale), FLOAT32_TINY, propagate_nan=tl.PropagateNan.ALL)
        exponent = tl.floor(-tl.log2(bound))
        exponent = tl.where(exponent > 0, tl.minimum(exponent, MAX_LIFT),
                            tl.where(exponent < -MAX_STORED, exponent + MAX_STORED, 0.0))  # NaN -> 0
        lift = ((exponent.to(tl.int32) + 127) << 23).to(tl.float32, bitcast=True)  # exactly 2^exponent
        grad_factor *= lift
    return hard_loss, soft_loss, log_sum_exp, coef_teacher, coef_student, grad_factor, lift


@triton.jit
def _grad_block(s, t, cols, in_row, valid, in_shard, column, row_max, log_sum_exp, coef_teacher, coef_student,
                grad_factor, weight_hard, soft_scale, student_cap, STUDENT_CAP: tl.constexpr):
    """d L / d s (times grad_factor) on one block of a row's columns, from its transformed logits."""
    prob = tl.exp((s - row_max) - log_sum_exp)
    grad = weight_hard * (prob - tl.where((cols == column) & in_shard, 1.0, 0.0))
    grad -= soft_scale * (coef_teacher * t - coef_student * s)
    if STUDENT_CAP:
        grad *= 1.0 - (s / student_cap) * (s / student_cap)  # d(c tanh(z / c)) / dz
    grad *= grad_factor
    return tl.where(valid & in_row, grad, 0.0)


@triton.jit
def _row_losses_and_grad(
    student_row, teacher_row, losses_row, valid, in_shard, column, vocab_student,
    row_max, sum_exp, target_logit, dot, sum_sq_student, sum_sq_teacher, student_unit, teacher_unit,
    weight_hard, weight_soft, beta, inv_temp_sq, eps, student_scale, teacher_scale, student_cap, teacher_cap,
    lift_row, STUDENT_CAP: tl.constexpr, TEACHER_CAP: tl.constexpr, WRITE_GRAD: tl.constexpr,
    LIFT: tl.constexpr, BLOCK: tl.constexpr,
):
    """Losses and (if WRITE_GRAD) d L / d s of a whole row from its statistics, streaming the row's
    logits again; with LIFT the row's power of two is stored at ``lift_row``."""
    hard_loss, soft_loss, log_sum_exp, coef_teacher, coef_student, grad_factor, lift = _row_losses_and_factors(
        valid, row_max, sum_exp, target_logit, dot, sum_sq_student, sum_sq_teacher, student_unit, teacher_unit,
        beta, inv_temp_sq, eps, weight_hard, weight_soft, student_scale, LIFT and WRITE_GRAD,
    )
    tl.store(losses_row, hard_loss)
    tl.store(losses_row + 1, soft_loss)
    if WRITE_GRAD:
        if LIFT:
            tl.store(lift_row, lift)
        offsets = tl.arange(0, BLOCK)
        for start in range(0, vocab_student, BLOCK):
            cols = start + offsets
            in_row = cols < vocab_student
            s = _load_logits(student_row, cols, in_row, student_scale, student_cap, STUDENT_CAP)
            t = _load_logits(teacher_row, cols, in_row, teacher_scale, teacher_cap, TEACHER_CAP)
            grad = _grad_block(s, t, cols, in_row, valid, in_shard, column, row_max, log_sum_exp, coef_teacher,
                               coef_student, grad_factor, weight_hard, weight_soft * beta, student_cap, STUDENT_CAP)
            tl.store(student_row + cols, grad.to(student_row.dtype.element_ty), mask=in_row)


@triton.jit
def _rescue_kernel(
    student_ptr, student_row_stride, teacher_ptr, teacher_row_stride, labels_ptr, losses_ptr, lifts_ptr,
    vocab_student, vocab_teacher, ignore_index, vocab_start, vocab_student_total,
    weight_hard, weight_soft, beta, inv_temp_sq, eps, student_cap, teacher_cap, student_scale, teacher_scale,
    STUDENT_CAP: tl.constexpr, TEACHER_CAP: tl.constexpr, WRITE_GRAD: tl.constexpr, LIFT: tl.constexpr,
    BLOCK: tl.constexpr,
):
    """One program per row, after the sliced kernel: the rows it left with NaN losses (their plain sums
    overflowed fp32) again, with unit-scaled sums. A branch for them inside the hot kernel cost the
    step 20% (benchmarks/NOTES.md item 10)."""
    row = tl.program_id(0).to(tl.int64)
    losses_row = losses_ptr + row * 2
    left = tl.load(losses_row)
    if left != left:
        student_row, teacher_row, valid, in_shard, column = _row_and_label(
            row, student_ptr, student_row_stride, teacher_ptr, teacher_row_stride, labels_ptr, ignore_index,
            vocab_start, vocab_student, vocab_student_total,
        )
        row_max, sum_exp, target_logit, dot, sum_sq_student, sum_sq_teacher, student_unit, teacher_unit = _row_stats(
            student_row, teacher_row, in_shard, column, vocab_student, vocab_teacher, student_scale, teacher_scale,
            student_cap, teacher_cap, STUDENT_CAP, TEACHER_CAP, True, BLOCK,
        )
        _row_losses_and_grad(  # an inf or NaN logit still overflows: its NaN loss and gradient are the answer
            student_row, teacher_row, losses_row, valid, in_shard, column, vocab_student,
            row_max, sum_exp, target_logit, dot, sum_sq_student, sum_sq_teacher, student_unit, teacher_unit,
            weight_hard, weight_soft, beta, inv_temp_sq, eps, student_scale, teacher_scale, student_cap, teacher_cap,
            lifts_ptr + row, STUDENT_CAP, TEACHER_CAP, WRITE_GRAD, LIFT, BLOCK,
        )


@triton.jit
def _span_partials(student_row, teacher_row, in_shard, column, span_start, span_stop, vocab_student, vocab_teacher,
                   student_scale, teacher_scale, student_cap, teacher_cap, STUDENT_CAP: tl.constexpr,
                   TEACHER_CAP: tl.constexpr, BLOCK: tl.constexpr):
    """One span of a row's columns, streamed in BLOCK-wide steps: its share of the row statistics, i.e.
    its max of s, sum of exp(s - that max), s[label] if the label lies in it (else 0), s.t, |s|^2, |t|^2
    (the student's padding is 0 in s and -inf for the max)."""
    offsets = tl.arange(0, BLOCK)
    run_max = tl.full([BLOCK], float("-inf"), tl.float32)
    run_sum_exp = tl.zeros([BLOCK], tl.float32)
    dot = tl.zeros([BLOCK], tl.float32)
    sum_sq_student = tl.zeros([BLOCK], tl.float32)
    sum_sq_teacher = tl.zeros([BLOCK], tl.float32)
    for start in range(span_start, span_stop, BLOCK):
        cols = start + offsets
        in_student = cols < vocab_student
        s = _load_logits(student_row, cols, in_student, student_scale, student_cap, STUDENT_CAP)
        t = _load_logits(teacher_row, cols, cols < vocab_teacher, teacher_scale, teacher_cap, TEACHER_CAP)
        s_for_max = tl.where(in_student, s, float("-inf"))
        new_max = tl.maximum(run_max, s_for_max)
        shift = tl.where(new_max != float("-inf"), new_max, 0.0)
        run_sum_exp = run_sum_exp * tl.exp(run_max - shift) + tl.exp(s_for_max - shift)
        run_max = new_max
        dot += s * t
        sum_sq_student += s * s
        sum_sq_teacher += t * t
    span_max = tl.max(run_max, axis=0)
    span_shift = tl.where(span_max != float("-inf"), span_max, 0.0)  # a span past the student's vocabulary
    sum_exp = tl.sum(run_sum_exp * tl.exp(run_max - span_shift), axis=0)
    in_span = in_shard & (column >= span_start) & (column < span_stop)
    target = _load_logits(student_row, column, in_span, student_scale, student_cap, STUDENT_CAP)
    return (span_max, sum_exp, target, tl.sum(dot, axis=0), tl.sum(sum_sq_student, axis=0),
            tl.sum(sum_sq_teacher, axis=0))


@triton.jit
def _combined_partials(partials_row, num_slices, MAX_SLICES: tl.constexpr):
    """The row statistics (scales 1) from the partials of all its slices, [NUM_PARTIALS, num_slices],
    read past L1 (other programs wrote them), summed in slice order: every program of a row gets
    the same bits."""
    slices = tl.arange(0, MAX_SLICES)
    present = slices < num_slices
    maxes = tl.load(partials_row + slices, mask=present, other=float("-inf"), cache_modifier=".cg")
    row_max = tl.max(maxes, axis=0)
    row_shift = tl.where(row_max != float("-inf"), row_max, 0.0)
    sums_exp = tl.load(partials_row + num_slices + slices, mask=present, other=0.0, cache_modifier=".cg")
    sum_exp = tl.sum(tl.where(maxes != float("-inf"), sums_exp * tl.exp(maxes - row_shift), 0.0), axis=0)
    target = tl.sum(tl.load(partials_row + 2 * num_slices + slices, mask=present, other=0.0, cache_modifier=".cg"))
    dot = tl.sum(tl.load(partials_row + 3 * num_slices + slices, mask=present, other=0.0, cache_modifier=".cg"))
    sum_sq_student = tl.sum(tl.load(partials_row + 4 * num_slices + slices, mask=present, other=0.0,
                                    cache_modifier=".cg"))
    sum_sq_teacher = tl.sum(tl.load(partials_row + 5 * num_slices + slices, mask=present, other=0.0,
                                    cache_modifier=".cg"))
    return row_max, sum_exp, target, dot, sum_sq_student, sum_sq_teacher


@triton.jit
def _sliced_row_step_kernel(
    student_ptr, student_row_stride, teacher_ptr, teacher_row_stride, labels_ptr, losses_ptr, lifts_ptr,
    partials_ptr, counters_ptr, num_slices,
    vocab_student, vocab_teacher, ignore_index, vocab_start, vocab_student_total,
    weight_hard, weight_soft, beta, inv_temp_sq, eps, student_cap, teacher_cap, student_scale, teacher_scale,
    STUDENT_CAP: tl.constexpr, TEACHER_CAP: tl.constexpr, WRITE_GRAD: tl.constexpr, LIFT: tl.constexpr,
    PUBLISH: tl.constexpr, WAIT: tl.constexpr, FINISH: tl.constexpr, SLICE: tl.constexpr,
    MAX_SLICES: tl.constexpr, BLOCK: tl.constexpr, TICKETS: tl.constexpr = True,
):
    """One program per (row, slice of SLICE columns): the row step reading each logit once.

    PUBLISH: load the slice, store its partial statistics, count them in the row's counter.
    FINISH: combine the row's partials into its statistics; the slice-0 program writes the losses
    (and lift), every program its slice's gradient from the logits it holds.
    In one launch (PUBLISH and FINISH) a program must wait for the other slices of its row (WAIT):
    programs take their (row, slice) from a ticket counter, so every program waited for has started.
    Without gradients no one waits: the last program of a row to publish finishes it alone.
    Rows whose sums overflow fp32 get NaN losses and keep their logits, for the RESCUE launch of
    ``_rescue_kernel``."""
    if WAIT and TICKETS:
        ticket = tl.atomic_add(counters_ptr, 1)  # counters_ptr[0]: the ticket counter, then one per row
    else:
        ticket = tl.program_id(0)
    row = (ticket // num_slices).to(tl.int64)
    slice_index = ticket % num_slices
    student_row, teacher_row, valid, in_shard, column = _row_and_label(
        row, student_ptr, student_row_stride, teacher_ptr, teacher_row_stride, labels_ptr, ignore_index,
        vocab_start, vocab_student, vocab_student_total,
    )
    span_start = slice_index * SLICE
    span_stop = tl.minimum(span_start + SLICE, tl.maximum(vocab_student, vocab_teacher))
    partials_row = partials_ptr + row * NUM_PARTIALS * num_slices
    counter = counters_ptr + 1 + row
    finish = FINISH
    if PUBLISH:
        slice_max, sum_exp, target, dot, sum_sq_student, sum_sq_teacher = _span_partials(
            student_row, teacher_row, in_shard, column, span_start, span_stop, vocab_student, vocab_teacher,
            student_scale, teacher_scale, student_cap, teacher_cap, STUDENT_CAP, TEACHER_CAP, BLOCK)
        partial = partials_row + slice_index
        tl.store(partial, slice_max)
        tl.store(partial + num_slices, sum_exp)
        tl.store(partial + 2 * num_slices, target)
        tl.store(partial + 3 * num_slices, dot)
        tl.store(partial + 4 * num_slices, sum_sq_student)
        tl.store(partial + 5 * num_slices, sum_sq_teacher)
        tl.debug_barrier()  # every thread's stores before the release below
        published = tl.atomic_add(counter, 1, sem="acq_rel")
        if not WRITE_GRAD:
            finish = published == num_slices - 1
    if WAIT and WRITE_GRAD:
        while tl.atomic_add(counter, 0, sem="acquire") < num_slices:
            pass
    if finish:
        row_max, sum_exp, target_logit, dot, sum_sq_student, sum_sq_teacher = _combined_partials(
            partials_row, num_slices, MAX_SLICES)
        usable = _overflowed(dot, sum_sq_student, sum_sq_teacher) == 0
        unit = tl.full([], 1.0, tl.float32)
        hard_loss, soft_loss, log_sum_exp, coef_teacher, coef_student, grad_factor, lift = _row_losses_and_factors(
            valid, row_max, sum_exp, target_logit, dot, sum_sq_student, sum_sq_teacher, unit, unit,
            beta, inv_temp_sq, eps, weight_hard, weight_soft, student_scale, LIFT and WRITE_GRAD,
        )
        if WRITE_GRAD:  # the span again: read moments ago, it comes from L2
            offsets = tl.arange(0, BLOCK)
            for start in range(span_start, tl.minimum(span_stop, vocab_student), BLOCK):
                cols = start + offsets
                in_row = cols < vocab_student
                s = _load_logits(student_row, cols, in_row, student_scale, student_cap, STUDENT_CAP)
                t = _load_logits(teacher_row, cols, in_row, teacher_scale, teacher_cap, TEACHER_CAP)
                grad = _grad_block(s, t, cols, in_row, valid, in_shard, column, row_max, log_sum_exp, coef_teacher,
                                   coef_student, grad_factor, weight_hard, weight_soft * beta, student_cap, STUDENT_CAP)
                tl.store(student_row + cols, grad.to(student_row.dtype.element_ty), mask=tl.where(usable, in_row, False))
        if WRITE_GRAD:
            writes_losses = slice_index == 0
        else:
            writes_losses = True
        if writes_losses:
            tl.store(losses_ptr + row * 2, tl.where(usable, hard_loss, float("nan")))
            tl.store(losses_ptr + row * 2 + 1, tl.where(usable, soft_loss, float("nan")))
            if LIFT and WRITE_GRAD:
                tl.store(lifts_ptr + row, lift)


@triton.jit
def _row_stats_kernel(
    student_ptr, student_row_stride, teacher_ptr, teacher_row_stride, labels_ptr, stats_ptr,
    vocab_student, vocab_teacher, ignore_index, vocab_start, vocab_student_total,
    student_cap, teacher_cap, student_scale, teacher_scale,
    STUDENT_CAP: tl.constexpr, TEACHER_CAP: tl.constexpr, NUM_STATS: tl.constexpr, BLOCK: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    student_row, teacher_row, _, in_shard, column = _row_and_label(
        row, student_ptr, student_row_stride, teacher_ptr, teacher_row_stride, labels_ptr, ignore_index,
        vocab_start, vocab_student, vocab_student_total,
    )
    row_max, sum_exp, target_logit, dot, sum_sq_student, sum_sq_teacher, student_unit, teacher_unit = _row_stats(
        student_row, teacher_row, in_shard, column, vocab_student, vocab_teacher, student_scale, teacher_scale,
        student_cap, teacher_cap, STUDENT_CAP, TEACHER_CAP, False, BLOCK,
    )
    if _overflowed(dot, sum_sq_student, sum_sq_teacher):
        dot, sum_sq_student, sum_sq_teacher, student_unit, teacher_unit = _unit_scaled_sums(
            student_row, teacher_row, vocab_student, vocab_teacher, student_scale, teacher_scale,
            student_cap, teacher_cap, STUDENT_CAP, TEACHER_CAP, BLOCK,
        )
    stats_row = stats_ptr + row * NUM_STATS  # the order of row_step.ROW_STATS
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
    weight_hard, weight_soft, beta, inv_temp_sq, eps, student_cap, teacher_cap, student_scale, teacher_scale,
    STUDENT_CAP: tl.constexpr, TEACHER_CAP: tl.constexpr, WRITE_GRAD: tl.constexpr, LIFT: tl.constexpr,
    NUM_STATS: tl.constexpr, BLOCK: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    student_row, teacher_row, valid, in_shard, column = _row_and_label(
        row, student_ptr, student_row_stride, teacher_ptr, teacher_row_stride, labels_ptr, ignore_index,
        vocab_start, vocab_student, vocab_student_total,
    )
    stats_row = stats_ptr + row * NUM_STATS
    _row_losses_and_grad(
        student_row, teacher_row, losses_ptr + row * 2, valid, in_shard, column, vocab_student,
        tl.load(stats_row), tl.load(stats_row + 1), tl.load(stats_row + 2), tl.load(stats_row + 3),
        tl.load(stats_row + 4), tl.load(stats_row + 5), tl.load(stats_row + 6), tl.load(stats_row + 7),
        weight_hard, weight_soft, beta, inv_temp_sq, eps, student_scale, teacher_scale, student_cap, teacher_cap,
        lifts_ptr + row, STUDENT_CAP, TEACHER_CAP, WRITE_GRAD, LIFT, BLOCK,
    )


def _check_layout(student_logits, teacher_logits, labels, *contiguous):
    if student_logits.stride(1) != 1 or teacher_logits.stride(1) != 1:
        raise ValueError("the Triton row step needs logits with unit stride along the vocabulary")
    if not all(t.is_contiguous() for t in (labels, *contiguous)):
        raise ValueError("the Triton row step needs contiguous labels, statistics and token_losses")


def _common_args(vocab_student, scales: RowStepScales):
    total = vocab_student if scales.vocab_student_total is None else scales.vocab_student_total
    return (scales.ignore_index, scales.vocab_start, total)


def _logit_args(scales: RowStepScales):
    return (scales.student_softcap or 1.0, scales.teacher_softcap or 1.0, scales.student_logit_scale,
            scales.teacher_logit_scale)


def _loss_args(scales: RowStepScales):
    return (scales.weight_hard, scales.weight_soft, scales.beta, 1.0 / (scales.temperature * scales.temperature),
            COSINE_EPS, *_logit_args(scales))


def _block(vocab, block_size, num_warps, default=DEFAULT_BLOCK):
    return block_size or max(32 * num_warps, min(default, triton.next_power_of_2(max(1, vocab))))


def _caps(scales: RowStepScales):
    return dict(STUDENT_CAP=scales.student_softcap is not None, TEACHER_CAP=scales.teacher_softcap is not None)


def _lift_args(grad_lifts, token_losses, write_grad):
    """The lifts' pointer (token_losses stands in when there are none: never written) and LIFT."""
    lift = write_grad and grad_lifts is not None
    return (grad_lifts if lift else token_losses), dict(LIFT=lift)


def row_step_triton(student_logits, teacher_logits, labels, scales: RowStepScales, token_losses, write_grad,
                    grad_lifts=None, block_size=None, slice_size=None, num_warps=None, wait=None, tickets=True) -> None:
    """The sliced kernel (``slice_size`` columns per program, streamed ``block_size`` at a time), then the
    RESCUE launch for rows whose sums
    overflowed. ``wait``: one launch whose programs wait for each other (default on a GPU), or two
    launches, publish then finish (Triton's interpreter runs one program at a time: none could wait)."""
    rows, vocab_student = student_logits.shape
    if rows == 0:
        return
    _check_layout(student_logits, teacher_logits, labels, token_losses, *([] if grad_lifts is None else [grad_lifts]))
    lifts, lift_flag = _lift_args(grad_lifts, token_losses, write_grad)
    vocab = max(vocab_student, teacher_logits.shape[1])
    num_warps = num_warps or (DEFAULT_WARPS if write_grad else LOSS_ONLY_WARPS)
    block = _block(vocab, block_size, num_warps)
    slice_size = triton.cdiv(slice_size or (DEFAULT_SLICE if write_grad else LOSS_ONLY_SLICE), block) * block
    num_slices = triton.cdiv(vocab, slice_size)
    partials = torch.empty(rows, NUM_PARTIALS.value, num_slices, dtype=torch.float32, device=student_logits.device)
    counters = torch.zeros(1 + rows, dtype=torch.int32, device=student_logits.device)
    wait = student_logits.is_cuda if wait is None else wait
    if not write_grad:
        phases = [dict(PUBLISH=True, WAIT=False, FINISH=True)]  # the last program of a row to publish finishes it
    elif wait:
        phases = [dict(PUBLISH=True, WAIT=True, FINISH=True)]
    else:
        phases = [dict(PUBLISH=True, WAIT=False, FINISH=False), dict(PUBLISH=False, WAIT=False, FINISH=True)]
    common = (student_logits, student_logits.stride(0), teacher_logits, teacher_logits.stride(0), labels, token_losses,
              lifts)
    for phase in phases:
        _sliced_row_step_kernel[(rows * num_slices,)](
            *common, partials, counters, num_slices, vocab_student, teacher_logits.shape[1],
            *_common_args(vocab_student, scales), *_loss_args(scales), **_caps(scales), WRITE_GRAD=write_grad,
            **lift_flag, **phase, SLICE=slice_size, MAX_SLICES=triton.next_power_of_2(num_slices), BLOCK=block,
            TICKETS=tickets, num_warps=num_warps,
        )
    _rescue_kernel[(rows,)](
        *common, vocab_student, teacher_logits.shape[1], *_common_args(vocab_student, scales), *_loss_args(scales),
        **_caps(scales), WRITE_GRAD=write_grad, **lift_flag, BLOCK=_block(vocab_student, None, RESCUE_WARPS),
        num_warps=RESCUE_WARPS,
    )


def row_stats_triton(student_logits, teacher_logits, labels, scales: RowStepScales, block_size=None,
                     num_warps=DEFAULT_WARPS) -> torch.Tensor:
    rows, vocab_student = student_logits.shape
    stats = torch.empty(rows, NUM_STATS, dtype=torch.float32, device=student_logits.device)
    if rows == 0:
        return stats
    _check_layout(student_logits, teacher_logits, labels)
    _row_stats_kernel[(rows,)](
        student_logits, student_logits.stride(0), teacher_logits, teacher_logits.stride(0), labels, stats,
        vocab_student, teacher_logits.shape[1], *_common_args(vocab_student, scales), *_logit_args(scales),
        **_caps(scales), NUM_STATS=NUM_STATS, BLOCK=_block(vocab_student, block_size, num_warps),
        num_warps=num_warps,
    )
    return stats


def row_grad_triton(student_logits, teacher_logits, labels, stats, scales: RowStepScales, token_losses, write_grad,
                    grad_lifts=None, block_size=None, num_warps=DEFAULT_WARPS) -> None:
    rows, vocab_student = student_logits.shape
    if rows == 0:
        return
    _check_layout(student_logits, teacher_logits, labels, stats, token_losses,
                  *([] if grad_lifts is None else [grad_lifts]))
    lifts, lift_flag = _lift_args(grad_lifts, token_losses, write_grad)
    _row_grad_kernel[(rows,)](
        student_logits, student_logits.stride(0), teacher_logits, teacher_logits.stride(0), labels, stats,
        token_losses, lifts, vocab_student, *_common_args(vocab_student, scales), *_loss_args(scales),
        **_caps(scales), WRITE_GRAD=write_grad, **lift_flag, NUM_STATS=NUM_STATS,
        BLOCK=_block(vocab_student, block_size, num_warps), num_warps=num_warps,
    )


TRITON_ROW_STEP = RowStepImpl(row_step_triton, row_stats_triton, row_grad_triton)
