"""Study: can the row step's second pass read its logits from L2 instead of HBM?

The fused row step streams each row twice (statistics, then the gradient): 5 buffer passes, 1.31 GB
per 1024 rows at the seed vocabulary, and it runs at the copy rate (benchmarks/NOTES.md item 2). With
one program per row, all 1024 rows are in flight at once, so 526 MB are touched between a logit's two
reads and the second read comes from HBM. Two changes could make it an L2 hit (H200: 50 MB of L2):

* persistent programs (a grid of P programs, each looping over rows): only P rows, P * 513 KB, are in
  flight; P = 66 would be 34 MB.
* REVERSE: the gradient pass walks the row backwards, so the blocks the statistics read last are read
  again first.

Prediction (written before the run): REVERSE alone on the current grid saves ~5% (each row's share of
L2 is ~50 KB of its 513 KB); persistent P <= 132 with REVERSE saves up to ~30% (0.39 -> ~0.28 ms) *if*
P programs can pull the bandwidth, which with 4 warps each they likely cannot (8-16 programs per SM
are what keep enough loads in flight today); so the likely outcome is a loss for small P at 4 warps,
and a small gain at most for larger blocks / more warps. Each variant's output is checked against the
library's row step before it is timed.

    PYTHONPATH=src python benchmarks/l2_study.py [--rows 1024] [--vocab 128256] [--json out.json]
"""

import argparse
import json

import torch
import triton
import triton.language as tl
import triton.testing

from cosdistill.row_step import COSINE_EPS, RowStepScales
from cosdistill.row_step_triton import (_overflowed, _row_and_label, _row_losses_and_grad, _row_stats,
                                        row_step_triton)


@triton.jit
def _persistent_row_step_kernel(
    student_ptr, student_row_stride, teacher_ptr, teacher_row_stride, labels_ptr, losses_ptr, rows,
    vocab_student, vocab_teacher, ignore_index, weight_hard, weight_soft, beta, inv_temp_sq, eps,
    REVERSE: tl.constexpr, BLOCK: tl.constexpr,
):
    """The library's first launch (no softcap, no logit scale, no split), P programs looping over rows."""
    for row_index in range(tl.program_id(0), rows, tl.num_programs(0)):
        row = row_index + tl.zeros([], tl.int64)
        student_row, teacher_row, valid, in_shard, column = _row_and_label(
            row, student_ptr, student_row_stride, teacher_ptr, teacher_row_stride, labels_ptr, ignore_index,
            0, vocab_student, vocab_student,
        )
        row_max, sum_exp, target_logit, dot, sum_sq_student, sum_sq_teacher, student_unit, teacher_unit = _row_stats(
            student_row, teacher_row, in_shard, column, vocab_student, vocab_teacher, 1.0, 1.0, 1.0, 1.0,
            False, False, False, BLOCK,
        )
        usable = _overflowed(dot, sum_sq_student, sum_sq_teacher) == 0
        _row_losses_and_grad(
            student_row, teacher_row, losses_ptr + row * 2, valid, in_shard, column, vocab_student,
            row_max, sum_exp, target_logit, dot, sum_sq_student, sum_sq_teacher, student_unit, teacher_unit,
            weight_hard, weight_soft, beta, inv_temp_sq, eps, 1.0, 1.0, 1.0, 1.0, usable, False, False, True, BLOCK,
            REVERSE,
        )


def persistent_row_step(student, teacher, labels, scales: RowStepScales, losses, programs, reverse, block, warps):
    rows, vocab = student.shape
    _persistent_row_step_kernel[(min(programs, rows),)](
        student, student.stride(0), teacher, teacher.stride(0), labels, losses, rows, vocab, teacher.shape[1],
        scales.ignore_index, scales.weight_hard, scales.weight_soft, scales.beta,
        1.0 / scales.temperature**2, COSINE_EPS, REVERSE=reverse, BLOCK=block, num_warps=warps,
    )


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--rows", type=int, default=1024)
    parser.add_argument("--vocab", type=int, default=128256)
    parser.add_argument("--json")
    args = parser.parse_args()
    rows, vocab = args.rows, args.vocab
    torch.manual_seed(0)
    student = torch.randn(rows, vocab, device="cuda", dtype=torch.bfloat16) * 3
    teacher = torch.randn(rows, vocab, device="cuda", dtype=torch.bfloat16) * 3
    labels = torch.randint(0, vocab, (rows,), device="cuda")
    scales = RowStepScales(0.5, 0.5, 0.5, 1.0, -100)
    scratch, losses = student.clone(), torch.empty(rows, 2, device="cuda")
    expected_losses = torch.empty(rows, 2, device="cuda")
    row_step_triton(scratch, teacher, labels, scales, expected_losses, True)
    expected_grad = scratch.clone()
    copy_ms = triton.testing.do_bench(lambda: scratch.copy_(student), warmup=50, rep=200, return_mode="median")

    variants = {"library (grid = rows)": lambda: row_step_triton(scratch, teacher, labels, scales, losses, True)}
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    for programs in (sms // 2, sms, 2 * sms, 4 * sms, rows):
        for reverse in (False, True):
            for block, warps in ((1024, 4), (2048, 8), (4096, 8), (4096, 16)):
                if programs == rows and (block, warps) != (1024, 4):
                    continue
                variants[f"P={programs} reverse={reverse} block={block} warps={warps}"] = (
                    lambda p=programs, r=reverse, b=block, w=warps:
                    persistent_row_step(scratch, teacher, labels, scales, losses, p, r, b, w))

    results = []
    bytes_moved = 5 * rows * vocab * student.element_size()
    for name, run in variants.items():
        scratch.copy_(student)
        losses.fill_(float("nan"))
        run()
        grad_err = ((scratch.float() - expected_grad.float()).norm() / expected_grad.float().norm()).item()
        loss_err = ((losses - expected_losses).norm() / expected_losses.norm()).item()

        def step(run=run):
            scratch.copy_(student)  # the step overwrites its input: time the copy apart and subtract it
            run()

        step_ms = triton.testing.do_bench(step, warmup=50, rep=300, return_mode="median") - copy_ms
        row = dict(variant=name, ms=round(step_ms, 4), tbps=round(bytes_moved / step_ms / 1e9, 2),
                   grad_err=grad_err, loss_err=loss_err)
        print(row, flush=True)
        results.append(row)
    if args.json:
        with open(args.json, "w") as file:
            json.dump(dict(rows=rows, vocab=vocab, copy_ms=copy_ms, results=results), file, indent=1)


if __name__ == "__main__":
    main()
