"""Time the Triton row step alone on one chunk, for several block sizes and warp counts, and (if given)
another implementation of row_step_triton with the same signature, e.g. an earlier commit's, for an A/B.

Bytes counted: pass 1 reads s and t, pass 2 reads s and t and writes s: 5 * rows * V * itemsize.
Compared with a device-to-device copy of the same buffers (read + write counted).

    PYTHONPATH=src python benchmarks/row_step_bench.py [--rows 1024] [--vocab 128256] [--other FILE]
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
    parser.add_argument("--other", help="a file defining row_step_triton (same signature), timed beside this one")
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
    impls = [("this", row_step_triton)] + ([("other", load_other(args.other))] if args.other else [])
    for write_grad, passes, configs in ((True, 5, ((1024, 4), (2048, 2), (2048, 4), (4096, 4), (2048, 8), (4096, 8))),
                                        (False, 2, ((2048, 4), (2048, 8), (4096, 8), (2048, 16), (4096, 16)))):
        for name, step in impls:
            for block, warps in (None, None), *configs:
                if write_grad:  # the step overwrites its input: time it with a copy, subtract the copy
                    ms = timed(lambda: (scratch.copy_(student), step(scratch, teacher, labels, scales, losses, True,
                                                                      block_size=block, num_warps=warps))) - copy_ms
                else:
                    ms = timed(lambda: step(student, teacher, labels, scales, losses, False, block_size=block,
                                            num_warps=warps))
                setting = "defaults" if block is None else f"block={block:5d} warps={warps:2d}"
                print(f"{'row step' if write_grad else 'loss only'} {name} {setting}: {ms:.3f} ms, "
                      f"{passes * one_pass / ms / 1e9:.2f} TB/s", flush=True)


if __name__ == "__main__":
    main()
