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

The launch without gradients runs passes 1 and 2; an ignored token reads nothing.
"""

import math

import triton
import triton.language as tl

from .._row_step import RowStepImpl, RowStepScales
from .row_step_triton import FLOAT32_TINY, INTERPRET, LOG2E, _block, _check_layout, _common_args, _row_and_label

# Untuned: the cosine step's (row_step_triton.py) until the H200 sweeps. STAGES: each hot loop's loads go
# through shared memory STAGES - 1 blocks ahead (1: plain loads into registers).
DEFAULT_BLOCK = 2048
DEFAULT_WARPS = 8
DEFAULT_STAGES = 4
LOSS_ONLY_BLOCK = 2048
LOSS_ONLY_WARPS = 8
LOSS_ONLY_STAGES = 4

LOG2E_HOST = math.log2(math.e)
LN2: tl.constexpr = tl.constexpr(math.log(2.0))  # base-2 sums back to nats
# The soft term's form, a compile-time branch each (the spec's three cases):
FORWARD: tl.constexpr = tl.constexpr(0)  # beta == 0: KL(q || p)
REVERSE: tl.constexpr = tl.constexpr(1)  # beta == 1: KL(p || q)
MIXED: tl.constexpr = tl.constexpr(2)  # 0 < beta < 1: against the mixture m


@triton.jit
def _exp2(x, ACCURATE: tl.constexpr = False):
    """2^x as row_step_triton._exp's ex2.approx.ftz (results below 1e-38 flush to 0), without its multiply by
    log2(e), which the base-2 callers have folded into their scales. ACCURATE: the row's few scalars."""
    if INTERPRET:
        return tl.exp2(x)
    elif ACCURATE:
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
def _online(run_max, run_sum, x):
    """Each lane's running max and sum of 2^(x - max), one exponential per logit instead of the usual two:
    only the smaller of x and the old max is shifted by the other. The first logit (max -inf) gives
    gap = 2^-inf = 0 and sum 1."""
    gap = _exp2(-tl.abs(x - run_max))
    grew = x > run_max
    return tl.maximum(run_max, x), tl.where(grew, run_sum * gap + 1.0, run_sum + gap)


@triton.jit
def _online_masked(run_max, run_sum, x, mask):
    """_online where mask holds; elsewhere the lane keeps its state (x there is the load's 0, so nothing
    computed is NaN either)."""
    new_max, new_sum = _online(run_max, run_sum, x)
    return tl.where(mask, new_max, run_max), tl.where(mask, new_sum, run_sum)


@triton.jit
def _row_total(run_max, run_sum):
    """(max, sum of 2^(x - max)) of the row from its lanes'; a lane that saw nothing holds (-inf, 0)."""
    row_max = tl.max(run_max, axis=0)
    return row_max, tl.sum(run_sum * tl.exp2(run_max - row_max), axis=0)


@triton.jit
def _student_probs(s, a, z_scale, norm_z, inv_ratio, SHARED: tl.constexpr):
    """(p, softmax(s)): the student's probabilities at T over the padded vocabulary (log2 p = a) and unscaled
    over its own (the hard term's). With SHARED (T == 1) they differ only by the padding's share of the
    normaliser: one exponential, and p = softmax(s) * inv_ratio with inv_ratio <= 1, so nothing overflows
    however much the padding's zeros dominate."""
    if SHARED:
        hard_prob = _exp2(s * z_scale - norm_z)
        return hard_prob * inv_ratio, hard_prob
    else:
        return _exp2(a), _exp2(s * z_scale - norm_z)


@triton.jit
def _mixture(p, b, keep, log_beta):
    """(beta q, log2 m) with m = (1 - beta) p + beta q; keep = 1 - beta. The max with the smallest normal
    keeps the log finite where p and q both flush to 0, whose terms then weigh 0 (lg2.approx.ftz would
    read a subnormal sum as 0 and give -inf, and 0 * -inf is NaN)."""
    beta_q = _exp2(b + log_beta)
    return beta_q, _log2(tl.maximum(keep * p + beta_q, FLOAT32_TINY))


@triton.jit
def _soft_terms(s, t, x_scale, norm_x, norm_y, keep, log_beta, MODE: tl.constexpr):
    """Per logit pair, the soft loss's summands in base-2 units: (the student's, the teacher's); the soft loss
    is ln 2 times their sums, and the student's alone is (1 - beta) KL(p || m) for the mixed gradient's
    row sum. FORWARD: q (b - a), REVERSE: p (a - b), MIXED: (1 - beta) p (a - m) and beta q (b - m)."""
    a = s * x_scale - norm_x
    b = t * x_scale - norm_y
    if MODE == FORWARD:
        return tl.zeros_like(a), _exp2(b) * (b - a)
    elif MODE == REVERSE:
        return _exp2(a) * (a - b), tl.zeros_like(a)
    else:
        p = _exp2(a)
        beta_q, log_m = _mixture(p, b, keep, log_beta)
        return (keep * p) * (a - log_m), beta_q * (b - log_m)


