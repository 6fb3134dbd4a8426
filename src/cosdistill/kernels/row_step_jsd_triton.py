"""The generalized-JSD row step in Triton: the twin of ``_row_step_jsd.py`` (read that first: it defines the
losses, the gradient and how the student's zero padding to the teacher's vocabulary enters).

One program per token row, in base-2 logarithms throughout: log2(e) / T is folded into the logits' scale, so
each exponential or logarithm is a single SFU instruction. The soft term needs both models' log-sum-exps at T
before any of its sums, and beta > 0's gradient needs the row sum sum_j p_j g_j of the finished sums, hence up
to three passes over the row:

1. online max and sum of exponentials per lane (one exp per logit and stream, see ``_online``) of the
   student at T over its own vocabulary, of the teacher at T and, unless T == 1 where it is the same stream,
   of the unscaled student for the hard term; the padding's zeros join the student's soft normaliser in
   closed form afterwards;
2. the soft loss's sums; for beta == 0 also the gradient, whose soft part (p - q) / T needs no row sum;
3. beta > 0 with gradients only: the gradient.

The launch without gradients runs passes 1 and 2; an ignored token reads nothing. Over a vocabulary split the
passes are three launches with the ranks' numbers combined between them (``split_jsd_row_step_triton``). Each
pass reloads the logits and applies the logit scales and softcaps again, rounding each logit to one fp32 value
(``load_logits``): a product left to FMA contraction would be exact in s - max but rounded in the max.
"""

import torch
import triton
import triton.language as tl

