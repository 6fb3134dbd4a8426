"""The student's per-token metrics (entropy, whether the label is the top logit) in one read of each row: one
program per row, the row's max, sum of exponentials and their weighted sum of distances kept online, in base 2.
Its spec: ``_student_metrics.student_metrics_torch``."""

import triton
import triton.language as tl

from .._row_step import RowStepConstants
from . import TRITON_OPTIONS
from .triton_common import LN2, LOG2E, block_size_for, load_logits, row_and_label

# Columns per block and warps per row: a memory-bound pass with a handful of block reductions.
BLOCK = 4096
NUM_WARPS = 4


@triton.jit
def _student_metrics_kernel(student_ptr, student_row_stride, labels_ptr, out_ptr, vocab_student, ignore_index,
                            x_scale, cap, logit_scale, CAP: tl.constexpr, BLOCK: tl.constexpr):
    """out[row] = (entropy in nats of softmax(s / T), 1.0 where the label is the first largest s), with
    x = s log2(e) / T: H = log2(S) - X / S in bits, S = sum 2^(x - m), X = sum (x - m) 2^(x - m), m the row's max
    (the largest s times x_scale: a positive scale keeps the order), each block's terms moved to the running max
    as it grows."""
    row = tl.program_id(0).to(tl.int64)
    student_row, valid, _, column = row_and_label(row, student_ptr, student_row_stride, labels_ptr, ignore_index, 0,
                                                  vocab_student, vocab_student)
    offsets = tl.arange(0, BLOCK)
    top = tl.full([], float("-inf"), tl.float32)  # the largest s so far
    top_column = tl.full([], vocab_student, tl.int32)  # the first column holding it
    sum_exp = tl.zeros([], tl.float32)
    sum_weighted = tl.zeros([], tl.float32)
    for start in range(0, vocab_student, BLOCK):
        cols = start + offsets
        in_row = cols < vocab_student
        s = tl.where(in_row, load_logits(student_row, cols, in_row, logit_scale, cap, CAP), float("-inf"))
        block_top = tl.max(s, axis=0)
        block_column = tl.min(tl.where(s == block_top, cols, vocab_student), axis=0)
        top_column = tl.where(block_top > top, block_column, top_column)  # an equal later block keeps the first
        new_top = tl.maximum(top, block_top)
        distance = tl.where(in_row, (s - new_top) * x_scale, 0.0)
        terms = tl.where(in_row, tl.exp2(distance), 0.0)
        grown = (top - new_top) * x_scale  # how much the earlier distances grow (-inf before the first block)
        moved = tl.exp2(grown)
        shift = tl.where(sum_exp > 0.0, grown, 0.0)
        sum_weighted = moved * (sum_weighted + shift * sum_exp)
        sum_exp = moved * sum_exp + tl.sum(terms, axis=0)
        sum_weighted += tl.sum(tl.where(terms > 0.0, distance * terms, 0.0), axis=0)  # a -inf logit adds 0
        top = new_top
    entropy = (tl.log2(sum_exp) - sum_weighted / sum_exp) * LN2
    tl.store(out_ptr + 2 * row, tl.where(valid, entropy, 0.0))
    tl.store(out_ptr + 2 * row + 1, tl.where(valid & (top_column == column), 1.0, 0.0))


def student_metrics_triton(student_logits, labels, constants: RowStepConstants, temperature: float, out) -> None:
    """student_metrics_torch in one kernel: student_logits [n, Vs] of unit column stride, contiguous labels [n]
    and out [n, 2] float32."""
    rows, vocab_student = student_logits.shape
    if student_logits.stride(1) != 1 or not (labels.is_contiguous() and out.is_contiguous()):
        raise ValueError("the Triton student metrics need logits of unit column stride, contiguous labels and out, got "
                         f"student_logits {tuple(student_logits.shape)} strides {student_logits.stride()}, labels "
                         f"strides {labels.stride()}, out strides {out.stride()}")
    if rows == 0:
        return
    scale = constants.student_logit_scale
    _student_metrics_kernel[(rows,)](
        student_logits, student_logits.stride(0), labels, out, vocab_student, constants.ignore_index,
        LOG2E.value / temperature, constants.student_softcap or 1.0, None if scale == 1.0 else scale,
        CAP=constants.student_softcap is not None, BLOCK=block_size_for(vocab_student, None, NUM_WARPS, BLOCK),
        num_warps=NUM_WARPS, **TRITON_OPTIONS)
