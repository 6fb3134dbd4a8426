"""Study: the row step reading every logit once, the row held on chip between its statistics and its gradient.

The library's row step (row_step_triton) reads each row's student and teacher logits twice, once for
the statistics and once for the gradient, and writes the gradient: 10 bytes per bf16 logit pair, at
the copy rate already (NOTES items 28, 47). Held on chip, a row costs 6. Two ways, both reusing the
library's jit functions for the label, the logits, the losses, the gradient's coefficients and the
gradient (no math of their own), for the plain case only: both heads over the same vocabulary, no
softcap or logit scale. A row whose sums overflow fp32 gets NaN losses and keeps its logits, as in the
library's first launch.

* ``cluster:CTAS:WARPS`` (NOTES item 50): one program per row whose tensors Triton splits over a
  cluster of CTAS CTAs (``num_ctas``), the reductions through distributed shared memory. Triton 3.9
  compiles it; Triton 3.6, the GPU machine's, refuses reductions across a cluster (s10j).
* ``slices:SLICE:WARPS`` (NOTES item 51): one program per (row, slice of SLICE columns) loads its slice
  in one go into registers, publishes the slice's partial statistics, waits until every slice of its
  row has, combines them and writes its slice's gradient from the registers. Item 38's sliced kernel
  read its slice a second time and spun hot on the row's counter; here nothing is read twice and a
  waiting program sleeps between polls (``nanosleep``). Programs take their (row, slice) from a ticket
  counter in the order they start (item 38's scheme): every ticket below a program's was taken by a
  program that is running or done, so only the newest row can be incomplete and the wait cannot
  deadlock while the GPU holds a row's slices at once. Triton's interpreter runs programs one after
  another, so there the halves run as two launches (the second reloads its slice). Every slice
  program stores the row's losses (the same values, from the same partials in the same order).

Predictions: NOTES items 50 and 51 (0.19 ms per 1024 rows at the copy rate; expected 0.22-0.32
against the library's 0.30).

    PYTHONPATH=src python benchmarks/one_read_row_step_study.py [--rows 2048] [--vocab 128256]
        [--configs slices:4096:4 slices:8192:8 cluster:8:16]
"""

import argparse
import time

import torch
import triton
import triton.language as tl

from cosdistill.api import row_step_scales
from cosdistill.bench import rel_err
from cosdistill.row_step import row_step_torch
from cosdistill.row_step_triton import (
    INTERPRET, _grad_block, _grad_coefficients, _load_logits, _loss_args, _overflowed, _row_and_label, _row_losses,
    row_step_triton,
)

SCALES = row_step_scales(0.5, 0.5, 0.5, 1.0, -100, None, None, 1.0, 1.0)
PARTIAL_STATS = tl.constexpr(6)  # max, sum of exp (against that max), the label's logit (0 if not in the slice), s.t, |s|^2, |t|^2


@triton.jit
def _sleep_a_little(x):
    """Returns x after a short nanosleep: the wait polls without spinning hot."""
    return tl.inline_asm_elementwise("nanosleep.u32 200;\n mov.u32 $0, $1;", "=r,r", [x], dtype=tl.int32,
                                     is_pure=False, pack=1)


