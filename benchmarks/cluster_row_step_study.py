"""Study: the row step with each row held on chip by a cluster of CTAs, so every logit is read once.

The library's row step (row_step_triton) reads each row's student and teacher logits twice, once for
the statistics and once for the gradient, and writes the gradient: 10 bytes per bf16 logit pair, at
the copy rate already (NOTES items 28, 47). A row of the seed vocabulary (2 x 128256 bf16, 0.5 MB) fits
in no SM, but it fits in the registers of a thread-block cluster: with ``num_ctas = 8`` Triton splits
one program's tensors over 8 CTAs on 8 SMs and does the row's reductions through distributed shared
memory and cluster barriers (checked on the CPU: the sm_90 compile emits barrier.cluster and mapa, and
ptxas reports 122 registers at 16 warps, no spills). So one program loads the whole row once, reduces,
and writes the gradient from registers: 6 bytes per logit pair.

The kernel here reuses the library's jit functions for the label, the logits, the losses, the gradient's
coefficients and the gradient (no math of its own), for the plain case only: both heads over the same
vocabulary (at most VOCAB_PAD columns), no softcap or logit scale, bf16. Rows whose sums overflow fp32
get NaN losses and keep their logits, as in the library's first launch.

Prediction (NOTES item 50): 6 of 10 bytes. If the cluster streams at the copy rate, 0.19 ms per 1024
rows against the library's 0.32; but each SM holds one CTA (122 registers x 512 threads), so a row's
load, its reductions (cluster barriers) and its store run one after another with nothing to overlap
them, and ~16 rows are in flight machine-wide (128 of 132 SMs in clusters of 8). Expected 0.2-0.4 ms:
a gain only if the barriers cost less than the bytes saved.

Outcome (H200, s10j): Triton 3.6 cannot compile it (its cluster layout planning refuses reductions
across CTAs); Triton 3.9 can. Kept for a GPU machine with a newer Triton.

    PYTHONPATH=src python benchmarks/cluster_row_step_study.py [--rows 1024] [--vocab 128256] [--configs 8:16 8:8 4:16]
"""

import argparse
import time

import torch
import triton
import triton.language as tl

from cosdistill.row_step import row_step_torch
from cosdistill.api import row_step_scales
from cosdistill.row_step_triton import (
    _grad_block, _grad_coefficients, _load_logits, _loss_args, _overflowed, _row_and_label, _row_losses,
    row_step_triton,
)

SCALES = row_step_scales(0.5, 0.5, 0.5, 1.0, -100, None, None, 1.0, 1.0)


