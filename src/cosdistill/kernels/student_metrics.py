"""The student's per-token metrics (entropy, whether the label is the top logit) in one read of each row: one
program per row, the row's max, sum of exponentials and their weighted sum of distances kept online, in base 2.
Its spec: ``_student_metrics.student_metrics_torch``."""

import math

import triton
import triton.language as tl

from .._row_step import RowStepConstants
from . import TRITON_OPTIONS
from .triton_common import LOG2E, block_size_for, load_logits, row_and_label

NEG_INF: tl.constexpr = tl.constexpr(float("-inf"))
LN2: tl.constexpr = tl.constexpr(math.log(2.0))


@triton.jit
def _student_metrics_kernel(student_ptr, student_row_stride, labels_ptr, out_ptr, vocab_student, ignore_index,
                            x_scale, cap, logit_scale, CAP: tl.constexpr, BLOCK: tl.constexpr):
    """out[row] = (entropy in nats of softmax(s / T), 1.0 where the label is the first largest s), with
    x = s log2(e) / T: H = log2(S) - X / S in bits, S = sum 2^(x - m), X = sum (x - m) 2^(x - m), m the row's max,
    each block's terms moved to the running max as it grows."""
    row = tl.program_id(0).to(tl.int64)
    student_row, valid, _, column = row_and_label(row, student_ptr, student_row_stride, labels_ptr, ignore_index, 0,
                                                  vocab_student, vocab_student)
    offsets = tl.arange(0, BLOCK)
    x_max = tl.full([], NEG_INF, tl.float32)  # of x, for the entropy
    sum_exp = tl.zeros([], tl.float32)
    sum_weighted = tl.zeros([], tl.float32)
    top = tl.full([], NEG_INF, tl.float32)  # of s, for the first largest column (x's rounding could tie logits)
    top_column = tl.full([], vocab_student, tl.int32)
    for start in range(0, vocab_student, BLOCK):
        cols = start + offsets
        in_row = cols < vocab_student
        s = load_logits(student_row, cols, in_row, logit_scale, cap, CAP)
        s = tl.where(in_row, s, NEG_INF)
        block_top = tl.max(s, axis=0)
        block_column = tl.min(tl.where(s == block_top, cols, vocab_student), axis=0)
        top_column = tl.where(block_top > top, block_column, top_column)  # an equal later block keeps the first
        top = tl.maximum(top, block_top)
        x = s * x_scale
        new_max = tl.maximum(x_max, tl.max(x, axis=0))
        distance = tl.where(in_row, x - new_max, 0.0)
        terms = tl.where(in_row, tl.exp2(distance), 0.0)
        moved = tl.exp2(x_max - new_max)  # 0 before the first block
        shift = tl.where(sum_exp > 0.0, x_max - new_max, 0.0)  # the earlier terms' distances grow by it (not -inf)
        sum_weighted = moved * (sum_weighted + shift * sum_exp)
        sum_exp = moved * sum_exp + tl.sum(terms, axis=0)
        sum_weighted += tl.sum(distance * terms, axis=0)
        x_max = new_max
    entropy = (tl.log2(sum_exp) - sum_weighted / sum_exp) * LN2
    tl.store(out_ptr + 2 * row, tl.where(valid, entropy, 0.0))
    tl.store(out_ptr + 2 * row + 1, tl.where(valid & (top_column == column), 1.0, 0.0))


def student_metrics_triton(student_logits, labels, constants: RowStepConstants, temperature: float, out) -> None:
    """student_metrics_torch in one kernel: student_logits [n, Vs] of unit column stride, contiguous labels [n]
    and out [n, 2] float32."""
    rows, vocab_student = student_logits.shape
    if student_logits.stride(1) != 1 or not (labels.is_contiguous() and out.is_contiguous()):
        raise ValueError("the Triton student metrics need logits of unit column stride, contiguous labels and out")
    if rows == 0:
        return
    scale = constants.student_logit_scale
    _student_metrics_kernel[(rows,)](
        student_logits, student_logits.stride(0), labels, out, vocab_student, constants.ignore_index,
        LOG2E.value / temperature, constants.student_softcap or 1.0, None if scale == 1.0 else scale,
        CAP=constants.student_softcap is not None, BLOCK=block_size_for(vocab_student, None, 4, 4096),
        num_warps=4, **TRITON_OPTIONS)