@triton.jit
def _held_slice_row_step_kernel(
    student_ptr, teacher_ptr, row_stride, labels_ptr, losses_ptr, partials_ptr, counters_ptr, slices, vocab,
    ignore_index, weight_hard, weight_soft, beta, inv_temp_sq, eps,
    SLICE: tl.constexpr, SLICES_POW2: tl.constexpr, WAIT: tl.constexpr, STATS: tl.constexpr, GRAD: tl.constexpr,
    SLEEP: tl.constexpr,
):
    if WAIT:
        ticket = tl.atomic_add(counters_ptr, 1).to(tl.int64)
    else:
        ticket = tl.program_id(0).to(tl.int64)
    row = ticket // slices
    index = ticket % slices
    start = index * SLICE
    student_row, valid, in_shard, column = _row_and_label(
        row, student_ptr, row_stride, labels_ptr, ignore_index, 0, vocab, vocab)
    teacher_row = teacher_ptr + row * row_stride
    cols = start + tl.arange(0, SLICE)
    in_row = cols < vocab
    in_slice = in_shard & (column >= start) & (column < start + SLICE)
    s = _load_logits(student_row, cols, in_row, None, 1.0, False)  # the slice, once; 0 past the vocabulary
    t = _load_logits(teacher_row, cols, in_row, None, 1.0, False)
    partials_row = partials_ptr + row * slices * PARTIAL_STATS
    if STATS:
        part_max = tl.max(tl.where(in_row, s, float("-inf")), axis=0)
        mine = partials_row + index * PARTIAL_STATS
        tl.store(mine, part_max)
        tl.store(mine + 1, tl.sum(tl.where(in_row, tl.exp(s - part_max), 0.0), axis=0))
        tl.store(mine + 2, tl.sum(tl.where(cols == column, s, 0.0), axis=0))
        tl.store(mine + 3, tl.sum(s * t, axis=0))
        tl.store(mine + 4, tl.sum(s * s, axis=0))
        tl.store(mine + 5, tl.sum(t * t, axis=0))
    if WAIT:
        row_counter = counters_ptr + 1 + row
        tl.debug_barrier()  # every thread's stores before the release
        published = tl.atomic_add(row_counter, 1, sem="release") + 1
        while published < slices:
            if SLEEP:
                published = tl.atomic_add(row_counter, _sleep_a_little(tl.full([], 0, tl.int32)), sem="acquire")
            else:
                published = tl.atomic_add(row_counter, 0, sem="acquire")
    if GRAD:
        at = partials_row + tl.arange(0, SLICES_POW2) * PARTIAL_STATS
        present = tl.arange(0, SLICES_POW2) < slices
        maxes = tl.load(at, mask=present, other=float("-inf"), volatile=True)
        row_max = tl.max(maxes, axis=0)
        sum_exp = tl.sum(tl.load(at + 1, mask=present, other=0.0, volatile=True) * tl.exp(maxes - row_max), axis=0)
        target_logit = tl.sum(tl.load(at + 2, mask=present, other=0.0, volatile=True), axis=0)
        dot = tl.sum(tl.load(at + 3, mask=present, other=0.0, volatile=True), axis=0)
        sum_sq_student = tl.sum(tl.load(at + 4, mask=present, other=0.0, volatile=True), axis=0)
        sum_sq_teacher = tl.sum(tl.load(at + 5, mask=present, other=0.0, volatile=True), axis=0)
        _finish_row(student_row, teacher_row, losses_ptr + row * 2, s, t, cols, in_row, valid, in_slice, column,
                    row_max, sum_exp, target_logit, dot, sum_sq_student, sum_sq_teacher, weight_hard, weight_soft,
                    beta, inv_temp_sq, eps)


