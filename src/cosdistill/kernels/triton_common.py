"""What the Triton kernels share: the interpreter's flag and the constants their jit code reads, the logits as
the loss sees them (logit scale, softcap, one rounding), a row's label, the fp16 lift's power of two, and the
launch arguments made from a call's RowStepConstants. The cosine step (``row_step_triton.py``) and the JSD's
(``row_step_jsd_triton.py``) take them from here; each keeps its own math."""

import os

import triton
import triton.language as tl

from .._row_step import MAX_LIFT_EXPONENT, MAX_STORED_EXPONENT, RowStepConstants

FLOAT32_TINY: tl.constexpr = tl.constexpr(1.1754943508222875e-38)  # bound 0 (both weights 0): no log2(0)
FLOAT32_MAX: tl.constexpr = tl.constexpr(3.4028234663852886e38)
# An fp32 sum of squares below this may have lost its smallest squares (subnormal) beside its largest.
SMALLEST_PLAIN_SUM: tl.constexpr = tl.constexpr(2.0**-100)
MAX_LIFT: tl.constexpr = tl.constexpr(float(MAX_LIFT_EXPONENT))
MAX_STORED: tl.constexpr = tl.constexpr(float(MAX_STORED_EXPONENT))
LOG2E: tl.constexpr = tl.constexpr(1.4426950408889634)
LN2: tl.constexpr = tl.constexpr(0.6931471805599453)  # base-2 sums back to nats
INTERPRET: tl.constexpr = tl.constexpr(os.environ.get("TRITON_INTERPRET") == "1")  # read when Triton reads it


@triton.jit
def stable_tanh(x):
    """tanh(x), written through exp of a non-positive number (no overflow), except below |x| = 1/8, where
    1 - exp(-2|x|) cancels (relative error ~6e-8 / |x|) and tanh's Taylor series to x^7 is exact to fp32's
    rounding instead."""
    a = tl.abs(x)
    decay = tl.exp(-2.0 * a)
    a2 = a * a
    series = a * (1.0 + a2 * (-1.0 / 3.0 + a2 * (2.0 / 15.0 + a2 * (-17.0 / 315.0))))
    tanh_abs = tl.where(a < 0.125, series, (1.0 - decay) / (1.0 + decay))
    return tl.where(x >= 0, tanh_abs, -tanh_abs)


@triton.jit
def mul_rn(x, y):
    """x * y rounded to fp32 before anything uses it: mul.rn, which neither LLVM nor ptxas contracts into one
    FMA with the subtraction that uses it, as Triton's FP fusion does a plain product. The interpreter cannot
    run PTX (and contracts nothing)."""
    if INTERPRET:
        return x * y
    else:
        return tl.inline_asm_elementwise("mul.rn.f32 $0, $1, $2;", "=f,f,f", [x, y], dtype=tl.float32,
                                         is_pure=True, pack=1)


@triton.jit
def load_logits(row, cols, mask, logit_scale, cap, CAP: tl.constexpr, MASKED: tl.constexpr = True):
    """Logits as the loss sees them: fp32, times the logit scale (None: 1), softcapped; 0 where masked,
    and 0 everywhere for a row of None (no teacher logits: the Gram path, _teacher_gram.py).

    The last product, x times the scale or cap times tanh(x / cap), is rounded once (mul_rn), so that every
    difference the kernels take (s - max, max - s[label]) sees one fp32 value per logit, as the interpreter
    does: contracted into FMAs it was rounded in the max but not in s - max (docs/design.md, Softcaps and logit
    scales). Without caps and scales the kernels are unchanged."""
    if row is None:  # one if-elif chain: code after a return in a static branch is still compiled
        x = tl.zeros(cols.shape, tl.float32)
    elif MASKED:
        x = tl.load(row + cols, mask=mask, other=0.0).to(tl.float32)
    else:
        x = tl.load(row + cols).to(tl.float32)
    if logit_scale is not None:
        x = mul_rn(x, logit_scale)
    if CAP:  # cap * tanh(x / cap), x / cap as x times 1 / cap (the scalar's division is hoisted out of the loop)
        x = mul_rn(cap, stable_tanh(x * (1.0 / cap)))
    return x


