"""Study: the row step in vocabulary slices whose second read comes from L2, with prefetched loads.

The library's row step (row_step_triton.py) runs one program per row: it streams the row's 0.51 MB
of student and teacher logits for the statistics, then again for the gradient, 1.31 GB of HBM
traffic per 1024 rows at the seed vocabulary, at 98% of the copy rate (0.322 ms, NOTES item 28).
Here one program per (row, slice of SLICE columns): it streams its slice for the partial statistics,
publishes them, waits until every slice of its row has (a per-row counter; programs take their
(row, slice) from a ticket counter in the order they start, so every program a row waits for is
running or done), combines the partials and streams its slice again for the gradient. The second
read follows the first by microseconds: ~528 programs x 2 x SLICE x 2 bytes in flight (17 MB at
SLICE 8192) fit the 50 MB L2, so HBM moves ~0.79 GB per 1024 rows (read once, write once) and L2
the other 0.53 GB. Items 21 and 23 tried slices before the prefetch of item 28, when the step was
bound by the bytes each SM kept in flight (0.377 ms against 0.387, item 23); item 31's backward
walk for L2 reuse cost 25%.

The statistics and the gradient are the library's own jit functions (_row_stats on a slice,
_row_losses_and_grad on a slice with the combined statistics): no math is written here. Hot path
only: no overflow rescue (random logits of order 3 never overflow), no lifts (bf16), Vs = Vt.

Prediction: 0.20-0.26 ms per 1024 rows against 0.322 (HBM-bound at ~0.79 GB if the L2 re-reads
overlap; the wait costs each program a few microseconds), i.e. -0.06..-0.12 ms per 1024 rows,
-1.5..-3% of the seed floor (V = 262144 / H = 2048: -3..-6%). Range 0.20-0.40: it may also lose,
as item 31 did, if the re-read pattern defeats the prefetch or the wait idles the SMs.

    PYTHONPATH=src python benchmarks/sliced_row_step_study.py [--rows 1024] [--vocab 128256]
        [--configs SLICE:BLOCK:WARPS:STAGES ...]

On the CPU (Triton's interpreter runs programs one after another, so no program may wait for
another) the two halves run as two launches; tests/test_sliced_row_step_study.py checks them.
"""

import argparse
import os

import torch
import triton
import triton.language as tl

from cosdistill.bench import rel_err
from cosdistill.row_step import RowStepScales, row_step_torch
from cosdistill.row_step_triton import (_caps, _loss_args, _overflowed, _row_and_label, _row_losses_and_grad,
                                        _row_stats, row_step_triton)

# jit globals must be constexprs (the launcher reads .value)
PARTIALS: tl.constexpr = tl.constexpr(6)  # max, sum of exp (relative to that max), target logit, s.t, |s|^2, |t|^2
BOTH: tl.constexpr = tl.constexpr(0)  # PHASE: one launch, each program waits for its row's slices
STATS_ONLY: tl.constexpr = tl.constexpr(1)  # the first half alone (Triton's interpreter)
GRAD_ONLY: tl.constexpr = tl.constexpr(2)  # the second half alone