@triton.jit
def _grad(s, t, cols, label_col, x_scale, z_scale, norm_x, norm_y, norm_z, inv_ratio, weight_hard, soft_coef,
          log_coef, shift, keep, log_beta, MODE: tl.constexpr, SHARED: tl.constexpr):
    """(d L / d s, the FORWARD soft summand q (b - a)) of a block: weight_hard (softmax(s) - onehot) plus
    soft_coef = weight_soft / T times the soft term's bracket, in REVERSE and MIXED p (log_coef (a - x) - shift)
    with x = b or log2 m and the row constants from pass 2."""
    a = s * x_scale - norm_x
    b = t * x_scale - norm_y
    p, hard_prob = _student_probs(s, a, z_scale, norm_z, inv_ratio, SHARED)
    grad = weight_hard * hard_prob - tl.where(cols == label_col, weight_hard, 0.0)
    if MODE == FORWARD:
        q = _exp2(b)
        return grad + soft_coef * (p - q), q * (b - a)
    elif MODE == REVERSE:
        return grad + p * (log_coef * (a - b) - shift), tl.zeros_like(a)
    else:
        _, log_m = _mixture(p, b, keep, log_beta)
        return grad + p * (log_coef * (a - log_m) - shift), tl.zeros_like(a)


@triton.jit
def _jsd_row_step_kernel(
    student_ptr, student_row_stride, teacher_ptr, teacher_row_stride, labels_ptr, losses_ptr,
    vocab_student, vocab_teacher, ignore_index, vocab_start, vocab_student_total,
    weight_hard, soft_coef, x_scale, padding, keep, log_beta,
    MODE: tl.constexpr, SHARED: tl.constexpr, WRITE_GRAD: tl.constexpr, BLOCK: tl.constexpr, STAGES: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    student_row, valid, in_shard, column = _row_and_label(
        row, student_ptr, student_row_stride, labels_ptr, ignore_index, vocab_start, vocab_student,
        vocab_student_total,
    )
    # As the spec's label_columns: a valid label outside this shard's columns stands at column 0.
    label_col = tl.where(in_shard, column, 0).to(tl.int32)
    teacher_row = teacher_ptr + row * teacher_row_stride
    losses_row = losses_ptr + row * 2
    offsets = tl.arange(0, BLOCK)
    whole_blocks_stop = vocab_student - vocab_student % BLOCK
    if SHARED:
        z_scale = x_scale  # the same stream as the soft term's student at T
    else:
        z_scale = LOG2E  # the unscaled student, for the hard term
    if valid:
        # Pass 1: the three (two at T == 1) streams' running max and sum of exps; hot loop without masks.
        max_x = tl.full([BLOCK], float("-inf"), tl.float32)
        sum_x = tl.zeros([BLOCK], tl.float32)
        max_y = tl.full([BLOCK], float("-inf"), tl.float32)
        sum_y = tl.zeros([BLOCK], tl.float32)
        max_z = tl.full([BLOCK], float("-inf"), tl.float32)
        sum_z = tl.zeros([BLOCK], tl.float32)
        for start in tl.range(0, whole_blocks_stop, BLOCK, num_stages=STAGES):
            cols = start + offsets
            s = tl.load(student_row + cols).to(tl.float32)
            t = tl.load(teacher_row + cols).to(tl.float32)
            max_x, sum_x = _online(max_x, sum_x, s * x_scale)
            max_y, sum_y = _online(max_y, sum_y, t * x_scale)
            if not SHARED:
                max_z, sum_z = _online(max_z, sum_z, s * z_scale)
        for start in range(whole_blocks_stop, vocab_teacher, BLOCK):  # the student's last block, the teacher's rest
            cols = start + offsets
            in_student = cols < vocab_student
            in_teacher = cols < vocab_teacher
            s = tl.load(student_row + cols, mask=in_student, other=0.0).to(tl.float32)
            t = tl.load(teacher_row + cols, mask=in_teacher, other=0.0).to(tl.float32)
            max_x, sum_x = _online_masked(max_x, sum_x, s * x_scale, in_student)
            max_y, sum_y = _online_masked(max_y, sum_y, t * x_scale, in_teacher)
            if not SHARED:
                max_z, sum_z = _online_masked(max_z, sum_z, s * z_scale, in_student)
        top_x, total_x = _row_total(max_x, sum_x)
        top_y, total_y = _row_total(max_y, sum_y)
        if SHARED:
            top_z, total_z = top_x, total_x
        else:
            top_z, total_z = _row_total(max_z, sum_z)
        # The padding's zeros, 2^0 each, join the student's soft normaliser (not the hard term's). The where
        # keeps padding * 2^-top (inf for a very negative top) out of rows without padding.
        top_padded = tl.where(padding > 0, tl.maximum(top_x, 0.0), top_x)
        total_padded = total_x * tl.exp2(top_x - top_padded) + tl.where(padding > 0, padding * tl.exp2(-top_padded),
                                                                        0.0)
        norm_x = top_padded + tl.log2(total_padded)  # log2 p = s x_scale - norm_x
        norm_y = top_y + tl.log2(total_y)  # log2 q = t x_scale - norm_y
        norm_z = top_z + tl.log2(total_z)  # log2 softmax(s) = s z_scale - norm_z
        inv_ratio = tl.exp2(norm_z - norm_x)  # p / softmax(s) on the student's columns: 1 without padding
        target = tl.load(student_row + label_col, mask=label_col < vocab_student, other=0.0).to(tl.float32)
        # (max - target) + log(sum): the two parts apart, as row_step.row_grad_torch keeps them
        hard_loss = LN2 * ((top_z - target * z_scale) + tl.log2(total_z))

        # Pass 2: the soft sums, and for FORWARD with gradients the gradient (its target read above first).
        student_part = tl.zeros([BLOCK], tl.float32)
        teacher_part = tl.zeros([BLOCK], tl.float32)
        for start in tl.range(0, whole_blocks_stop, BLOCK, num_stages=STAGES):
            cols = start + offsets
            s = tl.load(student_row + cols).to(tl.float32)
            t = tl.load(teacher_row + cols).to(tl.float32)
            if WRITE_GRAD and MODE == FORWARD:
                grad, term = _grad(s, t, cols, label_col, x_scale, z_scale, norm_x, norm_y, norm_z, inv_ratio,
                                   weight_hard, soft_coef, 0.0, 0.0, keep, log_beta, MODE, SHARED)
                teacher_part += term
                tl.store(student_row + cols, grad.to(student_row.dtype.element_ty))
            else:
                student_term, teacher_term = _soft_terms(s, t, x_scale, norm_x, norm_y, keep, log_beta, MODE)
                student_part += student_term
                teacher_part += teacher_term
        for start in range(whole_blocks_stop, vocab_teacher, BLOCK):  # s is 0 on [Vs, Vt): the padding counts
            cols = start + offsets
            in_student = cols < vocab_student
            in_teacher = cols < vocab_teacher
            s = tl.load(student_row + cols, mask=in_student, other=0.0).to(tl.float32)
            t = tl.load(teacher_row + cols, mask=in_teacher, other=0.0).to(tl.float32)
            if WRITE_GRAD and MODE == FORWARD:
                grad, term = _grad(s, t, cols, label_col, x_scale, z_scale, norm_x, norm_y, norm_z, inv_ratio,
                                   weight_hard, soft_coef, 0.0, 0.0, keep, log_beta, MODE, SHARED)
                teacher_part += tl.where(in_teacher, term, 0.0)
                tl.store(student_row + cols, grad.to(student_row.dtype.element_ty), mask=in_student)
            else:
                student_term, teacher_term = _soft_terms(s, t, x_scale, norm_x, norm_y, keep, log_beta, MODE)
                student_part += tl.where(in_teacher, student_term, 0.0)
                teacher_part += tl.where(in_teacher, teacher_term, 0.0)
        student_sum = tl.sum(student_part, axis=0)
        soft_loss = LN2 * (student_sum + tl.sum(teacher_part, axis=0))
        tl.store(losses_row, hard_loss)
        tl.store(losses_row + 1, soft_loss)

        # Pass 3: REVERSE and MIXED subtract each row's sum_j p_j g_j, known only now.
        if WRITE_GRAD and MODE != FORWARD:
            if MODE == REVERSE:
                log_coef = soft_coef * LN2
                shift = soft_coef * soft_loss  # soft = sum p (a - b)
            else:
                log_coef = soft_coef * keep * LN2
                shift = soft_coef * LN2 * student_sum  # (1 - beta) KL(p || m) times soft_coef
            for start in tl.range(0, whole_blocks_stop, BLOCK, num_stages=STAGES):
                cols = start + offsets
                s = tl.load(student_row + cols).to(tl.float32)
                t = tl.load(teacher_row + cols).to(tl.float32)
                grad, _ = _grad(s, t, cols, label_col, x_scale, z_scale, norm_x, norm_y, norm_z, inv_ratio,
                                weight_hard, soft_coef, log_coef, shift, keep, log_beta, MODE, SHARED)
                tl.store(student_row + cols, grad.to(student_row.dtype.element_ty))
            for start in range(whole_blocks_stop, vocab_student, BLOCK):  # the last, partial block
                cols = start + offsets
                in_student = cols < vocab_student
                s = tl.load(student_row + cols, mask=in_student, other=0.0).to(tl.float32)
                t = tl.load(teacher_row + cols, mask=in_student, other=0.0).to(tl.float32)
                grad, _ = _grad(s, t, cols, label_col, x_scale, z_scale, norm_x, norm_y, norm_z, inv_ratio,
                                weight_hard, soft_coef, log_coef, shift, keep, log_beta, MODE, SHARED)
                tl.store(student_row + cols, grad.to(student_row.dtype.element_ty), mask=in_student)
    else:  # an ignored token: no loss, no gradient
        tl.store(losses_row, 0.0)
        tl.store(losses_row + 1, 0.0)
        if WRITE_GRAD:
            for start in range(0, vocab_student, BLOCK):
                cols = start + offsets
                tl.store(student_row + cols, tl.zeros([BLOCK], student_row.dtype.element_ty), mask=cols < vocab_student)


def _check_scales(scales: RowStepScales):
    """The spec's scope: no softcaps or logit scales (the JSD's API refuses them), beta in [0, 1], T > 0."""
    for name in ("student_softcap", "teacher_softcap"):
        if getattr(scales, name) is not None:
            raise ValueError(f"the JSD row step takes no {name}, got {getattr(scales, name)}")
    for name in ("student_logit_scale", "teacher_logit_scale"):
        if getattr(scales, name) != 1.0:
            raise ValueError(f"the JSD row step takes no {name} other than 1, got {getattr(scales, name)}")
    if not 0.0 <= scales.beta <= 1.0:
        raise ValueError(f"the JSD row step needs beta in [0, 1], got {scales.beta}")
    if not scales.temperature > 0.0:
        raise ValueError(f"the JSD row step needs a positive temperature, got {scales.temperature}")


def row_step_jsd_triton(student_logits, teacher_logits, labels, scales: RowStepScales, token_losses, write_grad,
                        grad_lifts=None, block_size=None, num_warps=None, num_stages=None) -> None:
    if grad_lifts is not None:
        raise ValueError("the JSD row step has no fp16 lifts: pass bf16 or fp32 logits")
    _check_scales(scales)
    if teacher_logits is None:
        raise ValueError("the JSD row step needs the teacher's logits (it has no Gram path)")
    rows, vocab_student = student_logits.shape
    vocab_teacher = teacher_logits.shape[1]
    if vocab_teacher < vocab_student:
        raise ValueError(f"the teacher's vocabulary ({vocab_teacher}) is smaller than the student's ({vocab_student})")
    if rows == 0:
        return
    _check_layout(student_logits, teacher_logits, labels, token_losses)
    beta, temperature = scales.beta, scales.temperature
    mode = 0 if beta == 0.0 else 1 if beta == 1.0 else 2  # FORWARD, REVERSE, MIXED
    num_warps = num_warps or (DEFAULT_WARPS if write_grad else LOSS_ONLY_WARPS)
    block = _block(vocab_student, block_size, num_warps, DEFAULT_BLOCK if write_grad else LOSS_ONLY_BLOCK)
    stages = num_stages or (DEFAULT_STAGES if write_grad else LOSS_ONLY_STAGES)
    _jsd_row_step_kernel[(rows,)](
        student_logits, student_logits.stride(0), teacher_logits, teacher_logits.stride(0), labels, token_losses,
        vocab_student, vocab_teacher, *_common_args(vocab_student, scales),
        scales.weight_hard, scales.weight_soft / temperature, LOG2E_HOST / temperature,
        float(vocab_teacher - vocab_student), 1.0 - beta, math.log2(beta) if mode == 2 else 0.0,
        MODE=mode, SHARED=temperature == 1.0, WRITE_GRAD=write_grad, BLOCK=block, STAGES=stages,
        num_warps=num_warps,
    )


# No split into statistics and gradient: a vocabulary split over ranks is refused for the JSD (_plan.py).
TRITON_JSD_ROW_STEP = RowStepImpl(row_step_jsd_triton, None, None)
