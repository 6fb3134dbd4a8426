"""Time the Triton row step alone on one chunk, for several block sizes, warp counts and prefetch stages
(``--stages``), and (if given)
another implementation of row_step_triton with the same signature, e.g. an earlier commit's, for an A/B.

Bytes counted: pass 1 reads s and t, pass 2 reads s and t and writes s: 5 * rows * V * itemsize.
Compared with a device-to-device copy of the same buffers (read + write counted). Each setting's
losses and gradient are first checked against the torch row step (relative error printed).

    PYTHONPATH=src python benchmarks/row_step_bench.py [--rows 1024] [--vocab 128256] [--softcap 30] [--stages 1 3]
        [--configs 2048:4] [--other FILE]
"""

import argparse
import functools
import importlib.util
import inspect

import torch
import triton.testing

from cosdistill._row_step import RowStepScales, row_step_torch
from cosdistill.kernels.row_step_triton import row_step_triton
from cosdistill.testing import rel_err


def load_other(path):
    spec = importlib.util.spec_from_file_location("other_row_step", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module.row_step_triton


def sweep(impls, parameter, label, values):
    """Each implementation at each value of ``parameter`` (None: its default); one that lacks the
    parameter runs once, at its own setting."""
    if values == [None]:
        return impls
    swept = []
    for name, step in impls:
        if parameter in inspect.signature(step).parameters:
            swept += [(f"{name} {label}={value}", functools.partial(step, **{parameter: value})) if value else (name, step)
                      for value in values]
        else:
            swept.append((name, step))
    return swept


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--rows", type=int, default=1024)
    parser.add_argument("--vocab", type=int, default=128256)
    parser.add_argument("--softcap", type=float, help="both heads' logit softcap (Gemma-2: 30); default none")
    parser.add_argument("--other", help="a file defining row_step_triton (same signature), timed beside this one")
    parser.add_argument("--stages", type=int, nargs="+", default=[None],
                        help="num_stages settings swept (default: each kernel's own); an --other without the "
                             "argument runs once")
    parser.add_argument("--configs", nargs="+", help="BLOCK:WARPS settings for both modes (default: a sweep each)")
    args = parser.parse_args()
    rows, vocab = args.rows, args.vocab
    student = torch.randn(rows, vocab, device="cuda", dtype=torch.bfloat16) * 3
    teacher = torch.randn(rows, vocab, device="cuda", dtype=torch.bfloat16) * 3
    labels = torch.randint(0, vocab, (rows,), device="cuda")
    losses = torch.empty(rows, 2, device="cuda")
    scales = RowStepScales(0.5, 0.5, 0.5, 1.0, -100, student_softcap=args.softcap, teacher_softcap=args.softcap)
    scratch = student.clone()
    one_pass = rows * vocab * student.element_size()

    def timed(fn):
        return triton.testing.do_bench(fn, warmup=50, rep=300, return_mode="median")

    want_grad, want_losses = student.clone(), torch.empty_like(losses)
    row_step_torch(want_grad, teacher, labels, scales, want_losses, True)
    want_loss_only = torch.empty_like(losses)
    row_step_torch(student.clone(), teacher, labels, scales, want_loss_only, False)

    def error(step, write_grad, block, warps):
        scratch.copy_(student)
        losses.fill_(float("nan"))  # poisoned: every row must be written
        step(scratch, teacher, labels, scales, losses, write_grad, block_size=block, num_warps=warps)
        if not write_grad:
            return rel_err(losses, want_loss_only)
        return max(rel_err(losses, want_losses), rel_err(scratch.float(), want_grad.float()))

    copy_ms = timed(lambda: scratch.copy_(student))
    print(f"copy of one buffer: {copy_ms:.3f} ms, {2 * one_pass / copy_ms / 1e9:.2f} TB/s")
    impls = [("this", row_step_triton)] + ([("other", load_other(args.other))] if args.other else [])
    impls = sweep(impls, "num_stages", "stages", args.stages)
    grad_configs = ((1024, 4), (2048, 2), (2048, 4), (4096, 4), (2048, 8), (4096, 8))
    loss_configs = ((2048, 4), (2048, 8), (4096, 8), (2048, 16), (4096, 16))
    if args.configs:
        grad_configs = loss_configs = [tuple(int(part) for part in config.split(":")) for config in args.configs]
    for write_grad, passes, configs in ((True, 5, grad_configs), (False, 2, loss_configs)):
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
                      f"{passes * one_pass / ms / 1e9:.2f} TB/s, rel err {error(step, write_grad, block, warps):.1e}",
                      flush=True)


if __name__ == "__main__":
    main()