@triton.jit
def _sliced_kernel(
    student_ptr, student_row_stride, teacher_ptr, teacher_row_stride, labels_ptr, losses_ptr, partials_ptr,
    counters_ptr, vocab, slices, ignore_index, weight_hard, weight_soft, beta, inv_temp_sq, eps, student_cap,
    teacher_cap, student_scale, teacher_scale, STUDENT_CAP: tl.constexpr, TEACHER_CAP: tl.constexpr,
    PHASE: tl.constexpr, SLICE: tl.constexpr, SLICES_POW2: tl.constexpr, BLOCK: tl.constexpr,
    STAGES: tl.constexpr,
):
    if PHASE == BOTH:  # (row, slice) in start order: what a program waits for is running or done
        ticket = tl.atomic_add(counters_ptr, 1).to(tl.int64)
    else:
        ticket = tl.program_id(0).to(tl.int64)
    row = ticket // slices
    start = (ticket % slices) * SLICE
    width = tl.minimum(vocab - start, SLICE)
    student_row, teacher_row, valid, in_shard, column = _row_and_label(
        row, student_ptr, student_row_stride, teacher_ptr, teacher_row_stride, labels_ptr, ignore_index, 0, vocab,
        vocab)
    in_slice = in_shard & (column >= start) & (column < start + width)
    partials_row = partials_ptr + row * slices * PARTIALS
    row_counter = counters_ptr + 1 + row
    if PHASE != GRAD_ONLY:
        part_max, part_sum_exp, part_target, part_dot, part_ss, part_tt, _, _ = _row_stats(
            student_row + start, teacher_row + start, in_slice, column - start, width, width, student_scale,
            teacher_scale, student_cap, teacher_cap, STUDENT_CAP, TEACHER_CAP, False, BLOCK, STAGES)
        mine = partials_row + (start // SLICE) * PARTIALS
        tl.store(mine, part_max)
        tl.store(mine + 1, part_sum_exp)
        tl.store(mine + 2, part_target)  # 0 unless the label lies in this slice (a masked load)
        tl.store(mine + 3, part_dot)
        tl.store(mine + 4, part_ss)
        tl.store(mine + 5, part_tt)
    if PHASE == BOTH:
        tl.debug_barrier()  # every thread's stores before the release
        published = tl.atomic_add(row_counter, 1, sem="release") + 1
        while published < slices:
            published = tl.atomic_add(row_counter, 0, sem="acquire")
    if PHASE != STATS_ONLY:
        index = tl.arange(0, SLICES_POW2)
        present = index < slices
        at = partials_row + index * PARTIALS
        maxes = tl.load(at, mask=present, other=float("-inf"), volatile=True)
        row_max = tl.max(maxes, axis=0)
        sum_exp = tl.sum(tl.load(at + 1, mask=present, other=0.0, volatile=True) * tl.exp(maxes - row_max), axis=0)
        target = tl.sum(tl.load(at + 2, mask=present, other=0.0, volatile=True), axis=0)
        dot = tl.sum(tl.load(at + 3, mask=present, other=0.0, volatile=True), axis=0)
        sum_sq_student = tl.sum(tl.load(at + 4, mask=present, other=0.0, volatile=True), axis=0)
        sum_sq_teacher = tl.sum(tl.load(at + 5, mask=present, other=0.0, volatile=True), axis=0)
        one = tl.full([], 1.0, tl.float32)
        _row_losses_and_grad(
            student_row + start, teacher_row + start, losses_ptr + row * 2, valid, in_slice, column - start, width,
            row_max, sum_exp, target, dot, sum_sq_student, sum_sq_teacher, one, one,
            weight_hard, weight_soft, beta, inv_temp_sq, eps, student_scale, teacher_scale, student_cap, teacher_cap,
            _overflowed(dot, sum_sq_student, sum_sq_teacher) == 0, losses_ptr, STUDENT_CAP, TEACHER_CAP, True, False,
            BLOCK, STAGES)


def sliced_row_step(student_logits, teacher_logits, labels, scales: RowStepScales, token_losses, slice_cols=8192,
                    block_size=2048, num_warps=8, num_stages=6, sync=None) -> None:
    """The row step with gradient, in slices (see the module docstring). ``sync`` (default: on a GPU)
    runs one launch whose programs wait for their row; without it, the two halves run as two launches."""
    rows, vocab = student_logits.shape
    if teacher_logits.shape != student_logits.shape:
        raise ValueError(f"the study needs Vs = Vt, got {tuple(student_logits.shape)} and {tuple(teacher_logits.shape)}")
    if slice_cols % block_size:
        raise ValueError(f"slice_cols ({slice_cols}) must be a multiple of block_size ({block_size})")
    if rows == 0:
        return
    slices = triton.cdiv(vocab, slice_cols)
    if slices > 64:  # resident programs must cover 2 * slices - 1 tickets: no deadlock
        raise ValueError(f"{slices} slices per row; at most 64 (slice_cols >= vocab / 64)")
    sync = student_logits.is_cuda and os.environ.get("TRITON_INTERPRET") != "1" if sync is None else sync
    partials = torch.empty(rows, slices, PARTIALS.value, dtype=torch.float32, device=student_logits.device)
    counters = torch.zeros(rows + 1, dtype=torch.int32, device=student_logits.device)  # the ticket, then each row's
    args = (student_logits, student_logits.stride(0), teacher_logits, teacher_logits.stride(0), labels, token_losses,
            partials, counters, vocab, slices, scales.ignore_index, *_loss_args(scales))
    meta = dict(**_caps(scales), SLICE=slice_cols, SLICES_POW2=triton.next_power_of_2(slices), BLOCK=block_size,
                STAGES=num_stages, num_warps=num_warps)
    for phase in (BOTH,) if sync else (STATS_ONLY, GRAD_ONLY):
        _sliced_kernel[(rows * slices,)](*args, PHASE=phase.value, **meta)


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--rows", type=int, default=1024)
    parser.add_argument("--vocab", type=int, default=128256)
    parser.add_argument("--configs", nargs="+", default=["4096:2048:8:6", "8192:2048:8:6", "16384:2048:8:6",
                                                          "8192:2048:4:4", "8192:1024:4:6", "16384:2048:8:4"],
                        help="SLICE:BLOCK:WARPS:STAGES")
    args = parser.parse_args()
    rows, vocab = args.rows, args.vocab
    student = torch.randn(rows, vocab, device="cuda", dtype=torch.bfloat16) * 3
    teacher = torch.randn(rows, vocab, device="cuda", dtype=torch.bfloat16) * 3
    labels = torch.randint(0, vocab, (rows,), device="cuda")
    labels[::7] = -100
    scales = RowStepScales(0.5, 0.5, 0.5, 1.0, -100)
    want_grad, want_losses = student.clone(), torch.empty(rows, 2, device="cuda")
    row_step_torch(want_grad, teacher, labels, scales, want_losses, True)
    scratch, losses = student.clone(), torch.empty(rows, 2, device="cuda")

    def timed(step):
        def call():
            scratch.copy_(student)
            step()
        copy_ms = triton.testing.do_bench(lambda: scratch.copy_(student), warmup=50, rep=300, return_mode="median")
        return triton.testing.do_bench(call, warmup=50, rep=300, return_mode="median") - copy_ms

    print(f"rows {rows}, vocab {vocab}, bf16; each checked against the torch row step first (rel err losses / grad)")
    library = lambda: row_step_triton(scratch, teacher, labels, scales, losses, True)  # noqa: E731
    steps = [("library row step", library)]
    for config in args.configs:
        slice_cols, block, warps, stages = (int(part) for part in config.split(":"))
        steps.append((f"sliced {config}", lambda s=slice_cols, b=block, w=warps, n=stages: sliced_row_step(
            scratch, teacher, labels, scales, losses, slice_cols=s, block_size=b, num_warps=w, num_stages=n)))
    for name, step in steps:
        scratch.copy_(student)
        losses.fill_(float("nan"))
        step()
        errors = (rel_err(losses, want_losses), rel_err(scratch, want_grad))
        ms = timed(step) if max(errors) < 1e-2 else float("nan")
        print(f"{name:28s} {ms:7.3f} ms per {rows} rows   rel err {errors[0]:.1e} / {errors[1]:.1e}")


if __name__ == "__main__":
    main()