@triton.jit
def _row_step_on_chip_kernel(
    student_ptr, teacher_ptr, row_stride, labels_ptr, losses_ptr, vocab, ignore_index,
    weight_hard, weight_soft, beta, inv_temp_sq, eps, VOCAB_PAD: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    student_row, teacher_row, valid, in_shard, column = _row_and_label(
        row, student_ptr, row_stride, teacher_ptr, row_stride, labels_ptr, ignore_index, 0, vocab, vocab)
    cols = tl.arange(0, VOCAB_PAD)
    in_row = cols < vocab
    s = _load_logits(student_row, cols, in_row, None, 1.0, False)  # the whole row, once; 0 past the vocabulary
    t = _load_logits(teacher_row, cols, in_row, None, 1.0, False)
    row_max = tl.max(tl.where(in_row, s, float("-inf")), axis=0)
    sum_exp = tl.sum(tl.where(in_row, tl.exp(s - row_max), 0.0), axis=0)
    dot = tl.sum(s * t, axis=0)
    sum_sq_student = tl.sum(s * s, axis=0)
    sum_sq_teacher = tl.sum(t * t, axis=0)
    target_logit = _load_logits(student_row, column, in_shard, None, 1.0, False)
    usable = _overflowed(dot, sum_sq_student, sum_sq_teacher) == 0
    one = tl.full([], 1.0, tl.float32)
    log_sum_exp, norm_student, student_eps, clamped_student, clamped_teacher, cos = _row_losses(
        losses_ptr + row * 2, valid, row_max, sum_exp, target_logit, dot, sum_sq_student, sum_sq_teacher, one, one,
        beta, inv_temp_sq, eps, usable)
    prob_coef, teacher_coef, student_coef = _grad_coefficients(
        sum_sq_student, sum_sq_teacher, one, one, norm_student, student_eps, clamped_student, clamped_teacher, cos,
        weight_hard, weight_soft, beta, inv_temp_sq, None, losses_ptr, False)
    grad = _grad_block(s, t, row_max, log_sum_exp, prob_coef, teacher_coef, student_coef, 1.0, False)
    t_label = _load_logits(teacher_row, column, in_shard, None, 1.0, False)
    label_grad = _grad_block(target_logit, t_label, row_max, log_sum_exp, prob_coef, teacher_coef, student_coef, 1.0,
                             False, ONE_HOT=True)
    grad = tl.where(cols == column, label_grad, grad)
    grad = tl.where(valid, grad, 0.0)  # an ignored token: no gradient
    grad = tl.where(usable, grad, s)  # an overflowed row keeps its logits (s converts back exactly)
    tl.store(student_row + cols, grad.to(student_ptr.dtype.element_ty), mask=in_row)


def row_step_on_chip(student_logits, teacher_logits, labels, token_losses, num_ctas=8, num_warps=16):
    """The plain case's row step (see the module docstring), overwriting student_logits with d L / d s."""
    rows, vocab = student_logits.shape
    weight_hard, weight_soft, beta, inv_temp_sq, eps = _loss_args(SCALES)[:5]
    _row_step_on_chip_kernel[(rows,)](
        student_logits, teacher_logits, student_logits.stride(0), labels, token_losses, vocab, SCALES.ignore_index,
        weight_hard, weight_soft, beta, inv_temp_sq, eps, VOCAB_PAD=triton.next_power_of_2(vocab),
        num_ctas=num_ctas, num_warps=num_warps)


def rel_err(got, want):
    return ((got.double() - want.double()).norm() / want.double().norm()).item()


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
    parser.add_argument("--rows", type=int, default=1024)
    parser.add_argument("--vocab", type=int, default=128256)
    parser.add_argument("--configs", nargs="+", default=["8:16", "8:8", "4:16"], help="NUM_CTAS:WARPS")
    parser.add_argument("--device", default="cuda")  # cpu: a check of the math in Triton's interpreter
    args = parser.parse_args()
    device = torch.device(args.device)
    student, teacher, labels = make_inputs(args.rows, args.vocab, device)

    def library(grad, teacher, labels, losses):
        row_step_triton(grad, teacher, labels, SCALES, losses, True)

    steps = {"library": library}
    for config in args.configs:
        num_ctas, warps = (int(part) for part in config.split(":"))
        steps[f"on chip {num_ctas} CTAs x {warps} warps"] = (
            lambda grad, teacher, labels, losses, num_ctas=num_ctas, warps=warps:
            row_step_on_chip(grad, teacher, labels, losses, num_ctas, warps))
    scratch, losses = student.clone(), torch.empty(args.rows, 2, device=device)
    copy_ms = triton.testing.do_bench(lambda: scratch.copy_(student), warmup=50, rep=300) if device.type == "cuda" else 0
    for name, step in steps.items():
        start = time.perf_counter()
        try:
            errors = check(step, student, teacher, labels)
        except Exception as error:  # a config the compiler or the launch refuses: say so, go on
            print(f"{name}: failed: {type(error).__name__}: {str(error)[:300]}", flush=True)
            continue
        first_s = time.perf_counter() - start
        line = f"{name}: losses err {errors[0]:.1e}, grad err {errors[1]:.1e}, first call {first_s:.1f} s"
        if device.type == "cuda":
            ms = triton.testing.do_bench(lambda: (scratch.copy_(student), step(scratch, teacher, labels, losses)),
                                         warmup=50, rep=300, return_mode="median") - copy_ms
            line += f"; {ms:.3f} ms per {args.rows} rows ({ms * 1024 / args.rows:.3f} per 1024)"
        print(line, flush=True)


if __name__ == "__main__":
    main()
