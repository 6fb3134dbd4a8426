"""Correctness on a CUDA GPU before any timing is trusted.

1. The Triton row step against the torch row step (the spec) at odd sizes, poisoned outputs.
2. The whole loss (impl="triton") against the float64 naive reference at a few odd shapes.
3. At the seed workload (V = 128256, H = 4096, student H/2, bf16, T = 8192 by default): the error of
   losses and gradients against float64 for each grad_weight accumulator dtype, and the peak memory
   above the inputs, to pick the default accum_dtype.

    PYTHONPATH=src python benchmarks/gpu_check.py [--seed-tokens 8192] [--json out.json]
"""

import argparse
import json

import torch

from cosdistill import fp8, fused_linear_cosine_distill
from cosdistill.reference import naive_cosine_distill
from cosdistill.row_step import RowStepScales, row_step_torch
from cosdistill.row_step_triton import row_step_triton

POISON = 12345.0


def rel_err(actual, expected):
    actual, expected = actual.double(), expected.double()
    return ((actual - expected).norm() / expected.norm().clamp_min(1e-300)).item()


def random_problem(tokens, vocab_student, vocab_teacher, hidden_teacher, dtype, bias, ignore_every, device="cuda"):
    hidden_student = hidden_teacher // 2
    labels = torch.randint(0, vocab_student, (tokens,), device=device)
    if ignore_every:
        labels[::ignore_every] = -100
    scale = lambda h: 2 / h**0.5  # noqa: E731  (logits of a few units, like a trained head)
    student_input = torch.randn(tokens, hidden_student, device=device, dtype=dtype, requires_grad=True)
    student_weight = (torch.randn(vocab_student, hidden_student, device=device) * scale(hidden_student)).to(dtype).requires_grad_()
    teacher_input = torch.randn(tokens, hidden_teacher, device=device, dtype=dtype)
    teacher_weight = (torch.randn(vocab_teacher, hidden_teacher, device=device) * scale(hidden_teacher)).to(dtype)
    student_bias = torch.randn(vocab_student, device=device, dtype=dtype, requires_grad=True) if bias else None
    teacher_bias = torch.randn(vocab_teacher, device=device, dtype=dtype) if bias else None
    return [student_input, student_weight, teacher_input, teacher_weight, labels, student_bias, teacher_bias]


def float64_reference(args):
    upcast = [None if t is None else t.detach().double().requires_grad_(t.requires_grad) for t in args]
    losses = naive_cosine_distill(*upcast)
    losses[0].backward()
    grads = [upcast[i].grad for i in (0, 1, 5) if upcast[i] is not None]
    return [x.detach() for x in losses], grads


def fused_run(args, **kwargs):
    for i in (0, 1, 5):
        if args[i] is not None:
            args[i].grad = None
    losses = fused_linear_cosine_distill(*args, return_soft_hard_loss=True, **kwargs)
    losses[0].backward()
    return list(losses), [args[i].grad for i in (0, 1, 5) if args[i] is not None]


def check_row_step():
    failures = []
    for rows, vocab_student, vocab_teacher, dtype in [
        (37, 128256, 128256, torch.bfloat16), (37, 128256, 128320, torch.bfloat16),
        (5, 32001, 32001, torch.float32), (9, 151936, 152064, torch.float16), (3, 1, 1, torch.float32),
        (3, 1, 2, torch.float32), (3, 2, 2, torch.float32), (4, 2, 3, torch.float32), (4, 17, 17, torch.bfloat16), (4, 1000, 1000, torch.float32),
    ]:
        student = (torch.randn(rows, vocab_student, device="cuda") * 3).to(dtype)
        teacher = (torch.randn(rows, vocab_teacher, device="cuda") * 3).to(dtype)
        labels = torch.randint(0, vocab_student, (rows,), device="cuda")
        labels[::4] = -100
        scales = RowStepScales(0.37, 0.81, 0.6, 1.7, -100)
        want_grad, want_losses = student.clone(), torch.full((rows, 2), POISON, device="cuda")
        row_step_torch(want_grad, teacher, labels, scales, want_losses, True)
        got_grad, got_losses = student.clone(), torch.full((rows, 2), POISON, device="cuda")
        row_step_triton(got_grad, teacher, labels, scales, got_losses, True)
        loss_err = rel_err(got_losses, want_losses)
        if vocab_student == 1:
            # The exact gradient is 0 (p = 1 and |cos| = 1): both sides hold only rounding noise, so
            # check that the noise is small in absolute terms instead of relative to noise.
            grad_err = got_grad.float().abs().max().item()
            loss_err = (got_losses - want_losses).abs().max().item()
        else:
            grad_err = rel_err(got_grad.float(), want_grad.float())
        ok = loss_err < 1e-5 and grad_err < (1e-5 if dtype == torch.float32 else 1e-2) and not (got_losses == POISON).any()
        print(f"row step rows={rows} Vs={vocab_student} Vt={vocab_teacher} {dtype}: err loss {loss_err:.2e} grad {grad_err:.2e} {'ok' if ok else 'FAIL'}")
        if not ok:
            failures.append(("row_step", rows, vocab_student, vocab_teacher, str(dtype)))
    return failures