@triton.jit
def _row_step_on_chip_kernel(
    student_ptr, teacher_ptr, row_stride, labels_ptr, losses_ptr, vocab, ignore_index,
    weight_hard, weight_soft, beta, inv_temp_sq, eps, VOCAB_PAD: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    student_row, valid, in_shard, column = _row_and_label(
        row, student_ptr, row_stride, labels_ptr, ignore_index, 0, vocab, vocab)
    teacher_row = teacher_ptr + row * row_stride
    cols = tl.arange(0, VOCAB_PAD)
    in_row = cols < vocab
    s = _load_logits(student_row, cols, in_row, None, 1.0, False)  # the whole row, once; 0 past the vocabulary
    t = _load_logits(teacher_row, cols, in_row, None, 1.0, False)
    row_max = tl.max(tl.where(in_row, s, float("-inf")), axis=0)
    sum_exp = tl.sum(tl.where(in_row, tl.exp(s - row_max), 0.0), axis=0)
    target_logit = _load_logits(student_row, column, in_shard, None, 1.0, False)
    _finish_row(student_row, teacher_row, losses_ptr + row * 2, s, t, cols, in_row, valid, in_shard, column,
                row_max, sum_exp, target_logit, tl.sum(s * t, axis=0), tl.sum(s * s, axis=0), tl.sum(t * t, axis=0),
                weight_hard, weight_soft, beta, inv_temp_sq, eps)


@triton.jit
def _finish_row(student_row, teacher_row, losses_row, s, t, cols, in_row, valid, in_label_part, column, row_max,
                sum_exp, target_logit, dot, sum_sq_student, sum_sq_teacher, weight_hard, weight_soft, beta,
                inv_temp_sq, eps):
    """From the row's statistics: its losses, and the gradient of the held part ``s`` / ``t`` at ``cols``
    (the label's entry if ``in_label_part``), stored over the student logits."""
    usable = _overflowed(dot, sum_sq_student, sum_sq_teacher) == 0
    one = tl.full([], 1.0, tl.float32)
    log_sum_exp, norm_student, student_eps, clamped_student, clamped_teacher, cos = _row_losses(
        losses_row, valid, row_max, sum_exp, target_logit, dot, sum_sq_student, sum_sq_teacher, one, one, beta,
        inv_temp_sq, eps, usable)
    prob_coef, teacher_coef, student_coef = _grad_coefficients(
        sum_sq_student, sum_sq_teacher, one, one, norm_student, student_eps, clamped_student, clamped_teacher, cos,
        weight_hard, weight_soft, beta, inv_temp_sq, None, losses_row, False)
    grad = _grad_block(s, t, row_max, log_sum_exp, prob_coef, teacher_coef, student_coef, 1.0, False)
    t_label = _load_logits(teacher_row, column, in_label_part, None, 1.0, False)
    label_grad = _grad_block(target_logit, t_label, row_max, log_sum_exp, prob_coef, teacher_coef, student_coef, 1.0,
                             False, ONE_HOT=True)
    grad = tl.where(cols == column, label_grad, grad)
    grad = tl.where(valid, grad, 0.0)  # an ignored token: no gradient
    grad = tl.where(usable, grad, s)  # an overflowed row keeps its logits (s converts back exactly)
    tl.store(student_row + cols, grad.to(student_row.dtype.element_ty), mask=in_row)


def row_step_held_slices(student_logits, teacher_logits, labels, token_losses, slice_cols=8192, num_warps=8,
                         mode="wait"):
    """The plain case's row step (see the module docstring), overwriting student_logits with d L / d s.

    ``mode`` takes the kernel apart for timing (NOTES item 53): "wait" is the kernel itself; "spin" polls
    the row's counter without sleeping; "halves" runs the statistics and the gradient as two launches
    (the second reloads its slice: 10 bytes per logit pair, as the library's per-row kernel); "nowait"
    runs one launch that neither takes tickets nor waits, so its gradient reads partial statistics that
    may not be there yet: wrong results, timed only, the cost of the held data path without the wait.
    """
    rows, vocab = student_logits.shape
    slices = triton.cdiv(vocab, slice_cols)
    device = student_logits.device
    partials = torch.empty(rows * slices * PARTIAL_STATS.value, dtype=torch.float32, device=device)
    counters = torch.zeros(rows + 1, dtype=torch.int32, device=device)  # the ticket, then each row's
    args = (student_logits, teacher_logits, student_logits.stride(0), labels, token_losses, partials, counters, slices,
            vocab, SCALES.ignore_index, *_loss_args(SCALES)[:5])
    common = dict(SLICE=slice_cols, SLICES_POW2=triton.next_power_of_2(slices), num_warps=num_warps)
    if INTERPRET or mode == "halves":
        for halves in (dict(STATS=True, GRAD=False), dict(STATS=False, GRAD=True)):
            _held_slice_row_step_kernel[(rows * slices,)](*args, WAIT=False, **halves, SLEEP=False, **common)
    else:
        _held_slice_row_step_kernel[(rows * slices,)](
            *args, WAIT=mode != "nowait", STATS=True, GRAD=True, SLEEP=mode == "wait", **common)



def row_step_on_chip(student_logits, teacher_logits, labels, token_losses, num_ctas=8, num_warps=16):
    """The cluster's row step (see the module docstring), overwriting student_logits with d L / d s."""
    rows, vocab = student_logits.shape
    _row_step_on_chip_kernel[(rows,)](
        student_logits, teacher_logits, student_logits.stride(0), labels, token_losses, vocab, SCALES.ignore_index,
        *_loss_args(SCALES)[:5], VOCAB_PAD=triton.next_power_of_2(vocab), num_ctas=num_ctas, num_warps=num_warps)

def make_inputs(rows, vocab, device, ignored_every=7):
    student = torch.randn(rows, vocab, device=device, dtype=torch.bfloat16) * 3
    teacher = torch.randn(rows, vocab, device=device, dtype=torch.bfloat16) * 3
    labels = torch.randint(0, vocab, (rows,), device=device)
    labels[::ignored_every] = SCALES.ignore_index
    return student, teacher, labels


def check(step, student, teacher, labels):
    """(losses error, gradient error) of a row step against the torch step on the same logits."""
    want_grad, want_losses = student.clone(), torch.empty(len(labels), 2, device=student.device)
    row_step_torch(want_grad, teacher, labels, SCALES, want_losses, True)
    got_grad, got_losses = student.clone(), torch.full_like(want_losses, float("nan"))  # poisoned
    step(got_grad, teacher, labels, got_losses)
    return rel_err(got_losses, want_losses), rel_err(got_grad, want_grad)


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--rows", type=int, default=2048)
    parser.add_argument("--vocab", type=int, default=128256)
    parser.add_argument("--configs", nargs="+", default=["slices:4096:4", "slices:8192:8", "cluster:8:16"],
                        help="slices:SLICE:WARPS[:MODE] (MODE: wait, spin, halves, nowait) or cluster:CTAS:WARPS")
    parser.add_argument("--device", default="cuda")  # cpu: a check of the math in Triton's interpreter
    args = parser.parse_args()
    device = torch.device(args.device)
    student, teacher, labels = make_inputs(args.rows, args.vocab, device)

    def library(grad, teacher, labels, losses):
        row_step_triton(grad, teacher, labels, SCALES, losses, True)

    steps = {"library": library}
    launchers = dict(slices=row_step_held_slices, cluster=row_step_on_chip)
    for config in args.configs:
        kind, size, warps, *mode = config.split(":")
        steps[f"{kind} {size} x {warps} warps{''.join(' ' + m for m in mode)}"] = (
            lambda grad, teacher, labels, losses, launch=launchers[kind], size=int(size), warps=int(warps), mode=mode:
            launch(grad, teacher, labels, losses, size, warps, *mode))
    scratch, losses = student.clone(), torch.empty(args.rows, 2, device=device)
    copy_ms = triton.testing.do_bench(lambda: scratch.copy_(student), warmup=50, rep=300) if device.type == "cuda" else 0
    for name, step in steps.items():
        start = time.perf_counter()
        try:
            errors = check(step, student, teacher, labels)
        except Exception as error:  # a config the compiler or the launch refuses: say so, go on
            print(f"{name}: failed: {type(error).__name__}: {str(error)[:300]}", flush=True)
            continue
        line = f"{name}: losses err {errors[0]:.1e}, grad err {errors[1]:.1e}, first call {time.perf_counter() - start:.1f} s"
        if device.type == "cuda":
            ms = triton.testing.do_bench(lambda: (scratch.copy_(student), step(scratch, teacher, labels, losses)),
                                         warmup=50, rep=300, return_mode="median") - copy_ms
            line += f"; {ms:.3f} ms per {args.rows} rows ({ms * 1024 / args.rows:.3f} per 1024)"
        print(line, flush=True)


if __name__ == "__main__":
    main()