@triton.jit
def one_if_none(x):
    if x is None:
        return 1.0
    else:
        return x


@triton.jit
def row_and_label(row, student_ptr, student_row_stride, labels_ptr, ignore_index, vocab_start, vocab_student,
                   vocab_student_total):
    """The row's student logits pointer and its label: whether it counts, and where it lies in this shard.
    (The teacher's row pointer is made in each kernel: a jit function cannot return None, the Gram path's.)"""
    label = tl.load(labels_ptr + row).to(tl.int64)
    valid = (label != ignore_index) & (label >= 0) & (label < vocab_student_total)
    column = label - vocab_start
    in_shard = valid & (column >= 0) & (column < vocab_student)
    return student_ptr + row * student_row_stride, valid, in_shard, column


@triton.jit
def lift_for(bound):
    """_row_step.lift_for: the row's power of two for a bound on its largest gradient entry."""
    exponent = tl.floor(-tl.log2(tl.maximum(bound, FLOAT32_TINY)))
    exponent = tl.where(exponent > 0, tl.minimum(exponent, MAX_LIFT),
                        tl.where(exponent < -MAX_STORED, exponent + MAX_STORED, 0.0))
    exponent = tl.where(bound <= FLOAT32_MAX, exponent, 0.0)  # NaN and inf: 1, as the spec
    return ((exponent.to(tl.int32) + 127) << 23).to(tl.float32, bitcast=True)  # exactly 2^exponent


@triton.jit
def through_softcap(grad, s, cap, CAP: tl.constexpr):
    """d L / d z from d L / d s, s = cap tanh(z / cap) the softcapped logit (CAP): times 1 - (s / cap)^2."""
    if CAP:
        tanh_z = s * (1.0 / cap)
        grad *= 1.0 - tanh_z * tanh_z
    return grad


def check_layout(student_logits, teacher_logits, labels, *contiguous):
    if student_logits.stride(1) != 1 or (teacher_logits is not None and teacher_logits.stride(1) != 1):
        raise ValueError(f"the Triton row step needs logits with unit stride along the vocabulary, got student_logits "
                         f"strides {student_logits.stride()}"
                         + ("" if teacher_logits is None else f" and teacher_logits strides {teacher_logits.stride()}"))
    tensors = (labels, *contiguous)
    if not all(t.is_contiguous() for t in tensors):
        raise ValueError("the Triton row step needs contiguous labels, statistics and token_losses, got strides "
                         f"{[t.stride() for t in tensors]} for shapes {[tuple(t.shape) for t in tensors]}")


def common_args(vocab_student, constants: RowStepConstants):
    total = vocab_student if constants.vocab_student_total is None else constants.vocab_student_total
    return (constants.ignore_index, constants.vocab_start, total)


def logit_args(constants: RowStepConstants):
    """Caps (1.0 when off: the CAP flags skip them), then logit scales (None for 1: no multiply per logit)."""
    def scale(value):
        return None if value == 1.0 else value

    return (constants.student_softcap or 1.0, constants.teacher_softcap or 1.0, scale(constants.student_logit_scale),
            scale(constants.teacher_logit_scale))


def block_size_for(vocab, block_size, num_warps, default):
    return block_size or max(32 * num_warps, min(default, triton.next_power_of_2(max(1, vocab))))


def cap_flags(constants: RowStepConstants):
    return dict(STUDENT_CAP=constants.student_softcap is not None, TEACHER_CAP=constants.teacher_softcap is not None)


def lift_args(grad_lifts, token_losses, write_grad):
    """The lifts' pointer (token_losses stands in when there are none: never written) and LIFT."""
    lift = write_grad and grad_lifts is not None
    return (grad_lifts if lift else token_losses), dict(LIFT=lift)