def check_loss():
    failures = []
    for tokens, vocab_student, vocab_teacher, hidden, dtype, bias, chunk in [
        (300, 32011, 32011, 256, torch.float32, True, 128),
        (300, 32011, 32100, 256, torch.bfloat16, False, 100),
        (1000, 128256, 128256, 512, torch.bfloat16, False, None),
        (257, 5003, 5003, 128, torch.float16, True, 64),
    ]:
        args = random_problem(tokens, vocab_student, vocab_teacher, hidden, dtype, bias, ignore_every=7)
        ref_losses, ref_grads = float64_reference(args)
        for impl in ("triton", "torch"):
            losses, grads = fused_run(args, impl=impl, chunk_size=chunk)
            loss_errs = [rel_err(a, b) for a, b in zip(losses, ref_losses)]
            grad_errs = [rel_err(a, b) for a, b in zip(grads, ref_grads)]
            tol_loss, tol_grad = (1e-5, 1e-4) if dtype == torch.float32 else (5e-3, 2e-2)
            ok = max(loss_errs) < tol_loss and max(grad_errs) < tol_grad
            print(f"loss {impl} T={tokens} Vs={vocab_student} Vt={vocab_teacher} H={hidden} {dtype} bias={bias}: "
                  f"loss errs {[f'{e:.1e}' for e in loss_errs]} grad errs {[f'{e:.1e}' for e in grad_errs]} {'ok' if ok else 'FAIL'}")
            if not ok:
                failures.append(("loss", impl, tokens, vocab_student, str(dtype)))
    return failures


def check_fp8():
    """The FP8 teacher path against float64 fed the dequantized teacher: only rounding may differ."""
    failures = []
    for tokens, vocab_student, vocab_teacher, hidden, chunk in [(300, 32011, 32011, 256, 128), (1000, 128256, 128320, 512, None)]:
        args = random_problem(tokens, vocab_student, vocab_teacher, hidden, torch.bfloat16, bias=True, ignore_every=7)
        quantized = list(args)
        quantized[2], quantized[3] = fp8.dequantized(args[2]), fp8.dequantized(args[3])
        ref_losses, ref_grads = float64_reference(quantized)
        losses, grads = fused_run(args, chunk_size=chunk, teacher_precision="fp8")
        loss_errs = [rel_err(a, b) for a, b in zip(losses, ref_losses)]
        grad_errs = [rel_err(a, b) for a, b in zip(grads, ref_grads)]
        ok = max(loss_errs) < 5e-3 and max(grad_errs) < 2e-2
        print(f"fp8 T={tokens} Vs={vocab_student} Vt={vocab_teacher} H={hidden}: loss errs {[f'{e:.1e}' for e in loss_errs]} "
              f"grad errs {[f'{e:.1e}' for e in grad_errs]} {'ok' if ok else 'FAIL'}")
        if not ok:
            failures.append(("fp8", tokens, vocab_student, vocab_teacher))
    return failures


def seed_accum_study(tokens):
    """Error vs float64 and peak memory above the inputs for each accum_dtype at the seed workload."""
    args = random_problem(tokens, 128256, 128256, 4096, torch.bfloat16, bias=False, ignore_every=0)
    ref_losses, ref_grads = float64_reference(args)
    rows = []
    for accum_dtype in (torch.bfloat16, torch.float32):
        for chunk in (None, 1024, 2048):
            fused_run(args, accum_dtype=accum_dtype, chunk_size=chunk)  # warm-up
            for i in (0, 1):
                args[i].grad = None
            torch.cuda.synchronize()
            torch.cuda.empty_cache()
            torch.cuda.reset_peak_memory_stats()
            base = torch.cuda.memory_allocated()
            losses, grads = fused_run(args, accum_dtype=accum_dtype, chunk_size=chunk)
            torch.cuda.synchronize()
            peak = (torch.cuda.max_memory_allocated() - base) / 1e9
            row = dict(tokens=tokens, accum_dtype=str(accum_dtype), chunk_size=chunk, peak_gb_above_inputs=round(peak, 3),
                       loss_err=rel_err(losses[0], ref_losses[0]), grad_input_err=rel_err(grads[0], ref_grads[0]),
                       grad_weight_err=rel_err(grads[1], ref_grads[1]))
            print("seed accum study", row)
            rows.append(row)
    return rows


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--seed-tokens", type=int, default=8192)
    parser.add_argument("--json")
    args = parser.parse_args()
    print(torch.__version__, torch.cuda.get_device_name())
    failures = check_row_step() + check_loss() + check_fp8()
    study = seed_accum_study(args.seed_tokens)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(dict(failures=failures, accum_study=study), f, indent=1)
    print("GPU CHECK", "FAILED " + str(failures) if failures else "PASSED")
    raise SystemExit(1 if failures else 0)


if __name__ == "__main__":
    main()
