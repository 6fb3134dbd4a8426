"""The student's per-token metrics (entropy, whether the label is the top logit) in one read of each row: one
program per row, each lane keeping its own running max, first column of it, sum of exponentials and their weighted
sum of distances (in base 2), and the lanes combined once at the row's end. Its spec:
``_student_metrics.student_metrics_torch``."""

import triton
import triton.language as tl

from .._row_step import RowStepConstants
from . import TRITON_OPTIONS
from .triton_common import LN2, LOG2E, block_size_for, load_logits, row_and_label

# Lanes per row, warps and pipelined loads (STAGES - 1 blocks ahead; 1: plain loads), chosen by an H100 sweep
# (docs/design.md, The student's metrics).
BLOCK = 2048
NUM_WARPS = 8
STAGES = 1


@triton.jit
def _online(top, top_column, sum_exp, sum_weighted, s, cols, x_scale):
    """Each lane's running (max of s, first column holding it, S = sum 2^e, W = sum e 2^e), e = (s - max) x_scale
    the distances in bits, with one exponential per logit: only the smaller of s and the old max is shifted by the
    other. A -inf logit leaves the lane as it was; the first finite one gives (s, its column, 1, 0)."""
    distance = -tl.abs(s - top) * x_scale
    term = tl.exp2(distance)
    grew = s > top
    new_weighted = tl.where(grew, tl.where(term > 0.0, term * (sum_weighted + distance * sum_exp), 0.0),
                            sum_weighted + tl.where(term > 0.0, distance * term, 0.0))
    new_sum = tl.where(grew, sum_exp * term + 1.0, sum_exp + term)
    counts = s != float("-inf")  # NaN counts, so that it reaches the entropy as the spec's does
    return (tl.where(grew, s, top), tl.where(grew, cols, top_column), tl.where(counts, new_sum, sum_exp),
            tl.where(counts, new_weighted, sum_weighted))


@triton.jit
def _student_metrics_kernel(student_ptr, student_row_stride, labels_ptr, out_ptr, vocab_student, ignore_index,
                            x_scale, cap, logit_scale, CAP: tl.constexpr, BLOCK: tl.constexpr, STAGES: tl.constexpr):
    """out[row] = (entropy in nats of softmax(s / T), 1.0 where the label is the first largest s), with
    x = s log2(e) / T: H = log2(S) - W / S in bits, S = sum 2^(x - m), W = sum (x - m) 2^(x - m), m the row's max
    (the largest s times x_scale: a positive scale keeps the order)."""
    row = tl.program_id(0).to(tl.int64)
    student_row, valid, _, column = row_and_label(row, student_ptr, student_row_stride, labels_ptr, ignore_index, 0,
                                                  vocab_student, vocab_student)
    offsets = tl.arange(0, BLOCK)
    top = tl.full([BLOCK], float("-inf"), tl.float32)
    top_column = offsets  # a lane's first column, where a row all -inf has its first largest logit (torch.argmax's)
    sum_exp = tl.zeros([BLOCK], tl.float32)
    sum_weighted = tl.zeros([BLOCK], tl.float32)
    whole_blocks_stop = vocab_student - vocab_student % BLOCK
    for start in tl.range(0, whole_blocks_stop, BLOCK, num_stages=STAGES):
        cols = start + offsets
        s = load_logits(student_row, cols, None, logit_scale, cap, CAP, MASKED=False)
        top, top_column, sum_exp, sum_weighted = _online(top, top_column, sum_exp, sum_weighted, s, cols, x_scale)
    if whole_blocks_stop < vocab_student:  # the last, partial block: lanes past the row see -inf
        cols = whole_blocks_stop + offsets
        in_row = cols < vocab_student
        s = tl.where(in_row, load_logits(student_row, cols, in_row, logit_scale, cap, CAP), float("-inf"))
        top, top_column, sum_exp, sum_weighted = _online(top, top_column, sum_exp, sum_weighted, s, cols, x_scale)
    row_top = tl.max(top, axis=0)
    first_top = tl.min(tl.where(top == row_top, top_column, vocab_student), axis=0)
    shift = (top - row_top) * x_scale  # each lane's distances move by this to the row's max
    moved = tl.exp2(shift)
    # Not a lane that saw only -inf, or whose sums vanish beside the row's max; a NaN lane's (its max may be -inf) is
    # kept, so that the NaN reaches the entropy
    live = (moved > 0.0) | (sum_exp != sum_exp)
    total = tl.sum(tl.where(live, moved * sum_exp, 0.0), axis=0)
    weighted = tl.sum(tl.where(live, moved * (sum_weighted + shift * sum_exp), 0.0), axis=0)
    entropy = (tl.log2(total) - weighted / total) * LN2
    tl.store(out_ptr + 2 * row, tl.where(valid, entropy, 0.0))
    tl.store(out_ptr + 2 * row + 1, tl.where(valid & (first_top == column), 1.0, 0.0))


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
        STAGES=STAGES, num_warps=NUM_WARPS, **TRITON_OPTIONS)
