"""Time the Triton row step alone on one chunk: the sliced kernel over slice widths and warp counts,
and (if given) another implementation of row_step_triton, e.g. an earlier commit's, for an A/B.

HBM bytes per call: the sliced kernel reads s and t once and writes s: 3 * rows * V * itemsize (the
two-pass per-row kernel of earlier commits moved 5 * rows * V * itemsize). Compared with a
device-to-device copy of the same buffers (read + write counted).

    PYTHONPATH=src python benchmarks/row_step_bench.py [--rows 1024] [--vocab 128256] [--other MODULE_PATH]
"""

import argparse
import importlib.util

import torch
import triton.testing

from cosdistill.row_step import RowStepScales
from cosdistill.row_step_triton import row_step_triton


def load_other(path):
    spec = importlib.util.spec_from_file_location("other_row_step", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module.row_step_triton


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--rows", type=int, default=1024)
    parser.add_argument("--vocab", type=int, default=128256)
    parser.add_argument("--other", help="a file defining row_step_triton with the same signature (A/B)")
    parser.add_argument("--slices", default="4096,8192,16384,32768")
    parser.add_argument("--warps", default="2,4,8", help="each with a block of 256 columns per warp")
    args = parser.parse_args()
    rows, vocab = args.rows, args.vocab
    student = torch.randn(rows, vocab, device="cuda", dtype=torch.bfloat16) * 3
    teacher = torch.randn(rows, vocab, device="cuda", dtype=torch.bfloat16) * 3
    labels = torch.randint(0, vocab, (rows,), device="cuda")
    losses = torch.empty(rows, 2, device="cuda")
    scales = RowStepScales(0.5, 0.5, 0.5, 1.0, -100)
    scratch = student.clone()
    one_pass = rows * vocab * student.element_size()

    def timed(fn):
        return triton.testing.do_bench(fn, warmup=50, rep=300, return_mode="median")

    copy_ms = timed(lambda: scratch.copy_(student))
    print(f"copy of one buffer: {copy_ms:.3f} ms, {2 * one_pass / copy_ms / 1e9:.2f} TB/s")

    def report(name, step, passes, write_grad):
        if write_grad:  # the step overwrites its input: time the copy with it, subtract it
            ms = timed(lambda: (scratch.copy_(student), step(scratch))) - copy_ms
        else:
            ms = timed(lambda: step(student))
        print(f"{name}: {ms:.3f} ms, {passes * one_pass / ms / 1e9:.2f} TB/s")

    impls = [("sliced", row_step_triton)] + ([("other", load_other(args.other))] if args.other else [])
    for write_grad, passes in ((True, 3), (False, 2)):
        mode = "row step" if write_grad else "loss only"
        if args.other:
            report(f"{mode} other (defaults)", lambda x: impls[1][1](x, teacher, labels, scales, losses, write_grad),
                   5 if write_grad else 2, write_grad)
        report(f"{mode} sliced (defaults)", lambda x: row_step_triton(x, teacher, labels, scales, losses, write_grad),
               passes, write_grad)
        for slice_size in map(int, args.slices.split(",")):
            for warps in map(int, args.warps.split(",")):
                for tickets in (True, False) if write_grad else (True,):
                    report(f"{mode} sliced slice={slice_size:5d} warps={warps:2d} tickets={tickets}",
                           lambda x: row_step_triton(x, teacher, labels, scales, losses, write_grad,
                                                     block_size=256 * warps, slice_size=slice_size, num_warps=warps,
                                                     tickets=tickets),
                           passes, write_grad)


if __name__ == "__main__":
    main()
