"""Time the Triton row step alone on one chunk, for several block sizes and warp counts.

Bytes counted: pass 1 reads s and t, pass 2 reads s and t and writes s: 5 * rows * V * itemsize.
Compared with a device-to-device copy of the same buffers (read + write counted).

    PYTHONPATH=src python benchmarks/row_step_bench.py [--rows 1024] [--vocab 128256]
"""

import argparse

import torch
import triton.testing

from cosdistill.row_step import RowStepScales
from cosdistill.row_step_triton import row_step_triton


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--rows", type=int, default=1024)
    parser.add_argument("--vocab", type=int, default=128256)
    args = parser.parse_args()
    rows, vocab = args.rows, args.vocab
    student = torch.randn(rows, vocab, device="cuda", dtype=torch.bfloat16) * 3
    teacher = torch.randn(rows, vocab, device="cuda", dtype=torch.bfloat16) * 3
    labels = torch.randint(0, vocab, (rows,), device="cuda")
    losses = torch.empty(rows, 2, device="cuda")
    scales = RowStepScales(0.5, 0.5, 0.5, 1.0, -100)
    scratch = student.clone()
    bytes_moved = 5 * rows * vocab * student.element_size()

    copy_ms = triton.testing.do_bench(lambda: scratch.copy_(student), warmup=50, rep=200, return_mode="median")
    copy_tbps = 2 * student.numel() * student.element_size() / copy_ms / 1e9
    print(f"copy of one buffer: {copy_ms:.3f} ms, {copy_tbps:.2f} TB/s")
    for block in (1024, 2048, 4096, 8192):
        for warps in (4, 8, 16):
            if block // (32 * warps) < 1:
                continue

            def step():
                scratch.copy_(student)  # the step overwrites its input; time the copy apart and subtract
                row_step_triton(scratch, teacher, labels, scales, losses, True, block_size=block, num_warps=warps)

            total_ms = triton.testing.do_bench(step, warmup=50, rep=300, return_mode="median")
            step_ms = total_ms - copy_ms
            print(f"row step block={block:5d} warps={warps:2d}: {step_ms:.3f} ms, {bytes_moved / step_ms / 1e9:.2f} TB/s")
    for block in (1024, 2048, 4096):
        for warps in (4, 8, 16):
            loss_only_ms = triton.testing.do_bench(
                lambda: row_step_triton(student, teacher, labels, scales, losses, False, block_size=block, num_warps=warps),
                warmup=50, rep=300, return_mode="median")
            print(f"loss only (no grad) block={block:5d} warps={warps:2d}: {loss_only_ms:.3f} ms, "
                  f"{2 * rows * vocab * 2 / loss_only_ms / 1e9:.2f} TB/s")


if __name__ == "__main__":
    main()