from .._row_step import RowStepConstants, RowStepImpl
from .._row_step_jsd import combine_jsd_sums_torch
from . import TRITON_OPTIONS
from .triton_common import (
    INTERPRET,
    LN2,
    LOG2E,
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

# H200 sweeps (docs/design.md, The generalized JSD). STAGES: each hot loop's loads go through shared memory
# STAGES - 1 blocks ahead (1: plain loads into registers).
DEFAULT_BLOCK = 2048
DEFAULT_WARPS = 8
DEFAULT_STAGES = 4
LOSS_ONLY_BLOCK = 2048
LOSS_ONLY_WARPS = 4  # the no-grad launch's own, chosen by measurement (docs/design.md)
LOSS_ONLY_STAGES = 4

# The soft term's form, a compile-time branch each (the spec's three cases):
FORWARD: tl.constexpr = tl.constexpr(0)  # beta == 0: KL(q || p)
REVERSE: tl.constexpr = tl.constexpr(1)  # beta == 1: KL(p || q)
MIXED: tl.constexpr = tl.constexpr(2)  # 0 < beta < 1: against the mixture m
# 0 < beta < 1 with the mixture's log through log2(1 + y) to fp32's relative precision (``_minus_mixture``) and
# the gradient in its row's reference form (``_row_reference``), where MIXED's one log of (1 - beta) + beta 2^d
# keeps only its absolute precision: against a divergence that shrinks with beta or 1 - beta within EDGE_MARGIN
# of beta = 0 or 1, and against the gradient of a teacher peaked far from the student, which MIXED leaves at
# bf16's rounding (mode_of says where each runs).
MIXED_PRECISE: tl.constexpr = tl.constexpr(3)
EDGE_MARGIN = 0.05
LOG1P_SERIES_BELOW: tl.constexpr = tl.constexpr(0.125)  # _log2_1p's series to y^8 is within fp32's rounding below


@triton.jit
def _exp2(x):
    """2^x as row_step_triton._exp's ex2.approx.ftz (results below 1e-38 flush to 0), without its multiply by
    log2(e): the base-2 callers have folded that into their scales. The interpreter cannot run PTX."""
    if INTERPRET:
        return tl.exp2(x)
    else:
        return tl.inline_asm_elementwise("ex2.approx.ftz.f32 $0, $1;", "=f,f", [x], dtype=tl.float32,
                                         is_pure=True, pack=1)


@triton.jit
def _log2(x):
    """log2(x) in one SFU instruction (lg2.approx.ftz: an input below 1e-38 reads as 0, so callers keep x
    normal). The interpreter cannot run PTX."""
    if INTERPRET:
        return tl.log2(x)
    else:
        return tl.inline_asm_elementwise("lg2.approx.ftz.f32 $0, $1;", "=f,f", [x], dtype=tl.float32,
                                         is_pure=True, pack=1)


@triton.jit
def _online(run_max, run_sum, v, scale):
    """Each lane's running max of the logits v and sum of 2^((v - max) scale), one exponential per logit instead
    of the usual two: only the smaller of v and the old max is shifted by the other. The max stays in the logits'
    own units, so that v - max is formed before the scaling, exactly where v is near the max, and large logits
    at a small T lose nothing to the rounding of v * scale. The first logit (max -inf) gives gap 0 and sum 1."""
    gap = _exp2(-tl.abs(v - run_max) * scale)
    return tl.maximum(run_max, v), tl.where(v > run_max, run_sum * gap + 1.0, run_sum + gap)


@triton.jit
def _online_two(run_max, sum_x, sum_z, v, x_scale, z_scale):
    """_online at two scales, the student's at T and unscaled (T != 1), sharing its max."""
    distance = -tl.abs(v - run_max)
    gap_x = _exp2(distance * x_scale)
    gap_z = _exp2(distance * z_scale)
    grew = v > run_max
    return (tl.maximum(run_max, v), tl.where(grew, sum_x * gap_x + 1.0, sum_x + gap_x),
            tl.where(grew, sum_z * gap_z + 1.0, sum_z + gap_z))


@triton.jit
def _row_total(run_max, run_sum, scale):
    """(max, sum of 2^((v - max) scale)) of the row from its lanes'; a lane that saw nothing holds (-inf, 0), and
    a row that saw nothing (a vocabulary split's shard without student columns) gives (-inf, 0), not NaN."""
    row_max = tl.max(run_max, axis=0)
    shift = tl.where(row_max == float("-inf"), 0.0, row_max)
    return row_max, tl.sum(run_sum * tl.exp2((run_max - shift) * scale), axis=0)


@triton.jit
def _log_probs(s, t, x_scale, shift_x, norm_x, shift_y, norm_y, MASKED: tl.constexpr):
    """(log2 p, log2 q, d) of a block, d = log2 q - log2 p formed as ((t - shift_y) - (s - shift_x)) x_scale +
    (norm_x - norm_y): from the logits' distances to their rows' maxima, not as log2 q minus log2 p, each of
    which is off by about an ulp of its normaliser (log2 V), which summed over a whole vocabulary swamps a
    small divergence. MASKED, a partial block: its lanes past a vocabulary hold the loads' 0s, whose
    log-probabilities can be large and positive (2^x = inf); a real one is <= 0, so the clamps change only
    those lanes, which nothing stores or sums."""
    student_distance = s - shift_x
    teacher_distance = t - shift_y
    a = student_distance * x_scale - norm_x
    b = teacher_distance * x_scale - norm_y
    d = (teacher_distance - student_distance) * x_scale + (norm_x - norm_y)
    if MASKED:
        a = tl.minimum(a, 0.0)
        b = tl.minimum(b, 0.0)
    return a, b, d


@triton.jit
def _student_probs(s, a, z_scale, shift_z, norm_z, inv_ratio, SHARED: tl.constexpr, MASKED: tl.constexpr):
    """(p, softmax(s)): the student's probabilities at T over the padded vocabulary (log2 p = a) and unscaled
    over its own (the hard term's). With SHARED (T == 1) they differ only by the padding's share of the
    normaliser: one exponential, and p = softmax(s) * inv_ratio with inv_ratio <= 1, so nothing overflows
    however much the padding's zeros dominate. MASKED: as _log_probs."""
    log_hard = (s - shift_z) * z_scale - norm_z
    if MASKED:
        log_hard = tl.minimum(log_hard, 0.0)
    if SHARED:
        hard_prob = _exp2(log_hard)
        return hard_prob * inv_ratio, hard_prob
    else:
        return _exp2(a), _exp2(log_hard)


@triton.jit
def _log2_1p(y):
    """log2(1 + y) to fp32's relative precision for |y| <= 1, where 1 + y itself would round y's low bits
    away: below LOG1P_SERIES_BELOW its series, above it one log."""
    series = 1.0 / 8.0
    for k in tl.static_range(7, 0, -1):
        series = 1.0 / k - y * series  # Horner: y (1 - y / 2 + y^2 / 3 - ... - y^7 / 8)
    return tl.where(tl.abs(y) < LOG1P_SERIES_BELOW, LOG2E * y * series, _log2(1.0 + y))


@triton.jit
def _log2_weights(keep, beta):
    """(log2(1 - beta), log2(beta)), each from whichever of beta and 1 - beta is small (the other side's argument
    held in range), so that both keep fp32's relative precision at betas near 0 and 1."""
    log_keep = tl.where(beta < 0.5, _log2_1p(-tl.minimum(beta, 0.5)), _log2(keep))
    log_beta = tl.where(beta < 0.5, _log2(beta), _log2_1p(-tl.minimum(keep, 0.5)))
    return log_keep, log_beta


@triton.jit
def _minus_mixture(d, keep, beta, MODE: tl.constexpr):
    """(log2 p - log2 m, log2 q - log2 m, log2 p - log2 m + log2(1 - beta)), m = (1 - beta) p + beta q, from
    d = log2 q - log2 p alone, each formed without cancelling large terms (as b - m = d + (a - m) would, where a
    teacher peaks far from the student). MIXED (the third repeats the first): with L = log2 of the
    larger weight plus the other times 2^-|d|, they are (-L - d, -L) for d >= 0 and (-L, d - L) below: one
    exponential and one log. MIXED_PRECISE: with c = log2((1 - beta) / beta), m is the larger of (1 - beta) p and
    beta q times 1 + y, y = 2^-|c - d| <= 1, and log2(1 + y) is taken to fp32's relative precision, as are
    log2(1 - beta) and log2(beta): the terms that cancel in the soft term's sums (to O(beta^2) as beta -> 0) then
    carry fp32's relative rounding, not its absolute one. Its third, log2((1 - beta) p / m), is -log2(1 + y) where
    the student's weight is the larger (log2(1 - beta) cancelled before it is formed) and c - d - log2(1 + y)
    elsewhere: the gradient's shifted form (_row_reference), sharing the others' exponential and logs."""
    if MODE == MIXED:
        smaller = _exp2(-tl.abs(d))  # the smaller of 2^d and 2^-d: never overflows
        spread = tl.where(d >= 0.0, beta + keep * smaller, keep + beta * smaller)
        log_spread = _log2(spread)
        student_gap = -log_spread - tl.maximum(d, 0.0)
        return student_gap, tl.minimum(d, 0.0) - log_spread, student_gap
    else:
        log_keep, log_beta = _log2_weights(keep, beta)
        log_ratio = log_keep - log_beta
        student_larger = d <= log_ratio  # (1 - beta) p >= beta q
        log_spread = _log2_1p(_exp2(-tl.abs(log_ratio - d)))
        return (tl.where(student_larger, -log_keep, -log_beta - d) - log_spread,
                tl.where(student_larger, d - log_keep, -log_beta) - log_spread,
                tl.where(student_larger, 0.0, log_ratio - d) - log_spread)


@triton.jit
def _soft_terms(a, b, d, referenced_d, keep, beta, MODE: tl.constexpr):
    """The soft loss's summands in base-2 units, (the student's, the teacher's, the student's shifted), from
    log2 p = a, log2 q = b and d = log2 q - log2 p. FORWARD: (0, q d); REVERSE: (-p d, 0, -p (d - d*)) with
    ``referenced_d`` = d - d* (_referenced_gap); MIXED: (p (a - log2 m), beta q (b - log2 m)). The student's sum is
    also the gradient's row sum sum_j p_j g_j (up to the factor _grad's log_coef carries); the third, the same row
    sum in the shifted form: REVERSE's against the reference column, MIXED_PRECISE's p times its gap shifted by
    log2(1 - beta) (MIXED repeats the student's)."""
    if MODE == FORWARD:
        return tl.zeros_like(a), _exp2(b) * d, tl.zeros_like(a)
    elif MODE == REVERSE:
        p = _exp2(a)
        return -p * d, tl.zeros_like(a), -p * referenced_d
    else:
        p = _exp2(a)
        student_gap, teacher_gap, shifted_gap = _minus_mixture(d, keep, beta, MODE)
        return p * student_gap, beta * _exp2(b) * teacher_gap, p * shifted_gap


@triton.jit
def _grad(s, a, b, d, cols, label_col, z_scale, shift_z, norm_z, inv_ratio, weight_hard, soft_coef, log_coef, row_sum,
          shifted, keep, beta, MODE: tl.constexpr, SHARED: tl.constexpr, MASKED: tl.constexpr):
    """(d L / d s, FORWARD's soft summand q d) of a block: weight_hard (softmax(s) - onehot) plus soft_coef =
    weight_soft / T times the soft term's bracket; in REVERSE and MIXED p log_coef ((a - x) - row_sum) with
    a - x = -d or log2 p - log2 m (MIXED_PRECISE: plus log2(1 - beta) where the row is ``shifted``, as row_sum
    then is). The bracket is formed before the scaling, as the spec forms it: where p sits on one column, (a - x)
    and row_sum are large and equal, and scaled apart they would round apart. It is scaled by p log_coef, not p
    times log_coef times it: at temperatures near 0 the latter passes fp32's range where p is 0 (inf times 0)."""
    p, hard_prob = _student_probs(s, a, z_scale, shift_z, norm_z, inv_ratio, SHARED, MASKED)
    grad = weight_hard * hard_prob - tl.where(cols == label_col, weight_hard, 0.0)
    if MODE == FORWARD:
        q = _exp2(b)
        return grad + soft_coef * (p - q), q * d
    elif MODE == REVERSE:
        return grad + (p * log_coef) * (-d - row_sum), tl.zeros_like(a)
    else:
        student_gap, _, shifted_gap = _minus_mixture(d, keep, beta, MODE)
        gap = tl.where(shifted, shifted_gap, student_gap)
        return grad + (p * log_coef) * (gap - row_sum), tl.zeros_like(a)


@triton.jit
def _referenced_gap(s, t, top_s, teacher_at_top, x_scale):
    """REVERSE's d - d*, d* = d at the row's reference column (the student's largest logit top_s, the teacher's
    there teacher_at_top; _row_step_jsd._referenced_gaps), from the logits' distances to that column: 0 there, so
    that where p sits on it the gradient's bracket -(d - d*) - row sum keeps fp32's relative precision."""
    return ((t - teacher_at_top) - (s - top_s)) * x_scale


@triton.jit
def _through_the_head(grad, s, logit_scale, cap, CAP: tl.constexpr):
    """d L / d raw logit from d L / d s, s the softcapped logit: through the softcap, then times the logit scale."""
    grad = through_softcap(grad, s, cap, CAP)
    if logit_scale is not None:
        grad = grad * logit_scale
    return grad


@triton.jit
def _lifted(grad, lift, LIFT: tl.constexpr):
    if LIFT:
        grad = grad * lift
    return grad


@triton.jit
def _soft_bracket(a, b, student_term, MODE: tl.constexpr):
    """_row_step_jsd._soft_brackets in nats up to MIXED's factor 1 - beta: p - q, or p g from the student's
    summand (base 2)."""
    if MODE == FORWARD:
        return _exp2(a) - _exp2(b)
    else:
        return student_term * LN2


@triton.jit
def _row_lift(lift_row, weight_hard, soft_coef, largest_bracket, largest_p, row_sum, student_scale):
    """The row's power of two from _row_step_jsd.jsd_lift_bound, stored at ``lift_row``."""
    soft = largest_bracket + largest_p * tl.abs(row_sum)
    bound = (tl.abs(weight_hard) + tl.abs(soft_coef) * soft) * tl.abs(one_if_none(student_scale))
    lift = lift_for(bound)
    tl.store(lift_row, lift)
    return lift


@triton.jit
def _at_top(at_top, max_s, s, t):
    """Each lane's teacher logit at its largest student logit so far, the largest among ties (before max_s takes
    s in)."""
    return tl.where(s > max_s, t, tl.where(s == max_s, tl.maximum(at_top, t), at_top))


@triton.jit
def _row_sums_of_exps(student_row, teacher_row, vocab_student, vocab_teacher, x_scale, z_scale, student_cap,
                      teacher_cap, student_scale, teacher_scale, SHARED: tl.constexpr, REFERENCE: tl.constexpr,
                      STUDENT_CAP: tl.constexpr, TEACHER_CAP: tl.constexpr, BLOCK: tl.constexpr,
                      STAGES: tl.constexpr):
    """Pass 1: (top_s, total_x, total_z, top_t, total_y, teacher_at_top), each model's row max and sum of
    exponentials over the given columns: the student's at T (x) and, unless T == 1 where it is the same stream,
    unscaled (z); the teacher's at T (y); with REFERENCE, the teacher's largest logit among the student's top_s
    columns (REVERSE's reference column; else 0). A student with no columns here gives (-inf, 0) and -inf. The hot
    loop runs without masks."""
    offsets = tl.arange(0, BLOCK)
    whole_blocks_stop = vocab_student - vocab_student % BLOCK
    max_s = tl.full([BLOCK], float("-inf"), tl.float32)
    sum_x = tl.zeros([BLOCK], tl.float32)
    sum_z = tl.zeros([BLOCK], tl.float32)
    max_t = tl.full([BLOCK], float("-inf"), tl.float32)
    sum_y = tl.zeros([BLOCK], tl.float32)
    at_top = tl.full([BLOCK], float("-inf"), tl.float32)
    for start in tl.range(0, whole_blocks_stop, BLOCK, num_stages=STAGES):
        cols = start + offsets
        s = load_logits(student_row, cols, None, student_scale, student_cap, STUDENT_CAP, MASKED=False)
        t = load_logits(teacher_row, cols, None, teacher_scale, teacher_cap, TEACHER_CAP, MASKED=False)
        if REFERENCE:
            at_top = _at_top(at_top, max_s, s, t)
        if SHARED:
            max_s, sum_x = _online(max_s, sum_x, s, x_scale)
        else:
            max_s, sum_x, sum_z = _online_two(max_s, sum_x, sum_z, s, x_scale, z_scale)
        max_t, sum_y = _online(max_t, sum_y, t, x_scale)
    for start in range(whole_blocks_stop, vocab_teacher, BLOCK):  # the student's last block, the teacher's rest
        cols = start + offsets
        in_student = cols < vocab_student
        in_teacher = cols < vocab_teacher
        s = load_logits(student_row, cols, in_student, student_scale, student_cap, STUDENT_CAP)
        t = load_logits(teacher_row, cols, in_teacher, teacher_scale, teacher_cap, TEACHER_CAP)
        # A lane past a vocabulary keeps its state (its 0s computed nothing NaN).
        if REFERENCE:
            at_top = tl.where(in_student, _at_top(at_top, max_s, s, t), at_top)
        if SHARED:
            new_max, new_sum_x = _online(max_s, sum_x, s, x_scale)
        else:
            new_max, new_sum_x, new_sum_z = _online_two(max_s, sum_x, sum_z, s, x_scale, z_scale)
            sum_z = tl.where(in_student, new_sum_z, sum_z)
        max_s = tl.where(in_student, new_max, max_s)
        sum_x = tl.where(in_student, new_sum_x, sum_x)
        new_max, new_sum_y = _online(max_t, sum_y, t, x_scale)
        max_t = tl.where(in_teacher, new_max, max_t)
        sum_y = tl.where(in_teacher, new_sum_y, sum_y)
    top_s, total_x = _row_total(max_s, sum_x, x_scale)
    top_t, total_y = _row_total(max_t, sum_y, x_scale)
    if SHARED:
        total_z = total_x
    else:
        total_z = _row_total(max_s, sum_z, z_scale)[1]
    teacher_at_top = 0.0
    if REFERENCE:
        teacher_at_top = tl.max(tl.where(max_s == top_s, at_top, float("-inf")), axis=0)
    return top_s, total_x, total_z, top_t, total_y, teacher_at_top


@triton.jit
def _with_padding(top_s, total_x, padding, x_scale):
    """(shift_x, total): the student's soft normaliser, log2 p = (s - shift_x) x_scale - log2(total), with the
    padding's zeros joined in (not the hard term's). The max keeps the padding's exponential finite in rows
    without padding, where it is multiplied by 0."""
    shift_x = tl.where(padding > 0, tl.maximum(top_s, 0.0), top_s)
    total = total_x * tl.exp2((top_s - shift_x) * x_scale) + padding * tl.exp2(-tl.maximum(shift_x, 0.0) * x_scale)
    return shift_x, total


@triton.jit
def _inv_ratio(top_s, shift_x, x_scale, norm_x, norm_z, SHARED: tl.constexpr):
    """With SHARED (T == 1), p / softmax(s) on the student's columns (<= 1; 1 without padding); else unused, the
    two being independent exponentials."""
    if SHARED:
        return tl.exp2((top_s - shift_x) * x_scale + (norm_z - norm_x))
    else:
        return tl.full([], 1.0, tl.float32)


@triton.jit
def _write_row_grad(student_row, teacher_row, vocab_student, label_col, x_scale, z_scale, shift_x, norm_x, top_t,
                    norm_y, top_s, teacher_at_top, norm_z, inv_ratio, weight_hard, soft_coef, log_coef, row_sum, shifted,
                    keep, beta, lift, student_cap, teacher_cap, student_scale, teacher_scale, MODE: tl.constexpr,
                    SHARED: tl.constexpr, LIFT: tl.constexpr, STUDENT_CAP: tl.constexpr, TEACHER_CAP: tl.constexpr,
                    BLOCK: tl.constexpr, STAGES: tl.constexpr):
    """Pass 3: the row's gradient over the student's columns, over its logits (_grad, REVERSE's with d - d* where
    the row is ``shifted``, as its row sum then is; times ``lift`` with LIFT)."""
    offsets = tl.arange(0, BLOCK)
    whole_blocks_stop = vocab_student - vocab_student % BLOCK
    for start in tl.range(0, whole_blocks_stop, BLOCK, num_stages=STAGES):
        cols = start + offsets
        s = load_logits(student_row, cols, None, student_scale, student_cap, STUDENT_CAP, MASKED=False)
        t = load_logits(teacher_row, cols, None, teacher_scale, teacher_cap, TEACHER_CAP, MASKED=False)
        a, b, d = _log_probs(s, t, x_scale, shift_x, norm_x, top_t, norm_y, MASKED=False)
        if MODE == REVERSE:
            d = tl.where(shifted, _referenced_gap(s, t, top_s, teacher_at_top, x_scale), d)
        grad, _ = _grad(s, a, b, d, cols, label_col, z_scale, top_s, norm_z, inv_ratio, weight_hard, soft_coef, log_coef,
                        row_sum, shifted, keep, beta, MODE, SHARED, MASKED=False)
        grad = _lifted(_through_the_head(grad, s, student_scale, student_cap, STUDENT_CAP), lift, LIFT)
        tl.store(student_row + cols, grad.to(student_row.dtype.element_ty))
    for start in range(whole_blocks_stop, vocab_student, BLOCK):  # the last, partial block
        cols = start + offsets
        in_student = cols < vocab_student
        s = load_logits(student_row, cols, in_student, student_scale, student_cap, STUDENT_CAP)
        t = load_logits(teacher_row, cols, in_student, teacher_scale, teacher_cap, TEACHER_CAP)
        a, b, d = _log_probs(s, t, x_scale, shift_x, norm_x, top_t, norm_y, MASKED=True)
        if MODE == REVERSE:
            d = tl.where(shifted, _referenced_gap(s, t, top_s, teacher_at_top, x_scale), d)
        grad, _ = _grad(s, a, b, d, cols, label_col, z_scale, top_s, norm_z, inv_ratio, weight_hard, soft_coef, log_coef,
                        row_sum, shifted, keep, beta, MODE, SHARED, MASKED=True)
        grad = _lifted(_through_the_head(grad, s, student_scale, student_cap, STUDENT_CAP), lift, LIFT)
        tl.store(student_row + cols, grad.to(student_row.dtype.element_ty), mask=in_student)


@triton.jit
def _soft_sums(student_row, teacher_row, vocab_student, vocab_teacher, x_scale, shift_x, norm_x, top_t, norm_y, top_s,
               teacher_at_top, keep, beta, student_cap, teacher_cap, student_scale, teacher_scale, MODE: tl.constexpr,
               REFERENCE: tl.constexpr, LIFT: tl.constexpr, STUDENT_CAP: tl.constexpr, TEACHER_CAP: tl.constexpr,
               BLOCK: tl.constexpr, STAGES: tl.constexpr):
    """Pass 2 without the gradient: (student_sum, teacher_sum, shifted_sum, largest_bracket) over the given
    columns, the sums of _soft_terms (the student's, sum p (a - x) with x = b or log2 m, is also the gradient's row
    sum; shifted_sum the row sum in the gradient's shifted form: MIXED_PRECISE's, and with REFERENCE REVERSE's
    against its reference column (top_s, teacher_at_top), else the student's) and with LIFT the largest
    |_soft_bracket| over the student's columns (0 without), unshifted. The student's zero padding counts."""
    offsets = tl.arange(0, BLOCK)
    whole_blocks_stop = vocab_student - vocab_student % BLOCK
    largest_bracket = tl.zeros([BLOCK], tl.float32)
    student_part = tl.zeros([BLOCK], tl.float32)
    teacher_part = tl.zeros([BLOCK], tl.float32)
    shifted_part = tl.zeros([BLOCK], tl.float32)
    for start in tl.range(0, whole_blocks_stop, BLOCK, num_stages=STAGES):
        cols = start + offsets
        s = load_logits(student_row, cols, None, student_scale, student_cap, STUDENT_CAP, MASKED=False)
        t = load_logits(teacher_row, cols, None, teacher_scale, teacher_cap, TEACHER_CAP, MASKED=False)
        a, b, d = _log_probs(s, t, x_scale, shift_x, norm_x, top_t, norm_y, MASKED=False)
        referenced_d = d
        if REFERENCE:
            referenced_d = _referenced_gap(s, t, top_s, teacher_at_top, x_scale)
        student_term, teacher_term, shifted_term = _soft_terms(a, b, d, referenced_d, keep, beta, MODE)
        student_part += student_term
        teacher_part += teacher_term
        if MODE == MIXED_PRECISE or REFERENCE:
            shifted_part += shifted_term
        if LIFT:
            largest_bracket = tl.maximum(largest_bracket, tl.abs(_soft_bracket(a, b, student_term, MODE)))
    for start in range(whole_blocks_stop, vocab_teacher, BLOCK):  # s is 0 on [Vs, Vt): the padding counts
        cols = start + offsets
        in_student = cols < vocab_student
        in_teacher = cols < vocab_teacher
        s = load_logits(student_row, cols, in_student, student_scale, student_cap, STUDENT_CAP)
        t = load_logits(teacher_row, cols, in_teacher, teacher_scale, teacher_cap, TEACHER_CAP)
        a, b, d = _log_probs(s, t, x_scale, shift_x, norm_x, top_t, norm_y, MASKED=True)
        referenced_d = d
        if REFERENCE:
            referenced_d = _referenced_gap(s, t, top_s, teacher_at_top, x_scale)
        student_term, teacher_term, shifted_term = _soft_terms(a, b, d, referenced_d, keep, beta, MODE)
        student_part += tl.where(in_teacher, student_term, 0.0)
        teacher_part += tl.where(in_teacher, teacher_term, 0.0)
        if MODE == MIXED_PRECISE or REFERENCE:
            shifted_part += tl.where(in_teacher, shifted_term, 0.0)
        if LIFT:  # over the student's columns: the padding has no gradient
            bracket = tl.abs(_soft_bracket(a, b, student_term, MODE))
            largest_bracket = tl.where(in_student, tl.maximum(largest_bracket, bracket), largest_bracket)
    student_sum = tl.sum(student_part, axis=0)
    shifted_sum = student_sum
    if MODE == MIXED_PRECISE or REFERENCE:
        shifted_sum = tl.sum(shifted_part, axis=0)
    return student_sum, tl.sum(teacher_part, axis=0), shifted_sum, tl.max(largest_bracket, axis=0)


@triton.jit
def _soft_loss(student_sum, teacher_sum, keep, MODE: tl.constexpr):
    """The soft term in nats from _soft_sums' sums."""
    if MODE == FORWARD:
        soft = teacher_sum
    elif MODE == REVERSE:
        soft = student_sum
    else:
        soft = keep * student_sum + teacher_sum
    return soft * LN2


@triton.jit
def _row_reference(student_sum, shifted_sum, MODE: tl.constexpr):
    """(row_sum, shifted): the gradient's bracket g_k - sum_j p_j g_j is the same for g shifted by any constant
    (sum p = 1), but formed in fp32 it keeps only the absolute precision of g where p sits. MIXED_PRECISE's student
    gap is -log2(1 - beta) plus a small term wherever the student's weight dominates the mixture (a teacher
    peaked far from the student, at betas from ~0.3 up at temperature 0.5): there the gap shifted by
    log2(1 - beta) holds only the small term, elsewhere the unshifted one is small. Of the two forms, the one
    whose row sum is smaller in size, the same on every rank of a split (the sums are combined before this
    pass). REVERSE's g = -d grows as the gap over T, and where p sits on one column g there and the row sum are
    large and nearly equal: against its reference column (_referenced_gap) g is 0 there; but where p is spread and
    the teacher's logit at that column is far from its others, g - g* is large everywhere and -d small. Again the
    form whose row sum is the smaller (_row_step_jsd._reverse_kl_form). FORWARD and MIXED, unshifted."""
    if MODE == MIXED_PRECISE or MODE == REVERSE:
        shifted = tl.abs(shifted_sum) < tl.abs(student_sum)
        return tl.where(shifted, shifted_sum, student_sum), shifted
    else:
        return student_sum, False


@triton.jit
def _lift_and_write_row_grad(student_row, teacher_row, lift_row, vocab_student, label_col, x_scale, z_scale, shift_x,
                             norm_x, top_t, norm_y, top_s, teacher_at_top, norm_z, inv_ratio, weight_hard, soft_coef,
                             student_sum, shifted_sum, largest_bracket, keep, beta, student_cap, teacher_cap,
                             student_scale, teacher_scale,
                             MODE: tl.constexpr, SHARED: tl.constexpr, LIFT: tl.constexpr, STUDENT_CAP: tl.constexpr,
                             TEACHER_CAP: tl.constexpr, BLOCK: tl.constexpr, STAGES: tl.constexpr):
    """Pass 3 from the row's whole sums: with LIFT its power of two (stored at ``lift_row``), then the gradient in
    the row's reference form (_row_reference)."""
    if MODE >= MIXED:
        gap_scale = keep  # g = (1 - beta) (a - log m)
    else:
        gap_scale = 1.0
    log_coef = soft_coef * gap_scale * LN2
    lift = 1.0
    if LIFT:
        row_sum = 0.0  # sum_j p_j g_j in nats, which FORWARD's bracket p - q does not take
        if MODE != FORWARD:
            row_sum = LN2 * gap_scale * student_sum
        largest_p = tl.exp2((top_s - shift_x) * x_scale - norm_x)
        lift = _row_lift(lift_row, weight_hard, soft_coef, gap_scale * largest_bracket, largest_p, row_sum,
                         student_scale)
    row_sum, shifted = _row_reference(student_sum, shifted_sum, MODE)
    _write_row_grad(student_row, teacher_row, vocab_student, label_col, x_scale, z_scale, shift_x, norm_x, top_t,
                    norm_y, top_s, teacher_at_top, norm_z, inv_ratio, weight_hard, soft_coef, log_coef, row_sum, shifted,
                    keep, beta, lift, student_cap, teacher_cap, student_scale, teacher_scale, MODE, SHARED, LIFT, STUDENT_CAP,
                    TEACHER_CAP, BLOCK, STAGES)


@triton.jit
def _zero_row(student_row, vocab_student, BLOCK: tl.constexpr):
    """An ignored token's gradient: 0 over the student's columns."""
    offsets = tl.arange(0, BLOCK)
    for start in range(0, vocab_student, BLOCK):
        cols = start + offsets
        tl.store(student_row + cols, tl.zeros([BLOCK], student_row.dtype.element_ty), mask=cols < vocab_student)


@triton.jit
def _jsd_row_step_kernel(
    student_ptr, student_row_stride, teacher_ptr, teacher_row_stride, labels_ptr, losses_ptr, lifts_ptr,
    vocab_student, vocab_teacher, ignore_index, vocab_start, vocab_student_total,
    weight_hard, soft_coef, x_scale, padding, keep, beta, student_cap, teacher_cap, student_scale, teacher_scale,
    MODE: tl.constexpr, SHARED: tl.constexpr, WRITE_GRAD: tl.constexpr, LIFT: tl.constexpr,
    STUDENT_CAP: tl.constexpr, TEACHER_CAP: tl.constexpr, BLOCK: tl.constexpr, STAGES: tl.constexpr,
):
    """With LIFT (fp16 logits, WRITE_GRAD) each row's gradient is written times its power of two, stored at
    lifts_ptr (1 for an ignored row), as the spec's jsd_shard_grad_torch. REVERSE with WRITE_GRAD finds its
    reference column in pass 1 and takes its row sum against it in pass 2 (_referenced_gap)."""
    REFERENCE: tl.constexpr = MODE == REVERSE and WRITE_GRAD
    row = tl.program_id(0).to(tl.int64)
    student_row, valid, in_shard, column = row_and_label(
        row, student_ptr, student_row_stride, labels_ptr, ignore_index, vocab_start, vocab_student,
        vocab_student_total,
    )
    # As the spec's label_columns: a valid label outside this shard's columns has no target logit and no one-hot.
    label_col = tl.where(in_shard, column, -1).to(tl.int32)
    teacher_row = teacher_ptr + row * teacher_row_stride
    losses_row = losses_ptr + row * 2
    offsets = tl.arange(0, BLOCK)
    whole_blocks_stop = vocab_student - vocab_student % BLOCK
    if SHARED:
        z_scale = x_scale  # the same stream as the soft term's student at T
    else:
        z_scale = LOG2E  # the unscaled student, for the hard term
    if valid:
        top_s, total_x, total_z, top_t, total_y, teacher_at_top = _row_sums_of_exps(
            student_row, teacher_row, vocab_student, vocab_teacher, x_scale, z_scale, student_cap, teacher_cap,
            student_scale, teacher_scale, SHARED, REFERENCE, STUDENT_CAP, TEACHER_CAP, BLOCK, STAGES)
        shift_x, total_padded = _with_padding(top_s, total_x, padding, x_scale)
        norm_x = tl.log2(total_padded)  # log2 p = (s - shift_x) x_scale - norm_x
        norm_y = tl.log2(total_y)  # log2 q = (t - top_t) x_scale - norm_y
        norm_z = tl.log2(total_z)  # log2 softmax(s) = (s - top_s) z_scale - norm_z
        inv_ratio = _inv_ratio(top_s, shift_x, x_scale, norm_x, norm_z, SHARED)
        target = load_logits(student_row, label_col, label_col >= 0, student_scale, student_cap, STUDENT_CAP)
        hard_loss = (top_s - target) + LN2 * norm_z  # logsumexp(s) - s[label]

        # Pass 2: the soft sums, and for FORWARD with gradients the gradient (the target is read above).
        # With LIFT the gradient waits for pass 3 (in FORWARD too): its bound needs the whole row's brackets.
        if WRITE_GRAD and MODE == FORWARD and not LIFT:
            student_sum, shifted_sum = 0.0, 0.0
            teacher_part = tl.zeros([BLOCK], tl.float32)
            for start in tl.range(0, whole_blocks_stop, BLOCK, num_stages=STAGES):
                cols = start + offsets
                s = load_logits(student_row, cols, None, student_scale, student_cap, STUDENT_CAP, MASKED=False)
                t = load_logits(teacher_row, cols, None, teacher_scale, teacher_cap, TEACHER_CAP, MASKED=False)
                a, b, d = _log_probs(s, t, x_scale, shift_x, norm_x, top_t, norm_y, MASKED=False)
                grad, term = _grad(s, a, b, d, cols, label_col, z_scale, top_s, norm_z, inv_ratio, weight_hard,
                                   soft_coef, 0.0, 0.0, False, keep, beta, MODE, SHARED, MASKED=False)
                teacher_part += term
                tl.store(student_row + cols, _through_the_head(grad, s, student_scale, student_cap, STUDENT_CAP).to(
                    student_row.dtype.element_ty))
            for start in range(whole_blocks_stop, vocab_teacher, BLOCK):  # s is 0 on [Vs, Vt): the padding counts
                cols = start + offsets
                in_student = cols < vocab_student
                in_teacher = cols < vocab_teacher
                s = load_logits(student_row, cols, in_student, student_scale, student_cap, STUDENT_CAP)
                t = load_logits(teacher_row, cols, in_teacher, teacher_scale, teacher_cap, TEACHER_CAP)
                a, b, d = _log_probs(s, t, x_scale, shift_x, norm_x, top_t, norm_y, MASKED=True)
                grad, term = _grad(s, a, b, d, cols, label_col, z_scale, top_s, norm_z, inv_ratio, weight_hard,
                                   soft_coef, 0.0, 0.0, False, keep, beta, MODE, SHARED, MASKED=True)
                teacher_part += tl.where(in_teacher, term, 0.0)
                tl.store(student_row + cols, _through_the_head(grad, s, student_scale, student_cap, STUDENT_CAP).to(
                    student_row.dtype.element_ty), mask=in_student)
            teacher_sum = tl.sum(teacher_part, axis=0)
            largest_bracket = 0.0
        else:
            student_sum, teacher_sum, shifted_sum, largest_bracket = _soft_sums(
                student_row, teacher_row, vocab_student, vocab_teacher, x_scale, shift_x, norm_x, top_t, norm_y, top_s,
                teacher_at_top, keep, beta, student_cap, teacher_cap, student_scale, teacher_scale, MODE, REFERENCE,
                LIFT, STUDENT_CAP, TEACHER_CAP, BLOCK, STAGES)
        tl.store(losses_row, hard_loss)
        tl.store(losses_row + 1, _soft_loss(student_sum, teacher_sum, keep, MODE))

        # Pass 3: REVERSE and MIXED subtract each row's sum_j p_j g_j, known only now; with LIFT each form
        # scales by the row's power of two, known only now too.
        if WRITE_GRAD and (MODE != FORWARD or LIFT):
            _lift_and_write_row_grad(
                student_row, teacher_row, lifts_ptr + row, vocab_student, label_col, x_scale, z_scale, shift_x, norm_x,
                top_t, norm_y, top_s, teacher_at_top, norm_z, inv_ratio, weight_hard, soft_coef, student_sum, shifted_sum,
                largest_bracket, keep,
                beta, student_cap, teacher_cap, student_scale, teacher_scale, MODE, SHARED, LIFT, STUDENT_CAP,
                TEACHER_CAP, BLOCK, STAGES)
    else:  # an ignored token: no loss, no gradient
        tl.store(losses_row, 0.0)
        tl.store(losses_row + 1, 0.0)
        if LIFT:
            tl.store(lifts_ptr + row, 1.0)
        if WRITE_GRAD:
            _zero_row(student_row, vocab_student, BLOCK)


def mode_of(beta: float, dtype: torch.dtype) -> int:
    """The soft term's form for this beta and logits of this dtype: FORWARD, REVERSE, MIXED or MIXED_PRECISE (the
    CUDA step's MODE, but for MIXED_PRECISE, which it has no form of). MIXED, the cheaper, only for bf16 logits
    away from beta's edges, whose gradient's own rounding is above MIXED's (docs/design.md, The generalized JSD,
    Precision)."""
    if beta == 0.0:
        return FORWARD.value
    if beta == 1.0:
        return REVERSE.value
    if dtype == torch.bfloat16 and min(beta, 1.0 - beta) >= EDGE_MARGIN:
        return MIXED.value
    return MIXED_PRECISE.value


def _check_constants(constants: RowStepConstants):
    """beta in [0, 1], T > 0 (the API checks them; a direct call is checked here)."""
    if not 0.0 <= constants.beta <= 1.0:
        raise ValueError(f"the JSD row step needs beta in [0, 1], got {constants.beta}")
    if not constants.temperature > 0.0:
        raise ValueError(f"the JSD row step needs a positive temperature, got {constants.temperature}")


def row_step_jsd_triton(student_logits, teacher_logits, labels, constants: RowStepConstants, token_losses, write_grad,
                        grad_lifts=None, block_size=None, num_warps=None, num_stages=None) -> None:
    rows, vocab_student, vocab_teacher = _checked_sizes(student_logits, teacher_logits, labels, constants, token_losses,
                                                        *([] if grad_lifts is None else [grad_lifts]))
    if rows == 0:
        return
    lifts, lift_flag = lift_args(grad_lifts, token_losses, write_grad)
    beta, temperature = constants.beta, constants.temperature
    mode = mode_of(beta, student_logits.dtype)
    num_warps = num_warps or (DEFAULT_WARPS if write_grad else LOSS_ONLY_WARPS)
    block = block_size_for(vocab_student, block_size, num_warps, DEFAULT_BLOCK if write_grad else LOSS_ONLY_BLOCK)
    stages = num_stages or (DEFAULT_STAGES if write_grad else LOSS_ONLY_STAGES)
    _jsd_row_step_kernel[(rows,)](
        student_logits, student_logits.stride(0), teacher_logits, teacher_logits.stride(0), labels, token_losses, lifts,
        vocab_student, vocab_teacher, *common_args(vocab_student, constants),
        constants.weight_hard, constants.weight_soft / temperature, LOG2E.value / temperature,
        float(vocab_teacher - vocab_student), 1.0 - beta, beta, *logit_args(constants), **cap_flags(constants),
        MODE=mode, SHARED=temperature == 1.0, WRITE_GRAD=write_grad, **lift_flag, BLOCK=block, STAGES=stages,
        num_warps=num_warps, **TRITON_OPTIONS,
    )


# The vocabulary split's three stages, the spec's (split_jsd_row_step) in this kernel's terms: a shard's
# statistics are pairs (max, sum of exponentials relative to it) rather than log-sum-exps, so that once the
# ranks' pairs are combined every rank forms d from the logits' distances to the whole row's maxima, as the
# unsplit kernel does. Their layout, [n, 8] fp32 (an ignored row's are placeholders that combine to finite
# numbers nothing reads):
SHARD_STATS = (
    "student_max",  # top_s: the max of s over the shard's student columns (-inf over none)
    "student_sum",  # total_z: sum of 2^((s - top_s) log2(e)), the hard term's normaliser
    "padded_shift",  # shift_x: _with_padding's, the max of s and, where the shard has padding, 0
    "padded_sum",  # sum of 2^((s - shift_x) log2(e) / T) over the teacher's columns, s zero-padded
    "teacher_max",  # top_t
    "teacher_sum",  # total_y: sum of 2^((t - top_t) log2(e) / T)
    "target_logit",  # s[label] if the label falls in this shard, else 0
    "teacher_at_student_top",  # REVERSE's: the teacher's largest logit among the student's top_s columns (-inf over
    # none), whichever rank holds the row's top_s; 0 in the other modes
)
NUM_SHARD_STATS: tl.constexpr = tl.constexpr(len(SHARD_STATS))
# Per row: the _soft_sums of the shard's columns, (student_sum, teacher_sum, shifted_sum, largest_bracket); the
# ranks add up the first three and take the largest of the fourth (combine_jsd_sums_triton).
NUM_SHARD_SUMS: tl.constexpr = tl.constexpr(4)


@triton.jit
def _jsd_shard_stats_kernel(
    student_ptr, student_row_stride, teacher_ptr, teacher_row_stride, labels_ptr, stats_ptr,
    vocab_student, vocab_teacher, ignore_index, vocab_start, vocab_student_total,
    x_scale, padding, student_cap, teacher_cap, student_scale, teacher_scale,
    SHARED: tl.constexpr, REFERENCE: tl.constexpr, STUDENT_CAP: tl.constexpr, TEACHER_CAP: tl.constexpr,
    BLOCK: tl.constexpr, STAGES: tl.constexpr,
):
    """Stage 1: the SHARD_STATS of each row over the shard's columns (pass 1 of _jsd_row_step_kernel)."""
    row = tl.program_id(0).to(tl.int64)
    student_row, valid, in_shard, column = row_and_label(
        row, student_ptr, student_row_stride, labels_ptr, ignore_index, vocab_start, vocab_student,
        vocab_student_total,
    )
    label_col = tl.where(in_shard, column, -1).to(tl.int32)
    stats_row = stats_ptr + row * NUM_SHARD_STATS
    if valid:
        top_s, total_x, total_z, top_t, total_y, teacher_at_top = _row_sums_of_exps(
            student_row, teacher_ptr + row * teacher_row_stride, vocab_student, vocab_teacher, x_scale, LOG2E,
            student_cap, teacher_cap, student_scale, teacher_scale, SHARED, REFERENCE, STUDENT_CAP, TEACHER_CAP, BLOCK,
            STAGES)
        shift_x, total_padded = _with_padding(top_s, total_x, padding, x_scale)
        target = load_logits(student_row, label_col, label_col >= 0, student_scale, student_cap, STUDENT_CAP)
        tl.store(stats_row, top_s)
        tl.store(stats_row + 1, total_z)
        tl.store(stats_row + 2, shift_x)
        tl.store(stats_row + 3, total_padded)
        tl.store(stats_row + 4, top_t)
        tl.store(stats_row + 5, total_y)
        tl.store(stats_row + 6, target)
        tl.store(stats_row + 7, teacher_at_top)
    else:
        for index in tl.static_range(NUM_SHARD_STATS):
            tl.store(stats_row + index, (index % 2 == 1) * 1.0)  # maxima 0, sums 1, the rest 0 or 1: never read


@triton.jit
def _whole_row_stats(stats_row):
    """(top_s, norm_z, shift_x, norm_x, top_t, norm_y, target, teacher_at_top) from a row's combined SHARD_STATS,
    the norms log2 of the sums as in _jsd_row_step_kernel."""
    return (tl.load(stats_row), tl.log2(tl.load(stats_row + 1)), tl.load(stats_row + 2), tl.log2(tl.load(stats_row + 3)),
            tl.load(stats_row + 4), tl.log2(tl.load(stats_row + 5)), tl.load(stats_row + 6), tl.load(stats_row + 7))


@triton.jit
def _jsd_shard_sums_kernel(
    student_ptr, student_row_stride, teacher_ptr, teacher_row_stride, labels_ptr, stats_ptr, sums_ptr,
    vocab_student, vocab_teacher, ignore_index, vocab_start, vocab_student_total,
    x_scale, keep, beta, student_cap, teacher_cap, student_scale, teacher_scale,
    MODE: tl.constexpr, LIFT: tl.constexpr, STUDENT_CAP: tl.constexpr, TEACHER_CAP: tl.constexpr,
    BLOCK: tl.constexpr, STAGES: tl.constexpr,
):
    """Stage 2: each row's _soft_sums over the shard's columns, from the whole row's statistics (0 if ignored)."""
    row = tl.program_id(0).to(tl.int64)
    student_row, valid, in_shard, column = row_and_label(
        row, student_ptr, student_row_stride, labels_ptr, ignore_index, vocab_start, vocab_student,
        vocab_student_total,
    )
    sums_row = sums_ptr + row * NUM_SHARD_SUMS
    student_sum, teacher_sum, shifted_sum, largest_bracket = 0.0, 0.0, 0.0, 0.0
    if valid:
        top_s, norm_z, shift_x, norm_x, top_t, norm_y, target, teacher_at_top = _whole_row_stats(
            stats_ptr + row * NUM_SHARD_STATS)
        student_sum, teacher_sum, shifted_sum, largest_bracket = _soft_sums(
            student_row, teacher_ptr + row * teacher_row_stride, vocab_student, vocab_teacher, x_scale, shift_x,
            norm_x, top_t, norm_y, top_s, teacher_at_top, keep, beta, student_cap, teacher_cap, student_scale,
            teacher_scale, MODE, MODE == REVERSE, LIFT, STUDENT_CAP, TEACHER_CAP, BLOCK, STAGES)
    tl.store(sums_row, student_sum)
    tl.store(sums_row + 1, teacher_sum)
    tl.store(sums_row + 2, shifted_sum)
    tl.store(sums_row + 3, largest_bracket)


@triton.jit
def _jsd_shard_grad_kernel(
    student_ptr, student_row_stride, teacher_ptr, teacher_row_stride, labels_ptr, stats_ptr, sums_ptr, losses_ptr,
    lifts_ptr, vocab_student, ignore_index, vocab_start, vocab_student_total,
    weight_hard, soft_coef, x_scale, keep, beta, student_cap, teacher_cap, student_scale, teacher_scale,
    MODE: tl.constexpr, SHARED: tl.constexpr, WRITE_GRAD: tl.constexpr, LIFT: tl.constexpr,
    STUDENT_CAP: tl.constexpr, TEACHER_CAP: tl.constexpr, BLOCK: tl.constexpr, STAGES: tl.constexpr,
):
    """Stage 3: each row's losses from the whole row's statistics and sums (the same on every rank) and, with
    WRITE_GRAD, the gradient of the shard's student columns (pass 3 of _jsd_row_step_kernel, in every MODE)."""
    row = tl.program_id(0).to(tl.int64)
    student_row, valid, in_shard, column = row_and_label(
        row, student_ptr, student_row_stride, labels_ptr, ignore_index, vocab_start, vocab_student,
        vocab_student_total,
    )
    label_col = tl.where(in_shard, column, -1).to(tl.int32)
    losses_row = losses_ptr + row * 2
    if valid:
        top_s, norm_z, shift_x, norm_x, top_t, norm_y, target, teacher_at_top = _whole_row_stats(
            stats_ptr + row * NUM_SHARD_STATS)
        sums_row = sums_ptr + row * NUM_SHARD_SUMS
        student_sum = tl.load(sums_row)
        tl.store(losses_row, (top_s - target) + LN2 * norm_z)
        tl.store(losses_row + 1, _soft_loss(student_sum, tl.load(sums_row + 1), keep, MODE))
        if WRITE_GRAD:
            _lift_and_write_row_grad(
                student_row, teacher_ptr + row * teacher_row_stride, lifts_ptr + row, vocab_student, label_col, x_scale,
                LOG2E, shift_x, norm_x, top_t, norm_y, top_s, teacher_at_top, norm_z,
                _inv_ratio(top_s, shift_x, x_scale, norm_x, norm_z, SHARED), weight_hard, soft_coef, student_sum,
                tl.load(sums_row + 2), tl.load(sums_row + 3), keep, beta, student_cap, teacher_cap, student_scale,
                teacher_scale, MODE, SHARED, LIFT, STUDENT_CAP, TEACHER_CAP, BLOCK, STAGES)
    else:
        tl.store(losses_row, 0.0)
        tl.store(losses_row + 1, 0.0)
        if LIFT:
            tl.store(lifts_ptr + row, 1.0)
        if WRITE_GRAD:
            _zero_row(student_row, vocab_student, BLOCK)


def _checked_sizes(student_logits, teacher_logits, labels, constants: RowStepConstants, *contiguous):
    """(rows, vocab_student, vocab_teacher) of a chunk's logits, whole rows or a shard of them, once the constants,
    the teacher's logits and, where there are rows, the layouts are checked."""
    _check_constants(constants)
    if teacher_logits is None:
        raise ValueError("the JSD row step needs the teacher's logits (it has no Gram path)")
    rows, vocab_student = student_logits.shape
    vocab_teacher = teacher_logits.shape[1]
    if vocab_teacher < vocab_student:
        raise ValueError(f"the teacher's vocabulary ({vocab_teacher}) is smaller than the student's ({vocab_student})")
    if rows:
        check_layout(student_logits, teacher_logits, labels, *contiguous)
    return rows, vocab_student, vocab_teacher


def jsd_shard_stats_triton(student_logits, teacher_logits, labels, constants: RowStepConstants) -> torch.Tensor:
    """Stage 1 over a shard's columns: [n, NUM_SHARD_STATS] fp32 (SHARD_STATS)."""
    stats = torch.empty(len(labels), NUM_SHARD_STATS.value, dtype=torch.float32, device=student_logits.device)
    rows, vocab_student, vocab_teacher = _checked_sizes(student_logits, teacher_logits, labels, constants, stats)
    if rows:
        _jsd_shard_stats_kernel[(rows,)](
            student_logits, student_logits.stride(0), teacher_logits, teacher_logits.stride(0), labels, stats,
            vocab_student, vocab_teacher, *common_args(vocab_student, constants), LOG2E.value / constants.temperature,
            float(vocab_teacher - vocab_student), *logit_args(constants), **cap_flags(constants),
            SHARED=constants.temperature == 1.0, REFERENCE=constants.beta == 1.0,
            BLOCK=block_size_for(vocab_teacher, None, LOSS_ONLY_WARPS, LOSS_ONLY_BLOCK),
            STAGES=LOSS_ONLY_STAGES, num_warps=LOSS_ONLY_WARPS, **TRITON_OPTIONS,
        )
    return stats


def combine_jsd_stats_triton(shard_stats: torch.Tensor, temperature: float) -> torch.Tensor:
    """The whole rows' SHARD_STATS from the ranks', [ranks, n, NUM_SHARD_STATS] -> [n, NUM_SHARD_STATS]: each
    (max, sum) pair's sums rescaled to the largest max at the pair's own scale (the hard term's log2(e), the
    others' log2(e) / T), the target logits added up, the teacher at the student's top from the ranks that hold it."""
    stats = torch.empty_like(shard_stats[0])
    for top, scale in ((0, LOG2E.value), (2, LOG2E.value / temperature), (4, LOG2E.value / temperature)):
        stats[:, top] = shard_stats[..., top].amax(0)
        shift = torch.exp2((shard_stats[..., top] - stats[:, top]) * scale)
        stats[:, top + 1] = (shard_stats[..., top + 1] * shift).sum(0)
    stats[:, 6] = shard_stats[..., 6].sum(0)
    holds_top = shard_stats[..., 0] == stats[:, 0]
    stats[:, 7] = torch.where(holds_top, shard_stats[..., 7], float("-inf")).amax(0)
    return stats


def jsd_shard_sums_triton(student_logits, teacher_logits, labels, stats, constants: RowStepConstants,
                          lift_terms=False) -> torch.Tensor:
    """Stage 2 over a shard's columns, from the combined statistics: [n, NUM_SHARD_SUMS] fp32."""
    sums = torch.empty(len(labels), NUM_SHARD_SUMS.value, dtype=torch.float32, device=student_logits.device)
    rows, vocab_student, vocab_teacher = _checked_sizes(student_logits, teacher_logits, labels, constants, stats, sums)
    if rows:
        _jsd_shard_sums_kernel[(rows,)](
            student_logits, student_logits.stride(0), teacher_logits, teacher_logits.stride(0), labels, stats, sums,
            vocab_student, vocab_teacher, *common_args(vocab_student, constants), LOG2E.value / constants.temperature,
            1.0 - constants.beta, constants.beta, *logit_args(constants), **cap_flags(constants),
            MODE=mode_of(constants.beta, student_logits.dtype), LIFT=lift_terms,
            BLOCK=block_size_for(vocab_teacher, None, LOSS_ONLY_WARPS, LOSS_ONLY_BLOCK), STAGES=LOSS_ONLY_STAGES,
            num_warps=LOSS_ONLY_WARPS, **TRITON_OPTIONS,
        )
    return sums


def combine_jsd_sums_triton(shard_sums: torch.Tensor) -> torch.Tensor:
    """The whole rows' shard sums from the ranks', [ranks, n, NUM_SHARD_SUMS] -> [n, NUM_SHARD_SUMS]."""
    return combine_jsd_sums_torch(shard_sums, summed=3)


def jsd_shard_grad_triton(student_logits, teacher_logits, labels, stats, sums, constants: RowStepConstants, token_losses,
                          write_grad, grad_lifts=None) -> None:
    """Stage 3: the losses and, if asked, the shard's gradient over its logits (times each row's lift, given
    ``grad_lifts``), from the combined statistics and sums."""
    rows, vocab_student, _ = _checked_sizes(student_logits, teacher_logits, labels, constants, stats, sums, token_losses,
                                            *([] if grad_lifts is None else [grad_lifts]))
    if not rows:
        return
    lifts, lift_flag = lift_args(grad_lifts, token_losses, write_grad)
    num_warps = DEFAULT_WARPS if write_grad else LOSS_ONLY_WARPS
    _jsd_shard_grad_kernel[(rows,)](
        student_logits, student_logits.stride(0), teacher_logits, teacher_logits.stride(0), labels, stats, sums,
        token_losses, lifts, vocab_student, *common_args(vocab_student, constants), constants.weight_hard,
        constants.weight_soft / constants.temperature, LOG2E.value / constants.temperature, 1.0 - constants.beta,
        constants.beta, *logit_args(constants), **cap_flags(constants), MODE=mode_of(constants.beta, student_logits.dtype),
        SHARED=constants.temperature == 1.0,
        WRITE_GRAD=write_grad, **lift_flag, BLOCK=block_size_for(vocab_student, None, num_warps, DEFAULT_BLOCK),
        STAGES=DEFAULT_STAGES,
        num_warps=num_warps, **TRITON_OPTIONS,
    )


def split_jsd_row_step_triton(all_gather):
    """The JSD's row step over a vocabulary split across ranks in three launches, with split_jsd_row_step's two
    all-gathers of O(rows) per chunk between them (of [n, 8] and [n, 4] fp32)."""

    def row_step(student_logits, teacher_logits, labels, constants, token_losses, write_grad, grad_lifts=None):
        stats = combine_jsd_stats_triton(
            all_gather(jsd_shard_stats_triton(student_logits, teacher_logits, labels, constants)), constants.temperature)
        lift_terms = write_grad and grad_lifts is not None
        sums = combine_jsd_sums_triton(all_gather(jsd_shard_sums_triton(student_logits, teacher_logits, labels, stats,
                                                                        constants, lift_terms)))
        jsd_shard_grad_triton(student_logits, teacher_logits, labels, stats, sums, constants, token_losses, write_grad,
                              grad_lifts)  # every rank: the same stats and sums, so the same losses and lifts

    return row_step


JSD_TRITON_ROW_STEP = RowStepImpl(row_step_jsd_triton, None, None, split=split_jsd_row_step_triton)
